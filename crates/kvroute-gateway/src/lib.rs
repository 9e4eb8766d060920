//! # kvroute-gateway
//!
//! The OpenAI- and SGLang-compatible router server: `kvroute serve`. Requests are parsed
//! just enough to get the model, the routing text (or token ids) and the session; the
//! routing core ([`kvroute_core::policy::route`]) picks a worker; the body is forwarded
//! unchanged and the response is streamed back byte for byte. See `docs/gateway.md`.
//!
//! - [`config`]: TOML/flags/env configuration.
//! - [`pipeline`]: one request's stages — parse, routing key, admit, decide, dispatch
//!   (retries), respond and account — one module each.
//! - [`fleet`]: the workers, swapped whole; health, engine signals and load in atomics.
//! - [`routers`]: one router (policy state) per model; eviction in bounded slices.
//! - [`health`]: active health checks, inference probes, model discovery, `/metrics` scraping.
//! - [`admin`]: worker management, `/policy`, `/debug/route`.
//! - [`body_budget`]: the request bodies held at once, bounded.
//! - [`hops`]: routing-loop guards (`Via`, 508, a worker URL that is this router).
//! - [`kv_subscriber`]: engine KV events (subscribers feeding the precise index).
//! - [`tokenizer`]: the model's own tokenizer, loaded locally.
//! - [`cluster`]: the worker registry and live policy in etcd, shared by router replicas.
//! - [`tenant`]: a request's tenant, its cache salt, and who sees decision details.
//! - [`tls`]: HTTPS for clients and the trust roots for `https://` workers.
//! - [`record`]: live traffic written as a privacy-safe trace (`record`).
//! - [`reload`]: SIGHUP: the TLS certificate and the configuration file, read again.
//!
//! Wire formats (request parsing, errors, the KV-event codec, engine metrics) live in
//! `kvroute-protocol`; the simulated worker in `kvroute-engine-sim`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod admin_token;
pub mod api_keys;
pub mod app;
pub mod body_budget;
pub mod cluster;
pub mod config;
pub mod epp;
pub mod fleet;
pub mod health;
pub mod hops;
pub mod kv_move;
pub mod kv_subscriber;
pub mod kv_tokens;
pub mod lora;
pub mod membership;
pub mod metrics;
pub mod model;
pub mod pd;
pub mod pipeline;
pub mod policy_control;
pub mod record;
pub mod reload;
pub mod routers;
pub mod server;
pub mod tenant;
pub mod tls;
pub mod tokenizer;
pub mod twin;
pub mod upstream;

use app::AppState;
use axum::Router;
use axum::routing::{get, post};
pub use config::GatewayConfig;
pub use reload::ConfigSource;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The endpoints clients use: inference, models, health, readiness and metrics.
pub fn public_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/chat/completions", post(pipeline::chat_completions))
        .route("/v1/completions", post(pipeline::completions))
        .route("/generate", post(pipeline::generate))
        .route("/v1/models", get(admin::models))
        .route("/health", get(admin::health))
        .route("/readiness", get(admin::readiness))
        .route("/metrics", get(admin::metrics))
}

/// The admin API's paths.
pub const ADMIN_PATHS: [&str; 6] =
    ["/add_worker", "/remove_worker", "/list_workers", "/workers", "/policy", "/debug/route"];

/// The admin endpoints (SGLang router's worker management, the worker table, live policy,
/// dry-run routing), each behind [`admin::require_admin`]: a bearer token when
/// `admin_token` is set, else loopback clients whose request names no proxy.
pub fn admin_routes(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/add_worker", post(admin::add_worker))
        .route("/remove_worker", post(admin::remove_worker))
        .route("/list_workers", get(admin::list_workers))
        .route("/workers", get(admin::workers))
        .route("/policy", get(admin::get_policy).put(admin::put_policy))
        .route("/debug/route", post(admin::debug_route))
        .route_layer(axum::middleware::from_fn_with_state(Arc::clone(state), admin::require_admin))
}

/// The admin paths on a listener that does not serve them: 404 JSON saying where they are
/// ([`admin::admin_not_here`]).
fn admin_elsewhere() -> Router<Arc<AppState>> {
    ADMIN_PATHS.iter().fold(Router::new(), |r, p| r.route(p, axum::routing::any(admin::admin_not_here)))
}

