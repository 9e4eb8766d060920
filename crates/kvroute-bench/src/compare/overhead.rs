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
    /// kvroute policies to run (`cache_aware` is `kvroute serve`'s default).
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

/// Runs `kvroute bench overhead`.
pub fn run(mut a: Args) -> anyhow::Result<()> {
    a.peers.retain(|p| !p.is_empty());
    for p in &a.peers {
        if !["sglang-router", "vllm-router", "smg"].contains(&p.as_str()) {
            anyhow::bail!("--peers: unknown peer `{p}` (sglang-router, vllm-router, smg)");
        }
    }
    for p in &a.policies {
        kvroute_core::registry::build(p, &serde_json::Value::Null).with_context(|| format!("--policies: {p}"))?;
    }
    let wrk = overhead::find_wrk(a.wrk.as_deref())?;
    let logs = match &a.log_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("kvroute-overhead-{}", std::process::id())),
    };
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut targets: Vec<overhead::Target> =
        a.policies.iter().map(|p| overhead::Target { router: "kvroute".into(), policy: p.clone() }).collect();
    for peer in &a.peers {
        for p in &a.peer_policies {
            targets.push(overhead::Target { router: peer.clone(), policy: p.clone() });
        }
    }
    let peers_dir = a.peers_dir.clone().unwrap_or_else(|| {
        std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from).join(".cache/kvroute/peers")
    });
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ctx = Ctx {
        exe: std::env::current_exe().context("locating the kvroute binary")?,
        peers_dir,
        logs: logs.clone(),
        client: reqwest::Client::builder().build()?,
        seq: Default::default(),
        // kvroute serve's default health-check interval (the Ctx also turns the /metrics
        // scrape on, as `bench compare` runs kvroute; every 10 s it is two small GETs).
        scrape_secs: 10.0,
        model: MODEL.to_string(),
        llama: None,
        llama_cache_ram: 0,
        kv_events: Default::default(),
    };
    let cfg = Config {
        wrk,
        duration_secs: a.duration,
        warmup_secs: a.warmup,
        rounds: a.rounds,
        workers: a.workers,
        targets,
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
    println!(
        "(added p50 = router c=1 p50 − direct c=1 p50 of the same round; errors = non-2xx answers + socket errors in both runs; RSS = VmRSS of the router's process tree after its runs; {} CPUs, load average {} before, {} after; {})",
        report.cpus,
        report.load_before.map_or_else(|| "?".into(), |l| format!("{:.2}", l[0])),
        report.load_after.map_or_else(|| "?".into(), |l| format!("{:.2}", l[0])),
        report.wrk_version
    );
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?).with_context(|| format!("writing {}", p.display()))?;
    }
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
