//! A stand-in for a gateway that calls an endpoint picker (EPP) of the Gateway API
//! Inference Extension — what Envoy's ext_proc filter with an `InferencePool` backend does,
//! reduced to what a benchmark or a test on one machine needs: each HTTP request is sent to
//! the picker over ext_proc v3 (request headers, then its body), forwarded to the endpoints
//! the picker names in `x-gateway-destination-endpoint` (in order: a connection error or a
//! 5xx moves to the next, as an Envoy retry policy with `connect-failure,5xx` does), and its
//! response reported back (headers with `x-gateway-destination-endpoint-served` in the
//! `envoy.lb` metadata, every body chunk, the end). In full-duplex mode the bodies the client
//! and the worker receive are the ones the picker passed back.
//!
//! Not Envoy: no TLS, no HTTP/2 to workers, no route configuration, no circuit breaking. It
//! exists so `kvroute serve --epp-listen` can be measured against `kvroute serve` on the same
//! fleet (`kvroute bench epp-gateway`), with the picker's round trip timed per request.

use anyhow::Context;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, body_mutation,
    processing_request::Request as Msg, processing_response::Response as Reply,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures_util::StreamExt;
use hdrhistogram::Histogram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::transport::Channel;

/// Largest request body the stand-in reads, bytes.
pub const MAX_BODY: usize = 16 << 20;

/// How the stand-in's ext_proc filter sends bodies (Envoy `ProcessingMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BodyMode {
    /// Request and response bodies `FULL_DUPLEX_STREAMED` (the picker passes them back).
    FullDuplex,
    /// Request body `BUFFERED`, response body `STREAMED`.
    Buffered,
}

/// The stand-in gateway.
#[derive(Debug)]
pub struct Gateway {
    epp: ExternalProcessorClient<Channel>,
    http: reqwest::Client,
    mode: BodyMode,
    /// Time from the request headers sent to the destination received, µs.
    picks: Mutex<Histogram<u64>>,
}

impl Gateway {
    /// A stand-in calling the picker at `epp` (`host:port`).
    ///
    /// # Errors
    /// The picker's address does not parse.
    pub fn new(epp: &str, mode: BodyMode) -> anyhow::Result<Arc<Gateway>> {
        let channel = Channel::from_shared(format!("http://{epp}"))
            .with_context(|| format!("--epp {epp}"))?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        let epp = ExternalProcessorClient::new(channel).max_decoding_message_size(MAX_BODY + (1 << 16));
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
        let picks = Histogram::new_with_bounds(1, 60_000_000, 3).context("histogram")?;
        Ok(Arc::new(Gateway { epp, http, mode, picks: Mutex::new(picks) }))
    }

    /// The picker's round trips so far: (count, p50, p99, p99.9), µs.
    pub fn pick_micros(&self) -> (u64, u64, u64, u64) {
        let h = self.picks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (h.len(), h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.value_at_quantile(0.999))
    }

    /// The stand-in's HTTP routes: every path proxied, `GET /epp-gateway/stats` its pick
    /// latency.
    pub fn router(self: &Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/epp-gateway/stats", axum::routing::get(stats))
            .fallback(proxy)
            .with_state(Arc::clone(self))
    }
}

async fn stats(State(g): State<Arc<Gateway>>) -> Response {
    let (count, p50, p99, p999) = g.pick_micros();
    axum::Json(serde_json::json!({"picks": count, "p50_us": p50, "p99_us": p99, "p999_us": p999})).into_response()
}

fn header(k: &str, v: &[u8]) -> EnvoyHeader {
    EnvoyHeader { key: k.into(), raw_value: v.to_vec(), ..Default::default() }
}

fn headers_msg(pseudo: &[(&str, &[u8])], h: &HeaderMap, end_of_stream: bool) -> HttpHeaders {
    let mut hs: Vec<EnvoyHeader> = pseudo.iter().map(|(k, v)| header(k, v)).collect();
    hs.extend(h.iter().map(|(k, v)| header(k.as_str(), v.as_bytes())));
    HttpHeaders { headers: Some(EnvoyHeaders { headers: hs }), end_of_stream, ..Default::default() }
}

fn served_metadata(endpoint: &str) -> Metadata {
    let inner = Struct {
        fields: [(
            "x-gateway-destination-endpoint-served".to_string(),
            Value { kind: Some(Kind::StringValue(endpoint.into())) },
        )]
        .into_iter()
        .collect(),
    };
    Metadata { filter_metadata: [("envoy.lb".to_string(), inner)].into_iter().collect(), ..Default::default() }
}

fn plain(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, msg.into()).into_response()
}

/// One ext_proc stream: messages to the picker and its answers.
struct Exchange {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Exchange {
    async fn send(&self, m: Msg, metadata: Option<Metadata>) -> Result<(), Response> {
        let r = ProcessingRequest { request: Some(m), metadata_context: metadata, ..Default::default() };
        self.tx.send(r).await.map_err(|_| plain(StatusCode::BAD_GATEWAY, "the picker closed the stream"))
    }

