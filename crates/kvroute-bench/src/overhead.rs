//! Proxy overhead measured from outside: `wrk` (a C closed-loop client that shares no
//! runtime with anything under test) against instant workers, directly and through each
//! router, at concurrency 1 (added latency) and 32 (throughput). The engine of
//! `kvroute bench overhead`.
//!
//! The processes (workers, kvroute, the peer routers) are started by a [`Launcher`] the
//! caller provides (the `kvroute` binary uses the launchers of `kvroute bench compare`, so
//! both start the same command lines). Per round: the direct call to one worker, then every
//! router in turn (the order rotated from round to round), each with a warm-up, a run at
//! concurrency 1, a run at concurrency 32 and the resident memory of its process tree.
//! Non-2xx answers (wrk: status ≥ 400) and socket errors are counted as failures and shown.
//!
//! Everything is bounded: each wrk run by its duration (plus a margin, then it is killed),
//! each router start by the launcher's timeout; every child is killed when dropped, on an
//! error, and on Ctrl-C or SIGTERM.

use anyhow::{Context, bail};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// Concurrency of the latency run (added latency is measured here).
pub const LATENCY_CONNECTIONS: usize = 1;
/// Concurrency of the throughput run.
pub const THROUGHPUT_CONNECTIONS: usize = 32;

/// The Debian/Ubuntu package that provides `wrk`.
pub const WRK_PACKAGE: &str = "wrk";

/// A router and policy under test.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Target {
    /// `kvroute`, `sglang-router`, `vllm-router` or `smg`.
    pub router: String,
    /// Its `--policy`.
    pub policy: String,
}

impl Target {
    /// `router policy`.
    pub fn label(&self) -> String {
        format!("{} {}", self.router, self.policy)
    }
}

/// Starts and stops the processes under test. Every `Proc` must kill its process when
/// dropped (that is the cleanup on errors and interruption).
#[allow(async_fn_in_trait)]
pub trait Launcher {
    /// A running child process.
    type Proc;
    /// Starts `n` instant workers and waits until they answer; their base URLs.
    async fn workers(&self, n: usize) -> anyhow::Result<(Vec<Self::Proc>, Vec<String>)>;
    /// Starts the router of `t` in front of `workers` and waits until it forwards a chat
    /// completion; its base URL.
    async fn router(&self, t: &Target, workers: &[String]) -> anyhow::Result<(Self::Proc, String)>;
    /// The process id (for its resident memory).
    fn pid(p: &Self::Proc) -> Option<u32>;
    /// Stops it and waits (bounded) for it to exit.
    async fn stop(&self, p: Self::Proc);
    /// True when the error of [`Launcher::router`] means the router is not installed (it is
    /// then skipped in later rounds).
    fn not_installed(e: &anyhow::Error) -> bool {
        format!("{e:#}").contains("not installed")
    }
}

/// Settings of the benchmark.
#[derive(Debug, Clone)]
pub struct Config {
    /// The wrk binary ([`find_wrk`]).
    pub wrk: PathBuf,
    /// Seconds of each measured run.
    pub duration_secs: u64,
    /// Seconds of the warm-up before each router's (and the direct path's) runs, at
    /// concurrency 32; not measured.
    pub warmup_secs: u64,
    /// Rounds: each runs the direct path and every target once.
    pub rounds: usize,
    /// Instant workers behind the routers.
    pub workers: usize,
    /// Routers and policies, in table order.
    pub targets: Vec<Target>,
    /// `model` of the chat completion.
    pub model: String,
    /// wrk's per-request timeout, seconds (a request slower than this is a timeout error).
    pub request_timeout_secs: u64,
    /// Directory for the Lua script and every wrk output.
    pub dir: PathBuf,
}

