//! Client API keys (`api_key_file`): inference and `/v1/models` need a known key, and each
//! key's requests and tokens per minute are limited (429 with `Retry-After`), counted per
//! tenant. Every connection is to 127.0.0.1 with a simulated worker.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

fn chat(max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens})
}

/// A router (round robin) in front of one instant simulated worker, its key file in the
/// temporary directory; both stopped and the file removed on drop.
struct Keyed {
    router: String,
    /// The key file; removed when dropped (after `Drop` stopped the router).
    file: tempfile::TempPath,
    stop: CancellationToken,
    stop_worker: CancellationToken,
}

impl Keyed {
    /// Writes `keys` to a file named after `name` and starts the router with it.
    async fn start(name: &str, keys: &str) -> Keyed {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let stop_worker = CancellationToken::new();
        let sim = EngineSimConfig { instant: true, ..EngineSimConfig::default() };
        let (w, _sim) = engine_sim::spawn_local(sim, stop_worker.clone()).await.expect("worker");
        let file = tempfile::Builder::new()
            .prefix(&format!("kvroute-{name}-"))
            .suffix(".txt")
            .tempfile()
            .expect("temp file")
            .into_temp_path();
        std::fs::write(&file, keys).expect("write keys");
        let config = GatewayConfig {
            policy: "round_robin".into(),
            worker_urls: vec![w],
            port: 0,
            api_key_file: Some(file.display().to_string()),
            ..GatewayConfig::default()
        };
        let stop = CancellationToken::new();
        let (router, _task) = common::start_router(config, stop.clone()).await;
        Keyed { router, file, stop, stop_worker }
    }
}

