//! `kvroute bench decision`: decision time per policy from the release binary, no Criterion
//! build needed. The same measurement as `cargo bench -p kvroute-core --bench decision`:
//! each policy's index warmed by the whole Mooncake conversation trace (`data/traces`, or
//! `--trace`) on N workers of uneven load, then a probe request (`--prompt-tokens` long, in
//! 512-token Mooncake blocks, the first shared with the trace's system prompt, with as much
//! text) decided `--decisions` times, each call timed on its own (key, pick and fallbacks;
//! nothing committed).

use anyhow::{Context, bail};
use kvroute_core::policy::{PickCtx, Policy, decide, route};
use kvroute_core::registry;
use kvroute_core::types::{BlockHash, BlockSeq, Nanos, RequestView, Role, WorkerId, WorkerView};
use rand_core::SeedableRng;
use std::hint::black_box;
use std::time::Instant;

/// Longest probe, tokens (its text is 4 bytes a token).
const MAX_PROMPT_TOKENS: u32 = 1 << 20;
/// Most decisions timed per policy and fleet size.
const MAX_DECISIONS: usize = 10_000_000;

/// Tokens per Mooncake block.
const BLOCK_TOKENS: u32 = 512;

/// Flags of `kvroute bench decision`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Fleet sizes, comma separated.
    #[arg(long, default_value = "8,256,1024")]
    pub workers: String,
    /// Policies, comma separated, or `all`.
    #[arg(long, default_value = "all")]
    pub policy: String,
    /// Prompt tokens of the probe request.
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: u32,
    /// Decisions timed per policy and fleet size.
    #[arg(long, default_value_t = 20_000)]
    pub decisions: usize,
    /// Trace that warms the index (Mooncake JSONL).
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// Print one JSON object per line instead of the table: `policy`, `workers`, `p50_ns`,
    /// `p99_ns`, `p999_ns`, `max_ns`, `index_size`.
    #[arg(long)]
    pub json: bool,
}

struct TraceReq {
    input: u32,
    blocks: Vec<BlockHash>,
}

fn read_trace(path: &std::path::Path) -> anyhow::Result<Vec<TraceReq>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--trace {}", path.display()))?;
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(l).with_context(|| format!("--trace {} line {}", path.display(), i + 1))?;
        let Some(ids) = v["hash_ids"].as_array() else {
            bail!("--trace {} line {}: no `hash_ids` array", path.display(), i + 1);
        };
        out.push(TraceReq {
            input: v["input_length"].as_u64().unwrap_or(0).min(u64::from(u32::MAX)) as u32,
            blocks: ids.iter().filter_map(serde_json::Value::as_u64).map(BlockHash).collect(),
        });
    }
    if out.is_empty() {
        bail!("--trace {}: no requests", path.display());
    }
    Ok(out)
}

/// `n` workers of uneven load (as the Criterion bench's).
fn fleet(n: usize) -> Vec<WorkerView> {
    (0..n)
        .map(|i| {
            let mut w = WorkerView::idle(WorkerId(i as u32));
            w.in_flight = (i % 7) as u32;
            w.pending_prefill_tokens = (i as u64 % 5) * 1000;
            w
        })
        .collect()
}

fn view<'a>(r: &'a TraceReq, text: Option<&'a str>) -> RequestView<'a> {
    RequestView {
        model: "m",
        text,
        token_ids: None,
        blocks: Some(BlockSeq { block_tokens: BLOCK_TOKENS, hashes: &r.blocks }),
        input_tokens: r.input,
        output_tokens: Some(256),
        session_id: None,
        role: Role::Both,
    }
}

fn warmed(name: &str, trace: &[TraceReq], c: &[WorkerView]) -> anyhow::Result<Box<dyn Policy>> {
    let mut p = registry::build(name, &serde_json::Value::Null).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    for (i, r) in trace.iter().enumerate() {
        let mut ctx = PickCtx { now: Nanos::from_millis(i as u64), rng: &mut rng };
        let _ = route(p.as_mut(), &view(r, None), c, &mut ctx);
    }
    Ok(p)
}

/// The probe: `tokens` long, its first block the trace's most common first block, the
/// rest new; about 4 characters of text a token.
fn probe(trace: &[TraceReq], tokens: u32) -> (TraceReq, String) {
    let n = tokens.div_ceil(BLOCK_TOKENS).max(1) as usize;
    let first = trace.iter().find_map(|r| r.blocks.first().copied()).unwrap_or(BlockHash(1));
    let blocks: Vec<BlockHash> = std::iter::once(first).chain((1..n).map(|i| BlockHash(u64::MAX - i as u64))).collect();
    let chars = tokens as usize * 4;
    let text = "You are a helpful assistant. Answer the question using the documents. ".repeat(chars / 70 + 1);
    (TraceReq { input: tokens, blocks }, text[..chars].to_string())
}

/// Runs `kvroute bench decision`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let sizes: Vec<usize> = a
        .workers
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|n| (1..=65_536).contains(n)))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow::anyhow!("--workers: expected sizes from 1 to 65536, comma separated"))?;
    let names: Vec<String> = if a.policy == "all" {
        registry::names().iter().map(|s| (*s).to_string()).collect()
    } else {
        a.policy.split(',').map(|s| s.trim().to_string()).collect()
    };
    for n in &names {
        if !registry::names().contains(&n.as_str()) {
            bail!("--policy: unknown policy `{n}`; known: all, {}", registry::names().join(", "));
        }
    }
    if !(1..=MAX_PROMPT_TOKENS).contains(&a.prompt_tokens) {
        bail!("--prompt-tokens: from 1 to {MAX_PROMPT_TOKENS}");
    }
    if !(1..=MAX_DECISIONS).contains(&a.decisions) {
        bail!("--decisions: from 1 to {MAX_DECISIONS}");
    }
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_trace.jsonl");
    let trace = read_trace(a.trace.as_deref().unwrap_or(std::path::Path::new(default)))?;
    let (pr, text) = probe(&trace, a.prompt_tokens);
    if !a.json {
        println!("workers policy              p50_ns    p99_ns  p99.9_ns    max_ns  index_size");
    }
    for &n in &sizes {
        let c = fleet(n);
        for name in &names {
            let p = warmed(name, &trace, &c)?;
            let req = view(&pr, Some(&text));
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
            let mut h = hdrhistogram::Histogram::<u64>::new(3).context("histogram")?;
            for _ in 0..a.decisions {
                let mut ctx = PickCtx { now: Nanos::from_secs(4000), rng: &mut rng };
                let t = Instant::now();
                let _ = black_box(decide(p.as_ref(), black_box(&req), &c, &mut ctx));
                let _ = h.record(t.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
            }
            let (p50, p99, p999, max) =
                (h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.value_at_quantile(0.999), h.max());
            if a.json {
                let o = serde_json::json!({"policy": name, "workers": n, "p50_ns": p50, "p99_ns": p99,
                    "p999_ns": p999, "max_ns": max, "index_size": p.index_size(), "prompt_tokens": a.prompt_tokens});
                println!("{o}");
            } else {
                println!("{n:>7} {name:<16} {p50:>9} {p99:>9} {p999:>9} {max:>9} {:>11}", p.index_size());
            }
        }
    }
    Ok(())
}