/// Builds the router of the main port over `state`: the public endpoints, and the admin API
/// only when `admin_token` is set (without a token it is served only on `admin_listen`; a
/// same-host reverse proxy would make every client on the main port look local). Serve it
/// with connect info (`into_make_service_with_connect_info::<SocketAddr>`).
pub fn app(state: Arc<AppState>) -> Router {
    let routes = if state.cfg.has_admin_token() && state.cfg.admin_listen.is_none() {
        public_routes().merge(admin_routes(&state))
    } else {
        public_routes().merge(admin_elsewhere())
    };
    with_fallbacks(routes).with_state(state)
}

/// The admin listener's router (`admin_listen`): the admin API only.
pub fn admin_app(state: Arc<AppState>) -> Router {
    with_fallbacks(admin_routes(&state)).with_state(state)
}

/// JSON errors for an unknown path (404) and a known path with the wrong method (405; axum
/// answers it with an empty body otherwise).
fn with_fallbacks(r: Router<Arc<AppState>>) -> Router<Arc<AppState>> {
    r.fallback(admin::not_found).method_not_allowed_fallback(admin::method_not_allowed)
}

/// Serves the gateway on `listener` until `shutdown` resolves, then drains in-flight
/// requests. Background tasks (health checks, policy maintenance) stop with it. A SIGHUP
/// reloads the TLS certificate only: [`serve_with_reload`] with no [`ConfigSource`].
///
/// # Errors
/// Invalid configuration, or an I/O error of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_with_reload(listener, cfg, None, shutdown).await
}

/// [`serve`], with `reload` read again on each SIGHUP (besides the TLS certificate): the
/// policy, its knobs and `worker_urls` change live, other changed keys are logged as
/// needing a restart, and a configuration that fails to read or validate changes nothing
/// ([`reload`]; `kvroute_config_reloads_total{outcome}`). `cfg` is the configuration to
/// start with, normally `reload`'s own first result.
///
/// # Errors
/// Invalid configuration, the SIGHUP handler cannot be installed, or an I/O error of the
/// listener. A failed reload is never an error here.
pub async fn serve_with_reload(
    listener: tokio::net::TcpListener,
    cfg: GatewayConfig,
    reload: Option<ConfigSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_when_ready(listener, cfg, reload, shutdown, |_| {}).await
}

/// [`serve_with_reload`], calling `ready` with the configuration in effect once everything
/// that can stop the start has passed (the configuration validated, the TLS files, API
/// keys, admin token and tokenizer read, the listeners bound) and just before the first
/// connection is served: what `kvroute serve` announces then.
///
/// # Errors
/// As [`serve_with_reload`].
pub async fn serve_when_ready(
    listener: tokio::net::TcpListener,
    cfg: GatewayConfig,
    reload: Option<ConfigSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(&GatewayConfig),
) -> anyhow::Result<()> {
    cfg.validate()?;
    let tls = load_tls(&cfg)?;
    // Registered before the first connection is accepted, so a SIGHUP reloads rather than
    // ending the process; one arriving before the handler task starts waits for it.
    let hup = reload::Hangup::install()?;
    let state = AppState::new(cfg)?;
    let cancel = tokio_util::sync::CancellationToken::new();
    let admin = bind_admin(&state).await?;
    let epp = bind_epp(&state).await?;
    let main_app = app(Arc::clone(&state));
    let others: Vec<&tokio::net::TcpListener> =
        admin.as_ref().map(|(l, _)| l).into_iter().chain(epp.as_ref()).collect();
    refuse_own_addresses(&state, &listener, &others).await?;
    state.add_initial_workers().await;
    let reloader = tokio::spawn(reload::run(hup, tls.clone(), reload, Arc::clone(&state)));
    let mut tasks = spawn_background(&state, &cancel);
    let limits = server::Limits::from_config(&state.cfg);
    tasks.extend(admin.map(|(l, a)| spawn_admin(l, a, limits, tls.clone(), cancel.clone())));
    let epp_tls = epp_tls(&state.cfg, tls.as_ref(), epp.as_ref())?;
    tasks.extend(epp.map(|l| spawn_epp(&state, l, limits, epp_tls, cancel.clone())));
    ready(&state.cfg);
    let deadline = server::serve(listener, main_app, limits, tls, shutdown, drain_hooks(&state)).await;
    // The background tasks (health checks, KV events, etcd, NATS) stop now; none may hold
    // the process past the drain deadline (a NATS flush or an etcd call to a server that
    // is down would wait forever): what is left at the deadline is abandoned.
    cancel.cancel();
    reloader.abort();
    stop_by(deadline, tasks).await;
    Ok(())
}

