//! The etcd side of cluster mode: list and watch the worker registry and the policy key,
//! apply what changes, and ride out etcd being down.
//!
//! One task per router ([`run`]). A session connects, lists `PREFIX/workers/` and reads the
//! policy key at one revision, reconciles the fleet with the list (adds what is new,
//! updates what changed, removes registered workers that are gone), then watches both
//! from the next revision, so nothing between the list and the watch is missed. When
//! etcd is unreachable or a watch ends, `kvroute_etcd_connected` drops to 0, the router
//! keeps routing on the last known registry and policy (and the static configuration),
//! and the session starts again after a capped exponential backoff (0.1 s to 5 s).
//!
//! With `state_dir`, the registry etcd listed is also kept on disk ([`super::last_known`]):
//! written after each list and change, read when this replica's first session fails, so a
//! replica started during an etcd outage routes to the workers etcd last knew, marked
//! stale until etcd answers and its list replaces them.

use super::last_known;
use crate::app::AppState;
use crate::metrics::PolicyUpdateLabels;
use crate::model::registration::WorkerRecord;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, WatchOptions};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// First wait before reconnecting to etcd; doubled per failed session up to
/// [`BACKOFF_MAX`].
pub const BACKOFF_START: Duration = Duration::from_millis(100);
/// Longest wait between two connection attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Time without a frame from etcd after which the client sends an HTTP/2 ping.
///
/// etcd refuses pings more frequent than its `--grpc-keepalive-min-time` (default 5 s):
/// the third ping that comes sooner than that after the previous one is answered with
/// GOAWAY `too_many_pings` and the connection is closed, so a client pinging every 2 s lost
/// its watches and re-listed the registry every ~8 s. 10 s is twice etcd's default
/// minimum, so scheduling delays on either side never bring two pings within 5 s of each
/// other. Kubernetes' API server keeps its etcd connections alive with 30 s / 10 s; etcd's
/// own Go client sends none unless asked. Pings matter only for an etcd that vanished
/// without closing the socket (a host or network failure): an etcd process that exits
/// closes it, which ends the watch at once.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long an unanswered ping waits before the connection is declared dead; with
/// [`KEEP_ALIVE_INTERVAL`], a silent etcd ends the session within 15 s (a ping's answer
/// comes from etcd's HTTP/2 transport, not from its raft log, so a busy etcd still
/// answers in milliseconds).
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The client's options (the routers' and `kvroute register`'s): bounded connects and
/// calls, and HTTP/2 keep-alives ([`KEEP_ALIVE_INTERVAL`], [`KEEP_ALIVE_TIMEOUT`]) so a dead
/// etcd ends a watch or a lease's keep-alive stream even when nothing changes. Pings are
/// sent only while a stream (a watch, a lease keep-alive) is open: etcd also counts a ping
/// on a connection without streams as abuse (its `PermitWithoutStream` is off), and an idle
/// connection has nothing to lose.
pub(crate) fn options() -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(5))
        .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)
        .with_keep_alive_while_idle(false)
}

/// What this router learnt from etcd: the registered workers by key, and the revision of
/// the last policy value applied.
#[derive(Debug, Default)]
struct Known {
    /// etcd key → the worker's record (its URL normalised).
    workers: HashMap<String, WorkerRecord>,
    policy_revision: i64,
    /// etcd answered a list since the start (before: `workers` is empty, or what
    /// `state_dir` held).
    listed: bool,
    /// `workers` came from `state_dir` and etcd has not answered since.
    stale: bool,
    /// `state_dir` was read (once, at the first failed session).
    cache_tried: bool,
    /// `workers` changed since it was last saved to `state_dir`.
    dirty: bool,
    /// The etcd revision of the last change seen.
    revision: i64,
    /// When `workers` was last saved.
    saved_at: Option<tokio::time::Instant>,
}

