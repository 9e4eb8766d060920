//! `kvroute bench decision`: decision time per policy from the release binary, no Criterion
//! build needed. The same measurement as `cargo bench -p kvroute-core --bench decision`:
//! the fixture of [`kvroute_core::decision_bench`] — each policy's index warmed by the whole
//! Mooncake conversation trace (`data/traces`, or `--trace`) on N workers of uneven load,
//! then a probe request `--prompt-tokens` long — decided `--decisions` times, each call
//! timed on its own (key and pick: fallbacks are worked out only for a retry; nothing
//! committed) at `--probe-at` seconds.
//!
//! A policy that reads the fleet's digest ([`kvroute_core::fleet_digest::FleetDigest`]:
//! least_ttft, prefill_cost, kv_score, lmetric, capped, unified, cache_aware,
//! prefix_affinity) is given one, built with the fleet, as the replay
//! keeps one beside its engines' views, so it reads only the workers that can win;
//! `--no-digest` times decisions that read every view.
//!
//! With `--gateway` each timed call also reads the candidates the way a request through
//! `kvroute serve` does: the workers are a gateway fleet
//! ([`kvroute_gateway::fleet::Fleet`]) of N workers serving the model. Each policy decides
//! on the views the fleet keeps between requests and their digest (`Fleet::decide_kept`):
//! before each timed call one worker's counters change (a request opened and closed on
//! worker `k % N` at the `k`-th decision, as a dispatch marks its worker), and the call
//! re-reads that worker's view and updates the digest before the policy decides (a policy
//! that reads no digest decides on the kept views). With `--no-digest` each call starts
//! from `Fleet::candidates` (the
//! model's roster, each worker's view read from its atomics) and ends when those
//! candidates are dropped. Loads
//! are open requests on the workers' counters: `i % 7` in flight on worker `i` (7 is
//! `--in-flight-spread`), the first of them with `(i % 5) × 1000` tokens to prefill (a
//! worker with nothing in flight has nothing queued, unlike the fixture's).

use anyhow::{Context, bail};
use kvroute_core::decision_bench::{TraceReq, cold_probe, fleet_loaded, parse_mooncake, probe, view, warmed};
use kvroute_core::policy::{PickCtx, decide};
use kvroute_core::registry;
use kvroute_core::types::Nanos;
use rand_core::SeedableRng;
use std::hint::black_box;
use std::time::Instant;

/// Longest probe, tokens (its text is 4 bytes a token).
const MAX_PROMPT_TOKENS: u32 = 1 << 20;
/// Most decisions timed per policy and fleet size.
const MAX_DECISIONS: usize = 10_000_000;

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
    /// Time the gateway's candidate read with each decision (at most
    /// `kvroute_gateway::fleet::MAX_WORKERS` workers): the kept views and their digest, or
    /// a read of every worker's view (see the module docs); JSON objects get
    /// `"gateway": true`.
    #[arg(long)]
    pub gateway: bool,
    /// Decide without the fleet's digest: every policy reads every view (with `--gateway`:
    /// as `kvroute serve` does for a request whose candidates it narrows or rewrites,
    /// e.g. with KV events). JSON objects say `"digest"`.
    #[arg(long)]
    pub no_digest: bool,
    /// When the probe is decided, seconds on the policies' clock. The warm-up routes one
    /// trace request a millisecond from 0 (the whole Mooncake trace: ~12 s), so at the
    /// default 4000 an index whose entries expire (kv_score's, `ttl_secs` 120) holds
    /// nothing: pass 13 to probe it warm. JSON objects say `probe_at_secs`.
    #[arg(long, default_value_t = 4000.0)]
    pub probe_at: f64,
    /// Worker `i` runs `i % N` requests of the 256 it takes (1 to 256). The default 7 is a
    /// light fleet (every worker within kv_score's tie band of the least loaded); ~100 a
    /// busy one. JSON objects say `in_flight_spread`.
    #[arg(long, default_value_t = 7)]
    pub in_flight_spread: u32,
    /// Time a probe no worker holds any block of (its decision a cold prompt's), instead
    /// of one that shares the trace's system prompt. JSON objects say `cold_probe`.
    #[arg(long)]
    pub cold_probe: bool,
}

