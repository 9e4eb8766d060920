//! `kvroute advise`: which policy (and knobs) fits a trace — typically one recorded with
//! `kvroute serve --record` — judged by replaying it through every candidate on simulated
//! engines over several arrival realisations.
//!
//! 1. Every candidate policy is replayed on each realisation of the trace: for traces with
//!    whole-second timestamps (Mooncake), each second's requests at seeded random instants
//!    ([`trace::spread_seconds_random`]); for traces with finer timestamps (recorded ones),
//!    each arrival moved by a seeded uniform jitter of up to `--jitter-ms`, order kept.
//! 2. Policies are ranked by rejections, then mean TTFT averaged over the realisations.
//! 3. Unless `--no-knob-search`, the best `--search-top` policies are tried again with each
//!    numeric knob halved and doubled, one knob at a time (one pass of a coordinate search,
//!    the knob's documented range permitting); a variant is kept when its mean TTFT is lower
//!    in every realisation.
//! 4. The recommendation is printed with its expected change against `--current` (mean and
//!    p99 TTFT, averaged, and the spread of the mean's change over the realisations), and the
//!    `kvroute serve` flags that select it.
//! 5. With `--headroom`, what routing leaves on the table: the recommendation, the best
//!    three policies and round_robin (when a candidate) replayed again with each KV oracle,
//!    and, as a router that moves KV, with pulls between engines at 50 GB/s
//!    (`kvroute replay --prefix-state precise --kv-pull 50`)
//!    ([`kvroute_sim::replay::KvOracle`]): `fleet` (every request finds the longest prefix any
//!    engine holds, wherever it is sent: perfect placement of the fleet's cached prefixes)
//!    and `store` (the longest prefix any engine has computed, without bound: a shared KV
//!    store of unlimited size). The best of each is a bound, not a router.

use anyhow::{Context, bail};
use kvroute_sim::engine::Profile;
use kvroute_sim::replay::{KvOracle, KvPull, PrefixState, ReplayConfig, replay};
use kvroute_sim::report::{Slo, summarise};
use kvroute_sim::trace::{self, TraceRequest};
use rand_core::{Rng, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;

/// Flags of `kvroute advise`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Trace file (a `kvroute serve --record` file, Mooncake JSONL, session JSONL or Azure CSV).
    #[arg(long)]
    pub trace: PathBuf,
    /// Number of simulated engines (the fleet the advice is for).
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    #[command(flatten)]
    pub profile: crate::sim_args::ProfileArgs,
    /// Arrival-rate multiplier (1 = the trace's own load; 1.5 = the same traffic 50 % busier).
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Candidate policies, comma-separated, or `all`.
    #[arg(long, default_value = "all")]
    pub policies: String,
    /// The policy running now, the baseline of the expected gain (default: `kvroute
    /// serve`'s default policy).
    #[arg(long, default_value = kvroute_core::registry::DEFAULT_POLICY)]
    pub current: String,
    /// Arrival realisations each candidate is replayed on (1 to 32).
    #[arg(long, default_value_t = 3)]
    pub realisations: u64,
    /// Traces with sub-second timestamps: the largest shift of an arrival in a realisation, ms.
    #[arg(long, default_value_t = 100.0)]
    pub jitter_ms: f64,
    /// Knob search: how many of the best policies get one (0 = none).
    #[arg(long, default_value_t = 2)]
    pub search_top: usize,
    /// No knob search.
    #[arg(long)]
    pub no_knob_search: bool,
    /// Closed-loop sessions (as `kvroute replay --closed-sessions`): each turn of a session
    /// arrives only once the previous one ended. For recordings of chat clients that send
    /// a session header.
    #[arg(long)]
    pub closed_sessions: bool,
    /// A load generator's closed-loop clients, N sessions at a time (as `kvroute replay
    /// --session-concurrency`; implies `--closed-sessions`). 0 = no limit.
    #[arg(long, default_value_t = 0)]
    pub session_concurrency: usize,
    /// The engines share this many CPU cores, one thread each (as `kvroute replay
    /// --host-cores`). 0 = every engine has its own hardware.
    #[arg(long, default_value_t = 0)]
    pub host_cores: u32,
    /// The measured slow-down of each busy engine with 1, 2, … engines busy, comma-separated
    /// (as `kvroute replay --host-slowdown`).
    #[arg(long, value_delimiter = ',')]
    pub host_slowdown: Vec<f64>,
    /// Which sessions of the trace to judge on (a time span, conversations of a minimum
    /// length), as `kvroute replay`; the slice's first request becomes time 0.
    #[command(flatten)]
    pub slice: kvroute_bench::cli::TraceSliceArgs,
    /// Cap on every request's output tokens, as `kvroute replay --max-output`.
    #[arg(long)]
    pub max_output: Option<u32>,
    /// Keep only the first N requests of the trace (after the slice).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Key each tenant's requests apart (trace lines with a `tenant`, as `kvroute serve
    /// --record` writes them under tenant isolation), as `kvroute replay
    /// --tenant-isolation`; `false` judges the policies on one shared cache.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub tenant_isolation: bool,
    /// Write the ranking and the recommendation as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub jobs: crate::sim_args::JobsArgs,
    /// Also bound what routing leaves on the table: the recommendation, the best three
    /// policies and round_robin (when a candidate) replayed with `kvroute replay --kv-oracle fleet` (perfect
    /// placement of the fleet's cached prefixes) and `store` (a shared KV store without
    /// bound), and, as a router that moves KV rather than a bound, with KV pulls between
    /// engines at 50 GB/s (`kvroute replay --prefix-state precise --kv-pull 50`). Not with a
    /// profile with llama.cpp slots.
    #[arg(long)]
    pub headroom: bool,
}

