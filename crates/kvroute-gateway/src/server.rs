//! The HTTP server loop (hyper through `hyper-util`): accepts connections up to a cap,
//! gives each one deadline from its accept to its first request head, closes connections
//! left idle, keeps a small reserve of connections for health probes, and on shutdown
//! drains within one deadline. `axum::serve` has none of these.
//!
//! - **First request.** From accept to the first complete request head a connection has
//!   `header_read_timeout` — one deadline around the TLS handshake, `hyper-util`'s sniff of
//!   HTTP/1 or HTTP/2 (it reads up to 24 bytes before either protocol's own timers start)
//!   and HTTP/2's preface and SETTINGS. hyper's HTTP/1 `header_read_timeout` alone starts
//!   only once HTTP/1 was chosen: a silent socket, one byte, half an HTTP/2 preface, an h2c
//!   connection that never opens a stream or a finished TLS handshake followed by silence
//!   each held a connection slot forever.
//! - **Idle.** A connection with no request open for `header_read_timeout` is shut down
//!   gracefully (HTTP/2: GOAWAY; HTTP/1 keep-alive is also closed by hyper's own timer).
//!   HTTP/2 connections are also sent PINGs (`http2_keep_alive`) so a vanished peer with a
//!   stream open is noticed.
//! - **Probe reserve.** When all `max_connections` are taken, up to `probe_connections`
//!   more are accepted that serve only `GET /health` and `GET /readiness` (503 JSON for
//!   anything else), close after the answer, and must send their request within
//!   [`PROBE_FIRST_REQUEST`]: a full connection table never fails a liveness probe, and
//!   silent sockets cannot hold the reserve for long. (The admin listener was the other
//!   choice; probes, load balancers and Kubernetes all check the serving port.)
//! - **Per client.** With `max_connections_per_client`, a client address at its cap has a
//!   new connection closed at accept, so one client cannot take the whole table.
//! - **Shutdown** ([`serve`]): the signal, then `drain_delay` still accepting (while
//!   `/readiness` says 503), then no new connections and every open one is shut down
//!   gracefully; shortly before `drain_timeout` (counted from the signal) streams still
//!   open are told to end ([`Drain::cut_streams`]: an SSE error event), and at the
//!   deadline whatever is left is dropped.

use crate::GatewayConfig;
use crate::tls::ServerTls;
use axum::Router;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use kvroute_protocol::api_error::ApiError;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A connection from the probe reserve must send its request within this long of its
/// accept (or `header_read_timeout`, if shorter). A health probe sends it at once;
/// kubelet's default probe timeout is 1 s.
pub const PROBE_FIRST_REQUEST: Duration = Duration::from_secs(2);

/// Longest request target (path and query, or the whole absolute URI) served, bytes;
/// beyond, 414 JSON. nginx's default (a request line must fit one 8 KiB
/// `large_client_header_buffers` buffer). Checked before the app sees the request: hyper's
/// own limit (64 KiB) answers 414 with an empty body and cannot be given one.
pub const MAX_URI_BYTES: usize = 8 << 10;

/// Most bytes of a request's header fields (names and values, plus 4 each for `": "` and
/// CRLF); beyond, 431 JSON naming the largest field. Envoy's default
/// (`max_request_headers_kb`, 60 KiB). Below hyper's own limit (its ~400 KiB read buffer,
/// and 100 fields), whose 431 has an empty body.
pub const MAX_HEADER_BYTES: usize = 60 << 10;

/// The 414 or 431 for a request head over [`MAX_URI_BYTES`] or [`MAX_HEADER_BYTES`].
fn head_too_large<B>(req: &http::Request<B>) -> Option<ApiError> {
    let uri = req.uri();
    let target = uri.path_and_query().map_or(0, |p| p.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.scheme_str().map_or(0, |s| s.len() + 3);
    if target > MAX_URI_BYTES {
        return Some(ApiError::new(
            http::StatusCode::URI_TOO_LONG,
            format!("the request target is {target} bytes; at most {MAX_URI_BYTES} are served"),
        ));
    }
    let size = |(n, v): (&http::HeaderName, &http::HeaderValue)| n.as_str().len() + v.len() + 4;
    let total: usize = req.headers().iter().map(size).sum();
    if total > MAX_HEADER_BYTES {
        let (name, len) = req.headers().iter().map(|h| (h.0.as_str(), size(h))).max_by_key(|h| h.1).unwrap_or(("", 0));
        return Some(ApiError::new(
            http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request's header fields are {total} bytes; at most {MAX_HEADER_BYTES} are served \
                 (the largest: `{name}`, {len} bytes)"
            ),
        ));
    }
    None
}