/// Follows the registry and the policy key in `state.cfg.etcd` until `cancel`; returns at
/// once when no etcd endpoint is configured.
pub async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    if state.cfg.etcd.is_empty() {
        return;
    }
    let mut known = Known::default();
    let mut backoff = BACKOFF_START;
    loop {
        let started = tokio::time::Instant::now();
        let ended = tokio::select! {
            r = session(&state, &mut known) => r,
            () = cancel.cancelled() => break,
        };
        state.metrics.etcd_connected.set(0);
        if let Err(e) = ended {
            tracing::warn!(
                endpoints = ?state.cfg.etcd,
                error = format!("{e:#}"),
                retry_in_secs = backoff.as_secs_f64(),
                "etcd unavailable: routing on the last known registry and policy"
            );
        }
        if !known.listed && !known.cache_tried {
            known.cache_tried = true;
            tokio::select! {
                () = load_cache(&state, &mut known) => {}
                () = cancel.cancelled() => break,
            }
            state.registry.send_replace(true);
        }
        // A session that ran a while was a working connection: start the backoff afresh.
        if started.elapsed() > BACKOFF_MAX * 2 {
            backoff = BACKOFF_START;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = cancel.cancelled() => break,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    state.metrics.etcd_connected.set(0);
    // A change not written yet (within SAVE_EVERY of the last write); bounded, so shutdown
    // never waits on a slow disk.
    if known.dirty && known.listed {
        let _ = tokio::time::timeout(Duration::from_secs(1), save_cache(&state, &mut known)).await;
    }
}

/// Routes on the registry saved in `state_dir`, if any: etcd did not answer this replica's
/// first session. Its workers are marked stale until etcd's list replaces them.
async fn load_cache(state: &Arc<AppState>, known: &mut Known) {
    let Some(dir) = state.cfg.state_dir.clone() else { return };
    let prefix = state.cfg.etcd_prefix.clone();
    let dir_shown = dir.clone();
    let loaded = tokio::task::spawn_blocking(move || last_known::load(std::path::Path::new(&dir), &prefix)).await;
    let loaded = match loaded {
        Ok(Ok(Some(l))) => l,
        Ok(Ok(None)) => {
            tracing::info!(
                state_dir = dir_shown,
                "no saved etcd registry: routing on the static workers until etcd answers"
            );
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(error = e, "state_dir: the saved etcd registry is not used");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "state_dir: reading the saved etcd registry failed");
            return;
        }
    };
    let n = loaded.workers.len();
    for (key, record) in loaded.workers {
        put_record(state, known, key, record).await;
    }
    for r in known.workers.values() {
        if let Some(w) = state.fleet.by_url(&r.url) {
            w.registration_stale.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    known.stale = true;
    known.dirty = false;
    state.metrics.etcd_registry_stale.set(1);
    tracing::warn!(
        workers = n,
        added = known.workers.len(),
        refused = loaded.refused,
        age_secs = loaded.age_secs,
        "etcd unreachable at startup: routing on the last known registry from state_dir (stale until etcd answers)"
    );
}

/// Writes the registry to `state_dir` (when set); a failure is logged, and the next change
/// tries again.
async fn save_cache(state: &Arc<AppState>, known: &mut Known) {
    known.dirty = false;
    known.saved_at = Some(tokio::time::Instant::now());
    let Some(dir) = state.cfg.state_dir.clone() else { return };
    let prefix = state.cfg.etcd_prefix.clone();
    let workers = known.workers.clone();
    let revision = known.revision;
    let n = workers.len();
    let saved =
        tokio::task::spawn_blocking(move || last_known::save(std::path::Path::new(&dir), &prefix, revision, &workers))
            .await;
    match saved {
        Ok(Ok(())) => tracing::debug!(workers = n, revision, "etcd registry saved to state_dir"),
        Ok(Err(e)) => tracing::warn!(error = format!("{e:#}"), "state_dir: the etcd registry was not saved"),
        Err(e) => tracing::warn!(error = %e, "state_dir: saving the etcd registry failed"),
    }
}

/// One connection: list, reconcile, watch. Returns only with an error (etcd gone, a watch
/// cancelled or compacted).
async fn session(state: &Arc<AppState>, known: &mut Known) -> anyhow::Result<()> {
    let workers_prefix = format!("{}/workers/", state.cfg.etcd_prefix);
    let policy_key = state.cfg.policy_key();
    let mut client = Client::connect(&state.cfg.etcd, Some(options())).await?;
    let listed = client.get(workers_prefix.as_str(), Some(GetOptions::new().with_prefix())).await?;
    let revision = listed.header().map_or(0, |h| h.revision());
    let mut now_registered = HashMap::new();
    for kv in listed.kvs().iter().take(crate::model::worker_url::MAX_WORKERS) {
        now_registered.insert(String::from_utf8_lossy(kv.key()).into_owned(), kv.value().to_vec());
    }
    reconcile(state, known, now_registered).await;
    known.listed = true;
    state.registry.send_replace(true);
    known.revision = revision;
    // Saved at once (the loop below writes what is dirty when due).
    known.dirty = true;
    if known.stale {
        known.stale = false;
        for w in state.fleet.load().iter() {
            w.registration_stale.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        state.metrics.etcd_registry_stale.set(0);
        tracing::info!(workers = known.workers.len(), "etcd answered: its list replaced the registry from state_dir");
    }
    let policy = client.get(policy_key.as_str(), None).await?;
    if let Some(kv) = policy.kvs().first() {
        apply_policy(state, known, kv.value(), kv.mod_revision());
    }
    let from = WatchOptions::new().with_start_revision(revision + 1);
    let mut workers = client.watch(workers_prefix.as_str(), Some(from.clone().with_prefix())).await?;
    let mut policy_watch = client.watch(policy_key.as_str(), Some(from)).await?;
    state.metrics.etcd_connected.set(1);
    state.metrics.etcd_connects.inc();
    tracing::info!(endpoints = ?state.cfg.etcd, workers = known.workers.len(), revision, "etcd connected");
    loop {
        let save_due = known.dirty && state.cfg.state_dir.is_some();
        let save_at = known.saved_at.map_or_else(tokio::time::Instant::now, |t| t + last_known::SAVE_EVERY);
        tokio::select! {
            () = tokio::time::sleep_until(save_at), if save_due => save_cache(state, known).await,
            m = workers.message() => {
                let resp = m?.ok_or_else(|| anyhow::anyhow!("the worker watch ended"))?;
                if resp.canceled() {
                    anyhow::bail!("the worker watch was cancelled: {}", resp.cancel_reason());
                }
                if let Some(h) = resp.header() {
                    known.revision = known.revision.max(h.revision());
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    match ev.event_type() {
                        EventType::Put => put_worker(state, known, key, kv.value()).await,
                        EventType::Delete => delete_worker(state, known, &key),
                    }
                }
            }
            m = policy_watch.message() => {
                let resp = m?.ok_or_else(|| anyhow::anyhow!("the policy watch ended"))?;
                if resp.canceled() {
                    anyhow::bail!("the policy watch was cancelled: {}", resp.cancel_reason());
                }
                for ev in resp.events() {
                    if let (EventType::Put, Some(kv)) = (ev.event_type(), ev.kv()) {
                        apply_policy(state, known, kv.value(), kv.mod_revision());
                    }
                }
            }
        }
    }
}

/// Makes the fleet's registered workers those of `listed` (key → value).
async fn reconcile(state: &Arc<AppState>, known: &mut Known, listed: HashMap<String, Vec<u8>>) {
    let gone: Vec<String> = known.workers.keys().filter(|k| !listed.contains_key(*k)).cloned().collect();
    for k in gone {
        delete_worker(state, known, &k);
    }
    for (k, v) in listed {
        put_worker(state, known, k, &v).await;
    }
}

/// A worker key was written: add or update the worker (an invalid record is logged and
/// changes nothing).
async fn put_worker(state: &Arc<AppState>, known: &mut Known, key: String, value: &[u8]) {
    match WorkerRecord::parse(value) {
        Ok(r) => put_record(state, known, key, r).await,
        Err(e) => tracing::warn!(key, error = %e, "etcd: ignoring an invalid worker record"),
    }
}

/// Adds or updates the worker of a valid record registered at `key`.
async fn put_record(state: &Arc<AppState>, known: &mut Known, key: String, record: WorkerRecord) {
    let url = record.url.clone();
    if let Some(old) = known.workers.get(&key)
        && old.url != url
    {
        // The key now names another worker: the old one leaves unless another key holds it.
        let old = old.url.clone();
        known.workers.remove(&key);
        known.dirty = true;
        release(state, known, &old);
    }
    match state.add_registered_worker(record.clone()).await {
        Ok(()) => match known.workers.insert(key.clone(), record) {
            None => {
                known.dirty = true;
                tracing::info!(key, worker = url, "etcd: worker registered");
            }
            Some(old) => known.dirty |= known.workers.get(&key) != Some(&old),
        },
        Err(e) => tracing::warn!(key, worker = url, error = %e, "etcd: worker not added"),
    }
    state.metrics.etcd_workers.set(known.workers.len() as i64);
}

/// A worker key was deleted or its lease expired.
fn delete_worker(state: &AppState, known: &mut Known, key: &str) {
    if let Some(r) = known.workers.remove(key) {
        known.dirty = true;
        tracing::info!(key, worker = r.url, "etcd: worker deregistered");
        release(state, known, &r.url);
    }
    state.metrics.etcd_workers.set(known.workers.len() as i64);
}

/// Removes the worker at `url` unless another key still registers it or it is one of the
/// static workers (`worker_urls`, as last loaded); a static worker that stays loses its
/// registration, so a reload dropping it from `worker_urls` removes it.
fn release(state: &AppState, known: &Known, url: &str) {
    if known.workers.values().any(|r| r.url == url) {
        return;
    }
    if !state.static_workers.load().iter().any(|u| u == url) {
        state.remove_worker(url);
    } else if let Some(w) = state.fleet.by_url(url) {
        w.registration.store(None);
        w.set_capacity(crate::fleet::CapacitySource::Registry, None);
    }
}

/// Applies the policy key's value written at `revision` (once per revision).
fn apply_policy(state: &AppState, known: &mut Known, value: &[u8], revision: i64) {
    if revision != 0 && revision == known.policy_revision {
        return;
    }
    known.policy_revision = revision;
    let result = if value.len() > super::MAX_VALUE_BYTES {
        Err(format!("value of {} bytes (at most {})", value.len(), super::MAX_VALUE_BYTES))
    } else {
        serde_json::from_slice::<serde_json::Value>(value).map_err(|e| format!("not JSON: {e}")).and_then(|v| {
            crate::policy_control::apply(state, &v, crate::policy_control::Form::Cognitora)
                .map_err(|(field, e)| format!("{field}: {e}"))
        })
    };
    let outcome = match result {
        Ok(knobs) => {
            tracing::info!(policy = state.routers.policy_name(), %knobs, revision, "etcd: policy applied");
            "applied"
        }
        Err(e) => {
            tracing::error!(error = e, revision, "etcd: policy value refused; the last good policy stays");
            "rejected"
        }
    };
    state
        .metrics
        .policy_updates
        .get_or_create(&PolicyUpdateLabels { source: "etcd".into(), outcome: outcome.into() })
        .inc();
}