/// The best of the candidates replayed with one KV oracle (`--headroom`): a bound, not a
/// router.
#[derive(Debug, Clone, Serialize)]
pub struct Bound {
    /// `fleet` or `store` ([`KvOracle::as_str`]).
    pub kv_oracle: &'static str,
    /// The candidate that did best with it.
    pub best: Candidate,
    /// Its mean TTFT against the recommendation's, percent (negative: lower).
    pub mean_ttft_change_pct: f64,
}

/// The best of the candidates replayed with KV pulls between engines (`--headroom`): a
/// router that moves KV over a link, not a bound.
#[derive(Debug, Clone, Serialize)]
pub struct PullHeadroom {
    /// The link, GB/s.
    pub link_gbytes_per_s: f64,
    /// The candidate that did best with the pulls.
    pub best: Candidate,
    /// Its mean TTFT against the recommendation's, percent (negative: lower).
    pub mean_ttft_change_pct: f64,
}

/// The link `--headroom`'s KV pulls run over, GB/s (400 Gb/s RDMA).
const HEADROOM_PULL_GBYTES_PER_S: f64 = 50.0;

/// One candidate (a policy with knobs) over every realisation.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// Policy name.
    pub policy: String,
    /// Knobs changed from the policy's defaults (an empty object for the defaults).
    pub knobs: serde_json::Value,
    /// Mean TTFT per realisation, seconds.
    pub ttft_mean_s: Vec<f64>,
    /// p99 TTFT per realisation, seconds.
    pub ttft_p99_s: Vec<f64>,
    /// Rejected share per realisation.
    pub rejection_rate: Vec<f64>,
    /// Prefix-cache hit ratio per realisation.
    pub hit_ratio: Vec<f64>,
}

impl Candidate {
    fn avg(v: &[f64]) -> f64 {
        if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }
    }
    /// Mean TTFT averaged over the realisations, seconds.
    pub fn mean(&self) -> f64 {
        Self::avg(&self.ttft_mean_s)
    }
    /// p99 TTFT averaged over the realisations, seconds.
    pub fn p99(&self) -> f64 {
        Self::avg(&self.ttft_p99_s)
    }
    /// Rejected share averaged over the realisations.
    pub fn rejections(&self) -> f64 {
        Self::avg(&self.rejection_rate)
    }
    fn label(&self) -> String {
        match self.knobs.as_object() {
            Some(o) if !o.is_empty() => format!("{} {}", self.policy, self.knobs),
            _ => self.policy.clone(),
        }
    }
    /// Ordering: fewer rejections first, then lower mean TTFT.
    fn better_than(&self, o: &Candidate) -> bool {
        let (a, b) = (self.rejections(), o.rejections());
        if (a - b).abs() > 1e-9 {
            return a < b;
        }
        self.mean() < o.mean()
    }
}

