//! Connections that never send a request cannot hold the router: a silent socket, one
//! byte, half an HTTP/2 preface, an h2c connection that opens no stream, an h2c connection
//! idle after its request, and a TLS connection silent after its handshake are all closed
//! by the server; a full connection table still answers health probes (the probe reserve);
//! one client address is capped by `max_connections_per_client`; and none of them holds a
//! shutdown. Raw TCP (and TLS) clients on 127.0.0.1; every wait is a read to the server's
//! close behind the 60 s hang guard, far above the deadlines set here (never a timing
//! assertion).

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

mod common;
use common::{eventually, guard};
#[path = "common/pki.rs"]
mod pki;
use pki::{TestCa, scratch_dir};

/// HTTP/2's connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame.
const SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

fn cfg(urls: &[&str], header_read_timeout_secs: f64) -> GatewayConfig {
    GatewayConfig { header_read_timeout_secs, ..common::config(urls, "round_robin") }
}

fn addr(url: &str) -> String {
    url.split_once("://").map_or(url, |(_, a)| a).to_string()
}

/// Reads until the server closes the connection (EOF or reset); returns what it sent.
/// Fails the test (hang guard) when the server keeps it open.
async fn read_to_close(s: &mut (impl AsyncRead + Unpin)) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    guard(async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    out
}

/// An HTTP/2 HEADERS frame opening stream 1 with `GET /health` (HPACK: static-table
/// `:method GET` and `:scheme http`, literal `:authority` and `:path`; END_STREAM and
/// END_HEADERS).
fn h2_get_health() -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x41, 9];
    block.extend_from_slice(b"127.0.0.1");
    block.extend_from_slice(&[0x44, 7]);
    block.extend_from_slice(b"/health");
    let mut f = vec![0, 0, block.len() as u8, 1, 0x5, 0, 0, 0, 1];
    f.extend_from_slice(&block);
    f
}

