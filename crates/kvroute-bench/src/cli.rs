//! The command-line arguments and helpers shared by `kvroute bench` and
//! `kvroute bench compare`: what to send ([`WorkloadArgs`], [`TraceSliceArgs`]), how
//! ([`LoadArgs`]), the progress bar and the plots.

use crate::runner::{Api, Mode, RunConfig};
use crate::summary::{Slo, Summary};
use crate::workload::{self, Arrivals, BenchRequest, SharedPrefix};
use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What to send and how: shared by `kvroute bench` and the comparison.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    /// Replay this trace (Mooncake JSONL, session JSONL or Azure CSV) by its timestamps;
    /// prompt text is synthesised from its hash_ids, so shared blocks mean shared text.
    #[arg(long, conflicts_with = "workload")]
    pub trace: Option<PathBuf>,
    /// Synthetic workload: `poisson`, `constant` (independent prompts at --rate) or
    /// `shared-prefix` (llm-d's groups × prompts per group, Poisson at --rate).
    #[arg(long, value_parser = ["poisson", "constant", "shared-prefix"])]
    pub workload: Option<String>,
    /// Trace: multiply the arrival rate (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Synthetic: requests per second.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Trace: send only the first N requests. Synthetic (poisson/constant): number of
    /// requests, at most 10,000,000.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Synthetic: prompt tokens of independent requests (every prompt is built before the
    /// run: --requests × this × 4 bytes at most 2 GiB).
    #[arg(long, default_value_t = 512)]
    pub input_tokens: u32,
    /// Synthetic: output tokens (max_tokens) of every request.
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    /// Trace: cap on max_tokens (at least 1).
    #[arg(long, default_value_t = 128)]
    pub max_output: u32,
    /// Trace: scale blocks down to this many tokens each (prompts shrink alike), to replay a
    /// trace recorded on a large model against a small one.
    #[arg(long)]
    pub block_tokens: Option<u32>,
    /// Which sessions of the trace to send.
    #[command(flatten)]
    pub slice: TraceSliceArgs,
    /// shared-prefix: number of system prompts.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    /// shared-prefix: questions per system prompt (--groups × --prompts-per-group at most
    /// 10,000,000).
    #[arg(long, default_value_t = 16)]
    pub prompts_per_group: usize,
    /// shared-prefix: tokens per system prompt (every prompt is built before the run: the
    /// requests × (this + --question-tokens) × 4 bytes at most 2 GiB).
    #[arg(long, default_value_t = 2048)]
    pub system_tokens: u32,
    /// shared-prefix: tokens per question.
    #[arg(long, default_value_t = 256)]
    pub question_tokens: u32,
    /// Seed of synthetic arrivals and text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Which part of a trace to send, by time span and session (shared by `kvroute bench` and
/// `kvroute bench compare`).
#[derive(Debug, Clone, clap::Args)]
pub struct TraceSliceArgs {
    /// Trace: start of the slice to send, seconds from the trace start.
    #[arg(long, default_value_t = 0.0)]
    pub trace_start: f64,
    /// Trace: length of the slice, seconds (default: to the end).
    #[arg(long)]
    pub trace_window: Option<f64>,
    /// Trace: keep only sessions with at least this many requests in the slice (Mooncake:
    /// the depth-2 prefix group is the session).
    #[arg(long, default_value_t = 0)]
    pub min_turns: usize,
    /// Trace: drop sessions with a prompt longer than this many tokens (before --block-tokens).
    #[arg(long)]
    pub max_input_tokens: Option<u32>,
}

impl TraceSliceArgs {
    /// Whether any flag cuts the trace (else [`TraceSliceArgs::apply`] returns it whole).
    pub fn is_set(&self) -> bool {
        self.trace_start != 0.0 || self.trace_window.is_some() || self.min_turns > 1 || self.max_input_tokens.is_some()
    }