    async fn recv(&mut self) -> Result<Reply, Response> {
        match self.rx.message().await {
            Ok(Some(ProcessingResponse { response: Some(r), .. })) => Ok(r),
            Ok(_) => Err(plain(StatusCode::BAD_GATEWAY, "the picker ended the stream")),
            Err(e) => Err(plain(StatusCode::INTERNAL_SERVER_ERROR, format!("the picker failed: {e}"))),
        }
    }
}

/// What the picker decided for a request.
struct Routed {
    endpoints: Vec<String>,
    body: Bytes,
}

fn destination(c: &CommonResponse) -> Option<String> {
    let set = &c.header_mutation.as_ref()?.set_headers;
    let h = set.iter().filter_map(|o| o.header.as_ref()).find(|h| h.key == "x-gateway-destination-endpoint")?;
    Some(String::from_utf8_lossy(if h.raw_value.is_empty() { h.value.as_bytes() } else { &h.raw_value }).into_owned())
}

/// The picker's immediate response as the client's answer.
fn immediate(i: envoy_types::pb::envoy::service::ext_proc::v3::ImmediateResponse) -> Response {
    let status = i.status.and_then(|s| StatusCode::from_u16(s.code as u16).ok()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut r = (status, i.body).into_response();
    for h in i.headers.iter().flat_map(|m| m.set_headers.iter()).filter_map(|o| o.header.as_ref()) {
        if let (Ok(k), Ok(v)) =
            (axum::http::HeaderName::from_bytes(h.key.as_bytes()), HeaderValue::from_bytes(&h.raw_value))
        {
            r.headers_mut().insert(k, v);
        }
    }
    r
}

/// Sends the request to the picker and reads its decision (or its immediate response).
async fn pick(
    g: &Gateway,
    ex: &mut Exchange,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Routed, Response> {
    let t0 = Instant::now();
    let pseudo: [(&str, &[u8]); 2] = [(":method", b"POST"), (":path", path.as_bytes())];
    let (req_mode, resp_mode) = match g.mode {
        BodyMode::FullDuplex => (BodySendMode::FullDuplexStreamed, BodySendMode::FullDuplexStreamed),
        BodyMode::Buffered => (BodySendMode::Buffered, BodySendMode::Streamed),
    };
    let first = ProcessingRequest {
        request: Some(Msg::RequestHeaders(headers_msg(&pseudo, headers, false))),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: req_mode as i32,
            response_body_mode: resp_mode as i32,
            ..Default::default()
        }),
        ..Default::default()
    };
    ex.tx.send(first).await.map_err(|_| plain(StatusCode::BAD_GATEWAY, "the picker closed the stream"))?;
    let duplex = g.mode == BodyMode::FullDuplex;
    if !duplex {
        match ex.recv().await? {
            Reply::RequestHeaders(_) => {}
            Reply::ImmediateResponse(i) => return Err(immediate(i)),
            other => return Err(plain(StatusCode::BAD_GATEWAY, format!("unexpected answer to headers: {other:?}"))),
        }
    }
    ex.send(Msg::RequestBody(HttpBody { body: body.to_vec(), end_of_stream: true, ..Default::default() }), None)
        .await?;
    let mut endpoints = None;
    let mut out = Vec::new();
    loop {
        match ex.recv().await? {
            Reply::ImmediateResponse(i) => return Err(immediate(i)),
            Reply::RequestHeaders(h) if duplex => endpoints = h.response.as_ref().and_then(destination),
            Reply::RequestBody(b) => {
                let c = b.response.unwrap_or_default();
                if !duplex {
                    endpoints = destination(&c);
                    let body = match c.body_mutation.and_then(|m| m.mutation) {
                        Some(body_mutation::Mutation::Body(b)) => Bytes::from(b),
                        _ => body,
                    };
                    out = body.to_vec();
                    break;
                }
                if let Some(body_mutation::Mutation::StreamedResponse(s)) = c.body_mutation.and_then(|m| m.mutation) {
                    out.extend_from_slice(&s.body);
                    if s.end_of_stream {
                        break;
                    }
                }
            }
            other => return Err(plain(StatusCode::BAD_GATEWAY, format!("unexpected answer: {other:?}"))),
        }
    }
    let micros = t0.elapsed().as_micros().clamp(1, 60_000_000) as u64;
    let _ = g.picks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).record(micros);
    let endpoints: Vec<String> = endpoints
        .ok_or_else(|| plain(StatusCode::BAD_GATEWAY, "the picker named no destination"))?
        .split(',')
        .map(|e| e.trim().to_string())
        .filter(|e| !e.is_empty())
        .collect();
    Ok(Routed { endpoints, body: Bytes::from(out) })
}

