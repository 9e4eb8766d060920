//! The engine of `kvroute bench compare`: kvroute and the peer routers people run today (sglang-router,
//! vllm-router, SMG), one after another in front of the same simulated workers, with the same
//! load generator, in one run and one table.
//!
//! Two measurements per router and policy:
//! - **proxy overhead**: instant workers (`engine-sim --instant`), closed loop at concurrency
//!   1 and 32, non-streamed chat completions; added latency = router p50/p99 − the p50/p99
//!   of the same load sent straight to one worker;
//! - **routing quality**: a Mooncake conversation slice replayed by its timestamps onto
//!   engine simulators with realistic H100 timing (run `--time-scale`× faster than real time,
//!   arrivals likewise; latencies reported in simulated seconds), workers restarted cold for
//!   every run; prefix-cache hit ratio and request shares from the workers' own `/metrics`.
//!   kvroute scrapes the workers' `/metrics` (queue, KV usage, SM activity) every simulated
//!   5 s, Cognitora cgn-router's heartbeat; the peers use their own defaults.
//!
//! Peers come from the venvs `scripts/compare-peers.sh` installs (`--peers-dir`); a peer
//! whose venv is missing is reported as skipped, never silently dropped.
//!
//! `dynamo` is NVIDIA Dynamo 1.6.1's selection service (its KV router: radix index fed by the
//! workers' KV events, prefill/decode load cost) behind `scripts/dynamo-shim.py`, a forwarding
//! shim of this harness (reserve → forward → release); its workers publish KV events over
//! ZeroMQ. Its one policy is labelled `kv`; its overhead columns include the shim.

pub mod overhead;

use crate::cli::{self as cmd_bench, WorkloadArgs};
use crate::runner::{self, Api, Mode, RunConfig};
use crate::summary::{self, Slo, Summary};
use crate::workload::{self, Arrivals};
use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Suffix of a kvroute policy name in `--policies` that turns on llama.cpp slot routing.
pub const SLOTS_SUFFIX: &str = "/slots";

/// Suffix of a kvroute policy name in `--policies` that turns on llama.cpp slot routing and
/// the KV mover (`--kv-migration-dir`, the workers' shared `--slot-save-path`).
pub const SLOTS_KV_SUFFIX: &str = "/slots+kv";

/// The KV mover's smallest prefix in `bench compare`, tokens: the bench's documents are a
/// few hundred tokens (`--document-tokens`), below `kv_migration.min_tokens`' default.
pub const BENCH_KV_MIN_TOKENS: u32 = 128;

/// Flags of `kvroute bench compare`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory of the peer venvs (`peers/` with sglang-router and vllm-router, `smg/`,
    /// `dynamo/`).
    #[arg(long, env = "KVROUTE_PEERS_DIR")]
    pub peers_dir: Option<PathBuf>,
    /// Peers to compare (any of sglang-router, vllm-router, smg, dynamo). `dynamo` runs once,
    /// with its KV router (policy `kv`), whatever --peer-policies says, and only in front of
    /// simulated workers.
    #[arg(long, value_delimiter = ',', default_value = "sglang-router,vllm-router,smg,dynamo")]
    pub peers: Vec<String>,
    /// kvroute policies to run. A name ending in `/slots` runs kvroute with
    /// `--llama-slot-routing true` (llama.cpp workers without a host prompt cache:
    /// `--llama-cache-ram 0`); `/slots+kv` also turns on the KV mover (the llama.cpp
    /// workers share a `--slot-save-path` in the log directory).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,cache_aware,prefix_affinity,kv_score,lmetric,unified,prefill_cost,least_ttft"
    )]
    pub policies: Vec<String>,
    /// Peer policies to run.
    #[arg(long, value_delimiter = ',', default_value = "round_robin,cache_aware")]
    pub peer_policies: Vec<String>,
    /// Workers per run (simulated, or llama.cpp with --engine llama).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Worker engine: `sim` (kvroute engine-sim, simulated H100s) or `llama` (real
    /// llama.cpp `llama-server` processes, 1 thread and 2 slots each, started cold per run).
    #[arg(long, default_value = "sim", value_parser = ["sim", "llama"])]
    pub engine: String,
    /// With `--engine sim`: the engine-sim profile of the workers (h100-llama3-8b,
    /// a100-llama3-8b, or cpu-smollm2-135m: two llama.cpp slots without a host prompt cache,
    /// the simulated stand-in of `--engine llama`).
    #[arg(long, default_value = "h100-llama3-8b")]
    pub sim_profile: String,
    /// With `--engine sim`: overrides of the profile's constants as a JSON object (engine-sim
    /// `--profile-set`), e.g. the calibration `scripts/sim-to-real.py` prints.
    #[arg(long)]
    pub sim_profile_set: Option<String>,
    /// llama-server binary (`scripts/llama-workers.sh paths` prints it).
    #[arg(long, env = "KVROUTE_LLAMA_SERVER")]
    pub llama_server: Option<PathBuf>,
    /// GGUF model for llama-server.
    #[arg(long, env = "KVROUTE_LLAMA_MODEL")]
    pub llama_model: Option<PathBuf>,
    /// llama-server's host-RAM prompt cache per worker, MiB (`--cache-ram`; 0 = off, the
    /// default, so a worker holds only its slots' prompts; llama.cpp's own default is 8192).
    /// A bounded cache makes each worker an LRU prefix cache of finite size, as a GPU
    /// engine's KV pool is (SmolLM2-135M: ≈ 22.5 KiB per token, so 64 MiB ≈ 2,900 tokens).
    #[arg(long, default_value_t = 0)]
    pub llama_cache_ram: u32,
    /// Routing quality: scale the trace's blocks down to this many tokens (prompts shrink
    /// alike), e.g. 16 to fit Mooncake's 512-token blocks to a small CPU model.
    #[arg(long)]
    pub block_tokens: Option<u32>,
    /// Routing quality: the part of the trace to send.
    #[command(flatten)]
    pub slice: crate::cli::TraceSliceArgs,
    /// Routing quality: a workload instead of the Mooncake trace. `shared-prefix`: groups
    /// of prompts sharing a system prompt, Poisson arrivals at --rate. `mtbench`: the real
    /// MT-bench questions as two-turn conversations started at --rate per second, turn 2
    /// sent when turn 1's answer is complete and carrying that answer (--output-tokens each).
    #[arg(long, value_parser = ["shared-prefix", "mtbench"])]
    pub workload: Option<String>,
    /// mtbench: conversations (the first N questions; 0 = all 80).
    #[arg(long, default_value_t = 40)]
    pub conversations: usize,
    /// mtbench: tokens of a reference document in each conversation's system message
    /// (0: none), as in docs/real-engines.md's workload (b) (~300).
    #[arg(long, default_value_t = 0)]
    pub document_tokens: u32,
    /// mtbench: distinct documents (0: one per conversation; fewer share prefixes across
    /// conversations).
    #[arg(long, default_value_t = 0)]
    pub documents: usize,
    /// mtbench: share of conversations on document 0, the hot one (the rest take the
    /// others in turn): one document popular enough to overload its holder.
    #[arg(long, default_value_t = 0.0)]
    pub hot_document_share: f64,
    /// mtbench: run this many conversations at a time, each starting when one ends (closed
    /// loop; 0: open loop, started at --rate).
    #[arg(long, default_value_t = 0)]
    pub conversation_concurrency: usize,
    /// mtbench: the questions file (default: `mtbench_question.jsonl` beside the trace).
    #[arg(long)]
    pub mtbench: Option<PathBuf>,
    /// shared-prefix: groups (distinct system prompts).
    #[arg(long, default_value_t = 4)]
    pub groups: usize,
    /// shared-prefix: prompts per group (--groups × --prompts-per-group at most 10,000,000).
    #[arg(long, default_value_t = 6)]
    pub prompts_per_group: usize,
    /// shared-prefix: system prompt tokens.
    #[arg(long, default_value_t = 512)]
    pub system_tokens: u32,
    /// shared-prefix: question tokens.
    #[arg(long, default_value_t = 32)]
    pub question_tokens: u32,
    /// shared-prefix: output tokens.
    #[arg(long, default_value_t = 16)]
    pub output_tokens: u32,
    /// shared-prefix: arrival rate, requests per second.
    #[arg(long, default_value_t = 0.2)]
    pub rate: f64,
    /// Routing quality: cap of each request's output tokens.
    #[arg(long, default_value_t = 128)]
    pub max_output: u32,
    /// Routing quality: Mooncake trace (default: the shared conversation trace).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Routing quality: requests from the start of the trace.
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Routing quality: engines and arrivals run this many times faster than real time.
    #[arg(long, default_value_t = 25.0)]
    pub time_scale: f64,
    /// Routing quality: extra arrival-rate multiplier on top of the time scale (load).
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Overhead: seconds per (router, concurrency) point.
    #[arg(long, default_value_t = 4.0)]
    pub overhead_secs: f64,
    /// Skip the overhead measurement.
    #[arg(long)]
    pub skip_overhead: bool,
    /// Skip the routing-quality measurement.
    #[arg(long)]
    pub skip_quality: bool,
    /// Goodput SLO: TTFT, simulated seconds.
    #[arg(long, default_value_t = 2.0)]
    pub slo_ttft: f64,
    /// Goodput SLO: TPOT, simulated seconds.
    #[arg(long, default_value_t = 0.1)]
    pub slo_tpot: f64,
    /// Write every summary as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write plots (compare_ttft_cdf, compare_worker_share) into this directory.
    #[arg(long)]
    pub plots: Option<PathBuf>,
    /// Directory for router and worker logs (default: a new one under the temp dir).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