    /// `trace` cut to the slice ([`kvroute_sim::trace::session_slice`]); unchanged when no
    /// flag is set.
    ///
    /// # Errors
    /// A negative start, a non-positive window, or a slice with no requests.
    pub fn apply(
        &self,
        trace: Vec<kvroute_sim::trace::TraceRequest>,
    ) -> anyhow::Result<Vec<kvroute_sim::trace::TraceRequest>> {
        if !self.is_set() {
            return Ok(trace);
        }
        if !(self.trace_start.is_finite() && self.trace_start >= 0.0) {
            bail!("--trace-start must be a number of seconds ≥ 0, got {}", self.trace_start);
        }
        if let Some(w) = self.trace_window {
            positive("--trace-window", w)?;
        }
        let slice = kvroute_sim::trace::SessionSlice {
            start_secs: self.trace_start,
            window_secs: self.trace_window,
            min_turns: self.min_turns,
            max_input_tokens: self.max_input_tokens,
        };
        let t = kvroute_sim::trace::session_slice(trace, &slice);
        if t.is_empty() {
            bail!("the trace slice (--trace-start/--trace-window/--min-turns/--max-input-tokens) has no requests");
        }
        Ok(t)
    }
}

/// Flags of a load run.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Base URL of the router or worker, e.g. http://127.0.0.1:30000; several, comma
    /// separated, are a client-side round robin (request i to the (i mod n)-th), as in front
    /// of router replicas with no load balancer.
    #[arg(long)]
    pub url: Option<String>,
    /// What to send.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Stop releasing requests after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Open loop: bound on requests in flight. Closed loop: number of clients.
    #[arg(long, default_value_t = 256)]
    pub max_concurrency: usize,
    /// Closed loop (each client sends its next request when the last one ends), for
    /// overhead tests; timestamps are ignored.
    #[arg(long)]
    pub closed_loop: bool,
    /// Endpoint: chat or completions.
    #[arg(long, default_value = "chat", value_parser = ["chat", "completions"])]
    pub api: String,
    /// Ask for non-streamed answers (no TTFT/ITL then; E2E only).
    #[arg(long)]
    pub no_stream: bool,
    /// Model name (default: the first model of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Report times on a clock this many times slower than the wall clock: latencies are
    /// multiplied and rates divided by it (engine simulators at --time-scale N: pass N to
    /// get simulated seconds and simulated requests per second).
    #[arg(long, default_value_t = 1.0)]
    pub latency_scale: f64,
    /// Goodput SLO: maximum TTFT, seconds (scaled; > 0).
    #[arg(long, default_value_t = 2.0)]
    pub slo_ttft: f64,
    /// Goodput SLO: maximum TPOT, seconds (scaled; > 0).
    #[arg(long, default_value_t = 0.1)]
    pub slo_tpot: f64,
    /// Timeout of one request, wall seconds.
    #[arg(long, default_value_t = 300.0)]
    pub timeout: f64,
    /// Label of the run in the table and JSON.
    #[arg(long)]
    pub label: Option<String>,
    /// Write the summary and every request's record here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write plots (bench_ttft_cdf, bench_worker_share; PNG and SVG) into this directory.
    #[arg(long)]
    pub plots: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn positive(name: &str, v: f64) -> anyhow::Result<()> {
    if !(v.is_finite() && v > 0.0) {
        bail!("{name} must be a positive number, got {v}");
    }
    Ok(())
}

