//! Requests to send and when: from a trace or synthetic.

use kvroute_sim::trace::TraceRequest;
use rand_core::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct BenchRequest {
    /// Send time, from the start of the run (wall clock, after rate scaling).
    pub at: Duration,
    /// Prompt text (sent as one user message for chat, as `prompt` for completions).
    pub prompt: Arc<str>,
    /// `max_tokens` of the request (≥ 1).
    pub max_tokens: u32,
    /// Session (conversation) id, sent as `user`; `None` for single-shot requests.
    pub session: Option<String>,
}

/// Characters per token of synthesised text (`kvroute_core::types::CHARS_PER_TOKEN`, the
/// estimate the approximate router and engine-sim use).
pub const CHARS_PER_TOKEN: usize = kvroute_core::types::CHARS_PER_TOKEN;

const WORDS: [&str; 24] = [
    "alpha ", "beta ", "gamma ", "delta ", "kv ", "cache ", "prefix ", "token ", "model ", "router ", "worker ",
    "queue ", "batch ", "decode ", "prefill ", "block ", "hash ", "tree ", "load ", "score ", "session ", "turn ",
    "reply ", "prompt ",
];

/// Appends exactly `chars` characters of deterministic text derived from `id`: words
/// chosen by a stable hash of `(id, word index)`. Same id → same text, on every machine.
pub fn synth_text(id: u64, chars: usize, out: &mut String) {
    let start = out.len();
    let mut i = 0u64;
    while out.len() - start < chars {
        let h = kvroute_core::hash::stable_hash(&[id.to_le_bytes(), i.to_le_bytes()].concat());
        out.push_str(WORDS[(h % WORDS.len() as u64) as usize]);
        i += 1;
    }
    out.truncate(start + chars);
}

/// The prompt of a trace request: each block id becomes `block_tokens × 4` characters of
/// [`synth_text`], cut to `input_tokens × 4` characters. Requests sharing leading block ids
/// share a text prefix, so engines' prefix caches see exactly the trace's reuse. A request
/// without block ids (Azure traces) gets text unique to `fallback_id`.
pub fn synth_prompt(r: &TraceRequest, fallback_id: u64) -> String {
    let chars = r.input_tokens as usize * CHARS_PER_TOKEN;
    let mut s = String::with_capacity(chars);
    let block_chars = r.block_tokens.max(1) as usize * CHARS_PER_TOKEN;
    for b in &r.blocks {
        if s.len() >= chars {
            break;
        }
        synth_text(b.0, block_chars, &mut s);
    }
    if s.len() < chars {
        // Past the last block (or no blocks at all): text of this request alone.
        synth_text(0x5eed_0000_0000_0000 ^ fallback_id, chars - s.len(), &mut s);
    }
    s.truncate(chars);
    s
}

/// Most requests a synthetic workload may hold (`--requests`, `--groups ×
/// --prompts-per-group`): every request and its prompt are built before the run starts, so
/// an unbounded count aborted on the allocation.
pub const MAX_REQUESTS: usize = 10_000_000;

/// Most prompt text a synthetic workload builds, bytes: every request's prompt is built
/// before the run starts (2 GiB).
pub const MAX_PROMPT_BYTES: u64 = 2 << 30;

/// Checks that `n` prompts of `tokens` tokens each ([`CHARS_PER_TOKEN`] bytes a token) fit
/// in [`MAX_PROMPT_BYTES`].
///
/// # Errors
/// A message with the total, for the caller to prefix with the flags that set it.
pub fn check_prompt_bytes(n: usize, tokens: u64) -> Result<(), String> {
    let bytes = (n as u64).checked_mul(tokens).and_then(|t| t.checked_mul(CHARS_PER_TOKEN as u64));
    match bytes {
        Some(b) if b <= MAX_PROMPT_BYTES => Ok(()),
        _ => Err(format!(
            "{n} prompts of {tokens} tokens are more than the {MAX_PROMPT_BYTES} bytes of prompt text a synthetic \
             workload builds before it starts; send fewer or shorter requests (--duration ends a run early)"
        )),
    }
}

