//! `kvroute bench kv-events`: how many engine KV events one router ingests, and what that
//! does to its decisions, at fleet scale. In one process, on the gateway's own code:
//!
//! - **ingestion** — vLLM `BlockStored`/`BlockRemoved` batches (msgpack, current map
//!   encoding) of `--engines` engines, each decoded ([`kvroute_protocol::kv_events::decode`])
//!   and applied to the precise index as the gateway does
//!   ([`kvroute_gateway::kv_subscriber::apply_events`] on each of its `--copies`, a
//!   [`Twin`]), `--batches-per-lock` batches a write, engines in turn;
//! - **decisions** — a request on the engines' shared system prompt: its token blocks
//!   hashed, the engines' cached tokens read from a copy as the gateway's route
//!   stage does ([`PreciseIndex::cached_tokens_many`]), then `least_ttft` deciding over the
//!   whole fleet.
//!
//! Three phases of `--seconds` each: ingestion alone, decisions alone, both at once (one
//! thread each). What it leaves out of the gateway's path: the ZeroMQ receive and the
//! per-batch metric updates — which `--zmq` puts back (`cmd_bench_kv_zmq`: the same
//! batches published through ZeroMQ to a router running `kvroute serve`'s code).

use anyhow::{Context, bail};
use kvroute_core::decision_bench::fleet;
use kvroute_core::hash::{HashAlgo, hash_token_blocks};
use kvroute_core::policy::{PickCtx, decide};
use kvroute_core::precise::{PreciseConfig, PreciseIndex};
use kvroute_core::types::{BlockSeq, Nanos, RequestView, Role, WorkerId};
use kvroute_gateway::twin::Twin;
use kvroute_protocol::kv_events::{Encoding, EventBatch, KvEvent, decode, encode};
use rand_core::SeedableRng;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Batches pre-encoded per engine: the engine stores chain `j mod CYCLE` at its `j`-th
/// batch and removes the chain stored `CYCLE / 2` batches before, so each engine holds its
/// shared prefix and `CYCLE / 2` chains in the steady state.
const CYCLE: usize = 16;
/// Most token ids in the pre-encoded batches of all engines (about 400 MB encoded).
const MAX_TOKENS: u64 = 1 << 27;

/// Flags of `kvroute bench kv-events`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Engines publishing.
    #[arg(long, default_value_t = 1024)]
    pub engines: usize,
    /// Seconds of each phase.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Blocks per `BlockStored` event (one request's newly computed blocks).
    #[arg(long, default_value_t = 16)]
    pub blocks_per_event: usize,
    /// Tokens per block (vLLM's default 16).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Blocks of the system prompt every engine holds (and the probe request starts with).
    #[arg(long, default_value_t = 64)]
    pub shared_blocks: usize,
    /// Decoded batches applied in one write (the gateway's applier: up to 32 queued ones,
    /// `kv_subscriber::OPS_PER_WRITE`). More amortises the lock's handoff between ingestion
    /// and decisions, and holds decisions up for as many batches at a time.
    #[arg(long, default_value_t = 1)]
    pub batches_per_lock: usize,
    /// Copies of the index (the gateway's `policy_copies`): 2, ingestion writes both in
    /// turn and decisions read whichever it is not writing; 1, one `RwLock`.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub copies: u8,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Instead of the in-process phases: the engines publish through ZeroMQ (one PUB socket
    /// each on 127.0.0.1) to a router started in this process (`kvroute serve`'s code:
    /// its subscribers, applier and metrics), at `--rate` block events a second for
    /// `--seconds`; reports what the router applied, from its `kvroute_kv_event_batches`
    /// counters; decisions are asked of its `/debug/route` (the request's tokens in its
    /// body, so the route stage reads the precise index) with and without the publishing.
    #[arg(long)]
    pub zmq: bool,
    /// With `--zmq`: block events a second offered, all engines together.
    #[arg(long, default_value_t = 1_200_000.0)]
    pub rate: f64,
}

/// Token ids of block `k` of chain `c` of engine `e` (`None`: the shared prefix).
fn block_tokens(e: Option<usize>, c: usize, k: usize, bs: u32) -> impl Iterator<Item = u32> {
    let base = match e {
        None => k as u64 * u64::from(bs),
        Some(e) => (1u64 << 24) + (((e * CYCLE + c) * 4096 + k) as u64) * u64::from(bs),
    };
    (0..u64::from(bs)).map(move |j| ((base + j) % (1 << 31)) as u32)
}