impl Drop for Keyed {
    fn drop(&mut self) {
        self.stop.cancel();
        self.stop_worker.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required_and_each_key_is_held_to_its_requests_and_tokens_per_minute() {
    // `sk-hashed` listed by its SHA-256 (`printf %s sk-hashed | sha256sum`).
    let hashed = "c291001835042e213221b2f9fca79c9c91d08813d599b717bc695a268edb2ea6";
    let keys = format!("# test keys\nsk-req team-a rpm=3\nsk-tok team-b tpm=50\nsk-free\nsha256:{hashed} team-h\n");
    let keyed = Keyed::start("keys", &keys).await;
    let (c, r) = (reqwest::Client::new(), keyed.router.clone());
    let send = |key: Option<&str>, body: serde_json::Value| {
        let mut rb = c.post(format!("{r}/v1/chat/completions")).json(&body);
        if let Some(k) = key {
            rb = rb.bearer_auth(k);
        }
        guard(rb.send())
    };
    // No key, an unknown key: 401 JSON. /v1/models too; /health and /metrics stay open.
    for key in [None, Some("sk-unknown")] {
        let resp = send(key, chat(5)).await.expect("send");
        assert_eq!(resp.status(), 401);
        let v: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    }
    assert_eq!(guard(c.get(format!("{r}/v1/models")).send()).await.expect("s").status(), 401);
    let models = guard(c.get(format!("{r}/v1/models")).bearer_auth("sk-free").send()).await.expect("s");
    assert_eq!(models.status(), 200);
    assert_eq!(guard(c.get(format!("{r}/health")).send()).await.expect("s").status(), 200);
    // Requests per minute: 3, then 429 with Retry-After.
    for i in 0..3 {
        assert_eq!(send(Some("sk-req"), chat(5)).await.expect("send").status(), 200, "request {i}");
    }
    let resp = send(Some("sk-req"), chat(5)).await.expect("send");
    assert_eq!(resp.status(), 429);
    let wait: u64 = resp.headers()["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((1..=60).contains(&wait), "Retry-After {wait}");
    // OpenAI's error type for a rate limit, which clients branch on.
    let v: serde_json::Value = guard(resp.json()).await.expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["code"], 429, "{v}");
    // Tokens per minute: prompt (~3 tokens) + max_tokens 30 fits in 50 once, not twice; a
    // request larger than a minute's worth is refused without Retry-After.
    assert_eq!(send(Some("sk-tok"), chat(30)).await.expect("send").status(), 200);
    let resp = send(Some("sk-tok"), chat(30)).await.expect("send");
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let resp = send(Some("sk-tok"), chat(1000)).await.expect("send");
    assert_eq!(resp.status(), 429);
    assert!(!resp.headers().contains_key("retry-after"));
    // Another key is unaffected (no limits).
    for _ in 0..5 {
        assert_eq!(send(Some("sk-free"), chat(5)).await.expect("send").status(), 200);
    }
    // A key listed by its digest is served under its tenant; the digest itself is no key.
    assert_eq!(send(Some("sk-hashed"), chat(5)).await.expect("send").status(), 200);
    for digest in [format!("sha256:{hashed}"), hashed.to_string()] {
        assert_eq!(send(Some(&digest), chat(5)).await.expect("send").status(), 401, "{digest}");
    }
    let text = guard(c.get(format!("{r}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    for line in [
        r#"kvroute_tenant_requests_total{tenant="team-a",outcome="admitted"} 3"#,
        r#"kvroute_tenant_requests_total{tenant="team-a",outcome="rate_limited_requests"} 1"#,
        r#"kvroute_tenant_requests_total{tenant="team-b",outcome="admitted"} 1"#,
        r#"kvroute_tenant_requests_total{tenant="team-b",outcome="rate_limited_tokens"} 2"#,
        r#"kvroute_tenant_requests_total{tenant="-",outcome="admitted"} 5"#,
        r#"kvroute_tenant_requests_total{tenant="team-h",outcome="admitted"} 1"#,
    ] {
        assert!(text.contains(line), "missing `{line}` in\n{text}");
    }
    assert!(!text.contains("sk-"), "a key appeared in the metrics");
}

#[tokio::test]
async fn a_bad_key_file_stops_the_router_naming_the_line() {
    let file = tempfile::Builder::new().prefix("kvroute-badkeys-").suffix(".txt").tempfile().expect("temp file");
    std::fs::write(file.path(), "sk-a\nsk-b rpm=fast\n").expect("write");
    let config = GatewayConfig { api_key_file: Some(file.path().display().to_string()), ..GatewayConfig::default() };
    let err = kvroute_gateway::app::AppState::new(config).expect_err("refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("line 2") && msg.contains("rpm"), "{msg}");
}

/// `kvroute_api_key_reloads_total{outcome}` from `/metrics` (0 when absent).
async fn key_reloads(c: &reqwest::Client, r: &str, outcome: &str) -> u64 {
    let text = guard(c.get(format!("{r}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    let prefix = format!("kvroute_api_key_reloads_total{{outcome=\"{outcome}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.trim().parse().expect("counter"))
}

/// Rewrites the key file in one step (a rename), as a deploy tool would, sends this process
/// a SIGHUP and waits (bounded) until the `n`-th reload with `outcome` is counted.
async fn rewrite_and_reload(c: &reqwest::Client, r: &str, file: &std::path::Path, text: &str, outcome: &str, n: u64) {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write keys");
    std::fs::rename(&tmp, file).expect("replace keys");
    let pid = std::process::id().to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("kill").success());
    guard(async {
        while key_reloads(c, r, outcome).await < n {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// The key file is read again on SIGHUP, without any configuration file: a key removed is
/// refused from then on, a key added is served, a key whose line is unchanged keeps what it
/// used of its minute, a tenant no key names leaves `/metrics`, and a file that does not
/// parse keeps the keys in effect. (A SIGHUP goes to the whole test process: this is the
/// only test of this binary that sends one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reads_the_key_file_again_and_a_bad_file_keeps_the_keys_in_effect() {
    let keyed = Keyed::start("keys-reload", "sk-leaked team-old\nsk-kept team-kept rpm=2\n").await;
    let (c, r, file) = (reqwest::Client::new(), keyed.router.clone(), keyed.file.to_path_buf());
    let status = |key: &'static str| {
        let rb = c.post(format!("{r}/v1/chat/completions")).json(&chat(5)).bearer_auth(key);
        async move { guard(rb.send()).await.expect("send").status().as_u16() }
    };
    assert_eq!(status("sk-leaked").await, 200);
    assert_eq!(status("sk-new").await, 401);
    assert_eq!((status("sk-kept").await, status("sk-kept").await), (200, 200), "its two requests of the minute");
    assert_eq!(key_reloads(&c, &r, "applied").await, 0);

    rewrite_and_reload(&c, &r, &file, "sk-kept team-kept rpm=2\nsk-new team-new\n", "applied", 1).await;
    assert_eq!(status("sk-leaked").await, 401, "a removed key is refused");
    assert_eq!(status("sk-new").await, 200, "an added key is served");
    assert_eq!(status("sk-kept").await, 429, "an unchanged key keeps what it used of its minute");
    let text = guard(c.get(format!("{r}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    assert!(!text.contains("team-old"), "a tenant gone from the file stays in /metrics:\n{text}");
    assert!(text.contains(r#"kvroute_tenant_requests_total{tenant="team-new",outcome="admitted"} 1"#), "{text}");

    rewrite_and_reload(&c, &r, &file, "sk-new team-new rpm=fast\n", "invalid", 1).await;
    assert_eq!(status("sk-new").await, 200, "a file that does not parse changed the keys");
    assert_eq!(status("sk-kept").await, 429, "a file that does not parse changed the keys");
    assert_eq!(status("sk-leaked").await, 401);
}