/// Checks `--max-output`, the cap on a request's output tokens, the same in `replay`,
/// `advise`, `bench` and `demo`: at least 1 (0 ran with every request capped at one token).
///
/// # Errors
/// The whole message, naming the flag.
pub fn check_max_output(cap: u32) -> Result<(), String> {
    if cap == 0 { Err("--max-output must be at least 1".into()) } else { Ok(()) }
}

/// Smallest and largest synthetic arrival rate accepted (`--rate`), requests per second.
pub const RATE_RANGE: (f64, f64) = (1e-6, 1e6);

/// Checks a synthetic arrival rate (requests per second): finite, within [`RATE_RANGE`],
/// and sending `n` requests within [`kvroute_sim::trace::MAX_ARRIVAL_SECS`] (10^7 s).
///
/// # Errors
/// What is wrong, for the caller to prefix with its flag's name.
pub fn check_rate(rate: f64, n: usize) -> Result<(), String> {
    let (lo, hi) = RATE_RANGE;
    if !(rate.is_finite() && (lo..=hi).contains(&rate)) {
        return Err(format!("{rate:e} must be between {lo:e} and {hi:e} requests per second"));
    }
    let span = n as f64 / rate;
    if span > kvroute_sim::trace::MAX_ARRIVAL_SECS {
        return Err(format!("{n} requests at {rate}/s take {span:.3e} s, more than the maximum 10^7 s"));
    }
    Ok(())
}

/// A send time of `secs` seconds; past [`Duration::MAX`] (unreachable with checked flags,
/// e.g. a rate scale under 10^-9 on a long trace) it saturates rather than panic.
fn send_time(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// A trace as a workload: arrivals divided by `rate_scale` (2 = twice as fast), the first
/// request at 0, `max_tokens` capped at `max_output`. Check `rate_scale` with
/// [`kvroute_sim::trace::check_rate_scale`] first: a send time past the limit saturates.
pub fn from_trace(trace: &[TraceRequest], rate_scale: f64, max_output: u32) -> Vec<BenchRequest> {
    let base = trace.first().map_or(0, |r| r.arrival.0);
    let scale = if rate_scale.is_finite() && rate_scale > 0.0 { rate_scale } else { 1.0 };
    trace
        .iter()
        .enumerate()
        .map(|(i, r)| BenchRequest {
            at: send_time(r.arrival.0.saturating_sub(base) as f64 / 1e9 / scale),
            prompt: synth_prompt(r, i as u64).into(),
            max_tokens: r.output_tokens.clamp(1, max_output.max(1)),
            session: r.session.clone(),
        })
        .collect()
}

/// Arrival process of a synthetic workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Exponential gaps with mean `1 / rate` (rate in requests per second).
    Poisson(f64),
    /// Fixed gaps of `1 / rate`.
    Constant(f64),
}

impl Arrivals {
    fn times(self, n: usize, seed: u64) -> Vec<Duration> {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut t = 0.0f64;
        (0..n)
            .map(|i| {
                let at = t;
                t += match self {
                    Arrivals::Poisson(rate) => {
                        // Uniform in (0, 1]: 53 random bits.
                        let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                        -u.ln() / rate
                    }
                    Arrivals::Constant(rate) => 1.0 / rate,
                };
                let _ = i;
                send_time(at)
            })
            .collect()
    }
}

/// Independent requests of `input_tokens` unique tokens each (no shared prefix).
pub fn independent(
    n: usize,
    arrivals: Arrivals,
    input_tokens: u32,
    output_tokens: u32,
    seed: u64,
) -> Vec<BenchRequest> {
    arrivals
        .times(n, seed)
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let mut s = String::new();
            synth_text(seed.rotate_left(17) ^ (i as u64), input_tokens as usize * CHARS_PER_TOKEN, &mut s);
            BenchRequest { at, prompt: s.into(), max_tokens: output_tokens.max(1), session: None }
        })
        .collect()
}