/// Engine hash of block `k` of chain `c` of engine `e` (`None`: the shared prefix, the same
/// on every engine, as vLLM's content hashes with one seed are).
fn engine_hash(e: Option<usize>, c: usize, k: usize) -> u64 {
    match e {
        None => 0x5eed_0000_0000 + k as u64,
        Some(e) => ((e as u64 + 1) << 32) | ((c as u64) << 16) | k as u64,
    }
}

/// One engine's batches: the shared prefix first, then the cycle of store/remove batches.
fn engine_batches(e: usize, a: &Args) -> (Vec<u8>, Vec<Vec<u8>>) {
    let bs = a.block_size;
    let stored = |who: Option<usize>, c: usize, n: usize, parent: Option<u64>| KvEvent::BlockStored {
        block_hashes: (0..n).map(|k| engine_hash(who, c, k)).collect(),
        parent_block_hash: parent,
        token_ids: (0..n).flat_map(|k| block_tokens(who, c, k, bs)).collect(),
        block_size: bs,
        medium: Some("GPU".into()),
        group_idx: 0,
    };
    let batch = |events| encode(&EventBatch { ts: 0.0, events, dp_rank: None }, Encoding::Map);
    let prefix = batch(vec![stored(None, 0, a.shared_blocks, None)]);
    let last_shared = a.shared_blocks.checked_sub(1).map(|k| engine_hash(None, 0, k));
    let cycle = (0..CYCLE)
        .map(|c| {
            let old = (c + CYCLE / 2) % CYCLE;
            let removed = KvEvent::BlockRemoved {
                block_hashes: (0..a.blocks_per_event).map(|k| engine_hash(Some(e), old, k)).collect(),
                medium: Some("GPU".into()),
                group_idx: 0,
            };
            batch(vec![removed, stored(Some(e), c, a.blocks_per_event, last_shared)])
        })
        .collect();
    (prefix, cycle)
}

/// Block events (blocks stored plus blocks removed) in `events`.
fn block_events(events: &[KvEvent]) -> u64 {
    events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } | KvEvent::BlockRemoved { block_hashes, .. } => {
                block_hashes.len() as u64
            }
            KvEvent::AllBlocksCleared => 0,
        })
        .sum()
}

/// What one ingestion phase did.
struct Ingested {
    batches: u64,
    block_events: u64,
    secs: f64,
}

/// Decodes and applies the engines' batches in turn until `stop` or `until`, `per_lock`
/// decoded batches under each write lock.
fn ingest(
    ix: &Twin<PreciseIndex>,
    cycles: &[Vec<Vec<u8>>],
    per_lock: usize,
    t0: Instant,
    until: Instant,
    stop: &AtomicBool,
) -> Ingested {
    let start = Instant::now();
    let (mut batches, mut blocks) = (0u64, 0u64);
    let mut pending: Vec<(WorkerId, EventBatch)> = Vec::with_capacity(per_lock);
    let flush = |pending: &mut Vec<(WorkerId, EventBatch)>| {
        let now = Nanos(t0.elapsed().as_nanos() as u64);
        ix.write(|w| {
            for (e, b) in pending.iter() {
                kvroute_gateway::kv_subscriber::apply_events(w, *e, &b.events, now);
            }
        });
        pending.clear();
    };
    'run: for round in 0.. {
        for (e, cycle) in cycles.iter().enumerate() {
            // The clock is read every 64 batches, as often as the work allows.
            if batches.is_multiple_of(64) && (Instant::now() >= until || stop.load(Ordering::Relaxed)) {
                break 'run;
            }
            let Ok((b, _)) = decode(&cycle[round % CYCLE]) else { continue };
            batches += 1;
            blocks += block_events(&b.events);
            pending.push((WorkerId(e as u32), b));
            if pending.len() >= per_lock {
                flush(&mut pending);
            }
        }
    }
    flush(&mut pending);
    Ingested { batches, block_events: blocks, secs: start.elapsed().as_secs_f64() }
}