impl WorkloadArgs {
    /// Builds the requests.
    ///
    /// # Errors
    /// Neither or both of --trace/--workload, bad numbers, a synthetic workload of more than
    /// [`workload::MAX_REQUESTS`] requests (naming the flags), a malformed trace (file, line,
    /// field).
    pub fn build(&self) -> anyhow::Result<Vec<BenchRequest>> {
        positive("--rate-scale", self.rate_scale)?;
        kvroute_sim::trace::check_rate_scale(&[], self.rate_scale).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
        positive("--rate", self.rate)?;
        workload::check_max_output(self.max_output).map_err(anyhow::Error::msg)?;
        let reqs = match (&self.trace, self.workload.as_deref()) {
            (Some(path), None) => {
                let mut t = kvroute_sim::trace::read(path, None)?;
                kvroute_sim::trace::spread_seconds(&mut t);
                t = self.slice.apply(t)?;
                if let Some(n) = self.requests {
                    t.truncate(n);
                }
                if let Some(bt) = self.block_tokens {
                    if bt == 0 {
                        bail!("--block-tokens must be at least 1");
                    }
                    kvroute_sim::trace::rescale_blocks(&mut t, bt);
                }
                let (hit, total) = kvroute_sim::trace::infinite_cache_hit(&t);
                let sessions: std::collections::HashSet<&str> = t.iter().filter_map(|r| r.session.as_deref()).collect();
                eprintln!(
                    "trace: {} requests, {} sessions, {} prompt tokens, infinite-cache bound {:.1} % of them",
                    t.len(),
                    sessions.len(),
                    total,
                    100.0 * hit as f64 / total.max(1) as f64
                );
                kvroute_sim::trace::check_rate_scale(&t, self.rate_scale)
                    .map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
                workload::from_trace(&t, self.rate_scale, self.max_output)
            }
            (None, Some(w)) => {
                let arrivals =
                    if w == "constant" { Arrivals::Constant(self.rate) } else { Arrivals::Poisson(self.rate) };
                if w == "shared-prefix" {
                    if self.groups == 0 || self.prompts_per_group == 0 {
                        bail!("--groups and --prompts-per-group must be at least 1");
                    }
                    let max = workload::MAX_REQUESTS;
                    if self.groups.checked_mul(self.prompts_per_group).is_none_or(|n| n > max) {
                        bail!(
                            "--groups × --prompts-per-group: {} × {} requests is more than the maximum {max}",
                            self.groups,
                            self.prompts_per_group
                        );
                    }
                    workload::check_rate(self.rate, self.groups.saturating_mul(self.prompts_per_group))
                        .map_err(|e| anyhow::anyhow!("--rate: {e}"))?;
                    let per_request = u64::from(self.system_tokens) + u64::from(self.question_tokens);
                    workload::check_prompt_bytes(self.groups * self.prompts_per_group, per_request).map_err(|e| {
                        anyhow::anyhow!("--groups × --prompts-per-group × (--system-tokens + --question-tokens): {e}")
                    })?;
                    let shape = SharedPrefix {
                        groups: self.groups,
                        prompts_per_group: self.prompts_per_group,
                        system_tokens: self.system_tokens,
                        question_tokens: self.question_tokens,
                        output_tokens: self.output_tokens,
                    };
                    workload::shared_prefix(shape, arrivals, self.seed)
                } else {
                    let n = self.requests.unwrap_or(200);
                    if n > workload::MAX_REQUESTS {
                        bail!(
                            "--requests: {n} is more than the maximum {} of a synthetic workload",
                            workload::MAX_REQUESTS
                        );
                    }
                    workload::check_rate(self.rate, n).map_err(|e| anyhow::anyhow!("--rate: {e}"))?;
                    workload::check_prompt_bytes(n, u64::from(self.input_tokens.max(1)))
                        .map_err(|e| anyhow::anyhow!("--requests × --input-tokens: {e}"))?;
                    workload::independent(n, arrivals, self.input_tokens.max(1), self.output_tokens, self.seed)
                }
            }
            _ => bail!("give exactly one of --trace FILE or --workload poisson|constant|shared-prefix"),
        };
        if reqs.is_empty() {
            bail!("the workload has no requests");
        }
        Ok(reqs)
    }
}

impl LoadArgs {
    /// The run settings for `url` and `model`.
    ///
    /// # Errors
    /// Bad numbers.
    pub fn run_config(&self, url: &str, model: &str) -> anyhow::Result<RunConfig> {
        positive("--timeout", self.timeout)?;
        positive("--latency-scale", self.latency_scale)?;
        if let Some(d) = self.duration {
            positive("--duration", d)?;
        }
        if self.max_concurrency == 0 {
            bail!("--max-concurrency must be at least 1");
        }
        Ok(RunConfig {
            url: crate::runner::base_urls(url).collect::<Vec<_>>().join(","),
            model: model.to_string(),
            api: if self.api == "completions" { Api::Completions } else { Api::Chat },
            stream: !self.no_stream,
            mode: if self.closed_loop { Mode::Closed } else { Mode::Open },
            max_concurrency: self.max_concurrency,
            duration: self.duration.map(Duration::from_secs_f64),
            timeout: Duration::from_secs_f64(self.timeout),
        })
    }