/// Longest time before the drain deadline at which open streams are told to end, so their
/// SSE error event is written before the connection is dropped (a tenth of
/// `drain_timeout` when that is shorter).
const CUT_MARGIN: Duration = Duration::from_secs(1);

/// How long a connection being shut down may stay open with no request in it (for an
/// HTTP/2 client to read the GOAWAY and close first).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// The server's limits (from the gateway configuration: [`Limits::from_config`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From a connection's accept to its first complete request head, at most (TLS
    /// handshake and protocol sniff included); then between two requests, and how long a
    /// connection may stay without an open request.
    pub header_read_timeout: Duration,
    /// Open client connections at most; further clients use the probe reserve or wait in
    /// the listen backlog.
    pub max_connections: usize,
    /// Connections beyond `max_connections` that serve only `/health` and `/readiness`.
    pub probe_connections: usize,
    /// Open connections from one client IP address at most; 0: no cap.
    pub max_connections_per_client: usize,
    /// HTTP/2 PING interval, and how long a PING may go unanswered; `None`: no PINGs.
    pub http2_keep_alive: Option<Duration>,
    /// Streams open at once on one HTTP/2 connection at most; `None`: hyper's default
    /// (200). The endpoint picker's gateway multiplexes its requests on a few connections.
    pub http2_max_concurrent_streams: Option<u32>,
    /// After the shutdown signal, how long new connections are still accepted.
    pub drain_delay: Duration,
    /// After the shutdown signal, how long until everything still open is dropped.
    pub drain_timeout: Duration,
}

impl Limits {
    /// The limits `cfg` sets (`header_read_timeout_secs`, `max_connections`,
    /// `probe_connections`, `max_connections_per_client`, `http2_keep_alive_secs`,
    /// `drain_delay_secs`, `drain_timeout_secs`). `cfg` must be valid
    /// ([`GatewayConfig::validate`]).
    pub fn from_config(cfg: &GatewayConfig) -> Limits {
        let secs = |v: f64| Duration::from_secs_f64(v.max(0.0));
        Limits {
            header_read_timeout: secs(cfg.header_read_timeout_secs),
            max_connections: cfg.max_connections,
            probe_connections: cfg.probe_connections,
            max_connections_per_client: cfg.max_connections_per_client,
            http2_keep_alive: (cfg.http2_keep_alive_secs > 0.0).then(|| secs(cfg.http2_keep_alive_secs)),
            http2_max_concurrent_streams: None,
            drain_delay: secs(cfg.drain_delay_secs),
            drain_timeout: secs(cfg.drain_timeout_secs),
        }
    }
}

impl Default for Limits {
    /// The limits of the default configuration.
    fn default() -> Limits {
        Limits::from_config(&GatewayConfig::default())
    }
}

/// What the server does at shutdown besides closing connections.
#[derive(Default)]
pub struct Drain {
    /// Called once when the shutdown signal arrives, before `drain_delay` (for instance:
    /// `/readiness` starts answering 503).
    pub on_signal: Option<Box<dyn FnOnce() + Send>>,
    /// Cancelled shortly before the drain deadline, so streams still open can end with an
    /// error event before their connection is dropped.
    pub cut_streams: CancellationToken,
}

/// One connection's requests: how many are open, whether one has arrived, when the last
/// ended.
///
/// A request only updates atomics: the watchers sleep to their deadline and look then, so
/// a connection's task is not woken twice and no timer is set per request. Only once the
/// connection is shutting down ([`Activity::shutting_down`]) does each response's end wake
/// the watcher, which then waits for the last open one.
#[derive(Debug)]
struct Activity {
    /// Requests whose response has not ended (its body finished or dropped).
    open: AtomicUsize,
    /// A request head has arrived on this connection.
    started: AtomicBool,
    /// When the connection was accepted: the origin of `last_end_ns`.
    born: Instant,
    /// When the last response ended, ns after `born` (at first: 0, the accept).
    last_end_ns: AtomicU64,
    /// The connection is shutting down: each response's end notifies `changed`.
    closing: AtomicBool,
    /// Woken at each response's end once `closing` is set.
    changed: Notify,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            open: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            born: Instant::now(),
            last_end_ns: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    /// When the last response ended (at first: the accept).
    fn last_end(&self) -> Instant {
        self.born + Duration::from_nanos(self.last_end_ns.load(Ordering::Acquire))
    }