/// Realisation `k` of `base`.
fn realisation(base: &[TraceRequest], k: u64, jitter_ms: f64, rate: f64) -> Vec<TraceRequest> {
    let mut t = base.to_vec();
    let whole = t.iter().all(|r| r.arrival.0.is_multiple_of(1_000_000_000));
    if whole {
        trace::spread_seconds_random(&mut t, k);
    } else if jitter_ms > 0.0 {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(k);
        let span = (jitter_ms * 1e6) as u64;
        for r in &mut t {
            let shift = rng.next_u64() % (2 * span + 1);
            r.arrival.0 = (r.arrival.0 + shift).saturating_sub(span);
        }
        t.sort_by_key(|r| r.arrival);
    }
    trace::scale_rate(&mut t, rate);
    t
}

/// How requests arrive and where the engines run: `kvroute replay`'s `--closed-sessions`,
/// `--session-concurrency`, `--host-cores` and `--host-slowdown`.
#[derive(Debug, Clone)]
struct Clients {
    closed_sessions: bool,
    session_concurrency: usize,
    host_cores: u32,
    host_slowdown: Vec<f64>,
}

/// What every candidate is replayed on: the realisations of the trace, the fleet, how
/// clients send and how many replays run at once.
struct Bench {
    traces: Vec<Vec<TraceRequest>>,
    engines: usize,
    profile: Profile,
    clients: Clients,
    jobs: usize,
}

/// Replays `(policy, knobs)` on every realisation (in parallel over `jobs` threads).
fn evaluate(
    bench: &Bench,
    runs: &[(String, serde_json::Value)],
    kv_oracle: KvOracle,
    kv_pull: Option<KvPull>,
) -> anyhow::Result<Vec<Candidate>> {
    // A router that pulls KV knows each engine's cache: the precise prefix state.
    let prefix_state = match kv_pull {
        Some(_) => PrefixState::Precise { predict_window: kvroute_core::types::Nanos::from_secs(2) },
        None => PrefixState::Approximate,
    };
    let Bench { traces, engines, profile, clients, jobs } = bench;
    let (engines, jobs) = (*engines, *jobs);
    let infinite = trace::infinite_cache_hit(&traces[0]);
    let slo = Slo { ttft_s: 2.0, tpot_s: 0.1 };
    let work: Vec<(usize, usize)> = (0..runs.len()).flat_map(|i| (0..traces.len()).map(move |k| (i, k))).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = std::sync::Mutex::new(vec![vec![None; traces.len()]; runs.len()]);
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1).min(work.len()) {
            s.spawn(|| {
                loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(i, k)) = work.get(n) else { break };
                    let cfg = ReplayConfig {
                        engines,
                        profile: profile.clone(),
                        policy: runs[i].0.clone(),
                        knobs: runs[i].1.clone(),
                        seed: k as u64,
                        max_waiting: 4096,
                        engine_signals: true,
                        prefix_state,
                        slot_routing: false,
                        closed_sessions: clients.closed_sessions,
                        session_concurrency: clients.session_concurrency,
                        host_cores: clients.host_cores,
                        host_slowdown: clients.host_slowdown.clone(),
                        kv_oracle,
                        kv_migration: None,
                        kv_pull,
                    };
                    let r = replay(&traces[k], &cfg, &mut |_| {})
                        .map(|res| summarise(&res, 1.0, infinite, slo))
                        .map_err(|e| e.to_string());
                    if let Ok(mut g) = out.lock() {
                        g[i][k] = Some(r);
                    }
                }
            });
        }
    });
    let out = out.into_inner().map_err(|_| anyhow::anyhow!("a replay thread panicked"))?;
    let mut cands = Vec::new();
    for ((policy, knobs), rs) in runs.iter().zip(out) {
        let mut c = Candidate {
            policy: policy.clone(),
            knobs: knobs.clone(),
            ttft_mean_s: Vec::new(),
            ttft_p99_s: Vec::new(),
            rejection_rate: Vec::new(),
            hit_ratio: Vec::new(),
        };
        for r in rs {
            let r = match r {
                Some(Ok(r)) => r,
                Some(Err(e)) => bail!("replay of `{policy}` failed: {e}"),
                None => bail!("replay of `{policy}` did not run"),
            };
            c.ttft_mean_s.push(r.latency.ttft_mean_s);
            c.ttft_p99_s.push(r.latency.ttft_p99_s);
            c.rejection_rate.push(r.rejection_rate);
            c.hit_ratio.push(r.hit_ratio);
        }
        cands.push(c);
    }
    Ok(cands)
}