/// One wrk run, from the line the Lua `done` hook prints.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct WrkRun {
    /// Open connections (= concurrency, one thread).
    pub connections: usize,
    /// Completed requests (any status).
    pub requests: u64,
    /// Wall time of the run, seconds.
    pub duration_s: f64,
    /// Completed requests per second.
    pub rps: f64,
    /// Latency percentiles and mean, microseconds.
    pub p50_us: f64,
    /// 90th percentile, µs.
    pub p90_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
    /// Maximum, µs.
    pub max_us: f64,
    /// Answers with status ≥ 400 (wrk's "Non-2xx or 3xx responses").
    pub non_2xx: u64,
    /// Socket errors: connect.
    pub connect_errors: u64,
    /// Socket errors: read.
    pub read_errors: u64,
    /// Socket errors: write.
    pub write_errors: u64,
    /// Requests that exceeded the timeout.
    pub timeouts: u64,
}

impl WrkRun {
    /// Failed requests: non-2xx answers and socket errors.
    pub fn errors(&self) -> u64 {
        self.non_2xx + self.connect_errors + self.read_errors + self.write_errors + self.timeouts
    }
}

/// The marker of the Lua `done` hook's line.
const MARK: &str = "KVROUTE_WRK";

/// Parses the `KVROUTE_WRK key=value …` line of wrk's output.
///
/// # Errors
/// No such line, or a missing or malformed field.
pub fn parse_wrk(output: &str, connections: usize) -> anyhow::Result<WrkRun> {
    let line = output
        .lines()
        .find_map(|l| l.strip_prefix(MARK))
        .with_context(|| format!("wrk printed no {MARK} line (did the Lua script run?)"))?;
    let mut kv = std::collections::HashMap::new();
    for pair in line.split_whitespace() {
        let (k, v) = pair.split_once('=').with_context(|| format!("wrk: bad field `{pair}`"))?;
        let v: f64 = v.parse().with_context(|| format!("wrk: bad number in `{pair}`"))?;
        kv.insert(k, v);
    }
    let get = |k: &str| kv.get(k).copied().with_context(|| format!("wrk: no `{k}` in `{line}`"));
    let duration_s = get("duration_us")? / 1e6;
    let requests = get("requests")? as u64;
    Ok(WrkRun {
        connections,
        requests,
        duration_s,
        rps: if duration_s > 0.0 { requests as f64 / duration_s } else { 0.0 },
        p50_us: get("p50_us")?,
        p90_us: get("p90_us")?,
        p99_us: get("p99_us")?,
        mean_us: get("mean_us")?,
        max_us: get("max_us")?,
        non_2xx: get("status")? as u64,
        connect_errors: get("connect")? as u64,
        read_errors: get("read")? as u64,
        write_errors: get("write")? as u64,
        timeouts: get("timeout")? as u64,
    })
}

/// The Lua script: a POST of one non-streamed chat completion (one user message,
/// `max_tokens` 1), and a `done` hook printing the numbers in one parseable line.
pub fn lua_script(model: &str) -> String {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "You are a helpful assistant. What is the capital of France?"}],
        "max_tokens": 1,
        "stream": false,
    });
    // A Lua long string: the JSON has no `]]`.
    format!(
        r#"wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{body}]]
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("{MARK} requests=%d duration_us=%d connect=%d read=%d write=%d status=%d timeout=%d mean_us=%.2f max_us=%d p50_us=%d p90_us=%d p99_us=%d\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.max, latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"#
    )
}

/// `wrk` from `explicit`, else from `PATH`.
///
/// # Errors
/// Not found: the message names the Debian package.
pub fn find_wrk(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!(
            "wrk not found at {} (install the Debian/Ubuntu package `{WRK_PACKAGE}`: apt-get install -y {WRK_PACKAGE})",
            p.display()
        );
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let p = dir.join("wrk");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "wrk not found on PATH: `kvroute bench overhead` drives the routers with wrk, an external C client; install the Debian/Ubuntu package `{WRK_PACKAGE}` (apt-get install -y {WRK_PACKAGE}) or pass --wrk PATH"
    )
}