/// Forwards to the endpoints in order until one answers without a 5xx.
async fn forward(
    g: &Gateway,
    r: &Routed,
    path: &str,
    headers: &HeaderMap,
) -> Result<(String, reqwest::Response), Response> {
    let mut last = String::from("no endpoint");
    for ep in &r.endpoints {
        let mut rb = g.http.post(format!("http://{ep}{path}")).body(r.body.clone());
        for (k, v) in headers.iter().filter(|(k, _)| *k != "host" && *k != "content-length") {
            rb = rb.header(k, v);
        }
        match rb.send().await {
            Ok(resp) if !resp.status().is_server_error() => return Ok((ep.clone(), resp)),
            Ok(resp) => last = format!("{ep} answered {}", resp.status()),
            Err(e) => last = format!("{ep}: {e}"),
        }
    }
    Err(plain(StatusCode::SERVICE_UNAVAILABLE, format!("every endpoint failed; last: {last}")))
}

async fn proxy(State(g): State<Arc<Gateway>>, req: Request) -> Response {
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    let headers = req.headers().clone();
    let body = match axum::body::to_bytes(req.into_body(), MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return plain(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
    };
    let (tx, rx) = mpsc::channel(64);
    let outbound = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut client = g.epp.clone();
    let rx = match client.process(outbound).await {
        Ok(r) => r.into_inner(),
        Err(e) => return plain(StatusCode::INTERNAL_SERVER_ERROR, format!("the picker is unreachable: {e}")),
    };
    let mut ex = Exchange { tx, rx };
    let routed = match pick(&g, &mut ex, &path, &headers, body).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let (served, resp) = match forward(&g, &routed, &path, &headers).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    relay(g.mode, ex, served, resp).await
}

/// Reports the worker's response to the picker and relays it to the client, chunk by
/// chunk (in full-duplex mode, the chunks the picker passes back).
async fn relay(mode: BodyMode, mut ex: Exchange, served: String, resp: reqwest::Response) -> Response {
    let status = resp.status();
    let pseudo_status = status.as_u16().to_string().into_bytes();
    let ctype = resp.headers().get("content-type").cloned();
    let mut hs = HeaderMap::new();
    if let Some(c) = &ctype {
        hs.insert("content-type", c.clone());
    }
    let msg = Msg::ResponseHeaders(headers_msg(&[(":status", &pseudo_status)], &hs, false));
    if let Err(r) = ex.send(msg, Some(served_metadata(&served))).await {
        return r;
    }
    let mut out = Response::builder().status(status.as_u16());
    match ex.recv().await {
        Ok(Reply::ResponseHeaders(h)) => {
            let set = h.response.and_then(|c| c.header_mutation).map(|m| m.set_headers).unwrap_or_default();
            for o in set.iter().filter_map(|o| o.header.as_ref()) {
                out = out.header(o.key.as_str(), o.raw_value.as_slice());
            }
        }
        Ok(other) => {
            return plain(StatusCode::BAD_GATEWAY, format!("unexpected answer to response headers: {other:?}"));
        }
        Err(r) => return r,
    }
    if let Some(c) = ctype {
        out = out.header("content-type", c);
    }
    let duplex = mode == BodyMode::FullDuplex;
    let up = resp.bytes_stream().map(Some).chain(futures_util::stream::once(async { None }));
    let stream = futures_util::stream::unfold((Box::pin(up), ex), move |(mut up, mut ex)| async move {
        let (chunk, end) = match up.next().await? {
            Some(Ok(c)) => (c, false),
            Some(Err(e)) => return Some((Err(std::io::Error::other(e)), (up, ex))),
            None => (Bytes::new(), true),
        };
        let body = HttpBody { body: chunk.to_vec(), end_of_stream: end, ..Default::default() };
        if ex.send(Msg::ResponseBody(body), None).await.is_err() {
            return None;
        }
        let mut back = Vec::new();
        loop {
            match ex.recv().await {
                Ok(Reply::ResponseBody(b)) => match b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation) {
                    Some(body_mutation::Mutation::StreamedResponse(s)) if duplex => {
                        back.extend_from_slice(&s.body);
                        if s.end_of_stream || !end && back.len() >= chunk.len() {
                            break;
                        }
                    }
                    _ => {
                        back = chunk.to_vec();
                        break;
                    }
                },
                _ => return None,
            }
        }
        if end {
            // The stream ends here: the next poll returns None and the exchange is dropped.
            return (!back.is_empty()).then(|| (Ok(Bytes::from(back)), (up, ex)));
        }
        Some((Ok(Bytes::from(back)), (up, ex)))
    });
    out.body(Body::from_stream(stream)).unwrap_or_else(|e| plain(StatusCode::BAD_GATEWAY, e.to_string()))
}

/// Serves the stand-in on `listener` until `shutdown`.
///
/// # Errors
/// The listener's I/O error.
pub async fn serve(
    g: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use axum::serve::ListenerExt;
    // No Nagle delay on the client's connections (a small answer would wait for an ACK).
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, g.router()).with_graceful_shutdown(shutdown).await?;
    Ok(())
}
