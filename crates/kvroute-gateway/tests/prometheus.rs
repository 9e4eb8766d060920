//! A real Prometheus (Debian `prometheus`, its binary given by `KVROUTE_PROMETHEUS`) scrapes
//! two gateways on 127.0.0.1: job `kvroute` serves traffic on two simulated workers behind
//! API keys; job `kvroute-faults` routes to a worker that answers every request with a 500
//! and one that never answers, for retries, an ejection and admission rejections.
//! Prometheus's HTTP API must return kvroute's series with the values the traffic implies.
//! Every query of the Grafana dashboard (`docs/grafana/kvroute-dashboard.json`) must name
//! only series the gateway exposes, run, and return data wherever this traffic feeds it,
//! and docs/monitoring.md must list every series. Ignored by default; `scripts/test.sh`
//! runs it when `KVROUTE_PROMETHEUS` is set, and CI requires it.
//!
//! Waits poll until a deadline and then fail saying what they waited for; nothing asserts
//! on time.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

/// The model the simulated workers serve.
const MODEL: &str = "sim-llama-3-8b";

/// Series prefixes this test's fleet cannot feed (live policy needs etcd, KV-event series
/// need engines publishing events, the endpoint picker's need a gateway calling it — its
/// series are checked in crates/kvroute/tests/epp.rs — and the cluster sync's need NATS,
/// checked in crates/kvroute/tests/cluster_cli.rs): dashboard queries on them must run, not
/// return data.
const NEEDS_OUTSIDE_PIECES: [&str; 5] =
    ["kvroute_policy_updates", "kvroute_kv_event_", "kvroute_epp_", "kvroute_sync_", "kvroute_nats_"];

/// How long a wait may last before the test fails.
const DEADLINE: Duration = Duration::from_secs(60);

/// A fresh directory under the system temp dir, removed with its contents when the guard
/// drops (also on a panic).
fn scratch_dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("kvroute-prometheus-").tempdir().expect("create the test's directory")
}

/// A Prometheus server on 127.0.0.1 scraping its targets every second; killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
    client: reqwest::Client,
}

impl Prometheus {
    /// The Prometheus binary `KVROUTE_PROMETHEUS` names; fails saying how to get one.
    fn binary() -> String {
        std::env::var("KVROUTE_PROMETHEUS").ok().filter(|p| Path::new(p).is_file()).unwrap_or_else(|| {
            panic!(
                "this test needs a real Prometheus: install the Debian package `prometheus` \
                 (apt-get install prometheus) and run it with KVROUTE_PROMETHEUS=$(command -v prometheus) \
                 (scripts/test.sh runs it when that is set)"
            )
        })
    }