    /// The goodput SLO.
    ///
    /// # Errors
    /// `--slo-ttft` or `--slo-tpot` not a finite number of seconds > 0 ([`Slo::from_flags`]).
    pub fn slo(&self) -> anyhow::Result<Slo> {
        Slo::from_flags(self.slo_ttft, self.slo_tpot).map_err(anyhow::Error::msg)
    }
}

/// The first model id of `GET {url}/v1/models`.
///
/// # Errors
/// The endpoint is unreachable, answers an error, or lists no model.
pub async fn first_model(url: &str) -> anyhow::Result<String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let v: serde_json::Value = client
        .get(format!("{}/v1/models", url.trim_end_matches('/')))
        .send()
        .await
        .with_context(|| format!("GET {url}/v1/models"))?
        .error_for_status()?
        .json()
        .await?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("{url}/v1/models lists no model; pass --model"))
}

/// A progress bar over `n` requests (hidden with `quiet`).
pub fn progress(n: u64, label: &str, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(n);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg:<28} [{bar:40}] {pos}/{len} requests ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(label.to_string());
    bar
}

/// Writes the TTFT CDF and per-worker shares of `rows` into `dir` as `<prefix>_ttft_cdf` and
/// `<prefix>_worker_share` (PNG and SVG). Plot failures (no font) are warnings.
pub fn write_plots(dir: &Path, prefix: &str, rows: &[Summary], title: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let max_x = rows.iter().map(|r| r.latency.ttft_p99_s).fold(0.01_f64, f64::max) * 1.2;
    let series: Vec<_> = rows.iter().map(|r| (r.label.as_str(), r.ttft_cdf.as_slice())).collect();
    if let Err(e) = kvroute_sim::report::plot_cdf_series(&dir.join(format!("{prefix}_ttft_cdf")), &series, max_x, title)
    {
        eprintln!("kvroute: warning: TTFT plot not written: {e}");
    }
    let shares: Vec<(&str, Vec<f64>)> =
        rows.iter().map(|r| (r.label.as_str(), r.worker_share.values().copied().collect())).collect();
    let shares: Vec<(&str, &[f64])> = shares.iter().map(|(l, s)| (*l, s.as_slice())).collect();
    if shares.iter().any(|(_, s)| !s.is_empty())
        && let Err(e) = kvroute_sim::report::plot_worker_shares(
            &dir.join(format!("{prefix}_worker_share")),
            &shares,
            "share of requests per worker",
        )
    {
        eprintln!("kvroute: warning: worker-share plot not written: {e}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        w: WorkloadArgs,
    }

    fn build(args: &[&str]) -> anyhow::Result<Vec<BenchRequest>> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?;
        cli.w.build()
    }

    #[test]
    fn rates_that_overflow_the_send_times_are_refused_naming_the_flag() {
        // These panicked in `Duration::from_secs_f64` (exit 101).
        for (args, flag) in [
            (&["--workload", "constant", "--requests", "2", "--rate", "1e-300"][..], "--rate: "),
            (&["--workload", "poisson", "--requests", "2", "--rate", "1e-300"][..], "--rate: "),
            (&["--workload", "shared-prefix", "--rate", "1e-300"][..], "--rate: "),
            (&["--workload", "constant", "--requests", "2", "--rate-scale", "1e-300"][..], "--rate-scale: "),
        ] {
            let e = build(args).expect_err("refused").to_string();
            assert!(e.starts_with(flag), "{args:?}: {e}");
        }
        let dir = tempfile::Builder::new().prefix("kvroute-bench-cli-").tempdir().expect("temp dir");
        let trace = dir.path().join("t.jsonl");
        std::fs::write(
            &trace,
            "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [0]}\n\
             {\"timestamp\": 60000, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .expect("write trace");
        let t = trace.to_str().expect("utf-8 path");
        // In range, but 60 s stretched a million times is past 10^7 s.
        let e = build(&["--trace", t, "--rate-scale", "1e-6"]).expect_err("refused").to_string();
        assert!(e.starts_with("--rate-scale: ") && e.contains("10^7 s"), "{e}");
        assert_eq!(build(&["--trace", t, "--rate-scale", "2"]).expect("runs").len(), 2);
    }

    #[test]
    fn a_max_output_of_zero_is_refused_as_in_replay() {
        // It ran, every request capped at one token.
        let dir = tempfile::Builder::new().prefix("kvroute-bench-cli-max-output-").tempdir().expect("temp dir");
        let trace = dir.path().join("t.jsonl");
        std::fs::write(&trace, "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 9, \"hash_ids\": [0]}\n")
            .expect("write trace");
        let t = trace.to_str().expect("utf-8 path");
        let e = build(&["--trace", t, "--max-output", "0"]).expect_err("refused").to_string();
        assert_eq!(e, "--max-output must be at least 1");
        assert_eq!(build(&["--trace", t, "--max-output", "1"]).expect("runs")[0].max_tokens, 1);
    }

    #[test]
    fn slo_bounds_that_are_not_positive_seconds_are_refused_naming_the_flag() {
        // -1 and NaN made every request miss, inf every request meet, without a word.
        #[derive(Parser)]
        struct Load {
            #[command(flatten)]
            l: LoadArgs,
        }
        let slo = |args: &[&str]| {
            Load::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).expect("flags").l.slo()
        };
        for (args, flag) in [
            (&["--slo-ttft=-1"][..], "--slo-ttft: "),
            (&["--slo-ttft", "NaN"][..], "--slo-ttft: "),
            (&["--slo-tpot", "inf"][..], "--slo-tpot: "),
            (&["--slo-tpot", "0"][..], "--slo-tpot: "),
        ] {
            let e = slo(args).expect_err("refused").to_string();
            assert!(e.starts_with(flag) && e.contains("> 0"), "{args:?}: {e}");
        }
        assert_eq!(slo(&["--slo-ttft", "0.5"]).expect("valid"), Slo { ttft_s: 0.5, tpot_s: 0.1 });
    }

    #[test]
    fn synthetic_request_counts_past_the_bound_are_refused_naming_the_flag() {
        // These built every request up front and aborted on the allocation (exit 134).
        let e = build(&["--workload", "constant", "--rate", "1000000", "--requests", "100000000000"])
            .expect_err("refused")
            .to_string();
        assert!(e.starts_with("--requests: ") && e.contains("10000000"), "{e}");
        for (groups, per_group) in [("100000", "100000"), ("18446744073709551615", "2")] {
            let e = build(&[
                "--workload",
                "shared-prefix",
                "--rate",
                "1000000",
                "--groups",
                groups,
                "--prompts-per-group",
                per_group,
            ])
            .expect_err("refused")
            .to_string();
            assert!(e.starts_with("--groups × --prompts-per-group: ") && e.contains("10000000"), "{e}");
        }
        assert_eq!(
            build(&["--workload", "constant", "--requests", "3", "--input-tokens", "2"]).expect("runs").len(),
            3
        );
    }

    #[test]
    fn synthetic_prompt_text_past_the_bound_is_refused_naming_the_flags() {
        // One prompt of 4e9 tokens tried a 16 GB allocation; within the request bound,
        // 10 M prompts of 512 tokens are 20 GB.
        for (requests, tokens) in [("1", "4000000000"), ("10000000", "512")] {
            let e = build(&[
                "--workload",
                "poisson",
                "--rate",
                "1000000",
                "--requests",
                requests,
                "--input-tokens",
                tokens,
            ])
            .expect_err("refused")
            .to_string();
            assert!(e.starts_with("--requests × --input-tokens: ") && e.contains("2147483648"), "{e}");
        }
        let e = build(&[
            "--workload",
            "shared-prefix",
            "--rate",
            "1000000",
            "--groups",
            "1000",
            "--prompts-per-group",
            "1000",
            "--system-tokens",
            "4096",
        ])
        .expect_err("refused")
        .to_string();
        assert!(e.starts_with("--groups × --prompts-per-group × (--system-tokens"), "{e}");
        assert_eq!(
            build(&["--workload", "poisson", "--requests", "4", "--input-tokens", "1000"]).expect("runs").len(),
            4
        );
    }
}
