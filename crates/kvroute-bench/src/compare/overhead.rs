//! `kvroute bench overhead`: proxy overhead measured by `wrk` (an external C client) against
//! two instant workers, directly and through kvroute and each peer router
//! ([`crate::overhead`]).
//!
//! A child of [`crate::compare`] so that it starts workers and routers with exactly the command
//! lines `kvroute bench compare` uses (its `Ctx::workers` and `Ctx::router`), without
//! widening their visibility.

use super::{Child, Ctx, MODEL, Target};
use crate::overhead::{self, Config, Launcher};
use anyhow::Context;
use std::path::PathBuf;

/// Flags of `kvroute bench overhead`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory of the peer venvs (`peers/` with sglang-router and vllm-router, `smg/`), as
    /// `bash scripts/compare-peers.sh install` prints it.
    #[arg(long, env = "KVROUTE_PEERS_DIR")]
    pub peers_dir: Option<PathBuf>,
    /// Peers to measure (any of sglang-router, vllm-router, smg; `""` for kvroute alone).
    #[arg(long, value_delimiter = ',', default_value = "sglang-router,vllm-router,smg")]
    pub peers: Vec<String>,
    /// kvroute policies to run (neither is `kvroute serve`'s default, `least_ttft`).
    #[arg(long, value_delimiter = ',', default_value = "cache_aware,round_robin")]
    pub policies: Vec<String>,
    /// Peer policies to run.
    #[arg(long, value_delimiter = ',', default_value = "cache_aware,round_robin")]
    pub peer_policies: Vec<String>,
    /// Instant workers (`kvroute engine-sim --instant`, separate processes).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Seconds of each measured wrk run (one at concurrency 1, one at 32, per router).
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Seconds of unmeasured warm-up at concurrency 32 before each router's runs.
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// Rounds: each runs the direct path and every router once (order rotated per round).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// wrk's per-request timeout, seconds.
    #[arg(long, default_value_t = 5)]
    pub timeout: u64,
    /// The wrk binary (default: `wrk` on PATH; Debian package `wrk`).
    #[arg(long, env = "KVROUTE_WRK")]
    pub wrk: Option<PathBuf>,
    /// Write every run's numbers as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Directory for router, worker and wrk logs (default: a new one under the temp dir).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
}

impl Launcher for Ctx {
    type Proc = Child;

    async fn workers(&self, n: usize) -> anyhow::Result<(Vec<Child>, Vec<String>)> {
        Ctx::workers(self, n, &["--instant"]).await
    }

    async fn router(&self, t: &overhead::Target, workers: &[String]) -> anyhow::Result<(Child, String)> {
        Ctx::router(self, &Target { router: t.router.clone(), policy: t.policy.clone() }, workers).await
    }

    fn pid(p: &Child) -> Option<u32> {
        p.0.id()
    }

    async fn stop(&self, p: Child) {
        p.stop().await;
    }
}

/// Runs `kvroute bench overhead`: checks the flags, starts the workers and routers through
/// `bench compare`'s launcher, measures them with wrk, prints the notes and writes the JSON.
pub fn run(mut a: Args) -> anyhow::Result<()> {
    check_args(&mut a)?;
    let wrk = overhead::find_wrk(a.wrk.as_deref())?;
    let logs = super::log_dir(a.log_dir.as_ref(), "overhead")?;
    // kvroute serve's default health-check interval (the Ctx also turns the /metrics
    // scrape on, as `bench compare` runs kvroute; every 10 s it is two small GETs).
    let ctx = Ctx::new(super::peers_dir(a.peers_dir.as_ref()), logs.clone(), 10.0, None, 0)?;
    let cfg = Config {
        wrk,
        duration_secs: a.duration,
        warmup_secs: a.warmup,
        rounds: a.rounds,
        workers: a.workers,
        targets: targets(&a),
        model: MODEL.to_string(),
        request_timeout_secs: a.timeout.max(1),
        dir: logs.clone(),
    };
    println!(
        "kvroute bench overhead: wrk -t1 -c1/-c32 -d{}s (warm-up {} s), {} routers × {} rounds, {} instant workers, non-streamed chat completions; logs in {}",
        a.duration,
        a.warmup,
        cfg.targets.len(),
        a.rounds,
        a.workers,
        logs.display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(overhead::run(&cfg, &ctx))?;
    print_notes(&report);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?).with_context(|| format!("writing {}", p.display()))?;
    }
    fail_on_errors(&report)
}

/// Drops empty `--peers` entries and checks every peer and kvroute policy is known.
fn check_args(a: &mut Args) -> anyhow::Result<()> {
    a.peers.retain(|p| !p.is_empty());
    for p in &a.peers {
        if !["sglang-router", "vllm-router", "smg"].contains(&p.as_str()) {
            anyhow::bail!("--peers: unknown peer `{p}` (sglang-router, vllm-router, smg)");
        }
    }
    for p in &a.policies {
        kvroute_core::registry::build(p, &serde_json::Value::Null).with_context(|| format!("--policies: {p}"))?;
    }
    Ok(())
}

/// The routers to measure: kvroute with each `--policies`, then each peer with each
/// `--peer-policies`.
fn targets(a: &Args) -> Vec<overhead::Target> {
    let mut targets: Vec<overhead::Target> =
        a.policies.iter().map(|p| overhead::Target { router: "kvroute".into(), policy: p.clone() }).collect();
    for peer in &a.peers {
        for p in &a.peer_policies {
            targets.push(overhead::Target { router: peer.clone(), policy: p.clone() });
        }
    }
    targets
}

/// The line under the table: what the columns mean and how busy the machine was.
fn print_notes(report: &overhead::Report) {
    println!(
        "(added p50 = router c=1 p50 − direct c=1 p50 of the same round; errors = non-2xx answers + socket errors in both runs; RSS = VmRSS of the router's process tree after its runs; {} CPUs, load average {} before, {} after; {})",
        report.cpus,
        report.load_before.map_or_else(|| "?".into(), |l| format!("{:.2}", l[0])),
        report.load_after.map_or_else(|| "?".into(), |l| format!("{:.2}", l[0])),
        report.wrk_version
    );
}

/// An error naming every router whose runs had failed requests.
fn fail_on_errors(report: &overhead::Report) -> anyhow::Result<()> {
    let failing = report.failing();
    if !failing.is_empty() {
        let names: Vec<String> = failing
            .iter()
            .map(|r| format!("{} {} (round {}: {} failed)", r.router, r.policy, r.round, r.errors()))
            .collect();
        anyhow::bail!("requests failed: {}", names.join(", "));
    }
    Ok(())
}