/// A router under test.
#[derive(Debug, Clone)]
struct Target {
    router: String,
    policy: String,
}

impl Target {
    fn label(&self) -> String {
        format!("{} {}", self.router, self.policy)
    }
}

/// A child process killed when dropped.
struct Child(tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

impl Child {
    async fn stop(mut self) {
        let _ = self.0.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.0.wait()).await;
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(crate::free_port()?)
}

struct Ctx {
    exe: PathBuf,
    peers_dir: PathBuf,
    logs: PathBuf,
    client: reqwest::Client,
    seq: std::sync::atomic::AtomicUsize,
    /// kvroute's health-check and `/metrics` scrape interval, wall seconds.
    scrape_secs: f64,
    /// `model` of every request (engine-sim's name, or the llama-server alias).
    model: String,
    /// llama-server binary and model, when the workers are llama.cpp.
    llama: Option<(PathBuf, PathBuf)>,
    /// llama-server `--cache-ram`, MiB.
    llama_cache_ram: u32,
    /// KV-event endpoint (ZeroMQ PUB) of each engine-sim worker started with them, by URL.
    kv_events: std::sync::Mutex<BTreeMap<String, String>>,
}

/// The Dynamo forwarding shim, written into the log directory when Dynamo is run.
const DYNAMO_SHIM: &str = include_str!("../../../../scripts/dynamo-shim.py");

impl Ctx {
    /// A launcher for this binary's workers and kvroute, and the peers under `peers_dir`,
    /// logging into `logs`; `llama` names llama-server and its model when the workers are
    /// llama.cpp (requests then ask for the model `smollm2`).
    fn new(
        peers_dir: PathBuf,
        logs: PathBuf,
        scrape_secs: f64,
        llama: Option<(PathBuf, PathBuf)>,
        llama_cache_ram: u32,
    ) -> anyhow::Result<Ctx> {
        let exe = std::env::current_exe().context("locating the kvroute binary")?;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let model = if llama.is_some() { "smollm2".to_string() } else { MODEL.to_string() };
        Ok(Ctx {
            exe,
            peers_dir,
            logs,
            client: reqwest::Client::builder().build()?,
            seq: Default::default(),
            scrape_secs,
            model,
            llama,
            llama_cache_ram,
            kv_events: Default::default(),
        })
    }

    fn spawn(&self, program: &std::path::Path, args: &[String], name: &str) -> anyhow::Result<Child> {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = self.logs.join(format!("{n:03}-{name}.log"));
        let f = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Child(child))
    }

    /// The llama.cpp workers' `--slot-save-path` (shared by the workers of a run).
    fn slot_dir(&self) -> PathBuf {
        self.logs.join("slots")
    }

    /// Starts `n` workers — engine-sim with `extra` flags, or llama-server (one thread, two
    /// slots, 8192 context, `--cache-ram` from `--llama-cache-ram`, 0 by default as
    /// `scripts/llama-workers.sh` runs them) — and waits until each answers /health.
    async fn workers(&self, n: usize, extra: &[&str]) -> anyhow::Result<(Vec<Child>, Vec<String>)> {
        self.workers_kv(n, extra, false).await
    }

    /// [`Ctx::workers`]; with `kv_events`, engine-sim workers also publish their KV events
    /// (vLLM's positional msgpack, which Dynamo decodes) on a ZeroMQ PUB socket of their own,
    /// remembered in `self.kv_events`.
    async fn workers_kv(&self, n: usize, extra: &[&str], kv_events: bool) -> anyhow::Result<(Vec<Child>, Vec<String>)> {
        let (mut kids, mut urls) = (Vec::new(), Vec::new());
        if self.llama.is_some() {
            // Each set of cold workers starts with an empty slot directory.
            let _ = std::fs::remove_dir_all(self.slot_dir());
            std::fs::create_dir_all(self.slot_dir()).context("creating the workers' slot directory")?;
        }
        for i in 0..n {
            let port = free_port()?;
            match &self.llama {
                None => {
                    let mut args = vec!["engine-sim".to_string(), "--port".into(), port.to_string()];
                    args.extend(extra.iter().map(|s| s.to_string()));
                    if kv_events {
                        let endpoint = format!("tcp://127.0.0.1:{}", free_port()?);
                        args.extend([
                            "--kv-events".to_string(),
                            endpoint.clone(),
                            "--kv-encoding".into(),
                            "legacy".into(),
                        ]);
                        self.kv_events
                            .lock()
                            .map_err(|_| anyhow::anyhow!("kv_events lock"))?
                            .insert(format!("http://127.0.0.1:{port}"), endpoint);
                    }
                    kids.push(self.spawn(&self.exe, &args, &format!("worker{i}"))?);
                }
                Some((bin, model)) => {
                    let args: Vec<String> = [
                        "-m",
                        &model.display().to_string(),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        &port.to_string(),
                        "-t",
                        "1",
                        "-np",
                        "2",
                        "-c",
                        "8192",
                        "--cache-ram",
                        &self.llama_cache_ram.to_string(),
                        "--metrics",
                        "--slots",
                        "--no-webui",
                        "--alias",
                        &self.model,
                        "--slot-save-path",
                        &self.slot_dir().display().to_string(),
                    ]
                    .map(String::from)
                    .to_vec();
                    kids.push(self.spawn(bin, &args, &format!("llama{i}"))?);
                }
            }
            urls.push(format!("http://127.0.0.1:{port}"));
        }
        for u in &urls {
            self.wait_ok(&format!("{u}/health"), None, Duration::from_secs(120))
                .await
                .with_context(|| format!("worker {u}"))?;
        }
        Ok((kids, urls))
    }

    /// Polls `url` (GET, or POST `body`) until it answers 2xx.
    async fn wait_ok(&self, url: &str, body: Option<&serde_json::Value>, within: Duration) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let mut last = String::from("no answer");
        while t0.elapsed() < within {
            let req = match body {
                Some(b) => self.client.post(url).json(b),
                None => self.client.get(url),
            };
            match req.timeout(Duration::from_secs(5)).send().await {
                Ok(r) if r.status().is_success() => return Ok(()),
                Ok(r) => last = format!("HTTP {}", r.status()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("{url} not ready after {:?}: {last}", within)
    }

    /// Starts the router of `t` in front of `workers`; returns it and its URL once it
    /// forwards a chat completion.
    async fn router(&self, t: &Target, workers: &[String]) -> anyhow::Result<(Child, String)> {
        let (port, prom) = (free_port()?, free_port()?);
        let (program, mut args) = self.router_command(t, workers, port, prom)?;
        if !program.exists() {
            bail!("{} is not installed (run scripts/compare-peers.sh, which installs the peers)", program.display());
        }
        args.shrink_to_fit();
        let child = self.spawn(&program, &args, &t.label().replace([' ', '/'], "-"))?;
        let url = format!("http://127.0.0.1:{port}");
        let warm = serde_json::json!({"model": self.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1});
        self.wait_ok(&format!("{url}/v1/chat/completions"), Some(&warm), Duration::from_secs(90))
            .await
            .with_context(|| format!("{} did not come up (logs in {})", t.label(), self.logs.display()))?;
        Ok((child, url))
    }

    /// The program and arguments that start the router of `t` on `port` (peers: their
    /// Prometheus exporter, or Dynamo's selection service, on `prom`) in front of `workers`.
    fn router_command(
        &self,
        t: &Target,
        workers: &[String],
        port: u16,
        prom: u16,
    ) -> anyhow::Result<(PathBuf, Vec<String>)> {
        let host = ["--host".to_string(), "127.0.0.1".into(), "--port".into(), port.to_string()];
        let worker_args: Vec<String> =
            std::iter::once("--worker-urls".to_string()).chain(workers.iter().cloned()).collect();
        let policy = ["--policy".to_string(), t.policy.clone()];
        Ok(match t.router.as_str() {
            "kvroute" => (self.exe.clone(), self.kvroute_args(t, &host, workers)),
            "sglang-router" => {
                let mut a = vec!["-m".to_string(), "sglang_router.launch_router".into()];
                a.extend(host.iter().cloned());
                a.extend(worker_args.iter().cloned());
                a.extend(policy.iter().cloned());
                a.extend(["--prometheus-host", "127.0.0.1", "--log-level", "warn"].map(String::from));
                a.extend(["--prometheus-port".to_string(), prom.to_string()]);
                (self.peers_dir.join("peers/bin/python"), a)
            }
            "vllm-router" => {
                let mut a: Vec<String> = host.to_vec();
                a.extend(worker_args.iter().cloned());
                a.extend(policy.iter().cloned());
                a.extend(["--log-level".to_string(), "warning".into(), "--prometheus-port".into(), prom.to_string()]);
                (self.peers_dir.join("peers/bin/vllm-router"), a)
            }
            "smg" => {
                let mut a = vec!["launch".to_string()];
                a.extend(host.iter().cloned());
                a.extend(worker_args.iter().cloned());
                a.extend(policy.iter().cloned());
                a.extend(["--prometheus-host", "127.0.0.1", "--log-level", "warn"].map(String::from));
                a.extend(["--prometheus-port".to_string(), prom.to_string()]);
                (self.peers_dir.join("smg/bin/smg"), a)
            }
            "dynamo" => (self.peers_dir.join("dynamo/bin/python"), self.dynamo_args(workers, port, prom)?),
            other => bail!("unknown router {other}"),
        })
    }

    /// `kvroute serve`'s arguments for `t`, deployed as in front of vLLM (or llama.cpp).
    fn kvroute_args(&self, t: &Target, host: &[String], workers: &[String]) -> Vec<String> {
        let mut a = vec!["serve".to_string()];
        a.extend(host.iter().cloned());
        if let Some(name) = t.policy.strip_suffix(SLOTS_KV_SUFFIX) {
            a.extend(["--policy", name, "--llama-slot-routing", "true"].map(String::from));
            a.extend(["--kv-migration-dir".to_string(), self.slot_dir().display().to_string()]);
            a.extend(["--kv-migration-min-tokens".to_string(), BENCH_KV_MIN_TOKENS.to_string()]);
        } else if let Some(name) = t.policy.strip_suffix(SLOTS_SUFFIX) {
            a.extend(["--policy", name, "--llama-slot-routing", "true"].map(String::from));
        } else {
            a.extend(["--policy".to_string(), t.policy.clone()]);
        }
        a.push("--worker-urls".into());
        a.push(workers.join(","));
        // Engine signals as deployed in front of vLLM: /metrics scraped every
        // simulated 5 s (Cognitora cgn-router's heartbeat).
        a.extend(["--scrape-metrics".to_string(), "true".into()]);
        // The bench's one client reads the serving worker from `x-kvroute-worker`.
        a.extend(["--expose-decision-headers".to_string(), "true".into()]);
        a.extend(["--health-interval-secs".to_string(), self.scrape_secs.to_string()]);
        // In front of llama.cpp: the model's own tokenizer, as deployed (routing keys
        // are the worker's token ids).
        if let Some((_, model)) = &self.llama {
            a.extend(["--tokenizer".to_string(), model.display().to_string()]);
        }
        a
    }

    /// The Dynamo shim's arguments (the shim written into the log directory first): its
    /// port, its selection service's port and each worker with its KV-event endpoint.
    fn dynamo_args(&self, workers: &[String], port: u16, prom: u16) -> anyhow::Result<Vec<String>> {
        if self.llama.is_some() {
            bail!("dynamo runs only in front of simulated workers (the shim uses engine-sim's token ids)");
        }
        let shim = self.logs.join("dynamo-shim.py");
        std::fs::write(&shim, DYNAMO_SHIM).with_context(|| format!("writing {}", shim.display()))?;
        let mut a = vec![shim.display().to_string()];
        a.extend(["--port".to_string(), port.to_string(), "--select-port".into(), prom.to_string()]);
        a.extend(["--model".to_string(), self.model.clone()]);
        let kv = self.kv_events.lock().map_err(|_| anyhow::anyhow!("kv_events lock"))?;
        for w in workers {
            let Some(e) = kv.get(w) else { bail!("worker {w} publishes no KV events, which dynamo needs") };
            a.extend(["--worker".to_string(), format!("{w}={e}")]);
        }
        Ok(a)
    }

    /// Sums of the workers' prefix-cache counters and per-worker finished requests.
    async fn counters(&self, workers: &[String]) -> anyhow::Result<(f64, f64, Vec<f64>)> {
        let (mut hits, mut queries, mut done) = (0.0, 0.0, Vec::new());
        for w in workers {
            let text = self.client.get(format!("{w}/metrics")).send().await?.text().await?;
            let get = |name: &str| {
                text.lines()
                    .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>()
            };
            if self.llama.is_some() {
                // llama.cpp: prompt tokens processed and served from the cache; the share per
                // worker is of prompt tokens (it counts no requests).
                let cached = get("llamacpp:prompt_tokens_cached_total");
                let processed = get("llamacpp:prompt_tokens_total");
                hits += cached;
                queries += cached + processed;
                done.push(cached + processed);
            } else {
                hits += get("vllm:prefix_cache_hits_total");
                queries += get("vllm:prefix_cache_queries_total");
                done.push(get("vllm:request_success_total"));
            }
        }
        Ok((hits, queries, done))
    }
}

const MODEL: &str = "sim-llama-3-8b";

/// The peers `--peers` accepts.
const PEERS: [&str; 4] = ["sglang-router", "vllm-router", "smg", "dynamo"];

/// One row of the comparison.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    router: String,
    policy: String,
    /// Why this row has no numbers (not installed, failed to start, …).
    skipped: Option<String>,
    overhead_c1: Option<Summary>,
    overhead_c32: Option<Summary>,
    quality: Option<Summary>,
    /// Prefix-cache hit ratio from the workers' counters (tokens).
    hit_ratio: Option<f64>,
    /// Share of finished requests per worker, from the workers' counters.
    worker_share: Vec<f64>,
    /// Conversations: the turns after the first (those a prefix cache can serve).
    later_turns: Option<Summary>,
}

impl Row {
    /// The row of `t`, without numbers yet.
    fn new(t: &Target) -> Row {
        Row {
            router: t.router.clone(),
            policy: t.policy.clone(),
            skipped: None,
            overhead_c1: None,
            overhead_c32: None,
            quality: None,
            hit_ratio: None,
            worker_share: Vec::new(),
            later_turns: None,
        }
    }
}

fn overhead_load(secs: f64, conc: usize) -> RunConfig {
    RunConfig {
        url: String::new(),
        model: MODEL.into(),
        api: Api::Chat,
        stream: false,
        mode: Mode::Closed,
        max_concurrency: conc,
        duration: Some(Duration::from_secs_f64(secs)),
        timeout: Duration::from_secs(30),
    }
}

/// The machine's 1-minute load average (`/proc/loadavg`; `None` where there is none).
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// The machine's CPU time counters, `(busy, total)` in clock ticks, from the `cpu` line of
/// `/proc/stat` (busy = all but `idle` and `iowait`; `guest` is already in `user`); `None`
/// where there is none.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let total: u64 = v.iter().sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// Cores busy over the last `window`, measured now (`/proc/stat` read before and after;
/// `None` where there is none). Unlike the load average, which decays over minutes, it does
/// not count the workers of a run that just ended.
#[expect(clippy::disallowed_methods, reason = "plain blocking code between runs, outside any runtime")]
fn cores_busy_now(window: Duration) -> Option<f64> {
    let (b0, t0) = cpu_ticks()?;
    std::thread::sleep(window);
    let (b1, t1) = cpu_ticks()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    (t1 > t0).then(|| cores * (b1 - b0) as f64 / (t1 - t0) as f64)
}

/// `--peers-dir`, or `~/.cache/kvroute/peers`.
fn peers_dir(flag: Option<&PathBuf>) -> PathBuf {
    flag.cloned().unwrap_or_else(|| {
        std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from).join(".cache/kvroute/peers")
    })
}