    /// Resolves when no request head has arrived within `d` of the accept; never once one
    /// has.
    async fn no_request_within(&self, d: Duration) {
        tokio::time::sleep_until(self.born + d).await;
        if self.started.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
    }

    /// Resolves once no request is open and the last ended `idle` ago or more: sleeps to
    /// that deadline and looks again (a request that ended meanwhile moved it; one still
    /// open is looked at again `idle` later, and its end moves the deadline past that).
    async fn idle_for(&self, idle: Duration) {
        loop {
            if self.open.load(Ordering::Acquire) == 0 {
                let until = self.last_end() + idle;
                if until <= Instant::now() {
                    return;
                }
                tokio::time::sleep_until(until).await;
            } else {
                tokio::time::sleep(idle.max(Duration::from_millis(1))).await;
            }
        }
    }

    /// Marks the connection as shutting down, then resolves once no request is open and it
    /// is `not_before` or later.
    async fn shutting_down(&self, not_before: Instant) {
        self.closing.store(true, Ordering::SeqCst);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.open.load(Ordering::SeqCst) == 0 {
                if Instant::now() >= not_before {
                    return;
                }
                tokio::select! {
                    () = tokio::time::sleep_until(not_before) => {}
                    () = changed => {}
                }
            } else {
                changed.await;
            }
        }
    }
}

/// One open request of a connection, held until its response body ends or is dropped.
struct Open(Arc<Activity>);

impl Open {
    fn begin(act: &Arc<Activity>) -> Open {
        act.open.fetch_add(1, Ordering::SeqCst);
        act.started.store(true, Ordering::Release);
        Open(Arc::clone(act))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let act = &self.0;
        let since_born = u64::try_from(act.born.elapsed().as_nanos()).unwrap_or(u64::MAX);
        act.last_end_ns.fetch_max(since_born, Ordering::AcqRel);
        act.open.fetch_sub(1, Ordering::SeqCst);
        if act.closing.load(Ordering::SeqCst) {
            act.changed.notify_waiters();
        }
    }
}

/// Whether `req` is a health probe (`GET`/`HEAD` of `/health` or `/readiness`).
fn is_probe<B>(req: &http::Request<B>) -> bool {
    matches!(*req.method(), http::Method::GET | http::Method::HEAD)
        && matches!(req.uri().path(), "/health" | "/readiness")
}

/// One connection's service: the app, with the client's address for the admin check,
/// counting open requests; on a probe-reserve connection only health probes are served.
#[derive(Clone)]
struct ConnService {
    app: Router,
    peer: SocketAddr,
    act: Arc<Activity>,
    probe_only: bool,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for ConnService {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        let open = Open::begin(&self.act);
        let mut req = req.map(axum::body::Body::new);
        req.extensions_mut().insert(ConnectInfo(self.peer));
        // A reserve connection answers once and closes (HTTP/1; HTTP/2 has no such header).
        let close = self.probe_only && req.version() < http::Version::HTTP_2;
        let with_close = move |mut resp: axum::response::Response| {
            if close {
                resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
            }
            resp
        };
        if let Some(e) = head_too_large(&req) {
            drop(open);
            return Box::pin(std::future::ready(Ok(with_close(e.into_response()))));
        }
        if self.probe_only && !is_probe(&req) {
            let e = ApiError::new(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "max_connections reached: this connection is from the health-probe reserve (probe_connections) \
                 and serves only GET /health and GET /readiness; retry",
            )
            .retry_after(1);
            let resp = with_close(e.into_response());
            drop(open);
            return Box::pin(std::future::ready(Ok(resp)));
        }
        let call = tower_service::Service::call(&mut self.app.clone(), req);
        Box::pin(async move {
            let resp = call.await?;
            // The request stays open until its body is sent or dropped (a stream).
            let resp = resp.map(|b| {
                axum::body::Body::new(b.map_frame(move |f| {
                    let _open = &open;
                    f
                }))
            });
            Ok(with_close(resp))
        })
    }
}