/// A gateway fleet of `n` workers serving model `m`, loaded as the module doc says, and the
/// open requests that hold the load (dropping them settles it).
fn gateway_fleet(
    n: usize,
    spread: u32,
) -> anyhow::Result<(kvroute_gateway::fleet::Fleet, Vec<kvroute_core::ledger::LoadTicket>)> {
    let fleet = kvroute_gateway::fleet::Fleet::default();
    let mut open = Vec::new();
    for i in 0..n {
        let url = format!("http://w{i}.bench.invalid:8000");
        let (w, _) = fleet.add(&url, vec!["m".into()], kvroute_core::types::Health::Healthy)?;
        for k in 0..i % spread as usize {
            let queued = if k == 0 { (i as u64 % 5) * 1000 } else { 0 };
            open.push(w.load.dispatched(queued, 256));
        }
    }
    Ok((fleet, open))
}

/// The policies `--policy` names (`all`: every one), else an error naming the unknown one.
fn policy_names(flag: &str) -> anyhow::Result<Vec<String>> {
    let names: Vec<String> = if flag == "all" {
        registry::names().iter().map(|s| (*s).to_string()).collect()
    } else {
        flag.split(',').map(|s| s.trim().to_string()).collect()
    };
    for n in &names {
        if !registry::names().contains(&n.as_str()) {
            bail!("--policy: unknown policy `{n}`; known: all, {}", registry::names().join(", "));
        }
    }
    Ok(names)
}

/// One decision for `req` through the gateway fleet `g` (model `m`), as a request through
/// `kvroute serve` makes it: on the fleet's kept views for router `owner` when `kept` is
/// the empty digest they are kept with, else (or when no kept copy decides) on a fresh
/// read of the candidates.
fn decide_on_gateway(
    g: &kvroute_gateway::fleet::Fleet,
    owner: u64,
    kept: Option<&kvroute_core::fleet_digest::FleetDigest>,
    p: &dyn kvroute_core::Policy,
    req: &kvroute_core::RequestView<'_>,
    ctx: &mut PickCtx<'_>,
) {
    let on_kept = kept.and_then(|d| {
        g.decide_kept(black_box("m"), owner, d, |views, d| {
            let mut ctx = PickCtx { now: ctx.now, rng: &mut *ctx.rng, fleet: Some(d) };
            let r = decide(p, black_box(req), views, &mut ctx);
            let chosen = r.as_ref().ok().map(|(d, _)| d.worker);
            (r, chosen)
        })
    });
    if on_kept.is_none() {
        let cands = g.candidates(black_box("m"));
        let _ = black_box(decide(p, black_box(req), &cands.views, ctx));
    }
    black_box(on_kept);
}

/// Opens and closes a request on worker `k % n` of `g`: its view is marked changed (and
/// back as it was), as a dispatch marks the worker it goes to.
fn touch(g: &kvroute_gateway::fleet::Fleet, k: usize) {
    let list = g.load();
    if let Some(w) = list.get(k % list.len().max(1)) {
        drop(w.load.dispatched(0, 0));
    }
}

fn read_trace(path: &std::path::Path) -> anyhow::Result<Vec<TraceReq>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--trace {}", path.display()))?;
    let trace = parse_mooncake(&text).map_err(|e| anyhow::anyhow!("--trace {}: {e}", path.display()))?;
    if trace.is_empty() {
        bail!("--trace {}: no requests", path.display());
    }
    Ok(trace)
}

