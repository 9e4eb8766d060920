//! TLS with rustls: clients over HTTPS (HTTP/2 by ALPN and HTTP/1.1), `https://` workers
//! trusted through `worker_ca_file`, and certificate reloads. Certificates are generated
//! per run by a private test CA; every connection is to 127.0.0.1.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use kvroute_gateway::server::{self, Limits};
use kvroute_gateway::tls::ServerTls;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;
#[path = "common/pki.rs"]
mod pki;
use pki::{TestCa, client_trusting, scratch_dir};

fn chat() -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hello over TLS"}],
        "max_tokens": 3})
}

fn limits() -> Limits {
    Limits {
        header_read_timeout: Duration::from_secs(10),
        max_connections: 64,
        drain_timeout: Duration::from_secs(5),
        drain_delay: Duration::ZERO,
        ..Limits::default()
    }
}

/// Serves `app` with `tls` on an ephemeral port until `stop`; returns `https://127.0.0.1:PORT`.
async fn serve_tls(app: axum::Router, tls: Arc<ServerTls>, stop: CancellationToken) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move {
        server::serve(l, app, limits(), Some(tls), async move { stop.cancelled().await }, server::Drain::default())
            .await;
    });
    url
}

/// Starts the gateway with `cfg` (which has `tls_cert`/`tls_key`) until `stop` and waits,
/// bounded, until `client` gets an answer from `/health` over HTTPS.
async fn start_https_router(cfg: GatewayConfig, stop: CancellationToken, client: &reqwest::Client) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", l.local_addr().expect("addr"));
    tokio::spawn(kvroute_gateway::serve(l, cfg, async move { stop.cancelled().await }));
    guard(async {
        while client.get(format!("{url}/health")).send().await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_reach_the_router_over_https_by_http2_and_http1_and_plain_http_or_an_unknown_ca_is_refused() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = scratch_dir("tls-clients");
    let ca = TestCa::new("kvroute test CA");
    let (crt, key) = ca.server_cert(dir.path(), "router");
    let stop_w = CancellationToken::new();
    let (w, sim) =
        engine_sim::spawn_local(EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() }, stop_w.clone())
            .await
            .expect("worker");
    let cfg = GatewayConfig {
        tls_cert: Some(crt.display().to_string()),
        tls_key: Some(key.display().to_string()),
        ..common::config(&[&w], "round_robin")
    };
    let stop = CancellationToken::new();
    let h2 = client_trusting(&ca, false);
    let r = start_https_router(cfg, stop.clone(), &h2).await;

    let resp = guard(h2.post(format!("{r}/v1/chat/completions")).json(&chat()).send()).await.expect("https h2");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2, "ALPN offers h2");
    let v: serde_json::Value = resp.json().await.expect("json");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");

    let h1 = client_trusting(&ca, true);
    let resp = guard(h1.post(format!("{r}/v1/chat/completions")).json(&chat()).send()).await.expect("https h1");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_11);
    // The simulated worker counts a request finished just after its answer is written: read
    // the count once it has caught up (a hang guard, not a timing assertion).
    common::eventually("both HTTPS requests reached the worker", async || sim.stats().finished == 2).await;

    // Plain HTTP to the TLS port: the handshake fails and the connection is closed.
    let plain = r.replacen("https://", "http://", 1);
    let res = guard(common::client().get(format!("{plain}/health")).send()).await;
    assert!(res.is_err(), "plain HTTP must not be served on the TLS port: {res:?}");
    // A client that does not trust the router's CA refuses the certificate.
    let other = client_trusting(&TestCa::new("some other CA"), false);
    let res = guard(other.get(format!("{r}/health")).send()).await;
    assert!(res.is_err(), "a certificate from an unknown CA was accepted: {res:?}");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_workers_are_trusted_through_worker_ca_file_and_not_without_it() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = scratch_dir("tls-workers");
    let fleet_ca = TestCa::new("inference fleet CA");
    let (crt, key) = fleet_ca.server_cert(dir.path(), "worker");
    let ca_file = fleet_ca.write(dir.path(), "fleet-ca.pem");
    // A simulated worker behind TLS, served by the gateway's own server loop.
    let sim = engine_sim::start(EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() });
    let stop_w = CancellationToken::new();
    let w =
        serve_tls(engine_sim::app(Arc::clone(&sim)), ServerTls::load(&crt, &key).expect("worker TLS"), stop_w.clone())
            .await;
    assert!(w.starts_with("https://127.0.0.1:"));

    let c = common::client();
    let trusted =
        GatewayConfig { worker_ca_file: Some(ca_file.display().to_string()), ..common::config(&[&w], "round_robin") };
    let stop = CancellationToken::new();
    let (r, _t) = common::start_router(trusted, stop.clone()).await;
    for _ in 0..3 {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
        assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap_or_default());
    }
    common::eventually("the requests went to the https worker", async || sim.stats().finished == 3).await;
    let workers: serde_json::Value =
        guard(c.get(format!("{r}/workers")).send()).await.expect("workers").json().await.expect("json");
    assert_eq!(workers["workers"][0]["models"][0], "sim-llama-3-8b", "models discovered over TLS: {workers}");

    // Without the fleet's CA the worker's certificate is refused: its health checks fail, so
    // it is never routed to, and the client gets a JSON 503.
    let untrusted = common::config(&[&w], "round_robin");
    let stop2 = CancellationToken::new();
    let (r2, _t2) = common::start_router(untrusted, stop2.clone()).await;
    let resp = guard(c.post(format!("{r2}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    let status = resp.status();
    let v: serde_json::Value = resp.json().await.expect("JSON error");
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["message"], "no healthy worker available", "{v}");
    assert_eq!(sim.stats().finished, 3, "no request reached the worker through an untrusted certificate");
    // An unreadable or empty CA bundle is a startup error naming the key.
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").expect("write");
    for bad in [empty.display().to_string(), dir.path().join("missing.pem").display().to_string()] {
        let cfg = GatewayConfig { worker_ca_file: Some(bad), ..common::config(&[&w], "round_robin") };
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let e = kvroute_gateway::serve(l, cfg, async {}).await.expect_err("bad CA bundle refused");
        assert!(format!("{e:#}").contains("worker_ca_file"), "{e:#}");
    }
    stop.cancel();
    stop2.cancel();
    stop_w.cancel();
}

/// Whether `url`'s `/health` answers 200 to a client trusting only `ca`: a new client, so
/// each check is a new connection and a new handshake.
async fn answers(url: &str, ca: &TestCa) -> bool {
    let c = client_trusting(ca, true);
    guard(c.get(format!("{url}/health")).send()).await.is_ok_and(|r| r.status() == 200)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_serves_the_new_certificate_to_new_connections_and_a_bad_file_keeps_the_old_one() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = scratch_dir("tls-reload");
    let (ca1, ca2) = (TestCa::new("first CA"), TestCa::new("second CA"));
    let (crt, key) = ca1.server_cert(dir.path(), "router");
    let tls = ServerTls::load(&crt, &key).expect("load");
    let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
    let stop = CancellationToken::new();
    let url = serve_tls(app, Arc::clone(&tls), stop.clone()).await;
    assert!(answers(&url, &ca1).await && !answers(&url, &ca2).await, "serving the first certificate");

    // Renewed in place (a new certificate from another CA), then reloaded.
    let (crt2, key2) = ca2.server_cert(dir.path(), "renewed");
    std::fs::rename(&crt2, &crt).expect("replace certificate");
    std::fs::rename(&key2, &key).expect("replace key");
    tls.reload().expect("reload");
    assert!(answers(&url, &ca2).await && !answers(&url, &ca1).await, "serving the renewed certificate");

    // A broken renewal: the reload fails naming the file and the certificate in use stays.
    std::fs::write(&crt, "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n").expect("write");
    let e = tls.reload().expect_err("a garbled certificate is refused");
    assert!(format!("{e:#}").contains("tls_cert"), "{e:#}");
    std::fs::write(&crt, "").expect("write");
    let e = tls.reload().expect_err("an empty certificate file is refused");
    assert!(format!("{e:#}").contains("no CERTIFICATE"), "{e:#}");
    // A key that is not the certificate's.
    let (crt3, _) = ca1.server_cert(dir.path(), "third");
    std::fs::rename(&crt3, &crt).expect("replace certificate");
    let e = tls.reload().expect_err("a key that does not fit is refused");
    assert!(format!("{e:#}").contains("does not fit"), "{e:#}");
    assert!(answers(&url, &ca2).await, "still serving the last good certificate");
    // The configuration refuses half a TLS setup.
    let half = GatewayConfig { tls_cert: Some(crt.display().to_string()), ..GatewayConfig::default() };
    assert_eq!(half.validate().expect_err("cert without key").key, "tls_key");
    stop.cancel();
}

/// With `reload_watch_secs`, a certificate renewed in place (as cert-manager renews a
/// mounted Secret) is served to new connections without a signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_renewed_in_place_is_served_without_a_signal_with_the_file_watch() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = scratch_dir("tls-watch");
    let (ca1, ca2) = (TestCa::new("first CA"), TestCa::new("second CA"));
    let (crt, key) = ca1.server_cert(dir.path(), "router");
    let cfg = GatewayConfig {
        tls_cert: Some(crt.display().to_string()),
        tls_key: Some(key.display().to_string()),
        reload_watch_secs: 1.0,
        ..common::config(&[], "round_robin")
    };
    let stop = CancellationToken::new();
    let url = start_https_router(cfg, stop.clone(), &client_trusting(&ca1, true)).await;
    assert!(answers(&url, &ca1).await && !answers(&url, &ca2).await, "serving the first certificate");
    let (crt2, key2) = ca2.server_cert(dir.path(), "renewed");
    std::fs::rename(&key2, &key).expect("replace key");
    std::fs::rename(&crt2, &crt).expect("replace certificate");
    guard(async {
        while !answers(&url, &ca2).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(!answers(&url, &ca1).await, "the first certificate is no longer served");
    stop.cancel();
}
