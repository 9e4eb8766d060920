//! `kvroute bench kv-events --zmq`: engine KV events through ZeroMQ into a router, end to
//! end. Each engine gets a PUB socket on 127.0.0.1 (as vLLM's `ZmqEventPublisher` binds
//! one), a router is started in this process on `kvroute serve`'s code
//! ([`kvroute_gateway::serve`]: one SUB socket and subscriber per engine, the applier
//! writing up to 32 queued batches at a time), and the engines publish the batches
//! `bench kv-events` pre-encodes, paced to an offered rate. What the router applied is
//! read from its own `kvroute_kv_event_batches` counters on `/metrics`. Decisions are
//! asked of its `POST /debug/route` one after another (the request's token ids in the body,
//! so the route stage reads the precise index for every engine and least_ttft decides), for
//! `seconds` before the publishing and through it: their times are HTTP round trips on
//! 127.0.0.1, the decision inside them. The engines' URLs point at a stub in this process
//! that answers every path empty (health checks pass; it serves no request). Publishers,
//! router and stub share this process and its cores, as a router and a load generator on
//! one host do.

use anyhow::{Context, bail};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketSend};

/// What to publish and how fast.
pub struct Plan {
    /// Seconds of the timed phase.
    pub seconds: f64,
    /// Block events a second offered, all engines together.
    pub rate: f64,
    /// Block events in one cycle batch (blocks removed plus stored).
    pub block_events_per_batch: u64,
    /// Each engine's first batch (the shared prefix).
    pub prefixes: Vec<Vec<u8>>,
    /// Each engine's cycle of batches.
    pub cycles: Vec<Vec<Vec<u8>>>,
    /// The decisions' request: the engines' shared system prompt, then tokens none holds.
    pub probe: Vec<u32>,
    /// Tokens of `probe` every engine holds (what a decision must find cached).
    pub probe_cached: u64,
    /// Print one JSON object.
    pub json: bool,
}

impl Plan {
    /// Batches in each engine's cycle (at least 1).
    fn cycle_len(&self) -> usize {
        self.cycles.first().map_or(0, Vec::len).max(1)
    }
}

/// Runs the end-to-end measurement.
pub fn run(p: &Plan) -> anyhow::Result<()> {
    if !(p.rate.is_finite() && p.rate >= 1.0) {
        bail!("--rate: at least 1 block event a second");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("tokio runtime")?;
    rt.block_on(measure(p))
}

/// Sums of the router's KV-event counters, per worker URL for the batches.
#[derive(Debug, Default)]
struct Counters {
    batches: HashMap<String, u64>,
    gaps: u64,
    errors: u64,
}

impl Counters {
    fn applied(&self) -> u64 {
        self.batches.values().sum()
    }
}

/// The router's KV-event counters from its Prometheus text (`name{worker="URL"} value`
/// lines): batches applied per worker URL, gaps and errors summed.
fn parse_counters(text: &str) -> Counters {
    let mut c = Counters::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.parse::<f64>() else { continue };
        let v = v.max(0.0) as u64;
        // `\u{22}` is the double quote and `\u{7b}` the opening brace, spelled so that
        // line-based tools do not take them for a string's end or a block's start.
        let worker = series.split_once("worker=\u{22}").and_then(|(_, r)| r.split_once('\u{22}')).map(|(w, _)| w);
        if series.starts_with("kvroute_kv_event_batches_total\u{7b}") {
            if let Some(w) = worker {
                *c.batches.entry(w.to_string()).or_default() += v;
            }
        } else if series.starts_with("kvroute_kv_event_gaps_total\u{7b}") {
            c.gaps += v;
        } else if series.starts_with("kvroute_kv_event_errors_total\u{7b}") {
            c.errors += v;
        }
    }
    c
}

async fn scrape(client: &reqwest::Client, router: &str, token: &str) -> anyhow::Result<Counters> {
    let text = client
        .get(format!("{router}/metrics"))
        .bearer_auth(token)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .context("the router's /metrics")?
        .text()
        .await
        .context("the router's /metrics")?;
    Ok(parse_counters(&text))
}

/// One published message: `[topic, seq, payload]` as engines send it.
fn message(seq: u64, payload: &[u8]) -> anyhow::Result<zeromq::ZmqMessage> {
    let frames = kvroute_protocol::kv_events::frames("kv-events", seq, bytes::Bytes::copy_from_slice(payload));
    zeromq::ZmqMessage::try_from(frames).map_err(|e| anyhow::anyhow!("a ZeroMQ message: {e}"))
}