/// llm-d's shared-prefix shape: `groups` system prompts of `system_tokens` each, every group
/// asked `prompts_per_group` questions of `question_tokens` (prompt = system prompt +
/// question). Requests are interleaved across groups in a seeded random order, so a router
/// sees every group's prefix again and again while other groups' traffic is in flight.
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    /// Number of distinct system prompts.
    pub groups: usize,
    /// Questions per group.
    pub prompts_per_group: usize,
    /// Tokens of each system prompt.
    pub system_tokens: u32,
    /// Tokens of each question.
    pub question_tokens: u32,
    /// `max_tokens` of every request.
    pub output_tokens: u32,
}

/// The requests of a [`SharedPrefix`] workload, sent by `arrivals`.
pub fn shared_prefix(shape: SharedPrefix, arrivals: Arrivals, seed: u64) -> Vec<BenchRequest> {
    let n = shape.groups * shape.prompts_per_group;
    let mut order: Vec<(usize, usize)> =
        (0..shape.groups).flat_map(|g| (0..shape.prompts_per_group).map(move |q| (g, q))).collect();
    // Fisher–Yates with the seeded generator.
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5a5a);
    for i in (1..order.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let systems: Vec<String> = (0..shape.groups)
        .map(|g| {
            let mut s = String::new();
            synth_text(seed ^ (0x1000_0000 + g as u64), shape.system_tokens as usize * CHARS_PER_TOKEN, &mut s);
            s
        })
        .collect();
    arrivals
        .times(n, seed)
        .into_iter()
        .zip(order)
        .map(|(at, (g, q))| {
            let mut s = systems[g].clone();
            synth_text(
                seed ^ (0x2000_0000 + ((g as u64) << 20) + q as u64),
                shape.question_tokens as usize * CHARS_PER_TOKEN,
                &mut s,
            );
            BenchRequest {
                at,
                prompt: s.into(),
                max_tokens: shape.output_tokens.max(1),
                session: Some(format!("group-{g}")),
            }
        })
        .collect()
}

/// A multi-turn conversation: its user turns are sent one after another, each turn's
/// messages carrying every earlier turn and the model's own answer to it, so turn k's prompt
/// extends turn k−1's prompt (the prefix a worker's KV cache can serve).
#[derive(Debug, Clone)]
pub struct Conversation {
    /// When the first turn is sent, from the start of the run.
    pub at: Duration,
    /// System message, when the conversation has one.
    pub system: Option<Arc<str>>,
    /// The user messages, in order.
    pub turns: Vec<Arc<str>>,
    /// `max_tokens` of every turn (≥ 1).
    pub max_tokens: u32,
}

/// The first `n` (all when `n` is 0) MT-bench questions of `text` (`mtbench_question.jsonl`:
/// one JSON object per line with a `turns` array of user messages, as published by
/// FastChat's LLM-judge) as two-turn conversations started by `arrivals`.
///
/// # Errors
/// A message naming the line and field for a malformed line; no conversations.
pub fn mtbench(
    text: &str,
    n: usize,
    arrivals: Arrivals,
    max_tokens: u32,
    seed: u64,
) -> Result<Vec<Conversation>, String> {
    let mut turns_of = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if n > 0 && turns_of.len() == n {
            break;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: not valid JSON: {e}", i + 1))?;
        let turns = v
            .get("turns")
            .and_then(serde_json::Value::as_array)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| format!("line {}: field `turns` must be a non-empty array of strings", i + 1))?;
        let turns: Vec<Arc<str>> = turns
            .iter()
            .map(|t| t.as_str().map(Arc::from))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("line {}: field `turns` must hold strings", i + 1))?;
        turns_of.push(turns);
    }
    if turns_of.is_empty() {
        return Err("no conversations".into());
    }
    let times = arrivals.times(turns_of.len(), seed);
    Ok(turns_of
        .into_iter()
        .zip(times)
        .map(|(turns, at)| Conversation { at, system: None, turns, max_tokens: max_tokens.max(1) })
        .collect())
}