/// Knob variants of `policy` for one pass of a coordinate search: each numeric knob halved
/// and doubled (integers stay integers and at least 1), one at a time; variants the policy
/// refuses (out of range) are left out.
fn knob_variants(policy: &str) -> Vec<serde_json::Value> {
    let Some(info) = kvroute_core::registry::list().into_iter().find(|i| i.name == policy) else { return Vec::new() };
    let mut out = Vec::new();
    for k in &info.knobs {
        let variants: Vec<serde_json::Value> = match &k.default {
            serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => {
                let v = n.as_i64().unwrap_or(0);
                if v <= 0 {
                    continue;
                }
                vec![(v / 2).max(1).into(), v.saturating_mul(2).into()]
            }
            serde_json::Value::Number(n) => {
                let v = n.as_f64().unwrap_or(0.0);
                if v == 0.0 || !v.is_finite() {
                    continue;
                }
                vec![(v / 2.0).into(), (v * 2.0).into()]
            }
            _ => continue,
        };
        for v in variants {
            if v == k.default {
                continue;
            }
            let knobs = serde_json::json!({ k.name: v });
            if kvroute_core::registry::build(policy, &knobs).is_ok() {
                out.push(knobs);
            }
        }
    }
    out
}

/// The recommendation's expected change against the current policy, percent.
struct Change {
    /// Mean TTFT, averaged over the realisations.
    mean: f64,
    /// Lowest and highest change of the mean TTFT over the realisations.
    range: (f64, f64),
    /// p99 TTFT, averaged.
    p99: f64,
}

impl Change {
    /// `best` against `current`.
    fn of(best: &Candidate, current: &Candidate) -> Change {
        let changes: Vec<f64> =
            best.ttft_mean_s.iter().zip(&current.ttft_mean_s).map(|(b, c)| 100.0 * (b / c - 1.0)).collect();
        let range = changes.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| (l.min(x), h.max(x)));
        Change {
            mean: 100.0 * (best.mean() / current.mean() - 1.0),
            range,
            p99: 100.0 * (best.p99() / current.p99() - 1.0),
        }
    }
}