/// Resident memory of `pid` and all its descendants, KiB (VmRSS from `/proc`); `None` when
/// the process is gone or `/proc` is unreadable.
pub fn tree_rss_kib(pid: u32) -> Option<u64> {
    let own = vm_rss_kib(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)?;
    // Children by parent pid, from /proc/*/stat.
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
            // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok()) {
                parents.push((p, ppid));
            }
        }
    }
    let mut total = own;
    let mut frontier = vec![pid];
    while let Some(x) = frontier.pop() {
        for &(c, pp) in &parents {
            if pp == x {
                if let Some(r) = std::fs::read_to_string(format!("/proc/{c}/status")).ok().and_then(|s| vm_rss_kib(&s))
                {
                    total += r;
                }
                frontier.push(c);
            }
        }
    }
    Some(total)
}

/// `VmRSS` of a `/proc/PID/status` text, KiB.
pub fn vm_rss_kib(status: &str) -> Option<u64> {
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`).
pub fn load_average() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = s.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

/// The measurements of one router (or the direct path) in one round.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// Round, from 1.
    pub round: usize,
    /// `direct`, or the router.
    pub router: String,
    /// The policy (`-` for direct).
    pub policy: String,
    /// Why there are no numbers (not installed, did not start, wrk failed).
    pub skipped: Option<String>,
    /// The run at concurrency 1.
    pub c1: Option<WrkRun>,
    /// The run at concurrency 32.
    pub c32: Option<WrkRun>,
    /// Resident memory of the router's process tree after its runs, KiB.
    pub rss_kib: Option<u64>,
    /// Load average (1 min) when its runs started.
    pub load_before: Option<f64>,
}

impl Row {
    fn new(round: usize, router: &str, policy: &str) -> Self {
        Row {
            round,
            router: router.into(),
            policy: policy.into(),
            skipped: None,
            c1: None,
            c32: None,
            rss_kib: None,
            load_before: None,
        }
    }

    /// Failed requests in its measured runs.
    pub fn errors(&self) -> u64 {
        self.c1.iter().chain(&self.c32).map(WrkRun::errors).sum()
    }
}

/// Everything measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Every row of every round, the direct path first in each round.
    pub rows: Vec<Row>,
    /// Rounds run.
    pub rounds: usize,
    /// Seconds per measured run.
    pub duration_secs: u64,
    /// Seconds of warm-up.
    pub warmup_secs: u64,
    /// Instant workers.
    pub workers: usize,
    /// `nproc`.
    pub cpus: usize,
    /// Load averages before and after the whole benchmark.
    pub load_before: Option<[f64; 3]>,
    /// After.
    pub load_after: Option<[f64; 3]>,
    /// `wrk --version`'s first line.
    pub wrk_version: String,
}

impl Report {
    /// Rows with failed requests (any router or the direct path).
    pub fn failing(&self) -> Vec<&Row> {
        self.rows.iter().filter(|r| r.errors() > 0).collect()
    }
}

/// A wrk child, killed when dropped.
struct KillOnDrop(tokio::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// Runs wrk once against `url` at `connections` for `secs`; its output is kept in
/// `log` and parsed.
async fn wrk(
    cfg: &Config,
    script: &Path,
    url: &str,
    connections: usize,
    secs: u64,
    log: &Path,
) -> anyhow::Result<WrkRun> {
    let target = format!("{}/v1/chat/completions", url.trim_end_matches('/'));
    let args = [
        "-t1".to_string(),
        format!("-c{connections}"),
        format!("-d{secs}s"),
        format!("--timeout={}s", cfg.request_timeout_secs),
        "--latency".into(),
        "-s".into(),
        script.display().to_string(),
        target,
    ];
    let child = tokio::process::Command::new(&cfg.wrk)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", cfg.wrk.display()))?;
    let mut child = KillOnDrop(child);
    let bound = Duration::from_secs(secs + cfg.request_timeout_secs + 30);
    let mut stdout = child.0.stdout.take().context("wrk stdout")?;
    let mut stderr = child.0.stderr.take().context("wrk stderr")?;
    let read = async {
        use tokio::io::AsyncReadExt;
        let (mut o, mut e) = (String::new(), String::new());
        let (a, b) = tokio::join!(stdout.read_to_string(&mut o), stderr.read_to_string(&mut e));
        a?;
        b?;
        let status = child.0.wait().await?;
        anyhow::Ok((status, o, e))
    };
    let (status, out, err) =
        tokio::time::timeout(bound, read).await.with_context(|| format!("wrk did not finish within {bound:?}"))??;
    let text = format!("$ wrk {}\n{out}{err}", args.join(" "));
    std::fs::write(log, &text).with_context(|| format!("writing {}", log.display()))?;
    if !status.success() {
        bail!("wrk failed ({status}): {}", err.trim());
    }
    parse_wrk(&out, connections).with_context(|| format!("wrk output in {}", log.display()))
}

/// Warm-up, the concurrency-1 run and the concurrency-32 run against `url`.
async fn measure(cfg: &Config, script: &Path, url: &str, name: &str, row: &mut Row) -> anyhow::Result<()> {
    let log = |what: &str| cfg.dir.join(format!("r{}-{name}-{what}.txt", row.round));
    row.load_before = load_average().map(|l| l[0]);
    if cfg.warmup_secs > 0 {
        wrk(cfg, script, url, THROUGHPUT_CONNECTIONS, cfg.warmup_secs, &log("warmup")).await?;
    }
    row.c1 = Some(wrk(cfg, script, url, LATENCY_CONNECTIONS, cfg.duration_secs, &log("c1")).await?);
    row.c32 = Some(wrk(cfg, script, url, THROUGHPUT_CONNECTIONS, cfg.duration_secs, &log("c32")).await?);
    Ok(())
}

/// `wrk --version`'s first line.
fn wrk_version(wrk: &Path) -> String {
    std::process::Command::new(wrk)
        .arg("--version")
        .output()
        .map(|o| {
            let s = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
            s.lines().next().unwrap_or("").trim().to_string()
        })
        .unwrap_or_default()
}

/// Runs the benchmark; prints each round's table as it completes (and progress on stderr).
/// Stops and kills every child on Ctrl-C or SIGTERM.
///
/// # Errors
/// Workers that do not start, a failing wrk on the direct path, bad settings, interruption.
/// A router that does not start or a wrk failure through a router is recorded in its row.
pub async fn run<L: Launcher>(cfg: &Config, launcher: &L) -> anyhow::Result<Report> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = run_inner(cfg, launcher) => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted (Ctrl-C); children stopped"),
        _ = term.recv() => bail!("terminated (SIGTERM); children stopped"),
    }
}

/// Checks the settings, writes wrk's script, starts the workers, runs every round (its
/// table printed as it ends) and the summary of several rounds.
async fn run_inner<L: Launcher>(cfg: &Config, launcher: &L) -> anyhow::Result<Report> {
    if cfg.duration_secs == 0 || cfg.rounds == 0 || cfg.workers == 0 {
        bail!("--duration, --rounds and --workers must be at least 1");
    }
    std::fs::create_dir_all(&cfg.dir).with_context(|| format!("creating {}", cfg.dir.display()))?;
    let script = cfg.dir.join("chat.lua");
    std::fs::write(&script, lua_script(&cfg.model)).with_context(|| format!("writing {}", script.display()))?;
    let mut report = Report {
        rows: Vec::new(),
        rounds: cfg.rounds,
        duration_secs: cfg.duration_secs,
        warmup_secs: cfg.warmup_secs,
        workers: cfg.workers,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before: load_average(),
        load_after: None,
        wrk_version: wrk_version(&cfg.wrk),
    };
    let (kids, urls) = launcher.workers(cfg.workers).await.context("starting the instant workers")?;
    let mut absent: Vec<(usize, String)> = Vec::new();
    for round in 1..=cfg.rounds {
        let rows = run_round(cfg, launcher, &script, &urls, round, &mut absent).await?;
        println!("{}", round_table(&rows, round, cfg.rounds));
        report.rows.extend(rows);
    }
    for k in kids {
        launcher.stop(k).await;
    }
    report.load_after = load_average();
    if cfg.rounds > 1 {
        println!("{}", summary_table(&report));
    }
    Ok(report)
}

/// One round: the direct path, then every router in an order rotated from round to round
/// (so no router always runs first or last); rows come back in target order.
async fn run_round<L: Launcher>(
    cfg: &Config,
    launcher: &L,
    script: &Path,
    urls: &[String],
    round: usize,
    absent: &mut Vec<(usize, String)>,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    eprintln!(
        "round {round}/{}: load average {}",
        cfg.rounds,
        load_average().map_or_else(|| "?".into(), |l| format!("{:.2} {:.2} {:.2}", l[0], l[1], l[2]))
    );
    let mut direct = Row::new(round, "direct", "-");
    measure(cfg, script, &urls[0], "direct", &mut direct).await.context("wrk against a worker directly")?;
    eprintln!("  direct: {}", progress_line(&direct));
    rows.push(direct);
    let n = cfg.targets.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.rotate_left((round - 1) % n.max(1));
    let mut measured: Vec<(usize, Row)> = Vec::new();
    for i in order {
        let row = router_row(cfg, launcher, script, urls, round, i, absent).await;
        measured.push((i, row));
    }
    measured.sort_by_key(|(i, _)| *i);
    rows.extend(measured.into_iter().map(|(_, r)| r));
    Ok(rows)
}

/// The row of target `i` in `round`: skipped when it was found not installed before, else
/// its router started, measured (with its RSS) and stopped; a failure is recorded in the row.
async fn router_row<L: Launcher>(
    cfg: &Config,
    launcher: &L,
    script: &Path,
    urls: &[String],
    round: usize,
    i: usize,
    absent: &mut Vec<(usize, String)>,
) -> Row {
    let t = &cfg.targets[i];
    let mut row = Row::new(round, &t.router, &t.policy);
    if let Some((_, why)) = absent.iter().find(|(j, _)| *j == i) {
        row.skipped = Some(why.clone());
        return row;
    }
    match launcher.router(t, urls).await {
        Ok((proc, url)) => {
            let name = t.label().replace(' ', "-");
            let m = measure(cfg, script, &url, &name, &mut row).await;
            row.rss_kib = L::pid(&proc).and_then(tree_rss_kib);
            launcher.stop(proc).await;
            match m {
                Ok(()) => eprintln!("  {}: {}", t.label(), progress_line(&row)),
                Err(e) => {
                    eprintln!("  {}: failed: {e:#}", t.label());
                    row.skipped = Some(format!("{e:#}"));
                }
            }
        }
        Err(e) => {
            eprintln!("  {}: skipped: {e:#}", t.label());
            if L::not_installed(&e) {
                absent.push((i, format!("{e:#}")));
            }
            row.skipped = Some(format!("{e:#}"));
        }
    }
    row
}

fn progress_line(r: &Row) -> String {
    match (&r.c1, &r.c32) {
        (Some(a), Some(b)) => {
            format!("c=1 p50 {:.0} µs p99 {:.0} µs; c=32 {:.0} req/s; {} errors", a.p50_us, a.p99_us, b.rps, r.errors())
        }
        _ => "-".into(),
    }
}

fn mb(kib: Option<u64>) -> String {
    kib.map_or_else(|| "-".into(), |k| format!("{:.0}", k as f64 / 1024.0))
}

const HEADER: &str = "| router | policy | c=1 p50 (µs) | c=1 p99 (µs) | added p50 (µs) | c=32 req/s | c=32 p50 (µs) | c=32 p99 (µs) | errors | RSS (MB) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|";

/// The table of one round (markdown): the direct path, then every router; added p50 is
/// the router's c=1 p50 minus the direct path's of the same round.
pub fn round_table(rows: &[Row], round: usize, rounds: usize) -> String {
    let direct = rows.iter().find(|r| r.router == "direct").and_then(|r| r.c1.as_ref()).map(|c| c.p50_us);
    let mut s = String::new();
    let load = rows
        .first()
        .and_then(|r| r.load_before)
        .map_or_else(String::new, |l| format!(", load average {l:.2} at its start"));
    let _ = writeln!(s, "\nround {round}/{rounds}{load}");
    let _ = writeln!(s, "{HEADER}");
    for r in rows {
        let (Some(c1), Some(c32)) = (&r.c1, &r.c32) else {
            let why = r.skipped.as_deref().unwrap_or("no numbers");
            let _ =
                writeln!(s, "| {} | {} | skipped: {} ||||||||", r.router, r.policy, why.lines().next().unwrap_or(""));
            continue;
        };
        let added = match direct {
            Some(d) if r.router != "direct" => format!("{:+.0}", c1.p50_us - d),
            _ => "-".into(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.0} | {added} | {:.0} | {:.0} | {:.0} | {} | {} |",
            r.router,
            r.policy,
            c1.p50_us,
            c1.p99_us,
            c32.rps,
            c32.p50_us,
            c32.p99_us,
            r.errors(),
            if r.router == "direct" { "-".into() } else { mb(r.rss_kib) },
        );
    }
    s
}

fn range(xs: &[f64], fmt: impl Fn(f64) -> String) -> String {
    if xs.is_empty() {
        return "-".into();
    }
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (a, b) = (fmt(lo), fmt(hi));
    if a == b { a } else { format!("{a}–{b}") }
}

/// All rounds as ranges (min–max over the rounds), one line per router and policy.
pub fn summary_table(report: &Report) -> String {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in &report.rows {
        let k = (r.router.clone(), r.policy.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let direct_p50 = |round: usize| {
        report
            .rows
            .iter()
            .find(|r| r.round == round && r.router == "direct")
            .and_then(|r| r.c1.as_ref())
            .map(|c| c.p50_us)
    };
    let mut s = String::new();
    let _ = writeln!(s, "\nall {} rounds (min–max over the rounds)", report.rounds);
    let _ = writeln!(s, "{HEADER}");
    for (router, policy) in keys {
        let rows: Vec<&Row> = report.rows.iter().filter(|r| r.router == router && r.policy == policy).collect();
        let ok: Vec<&Row> = rows.iter().copied().filter(|r| r.c1.is_some() && r.c32.is_some()).collect();
        if ok.is_empty() {
            let why = rows.iter().find_map(|r| r.skipped.as_deref()).unwrap_or("no numbers");
            let _ = writeln!(s, "| {router} | {policy} | skipped: {} ||||||||", why.lines().next().unwrap_or(""));
            continue;
        }
        let col = |f: &dyn Fn(&Row) -> Option<f64>| ok.iter().filter_map(|r| f(r)).collect::<Vec<f64>>();
        let us = |x: f64| format!("{x:.0}");
        let added = if router == "direct" {
            "-".into()
        } else {
            range(&col(&|r| Some(r.c1.as_ref()?.p50_us - direct_p50(r.round)?)), |x| format!("{x:+.0}"))
        };
        let errors: u64 = rows.iter().map(|r| r.errors()).sum();
        let partial =
            if ok.len() < rows.len() { format!(" ({} of {} rounds)", ok.len(), rows.len()) } else { String::new() };
        let _ = writeln!(
            s,
            "| {router} | {policy}{partial} | {} | {} | {added} | {} | {} | {} | {errors} | {} |",
            range(&col(&|r| Some(r.c1.as_ref()?.p50_us)), us),
            range(&col(&|r| Some(r.c1.as_ref()?.p99_us)), us),
            range(&col(&|r| Some(r.c32.as_ref()?.rps)), us),
            range(&col(&|r| Some(r.c32.as_ref()?.p50_us)), us),
            range(&col(&|r| Some(r.c32.as_ref()?.p99_us)), us),
            if router == "direct" {
                "-".into()
            } else {
                range(&col(&|r| Some(r.rss_kib? as f64 / 1024.0)), |x| format!("{x:.0}"))
            },
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "Running 1s test @ http://127.0.0.1:1/v1/chat/completions\n  1 threads and 1 connections\n\
        KVROUTE_WRK requests=20512 duration_us=1000123 connect=0 read=0 write=0 status=3 timeout=0 mean_us=47.21 max_us=910 p50_us=46 p90_us=52 p99_us=80\n";

    #[test]
    fn parses_the_done_line() {
        let r = parse_wrk(OUT, 1).expect("parse");
        assert_eq!(r.requests, 20512);
        assert!((r.rps - 20509.5).abs() < 1.0, "{}", r.rps);
        assert_eq!((r.p50_us, r.p90_us, r.p99_us, r.max_us), (46.0, 52.0, 80.0, 910.0));
        assert_eq!(r.non_2xx, 3);
        assert_eq!(r.errors(), 3);
        assert!(parse_wrk("Running 1s test\n", 1).is_err());
        assert!(parse_wrk("KVROUTE_WRK requests=1 duration_us=x\n", 1).is_err());
    }

    #[test]
    fn the_script_prints_every_parsed_field() {
        let s = lua_script("m");
        for k in [
            "requests",
            "duration_us",
            "connect",
            "read",
            "write",
            "status",
            "timeout",
            "mean_us",
            "max_us",
            "p50_us",
            "p90_us",
            "p99_us",
        ] {
            assert!(s.contains(&format!(" {k}=")), "{k}");
        }
        assert!(s.contains(r#""model":"m""#) && s.contains("wrk.method = \"POST\""));
    }

    #[test]
    fn rss_from_status() {
        assert_eq!(vm_rss_kib("Name:\tx\nVmPeak:\t 10 kB\nVmRSS:\t   1234 kB\n"), Some(1234));
        assert_eq!(vm_rss_kib("Name:\tx\n"), None);
        let me = tree_rss_kib(std::process::id()).expect("own rss");
        assert!(me > 0);
    }

    #[test]
    fn missing_wrk_names_the_package() {
        let e = find_wrk(Some(Path::new("/nonexistent/wrk"))).expect_err("missing");
        assert!(format!("{e}").contains("apt-get install -y wrk"), "{e}");
    }

    fn run(p50: f64, rps: f64, status: u64) -> WrkRun {
        WrkRun { p50_us: p50, p99_us: p50 * 2.0, rps, non_2xx: status, ..Default::default() }
    }

    #[test]
    fn tables_show_added_latency_and_ranges() {
        let mut rows = Vec::new();
        for (round, d, k) in [(1, 46.0, 186.0), (2, 47.0, 185.0)] {
            let mut direct = Row::new(round, "direct", "-");
            direct.c1 = Some(run(d, 20000.0, 0));
            direct.c32 = Some(run(400.0, 60000.0, 0));
            let mut kv = Row::new(round, "kvroute", "cache_aware");
            kv.c1 = Some(run(k, 5000.0, 0));
            kv.c32 = Some(run(2500.0, 13000.0 + round as f64 * 100.0, 0));
            kv.rss_kib = Some(20 * 1024);
            let mut peer = Row::new(round, "smg", "round_robin");
            peer.skipped = Some("/x/smg is not installed (run …)".into());
            rows.extend([direct, kv, peer]);
        }
        let t = round_table(&rows[..3], 1, 2);
        assert!(t.contains("| kvroute | cache_aware | 186 | 372 | +140 | 13100 | 2500 | 5000 | 0 | 20 |"), "{t}");
        assert!(t.contains("| smg | round_robin | skipped: /x/smg is not installed"), "{t}");
        let report = Report {
            rows,
            rounds: 2,
            duration_secs: 1,
            warmup_secs: 0,
            workers: 2,
            cpus: 2,
            load_before: None,
            load_after: None,
            wrk_version: String::new(),
        };
        let s = summary_table(&report);
        assert!(s.contains("| kvroute | cache_aware | 185–186 | 370–372 | +138–+140 | 13100–13200 |"), "{s}");
        assert!(report.failing().is_empty());
    }
}