    /// Starts Prometheus `bin` scraping each `(job, host:port)`, with its configuration,
    /// data and log in `dir`; returns once `/-/ready` answers.
    async fn start(bin: &str, dir: &Path, jobs: &[(&str, &str)]) -> Prometheus {
        let mut yml = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n",
        );
        for (job, target) in jobs {
            yml.push_str(&format!("  - job_name: {job}\n    static_configs:\n      - targets: [\"{target}\"]\n"));
        }
        let config = dir.join("prometheus.yml");
        std::fs::write(&config, yml).expect("write prometheus.yml");
        // The port is found free, then given to Prometheus: another process may take it in
        // between, so a Prometheus that exits at start is tried again on another port.
        let mut last_log = String::new();
        for attempt in 1..=3 {
            let port =
                std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
            let log = dir.join(format!("prometheus-{attempt}.log"));
            let child = Command::new(bin)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", dir.join(format!("data-{attempt}")).display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("prometheus log file"))
                .spawn()
                .unwrap_or_else(|e| panic!("start {bin}: {e}"));
            let mut p = Prometheus {
                child,
                url: format!("http://127.0.0.1:{port}"),
                log,
                client: reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("client"),
            };
            let deadline = tokio::time::Instant::now() + DEADLINE;
            let exited = loop {
                if let Some(status) = p.child.try_wait().expect("wait for prometheus") {
                    break status;
                }
                let ready = p.client.get(format!("{}/-/ready", p.url)).send().await;
                if ready.is_ok_and(|r| r.status().is_success()) {
                    return p;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "Prometheus was not ready within {DEADLINE:?}; its log:\n{}",
                    p.log_text()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            last_log = p.log_text();
            eprintln!("Prometheus exited at start ({exited}); trying another port. Its log:\n{last_log}");
        }
        panic!("Prometheus exited at start three times; the last log:\n{last_log}");
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `data` of a GET on the HTTP API (its `status` checked).
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let url = url::Url::parse_with_params(&format!("{}{path}", self.url), params).expect("url");
        let resp = guard(self.client.get(url).send()).await.unwrap_or_else(|e| panic!("Prometheus {path}: {e}"));
        let v: Value = guard(resp.json()).await.unwrap_or_else(|e| panic!("Prometheus {path}: not JSON: {e}"));
        assert_eq!(v["status"], "success", "Prometheus {path} {params:?}: {v}");
        v["data"].clone()
    }

    /// The result vector of an instant query.
    async fn query(&self, q: &str) -> Vec<Value> {
        let data = self.api("/api/v1/query", &[("query", q)]).await;
        assert_eq!(data["resultType"], "vector", "`{q}`: {data}");
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// The value of a query returning one sample; `None` when it returns none.
    async fn scalar(&self, q: &str) -> Option<f64> {
        let r = self.query(q).await;
        assert!(r.len() <= 1, "`{q}` returned {} series: {r:?}", r.len());
        r.first().and_then(sample)
    }

    /// Waits until `q` returns one sample equal to `want`.
    async fn until_value(&self, q: &str, want: f64) {
        eventually(&format!("`{q}` == {want}"), async || match self.scalar(q).await {
            Some(v) if v == want => Ok(()),
            got => Err(format!("{got:?}")),
        })
        .await;
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A sample's value (`"NaN"` included).
fn sample(s: &Value) -> Option<f64> {
    s["value"][1].as_str()?.parse().ok()
}

/// Whether a result vector has a number in it (not only NaN).
fn has_data(r: &[Value]) -> bool {
    r.iter().filter_map(sample).any(|v| !v.is_nan())
}

/// Polls `probe` until it returns `Ok`; fails after [`DEADLINE`] with `what` and the last
/// `Err`.
async fn eventually<T>(what: &str, mut probe: impl AsyncFnMut() -> Result<T, String>) -> T {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(last) if tokio::time::Instant::now() >= deadline => {
                panic!("waited {DEADLINE:?} for {what}; last seen: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn worker(cfg: EngineSimConfig, stop: &CancellationToken) -> String {
    engine_sim::spawn_local(cfg, stop.clone()).await.expect("start a simulated worker").0
}

fn chat(content: &str, stream: bool) -> Value {
    json!({"model": MODEL, "max_tokens": 3, "stream": stream, "messages": [{"role": "user", "content": content}]})
}

/// Requests the gateway at `gateway` has in flight on `worker` (its `/workers` table).
async fn in_flight(c: &reqwest::Client, gateway: &str, worker: &str) -> u64 {
    let v: Value = guard(guard(c.get(format!("{gateway}/workers")).send()).await.expect("workers").json())
        .await
        .expect("workers JSON");
    let rows = v["workers"].as_array().expect("worker rows");
    let row = rows.iter().find(|w| w["url"] == worker).unwrap_or_else(|| panic!("{worker} not in {v}"));
    row["in_flight"].as_u64().expect("in_flight")
}

/// The `kvroute_*` names a PromQL expression uses.
fn series_names(expr: &str) -> BTreeSet<&str> {
    expr.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == ':'))
        .filter(|t| t.starts_with("kvroute_"))
        .collect()
}

/// The series names a metric family of type `ty` exposes; every form it could take when
/// its type is unknown (`""`: a family without samples).
fn exposed_series(family: &str, ty: &str) -> Vec<String> {
    let with = |suffixes: &[&str]| suffixes.iter().map(|s| format!("{family}{s}")).collect();
    match ty {
        "counter" => with(&["_total"]),
        "histogram" => with(&["_bucket", "_sum", "_count"]),
        "gauge" => with(&[""]),
        _ => with(&["_total", "", "_bucket", "_sum", "_count"]),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Prometheus (Debian package prometheus): KVROUTE_PROMETHEUS=$(command -v prometheus) bash scripts/test.sh"]
async fn prometheus_scrapes_kvroute_and_every_dashboard_query_reads_its_series() {
    let bin = Prometheus::binary();
    // Declared before `prom`, so it is removed after Prometheus is killed.
    let dir = scratch_dir();
    let stop_w = CancellationToken::new();
    let sim = || EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() };
    let w1 = worker(sim(), &stop_w).await;
    let w2 = worker(sim(), &stop_w).await;
    let failing = worker(EngineSimConfig { error_rate: 1.0, ..sim() }, &stop_w).await;
    let hanging = worker(EngineSimConfig { hang_rate: 1.0, ..sim() }, &stop_w).await;

    // Job `kvroute`: two workers behind API keys (team-b may send one request a minute),
    // engine metrics scraped for the engines' prefix-cache hit ratio.
    let keys = dir.path().join("api-keys.txt");
    std::fs::write(&keys, "sk-main team-a\nsk-limited team-b rpm=1\n").expect("write the API-key file");
    let mut main_cfg = common::config(&[&w1, &w2], "cache_aware");
    main_cfg.api_key_file = Some(keys.display().to_string());
    // The admin token from a file, as a Secret gives it (the reload panel reads its series).
    let token = dir.path().join("admin-token");
    std::fs::write(&token, common::ADMIN_TOKEN).expect("write the admin token file");
    main_cfg.admin_token = None;
    main_cfg.admin_token_file = Some(token.display().to_string());
    main_cfg.scrape_metrics = true;
    main_cfg.health.interval_secs = 0.5;
    let stop = CancellationToken::new();
    let (gw, _task) = common::start_router(main_cfg, stop.clone()).await;
    // Job `kvroute-faults`: a failing and a hanging worker, two requests in flight at most.
    let mut faults_cfg = common::config(&[&failing, &hanging], "round_robin");
    faults_cfg.max_in_flight_per_model = 2;
    let (gf, _task_f) = common::start_router(faults_cfg, stop.clone()).await;

    let prom = Prometheus::start(
        &bin,
        dir.path(),
        &[("kvroute", gw.trim_start_matches("http://")), ("kvroute-faults", gf.trim_start_matches("http://"))],
    )
    .await;
    // Both targets scraped once before any traffic: counters start from a sample at 0.
    prom.until_value(r#"up{job="kvroute"}"#, 1.0).await;
    prom.until_value(r#"up{job="kvroute-faults"}"#, 1.0).await;

    // Traffic on `kvroute`: 12 requests of team-a, 4 streamed, sharing a prompt two by two;
    // then team-b's one request a minute, and one more (429).
    let c = common::client();
    let send = async |gateway: &str, key: Option<&str>, body: &Value| {
        let mut rb = c.post(format!("{gateway}/v1/chat/completions")).json(body);
        if let Some(k) = key {
            rb = rb.bearer_auth(k);
        }
        guard(rb.send()).await.expect("send")
    };
    let (team_a, streamed) = (12, 4);
    for i in 0..team_a {
        let body = chat(&format!("shared document {} — question {i}", i / 2), i < streamed);
        let resp = send(&gw, Some("sk-main"), &body).await;
        assert_eq!(resp.status(), 200, "request {i}");
        let text = guard(resp.text()).await.expect("body");
        if i < streamed {
            assert!(text.contains("data: [DONE]"), "stream {i} ended early: {text}");
        }
    }
    assert_eq!(send(&gw, Some("sk-limited"), &chat("team b", false)).await.status(), 200);
    assert_eq!(send(&gw, Some("sk-limited"), &chat("team b again", false)).await.status(), 429);

    // Traffic on `kvroute-faults`: two requests end up held by the hanging worker (whichever
    // the round robin sends to the failing worker first is tried there 3 times, which ejects
    // it, then moves on: 3 retries); the model's two permits are taken, so the next two
    // requests are refused with 503.
    let hold = |n: u64| {
        let (c, url, body) = (c.clone(), format!("{gf}/v1/chat/completions"), chat(&format!("held {n}"), false));
        tokio::spawn(async move { c.post(url).json(&body).send().await })
    };
    let mut held = Vec::new();
    for n in 1..=2u64 {
        held.push(hold(n));
        eventually(&format!("{n} request(s) held by the hanging worker"), async || {
            match in_flight(&c, &gf, &hanging).await {
                got if got == n => Ok(()),
                got => Err(format!("{got} in flight there")),
            }
        })
        .await;
    }
    for i in 0..2 {
        let resp = send(&gf, None, &chat(&format!("refused {i}"), false)).await;
        assert_eq!(resp.status(), 503, "request {i} over the admission limit");
        assert_eq!(resp.headers()["retry-after"], "1");
    }

    // Prometheus's API returns kvroute's series with the values the traffic implies.
    let in_main = |q: &str| q.replace("JOB", r#"job="kvroute""#);
    prom.until_value(&in_main("sum(kvroute_requests_total{JOB})"), f64::from(team_a + 2)).await;
    prom.until_value(&in_main(r#"sum(kvroute_requests_total{JOB,outcome="ok"})"#), f64::from(team_a + 1)).await;
    prom.until_value(&in_main(r#"sum(kvroute_requests_total{JOB,outcome="client_error"})"#), 1.0).await;
    let by_worker = prom.query(&in_main(r#"sum by (worker) (kvroute_requests_total{JOB,outcome="ok"})"#)).await;
    let workers: BTreeSet<&str> = by_worker.iter().filter_map(|s| s["metric"]["worker"].as_str()).collect();
    assert_eq!(workers, BTreeSet::from([w1.as_str(), w2.as_str()]), "ok requests per worker URL: {by_worker:?}");
    prom.until_value(&in_main(r#"kvroute_tenant_requests_total{JOB,tenant="team-a",outcome="admitted"}"#), 12.0).await;
    prom.until_value(&in_main(r#"kvroute_tenant_requests_total{JOB,tenant="team-b",outcome="admitted"}"#), 1.0).await;
    let limited = r#"kvroute_tenant_requests_total{JOB,tenant="team-b",outcome="rate_limited_requests"}"#;
    prom.until_value(&in_main(limited), 1.0).await;
    // Each successful answer is one end-to-end observation; TTFT has at least the streams.
    prom.until_value(&in_main("kvroute_e2e_seconds_count{JOB}"), f64::from(team_a + 1)).await;
    let ttft = prom.scalar(&in_main("kvroute_ttft_seconds_count{JOB}")).await.expect("TTFT count");
    assert!(ttft >= f64::from(streamed), "TTFT count {ttft} < {streamed} streams");
    assert_eq!(prom.scalar(&in_main("sum(kvroute_worker_healthy{JOB})")).await, Some(2.0));
    assert_eq!(prom.scalar(&in_main("sum(kvroute_worker_in_flight{JOB})")).await, Some(0.0), "left in flight");
    prom.until_value(&in_main("count(kvroute_engine_prefix_hit_ratio{JOB} >= 0 <= 1)"), 2.0).await;
    let in_faults = |q: &str| q.replace("JOB", r#"job="kvroute-faults""#);
    prom.until_value(&in_faults(&format!(r#"kvroute_admission_rejections_total{{JOB,model="{MODEL}"}}"#)), 2.0).await;
    prom.until_value(&in_faults(r#"sum(kvroute_requests_total{JOB,outcome="rejected"})"#), 2.0).await;
    prom.until_value(&in_faults("kvroute_retries_total{JOB}"), 3.0).await;
    prom.until_value(&in_faults(r#"kvroute_worker_ejections_total{JOB,outcome="ejected"}"#), 1.0).await;
    prom.until_value(&in_faults(&format!(r#"kvroute_worker_healthy{{JOB,worker="{failing}"}}"#)), 0.0).await;
    assert_eq!(
        prom.scalar(&in_faults(&format!(r#"kvroute_worker_in_flight{{JOB,worker="{hanging}"}}"#))).await,
        Some(2.0)
    );
    // The ejection series existed at 0 before, so the first ejection is an increase.
    eventually("the first ejection to show as an increase", async || {
        match prom.scalar(&in_faults("sum(increase(kvroute_worker_ejections_total{JOB}[5m]))")).await {
            Some(v) if v > 0.0 => Ok(()),
            got => Err(format!("{got:?}")),
        }
    })
    .await;

    // The dashboard: a data-source input and variable, a worker variable whose values
    // Prometheus has, and only kvroute series that exist in every query.
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana/kvroute-dashboard.json"))
            .expect("read docs/grafana/kvroute-dashboard.json"),
    )
    .expect("the dashboard is JSON");
    assert_eq!(dash["__inputs"][0]["pluginId"], "prometheus", "a Prometheus data-source input");
    let vars = dash["templating"]["list"].as_array().expect("templating.list");
    let var = |name: &str| vars.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("no variable `{name}`"));
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    let def = var("worker")["definition"].as_str().expect("worker variable definition");
    let metric = def
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(", worker)"))
        .unwrap_or_else(|| panic!("worker variable: {def}"));
    let values = prom.api("/api/v1/label/worker/values", &[("match[]", metric)]).await;
    let values: BTreeSet<&str> = values.as_array().expect("label values").iter().filter_map(Value::as_str).collect();
    for w in [&w1, &w2, &failing, &hanging] {
        assert!(values.contains(w.as_str()), "`{def}` lacks {w}: {values:?}");
    }
    // The gateway's metric families: every name registered in metrics.rs, typed from the
    // two gateways' expositions (prometheus-client leaves a family without samples, e.g.
    // the KV-event ones here, out of /metrics, so Prometheus never sees it).
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/metrics.rs")).expect("metrics.rs");
    let registered: BTreeSet<&str> =
        source.split('"').skip(1).step_by(2).filter(|lit| lit.starts_with("kvroute_") && !lit.contains(' ')).collect();
    let mut types = BTreeMap::new();
    for g in [&gw, &gf] {
        let text =
            guard(guard(c.get(format!("{g}/metrics")).send()).await.expect("/metrics").text()).await.expect("text");
        for (name, ty) in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' ')) {
            assert!(registered.contains(name), "`{name}` is exposed but not found in metrics.rs: {registered:?}");
            types.insert(name.to_string(), ty.to_string());
        }
    }
    assert_eq!(types.get("kvroute_requests").map(String::as_str), Some("counter"), "{types:?}");
    let exposed: BTreeSet<String> =
        registered.iter().flat_map(|f| exposed_series(f, types.get(*f).map_or("", String::as_str))).collect();
    let panels = dash["panels"].as_array().expect("panels");
    let ids: BTreeSet<u64> = panels.iter().filter_map(|p| p["id"].as_u64()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
    for p in panels {
        let title = p["title"].as_str().expect("title");
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel `{title}`");
        let targets = p["targets"].as_array().filter(|t| !t.is_empty());
        for t in targets.unwrap_or_else(|| panic!("panel `{title}` has no query")) {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel `{title}`");
            let expr = t["expr"].as_str().expect("expr");
            let names = series_names(expr);
            assert!(!names.is_empty(), "panel `{title}`: `{expr}` reads no kvroute series");
            for n in &names {
                assert!(exposed.contains(*n), "panel `{title}`: `{n}` is not a series the gateway exposes");
            }
            let q = expr.replace("$__rate_interval", "1m").replace("$worker", ".*");
            if names.iter().any(|n| NEEDS_OUTSIDE_PIECES.iter().any(|x| n.starts_with(x))) {
                prom.query(&q).await; // Runs (status checked); no data without etcd or KV events.
                continue;
            }
            // A rate needs traffic between two scrapes: keep some coming while polling.
            let mut i = 0;
            eventually(&format!("panel `{title}`: data from `{q}`"), async || {
                let r = prom.query(&q).await;
                if has_data(&r) {
                    return Ok(());
                }
                i += 1;
                let resp = send(&gw, Some("sk-main"), &chat(&format!("shared document 1 — more {i}"), true)).await;
                guard(resp.bytes()).await.expect("body");
                Err(format!("{r:?}"))
            })
            .await;
        }
    }

    // docs/monitoring.md lists every series the gateway exposes.
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/monitoring.md"))
        .expect("read docs/monitoring.md");
    for family in &registered {
        let listed = exposed_series(family, types.get(*family).map_or("", String::as_str))
            .iter()
            .any(|name| doc.contains(&format!("`{}`", name.strip_suffix("_bucket").unwrap_or(name))));
        assert!(listed, "docs/monitoring.md does not list `{family}`");
    }

    for h in held {
        h.abort();
    }
    drop(prom);
    stop.cancel();
    stop_w.cancel();
}