/// Runs `kvroute advise`: checks the flags, replays every candidate on each realisation
/// of the trace, searches knobs on the best, prints the ranking and the recommendation
/// (with the headroom bounds when asked) and writes the JSON.
pub fn run(a: Args) -> anyhow::Result<()> {
    let policies = candidate_policies(&a)?;
    crate::sim_args::check_host_slowdown(&a.host_slowdown)?;
    let profile = a.profile.load()?;
    if a.headroom && profile.slots > 0 {
        bail!("--headroom: profile `{}` has llama.cpp slots, no paged KV cache to bound", profile.name);
    }
    let base = load_trace(&a)?;
    // Jitter moves an arrival by at most --jitter-ms (≤ 60 s); the check leaves room for it.
    trace::check_rate_scale(&base, a.rate_scale).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
    let bench = Bench {
        traces: (1..=a.realisations).map(|k| realisation(&base, k, a.jitter_ms, a.rate_scale)).collect(),
        engines: a.engines,
        profile,
        clients: Clients {
            closed_sessions: a.closed_sessions,
            session_concurrency: a.session_concurrency,
            host_cores: a.host_cores,
            host_slowdown: a.host_slowdown.clone(),
        },
        jobs: a.jobs.jobs(),
    };
    eprintln!(
        "kvroute advise: {} requests, {} policies × {} realisations on {} engines ({})",
        base.len(),
        policies.len(),
        a.realisations,
        a.engines,
        bench.profile.name
    );
    let runs: Vec<(String, serde_json::Value)> = policies.iter().map(|p| (p.clone(), serde_json::json!({}))).collect();
    let mut cands = evaluate(&bench, &runs, KvOracle::Off, None)?;
    sort(&mut cands);
    let tuned = if a.no_knob_search { Vec::new() } else { knob_search(&bench, &cands, a.search_top)? };
    let mut all = cands.clone();
    all.extend(tuned.iter().cloned());
    sort(&mut all);
    let best = all.first().context("no candidate")?.clone();
    let current = cands.iter().find(|c| c.policy == a.current).context("the current policy was not replayed")?;
    print_ranking(&all);
    let change = Change::of(&best, current);
    println!();
    print_recommendation(&best, current, &change, a.realisations);
    let flags = serve_flags(&best);
    println!("kvroute serve {flags}");
    let bounds = if a.headroom { headroom(&bench, &best, &cands)? } else { Vec::new() };
    let pull = if a.headroom { pull_headroom(&bench, &best, &cands)? } else { None };
    println!(
        "(simulated: {} engines of profile {}, the trace at ×{}; a prediction, not a measurement)",
        a.engines, bench.profile.name, a.rate_scale
    );
    if let Some(p) = &a.json {
        let doc = serde_json::json!({
            "trace": a.trace.display().to_string(),
            "requests": base.len(),
            "engines": a.engines,
            "profile": bench.profile.name,
            "rate_scale": a.rate_scale,
            "realisations": a.realisations,
            "current": current,
            "ranking": all,
            "recommended": best,
            "mean_ttft_change_pct": change.mean,
            "mean_ttft_change_pct_range": [change.range.0, change.range.1],
            "p99_ttft_change_pct": change.p99,
            "serve_flags": flags,
            "headroom": bounds,
            "headroom_kv_pull": pull,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(())
}

/// Checks the numeric flags and returns the candidates: `--policies` (`all` expanded) and
/// `--current`, each once.
///
/// # Errors
/// A flag out of range, an unknown policy, or `--policies` naming none.
fn candidate_policies(a: &Args) -> anyhow::Result<Vec<String>> {
    if a.engines == 0 {
        bail!("--engines must be at least 1");
    }
    if !(1..=32).contains(&a.realisations) {
        bail!("--realisations: expected 1 to 32");
    }
    trace::check_rate_scale(&[], a.rate_scale).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
    if !(a.jitter_ms.is_finite() && (0.0..=60_000.0).contains(&a.jitter_ms)) {
        bail!("--jitter-ms: expected 0 to 60000");
    }
    let names = kvroute_core::registry::names();
    let mut policies: Vec<String> = Vec::new();
    for p in a.policies.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if p == "all" {
            policies.extend(names.iter().map(|n| n.to_string()));
        } else if names.contains(&p) {
            policies.push(p.to_string());
        } else {
            bail!("--policies: unknown policy `{p}`; known: all, {}", names.join(", "));
        }
    }
    if policies.is_empty() {
        // `--policies ''` recommended keeping --current without evaluating any candidate.
        bail!("--policies: no policy named");
    }
    if !names.contains(&a.current.as_str()) {
        bail!("--current: unknown policy `{}`", a.current);
    }
    if !policies.contains(&a.current) {
        policies.push(a.current.clone());
    }
    let mut seen = std::collections::HashSet::new();
    policies.retain(|p| seen.insert(p.clone()));
    Ok(policies)
}

/// Reads the trace and shapes it as the flags say (slice, tenants, output cap, limit).
fn load_trace(a: &Args) -> anyhow::Result<Vec<TraceRequest>> {
    // The reader's errors name the file already.
    let mut base = trace::read(&a.trace, None).context("--trace")?;
    if a.slice.is_set() {
        base = a.slice.apply(base)?;
        trace::rebase(&mut base);
    }
    if a.tenant_isolation {
        trace::isolate_tenants(&mut base);
    }
    crate::sim_args::cap_outputs(&mut base, a.max_output)?;
    if let Some(n) = a.limit {
        trace::truncate(&mut base, n);
    }
    if base.is_empty() {
        bail!("{}: no requests", a.trace.display());
    }
    Ok(base)
}

/// Knob search on the best `top` candidates: the variants that beat their policy's
/// defaults in every realisation (and reject no more), best first.
fn knob_search(bench: &Bench, cands: &[Candidate], top: usize) -> anyhow::Result<Vec<Candidate>> {
    let mut tuned: Vec<Candidate> = Vec::new();
    let mut variants = Vec::new();
    for c in cands.iter().take(top) {
        variants.extend(knob_variants(&c.policy).into_iter().map(|k| (c.policy.clone(), k)));
    }
    if variants.is_empty() {
        return Ok(tuned);
    }
    eprintln!("kvroute advise: knob search, {} variants", variants.len());
    for v in evaluate(bench, &variants, KvOracle::Off, None)? {
        let Some(plain) = cands.iter().find(|c| c.policy == v.policy) else { continue };
        let everywhere = v.ttft_mean_s.iter().zip(&plain.ttft_mean_s).all(|(x, y)| x < y)
            && v.rejections() <= plain.rejections() + 1e-9;
        if everywhere {
            tuned.push(v);
        }
    }
    sort(&mut tuned);
    Ok(tuned)
}

/// The ranking table: every candidate with its mean TTFT (and its range over the
/// realisations), p99, hit ratio and rejections.
fn print_ranking(all: &[Candidate]) {
    println!(
        "{:<4} {:<48} {:>10} {:>20} {:>10} {:>8} {:>7}",
        "rank", "policy", "TTFT mean", "(min–max)", "TTFT p99", "hit %", "rej %"
    );
    for (i, c) in all.iter().enumerate() {
        let lo = c.ttft_mean_s.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = c.ttft_mean_s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        println!(
            "{:<4} {:<48} {:>9.3}s {:>20} {:>9.3}s {:>7.1}% {:>6.2}%",
            i + 1,
            c.label(),
            c.mean(),
            format!("({lo:.3}–{hi:.3})"),
            c.p99(),
            100.0 * Candidate::avg(&c.hit_ratio),
            100.0 * c.rejections()
        );
    }
}

/// The recommendation line: keep the current policy, or switch with the expected change.
fn print_recommendation(best: &Candidate, current: &Candidate, change: &Change, realisations: u64) {
    if best.policy == current.policy && best.knobs.as_object().is_none_or(|o| o.is_empty()) {
        println!("Recommended: keep {} (no candidate does better on this trace).", current.policy);
    } else {
        println!(
            "Recommended: {} — mean TTFT {:.3} s against {:.3} s with {} ({:+.1} %; {:+.1} to {:+.1} % over {} realisations), p99 {:+.1} %",
            best.label(),
            best.mean(),
            current.mean(),
            current.policy,
            change.mean,
            change.range.0,
            change.range.1,
            realisations,
            change.p99
        );
    }
}

/// The `kvroute serve` flags that select `best`.
fn serve_flags(best: &Candidate) -> String {
    let mut flags = format!("--policy {}", best.policy);
    if best.knobs.as_object().is_some_and(|o| !o.is_empty()) {
        flags.push_str(&format!(" --policy-knobs '{}'", best.knobs));
    }
    flags
}

/// `--headroom`: the recommendation, the best three and round_robin replayed with each KV
/// oracle; prints and returns the best of each (bounds, not routers).
fn headroom(bench: &Bench, best: &Candidate, cands: &[Candidate]) -> anyhow::Result<Vec<Bound>> {
    let mut bounds = Vec::new();
    let runs = headroom_runs(best, cands);
    eprintln!("kvroute advise: headroom, {} candidates with each KV oracle", runs.len());
    println!();
    println!("Headroom (bounds, not routers; the best of {} candidates with each KV oracle):", runs.len());
    for oracle in [KvOracle::Fleet, KvOracle::Store] {
        let mut with = evaluate(bench, &runs, oracle, None)?;
        sort(&mut with);
        let Some(top) = with.into_iter().next() else { continue };
        let what = match oracle {
            KvOracle::Fleet => "every cached prefix found wherever a request goes (--kv-oracle fleet)",
            _ => "a shared KV store without bound (--kv-oracle store)",
        };
        let change = print_headroom(what, &top, best);
        bounds.push(Bound { kv_oracle: oracle.as_str(), best: top, mean_ttft_change_pct: change });
    }
    Ok(bounds)
}

/// `--headroom`'s router that moves KV: the same candidates with KV pulls between engines
/// at [`HEADROOM_PULL_GBYTES_PER_S`] (the profile's bytes a token); prints and returns the
/// best of them.
fn pull_headroom(bench: &Bench, best: &Candidate, cands: &[Candidate]) -> anyhow::Result<Option<PullHeadroom>> {
    let Some(pull) = KvPull::over(&bench.profile, HEADROOM_PULL_GBYTES_PER_S) else { return Ok(None) };
    let mut with = evaluate(bench, &headroom_runs(best, cands), KvOracle::Off, Some(pull))?;
    sort(&mut with);
    let Some(top) = with.into_iter().next() else { return Ok(None) };
    let what = format!(
        "a router that pulls KV between engines over {HEADROOM_PULL_GBYTES_PER_S} GB/s (not a bound; --prefix-state precise --kv-pull {HEADROOM_PULL_GBYTES_PER_S})"
    );
    let change = print_headroom(&what, &top, best);
    Ok(Some(PullHeadroom { link_gbytes_per_s: HEADROOM_PULL_GBYTES_PER_S, best: top, mean_ttft_change_pct: change }))
}

/// Prints one `--headroom` line, `what` and the best candidate `top` against the
/// recommendation `best`; returns the change of the mean TTFT, percent.
fn print_headroom(what: &str, top: &Candidate, best: &Candidate) -> f64 {
    let change = 100.0 * (top.mean() / best.mean() - 1.0);
    println!(
        "  {what}: mean TTFT {:.3} s ({change:+.1} % against the recommendation), p99 {:.3} s, hit {:.1} %, with {}",
        top.mean(),
        top.p99(),
        100.0 * Candidate::avg(&top.hit_ratio),
        top.label()
    );
    change
}

/// The candidates `--headroom` replays again: the recommendation, the best three and
/// round_robin (when a candidate), each once.
fn headroom_runs(best: &Candidate, cands: &[Candidate]) -> Vec<(String, serde_json::Value)> {
    let mut runs: Vec<(String, serde_json::Value)> = vec![(best.policy.clone(), best.knobs.clone())];
    for c in cands.iter().take(3).chain(cands.iter().filter(|c| c.policy == "round_robin")) {
        if !runs.iter().any(|(p, k)| *p == c.policy && *k == c.knobs) {
            runs.push((c.policy.clone(), c.knobs.clone()));
        }
    }
    runs
}

/// Sorts best first ([`Candidate::better_than`]).
fn sort(c: &mut [Candidate]) {
    c.sort_by(|a, b| {
        if a.better_than(b) {
            std::cmp::Ordering::Less
        } else if b.better_than(a) {
            std::cmp::Ordering::Greater
        } else {
            std::cmp::Ordering::Equal
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    fn args(flags: &[&str]) -> Args {
        Cli::try_parse_from(["advise", "--trace", "t.jsonl"].into_iter().chain(flags.iter().copied())).expect("flags").a
    }

    #[test]
    fn policies_naming_none_are_refused() {
        // `--policies ''` recommended keeping the current policy without evaluating any.
        for p in ["", " , "] {
            let e = candidate_policies(&args(&["--policies", p])).expect_err("refused").to_string();
            assert_eq!(e, "--policies: no policy named", "{p:?}");
        }
        let c = candidate_policies(&args(&["--policies", "round_robin", "--current", "least_load"])).expect("named");
        assert_eq!(c, ["round_robin", "least_load"]);
    }

    #[test]
    fn an_unreadable_trace_is_named_once() {
        // It was named twice: `--trace F: F: cannot read: …`.
        let mut a = args(&[]);
        a.trace = "/nonexistent/advise.jsonl".into();
        let e = format!("{:#}", load_trace(&a).expect_err("missing"));
        assert_eq!(e.matches("/nonexistent/advise.jsonl").count(), 1, "{e}");
        assert!(e.starts_with("--trace: "), "{e}");
    }

    #[test]
    fn knob_variants_halve_and_double_numeric_knobs_within_range() {
        let v = knob_variants("cache_aware");
        assert!(!v.is_empty());
        for k in &v {
            let o = k.as_object().expect("object");
            assert_eq!(o.len(), 1, "one knob at a time: {k}");
            assert!(kvroute_core::registry::build("cache_aware", k).is_ok());
        }
        assert!(knob_variants("no_such_policy").is_empty());
    }

    #[test]
    fn sub_second_traces_are_jittered_and_whole_second_ones_spread() {
        let mk = |ns: u64| TraceRequest {
            tenant: None,
            arrival: kvroute_core::types::Nanos(ns),
            input_tokens: 10,
            output_tokens: 1,
            blocks: Vec::new(),
            block_tokens: 16,
            session: None,
            turn: 0,
        };
        let fine: Vec<TraceRequest> = (0..50).map(|i| mk(1_000_000_000 + i * 3_000_001)).collect();
        let a = realisation(&fine, 1, 100.0, 1.0);
        let b = realisation(&fine, 2, 100.0, 1.0);
        assert_ne!(a.iter().map(|r| r.arrival).collect::<Vec<_>>(), b.iter().map(|r| r.arrival).collect::<Vec<_>>());
        assert!(a.iter().zip(&fine).all(|(x, y)| x.arrival.0.abs_diff(y.arrival.0) <= 200_000_000));
        assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
        let whole: Vec<TraceRequest> = (0..10).map(|_| mk(2_000_000_000)).collect();
        let c = realisation(&whole, 1, 100.0, 1.0);
        assert!(c.iter().any(|r| r.arrival.0 != 2_000_000_000));
    }
}
