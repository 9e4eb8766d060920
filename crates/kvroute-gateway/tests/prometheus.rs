//! A real Prometheus (Debian `prometheus`, given by `KVROUTE_PROMETHEUS`) scrapes the
//! gateway's `/metrics`: its HTTP API returns kvroute's series with the values the traffic
//! implies, and every query of the Grafana dashboard (`docs/grafana/kvroute-dashboard.json`)
//! is valid PromQL over series that exist. Ignored by default; `scripts/test.sh` runs it when
//! `KVROUTE_PROMETHEUS` is set, and CI requires it.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

/// A Prometheus server scraping one target every second; killed and its data removed on
/// drop.
struct Prometheus {
    child: Child,
    dir: std::path::PathBuf,
    url: String,
}

impl Prometheus {
    async fn start(target: &str) -> Prometheus {
        let bin = match std::env::var("KVROUTE_PROMETHEUS") {
            Ok(p) if std::path::Path::new(&p).is_file() => p,
            _ => panic!(
                "this test needs a real Prometheus: install the Debian package prometheus and run it with \
                 KVROUTE_PROMETHEUS=$(command -v prometheus) (scripts/test.sh does when it is set)"
            ),
        };
        let dir = std::env::temp_dir().join(format!("kvroute-prometheus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: kvroute\n    \
                 static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .expect("config");
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, dir, url: format!("http://127.0.0.1:{port}") };
        let c = reqwest::Client::new();
        for _ in 0..600 {
            if c.get(format!("{}/-/ready", p.url)).send().await.is_ok_and(|r| r.status().is_success()) {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("Prometheus not ready within 30 s");
    }

    /// An instant query through the HTTP API: the `data.result` vector (status checked).
    async fn query(&self, c: &reqwest::Client, q: &str) -> Vec<serde_json::Value> {
        let url = url::Url::parse_with_params(&format!("{}/api/v1/query", self.url), [("query", q)]).expect("url");
        let v: serde_json::Value = c.get(url).send().await.expect("query").json().await.expect("json");
        assert_eq!(v["status"], "success", "query `{q}`: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The single value of a query returning one sample (NaN when it returns none).
    async fn scalar(&self, c: &reqwest::Client, q: &str) -> f64 {
        let r = self.query(c, q).await;
        r.first().and_then(|s| s["value"][1].as_str()?.parse().ok()).unwrap_or(f64::NAN)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `q` until its value is `want`; fails after 60 s.
async fn until_value(p: &Prometheus, c: &reqwest::Client, q: &str, want: f64) {
    let mut last = f64::NAN;
    for _ in 0..600 {
        last = p.scalar(c, q).await;
        if last == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("`{q}` is {last}, expected {want} (60 s)");
}

/// The dashboard panels the test traffic must give data to (the others need ejections,
/// admission limits, API keys, engine scraping or etcd, and only have to be valid).
const PANELS_WITH_DATA: [&str; 8] = [
    "Requests by outcome",
    "Routing decisions by branch",
    "Prefix match predicted by the router",
    "TTFT at the router",
    "End-to-end latency",
    "In flight per worker",
    "Workers routable",
    "Decision time p99",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Prometheus (Debian prometheus): KVROUTE_PROMETHEUS=$(command -v prometheus) scripts/test.sh"]
async fn prometheus_scrapes_kvroute_and_every_dashboard_query_is_valid() {
    let stop_w = CancellationToken::new();
    let sim = || EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() };
    let (w1, _) = engine_sim::spawn_local(sim(), stop_w.clone()).await.expect("worker");
    let (w2, _) = engine_sim::spawn_local(sim(), stop_w.clone()).await.expect("worker");
    let stop = CancellationToken::new();
    let (r, _t) = common::start_router(common::config(&[&w1, &w2], "cache_aware"), stop.clone()).await;
    let prom = Prometheus::start(r.trim_start_matches("http://")).await;
    let c = reqwest::Client::new();

    // 12 requests, 4 of them streamed, sharing a prefix two by two.
    let (total, streamed) = (12, 4);
    for i in 0..total {
        let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 3, "stream": i < streamed,
            "messages": [{"role": "user", "content": format!("shared document {} — question {i}", i / 2)}]});
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&body).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
        let _ = guard(resp.bytes()).await.expect("body");
    }

    // Prometheus's API returns kvroute's series with the values the traffic implies.
    until_value(&prom, &c, "sum(kvroute_requests_total)", f64::from(total)).await;
    until_value(&prom, &c, r#"sum(kvroute_requests_total{outcome="ok"})"#, f64::from(total)).await;
    let by_worker = prom.query(&c, "sum by (worker) (kvroute_requests_total)").await;
    let mut workers: Vec<&str> = by_worker.iter().filter_map(|s| s["metric"]["worker"].as_str()).collect();
    workers.sort();
    let mut want = vec![w1.as_str(), w2.as_str()];
    want.sort();
    assert_eq!(workers, want, "one series per worker, labelled with its URL");
    assert!(prom.scalar(&c, "sum(kvroute_ttft_seconds_count)").await >= f64::from(streamed));
    assert_eq!(prom.scalar(&c, "sum(kvroute_worker_healthy)").await, 2.0);
    assert_eq!(prom.scalar(&c, "sum(kvroute_worker_in_flight)").await, 0.0, "nothing left in flight");
    assert_eq!(prom.scalar(&c, r#"up{job="kvroute"}"#).await, 1.0);

    // Every dashboard query parses and runs; the ones the traffic feeds return data.
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana/kvroute-dashboard.json"))
            .expect("dashboard"),
    )
    .expect("dashboard JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= PANELS_WITH_DATA.len());
    for title in PANELS_WITH_DATA {
        assert!(panels.iter().any(|p| p["title"] == title), "no panel `{title}`");
    }
    for p in panels {
        let title = p["title"].as_str().expect("title");
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr").replace("$worker", ".*");
            // A rate needs traffic between two scrapes: keep sending while polling (bounded).
            let mut got = prom.query(&c, &expr).await;
            if PANELS_WITH_DATA.contains(&title) {
                for i in 0..100 {
                    if got.iter().any(|s| s["value"][1].as_str().is_some_and(|v| v != "NaN")) {
                        break;
                    }
                    let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 2, "stream": true,
                        "messages": [{"role": "user", "content": format!("shared document 1 — more {i}")}]});
                    let resp =
                        guard(c.post(format!("{r}/v1/chat/completions")).json(&body).send()).await.expect("send");
                    let _ = guard(resp.bytes()).await.expect("body");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    got = prom.query(&c, &expr).await;
                }
                assert!(
                    got.iter().any(|s| s["value"][1].as_str().is_some_and(|v| v != "NaN")),
                    "panel `{title}`: `{expr}` returned no data: {got:?}"
                );
            }
        }
    }
    stop.cancel();
    stop_w.cancel();
}