/// `--log-dir`, or a new `kvroute-{what}-{pid}` under the temp dir; created.
fn log_dir(flag: Option<&PathBuf>, what: &str) -> anyhow::Result<PathBuf> {
    let logs = match flag {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("kvroute-{what}-{}", std::process::id())),
    };
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    Ok(logs)
}

/// What the machine was doing when the run started (recorded in the JSON).
struct MachineAtStart {
    /// 1-minute load average.
    load: Option<f64>,
    /// Cores busy over the second before the start (`--engine llama` only).
    busy: Option<f64>,
}

/// The requests of the routing-quality runs: a trace slice or synthetic workload, or
/// MT-bench conversations.
struct QualityLoad {
    /// The Mooncake trace (default or `--trace`), also when a workload replaces it.
    trace: PathBuf,
    /// MT-bench conversations (`--workload mtbench`).
    conversations: Option<Vec<workload::Conversation>>,
    /// Independent requests otherwise.
    requests: Vec<workload::BenchRequest>,
    /// Requests in all.
    n: usize,
}

/// Runs `kvroute bench compare`: checks the flags, builds both workloads, measures proxy
/// overhead and routing quality for every router and policy, and reports them.
pub fn run(mut a: Args) -> anyhow::Result<()> {
    let load = load_average();
    let busy = check_args(&mut a)?;
    let machine = MachineAtStart { load, busy };
    let logs = log_dir(a.log_dir.as_ref(), "compare")?;
    let quality = quality_load(&a)?;
    // The overhead workload: 256 distinct ~64-token chats, one output token, cycled.
    let overhead_reqs = workload::independent(256, Arrivals::Constant(1.0), 64, 1, 7);
    let targets = targets(&a);
    let llama = llama_paths(&a)?;
    let scrape_secs = (5.0 / a.time_scale).max(0.05);
    let ctx = Ctx::new(peers_dir(a.peers_dir.as_ref()), logs, scrape_secs, llama, a.llama_cache_ram)?;
    let slo = Slo { ttft_s: a.slo_ttft, tpot_s: a.slo_tpot };
    println!(
        "kvroute bench compare: {} configurations × {} {} workers; logs in {}",
        targets.len(),
        a.workers,
        if a.engine == "llama" { "llama.cpp" } else { "simulated" },
        ctx.logs.display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let mut rows: Vec<Row> = targets.iter().map(Row::new).collect();
        let mut direct = None;
        if !a.skip_overhead {
            direct = Some(measure_overhead(&ctx, &a, &targets, &mut rows, &overhead_reqs, slo).await?);
        }
        if !a.skip_quality {
            measure_quality(&ctx, &a, &targets, &mut rows, &quality, slo).await?;
        }
        print_table(&rows, direct.as_ref(), &a);
        if let Some(p) = &a.json {
            write_json(p, &a, &quality, &machine, direct.as_ref(), &rows)?;
        }
        if let Some(dir) = &a.plots {
            write_plots(dir, &a, &rows)?;
        }
        Ok(())
    })
}