/// The (type, stream) of each whole HTTP/2 frame in `bytes`.
fn h2_frames(mut bytes: &[u8]) -> Vec<(u8, u32)> {
    let mut out = Vec::new();
    while bytes.len() >= 9 {
        let len = (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff;
        out.push((bytes[3], stream));
        bytes = &bytes[(9 + len).min(bytes.len())..];
    }
    out
}

/// Connects, sends `GET /health` and reads the response head (empty when the server closed
/// the connection first); returns the connection and the head.
async fn health_head(a: &str) -> (TcpStream, String) {
    let mut s = TcpStream::connect(a).await.expect("connect");
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    guard(async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    (s, String::from_utf8_lossy(&head).into_owned())
}

/// [`health_head`]: the open connection when the answer was 200, `None` when the server
/// closed it instead.
async fn held_ok(a: &str) -> Option<TcpStream> {
    let (s, head) = health_head(a).await;
    head.starts_with("HTTP/1.1 200").then_some(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_partial_and_idle_sockets_are_closed_by_the_first_request_deadline() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let (r, _task) = common::start_router(cfg(&[&w], 0.5), stop.clone()).await;
    let a = addr(&r);
    let sends: [(&str, Vec<u8>); 5] = [
        ("a silent socket", Vec::new()),
        ("one byte of the HTTP/2 preface", b"P".to_vec()),
        ("one byte of an HTTP/1 request", b"G".to_vec()),
        ("half the HTTP/2 preface", PREFACE[..12].to_vec()),
        ("an h2c connection that opens no stream", [PREFACE, SETTINGS].concat()),
    ];
    let mut socks = Vec::new();
    for (what, bytes) in &sends {
        let mut s = TcpStream::connect(&a).await.expect("connect");
        s.write_all(bytes).await.expect("write");
        socks.push((what, s));
    }
    for (what, s) in &mut socks {
        let got = read_to_close(s).await;
        assert!(!h2_frames(&got).iter().any(|&(t, _)| t == 1), "{what}: no response to a request never sent");
    }
    // An h2c connection answered once and then left idle is shut down: GOAWAY, then closed.
    let mut h2 = TcpStream::connect(&a).await.expect("connect");
    h2.write_all(&[PREFACE, SETTINGS, &h2_get_health()].concat()).await.expect("write");
    let frames = h2_frames(&read_to_close(&mut h2).await);
    assert!(frames.contains(&(1, 1)), "the request on stream 1 was answered: {frames:?}");
    assert!(frames.iter().any(|&(t, _)| t == 7), "GOAWAY before the close: {frames:?}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_silent_after_its_handshake_is_closed() {
    let dir = scratch_dir("connections-tls");
    let ca = TestCa::new("kvroute connections test CA");
    let (crt, key) = ca.server_cert(dir.path(), "router");
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let config = GatewayConfig {
        tls_cert: Some(crt.to_string_lossy().into_owned()),
        tls_key: Some(key.to_string_lossy().into_owned()),
        ..cfg(&[&w], 0.5)
    };
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = l.local_addr().expect("addr").to_string();
    let s = stop.clone();
    tokio::spawn(kvroute_gateway::serve(l, config, async move { s.cancelled().await }));
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca.pem().as_bytes()).expect("CA der"))
        .expect("CA root");
    let tls = Arc::new(rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth());
    let connector = tokio_rustls::TlsConnector::from(tls);
    // The handshake completes (so the server is up), then the client says nothing.
    let mut stream = guard(async {
        loop {
            if let Ok(tcp) = TcpStream::connect(&a).await {
                let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
                if let Ok(s) = connector.connect(name, tcp).await {
                    return s;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(read_to_close(&mut stream).await.is_empty(), "nothing but the close");
    // A TCP connection that never starts its handshake is closed too.
    let mut silent = TcpStream::connect(&a).await.expect("connect");
    read_to_close(&mut silent).await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_probes_are_answered_while_silent_sockets_hold_every_connection() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    // Silent sockets are held (600 s) in the 3 regular slots; 2 more are the probe reserve.
    let config = GatewayConfig { max_connections: 3, probe_connections: 2, ..cfg(&[&w], 600.0) };
    // Started without common::start_router: its client's pooled connection could still
    // hold a regular slot. Ready once a `Connection: close` probe passes, whose slot is
    // free again when its connection is closed.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = l.local_addr().expect("addr").to_string();
    let r = format!("http://{a}");
    let s = stop.clone();
    tokio::spawn(kvroute_gateway::serve(l, config, async move { s.cancelled().await }));
    eventually("the router is ready", async || {
        let Ok(mut s) = TcpStream::connect(&a).await else { return false };
        let _ = s.write_all(b"GET /readiness HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        read_to_close(&mut s).await.starts_with(b"HTTP/1.1 200")
    })
    .await;
    // The server accepts in order: these take the regular slots; what follows, the reserve.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(&a).await.expect("connect"));
    }
    // Until the table is full: the readiness probe's slot may have been released only after
    // a silent socket arrived (which then went to the reserve, to be closed). A `/health`
    // answered with `connection: close` came from the reserve; one answered without holds
    // a regular slot and is kept (idle) with the silent ones.
    guard(async {
        loop {
            let (s, head) = health_head(&a).await;
            if head.to_ascii_lowercase().contains("connection: close") {
                break;
            }
            held.push(s);
        }
    })
    .await;
    let c = reqwest::Client::new();
    let health = guard(c.get(format!("{r}/health")).send()).await.expect("health answered");
    assert_eq!(health.status(), 200);
    let ready = guard(c.get(format!("{r}/readiness")).send()).await.expect("readiness answered");
    let body: serde_json::Value = guard(ready.json()).await.expect("readiness JSON");
    assert!(body.get("ready").is_some(), "{body}");
    // Anything else on a reserve connection: 503 as JSON naming the reserve, then closed.
    let mut other = TcpStream::connect(&a).await.expect("connect");
    other
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .expect("write");
    let answer = String::from_utf8_lossy(&read_to_close(&mut other).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("\"error\"") && answer.contains("probe_connections"), "{answer}");
    // A silent socket in the reserve is closed after the reserve's short deadline, even
    // with header_read_timeout_secs at 600.
    let mut squatter = TcpStream::connect(&a).await.expect("connect");
    assert!(read_to_close(&mut squatter).await.is_empty());
    // Once regular slots are free, other requests are served again.
    drop(held);
    let chat = serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2});
    eventually("a freed slot serves inference again", async || {
        let c = reqwest::Client::new();
        c.post(format!("{r}/v1/chat/completions")).json(&chat).send().await.is_ok_and(|x| x.status() == 200)
    })
    .await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_at_max_connections_per_client_has_further_connections_closed() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let config = GatewayConfig { max_connections_per_client: 2, ..cfg(&[&w], 600.0) };
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let a = addr(&r);
    // Two keep-alive connections, each answered once and held open (the start-up probe's
    // connection may still be closing: retried until both are in).
    let mut held = Vec::new();
    while held.len() < 2 {
        let mut got = None;
        eventually("a connection under the cap is served", async || {
            got = held_ok(&a).await;
            got.is_some()
        })
        .await;
        held.extend(got);
    }
    // A third from the same address is closed without an answer.
    assert!(held_ok(&a).await.is_none(), "the third connection was served");
    // Closing one lets a new one in.
    drop(held.pop());
    eventually("a slot of the client freed", async || held_ok(&a).await.is_some()).await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_not_held_by_silent_or_idle_sockets() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    // Only the shutdown can close these sockets: header_read_timeout_secs and the drain
    // deadline are both far beyond the hang guard.
    let config = GatewayConfig { drain_timeout_secs: 600.0, ..cfg(&[&w], 600.0) };
    let shutdown = CancellationToken::new();
    let (r, task) = common::start_router(config, shutdown.clone()).await;
    let a = addr(&r);
    let mut socks = Vec::new();
    for bytes in [&b""[..], b"P", &PREFACE[..12], &[PREFACE, SETTINGS].concat()] {
        let mut s = TcpStream::connect(&a).await.expect("connect");
        s.write_all(bytes).await.expect("write");
        socks.push(s);
    }
    let mut h2 = TcpStream::connect(&a).await.expect("connect");
    h2.write_all(&[PREFACE, SETTINGS, &h2_get_health()].concat()).await.expect("write");
    socks.push(h2);
    socks.push(
        guard(async {
            loop {
                if let Some(s) = held_ok(&a).await {
                    return s;
                }
            }
        })
        .await,
    );
    // Let the server take every connection in before it stops accepting.
    assert_eq!(guard(reqwest::get(format!("{r}/health"))).await.expect("health").status(), 200);
    shutdown.cancel();
    let ended = guard(task).await.expect("join");
    assert!(ended.is_ok(), "{ended:?}");
    for s in &mut socks {
        read_to_close(s).await;
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_target_or_header_gets_json_414_or_431_naming_it() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let (r, _task) = common::start_router(cfg(&[&w], 5.0), stop.clone()).await;
    let c = reqwest::Client::new();
    let long = format!("{r}/v1/models?x={}", "a".repeat(kvroute_gateway::server::MAX_URI_BYTES));
    let resp = guard(c.get(&long).send()).await.expect("answered");
    assert_eq!(resp.status(), 414);
    let v: serde_json::Value = guard(resp.json()).await.expect("JSON body");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("request target")), "{v}");
    let big = "v".repeat(kvroute_gateway::server::MAX_HEADER_BYTES);
    let resp = guard(c.get(format!("{r}/v1/models")).header("x-big", big).send()).await.expect("answered");
    assert_eq!(resp.status(), 431);
    let v: serde_json::Value = guard(resp.json()).await.expect("JSON body");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("`x-big`")), "{v}");
    // A request line hyper cannot parse is answered by hyper itself: 400, then closed
    // (hyper has no hook for that response's body).
    let mut bad = TcpStream::connect(addr(&r)).await.expect("connect");
    bad.write_all(b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n").await.expect("write");
    let answer = String::from_utf8_lossy(&read_to_close(&mut bad).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    stop.cancel();
}