/// The numeric flags in their ranges, else an error naming the flag.
fn check_ranges(a: &Args) -> anyhow::Result<()> {
    if !(1..=MAX_PROMPT_TOKENS).contains(&a.prompt_tokens) {
        bail!("--prompt-tokens: from 1 to {MAX_PROMPT_TOKENS}");
    }
    if !(1..=MAX_DECISIONS).contains(&a.decisions) {
        bail!("--decisions: from 1 to {MAX_DECISIONS}");
    }
    if !(1..=256).contains(&a.in_flight_spread) {
        bail!("--in-flight-spread: from 1 to 256, got {}", a.in_flight_spread);
    }
    if !(0.0..=1e9).contains(&a.probe_at) {
        bail!("--probe-at: seconds from 0 to 1e9, got {}", a.probe_at);
    }
    Ok(())
}

/// Runs `kvroute bench decision`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let sizes: Vec<usize> = a
        .workers
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|n| (1..=65_536).contains(n)))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow::anyhow!("--workers: expected sizes from 1 to 65536, comma separated"))?;
    let names = policy_names(&a.policy)?;
    check_ranges(&a)?;
    let probe_at = Nanos::from_secs_f64(a.probe_at);
    let max = kvroute_gateway::fleet::MAX_WORKERS;
    if a.gateway && sizes.iter().any(|n| *n > max) {
        bail!("--workers: a gateway fleet has at most {max} workers (--gateway)");
    }
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_trace.jsonl");
    let trace = read_trace(a.trace.as_deref().unwrap_or(std::path::Path::new(default)))?;
    let (pr, text) = if a.cold_probe { cold_probe(&trace, a.prompt_tokens) } else { probe(&trace, a.prompt_tokens) };
    if !a.json {
        println!("workers policy              p50_ns    p99_ns  p99.9_ns    max_ns  index_size");
    }
    for &n in &sizes {
        let c = fleet_loaded(n, a.in_flight_spread);
        let gateway = if a.gateway { Some(gateway_fleet(n, a.in_flight_spread)?) } else { None };
        for (owner, name) in names.iter().enumerate() {
            let p = warmed(name, &trace, &c).map_err(|e| anyhow::anyhow!("{e}"))?;
            // Kept for a policy that reads it, as the replay keeps it.
            let digest = p.fleet_digest().filter(|_| !a.no_digest && !a.gateway).map(|mut d| {
                d.refresh(&c);
                d
            });
            let digest = digest.as_ref();
            // With `--gateway`: the empty digest the gateway's kept views are built with.
            let kept = (!a.no_digest && a.gateway).then(|| p.fleet_digest().unwrap_or_default());
            let req = view(&pr, Some(&text));
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
            let mut h = hdrhistogram::Histogram::<u64>::new(3).context("histogram")?;
            for k in 0..a.decisions {
                if let (Some((g, _)), Some(_)) = (&gateway, &kept) {
                    touch(g, k);
                }
                let mut ctx = PickCtx { now: probe_at, rng: &mut rng, fleet: digest };
                let t = Instant::now();
                match &gateway {
                    Some((g, _)) => decide_on_gateway(g, owner as u64, kept.as_ref(), p.as_ref(), &req, &mut ctx),
                    None => {
                        let _ = black_box(decide(p.as_ref(), black_box(&req), &c, &mut ctx));
                    }
                }
                let _ = h.record(t.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
            }
            let (p50, p99, p999, max) =
                (h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.value_at_quantile(0.999), h.max());
            // Whether the policy read a digest (the replay's kind, or the gateway's kept one).
            let read_digest = digest.is_some() || (kept.is_some() && p.fleet_digest().is_some());
            if a.json {
                let o = serde_json::json!({"policy": name, "workers": n, "p50_ns": p50, "p99_ns": p99,
                    "p999_ns": p999, "max_ns": max, "index_size": p.index_size(), "prompt_tokens": a.prompt_tokens,
                    "gateway": a.gateway, "digest": read_digest, "probe_at_secs": a.probe_at,
                    "in_flight_spread": a.in_flight_spread, "cold_probe": a.cold_probe});
                println!("{o}");
            } else {
                println!("{n:>7} {name:<16} {p50:>9} {p99:>9} {p999:>9} {max:>9} {:>11}", p.index_size());
            }
        }
    }
    Ok(())
}