/// Checks the flags and fits them to the engine: `--engine llama` runs in real time
/// without the overhead part. Returns the cores busy before the start with llama.cpp
/// workers (warning when the machine is busy).
fn check_args(a: &mut Args) -> anyhow::Result<Option<f64>> {
    let mut busy_at_start = None;
    // `--peers ""` compares kvroute's policies alone.
    a.peers.retain(|p| !p.is_empty());
    if kvroute_sim::engine::Profile::named(&a.sim_profile).is_none() {
        bail!(
            "--sim-profile: unknown profile `{}`; known: {}",
            a.sim_profile,
            kvroute_sim::engine::Profile::NAMES.join(", ")
        );
    }
    if a.engine == "llama" {
        // Real engines run in real time (slow the trace with --rate-scale instead), and the
        // proxy-overhead part needs instant simulated workers.
        if a.time_scale != 1.0 {
            eprintln!("kvroute bench compare: --engine llama runs in real time; --time-scale set to 1");
        }
        a.time_scale = 1.0;
        a.skip_overhead = true;
        busy_at_start = warn_if_busy();
    }
    if a.workers == 0 {
        bail!("--workers must be at least 1");
    }
    if !(0.0..=1.0).contains(&a.hot_document_share) {
        bail!("--hot-document-share must be in [0, 1], got {}", a.hot_document_share);
    }
    if a.policies.iter().any(|p| p.ends_with(SLOTS_KV_SUFFIX)) && a.engine != "llama" {
        bail!("--policies: `{SLOTS_KV_SUFFIX}` needs --engine llama (the KV mover saves and restores llama.cpp slots)");
    }
    for p in &a.peers {
        if !PEERS.contains(&p.as_str()) {
            bail!("--peers: unknown peer `{p}` ({})", PEERS.join(", "));
        }
    }
    for p in &a.policies {
        let name = p.strip_suffix(SLOTS_KV_SUFFIX).or_else(|| p.strip_suffix(SLOTS_SUFFIX)).unwrap_or(p);
        kvroute_core::registry::build(name, &serde_json::Value::Null).with_context(|| format!("--policies: {p}"))?;
    }
    Ok(busy_at_start)
}