async fn measure(p: &Plan) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n = p.cycles.len();
    // The engines' HTTP side: health checks and scrapes answered empty.
    let stub = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("bind the engines' stub")?;
    let stub_port = stub.local_addr().context("stub address")?.port();
    let stub_task = tokio::spawn(async move {
        let app = axum::Router::new().fallback(|| async { "" });
        let _ = axum::serve(stub, app).await;
    });
    let mut socks = Vec::with_capacity(n);
    let mut sources = Vec::with_capacity(n);
    let mut urls = Vec::with_capacity(n);
    for e in 0..n {
        let mut s = zeromq::PubSocket::new();
        let ep = s.bind("tcp://127.0.0.1:0").await.with_context(|| format!("engine {e}: bind a PUB socket"))?;
        let url = format!("http://127.0.0.1:{stub_port}/engine-{e}");
        sources.push(kvroute_gateway::config::KvEventSource {
            worker: url.clone(),
            endpoint: ep.to_string(),
            replay: None,
        });
        urls.push(url);
        socks.push(s);
    }
    let token = format!("bench-{:x}", std::process::id());
    let cfg = kvroute_gateway::GatewayConfig {
        worker_urls: urls.clone(),
        kv_events: sources,
        port: 0,
        admin_token: Some(token.clone()),
        // No engine answers a parity probe here, and no load balancer waits on a drain.
        kv_parity_check: false,
        drain_delay_secs: 0.0,
        ..kvroute_gateway::GatewayConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("bind the router")?;
    let router = format!("http://{}", listener.local_addr().context("router address")?);
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    let server = tokio::spawn(kvroute_gateway::serve(listener, cfg, async move { stopped.cancelled().await }));
    let client = reqwest::Client::new();
    let target = Target { plan: p, client: &client, router: &router, token: &token, urls: &urls };
    let result = drive(&target, &mut socks).await;
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    stub_task.abort();
    result
}

/// The router under measurement and what it is sent.
struct Target<'a> {
    plan: &'a Plan,
    client: &'a reqwest::Client,
    router: &'a str,
    token: &'a str,
    urls: &'a [String],
}

