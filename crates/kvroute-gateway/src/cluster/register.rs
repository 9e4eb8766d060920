//! The registration sidecar (`kvroute register`): keeps one worker's key in etcd alive
//! while the worker is healthy.
//!
//! Every `check_interval` it asks the worker's health endpoint. While the worker answers
//! 200 the key `PREFIX/workers/<id>` holds its [`WorkerRecord`] under a lease of `ttl`,
//! renewed at each check. When the worker stops answering, the sidecar stops renewing: the
//! lease lapses and etcd deletes the key within `ttl`, which removes the worker from every
//! router. When it answers again, a new lease registers it again. On shutdown the lease is
//! revoked, so routers drop the worker at once. etcd being unreachable is retried with a
//! capped backoff; the worker then stays registered until its lease lapses.

use crate::model::registration::WorkerRecord;
use etcd_client::{Client, PutOptions};
use std::future::Future;
use std::time::Duration;

/// What `kvroute register` needs.
#[derive(Debug, Clone)]
pub struct RegisterConfig {
    /// etcd endpoints.
    pub etcd: Vec<String>,
    /// The key: `PREFIX/workers/<id>`.
    pub key: String,
    /// The value, validated.
    pub record: WorkerRecord,
    /// Lease TTL, seconds (at least 2).
    pub ttl_secs: i64,
    /// Time between two health checks (and lease renewals).
    pub check_interval: Duration,
    /// The worker's health endpoint path, e.g. `/health`.
    pub health_path: String,
}

/// A live registration: the lease and its keep-alive channel.
struct Lease {
    id: i64,
    keeper: etcd_client::LeaseKeeper,
    responses: etcd_client::LeaseKeepAliveStream,
}

/// Registers and renews until `shutdown` resolves, then revokes the lease.
///
/// # Errors
/// None in normal operation (etcd and worker failures are logged and retried); the
/// `Result` carries a bad configuration (an unusable HTTP client).
pub async fn run(cfg: RegisterConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let value = serde_json::to_string(&cfg.record)?;
    let http = reqwest::Client::builder().timeout(cfg.check_interval.max(Duration::from_secs(1))).build()?;
    let health_url = format!("{}{}", cfg.record.url, cfg.health_path);
    let mut client: Option<Client> = None;
    let mut lease: Option<Lease> = None;
    let mut backoff = Duration::from_millis(200);
    tokio::pin!(shutdown);
    loop {
        let healthy = http.get(&health_url).send().await.is_ok_and(|r| r.status().is_success());
        let step = async {
            let c = match &mut client {
                Some(c) => c,
                None => client.insert(Client::connect(&cfg.etcd, Some(super::etcd::options())).await?),
            };
            match (healthy, lease.as_mut()) {
                (true, None) => {
                    let id = c.lease_grant(cfg.ttl_secs, None).await?.id();
                    c.put(cfg.key.as_str(), value.as_str(), Some(PutOptions::new().with_lease(id))).await?;
                    let (keeper, responses) = c.lease_keep_alive(id).await?;
                    lease = Some(Lease { id, keeper, responses });
                    tracing::info!(key = cfg.key, worker = cfg.record.url, lease = id, "registered");
                }
                (true, Some(l)) => {
                    l.keeper.keep_alive().await?;
                    let ttl = l.responses.message().await?.map_or(0, |r| r.ttl());
                    if ttl <= 0 {
                        // The lease expired meanwhile (etcd was away longer than the TTL).
                        tracing::warn!(key = cfg.key, "lease expired: registering again");
                        lease = None;
                    }
                }
                (false, Some(_)) => {
                    tracing::warn!(
                        key = cfg.key,
                        worker = cfg.record.url,
                        "worker unhealthy: letting the lease lapse (deregistered within the TTL)"
                    );
                    lease = None;
                }
                (false, None) => {}
            }
            Ok::<_, etcd_client::Error>(())
        };
        // A bound on the whole step: an etcd that accepts and never answers (a keep-alive
        // response that never comes) must not stop the checks.
        let limit = cfg.check_interval.max(Duration::from_secs(5));
        let result = tokio::time::timeout(limit, step).await.unwrap_or_else(|_| {
            Err(etcd_client::Error::IoError(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer from etcd")))
        });
        let wait = match result {
            Ok(()) => {
                backoff = Duration::from_millis(200);
                cfg.check_interval
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in_secs = backoff.as_secs_f64(), "etcd unavailable");
                client = None;
                lease = None;
                let w = backoff;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                w.min(cfg.check_interval)
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = &mut shutdown => break,
        }
    }
    if let (Some(c), Some(l)) = (client.as_mut(), lease) {
        match tokio::time::timeout(Duration::from_secs(5), c.lease_revoke(l.id)).await {
            Ok(Ok(_)) => tracing::info!(key = cfg.key, "deregistered (lease revoked)"),
            _ => tracing::warn!(key = cfg.key, "could not revoke the lease; it lapses within the TTL"),
        }
    }
    Ok(())
}