/// Cores busy over the second before the start, with a warning when half a core or more
/// is: real engines share the cores with whatever else runs, so their timings compare only
/// with runs on an equally idle machine (docs/real-engines.md, "Runs on a quiet machine").
/// Measured now: the load average would still count the workers of a run that ended a
/// minute ago.
fn warn_if_busy() -> Option<f64> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let busy_at_start = cores_busy_now(Duration::from_secs(1));
    if let Some(busy) = busy_at_start.filter(|&b| b >= 0.5) {
        eprintln!(
            "kvroute bench compare: warning: the machine is busy ({busy:.2} of its {cores} cores in use over the \
             last second before the start): the llama.cpp workers will share the cores with that work, and \
             their timings will not compare with an idle machine's"
        );
    }
    busy_at_start
}

/// The quality workload: a Mooncake slice by its timestamps, a synthetic workload or
/// MT-bench conversations, `time_scale` × faster.
fn quality_load(a: &Args) -> anyhow::Result<QualityLoad> {
    let trace = match &a.trace {
        Some(t) => t.clone(),
        None => kvroute_sim::trace::find_default(None)?,
    };
    let conversations = match a.workload.as_deref() {
        Some("mtbench") => Some(mtbench_conversations(a, &trace)?),
        _ => None,
    };
    let synthetic = a.workload.is_some();
    let wl = WorkloadArgs {
        trace: (!synthetic).then(|| trace.clone()),
        workload: a.workload.clone(),
        rate_scale: a.time_scale * a.rate_scale,
        rate: a.rate * a.time_scale * a.rate_scale,
        requests: Some(a.requests),
        input_tokens: 0,
        output_tokens: a.output_tokens,
        max_output: a.max_output,
        block_tokens: a.block_tokens,
        slice: a.slice.clone(),
        groups: a.groups,
        prompts_per_group: a.prompts_per_group,
        system_tokens: a.system_tokens,
        question_tokens: a.question_tokens,
        seed: 0,
    };
    let requests = if conversations.is_some() { Vec::new() } else { wl.build()? };
    let n = conversations.as_ref().map_or(requests.len(), |c| c.iter().map(|c| c.turns.len()).sum());
    Ok(QualityLoad { trace, conversations, requests, n })
}