/// Gives conversation `i` a system message holding reference document `i % documents`
/// (`documents` 0: one per conversation) of `tokens × 4` characters of [`synth_text`], as in
/// workload (b) of docs/real-engines.md, the peers' measurement on llama.cpp (a ~300-token
/// document per conversation). Fewer documents than conversations share prefixes across
/// conversations. With `hot_share` > 0 that share of the conversations (spread evenly:
/// conversation `i` when `floor((i + 1) × hot_share) > floor(i × hot_share)`) takes document
/// 0 instead, and the others take documents 1.. in turn: one hot document.
pub fn attach_documents(convs: &mut [Conversation], tokens: u32, documents: usize, hot_share: f64, seed: u64) {
    let hot_share = if hot_share.is_finite() { hot_share.clamp(0.0, 1.0) } else { 0.0 };
    let mut cold = 0usize;
    for (i, c) in convs.iter_mut().enumerate() {
        let hot = hot_share > 0.0 && ((i + 1) as f64 * hot_share).floor() > (i as f64 * hot_share).floor();
        let d = if hot {
            0
        } else if hot_share > 0.0 && documents > 1 {
            cold += 1;
            1 + (cold - 1) % (documents - 1)
        } else if documents == 0 {
            i
        } else {
            i % documents
        };
        let mut s = format!("Reference document {d}. ");
        synth_text(seed ^ (0x3000_0000 + d as u64), tokens as usize * CHARS_PER_TOKEN, &mut s);
        c.system = Some(s.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::types::{BlockHash, Nanos};

    fn req(at_ms: u64, input: u32, blocks: &[u64]) -> TraceRequest {
        TraceRequest {
            tenant: None,
            arrival: Nanos(at_ms * 1_000_000),
            input_tokens: input,
            output_tokens: 10,
            blocks: blocks.iter().map(|&b| BlockHash(b)).collect(),
            block_tokens: 512,
            session: None,
            turn: 0,
        }
    }

    #[test]
    fn shared_block_ids_mean_shared_text() {
        let a = synth_prompt(&req(0, 1024, &[7, 8]), 0);
        let b = synth_prompt(&req(0, 1200, &[7, 8, 9]), 1);
        let c = synth_prompt(&req(0, 1024, &[6, 8]), 2);
        assert_eq!(a.len(), 1024 * 4);
        assert_eq!(b.len(), 1200 * 4);
        assert!(b.starts_with(&a), "same blocks, same text");
        assert_ne!(a[..2048], c[..2048], "other first block, other text");
        // A partial last block and no blocks at all still give the requested length.
        assert_eq!(synth_prompt(&req(0, 700, &[7, 8]), 3).len(), 2800);
        let u1 = synth_prompt(&req(0, 100, &[]), 4);
        let u2 = synth_prompt(&req(0, 100, &[]), 5);
        assert_eq!(u1.len(), 400);
        assert_ne!(u1, u2);
    }

    #[test]
    fn trace_times_are_scaled_from_the_first_arrival() {
        let t = [req(1000, 10, &[1]), req(3000, 10, &[1]), req(5000, 10, &[2])];
        let w = from_trace(&t, 2.0, 4);
        assert_eq!(w.iter().map(|r| r.at).collect::<Vec<_>>(), [0, 1000, 2000].map(Duration::from_millis));
        assert!(w.iter().all(|r| r.max_tokens == 4));
    }

    #[test]
    fn arrivals_have_the_asked_rate_and_are_seeded() {
        let p = Arrivals::Poisson(50.0).times(20_000, 1);
        let last = p.last().copied().unwrap_or_default().as_secs_f64();
        assert!((last - 400.0).abs() < 20.0, "20k arrivals at 50/s span about 400 s, got {last}");
        assert_eq!(p, Arrivals::Poisson(50.0).times(20_000, 1));
        assert_ne!(p, Arrivals::Poisson(50.0).times(20_000, 2));
        let c = Arrivals::Constant(4.0).times(3, 0);
        assert_eq!(c, [0, 250, 500].map(Duration::from_millis));
    }

    #[test]
    fn rates_and_scales_past_the_clock_saturate_and_are_refused() {
        // `Duration::from_secs_f64` panicked on these (exit 101).
        let c = Arrivals::Constant(1e-300).times(2, 0);
        assert_eq!(c, [Duration::ZERO, Duration::MAX]);
        let t = [req(0, 10, &[1]), req(1000, 10, &[1])];
        assert_eq!(from_trace(&t, 1e-300, 4)[1].at, Duration::MAX);
        for rate in [1e-300, 0.0, f64::NAN, f64::INFINITY, 1e300] {
            assert!(check_rate(rate, 2).unwrap_err().contains("must be between"), "{rate}");
        }
        assert!(check_rate(1e-6, 200).unwrap_err().contains("10^7 s"));
        assert!(check_rate(10.0, 200).is_ok());
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let shape =
            SharedPrefix { groups: 3, prompts_per_group: 4, system_tokens: 100, question_tokens: 10, output_tokens: 5 };
        let w = shared_prefix(shape, Arrivals::Constant(10.0), 9);
        assert_eq!(w.len(), 12);
        for r in &w {
            assert_eq!(r.prompt.len(), 440);
            let same_group: Vec<_> = w.iter().filter(|o| o.session == r.session).collect();
            assert_eq!(same_group.len(), 4);
            assert!(same_group.iter().all(|o| o.prompt[..400] == r.prompt[..400]));
        }
        let distinct: std::collections::HashSet<&str> = w.iter().map(|r| &r.prompt[..400]).collect();
        assert_eq!(distinct.len(), 3);
        let questions: std::collections::HashSet<&str> = w.iter().map(|r| &r.prompt[400..]).collect();
        assert_eq!(questions.len(), 12);
    }

    #[test]
    fn mtbench_reads_conversations_and_names_bad_lines() {
        let text = "{\"question_id\": 81, \"turns\": [\"a\", \"b\"]}\n\n{\"turns\": [\"c\"]}\n";
        let c = mtbench(text, 0, Arrivals::Constant(2.0), 0, 1).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].turns.len(), &*c[0].turns[1], c[0].max_tokens), (2, "b", 1));
        assert_eq!((c[1].at, c[1].system.is_none()), (Duration::from_millis(500), true));
        assert_eq!(mtbench(text, 1, Arrivals::Constant(1.0), 8, 1).unwrap().len(), 1);
        assert_eq!(
            mtbench("{\"turns\": 3}", 0, Arrivals::Constant(1.0), 8, 1).unwrap_err(),
            "line 1: field `turns` must be a non-empty array of strings"
        );
        assert!(
            mtbench("\n{oops", 0, Arrivals::Constant(1.0), 8, 1).unwrap_err().starts_with("line 2: not valid JSON")
        );
        assert_eq!(
            mtbench("{\"turns\": [1]}", 0, Arrivals::Constant(1.0), 8, 1).unwrap_err(),
            "line 1: field `turns` must hold strings"
        );
        assert_eq!(mtbench("", 0, Arrivals::Constant(1.0), 8, 1).unwrap_err(), "no conversations");
        let mut c = mtbench("{\"turns\": [\"a\"]}\n".repeat(3).as_str(), 0, Arrivals::Constant(1.0), 8, 1).unwrap();
        attach_documents(&mut c, 100, 2, 0.0, 7);
        let sys: Vec<&str> = c.iter().map(|c| c.system.as_deref().unwrap()).collect();
        assert_eq!((sys[0] == sys[2], sys[0] == sys[1]), (true, false), "document i % 2");
        assert!(sys[0].starts_with("Reference document 0. ") && sys[0].len() == 22 + 400);
        // A hot document: half the conversations on document 0, the rest on 1, 2, 1, 2, ...
        let mut c = mtbench("{\"turns\": [\"a\"]}\n".repeat(8).as_str(), 0, Arrivals::Constant(1.0), 8, 1).unwrap();
        attach_documents(&mut c, 10, 3, 0.5, 7);
        let doc = |c: &Conversation| c.system.as_deref().unwrap()[..21].to_string();
        let docs: Vec<String> = c.iter().map(doc).collect();
        let hot = docs.iter().filter(|d| d.starts_with("Reference document 0.")).count();
        assert_eq!(hot, 4, "{docs:?}");
        assert!(docs.iter().any(|d| d.starts_with("Reference document 1.")));
        assert!(docs.iter().any(|d| d.starts_with("Reference document 2.")));
    }
}