/// Decides the probe over `n` workers until `until`; the time of each decision (the
/// index reads included), nanoseconds.
fn decide_loop(
    ix: &Twin<PreciseIndex>,
    n: usize,
    tokens: &[u32],
    t0: Instant,
    until: Instant,
) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
    let policy =
        kvroute_core::registry::build("least_ttft", &serde_json::Value::Null).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut views = fleet(n);
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    let mut h = hdrhistogram::Histogram::<u64>::new(3).context("histogram")?;
    let mut hashes = Vec::new();
    let ids: Vec<WorkerId> = views.iter().map(|v| v.id).collect();
    let mut cached = Vec::new();
    while Instant::now() < until {
        let t = Instant::now();
        // The gateway's route stage: block sizes, the prompt hashed once, cached tokens.
        let sizes: Vec<Option<u32>> = {
            let r = ix.read();
            views.iter().map(|v| r.block_size(v.id)).collect()
        };
        let bs = sizes.iter().flatten().next().copied().unwrap_or(16);
        hashes.clear();
        hash_token_blocks(tokens, bs as usize, usize::MAX, HashAlgo::Xxh3, &mut hashes);
        {
            let r = ix.read();
            let now = Nanos(t0.elapsed().as_nanos() as u64);
            r.cached_tokens_many(&ids, &hashes, bs, now, &mut cached);
        }
        for ((v, s), t) in views.iter_mut().zip(&sizes).zip(&cached) {
            v.cached_tokens = s.and(*t);
        }
        let req = RequestView {
            model: "m",
            text: None,
            token_ids: Some(tokens),
            blocks: Some(BlockSeq { block_tokens: bs, hashes: &hashes }),
            input_tokens: tokens.len() as u32,
            output_tokens: Some(256),
            session_id: None,
            role: Role::Both,
        };
        let mut ctx = PickCtx { now: Nanos(t0.elapsed().as_nanos() as u64), rng: &mut rng, fleet: None };
        let _ = std::hint::black_box(decide(policy.as_ref(), &req, &views, &mut ctx));
        let _ = h.record(t.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
    }
    Ok(h)
}

/// Runs `kvroute bench kv-events`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if !(1..=65_536).contains(&a.engines) {
        bail!("--engines: from 1 to 65536");
    }
    if !(a.seconds.is_finite() && (0.1..=3600.0).contains(&a.seconds)) {
        bail!("--seconds: from 0.1 to 3600");
    }
    if !(1..=4096).contains(&a.blocks_per_event) || !(1..=4096).contains(&a.block_size) {
        bail!("--blocks-per-event and --block-size: from 1 to 4096");
    }
    if !(1..=65_536).contains(&a.shared_blocks) {
        bail!("--shared-blocks: from 1 to 65536");
    }
    if !(1..=4096).contains(&a.batches_per_lock) {
        bail!("--batches-per-lock: from 1 to 4096");
    }
    // The batches are encoded up front: bound the tokens they carry (about 3 bytes each).
    let tokens = (a.engines * (CYCLE * a.blocks_per_event + a.shared_blocks)) as u64 * u64::from(a.block_size);
    if tokens > MAX_TOKENS {
        bail!(
            "--engines x (16 x --blocks-per-event + --shared-blocks) x --block-size is {tokens} tokens of \
             pre-encoded events; at most {MAX_TOKENS}"
        );
    }
    let (prefixes, cycles): (Vec<Vec<u8>>, Vec<Vec<Vec<u8>>>) = (0..a.engines).map(|e| engine_batches(e, &a)).unzip();
    // The probe: the shared system prompt, then 8 blocks no engine holds.
    let tokens: Vec<u32> = (0..a.shared_blocks)
        .flat_map(|k| block_tokens(None, 0, k, a.block_size))
        .chain((0..8 * a.block_size).map(|j| (1u32 << 30) + j))
        .collect();
    if a.zmq {
        let per_batch = 2 * a.blocks_per_event as u64;
        return crate::cmd_bench_kv_zmq::run(&crate::cmd_bench_kv_zmq::Plan {
            seconds: a.seconds,
            rate: a.rate,
            block_events_per_batch: per_batch,
            prefixes,
            cycles,
            probe: tokens,
            probe_cached: a.shared_blocks as u64 * u64::from(a.block_size),
            json: a.json,
        });
    }
    let ix = Twin::of(PreciseIndex::new(PreciseConfig::default()), usize::from(a.copies));
    let t0 = Instant::now();
    for (e, p) in prefixes.iter().enumerate() {
        let (b, _) = decode(p).map_err(|e| anyhow::anyhow!("{e}"))?;
        ix.write(|w| kvroute_gateway::kv_subscriber::apply_events(w, WorkerId(e as u32), &b.events, Nanos(0)));
    }
    // One cycle of every engine first, so the timed phases run in the steady state.
    for round in 0..CYCLE {
        for (e, c) in cycles.iter().enumerate() {
            let (b, _) = decode(&c[round]).map_err(|e| anyhow::anyhow!("{e}"))?;
            ix.write(|w| kvroute_gateway::kv_subscriber::apply_events(w, WorkerId(e as u32), &b.events, Nanos(0)));
        }
    }
    let phase = Duration::from_secs_f64(a.seconds);
    let never = AtomicBool::new(false);
    let alone = ingest(&ix, &cycles, a.batches_per_lock, t0, Instant::now() + phase, &never);
    let quiet = decide_loop(&ix, a.engines, &tokens, t0, Instant::now() + phase)?;
    let stop = AtomicBool::new(false);
    let until = Instant::now() + phase;
    let (busy, loaded) = std::thread::scope(|s| {
        let ingester = s.spawn(|| ingest(&ix, &cycles, a.batches_per_lock, t0, until, &stop));
        let decided = decide_loop(&ix, a.engines, &tokens, t0, until);
        stop.store(true, Ordering::Relaxed);
        (ingester.join(), decided)
    });
    let busy = busy.map_err(|_| anyhow::anyhow!("the ingestion thread panicked"))?;
    // What the decisions read: engine 0's cached tokens of the probe (its system prompt).
    let mut hashes = Vec::new();
    hash_token_blocks(&tokens, a.block_size as usize, usize::MAX, HashAlgo::Xxh3, &mut hashes);
    let probe_cached =
        ix.read().cached_tokens(WorkerId(0), &hashes, a.block_size, Nanos(t0.elapsed().as_nanos() as u64));
    report(&a, &ix.read(), &alone, &busy, &quiet, &loaded?, probe_cached);
    Ok(())
}