/// The TLS certificate and key of `tls_cert` and `tls_key`, when both are set.
fn load_tls(cfg: &GatewayConfig) -> anyhow::Result<Option<Arc<tls::ServerTls>>> {
    Ok(match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(c), Some(k)) => Some(tls::ServerTls::load(c.as_ref(), k.as_ref())?),
        _ => None,
    })
}

/// With `admin_listen`, binds the admin API's own listener (the main port then serves only
/// the public endpoints); without it, the main port serves the admin API only when
/// `admin_token` is set.
async fn bind_admin(state: &Arc<AppState>) -> anyhow::Result<Option<(tokio::net::TcpListener, Router)>> {
    Ok(match &state.cfg.admin_listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr.as_str())
                .await
                .map_err(|e| anyhow::anyhow!("admin_listen {addr}: {e}"))?;
            tracing::info!(addr = %l.local_addr()?, "admin API listening");
            Some((l, admin_app(Arc::clone(state))))
        }
        None if !state.cfg.has_admin_token() => {
            tracing::info!("admin API off: set `admin_listen` (loopback) or `admin_token` to serve it");
            None
        }
        None => None,
    })
}

/// With `epp_listen`, binds the endpoint picker's gRPC listener.
async fn bind_epp(state: &AppState) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    let Some(addr) = &state.cfg.epp_listen else { return Ok(None) };
    let l =
        tokio::net::TcpListener::bind(addr.as_str()).await.map_err(|e| anyhow::anyhow!("epp_listen {addr}: {e}"))?;
    tracing::info!(addr = %l.local_addr()?, "endpoint picker (ext_proc gRPC) listening");
    Ok(Some(l))
}

/// The endpoint picker's TLS with `epp_tls`: the main port's certificate (`main`), else a
/// self-signed one for the listener's address, `localhost` and the host's name.
///
/// # Errors
/// The self-signed certificate could not be made.
fn epp_tls(
    cfg: &GatewayConfig,
    main: Option<&Arc<tls::ServerTls>>,
    listener: Option<&tokio::net::TcpListener>,
) -> anyhow::Result<Option<Arc<tls::ServerTls>>> {
    let Some(l) = listener.filter(|_| cfg.epp_tls) else { return Ok(None) };
    if let Some(t) = main {
        return Ok(Some(Arc::clone(t)));
    }
    let mut names = vec!["localhost".to_string(), l.local_addr()?.ip().to_string()];
    names.extend(std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()));
    let t = tls::ServerTls::self_signed(names)?;
    tracing::info!("endpoint picker serves TLS with a self-signed certificate (epp_tls, no tls_cert)");
    Ok(Some(t))
}

/// Serves the endpoint picker until `stop` (the main listener has drained: a gateway's
/// ext_proc streams are served through the drain delay, as HTTP clients are), with the main
/// port's connection guards (`limits`), up to [`epp::MAX_STREAMS_PER_CONNECTION`] streams
/// a connection (a gateway multiplexes its requests on a few), no probe reserve (the
/// gateway's health checks are gRPC calls on its ordinary connections) and no drain delay.
fn spawn_epp(
    state: &Arc<AppState>,
    listener: tokio::net::TcpListener,
    limits: server::Limits,
    tls: Option<Arc<tls::ServerTls>>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let limits = server::Limits {
        http2_max_concurrent_streams: Some(epp::MAX_STREAMS_PER_CONNECTION),
        probe_connections: 0,
        drain_delay: Duration::ZERO,
        ..limits
    };
    let app = epp::router(state);
    tokio::spawn(async move {
        server::serve(listener, app, limits, tls, async move { stop.cancelled().await }, server::Drain::default())
            .await;
    })
}

