//! `kvroute serve --epp-listen`: the Gateway API Inference Extension's endpoint picker over
//! Envoy ext_proc v3, driven with envoy-types' generated client — whole exchanges through
//! `kvroute bench epp-gateway`'s gateway stand-in (full duplex and buffered), and single
//! messages for the subset hint, immediate responses, a fallback endpoint and a client gone
//! mid-stream. The independent client (Python, envoy-data-plane) is `epp_python_client`.

mod common;

use common::{Proc, client, free_port, ledger_drains, spawn_kvroute, wait_ok};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request::Request as Msg,
    processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvroute_bench::epp_gateway::{BodyMode, Gateway};
use std::time::Duration;
use tokio::sync::mpsc;

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_string()).collect()
}

struct Fleet {
    _procs: Vec<Proc>,
    router: String,
    epp: String,
    workers: Vec<String>,
}

/// Two engine-sims and a router with the endpoint picker on, `extra` flags added.
async fn fleet(extra: &[&str]) -> Fleet {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (mut procs, urls) = common::engine_sims(2, "50").await;
    let workers: Vec<String> = urls.iter().map(|u| u.trim_start_matches("http://").to_string()).collect();
    let (port, epp) = (free_port(), format!("127.0.0.1:{}", free_port()));
    let mut a = args(&["serve", "--port", &port.to_string(), "--worker-urls", &urls.join(","), "--epp-listen", &epp]);
    a.extend(args(extra));
    procs.push(spawn_kvroute(&a));
    let router = format!("http://127.0.0.1:{port}");
    wait_ok(&router, "/readiness").await;
    Fleet { _procs: procs, router, epp, workers }
}

fn chat(model: &str, text: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": stream})
}