/// What kvroute's KV mover did, from its `kvroute_kv_migrations_total` series (`op
/// outcome N, ...`), or why it could not be read.
async fn mover_counts(client: &reqwest::Client, router: &str) -> String {
    let text = match client.get(format!("{router}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(e) => return format!("metrics unreadable: {e}"),
    };
    let counts: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("kvroute_kv_migrations_total{"))
        .filter_map(|l| {
            let label = |k: &str| l.split(&format!("{k}=\"")).nth(1)?.split('"').next();
            Some(format!("{} {} {}", label("op")?, label("outcome")?, l.rsplit(' ').next()?))
        })
        .collect();
    if counts.is_empty() { "nothing".into() } else { counts.join(", ") }
}

/// `--workload mtbench`: the questions file (`--mtbench`, or beside `trace`) as two-turn
/// conversations, with documents attached; a closed loop starts them all at zero.
fn mtbench_conversations(a: &Args, trace: &std::path::Path) -> anyhow::Result<Vec<workload::Conversation>> {
    let path = match &a.mtbench {
        Some(p) => p.clone(),
        None => trace.with_file_name("mtbench_question.jsonl"),
    };
    // The arrival rate the conversations start at: checked as `kvroute bench` checks its
    // own (at 1e-300 every conversation started at the end of the clock).
    let rate = a.rate * a.time_scale * a.rate_scale;
    workload::check_rate(rate, a.conversations)
        .map_err(|e| anyhow::anyhow!("--rate × --time-scale × --rate-scale: {e}"))?;
    let text = std::fs::read_to_string(&path).with_context(|| format!("--mtbench {}", path.display()))?;
    let arrivals = Arrivals::Poisson(rate);
    let mut c = workload::mtbench(&text, a.conversations, arrivals, a.output_tokens, 0)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if a.document_tokens > 0 {
        workload::attach_documents(&mut c, a.document_tokens, a.documents, a.hot_document_share, 0);
    }
    if a.conversation_concurrency > 0 {
        for x in &mut c {
            x.at = Duration::ZERO;
        }
    }
    Ok(c)
}

/// The routers under test: kvroute with each `--policies`, then each peer with each
/// `--peer-policies` (Dynamo once, with its KV router).
fn targets(a: &Args) -> Vec<Target> {
    let mut targets: Vec<Target> =
        a.policies.iter().map(|p| Target { router: "kvroute".into(), policy: p.clone() }).collect();
    for peer in &a.peers {
        if peer == "dynamo" {
            targets.push(Target { router: peer.clone(), policy: "kv".into() });
            continue;
        }
        for p in &a.peer_policies {
            targets.push(Target { router: peer.clone(), policy: p.clone() });
        }
    }
    targets
}

/// With `--engine llama`: llama-server and the model, which must exist.
fn llama_paths(a: &Args) -> anyhow::Result<Option<(PathBuf, PathBuf)>> {
    if a.engine != "llama" {
        return Ok(None);
    }
    let (Some(bin), Some(model)) = (a.llama_server.clone(), a.llama_model.clone()) else {
        bail!("--engine llama needs --llama-server and --llama-model (scripts/llama-workers.sh paths prints them)");
    };
    for p in [&bin, &model] {
        if !p.exists() {
            bail!("{} does not exist (run scripts/llama-workers.sh install)", p.display());
        }
    }
    Ok(Some((bin, model)))
}

/// c=1 and c=32 summaries of the overhead load sent to `url`.
async fn overhead_point(
    url: &str,
    label: &str,
    secs: f64,
    reqs: &[workload::BenchRequest],
    slo: Slo,
) -> anyhow::Result<(Summary, Summary)> {
    let mut out = Vec::new();
    for conc in [1usize, 32] {
        let cfg = RunConfig { url: url.to_string(), ..overhead_load(secs, conc) };
        let res = runner::run(&cfg, reqs, None).await?;
        out.push(summary::summarise(&format!("{label} c={conc}"), &res, 1.0, slo));
    }
    Ok((out.remove(0), out.remove(0)))
}

/// Proxy overhead: instant workers, the load straight to one of them, then through each
/// router in turn (a router that fails is marked skipped in its row). Returns the direct
/// c=1 and c=32 summaries.
async fn measure_overhead(
    ctx: &Ctx,
    a: &Args,
    targets: &[Target],
    rows: &mut [Row],
    reqs: &[workload::BenchRequest],
    slo: Slo,
) -> anyhow::Result<(Summary, Summary)> {
    eprintln!("proxy overhead: instant workers, closed loop, {} s per point", a.overhead_secs);
    // Instant workers publish no KV events; Dynamo is registered with their endpoints.
    let with_kv = targets.iter().any(|t| t.router == "dynamo");
    let (kids, urls) = ctx.workers_kv(a.workers, &["--instant"], with_kv).await?;
    let d = overhead_point(&urls[0], "direct", a.overhead_secs, reqs, slo).await?;
    eprintln!("  direct: c=1 p50 {:.3} ms, c=32 {:.0} req/s", d.0.latency.e2e_p50_s * 1e3, d.1.throughput_rps);
    for (t, row) in targets.iter().zip(rows.iter_mut()) {
        match ctx.router(t, &urls).await {
            Ok((child, url)) => {
                let m = overhead_point(&url, &t.label(), a.overhead_secs, reqs, slo).await;
                child.stop().await;
                match m {
                    Ok((c1, c32)) => {
                        eprintln!(
                            "  {}: c=1 p50 {:.3} ms, c=32 {:.0} req/s",
                            t.label(),
                            c1.latency.e2e_p50_s * 1e3,
                            c32.throughput_rps
                        );
                        row.overhead_c1 = Some(c1);
                        row.overhead_c32 = Some(c32);
                    }
                    Err(e) => row.skipped = Some(format!("{e:#}")),
                }
            }
            Err(e) => {
                eprintln!("  {}: skipped: {e:#}", t.label());
                row.skipped = Some(format!("{e:#}"));
            }
        }
    }
    for k in kids {
        k.stop().await;
    }
    Ok(d)
}