/// Open connections per client address, for `max_connections_per_client`.
#[derive(Debug, Default)]
struct PerClient(Mutex<HashMap<IpAddr, usize>>);

/// One connection counted against its client's cap, released on drop.
struct ClientHold(Arc<PerClient>, IpAddr);

impl PerClient {
    /// Counts a connection from `ip`; `None` when it already has `cap` (0: no cap, nothing
    /// counted).
    fn admit(self: &Arc<PerClient>, ip: IpAddr, cap: usize) -> Option<Option<ClientHold>> {
        if cap == 0 {
            return Some(None);
        }
        let ip = ip.to_canonical();
        let mut m = self.0.lock();
        let n = m.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(Some(ClientHold(Arc::clone(self), ip)))
    }
}

impl Drop for ClientHold {
    fn drop(&mut self) {
        let mut m = self.0.0.lock();
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// A connection's slot: one of `max_connections`, or one of the probe reserve.
enum Slot {
    Main(#[allow(dead_code)] OwnedSemaphorePermit),
    Probe(OwnedSemaphorePermit),
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (module docs):
/// `drain.on_signal` is called, new connections are still accepted for
/// `limits.drain_delay`, then open connections are shut down gracefully;
/// `drain.cut_streams` is cancelled shortly before `limits.drain_timeout` (counted from the
/// signal) and everything still open is dropped at it. Returns the drain deadline, once
/// every connection is closed or the deadline passed.
///
/// With `tls`, every connection is a TLS connection; the handshake counts toward the
/// first-request deadline and uses the certificate current at its start (so a reload
/// applies to new connections).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<Arc<ServerTls>>,
    shutdown: impl Future<Output = ()>,
    drain: Drain,
) -> Instant {
    let Drain { on_signal, cut_streams } = drain;
    let signalled = drain_signal(shutdown, on_signal, limits);
    tokio::pin!(signalled);
    let mut conns = Connections::new(app, limits, tls);
    let t0 = conns.accept_until(&listener, signalled).await;
    drop(listener);
    conns.closing.cancel();
    drain_connections(conns.tasks, t0, limits, cut_streams).await
}

/// Waits for `shutdown`, calls `on_signal`, then waits `drain_delay` (at most
/// `drain_timeout`) while connections are still accepted; returns the signal's instant.
async fn drain_signal(
    shutdown: impl Future<Output = ()>,
    on_signal: Option<Box<dyn FnOnce() + Send>>,
    limits: Limits,
) -> Instant {
    shutdown.await;
    let t0 = Instant::now();
    if let Some(f) = on_signal {
        f();
    }
    tokio::time::sleep(limits.drain_delay.min(limits.drain_timeout)).await;
    t0
}

/// The HTTP/1 and HTTP/2 connection settings of `limits` (head timeout, PINGs, streams).
fn http_builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    let mut h2 = builder.http2();
    h2.timer(TokioTimer::new());
    if let Some(k) = limits.http2_keep_alive {
        h2.keep_alive_interval(k).keep_alive_timeout(k);
    }
    if let Some(n) = limits.http2_max_concurrent_streams {
        h2.max_concurrent_streams(n);
    }
    builder
}

/// The accepting side of [`serve`]: what every connection shares, and their tasks.
struct Connections {
    app: Router,
    limits: Limits,
    tls: Option<Arc<ServerTls>>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    /// The `max_connections` slots.
    main: Arc<Semaphore>,
    /// The probe reserve (`probe_connections`).
    reserve: Arc<Semaphore>,
    per_client: Arc<PerClient>,
    /// Cancelled when the server stops accepting: every connection shuts down gracefully.
    closing: CancellationToken,
    /// Every connection's task, so the ones still open at the drain deadline can be ended.
    tasks: tokio::task::JoinSet<()>,
}

impl Connections {
    /// No connection yet.
    fn new(app: Router, limits: Limits, tls: Option<Arc<ServerTls>>) -> Connections {
        Connections {
            app,
            limits,
            tls,
            builder: Arc::new(http_builder(&limits)),
            main: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            reserve: Arc::new(Semaphore::new(limits.probe_connections)),
            per_client: Arc::new(PerClient::default()),
            closing: CancellationToken::new(),
            tasks: tokio::task::JoinSet::new(),
        }
    }

    /// Accepts connections, each once it has a slot, until `signalled` resolves; returns
    /// its instant (the shutdown signal's).
    async fn accept_until(
        &mut self,
        listener: &TcpListener,
        mut signalled: Pin<&mut impl Future<Output = Instant>>,
    ) -> Instant {
        loop {
            while self.tasks.try_join_next().is_some() {}
            let slot = tokio::select! {
                biased;
                t0 = &mut signalled => return t0,
                Ok(p) = Arc::clone(&self.main).acquire_owned() => Slot::Main(p),
                Ok(p) = Arc::clone(&self.reserve).acquire_owned() => Slot::Probe(p),
            };
            let (tcp, peer) = tokio::select! {
                biased;
                t0 = &mut signalled => return t0,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors or a connection reset before accept: wait a
                        // little instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let slot = slot.prefer_main(&self.main);
            let Some(client) = self.per_client.admit(peer.ip(), self.limits.max_connections_per_client) else {
                tracing::debug!(%peer, "connection closed: max_connections_per_client reached for this address");
                continue;
            };
            // Small request/response exchanges: do not let Nagle's algorithm hold segments back.
            let _ = tcp.set_nodelay(true);
            self.spawn(tcp, peer, slot, client);
        }
    }

    /// Serves one accepted connection in its own task (after its TLS handshake, with
    /// `tls`); closes it when no complete request head arrives within the first-request
    /// deadline (shorter on a reserve slot) or when the server stops accepting.
    fn spawn(&mut self, tcp: tokio::net::TcpStream, peer: SocketAddr, slot: Slot, client: Option<ClientHold>) {
        let probe_only = matches!(slot, Slot::Probe(_));
        let act = Arc::new(Activity::new());
        let svc = ConnService { app: self.app.clone(), peer, act: Arc::clone(&act), probe_only };
        let header_read_timeout = self.limits.header_read_timeout;
        let first_by = if probe_only { header_read_timeout.min(PROBE_FIRST_REQUEST) } else { header_read_timeout };
        let builder = Arc::clone(&self.builder);
        let acceptor = self.tls.as_ref().map(|t| t.acceptor());
        let closing = self.closing.clone();
        self.tasks.spawn(async move {
            let _held = (slot, client);
            // A reserve connection left idle (HTTP/2 keeps one open) goes as soon.
            let idle = first_by;
            let work = async {
                match acceptor {
                    None => drive(&builder, tcp, svc, &act, idle, &closing).await,
                    Some(acceptor) => {
                        let handshake = tokio::select! {
                            r = acceptor.accept(tcp) => r,
                            () = closing.cancelled() => return,
                        };
                        match handshake {
                            Ok(stream) => drive(&builder, stream, svc, &act, idle, &closing).await,
                            Err(e) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        }
                    }
                }
            };
            tokio::select! {
                () = work => {}
                () = act.no_request_within(first_by) => tracing::debug!(
                    %peer,
                    secs = first_by.as_secs_f64(),
                    "connection closed: no complete request head within header_read_timeout_secs of its accept"
                ),
            }
        });
    }
}

impl Slot {
    /// A reserve slot taken while waiting for a connection, traded for a regular one if one
    /// has freed since.
    fn prefer_main(self, main: &Arc<Semaphore>) -> Slot {
        match self {
            Slot::Probe(p) => match Arc::clone(main).try_acquire_owned() {
                Ok(m) => {
                    drop(p);
                    Slot::Main(m)
                }
                Err(_) => Slot::Probe(p),
            },
            s => s,
        }
    }
}

/// Waits for the open connections until the drain deadline (`t0 + drain_timeout`):
/// `cut_streams` is cancelled shortly before it, and what is still open at it is dropped.
/// Returns the deadline.
async fn drain_connections(
    mut conns: tokio::task::JoinSet<()>,
    t0: Instant,
    limits: Limits,
    cut_streams: CancellationToken,
) -> Instant {
    let deadline = t0 + limits.drain_timeout;
    let cut_at = deadline.checked_sub(CUT_MARGIN.min(limits.drain_timeout / 10)).unwrap_or(deadline);
    if !conns.is_empty() {
        tracing::info!(
            open = conns.len(),
            deadline_secs = deadline.saturating_duration_since(Instant::now()).as_secs_f64(),
            "draining connections"
        );
    }
    let drained = async { while conns.join_next().await.is_some() {} };
    let cut = async {
        tokio::time::sleep_until(cut_at).await;
        cut_streams.cancel();
        tokio::time::sleep_until(deadline).await;
    };
    tokio::select! {
        () = drained => {}
        () = cut => tracing::warn!(open = conns.len(), "drain deadline passed: closing the remaining connections"),
    }
    conns.shutdown().await;
    deadline
}

/// Serves one connection on `io` until it ends: shut down gracefully (HTTP/2: GOAWAY)
/// when the server stops accepting (`closing`) or after `idle` without an open request;
/// once shutting down, dropped when no request is open and [`SHUTDOWN_GRACE`] has passed
/// (an HTTP/2 client that never answers hyper's GOAWAY PING would otherwise keep it).
async fn drive<T>(
    builder: &auto::Builder<TokioExecutor>,
    io: T,
    svc: ConnService,
    act: &Activity,
    idle: Duration,
    closing: &CancellationToken,
) where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let peer = svc.peer;
    let conn = builder.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let mut drop_after: Option<Instant> = None;
    loop {
        tokio::select! {
            // The connection first: a GOAWAY just queued is written before a drop.
            biased;
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            () = closing.cancelled(), if drop_after.is_none() => {
                drop_after = Some(Instant::now() + SHUTDOWN_GRACE);
                conn.as_mut().graceful_shutdown();
            }
            () = act.idle_for(idle), if drop_after.is_none() => {
                tracing::debug!(%peer, "idle connection shut down (header_read_timeout_secs)");
                drop_after = Some(Instant::now() + SHUTDOWN_GRACE);
                conn.as_mut().graceful_shutdown();
            }
            () = act.shutting_down(drop_after.unwrap_or_else(Instant::now)), if drop_after.is_some() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_per_client_cap_counts_each_address_and_releases_on_drop() {
        let p = Arc::new(PerClient::default());
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let h1 = p.admit(a, 2).expect("first");
        let h2 = p.admit(mapped, 2).expect("second, same address as IPv4-mapped IPv6");
        assert!(p.admit(a, 2).is_none(), "third from the same address refused");
        assert!(p.admit(b, 2).is_some(), "another address is not affected");
        drop(h1);
        assert!(p.admit(a, 2).is_some(), "a slot freed on drop");
        drop(h2);
        assert!(matches!(p.admit(a, 0), Some(None)), "0: no cap, nothing counted");
    }

    #[test]
    fn request_targets_and_header_fields_over_the_limits_get_414_and_431_naming_them() {
        let ok = http::Request::builder().uri("/v1/models").header("a", "b").body(()).expect("request");
        assert!(head_too_large(&ok).is_none());
        let long = format!("/v1/models?x={}", "a".repeat(MAX_URI_BYTES));
        let e = head_too_large(&http::Request::builder().uri(long.as_str()).body(()).expect("request")).expect("414");
        assert_eq!(e.status, 414);
        assert!(e.message.contains(&long.len().to_string()), "{}", e.message);
        let big = "v".repeat(MAX_HEADER_BYTES);
        let req = http::Request::builder().uri("/").header("x-small", "1").header("x-big", big).body(()).expect("r");
        let e = head_too_large(&req).expect("431");
        assert_eq!(e.status, 431);
        assert!(e.message.contains("`x-big`"), "{}", e.message);
    }

    #[test]
    fn only_get_and_head_of_health_and_readiness_are_probes() {
        let req = |m: &str, p: &str| http::Request::builder().method(m).uri(p).body(()).expect("request");
        assert!(is_probe(&req("GET", "/health")));
        assert!(is_probe(&req("HEAD", "/readiness")));
        assert!(!is_probe(&req("POST", "/health")));
        assert!(!is_probe(&req("GET", "/metrics")));
        assert!(!is_probe(&req("GET", "/health/x")));
    }
}