async fn drive(t: &Target<'_>, socks: &mut [zeromq::PubSocket]) -> anyhow::Result<()> {
    let Target { plan: p, client, router, token, .. } = *t;
    let n = socks.len();
    join(t, socks).await?;
    // One cycle of every engine, unpaced, then the timed phase at the offered rate.
    let mut seq = vec![1u64; n];
    for _ in 0..p.cycle_len() {
        for e in 0..n {
            send_next(p, socks, seq.as_mut_slice(), e).await?;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let phase = Duration::from_secs_f64(p.seconds);
    let (cpu0, wall0) = (process_cpu(), Instant::now());
    let quiet = decisions(t, Instant::now() + phase).await?;
    let quiet_cores = (process_cpu() - cpu0) / wall0.elapsed().as_secs_f64();
    let before = scrape(client, router, token).await?;
    let (cpu0, start) = (process_cpu(), Instant::now());
    let (sent, loaded) = tokio::join!(publish(p, socks, &mut seq, start + phase), decisions(t, start + phase));
    let (sent, loaded) = (sent?, loaded?);
    let elapsed = start.elapsed().as_secs_f64();
    let loaded_cores = (process_cpu() - cpu0) / elapsed;
    let at_end = scrape(client, router, token).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let drained = scrape(client, router, token).await?;
    let per = p.block_events_per_batch as f64;
    let offered = sent as f64 * per / elapsed;
    let applied = (at_end.applied() - before.applied()) as f64 * per / elapsed;
    let total = drained.applied() - before.applied();
    let (gaps, errors) = (drained.gaps - before.gaps, drained.errors - before.errors);
    let q = |h: &hdrhistogram::Histogram<u64>| (h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.max(), h.len());
    let ((q50, q99, qmax, qn), (l50, l99, lmax, ln)) = (q(&quiet), q(&loaded));
    if p.json {
        let o = serde_json::json!({"zmq": true, "engines": n, "seconds": elapsed,
            "offered_block_events_per_s": offered, "applied_block_events_per_s": applied,
            "batches_sent": sent, "batches_applied_after_2s": total, "gaps": gaps, "errors": errors,
            "decision_alone": {"p50_ns": q50, "p99_ns": q99, "max_ns": qmax, "decisions": qn, "process_cores": quiet_cores},
            "decision_while_ingesting": {"p50_ns": l50, "p99_ns": l99, "max_ns": lmax, "decisions": ln,
                "process_cores": loaded_cores}});
        println!("{o}");
        return Ok(());
    }
    println!("{n} engines publishing through ZeroMQ to a router in this process, {elapsed:.1} s");
    println!("offered                {offered:>12.0} block events/s ({sent} batches)");
    println!("applied by the router  {applied:>12.0} block events/s during the phase");
    println!("applied 2 s later      {total:>12} batches of {sent} sent; sequence gaps {gaps}, malformed {errors}");
    println!("POST /debug/route        p50_ns     p99_ns      max_ns  decisions  process CPU (cores)");
    println!("  before publishing  {q50:>11} {q99:>10} {qmax:>11} {qn:>10} {quiet_cores:>20.2}");
    println!("  while publishing   {l50:>11} {l99:>10} {lmax:>11} {ln:>10} {loaded_cores:>20.2}");
    Ok(())
}

/// CPU seconds this process has used (router, publishers and stub together).
fn process_cpu() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Publishes every engine's cycle in turn, paced to the offered rate, until `until`;
/// the batches sent.
async fn publish(p: &Plan, socks: &mut [zeromq::PubSocket], seq: &mut [u64], until: Instant) -> anyhow::Result<u64> {
    let n = socks.len();
    let per_sec = p.rate / p.block_events_per_batch as f64;
    let start = Instant::now();
    let (mut sent, mut e) = (0u64, 0usize);
    while Instant::now() < until {
        let due = (start.elapsed().as_secs_f64() * per_sec) as u64;
        while sent < due {
            send_next(p, socks, seq, e).await?;
            sent += 1;
            e = (e + 1) % n;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(sent)
}

/// Sends engine `e`'s next batch of its cycle (the one its sequence number names) and
/// advances the sequence.
async fn send_next(p: &Plan, socks: &mut [zeromq::PubSocket], seq: &mut [u64], e: usize) -> anyhow::Result<()> {
    let round = (seq[e] as usize - 1) % p.cycle_len();
    socks[e].send(message(seq[e], &p.cycles[e][round])?).await.context("publish")?;
    seq[e] += 1;
    Ok(())
}

/// Asks the router's `/debug/route` for the probe's decision, one request after another,
/// until `until`; each round trip's time. The first answer must have found the shared
/// prompt cached (the decision read the engines' events).
async fn decisions(t: &Target<'_>, until: Instant) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
    let body = serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": t.plan.probe, "max_tokens": 1}))
        .context("the probe's body")?;
    let url = format!("{}/debug/route", t.router);
    let mut h = hdrhistogram::Histogram::<u64>::new(3).context("histogram")?;
    let mut checked = false;
    while Instant::now() < until {
        let start = Instant::now();
        let r = t
            .client
            .post(&url)
            .bearer_auth(t.token)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .context("POST /debug/route")?;
        let status = r.status();
        let text = r.text().await.context("POST /debug/route")?;
        let _ = h.record(start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
        if !status.is_success() {
            bail!("POST /debug/route: {status}: {text}");
        }
        if !checked {
            let v: serde_json::Value = serde_json::from_str(&text).context("a /debug/route answer")?;
            if v["matched"].as_u64() < Some(t.plan.probe_cached) {
                bail!(
                    "the decision found {} of the probe's {} shared tokens cached: {text}",
                    v["matched"],
                    t.plan.probe_cached
                );
            }
            checked = true;
        }
    }
    Ok(h)
}

/// Waits for the router, then for its SUB sockets to join ours (a PUB drops what it sends
/// before a subscriber has joined): the prefix batch (sequence 0) is sent again to every
/// engine the router has not applied one from, until all have.
async fn join(t: &Target<'_>, socks: &mut [zeromq::PubSocket]) -> anyhow::Result<()> {
    let Target { plan: p, client, router, token, urls } = *t;
    let n = socks.len();
    let mut up = false;
    for _ in 0..600 {
        if scrape(client, router, token).await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !up {
        bail!("the router did not answer /metrics within 30 s");
    }
    for _ in 0..120 {
        let c = scrape(client, router, token).await?;
        let missing: Vec<usize> = (0..n).filter(|&e| c.batches.get(&urls[e]).copied().unwrap_or(0) == 0).collect();
        if missing.is_empty() {
            return Ok(());
        }
        for e in missing {
            socks[e].send(message(0, &p.prefixes[e])?).await.context("publish")?;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    bail!("not every engine's subscription joined within 60 s")
}