/// Routing quality: for each router not missing, cold workers, the router, the quality
/// load by its timestamps, and the workers' counters before and after.
async fn measure_quality(
    ctx: &Ctx,
    a: &Args,
    targets: &[Target],
    rows: &mut [Row],
    q: &QualityLoad,
    slo: Slo,
) -> anyhow::Result<()> {
    // Arrivals: a closed loop of conversations has no schedule to span (every start
    // time is zero; each starts when another ends), an open loop spans its last arrival.
    let arrivals = match &q.conversations {
        Some(c) if a.conversation_concurrency > 0 => {
            format!("{} conversations, {} at a time (closed loop)", c.len(), a.conversation_concurrency)
        }
        Some(c) => format!("arrivals over {:.0} s wall", c.last().map_or(0.0, |c| c.at.as_secs_f64())),
        None => format!("arrivals over {:.0} s wall", q.requests.last().map_or(0.0, |r| r.at.as_secs_f64())),
    };
    eprintln!(
        "routing quality: {} {} requests, {arrivals} ({}× real time), workers restarted cold per run",
        q.n,
        a.workload.as_deref().unwrap_or("Mooncake"),
        a.time_scale
    );
    for (t, row) in targets.iter().zip(rows.iter_mut()) {
        if row.skipped.as_deref().is_some_and(|s| s.contains("not installed")) {
            continue;
        }
        quality_run(ctx, a, t, row, q, slo).await?;
    }
    Ok(())
}

/// One router's quality run, written into its row (or the row marked skipped when the
/// router does not start).
async fn quality_run(ctx: &Ctx, a: &Args, t: &Target, row: &mut Row, q: &QualityLoad, slo: Slo) -> anyhow::Result<()> {
    let ts = a.time_scale.to_string();
    let mut sim = vec!["--time-scale", ts.as_str(), "--profile", a.sim_profile.as_str()];
    if let Some(set) = &a.sim_profile_set {
        sim.extend(["--profile-set", set.as_str()]);
    }
    let (kids, urls) = ctx.workers_kv(a.workers, &sim, t.router == "dynamo").await?;
    let (child, url) = match ctx.router(t, &urls).await {
        Ok(x) => x,
        Err(e) => {
            eprintln!("  {}: skipped: {e:#}", t.label());
            row.skipped = Some(format!("{e:#}"));
            for k in kids {
                k.stop().await;
            }
            return Ok(());
        }
    };
    let before = ctx.counters(&urls).await?;
    let cfg = RunConfig {
        url,
        model: ctx.model.clone(),
        api: Api::Chat,
        stream: true,
        mode: Mode::Open,
        max_concurrency: if q.conversations.is_some() && a.conversation_concurrency > 0 {
            a.conversation_concurrency
        } else {
            1024
        },
        duration: None,
        timeout: Duration::from_secs(300),
    };
    let bar = cmd_bench::progress(q.n as u64, &t.label(), a.quiet);
    let res = match &q.conversations {
        Some(c) => runner::run_conversations(&cfg, c, Some(&bar)).await?,
        None => runner::run(&cfg, &q.requests, Some(&bar)).await?,
    };
    bar.finish_and_clear();
    let after = ctx.counters(&urls).await?;
    if t.policy.ends_with(SLOTS_KV_SUFFIX) {
        eprintln!("  {}: kv mover: {}", t.label(), mover_counts(&ctx.client, &cfg.url).await);
    }
    child.stop().await;
    for k in kids {
        k.stop().await;
    }
    let mut s = summary::summarise(&t.label(), &res, a.time_scale, slo);
    if let Some(c) = &q.conversations {
        row.later_turns = Some(later_turns(&t.label(), c, &res, a.time_scale, slo));
    }
    let hit = (after.0 - before.0) / (after.1 - before.1).max(1.0);
    let done: Vec<f64> = after.2.iter().zip(&before.2).map(|(x, y)| x - y).collect();
    let total: f64 = done.iter().sum::<f64>().max(1.0);
    row.worker_share = done.iter().map(|d| d / total).collect();
    s.worker_share =
        row.worker_share.iter().enumerate().map(|(i, x)| (format!("w{i}"), *x)).collect::<BTreeMap<_, _>>();
    eprintln!(
        "  {}: hit {:.1}%, TTFT mean {:.3} s p99 {:.3} s, {} ok / {} rejected / {} errors",
        t.label(),
        hit * 100.0,
        s.latency.ttft_mean_s,
        s.latency.ttft_p99_s,
        s.ok,
        s.rejected,
        s.errors
    );
    row.hit_ratio = Some(hit);
    row.quality = Some(s);
    Ok(())
}

/// Conversations: the summary of the later turns alone (the ones a prefix cache can serve).
fn later_turns(
    label: &str,
    c: &[workload::Conversation],
    res: &[runner::RequestResult],
    time_scale: f64,
    slo: Slo,
) -> Summary {
    let turns = c.iter().map(|c| c.turns.len()).max().unwrap_or(1).max(1);
    let later: Vec<_> = res.iter().filter(|r| r.index % turns > 0).cloned().collect();
    let l = summary::summarise(&format!("{label} turn 2+"), &later, time_scale, slo);
    eprintln!(
        "  {label}: later turns TTFT mean {:.3} s p90 {:.3} s ({} requests)",
        l.latency.ttft_mean_s,
        l.latency.ttft_p90_s,
        later.len()
    );
    l
}

