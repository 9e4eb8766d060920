//! The decision benchmark's fixture, shared by `cargo bench -p kvroute-core --bench decision`
//! and `kvroute bench decision`: a trace's requests as block hashes, a fleet of uneven load,
//! a policy warmed with the whole trace, and the probe request that is timed. Pure: the
//! caller reads the trace file.

use crate::policy::{PickCtx, Policy, route};
use crate::registry;
use crate::types::{BlockHash, BlockSeq, Nanos, RequestView, Role, WorkerId, WorkerView};
use rand_core::SeedableRng;

/// Tokens per Mooncake block.
pub const BLOCK_TOKENS: u32 = 512;

/// The probe's text, repeated: about 4 characters a token.
const PROBE_TEXT: &str = "You are a helpful assistant. Answer the question using the documents. ";

/// One trace request: its prompt tokens and block hashes.
#[derive(Debug, Clone)]
pub struct TraceReq {
    /// Prompt tokens.
    pub input: u32,
    /// Its blocks' hashes (Mooncake `hash_ids`).
    pub blocks: Vec<BlockHash>,
}

/// The requests of a Mooncake JSONL trace (`input_length`, `hash_ids`).
///
/// # Errors
/// The 1-based line number and what is wrong with it.
pub fn parse_mooncake(text: &str) -> Result<Vec<TraceReq>, String> {
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1))?;
        let Some(ids) = v["hash_ids"].as_array() else { return Err(format!("line {}: no `hash_ids` array", i + 1)) };
        out.push(TraceReq {
            input: v["input_length"].as_u64().unwrap_or(0).min(u64::from(u32::MAX)) as u32,
            blocks: ids.iter().filter_map(serde_json::Value::as_u64).map(BlockHash).collect(),
        });
    }
    Ok(out)
}

/// `n` workers of uneven load: `i % 7` requests in flight, `(i % 5) × 1000` tokens to
/// prefill; each named by a stable key ([`WorkerView::tie_key`]), as the gateway names every
/// worker by its URL, so consistent_hash and kv_score hash what they hash in `kvroute serve`.
pub fn fleet(n: usize) -> Vec<WorkerView> {
    fleet_loaded(n, 7)
}

/// [`fleet`] with `i % spread` requests in flight on worker `i` (of the 256 a worker takes):
/// 7 is the bench's light fleet, where every worker is within kv_score's tie band of the
/// least loaded; ~100 a busy one, where loads spread past it. A `spread` of 0 reads as 1.
pub fn fleet_loaded(n: usize, spread: u32) -> Vec<WorkerView> {
    let spread = spread.max(1) as usize;
    (0..n)
        .map(|i| {
            let mut w = WorkerView::idle(WorkerId(i as u32));
            w.in_flight = (i % spread) as u32;
            w.pending_prefill_tokens = (i as u64 % 5) * 1000;
            w.tie_key = Some(crate::hash::stable_hash(format!("http://worker-{i}:8000").as_bytes()));
            w
        })
        .collect()
}

/// The routing view of `r`, with `text` when given.
pub fn view<'a>(r: &'a TraceReq, text: Option<&'a str>) -> RequestView<'a> {
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

/// Policy `name` with its default knobs, warmed by routing (and committing) every request of
/// `trace` over `c`, one a millisecond.
///
/// # Errors
/// An unknown policy name.
pub fn warmed(name: &str, trace: &[TraceReq], c: &[WorkerView]) -> Result<Box<dyn Policy>, String> {
    let mut p = registry::build(name, &serde_json::Value::Null).map_err(|e| e.to_string())?;
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    for (i, r) in trace.iter().enumerate() {
        let mut ctx = PickCtx { now: Nanos::from_millis(i as u64), rng: &mut rng, fleet: None };
        let _ = route(p.as_mut(), &view(r, None), c, &mut ctx);
    }
    Ok(p)
}

/// The probe: `tokens` long (`tokens / 512` blocks, at least one), the blocks of the first
/// trace request that has as many (the first shared with the trace's system prompt) with
/// its last block new, and 4 characters of text a token. 4,096 tokens: 8 blocks, 16,384
/// characters.
pub fn probe(trace: &[TraceReq], tokens: u32) -> (TraceReq, String) {
    let n = (tokens / BLOCK_TOKENS).max(1) as usize;
    let mut blocks = trace.iter().find(|r| r.blocks.len() >= n).map(|r| r.blocks[..n].to_vec()).unwrap_or_default();
    // A trace without a request that long: its new blocks are new hashes.
    while blocks.len() < n {
        blocks.push(BlockHash(u64::MAX - 1_000_000 - blocks.len() as u64));
    }
    blocks[n - 1] = BlockHash(u64::MAX - (n as u64 - 1));
    let chars = tokens as usize * 4;
    let text = PROBE_TEXT.repeat(chars.div_ceil(PROBE_TEXT.len()));
    (TraceReq { input: tokens, blocks }, text[..chars].to_string())
}

/// [`probe`] with every block new: no worker holds any of it, and a policy's decision is
/// its cold one (a cache-aware policy then ranks by load alone, and an idle share of the
/// fleet ties). The new hashes are below `u64::MAX − 2,000,000`, far from a Mooncake
/// trace's `hash_ids` and from [`probe`]'s own.
pub fn cold_probe(trace: &[TraceReq], tokens: u32) -> (TraceReq, String) {
    let (mut p, text) = probe(trace, tokens);
    for (i, b) in p.blocks.iter_mut().enumerate() {
        *b = BlockHash(u64::MAX - 2_000_000 - i as u64);
    }
    (p, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_is_as_long_as_asked_and_ends_in_a_new_block() {
        let trace = parse_mooncake("{\"input_length\": 5000, \"hash_ids\": [1,2,3,4,5,6,7,8,9,10]}\n").expect("trace");
        let (p, text) = probe(&trace, 4096);
        assert_eq!((p.input, p.blocks.len(), text.len()), (4096, 8, 16_384));
        assert_eq!(p.blocks[..7], trace[0].blocks[..7]);
        assert_eq!(p.blocks[7], BlockHash(u64::MAX - 7));
        let (p, _) = probe(&trace, 100_000);
        assert_eq!(p.blocks.len(), 195);
        assert!(parse_mooncake("{\"input_length\": 1}\n").expect_err("no hash_ids").contains("line 1"));
        let (cold, _) = cold_probe(&trace, 4096);
        assert_eq!((cold.input, cold.blocks.len()), (4096, 8));
        assert!(cold.blocks.iter().all(|b| !trace[0].blocks.contains(b) && !p.blocks.contains(b)));
    }
}
