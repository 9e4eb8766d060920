//! Endpoint-picker mode (`epp_listen`): kvroute as the endpoint picker (EPP) of the Gateway
//! API Inference Extension — the protocol in `docs/proposals/004-endpoint-picker-protocol`
//! of kubernetes-sigs/gateway-api-inference-extension, spoken over Envoy's External
//! Processing (ext_proc v3) gRPC service. A gateway (Envoy, kgateway, Istio, NGINX Gateway
//! Fabric, GKE's) calls it once per request; kvroute decides with the same pipeline as
//! `serve` (parse, admit, decide, commit), answers the endpoints to try in
//! `x-gateway-destination-endpoint` and the `envoy.lb` dynamic metadata, or answers the
//! request itself (an immediate response with `serve`'s status and JSON body), and
//! watches the response go by to settle the dispatch (`exchange`).
//!
//! The same port serves the gRPC health checking protocol (`grpc.health.v1`) with the
//! services the endpoint-picker protocol names: `liveness` (the process answers),
//! `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` (as `/readiness`: a
//! routable worker, not draining, cluster state synced).
//!
//! The port is served like the main one ([`router`], given to `server::serve` by `lib.rs`):
//! the same connection guards, over TLS with `epp_tls`; each stream's messages are counted
//! against the body budget while they arrive ([`transit`]).

mod exchange;
pub mod transit;
pub mod wire;

use crate::app::AppState;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// Responses queued per ext_proc stream before the picker waits for the gateway to read.
const STREAM_QUEUE: usize = 32;
/// Most ext_proc streams (requests) open at once on one gateway connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 4096;

/// A stream of messages to the gateway.
type Outbound<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The ext_proc service.
struct Picker {
    s: Arc<AppState>,
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Outbound<ProcessingResponse>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_QUEUE);
        let transit = request.extensions().get::<Arc<transit::StreamBudget>>().cloned();
        tokio::spawn(exchange::run(Arc::clone(&self.s), request.into_inner(), transit, tx));
        let out = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(out)))
    }
}

/// The ext_proc service, each stream's body metered against the body budget
/// ([`transit`]): the picker finds the stream's [`transit::StreamBudget`] in its request's
/// extensions.
#[derive(Clone)]
struct MeteredPicker {
    inner: ExternalProcessorServer<Picker>,
    budget: crate::body_budget::BodyBudget,
}

impl tonic::server::NamedService for MeteredPicker {
    const NAME: &'static str = <ExternalProcessorServer<Picker> as tonic::server::NamedService>::NAME;
}

impl tower_service::Service<http::Request<tonic::body::Body>> for MeteredPicker {
    type Response = <ExternalProcessorServer<Picker> as tower_service::Service<
        http::Request<transit::Metered<tonic::body::Body>>,
    >>::Response;
    type Error = std::convert::Infallible;
    type Future = <ExternalProcessorServer<Picker> as tower_service::Service<
        http::Request<transit::Metered<tonic::body::Body>>,
    >>::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        tower_service::Service::<http::Request<transit::Metered<tonic::body::Body>>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let (body, stream) = transit::Metered::new(body, self.budget.clone());
        let mut req = http::Request::from_parts(parts, body);
        req.extensions_mut().insert(stream);
        self.inner.call(req)
    }
}

/// The gRPC health service of the endpoint-picker protocol.
struct Probes {
    s: Arc<AppState>,
}

impl Probes {
    fn status(&self, service: &str) -> Result<ServingStatus, Status> {
        let ready = || {
            let s = &self.s;
            let routable = s.fleet.load().iter().any(|w| w.is_routable());
            let draining = s.draining.load(std::sync::atomic::Ordering::Relaxed);
            let synced = s.sync.as_ref().is_none_or(|x| x.is_ready());
            let restored = s.journal.as_ref().is_none_or(|j| j.is_restored());
            if routable && !draining && synced && restored { ServingStatus::Serving } else { ServingStatus::NotServing }
        };
        match service {
            "" | "liveness" => Ok(ServingStatus::Serving),
            "readiness" | "envoy.service.ext_proc.v3.ExternalProcessor" => Ok(ready()),
            other => Err(Status::not_found(format!("unknown service `{other}`"))),
        }
    }
}

#[tonic::async_trait]
impl Health for Probes {
    type WatchStream = Outbound<HealthCheckResponse>;

    async fn check(&self, r: Request<HealthCheckRequest>) -> Result<Response<HealthCheckResponse>, Status> {
        let status = self.status(&r.get_ref().service)?;
        Ok(Response::new(HealthCheckResponse { status: status.into() }))
    }

    /// The status now, then each change (checked every second).
    async fn watch(&self, r: Request<HealthCheckRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let service = r.into_inner().service;
        let first = self.status(&service)?;
        let probes = Probes { s: Arc::clone(&self.s) };
        let out = futures_util::stream::unfold((probes, service, None), move |(p, service, last)| async move {
            let mut now = first;
            if last.is_some() {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    now = p.status(&service).unwrap_or(ServingStatus::ServiceUnknown);
                    if Some(now) != last {
                        break;
                    }
                }
            }
            Some((Ok(HealthCheckResponse { status: now.into() }), (p, service, Some(now))))
        });
        Ok(Response::new(Box::pin(out)))
    }
}

/// The endpoint picker's gRPC services (ext_proc and health) as a router, for
/// [`crate::server::serve`] on the `epp_listen` listener: the main port's connection guards
/// (`max_connections`, `max_connections_per_client`, the deadline for a connection that
/// sends nothing, `header_read_timeout_secs`) apply to it too, with up to
/// [`MAX_STREAMS_PER_CONNECTION`] streams a connection.
pub fn router(s: &Arc<AppState>) -> axum::Router {
    // A buffered request body is one message: room for the largest body the router accepts.
    let max_message = s.cfg.max_body_bytes.saturating_add(1 << 16);
    let picker = ExternalProcessorServer::new(Picker { s: Arc::clone(s) }).max_decoding_message_size(max_message);
    let picker = MeteredPicker { inner: picker, budget: s.body_budget.clone() };
    let health = HealthServer::new(Probes { s: Arc::clone(s) });
    tonic::service::Routes::new(picker).add_service(health).into_axum_router()
}
