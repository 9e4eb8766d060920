//! `kvroute bench`: a trace-driven or synthetic load generator for any OpenAI-compatible
//! endpoint (kvroute, a peer router, a worker), and `kvroute bench compare`, the side-by-side
//! comparison with peer routers.

use anyhow::{Context, bail};
use kvroute_bench::cli::{LoadArgs, first_model, progress, write_plots};
use kvroute_bench::{runner, summary};

/// Flags of `kvroute bench` (and the sub-command `compare`).
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// `kvroute bench compare`: kvroute against sglang-router, vllm-router and SMG;
    /// `kvroute bench overhead`: proxy overhead with wrk.
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// Sub-commands of `kvroute bench`.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Start workers, then kvroute and each peer router in turn, and compare them.
    Compare(Box<kvroute_bench::compare::Args>),
    /// Proxy overhead with wrk (an external C client): two instant workers, directly and
    /// through kvroute and each peer router, at concurrency 1 and 32.
    Overhead(kvroute_bench::compare::overhead::Args),
    /// A stand-in for a gateway calling an endpoint picker (Gateway API Inference
    /// Extension): proxies HTTP requests, asking the picker at --epp where each goes over
    /// Envoy ext_proc. For measuring `kvroute serve --epp-listen` against `kvroute serve`.
    EppGateway(EppGatewayArgs),
    /// Decision time per policy and fleet size (p50/p99/p99.9), index warmed by the
    /// Mooncake trace: the Criterion decision bench from the release binary.
    Decision(crate::cmd_bench_decision::Args),
    /// Engine KV events one router ingests (decoded and applied to the precise index) over
    /// N engines, and its decision time while it does, in one process.
    KvEvents(crate::cmd_bench_kv_events::Args),
}

/// Flags of `kvroute bench epp-gateway`.
#[derive(Debug, clap::Args)]
pub struct EppGatewayArgs {
    /// The endpoint picker's gRPC address, HOST:PORT.
    #[arg(long)]
    pub epp: String,
    /// Listen port on 127.0.0.1 (0 = any free port; the address is printed).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// How the stand-in's ext_proc filter sends bodies.
    #[arg(long, value_enum, default_value_t = kvroute_bench::epp_gateway::BodyMode::FullDuplex)]
    pub body_mode: kvroute_bench::epp_gateway::BodyMode,
}

/// Runs the stand-in gateway until SIGINT or SIGTERM, then prints the picker's round trips.
fn epp_gateway(a: EppGatewayArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let g = kvroute_bench::epp_gateway::Gateway::new(&a.epp, a.body_mode)?;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", a.port)).await?;
        println!("epp-gateway listening on http://{}", listener.local_addr()?);
        let stop = async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
        };
        kvroute_bench::epp_gateway::serve(std::sync::Arc::clone(&g), listener, stop).await?;
        let (n, p50, p99, p999) = g.pick_micros();
        println!("picker round trips: {n}, p50 {p50} us, p99 {p99} us, p99.9 {p999} us");
        Ok(())
    })
}

/// Runs `kvroute bench`.
pub fn run(a: Args) -> anyhow::Result<()> {
    match a.command {
        Some(BenchCommand::Compare(c)) => return kvroute_bench::compare::run(*c),
        Some(BenchCommand::Overhead(o)) => return kvroute_bench::compare::overhead::run(o),
        Some(BenchCommand::EppGateway(g)) => return epp_gateway(g),
        Some(BenchCommand::Decision(d)) => return crate::cmd_bench_decision::run(d),
        Some(BenchCommand::KvEvents(k)) => return crate::cmd_bench_kv_events::run(k),
        None => {}
    }
    let a = a.load;
    let Some(url) = a.url.clone() else { bail!("--url is required (or use `kvroute bench compare`)") };
    let slo = a.slo()?;
    let reqs = a.workload.build()?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let model = match &a.model {
            Some(m) => m.clone(),
            None => first_model(kvroute_bench::runner::base_urls(&url).next().unwrap_or_default()).await?,
        };
        let cfg = a.run_config(&url, &model)?;
        let label = a.label.clone().unwrap_or_else(|| url.clone());
        let span = reqs.last().map_or(0.0, |r| r.at.as_secs_f64());
        eprintln!(
            "kvroute bench: {} requests to {url} (model {model}), {}, {}",
            reqs.len(),
            if a.closed_loop {
                format!("closed loop × {}", a.max_concurrency)
            } else {
                format!("open loop over {span:.1} s")
            },
            if cfg.stream { "streaming" } else { "not streaming" }
        );
        let bar = progress(reqs.len() as u64, &label, a.quiet);
        let results = runner::run(&cfg, &reqs, Some(&bar)).await?;
        bar.finish_and_clear();
        let s = summary::summarise(&label, &results, a.latency_scale, slo);
        print!("{}", summary::table(std::slice::from_ref(&s)));
        if !s.failures.is_empty() {
            println!("failures: {:?}", s.failures);
        }
        if !s.worker_share.is_empty() {
            let shares: Vec<String> = s.worker_share.iter().map(|(w, x)| format!("{w} {:.1}%", x * 100.0)).collect();
            println!("share per worker: {}", shares.join(", "));
        }
        if let Some(p) = &a.json {
            let doc = serde_json::json!({"summary": s, "requests": results});
            std::fs::write(p, serde_json::to_vec_pretty(&doc)?).with_context(|| format!("writing {}", p.display()))?;
        }
        if let Some(dir) = &a.plots {
            write_plots(dir, "bench", std::slice::from_ref(&s), &format!("TTFT CDF: {label}"))?;
        }
        Ok(())
    })
}
