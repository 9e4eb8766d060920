//! The HTTP server loop (hyper through `hyper-util`): accepts connections up to a cap, reads
//! each request's headers within a timeout (which also closes idle keep-alive connections),
//! and on shutdown stops accepting, lets in-flight requests finish up to a drain deadline,
//! then drops what is left. `axum::serve` has none of these: a client sending headers one
//! byte a minute, or an idle keep-alive socket, was held forever and kept the router from
//! exiting after SIGTERM. With TLS ([`crate::tls::ServerTls`]) each connection's handshake
//! runs in its own task, bounded by the header-read timeout.

use crate::tls::ServerTls;
use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The server's limits (from the gateway configuration).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A request's headers must arrive within this long of the connection becoming ready
    /// for one (for a keep-alive connection: of the previous response's end).
    pub header_read_timeout: Duration,
    /// Open client connections at most; further clients wait in the listen backlog.
    pub max_connections: usize,
    /// After shutdown starts, how long in-flight requests may still run.
    pub drain_timeout: Duration,
}

/// One connection's service: the app, with the client's address for the admin check.
#[derive(Clone)]
struct WithPeer {
    app: Router,
    peer: SocketAddr,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for WithPeer {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = <Router as tower_service::Service<axum::extract::Request>>::Future;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        let mut req = req.map(axum::body::Body::new);
        req.extensions_mut().insert(ConnectInfo(self.peer));
        tower_service::Service::call(&mut self.app.clone(), req)
    }
}

/// Serves `app` on `listener` until `shutdown` resolves; then calls `on_drain`, stops
/// accepting and waits for open connections to finish their requests, at most
/// `limits.drain_timeout`. Returns once every connection is closed or the deadline passed.
///
/// With `tls`, every connection is a TLS connection: a client that does not complete its
/// handshake within `limits.header_read_timeout` is dropped, and each handshake uses the
/// certificate current at its start (so a reload applies to new connections).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<Arc<ServerTls>>,
    shutdown: impl Future<Output = ()>,
    on_drain: impl FnOnce(),
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Every connection's task, so the ones still open at the drain deadline can be ended.
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while conns.try_join_next().is_some() {}
        let permit = tokio::select! {
            p = Arc::clone(&slots).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (tcp, peer) = tokio::select! {
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
            () = &mut shutdown => break,
        };
        // Small request/response exchanges: do not let Nagle's algorithm hold segments back.
        let _ = tcp.set_nodelay(true);
        let svc = WithPeer { app: app.clone(), peer };
        let builder = Arc::clone(&builder);
        let watcher = graceful.watcher();
        let acceptor = tls.as_ref().map(|t| t.acceptor());
        let handshake_timeout = limits.header_read_timeout;
        conns.spawn(async move {
            let result = match acceptor {
                None => watcher.watch(builder.serve_connection(TokioIo::new(tcp), svc).into_owned()).await,
                Some(acceptor) => match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        watcher.watch(builder.serve_connection(TokioIo::new(stream), svc).into_owned()).await
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        Ok(())
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake not done within header_read_timeout_secs");
                        Ok(())
                    }
                },
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    on_drain();
    drop(listener);
    let open = graceful.count();
    if open > 0 {
        tracing::info!(open, deadline_secs = limits.drain_timeout.as_secs_f64(), "draining connections");
    }
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(open = conns.len(), "drain deadline passed: closing the remaining connections");
    }
    conns.shutdown().await;
}
