//! `kvroute demo`: 4 simulated engines, the gateway, and the multi-turn conversations of
//! a Mooncake trace slice replayed over real HTTP near the fleet's knee — under
//! `round_robin`, `cache_aware` (SGLang router's) and `least_ttft` (kvroute's default) in turn —
//! with a side-by-side table and a TTFT plot. The trace is the copy vendored in
//! `data/traces/`, so the demo needs nothing outside the repository.
//!
//! Prompt text is synthesised from the trace's `hash_ids`: each 512-token block becomes
//! 2,048 deterministic characters derived from its id, so requests sharing block ids share
//! a text prefix (and the engines' prefix caches see exactly the trace's reuse).

use anyhow::{Context, bail};
use kvroute_bench::runner::{self, Api, Mode, RunConfig};
use kvroute_bench::summary::{self, Slo};
use kvroute_bench::workload::{self, BenchRequest};
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use kvroute_sim::engine::Profile;
use kvroute_sim::trace;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Flags of `kvroute demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Mooncake trace (default: the copy vendored in the repository, data/traces/).
    #[arg(long, env = "KVROUTE_TRACE")]
    pub trace: Option<PathBuf>,
    /// Start of the trace slice, seconds from the trace start.
    #[arg(long, default_value_t = 0.0)]
    pub start_secs: f64,
    /// Length of the trace slice, seconds of the trace's own time.
    #[arg(long, default_value_t = 1200.0)]
    pub window_secs: f64,
    /// Keep the conversations with at least this many turns in the slice (Mooncake's
    /// depth-2 prefix groups): the traffic a prefix cache can serve.
    #[arg(long, default_value_t = 3)]
    pub min_turns: usize,
    /// Drop conversations with a prompt longer than this many tokens.
    #[arg(long, default_value_t = 32_768)]
    pub max_input_tokens: u32,
    /// Arrival-rate multiplier of the slice (the default is past round robin's knee on 4
    /// engines, and below a prefix-aware policy's).
    #[arg(long, default_value_t = 10.0)]
    pub rate_scale: f64,
    /// At most this many requests per policy.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Policies compared, comma-separated (the first is the baseline).
    #[arg(long, default_value = "round_robin,cache_aware,least_ttft")]
    pub policies: String,
    /// Simulated seconds per wall second (engines and arrivals alike). Averaged over 3
    /// runs, the HTTP runs' mean TTFT is within 6 % of `kvroute replay`'s of the same slice
    /// at 10× and at 5×; every wall millisecond of client, router and HTTP stack (1.0–1.5 ms
    /// a request on a 2-core machine) is that many simulated ones (docs/replay.md, Checks).
    #[arg(long, default_value_t = 10.0)]
    pub time_scale: f64,
    /// Cap on output tokens per request (at least 1).
    #[arg(long, default_value_t = 128)]
    pub max_output: u32,
    /// Write the TTFT CDF plot as PLOT.png and PLOT.svg ("" for none).
    #[arg(long, default_value = "kvroute-demo-ttft")]
    pub plot: String,
    /// Keep a router (with the last policy) running afterwards.
    #[arg(long)]
    pub serve: bool,
    /// Port of the router with --serve.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
}

/// Result of one policy run.
#[derive(Debug, Clone)]
pub struct DemoRow {
    /// Policy.
    pub policy: String,
    /// Requests sent.
    pub sent: usize,
    /// Requests answered successfully.
    pub ok: usize,
    /// Prefix-cache hit ratio over all engines (tokens).
    pub hit_ratio: f64,
    /// TTFT p50, simulated seconds.
    pub ttft_p50: f64,
    /// TTFT p99, simulated seconds.
    pub ttft_p99: f64,
    /// TTFT mean, simulated seconds.
    pub ttft_mean: f64,
    /// Completed requests per simulated second.
    pub throughput: f64,
    /// TTFT CDF points (simulated seconds, share of requests).
    pub ttft_cdf: Vec<(f64, f64)>,
}

struct Fleet {
    sims: Vec<Arc<engine_sim::EngineSim>>,
    urls: Vec<String>,
    stop: tokio_util::sync::CancellationToken,
}

async fn start_fleet(n: usize, time_scale: f64) -> anyhow::Result<Fleet> {
    let stop = tokio_util::sync::CancellationToken::new();
    let mut sims = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..n {
        let profile = Profile::named("h100-llama3-8b").context("profile")?;
        let cfg = EngineSimConfig { profile, time_scale, ..EngineSimConfig::default() };
        let (url, sim) = engine_sim::spawn_local(cfg, stop.clone()).await?;
        urls.push(url);
        sims.push(sim);
    }
    Ok(Fleet { sims, urls, stop })
}

async fn start_router(
    urls: &[String],
    policy: &str,
    port: u16,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<String> {
    let cfg = GatewayConfig {
        port,
        policy: policy.to_string(),
        worker_urls: urls.to_vec(),
        health: kvroute_gateway::config::HealthConfig { interval_secs: 2.0, ..Default::default() },
        // One tenant, the demo's own client: the table counts requests per worker.
        expose_decision_headers: true,
        // No load balancer in front: stop accepting as soon as the run ends.
        drain_delay_secs: 0.0,
        ..GatewayConfig::default()
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.with_context(|| format!("port {port}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = kvroute_gateway::serve(listener, cfg, async move { stop.cancelled().await }).await {
            eprintln!("kvroute: router error: {e:#}");
        }
    });
    Ok(url)
}

async fn run_policy(
    a: &Args,
    reqs: &[BenchRequest],
    policy: &str,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<DemoRow> {
    let fleet = start_fleet(a.engines, a.time_scale).await?;
    let router = start_router(&fleet.urls, policy, 0, fleet.stop.clone()).await?;
    let client = reqwest::Client::builder().build()?;
    // Wait until the router sees the workers.
    for _ in 0..100 {
        if client.get(format!("{router}/readiness")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bar.set_message(policy.to_string());
    let cfg = RunConfig {
        url: router,
        model: "sim-llama-3-8b".into(),
        api: Api::Completions,
        stream: true,
        mode: Mode::Open,
        max_concurrency: 512,
        duration: None,
        timeout: Duration::from_secs(120),
    };
    let results = runner::run(&cfg, reqs, Some(bar)).await?;
    let s = summary::summarise(policy, &results, a.time_scale, Slo { ttft_s: f64::INFINITY, tpot_s: f64::INFINITY });
    let (mut hit, mut q) = (0u64, 0u64);
    for sim in &fleet.sims {
        let st = sim.stats();
        hit += st.prefix_hit_tokens;
        q += st.prefix_queries_tokens;
    }
    fleet.stop.cancel();
    Ok(DemoRow {
        policy: policy.to_string(),
        sent: reqs.len(),
        ok: s.ok as usize,
        hit_ratio: hit as f64 / q.max(1) as f64,
        ttft_p50: s.latency.ttft_p50_s,
        ttft_p99: s.latency.ttft_p99_s,
        ttft_mean: s.latency.ttft_mean_s,
        throughput: s.throughput_rps,
        ttft_cdf: s.ttft_cdf.clone(),
    })
}

/// Runs `kvroute demo`: checks the flags, cuts the trace slice, runs every policy in turn
/// over HTTP, prints the table and the plot, and with `--serve` keeps a router running.
pub fn run(a: Args) -> anyhow::Result<()> {
    let policies = check_args(&a)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let path = kvroute_sim::trace::find_default(a.trace.as_deref())?;
    let reqs = load_slice(&a, &path)?;
    print_intro(&a, &path, &reqs);
    let load = workload::from_trace(&reqs, a.time_scale, a.max_output);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let bar = indicatif::ProgressBar::new((reqs.len() * policies.len()) as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg:<12} [{bar:40}] {pos}/{len} requests ({elapsed})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut rows = Vec::new();
        for p in &policies {
            rows.push(run_policy(&a, &load, p, &bar).await?);
        }
        bar.finish_and_clear();
        print_table(&rows);
        if !a.plot.is_empty() {
            plot(&a, &rows);
        }
        if a.serve {
            serve(&a, &policies).await?;
        }
        Ok(())
    })
}

/// Checks the numeric flags and returns the policies, each one the registry knows.
fn check_args(a: &Args) -> anyhow::Result<Vec<String>> {
    if a.engines == 0 || a.requests == 0 {
        bail!("--engines and --requests must be at least 1");
    }
    workload::check_max_output(a.max_output).map_err(anyhow::Error::msg)?;
    trace::check_rate_scale(&[], a.time_scale).map_err(|e| anyhow::anyhow!("--time-scale: {e}"))?;
    trace::check_rate_scale(&[], a.rate_scale).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
    if !(a.window_secs.is_finite() && a.window_secs > 0.0 && a.start_secs.is_finite() && a.start_secs >= 0.0) {
        bail!("--start-secs must be >= 0 and --window-secs > 0");
    }
    let policies: Vec<String> =
        a.policies.split(',').map(str::trim).filter(|p| !p.is_empty()).map(str::to_string).collect();
    if policies.is_empty() {
        bail!("--policies: none named");
    }
    for p in &policies {
        kvroute_core::registry::build(p, &serde_json::Value::Null).with_context(|| format!("--policies: `{p}`"))?;
    }
    Ok(policies)
}

/// The slice of the trace the demo sends: its conversations of `--min-turns` or more in
/// the window, from time 0, at `--rate-scale`, at most `--requests`.
fn load_slice(a: &Args, path: &std::path::Path) -> anyhow::Result<Vec<trace::TraceRequest>> {
    let mut reqs = trace::read(path, None)?;
    trace::spread_seconds(&mut reqs);
    let slice = trace::SessionSlice {
        start_secs: a.start_secs,
        window_secs: Some(a.window_secs),
        min_turns: a.min_turns,
        max_input_tokens: Some(a.max_input_tokens),
    };
    let mut reqs = trace::session_slice(reqs, &slice);
    trace::rebase(&mut reqs);
    trace::check_rate_scale(&reqs, a.rate_scale).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
    trace::scale_rate(&mut reqs, a.rate_scale);
    reqs.truncate(a.requests);
    if reqs.is_empty() {
        bail!("no request left in the slice: widen --window-secs or lower --min-turns");
    }
    // The engines' clock and the arrivals run --time-scale times faster.
    trace::check_rate_scale(&reqs, a.time_scale).map_err(|e| anyhow::anyhow!("--time-scale: {e}"))?;
    Ok(reqs)
}

/// The opening line: what is sent, how much of it a cache could serve, and onto what.
fn print_intro(a: &Args, path: &std::path::Path, reqs: &[trace::TraceRequest]) {
    let bound = trace::infinite_cache_hit(reqs);
    let span = reqs.last().map_or(0.0, |r| r.arrival.as_secs_f64());
    println!(
        "kvroute demo: {} requests of Mooncake conversations with >= {} turns (trace {}, {:.0}-{:.0} s, x{} rate: \
         {:.0} s of traffic, mean prompt {} tokens, at most {:.1} % of prompt tokens cacheable) on {} simulated \
         H100 engines (Llama-3-8B profile, {}x faster than real time), over real HTTP through the kvroute gateway",
        reqs.len(),
        a.min_turns,
        path.canonicalize().unwrap_or_else(|_| path.to_path_buf()).display(),
        a.start_secs,
        a.start_secs + a.window_secs,
        a.rate_scale,
        span,
        reqs.iter().map(|r| r.input_tokens as u64).sum::<u64>() / reqs.len() as u64,
        100.0 * bound.0 as f64 / bound.1.max(1) as f64,
        a.engines,
        a.time_scale
    );
}

/// The side-by-side table, and the best policy against the first (the baseline).
fn print_table(rows: &[DemoRow]) {
    println!();
    println!(
        "{:<14} {:>9} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "policy", "ok/sent", "hit %", "TTFT mean", "TTFT p50", "TTFT p99", "req/s"
    );
    for r in rows {
        println!(
            "{:<14} {:>4}/{:<4} {:>8.1} {:>9.3}s {:>9.3}s {:>9.3}s {:>10.2}",
            r.policy,
            r.ok,
            r.sent,
            r.hit_ratio * 100.0,
            r.ttft_mean,
            r.ttft_p50,
            r.ttft_p99,
            r.throughput
        );
    }
    println!(
        "(TTFT in simulated seconds, measured at the client; hit % = prompt tokens served from the engines' prefix caches)"
    );
    if let (Some(base), Some(best)) =
        (rows.first(), rows.iter().skip(1).min_by(|x, y| x.ttft_mean.total_cmp(&y.ttft_mean)))
        && best.ttft_mean > 0.0
    {
        println!(
            "{} against {}: mean TTFT {:.2}x, p99 {:.2}x, prompt tokens served from cache {:.1} % against {:.1} %",
            best.policy,
            base.policy,
            best.ttft_mean / base.ttft_mean,
            best.ttft_p99 / base.ttft_p99.max(1e-9),
            100.0 * best.hit_ratio,
            100.0 * base.hit_ratio
        );
    }
}

/// `--plot`: the TTFT CDF of every policy as PLOT.png and PLOT.svg (a failure is a warning).
fn plot(a: &Args, rows: &[DemoRow]) {
    let stem = PathBuf::from(&a.plot);
    let series: Vec<(&str, &[(f64, f64)])> = rows.iter().map(|r| (r.policy.as_str(), r.ttft_cdf.as_slice())).collect();
    let max_x = rows.iter().map(|r| r.ttft_p99).fold(0.1_f64, f64::max) * 1.2;
    let title = format!("kvroute demo: TTFT CDF, {} engines, Mooncake conversations", a.engines);
    match kvroute_sim::report::plot_cdf_series(&stem, &series, max_x, &title) {
        Ok(()) => println!("plot: {}", stem.with_extension("png").display()),
        Err(e) => eprintln!("kvroute: warning: plot skipped: {e}"),
    }
}

/// `--serve`: a fresh fleet at real time and a router with the last policy on `--port`,
/// until Ctrl-C.
async fn serve(a: &Args, policies: &[String]) -> anyhow::Result<()> {
    let fleet = start_fleet(a.engines, 1.0).await?;
    let last = policies.last().map_or(kvroute_core::registry::DEFAULT_POLICY, String::as_str);
    let url = start_router(&fleet.urls, last, a.port, fleet.stop.clone()).await?;
    println!("\nrouter on {url} (policy {last}), {} simulated engines; Ctrl-C to stop. Try:", a.engines);
    println!(
        "  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"sim-llama-3-8b\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":8}}' -D - "
    );
    crate::cmd_serve::shutdown_signal().await;
    fleet.stop.cancel();
    Ok(())
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

    #[test]
    fn a_max_output_of_zero_is_refused_as_in_replay() {
        let args = |flags: &[&str]| {
            Cli::try_parse_from(std::iter::once("demo").chain(flags.iter().copied())).expect("flags").a
        };
        let e = check_args(&args(&["--max-output", "0"])).expect_err("refused").to_string();
        assert_eq!(e, "--max-output must be at least 1");
        assert!(check_args(&args(&["--max-output", "1"])).is_ok());
    }
}