/// `--json`: the run's settings, the machine's load at the start, the direct path and
/// every row.
fn write_json(
    p: &std::path::Path,
    a: &Args,
    q: &QualityLoad,
    machine: &MachineAtStart,
    direct: Option<&(Summary, Summary)>,
    rows: &[Row],
) -> anyhow::Result<()> {
    let doc = serde_json::json!({
        "workers": a.workers, "time_scale": a.time_scale, "rate_scale": a.rate_scale,
        "requests": a.requests, "trace": q.trace, "overhead_secs": a.overhead_secs,
        "engine": a.engine, "sim_profile": (a.engine == "sim").then_some(&a.sim_profile),
        "sim_profile_set": a.sim_profile_set,
        "workload": a.workload, "quality_requests": q.n,
        "rate": a.rate, "output_tokens": a.output_tokens, "conversations": a.conversations,
        "document_tokens": a.document_tokens, "documents": a.documents,
        "conversation_concurrency": a.conversation_concurrency,
        "block_tokens": a.block_tokens, "trace_start": a.slice.trace_start,
        "trace_window": a.slice.trace_window, "min_turns": a.slice.min_turns,
        "max_input_tokens": a.slice.max_input_tokens,
        "llama_cache_ram_mib": a.llama_cache_ram, "load_average_at_start": machine.load,
        "cores_busy_at_start": machine.busy,
        "direct": direct.map(|d| [&d.0, &d.1]), "rows": rows,
    });
    std::fs::write(p, serde_json::to_vec_pretty(&doc)?).with_context(|| format!("writing {}", p.display()))?;
    Ok(())
}

/// `--plots`: the TTFT CDF and worker shares of the quality runs (none without one).
fn write_plots(dir: &std::path::Path, a: &Args, rows: &[Row]) -> anyhow::Result<()> {
    let q: Vec<Summary> = rows.iter().filter_map(|r| r.quality.clone()).collect();
    if q.is_empty() {
        return Ok(());
    }
    let title = match (a.engine.as_str(), a.workload.as_deref()) {
        ("llama", Some(w)) => format!("TTFT CDF, {w}, llama.cpp SmolLM2-135M workers"),
        ("llama", None) => "TTFT CDF, Mooncake slice, llama.cpp SmolLM2-135M workers".to_string(),
        (_, Some(w)) => format!("TTFT CDF, {w}, simulated H100 workers"),
        _ => "TTFT CDF, Mooncake slice, simulated H100 workers".to_string(),
    };
    cmd_bench::write_plots(dir, "compare", &q, &title)
}

fn ms(x: f64) -> String {
    format!("{:+.3}", x * 1e3)
}

fn print_table(rows: &[Row], direct: Option<&(Summary, Summary)>, a: &Args) {
    println!();
    if let Some((d1, d32)) = direct {
        println!(
            "direct to one instant worker: c=1 p50 {:.3} ms p99 {:.3} ms; c=32 {:.0} req/s",
            d1.latency.e2e_p50_s * 1e3,
            d1.latency.e2e_p99_s * 1e3,
            d32.throughput_rps
        );
    }
    println!(
        "| router | policy | added p50 c=1 (ms) | added p99 c=1 (ms) | req/s c=32 | hit % | TTFT mean (s) | TTFT p50 (s) | TTFT p99 (s) | later-turn TTFT mean (s) | goodput (req/s) | rejected + errors |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        if let Some(why) = r.skipped.as_ref().filter(|_| r.overhead_c1.is_none() && r.quality.is_none()) {
            println!("| {} | {} | skipped: {} ||||||||||", r.router, r.policy, why.lines().next().unwrap_or(""));
            continue;
        }
        let (o1, o99, rps) = match (&r.overhead_c1, &r.overhead_c32, direct) {
            (Some(c1), Some(c32), Some((d1, _))) => (
                ms(c1.latency.e2e_p50_s - d1.latency.e2e_p50_s),
                ms(c1.latency.e2e_p99_s - d1.latency.e2e_p99_s),
                format!("{:.0}", c32.throughput_rps),
            ),
            _ => ("-".into(), "-".into(), "-".into()),
        };
        let q = r.quality.as_ref();
        let f = |g: &dyn Fn(&Summary) -> String| q.map_or_else(|| "-".to_string(), g);
        println!(
            "| {} | {} | {o1} | {o99} | {rps} | {} | {} | {} | {} | {} | {} | {} |",
            r.router,
            r.policy,
            r.hit_ratio.map_or_else(|| "-".into(), |h| format!("{:.1}", h * 100.0)),
            f(&|s| format!("{:.3}", s.latency.ttft_mean_s)),
            f(&|s| format!("{:.3}", s.latency.ttft_p50_s)),
            f(&|s| format!("{:.3}", s.latency.ttft_p99_s)),
            r.later_turns.as_ref().map_or_else(|| "-".into(), |s| format!("{:.3}", s.latency.ttft_mean_s)),
            f(&|s| format!("{:.2}", s.goodput_rps)),
            f(&|s| format!("{}", s.rejected + s.errors)),
        );
    }
    if rows.iter().any(|r| r.router == "dynamo") {
        println!(
            "(dynamo: NVIDIA Dynamo 1.6.1's selection service behind scripts/dynamo-shim.py, the harness's Python forwarding shim (reserve → forward → release, one extra HTTP hop); its added latency and req/s measure the shim as much as Dynamo, compare it on hit % and TTFT)"
        );
    }
    if a.engine == "llama" {
        println!(
            "(quality: llama.cpp workers in real time; goodput in req/s with TTFT ≤ {} s and TPOT ≤ {} s; hit % = llamacpp:prompt_tokens_cached_total / all prompt tokens)",
            a.slo_ttft, a.slo_tpot
        );
    } else {
        println!(
            "(quality: TTFT in simulated seconds at {}× real time; goodput in simulated req/s with TTFT ≤ {} s and TPOT ≤ {} s; hit % from the workers' prefix-cache counters)",
            a.time_scale, a.slo_ttft, a.slo_tpot
        );
    }
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
    fn an_mtbench_rate_out_of_range_is_refused_naming_the_flags() {
        for rate in ["1e-300", "1e300"] {
            let a = Cli::try_parse_from(["compare", "--workload", "mtbench", "--rate", rate]).expect("flags").a;
            let e = mtbench_conversations(&a, std::path::Path::new("/nonexistent/trace.jsonl"))
                .expect_err("refused")
                .to_string();
            assert!(e.starts_with("--rate × --time-scale × --rate-scale: "), "{rate}: {e}");
        }
    }
}
