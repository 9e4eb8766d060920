//! Helpers shared by the process-level tests (each test file includes this module).

use std::process::Child;

/// A child process killed and reaped when dropped, so a failing test leaves nothing running.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An ephemeral loopback port ([`kvroute_bench::free_port`]: never one this process was
/// given before).
pub fn free_port() -> u16 {
    kvroute_bench::free_port().expect("ephemeral port")
}

/// The admin token the routers of these tests run with (`KVROUTE_ADMIN_TOKEN`): without
/// one the main port serves no admin API, and the tests read `/workers` and `/debug/route`.
#[allow(dead_code)]
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A client presenting [`ADMIN_TOKEN`] unless a request sets its own `Authorization`.
#[allow(dead_code)]
pub fn client() -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::AUTHORIZATION,
        reqwest::header::HeaderValue::from_str(&format!("Bearer {ADMIN_TOKEN}")).expect("value"),
    );
    reqwest::Client::builder().default_headers(h).build().expect("client")
}

/// Starts `kvroute ARGS...` with its output discarded (killed on drop), with
/// `KVROUTE_ADMIN_TOKEN` set to [`ADMIN_TOKEN`].
#[allow(dead_code)] // not every test binary starts kvroute processes this way
pub fn spawn_kvroute(args: &[String]) -> Proc {
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env("KVROUTE_ADMIN_TOKEN", ADMIN_TOKEN)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn kvroute");
    Proc(child)
}

/// Waits until `url` + `path` answers 200; fails the test after 30 s.
#[allow(dead_code)]
pub async fn wait_ok(url: &str, path: &str) {
    let c = reqwest::Client::new();
    for _ in 0..600 {
        let ok = c
            .get(format!("{url}{path}"))
            .timeout(std::time::Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{url}{path} did not answer 200 within 30 s");
}

/// (in_flight, waiting, pending_prefill_tokens) summed over a router's workers (its
/// ledger, from `GET /workers`).
#[allow(dead_code)]
pub async fn ledger(c: &reqwest::Client, router: &str) -> (u64, u64, u64) {
    let v: serde_json::Value =
        c.get(format!("{router}/workers")).send().await.expect("workers").json().await.expect("json");
    v["workers"].as_array().expect("rows").iter().fold((0, 0, 0), |(a, b, p), w| {
        let n = |k: &str| w[k].as_u64().unwrap_or(0);
        (a + n("in_flight"), b + n("waiting"), p + n("pending_prefill_tokens"))
    })
}

/// Polls the router's ledger until it is all zeros; fails the test after 30 s.
#[allow(dead_code)]
pub async fn ledger_drains(c: &reqwest::Client, router: &str) {
    let mut last = (0, 0, 0);
    for _ in 0..600 {
        last = ledger(c, router).await;
        if last == (0, 0, 0) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the ledger did not return to zero: (in_flight, waiting, pending_prefill_tokens) = {last:?}");
}

/// `n` engine-sims (`kvroute engine-sim --time-scale SCALE`) on free ports, once each
/// answers `/health`: the processes (killed on drop) and their base URLs.
#[allow(dead_code)]
pub async fn engine_sims(n: usize, time_scale: &str) -> (Vec<Proc>, Vec<String>) {
    let mut procs = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..n {
        let port = free_port();
        let a: Vec<String> = ["engine-sim", "--port", &port.to_string(), "--time-scale", time_scale]
            .iter()
            .map(|s| (*s).to_string())
            .collect();
        procs.push(spawn_kvroute(&a));
        urls.push(format!("http://127.0.0.1:{port}"));
    }
    for u in &urls {
        wait_ok(u, "/health").await;
    }
    (procs, urls)
}

/// `kvroute serve --port P ARGS...` on a free port, once `/readiness` answers 200: the
/// process (killed on drop) and its base URL.
#[allow(dead_code)]
pub async fn serve(args: &[&str]) -> (Proc, String) {
    let port = free_port().to_string();
    let mut a: Vec<String> = vec!["serve".into(), "--port".into(), port.clone()];
    a.extend(args.iter().map(|s| (*s).to_string()));
    let p = spawn_kvroute(&a);
    let url = format!("http://127.0.0.1:{port}");
    wait_ok(&url, "/readiness").await;
    (p, url)
}

/// Each worker's `(host_prompt_cache, slot_routing)` from `GET {base}/workers`, once every
/// worker's `llama_slot_routing = "auto"` probe has a verdict (at most 120 s; then as it is).
#[allow(dead_code)]
pub async fn slot_routing_flags(c: &reqwest::Client, base: &str) -> Vec<(serde_json::Value, serde_json::Value)> {
    let mut flags = Vec::new();
    for _ in 0..600 {
        let v: serde_json::Value =
            c.get(format!("{base}/workers")).send().await.expect("workers").json().await.expect("json");
        flags = v["workers"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|w| (w["host_prompt_cache"].clone(), w["slot_routing"].clone()))
            .collect();
        if flags.iter().all(|(h, _)| !h.is_null()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    flags
}