/// `kvroute_requests_total` summed over series whose labels contain `labels`.
async fn metric(router: &str, name: &str, labels: &str) -> u64 {
    let text = client().get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Polls [`metric`] until it reads `want` (an outcome is counted just after its ticket
/// closes); fails after 10 s.
async fn expect_metric(router: &str, name: &str, labels: &str, want: u64) {
    let mut got = 0;
    for _ in 0..200 {
        got = metric(router, name, labels).await;
        if got == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{name}{{{labels}}} is {got}, expected {want}");
}

/// `kvroute_buffered_body_bytes` once it reaches `bytes` (polled every 50 ms), or its last
/// value after 10 s; the caller asserts on it.
async fn buffered_at_least(router: &str, bytes: u64) -> u64 {
    let mut held = 0;
    for _ in 0..200 {
        held = metric(router, "kvroute_buffered_body_bytes", "").await;
        if held >= bytes {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_a_gateway_stand_in_are_picked_served_and_settled() {
    let f = fleet(&[]).await;
    for mode in [BodyMode::FullDuplex, BodyMode::Buffered] {
        let g = Gateway::new(&f.epp, mode).expect("gateway");
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", l.local_addr().expect("addr"));
        let stop = tokio_util::sync::CancellationToken::new();
        let s2 = stop.clone();
        let server = tokio::spawn(kvroute_bench::epp_gateway::serve(g.clone(), l, async move { s2.cancelled().await }));
        let c = reqwest::Client::new();
        let doc = "a shared document about routing and caches. ".repeat(40);
        for stream in [false, true] {
            let r = c
                .post(format!("{url}/v1/chat/completions"))
                .json(&chat("sim-llama-3-8b", &format!("{doc} question {stream}"), stream))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 200, "{mode:?} stream={stream}");
            let text = r.text().await.expect("body");
            if stream {
                assert!(text.contains("data: [DONE]"), "{text}");
            } else {
                let v: serde_json::Value = serde_json::from_str(&text).expect("json");
                assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
            }
        }
        let (n, p50, _, _) = g.pick_micros();
        assert_eq!(n, 2);
        assert!(p50 > 0);
        stop.cancel();
        let _ = server.await;
    }
    ledger_drains(&client(), &f.router).await;
    expect_metric(&f.router, "kvroute_requests_total", "outcome=\"ok\"", 4).await;
    expect_metric(&f.router, "kvroute_epp_requests_total", "outcome=\"picked\"", 4).await;
    expect_metric(&f.router, "kvroute_epp_served_total", "outcome=\"chosen\"", 4).await;
}

/// One ext_proc stream opened by hand.
struct Raw {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

async fn open(epp: &str) -> Raw {
    let mut c = ExternalProcessorClient::connect(format!("http://{epp}")).await.expect("connect");
    let (tx, rx) = mpsc::channel(16);
    let out = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let rx = c.process(out).await.expect("process").into_inner();
    Raw { tx, rx }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    let hs = pairs
        .iter()
        .map(|(k, v)| HeaderValue { key: (*k).into(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
        .collect();
    HttpHeaders { headers: Some(HeaderMap { headers: hs }), end_of_stream, ..Default::default() }
}

fn metadata(namespace: &str, key: &str, v: Kind) -> Metadata {
    let inner = Struct { fields: [(key.to_string(), Value { kind: Some(v) })].into_iter().collect() };
    Metadata { filter_metadata: [(namespace.to_string(), inner)].into_iter().collect(), ..Default::default() }
}

impl Raw {
    async fn send(&self, m: Msg, md: Option<Metadata>) {
        let r = ProcessingRequest { request: Some(m), metadata_context: md, ..Default::default() };
        self.tx.send(r).await.expect("send");
    }

    async fn recv(&mut self) -> Reply {
        let m = tokio::time::timeout(Duration::from_secs(10), self.rx.message()).await.expect("in time");
        m.expect("message").expect("not ended").response.expect("a response")
    }

    /// Sends a chat request (full duplex, optional subset hint) and returns the endpoints
    /// picked, or the immediate response's status and body.
    async fn request(
        &mut self,
        body: &serde_json::Value,
        subset: Option<&[&str]>,
    ) -> Result<Vec<String>, (u32, String)> {
        self.request_with(body, subset, &[]).await
    }

    /// [`Raw::request`] with `extra` request headers.
    async fn request_with(
        &mut self,
        body: &serde_json::Value,
        subset: Option<&[&str]>,
        extra: &[(&str, &str)],
    ) -> Result<Vec<String>, (u32, String)> {
        let md = subset.map(|s| {
            let list =
                ListValue { values: s.iter().map(|e| Value { kind: Some(Kind::StringValue((*e).into())) }).collect() };
            metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", Kind::ListValue(list))
        });
        let mut pairs =
            vec![(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")];
        pairs.extend_from_slice(extra);
        let h = headers(&pairs, false);
        self.send(Msg::RequestHeaders(h), md).await;
        let b = HttpBody { body: serde_json::to_vec(body).expect("json"), end_of_stream: true, ..Default::default() };
        self.send(Msg::RequestBody(b), None).await;
        match self.recv().await {
            Reply::ImmediateResponse(i) => {
                Err((i.status.map_or(0, |s| s.code as u32), String::from_utf8_lossy(&i.body).into_owned()))
            }
            Reply::RequestHeaders(h) => {
                let set = h.response.and_then(|c| c.header_mutation).expect("mutation").set_headers;
                let dest =
                    set.iter().filter_map(|o| o.header.as_ref()).find(|h| h.key == "x-gateway-destination-endpoint");
                let dest = String::from_utf8_lossy(&dest.expect("destination").raw_value).into_owned();
                // The body comes back (full duplex).
                let Reply::RequestBody(_) = self.recv().await else { panic!("the body passed back") };
                Ok(dest.split(',').map(str::to_string).collect())
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Reports response headers (`:status`, SSE), the endpoint that served, and reads the reply.
    async fn response_headers(&mut self, status: &str, served: &str) {
        let h = headers(&[(":status", status), ("content-type", "text/event-stream")], false);
        let md = metadata("envoy.lb", "x-gateway-destination-endpoint-served", Kind::StringValue(served.into()));
        self.send(Msg::ResponseHeaders(h), Some(md)).await;
        let Reply::ResponseHeaders(_) = self.recv().await else { panic!("response headers answered") };
    }

    async fn response_body(&mut self, chunk: &str, end: bool) {
        let b = HttpBody { body: chunk.as_bytes().to_vec(), end_of_stream: end, ..Default::default() };
        self.send(Msg::ResponseBody(b), None).await;
        let Reply::ResponseBody(_) = self.recv().await else { panic!("body answered") };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_unknown_models_fallbacks_and_clients_gone() {
    let f = fleet(&[]).await;
    // Subset hint: only the second worker is eligible.
    for i in 0..3 {
        let mut s = open(&f.epp).await;
        let picked = s.request(&chat("sim-llama-3-8b", &format!("q{i}"), true), Some(&[&f.workers[1]])).await;
        assert_eq!(picked.expect("picked")[0], f.workers[1]);
    }
    let mut s = open(&f.epp).await;
    let (status, body) = s.request(&chat("sim-llama-3-8b", "q", true), Some(&[])).await.expect_err("empty subset");
    assert_eq!(status, 503, "{body}");
    // Unknown model: serve's 404 and JSON body.
    let mut s = open(&f.epp).await;
    let (status, body) = s.request(&chat("no-such-model", "q", true), None).await.expect_err("404");
    assert_eq!(status, 404);
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert!(v["error"]["message"].as_str().expect("message").contains("no-such-model"), "{v}");
    // The gateway retried: the other endpoint served. The dispatch moves there and ends ok.
    let before = metric(&f.router, "kvroute_requests_total", "outcome=\"ok\"").await;
    let mut s = open(&f.epp).await;
    let picked = s.request(&chat("sim-llama-3-8b", "retry me", true), None).await.expect("picked");
    let other = f.workers.iter().find(|w| **w != picked[0]).expect("other");
    s.response_headers("200", other).await;
    s.response_body("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n", false).await;
    s.response_body("data: [DONE]\n\n", true).await;
    drop(s);
    ledger_drains(&client(), &f.router).await;
    expect_metric(&f.router, "kvroute_epp_served_total", "outcome=\"fallback\"", 1).await;
    let ok = format!("worker=\"http://{other}\"");
    assert!(metric(&f.router, "kvroute_requests_total", &ok).await >= 1);
    expect_metric(&f.router, "kvroute_requests_total", "outcome=\"ok\"", before + 1).await;
    // A client gone mid-stream: the gateway closes the ext_proc stream; the ledger settles.
    // (The subset picks above, never answered, were counted cancelled too.)
    let cancelled = 3;
    expect_metric(&f.router, "kvroute_requests_total", "outcome=\"cancelled\"", cancelled).await;
    let mut s = open(&f.epp).await;
    let picked = s.request(&chat("sim-llama-3-8b", "going away", true), None).await.expect("picked");
    s.response_headers("200", &picked[0]).await;
    s.response_body("data: {\"choices\":[]}\n\n", false).await;
    drop(s);
    ledger_drains(&client(), &f.router).await;
    expect_metric(&f.router, "kvroute_requests_total", "outcome=\"cancelled\"", cancelled + 1).await;
    expect_metric(&f.router, "kvroute_epp_observed_total", "outcome=\"closed_early\"", 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_full_is_an_immediate_503_and_a_dropped_pick_frees_its_place() {
    let f = fleet(&["--max-in-flight-per-model", "1"]).await;
    let mut held = open(&f.epp).await;
    held.request(&chat("sim-llama-3-8b", "first", true), None).await.expect("picked");
    let mut s = open(&f.epp).await;
    let (status, body) = s.request(&chat("sim-llama-3-8b", "second", true), None).await.expect_err("full");
    assert_eq!(status, 503);
    assert!(body.contains("too many requests in flight"), "{body}");
    drop(held);
    ledger_drains(&client(), &f.router).await;
    let mut s = open(&f.epp).await;
    s.request(&chat("sim-llama-3-8b", "third", true), None).await.expect("admitted again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs KVROUTE_EPP_PYTHON, a python with envoy-data-plane and grpcio-health-checking (.ci/run installs one)"]
async fn epp_python_client() {
    let python = std::env::var("KVROUTE_EPP_PYTHON")
        .expect("KVROUTE_EPP_PYTHON: a python with envoy-data-plane (this test was asked for, so it must run)");
    let f = fleet(&[]).await;
    let full = fleet(&["--max-in-flight-per-model", "1"]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/epp_client.py");
    let a = args(&[
        script,
        "--epp",
        &f.epp,
        "--router",
        &f.router,
        "--workers",
        &f.workers.join(","),
        "--admin-token",
        common::ADMIN_TOKEN,
        "--full-epp",
        &full.epp,
        "--full-router",
        &full.router,
    ]);
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(python).args(a).output())
        .await
        .expect("join")
        .expect("run the Python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for scenario in [
        "health",
        "streamed",
        "whole",
        "buffered",
        "subset",
        "unknown_model",
        "fallback",
        "client_gone",
        "admission_full",
    ] {
        assert!(stdout.lines().any(|l| l == format!("ok {scenario}")), "{scenario} did not pass: {stdout}");
    }
}

/// An immediate response names no worker address unless the client may see decision
/// details, as `serve`'s answers: a LoRA adapter no worker could load (its error names the
/// worker it tried) was shown with the address to every client (found by a black-box probe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_response_names_a_worker_only_to_a_client_that_may_see_decisions() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let port = free_port();
    let sim = spawn_kvroute(&args(&[
        "engine-sim",
        "--port",
        &port.to_string(),
        "--time-scale",
        "50",
        "--lora-slots",
        "1",
        "--lora-fail",
        "bad-adapter",
    ]));
    let worker = format!("http://127.0.0.1:{port}");
    wait_ok(&worker, "/health").await;
    // Declared before `router`, so it is removed after the router is stopped.
    let config = tempfile::Builder::new().prefix("kvroute-epp-lora-").suffix(".toml").tempfile().expect("temp file");
    std::fs::write(config.path(), "[[lora.adapters]]\nname = \"bad-adapter\"\npath = \"/adapters/bad\"\n")
        .expect("config");
    let (rport, epp) = (free_port(), format!("127.0.0.1:{}", free_port()));
    let router = spawn_kvroute(&args(&[
        "serve",
        "--port",
        &rport.to_string(),
        "--worker-urls",
        &worker,
        "--epp-listen",
        &epp,
        "--config",
        config.path().to_str().expect("path"),
    ]));
    wait_ok(&format!("http://127.0.0.1:{rport}"), "/readiness").await;
    let body = chat("bad-adapter", "hello", false);
    let mut s = open(&epp).await;
    let (status, shown) = s.request(&body, None).await.expect_err("no worker loads it");
    assert_eq!(status, 503, "{shown}");
    assert!(shown.contains("a worker answered"), "{shown}");
    assert!(!shown.contains("127.0.0.1"), "{shown}");
    let mut s = open(&epp).await;
    let token = format!("Bearer {}", common::ADMIN_TOKEN);
    let (_, admin) = s.request_with(&body, None, &[("authorization", &token)]).await.expect_err("503");
    assert!(admin.contains(&worker), "{admin}");
    drop((router, sim));
}

/// A buffered request body the picker cannot read whole gets an immediate 413, where it got
/// no answer at all (found by a black-box probe): BUFFERED_PARTIAL's first bytes of a body
/// over the gateway's buffer (the picker waited for an end that never comes), and one
/// message over the gRPC message limit (`max_body_bytes` + 64 KiB; the stream ended with
/// gRPC OK and nothing sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_bodies_that_cannot_be_read_whole_get_a_413() {
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;
    let f = fleet(&["--max-body-bytes", "4096"]).await;
    let h = || {
        headers(&[(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")], false)
    };
    let body = serde_json::to_vec(&chat("sim-llama-3-8b", &"word ".repeat(40), false)).expect("json");
    for (mode, bytes, end, want) in [
        (BodySendMode::BufferedPartial, body.clone(), false, "BUFFERED_PARTIAL"),
        (BodySendMode::Buffered, vec![b' '; 100 << 10], true, "larger than the limit of 4096 bytes"),
    ] {
        let mut s = open(&f.epp).await;
        let config = ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: BodySendMode::Streamed as i32,
            ..Default::default()
        };
        let first = ProcessingRequest {
            request: Some(Msg::RequestHeaders(h())),
            protocol_config: Some(config),
            ..Default::default()
        };
        s.tx.send(first).await.expect("send");
        let Reply::RequestHeaders(_) = s.recv().await else { panic!("headers answered") };
        let b = HttpBody { body: bytes, end_of_stream: end, ..Default::default() };
        s.send(Msg::RequestBody(b), None).await;
        let Reply::ImmediateResponse(i) = s.recv().await else { panic!("an immediate response ({mode:?})") };
        assert_eq!(i.status.map(|s| s.code), Some(413), "{mode:?}");
        let text = String::from_utf8_lossy(&i.body);
        assert!(text.contains(want), "{mode:?}: {text}");
    }
}

/// The endpoint picker takes its bodies from the same budget as `serve`
/// (`max_buffered_body_bytes`): while one stream holds most of it with a body still coming
/// in (full duplex), a body that does not fit beside it gets an immediate 503 naming the
/// limit, and once the first is picked its share is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_held_at_once_share_the_body_budget() {
    let f = fleet(&["--max-body-bytes", "49152", "--max-buffered-body-bytes", "65536"]).await;
    let big = chat("sim-llama-3-8b", &"word ".repeat(8_000), false);
    let bytes = serde_json::to_vec(&big).expect("json");
    // A stream sends the first 30,000 bytes of its body and waits.
    let mut slow = open(&f.epp).await;
    let h =
        headers(&[(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")], false);
    slow.send(Msg::RequestHeaders(h), None).await;
    let (start, rest) = bytes.split_at(30_000);
    slow.send(Msg::RequestBody(HttpBody { body: start.to_vec(), end_of_stream: false, ..Default::default() }), None)
        .await;
    let held = buffered_at_least(&f.router, 30_000).await;
    assert!((30_000..=65_536).contains(&held), "held {held}");
    // Another body of 40 KB does not fit beside it.
    let mut other = open(&f.epp).await;
    let (code, text) = other.request(&big, None).await.expect_err("refused");
    assert_eq!(code, 503, "{text}");
    assert!(text.contains("max_buffered_body_bytes"), "{text}");
    // The first body ends and is picked; its share is given back, and the other fits.
    slow.send(Msg::RequestBody(HttpBody { body: rest.to_vec(), end_of_stream: true, ..Default::default() }), None)
        .await;
    let Reply::RequestHeaders(_) = slow.recv().await else { panic!("the slow request picked") };
    expect_metric(&f.router, "kvroute_buffered_body_bytes", "", 0).await;
    let mut again = open(&f.epp).await;
    let picked = again.request(&big, None).await.expect("picked");
    assert!(!picked.is_empty(), "{picked:?}");
}

/// One ext_proc stream written on the wire by hand: gRPC frames (a flag byte, a 4-byte
/// big-endian length, the message), so a message can be cut short.
struct Wire {
    tx: mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
    rx: tonic::body::Body,
    read: Vec<u8>,
}

impl Wire {
    async fn open(epp: &str) -> Wire {
        use tower_service::Service;
        let mut ch = tonic::transport::Channel::from_shared(format!("http://{epp}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        let chunks = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let body = tonic::body::Body::new(axum::body::Body::from_stream(chunks));
        let req = http::Request::post(format!("http://{epp}/envoy.service.ext_proc.v3.ExternalProcessor/Process"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(body)
            .expect("request");
        futures_util::future::poll_fn(|cx| ch.poll_ready(cx)).await.expect("ready");
        let rx = ch.call(req).await.expect("response").into_body();
        Wire { tx, rx, read: Vec::new() }
    }

    /// Sends the first `sent` bytes of `m`'s frame (all of it: `usize::MAX`).
    async fn send(&self, m: Msg, sent: usize) {
        use prost::Message;
        let mut frame = grpc_frame(&ProcessingRequest { request: Some(m), ..Default::default() }.encode_to_vec());
        frame.truncate(sent);
        self.tx.send(Ok(frame.into())).await.expect("send");
    }

    /// The next reply (fails after 10 s, or when the stream ends without one).
    async fn recv(&mut self) -> Reply {
        use http_body_util::BodyExt;
        loop {
            if self.read.len() >= 5 {
                let len = u32::from_be_bytes([self.read[1], self.read[2], self.read[3], self.read[4]]) as usize;
                if self.read.len() >= 5 + len {
                    let m: Vec<u8> = self.read.drain(..5 + len).skip(5).collect();
                    let r = <ProcessingResponse as prost::Message>::decode(m.as_slice()).expect("a response");
                    return r.response.expect("a reply");
                }
            }
            let frame = tokio::time::timeout(Duration::from_secs(10), self.rx.frame()).await.expect("in time");
            let frame = frame.expect("not ended").expect("no error");
            if let Some(d) = frame.data_ref() {
                self.read.extend_from_slice(d);
            }
        }
    }
}

/// tonic assembles a gRPC message whole before the picker reads it. A message the gateway
/// has begun and not finished counts against the body budget as its bytes arrive, so
/// streams each sending a large body message slowly cannot make the router hold more than
/// `max_buffered_body_bytes`: the stream that does not fit gets an immediate 503. Before,
/// every half-sent message was held outside the budget and no stream was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_still_arriving_count_against_the_body_budget() {
    let f = fleet(&["--max-body-bytes", "1048576", "--max-buffered-body-bytes", "2097152"]).await;
    let big = chat("sim-llama-3-8b", &"word ".repeat(180_000), false);
    let body = HttpBody { body: serde_json::to_vec(&big).expect("json"), end_of_stream: true, ..Default::default() };
    assert!((900_000..1_000_000).contains(&body.body.len()));
    let h =
        headers(&[(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")], false);
    // Three streams each send 600 KB of their body's message and wait: 1.8 MB of 2 MiB.
    let mut streams = Vec::new();
    for i in 1..=3u64 {
        let w = Wire::open(&f.epp).await;
        w.send(Msg::RequestHeaders(h.clone()), usize::MAX).await;
        w.send(Msg::RequestBody(body.clone()), 600_000).await;
        let held = buffered_at_least(&f.router, i * 600_000).await;
        assert!(held >= i * 600_000, "stream {i}: {held} bytes held");
        streams.push(w);
    }
    // A fourth does not fit beside them.
    let mut fourth = Wire::open(&f.epp).await;
    fourth.send(Msg::RequestHeaders(h.clone()), usize::MAX).await;
    fourth.send(Msg::RequestBody(body.clone()), 600_000).await;
    let Reply::ImmediateResponse(i) = fourth.recv().await else { panic!("an immediate response") };
    let text = String::from_utf8_lossy(&i.body);
    assert_eq!(i.status.map(|s| s.code), Some(503), "{text}");
    assert!(text.contains("max_buffered_body_bytes"), "{text}");
    // The three go away; their bytes are back.
    drop(streams);
    expect_metric(&f.router, "kvroute_buffered_body_bytes", "", 0).await;
}

/// Once a stream's request headers named its tenant, the messages that follow are also
/// taken from the tenant's share of the budget while they arrive: a tenant's second
/// half-sent body past its share gets an immediate 429, and another tenant's body is picked.
/// (Buffered mode: the body is sent after the picker's "go on" to the headers, so the
/// tenant is known by then.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_arriving_is_taken_from_its_tenant_s_share() {
    let f = fleet(&[
        "--epp-body-mode",
        "buffered",
        "--tenant-header",
        "x-tenant",
        "--max-body-bytes",
        "1048576",
        "--max-buffered-body-bytes",
        "8388608",
        "--max-buffered-body-bytes-per-tenant",
        "1048576",
    ])
    .await;
    let big = chat("sim-llama-3-8b", &"word ".repeat(180_000), false);
    let body = HttpBody { body: serde_json::to_vec(&big).expect("json"), end_of_stream: true, ..Default::default() };
    let opened = async |tenant: &str| {
        let w = Wire::open(&f.epp).await;
        let pairs = [
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("x-tenant", tenant),
        ];
        w.send(Msg::RequestHeaders(headers(&pairs, false)), usize::MAX).await;
        w
    };
    let mut a1 = opened("a").await;
    let Reply::RequestHeaders(_) = a1.recv().await else { panic!("go on") };
    a1.send(Msg::RequestBody(body.clone()), 600_000).await;
    let held = buffered_at_least(&f.router, 600_000).await;
    assert!(held >= 600_000, "{held} bytes held");
    let mut a2 = opened("a").await;
    let Reply::RequestHeaders(_) = a2.recv().await else { panic!("go on") };
    a2.send(Msg::RequestBody(body.clone()), 600_000).await;
    let Reply::ImmediateResponse(i) = a2.recv().await else { panic!("an immediate response") };
    let text = String::from_utf8_lossy(&i.body);
    assert_eq!(i.status.map(|s| s.code), Some(429), "{text}");
    assert!(text.contains("max_buffered_body_bytes_per_tenant"), "{text}");
    let mut b = opened("b").await;
    let Reply::RequestHeaders(_) = b.recv().await else { panic!("go on") };
    b.send(Msg::RequestBody(body.clone()), usize::MAX).await;
    let Reply::RequestBody(_) = b.recv().await else { panic!("tenant b's request picked") };
    drop(a1);
}

/// Reads from `s` until the router closes it; fails when it is still open after 30 s (a
/// hang guard far above the deadlines the test sets, not a timing assertion).
async fn closed_by_the_router(s: &mut tokio::net::TcpStream, what: &str) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let read_to_close = async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read_to_close)
        .await
        .unwrap_or_else(|_| panic!("{what}: the endpoint picker kept the connection open"));
}

/// The picker's port has the main port's connection guards: a connection that sends
/// nothing is closed after `header_read_timeout_secs`, and a client past
/// `max_connections_per_client` is closed at once, while its first connection is served.
/// (gRPC's own server, before, kept both open.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_s_port_closes_silent_connections_and_caps_a_client() {
    let f = fleet(&["--header-read-timeout-secs", "1", "--max-connections-per-client", "1"]).await;
    let mut silent = tokio::net::TcpStream::connect(&f.epp).await.expect("connect");
    closed_by_the_router(&mut silent, "a silent connection").await;
    let mut first = Wire::open(&f.epp).await;
    let h =
        headers(&[(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")], false);
    first.send(Msg::RequestHeaders(h), usize::MAX).await;
    let mut second = tokio::net::TcpStream::connect(&f.epp).await.expect("connect");
    closed_by_the_router(&mut second, "a second connection of the client").await;
    let body = HttpBody {
        body: serde_json::to_vec(&chat("sim-llama-3-8b", "hello", false)).expect("json"),
        end_of_stream: true,
        ..Default::default()
    };
    first.send(Msg::RequestBody(body), usize::MAX).await;
    let Reply::RequestHeaders(_) = first.recv().await else { panic!("the first connection's request picked") };
}

/// `message` framed as gRPC sends it (a flag byte, a 4-byte big-endian length).
fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8];
    f.extend_from_slice(&(message.len() as u32).to_be_bytes());
    f.extend_from_slice(message);
    f
}

/// With `--epp-tls` and no certificate, the picker serves TLS (ALPN h2) with a self-signed
/// certificate, as the Gateway API Inference Extension's reference picker does: a gRPC
/// client that does not verify it gets the health service's answer and a pick, and a
/// plaintext client gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epp_tls_serves_grpc_over_a_self_signed_certificate() {
    use futures_util::StreamExt;
    let f = fleet(&["--epp-tls"]).await;
    let tls = reqwest::Client::builder()
        .tls_danger_accept_invalid_certs(true)
        .http2_prior_knowledge()
        .build()
        .expect("client");
    let grpc = |path: &str| {
        tls.post(format!("https://{}/{path}", f.epp))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
    };
    // grpc.health.v1 HealthCheckRequest { service: "liveness" } -> { status: SERVING (1) }.
    let mut check = vec![0x0a, 8];
    check.extend_from_slice(b"liveness");
    let r = grpc("grpc.health.v1.Health/Check").body(grpc_frame(&check)).send().await.expect("health over TLS");
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.expect("body").to_vec(), grpc_frame(&[0x08, 0x01]));
    // A whole exchange's first half: request headers and body in, the pick out.
    let pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")];
    let body = serde_json::to_vec(&chat("sim-llama-3-8b", "hello over TLS", false)).expect("json");
    let mut wire = Vec::new();
    for m in [
        Msg::RequestHeaders(headers(&pairs, false)),
        Msg::RequestBody(HttpBody { body, end_of_stream: true, ..Default::default() }),
    ] {
        wire.extend(grpc_frame(&prost::Message::encode_to_vec(&ProcessingRequest {
            request: Some(m),
            ..Default::default()
        })));
    }
    let (tx, rx) = mpsc::channel::<Result<Vec<u8>, std::io::Error>>(2);
    tx.send(Ok(wire)).await.expect("queue");
    let chunks = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let r = grpc("envoy.service.ext_proc.v3.ExternalProcessor/Process")
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .expect("ext_proc over TLS");
    let mut replies = r.bytes_stream();
    let mut read = Vec::new();
    while read.len() < 5 || read.len() < 5 + u32::from_be_bytes([read[1], read[2], read[3], read[4]]) as usize {
        let chunk = tokio::time::timeout(Duration::from_secs(10), replies.next()).await.expect("in time");
        read.extend_from_slice(&chunk.expect("a reply").expect("bytes"));
    }
    let len = u32::from_be_bytes([read[1], read[2], read[3], read[4]]) as usize;
    let reply: ProcessingResponse = prost::Message::decode(&read[5..5 + len]).expect("a response");
    let Some(Reply::RequestHeaders(h)) = reply.response else { panic!("a pick: {reply:?}") };
    let set = h.response.and_then(|c| c.header_mutation).expect("mutation").set_headers;
    assert!(set.iter().filter_map(|o| o.header.as_ref()).any(|h| h.key == "x-gateway-destination-endpoint"));
    drop(tx);
    // Plaintext HTTP/2 to the TLS port gets no answer.
    let plain = reqwest::Client::builder().http2_prior_knowledge().build().expect("client");
    let r = plain.post(format!("http://{}/grpc.health.v1.Health/Check", f.epp)).body(grpc_frame(&check)).send().await;
    assert!(r.is_err(), "a plaintext request was answered: {r:?}");
}

/// A stream carries one request: request headers sent again after the pick end the stream
/// with `INVALID_ARGUMENT`, where they got no reply and the stream waited until it closed.
/// (And a request that ends with its headers is answered as `serve` answers it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_headers_sent_twice_end_the_stream_with_an_error() {
    let f = fleet(&[]).await;
    let mut s = open(&f.epp).await;
    s.request(&chat("sim-llama-3-8b", "one request", false), None).await.expect("picked");
    let h = headers(&[(":method", "POST"), (":path", "/v1/chat/completions")], false);
    s.send(Msg::RequestHeaders(h.clone()), None).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), s.rx.message()).await.expect("an answer in time");
    let e = answer.expect_err("an error status");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    // An inference request without a body is refused as serve refuses an empty body,
    // where it was passed through to the least loaded worker.
    let mut s = open(&f.epp).await;
    s.send(Msg::RequestHeaders(headers(&[(":method", "POST"), (":path", "/v1/chat/completions")], true)), None).await;
    let Reply::ImmediateResponse(i) = s.recv().await else { panic!("an immediate response") };
    assert_eq!(i.status.map(|s| s.code), Some(400), "{}", String::from_utf8_lossy(&i.body));
    let served = client().post(format!("{}/v1/chat/completions", f.router)).send().await.expect("send");
    assert_eq!(served.status(), 400);
    // The same on a stream passed through (not an inference path).
    let mut s = open(&f.epp).await;
    s.send(Msg::RequestHeaders(headers(&[(":method", "GET"), (":path", "/v1/models")], true)), None).await;
    let Reply::RequestHeaders(_) = s.recv().await else { panic!("passed through") };
    s.send(Msg::RequestHeaders(h), None).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), s.rx.message()).await.expect("an answer in time");
    assert_eq!(answer.expect_err("an error status").code(), tonic::Code::InvalidArgument);
}

/// The endpoint picker holds a tenant's place for the whole exchange
/// (`max_in_flight_per_tenant`): with one of tenant a's requests picked and its stream
/// open, a's next request gets an immediate 429 naming the bound while tenant b's is
/// picked; once a's stream ends, a is picked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holds_its_places_for_the_whole_exchange() {
    let f = fleet(&["--tenant-header", "x-tenant", "--max-in-flight-per-tenant", "1"]).await;
    let body = chat("sim-llama-3-8b", "hello", false);
    let mut first = open(&f.epp).await;
    first.request_with(&body, None, &[("x-tenant", "a")]).await.expect("a's first request picked");
    let mut second = open(&f.epp).await;
    let (code, text) = second.request_with(&body, None, &[("x-tenant", "a")]).await.expect_err("a is at its bound");
    assert_eq!(code, 429, "{text}");
    assert!(text.contains("max_in_flight_per_tenant"), "{text}");
    let mut other = open(&f.epp).await;
    other.request_with(&body, None, &[("x-tenant", "b")]).await.expect("b is picked");
    // a's first stream ends (the gateway closes it): its place comes back.
    drop(first);
    let mut picked = false;
    for _ in 0..200 {
        let mut again = open(&f.epp).await;
        if again.request_with(&body, None, &[("x-tenant", "a")]).await.is_ok() {
            picked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(picked, "a's place did not come back after its stream ended");
}