/// Prints the three phases.
fn report(
    a: &Args,
    ix: &PreciseIndex,
    alone: &Ingested,
    busy: &Ingested,
    quiet: &hdrhistogram::Histogram<u64>,
    loaded: &hdrhistogram::Histogram<u64>,
    probe_cached: Option<u64>,
) {
    let rate = |i: &Ingested| (i.block_events as f64 / i.secs, i.batches as f64 / i.secs);
    let q = |h: &hdrhistogram::Histogram<u64>| (h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.max(), h.len());
    let ((ab, abt), (bb, bbt)) = (rate(alone), rate(busy));
    let ((q50, q99, qmax, qn), (l50, l99, lmax, ln)) = (q(quiet), q(loaded));
    let stats = ix.stats();
    if a.json {
        let o = serde_json::json!({
            "engines": a.engines, "blocks_per_event": a.blocks_per_event, "block_size": a.block_size,
            "shared_blocks": a.shared_blocks, "batches_per_lock": a.batches_per_lock,
            "ingest_alone_block_events_per_s": ab, "ingest_alone_batches_per_s": abt,
            "ingest_while_deciding_block_events_per_s": bb, "ingest_while_deciding_batches_per_s": bbt,
            "decision_alone": {"p50_ns": q50, "p99_ns": q99, "max_ns": qmax, "decisions": qn},
            "decision_while_ingesting": {"p50_ns": l50, "p99_ns": l99, "max_ns": lmax, "decisions": ln},
            "index": {"stored": stats.stored, "removed": stats.removed, "unknown_parent": stats.unknown_parent},
            "probe_cached_tokens_on_engine_0": probe_cached,
        });
        println!("{o}");
        return;
    }
    println!(
        "{} engines, {} blocks per event of {} tokens, {} shared blocks, {} batches a write lock; {}-second phases",
        a.engines, a.blocks_per_event, a.block_size, a.shared_blocks, a.batches_per_lock, a.seconds
    );
    println!("phase                      block events/s   batches/s   decision p50_ns   p99_ns     max_ns  decisions");
    println!("ingestion alone            {ab:>14.0} {abt:>11.0}");
    println!("decisions alone            {:>14} {:>11} {q50:>17} {q99:>8} {qmax:>10} {qn:>10}", "-", "-");
    println!("both (one thread each)     {bb:>14.0} {bbt:>11.0} {l50:>17} {l99:>8} {lmax:>10} {ln:>10}");
    println!(
        "the probe's cached tokens on engine 0: {} of {}",
        probe_cached.unwrap_or(0),
        a.shared_blocks as u64 * u64::from(a.block_size) + 8 * u64::from(a.block_size)
    );
}