/// Records the listeners' addresses before any worker is added, and stops the start when a
/// configured worker (`worker_urls`, the P/D pools) points at one of them: a router as its
/// own worker loops.
async fn refuse_own_addresses(
    state: &AppState,
    listener: &tokio::net::TcpListener,
    others: &[&tokio::net::TcpListener],
) -> anyhow::Result<()> {
    let mut own = vec![listener.local_addr()?];
    for l in others {
        own.push(l.local_addr()?);
    }
    *state.listen_addrs.write() = own;
    for u in state.static_workers.load_full().iter().map(String::as_str).chain(state.cfg.pd.urls()) {
        state
            .check_not_own(u)
            .await
            .map_err(|m| config::ConfigError { key: "worker_urls".into(), message: m.to_string() })?;
    }
    Ok(())
}

/// Starts the background tasks that run until `cancel`: health checks, KV events, the etcd
/// registry, the NATS cluster sync, the prefix journal and the KV mover's file sweep.
fn spawn_background(
    state: &Arc<AppState>,
    cancel: &tokio_util::sync::CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    vec![
        tokio::spawn(health::run_background(Arc::clone(state), cancel.clone())),
        spawn_kv_ingestion(state, cancel),
        tokio::spawn(cluster::etcd::run(Arc::clone(state), cancel.clone())),
        tokio::spawn(cluster::sync_task::run(Arc::clone(state), cancel.clone())),
        tokio::spawn(cluster::journal_task::run(Arc::clone(state), cancel.clone())),
        tokio::spawn(kv_move::run_sweeper(state.kv_mover.clone(), cancel.clone())),
    ]
}

/// Runs the KV-event subscribers and their applier ([`kv_subscriber::run`]) on a runtime
/// of their own, `kv_event_threads` threads (one by default): however fast engines publish,
/// ingestion takes at most that many cores and the operating system shares the rest with
/// the requests. On the request runtime, 1,024 subscribers' tasks queued ahead of the
/// requests' (`kvroute bench kv-events --zmq`, two cores: decisions 2.6–7.3 ms p50 at 1.2 M
/// block events/s, 1.3–1.6 ms with the subscribers apart). Nothing to run without KV-event
/// sources.
fn spawn_kv_ingestion(
    state: &Arc<AppState>,
    cancel: &tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let (s, c) = (Arc::clone(state), cancel.clone());
    if s.cfg.kv_events.is_empty() {
        return tokio::spawn(async {});
    }
    tokio::task::spawn_blocking(move || {
        let threads = usize::from(s.cfg.kv_event_threads.max(1));
        let built = if threads == 1 {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("kv-events")
                .enable_all()
                .build()
        };
        match built {
            Ok(rt) => rt.block_on(kv_subscriber::run(s, c)),
            Err(e) => tracing::error!(error = %e, "kv events: no runtime for the subscribers; not subscribing"),
        }
    })
}

/// Serves the admin listener until `stop`: it stops accepting as soon as the main one has
/// drained (no drain delay of its own).
fn spawn_admin(
    listener: tokio::net::TcpListener,
    admin: Router,
    limits: server::Limits,
    tls: Option<Arc<tls::ServerTls>>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let limits = server::Limits { drain_delay: Duration::ZERO, ..limits };
    tokio::spawn(async move {
        server::serve(listener, admin, limits, tls, async move { stop.cancelled().await }, server::Drain::default())
            .await;
    })
}

/// The main listener's shutdown besides closing connections: `/readiness` answers 503 from
/// the signal on, and open streams are cut just before the drain deadline.
fn drain_hooks(state: &Arc<AppState>) -> server::Drain {
    let draining = Arc::clone(state);
    let delay = state.cfg.drain_delay_secs;
    server::Drain {
        on_signal: Some(Box::new(move || {
            // `/readiness` answers 503 from here on, so load balancers stop sending.
            draining.draining.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(
                drain_delay_secs = delay,
                "shutting down: /readiness 503, new connections still served for drain_delay_secs, then draining"
            );
        })),
        cut_streams: state.cut_streams.clone(),
    }
}

/// Waits for `tasks` (already cancelled) until `deadline`, then aborts those still running.
async fn stop_by(deadline: tokio::time::Instant, tasks: Vec<tokio::task::JoinHandle<()>>) {
    let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
    if tokio::time::timeout_at(deadline, futures_util::future::join_all(tasks)).await.is_err() {
        tracing::warn!("drain deadline passed with background tasks still stopping: abandoned");
        aborts.iter().for_each(tokio::task::AbortHandle::abort);
    }
}
