//! Replica sync over NATS: the router replicas of one cluster share what each routed, so a
//! request sees the whole cluster's prefix state and in-flight load whichever replica it
//! lands on (`nats`, `cluster`).
//!
//! ```text
//! request path ──try_send──► queue (65,536) ──► publisher: batches ≤ 1,024 events / 5 ms
//!                                                  └─► kvroute.<cluster>.events  (msgpack)
//! kvroute.<cluster>.events ──► subscriber: skip own, count gaps, apply:
//!      routed     → the model's router commits it (prefix index, sessions) when it runs
//!                   the same policy; a remote load ticket opens on the worker
//!      first token→ the ticket's prefill part settles
//!      done       → the ticket closes
//! kvroute.<cluster>.snapshot (queue group) ◄── a starting replica's request; one peer
//!      answers with its recent routed events in chunks; ready when they are applied or
//!      `sync_snapshot_timeout_secs` passes
//! ```
//!
//! The request path only builds an event and `try_send`s it to a bounded queue: a full
//! queue, or NATS down, drops events (counted, `kvroute_sync_events_total{outcome=
//! "dropped"}`) and never delays or fails a request. Every batch carries the replica id
//! and a sequence number; a receiver counts the batches it never saw
//! (`kvroute_sync_gaps_total`). Remote load tickets close on their `done` event, when
//! their replica falls silent for [`PEER_SILENCE`], or [`TICKET_GRACE`] after
//! `request_timeout_secs`, so a replica that dies leaves no load behind.
//!
//! Dynamo's router replica sync (`--router-replica-sync`, NATS) and SMG's tree gossip
//! solve the same problem; Ray Serve's PrefixCacheAffinityRouter shares one tree actor.
//! Workers that publish KV events need no prefix sync (every replica subscribes to the
//! engines), but their load is shared all the same.

use crate::pipeline::route::Routed;
use crate::state::AppState;
use bytes::Bytes;
use futures_util::StreamExt;
use kvroute_core::ledger::LoadTicket;
use kvroute_core::policy::RequestKey;
use kvroute_core::types::{BlockHash, BlockSeq, RequestView, Role, WorkerId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Events waiting to be published; beyond this the request path drops them.
pub const QUEUE: usize = 65_536;
/// Most events in one published batch.
pub const MAX_BATCH_EVENTS: usize = 1024;
/// How long the publisher gathers events after the first of a batch.
pub const BATCH_WINDOW: Duration = Duration::from_millis(5);
/// A replica with nothing to send still publishes an empty batch this often (liveness).
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A replica not heard from for this long is gone: its remote load tickets close.
pub const PEER_SILENCE: Duration = Duration::from_secs(10);
/// A remote load ticket closes this long after `request_timeout_secs` even without its
/// `done` event (lost, or its replica restarted under the same id).
pub const TICKET_GRACE: Duration = Duration::from_secs(10);
/// Most remote load tickets held at once (over every peer).
pub const MAX_REMOTE_TICKETS: usize = 65_536;
/// Most peers tracked.
pub const MAX_PEERS: usize = 256;
/// Longest prompt text an event carries, bytes (a longer prompt's first bytes: the other
/// replicas learn that the worker holds at least that prefix).
pub const MAX_EVENT_TEXT: usize = 128 << 10;
/// Most token ids an event carries.
pub const MAX_EVENT_TOKENS: usize = 32_768;
/// Most block hashes an event carries (per list).
pub const MAX_EVENT_BLOCKS: usize = 8_192;
/// Most routed events kept for snapshots.
pub const SNAPSHOT_MAX_EVENTS: usize = 100_000;
/// Most bytes of routed events kept for snapshots (estimated).
pub const SNAPSHOT_MAX_BYTES: usize = 64 << 20;
/// Largest message this replica publishes, bytes, unless the server allows less (NATS's
/// default `max_payload` is 1 MiB).
pub const MAX_MESSAGE: usize = 512 << 10;

/// The request's prefix key as [`kvroute_core::policy::util::PrefixKey`] reads it: the
/// text when there is one, else the token ids, else the precomputed blocks.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum WirePrefix {
    /// No prefix key (load-only policies).
    None,
    /// Prompt text (at most [`MAX_EVENT_TEXT`] bytes, cut at a character boundary).
    Text(String),
    /// Prompt token ids (at most [`MAX_EVENT_TOKENS`]).
    Tokens(Vec<u32>),
    /// Precomputed chained block hashes and their tokens per block.
    Blocks(Vec<u64>, u32),
}

/// One request sent to a worker by some replica.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RoutedEvent {
    /// The sending replica's number for this dispatch (its later events name it).
    pub id: u64,
    /// The model the request was routed under (its router's key).
    pub model: String,
    /// The worker's base URL (ids differ between replicas; URLs do not).
    pub worker: String,
    /// The policy that decided (a receiver running another policy applies only the load).
    pub policy: String,
    /// The prefix key.
    pub prefix: WirePrefix,
    /// The policy's block hashes of the request ([`RequestKey::blocks`]).
    pub blocks: Vec<u64>,
    /// Tokens per block of `blocks`.
    pub block_tokens: u64,
    /// Session id, when the request had one.
    pub session: Option<String>,
    /// Prompt tokens (exact or estimated).
    pub input_tokens: u32,
    /// Expected output tokens, when known.
    pub output_tokens: Option<u32>,
    /// Uncached prompt tokens the worker must prefill (the sender's estimate).
    pub uncached: u64,
    /// Tokens the request weighs once decoding.
    pub decode: u64,
    /// The router set that decided: 0 the main one, 1 a disaggregated fleet's prefill pool,
    /// 2 its decode pool ([`Pool`]). Absent in events of older replicas (= 0).
    #[serde(default)]
    pub pool: u8,
}

/// Which of a replica's router sets decided a routed event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// The main routers (colocated requests).
    Main = 0,
    /// The prefill pool of a disaggregated fleet.
    Prefill = 1,
    /// The decode pool of a disaggregated fleet.
    Decode = 2,
}

impl RoutedEvent {
    fn size_estimate(&self) -> usize {
        let prefix = match &self.prefix {
            WirePrefix::None => 0,
            WirePrefix::Text(t) => t.len(),
            WirePrefix::Tokens(t) => t.len() * 5,
            WirePrefix::Blocks(b, _) => b.len() * 9,
        };
        200 + self.model.len() + self.worker.len() + prefix + self.blocks.len() * 9
    }
}

/// One event on the wire.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum WireEvent {
    /// A dispatch.
    Routed(RoutedEvent),
    /// The first token of dispatch `id` came back (prefill over).
    FirstToken(u64),
    /// Dispatch `id` ended (completed, failed or cancelled).
    Done(u64),
}

/// A published batch (msgpack, `kvroute.<cluster>.events`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Batch {
    /// The sending replica.
    pub replica: String,
    /// Its batch number, from 0 at its start, +1 per batch.
    pub seq: u64,
    /// When it was published, ns since the Unix epoch (for the lag histogram).
    pub sent_unix_ns: u64,
    /// The events in order.
    pub events: Vec<WireEvent>,
}

/// One part of a snapshot answer (msgpack, to the requester's inbox).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotChunk {
    /// The answering replica.
    pub replica: String,
    /// Part number from 0.
    pub part: u32,
    /// Whether this is the last part.
    pub last: bool,
    /// Routed events, oldest first.
    pub events: Vec<RoutedEvent>,
}

#[derive(Debug)]
enum Out {
    Routed(Box<RoutedEvent>),
    FirstToken(u64),
    Done(u64),
}

/// Recent routed events (this replica's and the ones it applied), the source of snapshots.
#[derive(Debug, Default)]
struct Recent {
    events: VecDeque<Arc<RoutedEvent>>,
    bytes: usize,
}

impl Recent {
    fn push(&mut self, e: Arc<RoutedEvent>) {
        self.bytes += e.size_estimate();
        self.events.push_back(e);
        while self.events.len() > SNAPSHOT_MAX_EVENTS || self.bytes > SNAPSHOT_MAX_BYTES {
            match self.events.pop_front() {
                Some(old) => self.bytes -= old.size_estimate(),
                None => break,
            }
        }
    }
}

/// This replica's side of the cluster sync.
#[derive(Debug)]
pub struct ReplicaSync {
    /// This replica's id.
    pub replica: String,
    events_subject: String,
    snapshot_subject: String,
    tx: mpsc::Sender<Out>,
    rx: Mutex<Option<mpsc::Receiver<Out>>>,
    next_id: AtomicU64,
    ready: AtomicBool,
    recent: Mutex<Recent>,
    outcomes: prometheus_client::metrics::family::Family<
        crate::metrics::OutcomeLabel,
        prometheus_client::metrics::counter::Counter,
    >,
}

/// A dispatch's sync handle: sends `first token` once and `done` when dropped.
#[derive(Debug)]
pub struct SharedTicket {
    sync: Arc<ReplicaSync>,
    id: u64,
    first: bool,
}

impl SharedTicket {
    /// The first token came back.
    pub fn first_token(&mut self) {
        if !self.first {
            self.first = true;
            self.sync.send(Out::FirstToken(self.id));
        }
    }
}

impl Drop for SharedTicket {
    fn drop(&mut self) {
        self.sync.send(Out::Done(self.id));
    }
}

fn cut_text(t: &str) -> String {
    t[..t.floor_char_boundary(MAX_EVENT_TEXT)].to_string()
}

impl ReplicaSync {
    /// The sync of a replica named `replica` (a random id when `None`) in `cluster`; it
    /// sends nothing until [`run`] connects it.
    pub fn new(cluster: &str, replica: Option<&str>, metrics: &crate::metrics::Metrics) -> Arc<Self> {
        let replica = replica.map_or_else(random_id, str::to_string);
        let (tx, rx) = mpsc::channel(QUEUE);
        for outcome in ["published", "dropped", "applied"] {
            drop(metrics.sync_events.get_or_create(&crate::metrics::OutcomeLabel { outcome: outcome.into() }));
        }
        Arc::new(ReplicaSync {
            replica,
            events_subject: format!("kvroute.{cluster}.events"),
            snapshot_subject: format!("kvroute.{cluster}.snapshot"),
            tx,
            rx: Mutex::new(Some(rx)),
            next_id: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            recent: Mutex::default(),
            outcomes: metrics.sync_events.clone(),
        })
    }

    /// Whether the start-up snapshot was applied (or its wait ended).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Relaxed)
    }

    fn send(&self, e: Out) {
        if self.tx.try_send(e).is_err() {
            self.count("dropped", 1);
        }
    }

    fn count(&self, outcome: &str, n: u64) {
        self.outcomes.get_or_create(&crate::metrics::OutcomeLabel { outcome: outcome.into() }).inc_by(n);
    }

    /// Announces that `req` (decided by `routed`) was sent to `worker` with `uncached`
    /// prompt tokens to prefill and `decode` tokens to decode. Never blocks: a full queue
    /// drops the event.
    pub fn routed(
        self: &Arc<Self>,
        routed: &Routed,
        req: &RequestView<'_>,
        worker_url: &str,
        uncached: u64,
        decode: u64,
    ) -> SharedTicket {
        self.routed_in(Pool::Main, routed, req, worker_url, uncached, decode)
    }

    /// [`ReplicaSync::routed`] for a decision of `pool`'s routers.
    pub fn routed_in(
        self: &Arc<Self>,
        pool: Pool,
        routed: &Routed,
        req: &RequestView<'_>,
        worker_url: &str,
        uncached: u64,
        decode: u64,
    ) -> SharedTicket {
        let id = self.next_id.fetch_add(1, Relaxed);
        // Only a policy that indexes the prompt itself needs it; the others record the key's
        // block hashes (`blocks`), 9 bytes per block instead of the prompt's bytes.
        let prefix = if !routed.router.records_request_prefix {
            WirePrefix::None
        } else if let Some(t) = req.text.filter(|t| !t.is_empty()) {
            WirePrefix::Text(cut_text(t))
        } else if let Some(t) = req.token_ids.filter(|t| !t.is_empty()) {
            WirePrefix::Tokens(t[..t.len().min(MAX_EVENT_TOKENS)].to_vec())
        } else if let Some(b) = req.blocks.filter(|b| !b.hashes.is_empty()) {
            WirePrefix::Blocks(b.hashes.iter().take(MAX_EVENT_BLOCKS).map(|h| h.0).collect(), b.block_tokens)
        } else {
            WirePrefix::None
        };
        let ev = RoutedEvent {
            id,
            model: req.model.to_string(),
            worker: worker_url.to_string(),
            policy: routed.router.policy_name.to_string(),
            prefix,
            blocks: routed.key.blocks.iter().take(MAX_EVENT_BLOCKS).map(|h| h.0).collect(),
            block_tokens: routed.key.block_tokens,
            session: req.session_id.map(str::to_string),
            input_tokens: req.input_tokens,
            output_tokens: req.output_tokens,
            uncached,
            decode,
            pool: pool as u8,
        };
        self.send(Out::Routed(Box::new(ev)));
        SharedTicket { sync: Arc::clone(self), id, first: false }
    }
}

fn random_id() -> String {
    format!("r{:016x}", crate::state::os_random_u64())
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Runs the sync until `cancel`: connects to `nats` (retrying in the background when it is
/// down), asks a peer for a snapshot, then publishes this replica's events and applies the
/// others'. Returns at once when the router has no `nats`.
pub async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let (Some(url), Some(sync)) = (state.cfg.nats.clone(), state.sync.clone()) else { return };
    let Some(rx) = sync.rx.lock().take() else { return };
    let gauge = state.metrics.nats_connected.clone();
    let timeout = Duration::from_secs_f64(state.cfg.connect_timeout_secs.max(0.5));
    let connected = async_nats::ConnectOptions::new()
        .name(format!("kvroute {}", sync.replica))
        .connection_timeout(timeout)
        .retry_on_initial_connect()
        // The server does not send a replica its own batches back (it would skip them).
        .no_echo()
        .max_reconnects(None)
        .reconnect_delay_callback(|n| match n {
            // The first attempt at once (as async-nats's default), then 100 ms doubling to 2 s.
            0 | 1 => Duration::ZERO,
            n => Duration::from_millis((100u64 << (n - 2).min(5)).min(2_000)),
        })
        .event_callback(move |e| {
            let gauge = gauge.clone();
            async move {
                match e {
                    async_nats::Event::Connected => {
                        gauge.set(1);
                        tracing::info!("NATS connected (cluster sync)");
                    }
                    async_nats::Event::Disconnected | async_nats::Event::Closed => {
                        gauge.set(0);
                        tracing::warn!("NATS disconnected (cluster sync): routing on local state, reconnecting");
                    }
                    other => tracing::debug!(event = %other, "NATS"),
                }
            }
        })
        .connect(url.as_str())
        .await;
    let client = match connected {
        Ok(c) => c,
        Err(e) => {
            // Only a bad address gets here (connection failures are retried in the
            // background); route on local state.
            let shown = url::Url::parse(&url).map_or_else(
                |_| "(unparsable)".to_string(),
                |u| format!("{}://{}:{}", u.scheme(), u.host_str().unwrap_or(""), u.port().unwrap_or(4222)),
            );
            tracing::error!(error = %e, nats = %shown, "cluster sync disabled: cannot use the NATS address");
            sync.ready.store(true, Relaxed);
            return;
        }
    };
    let events = match client.subscribe(sync.events_subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cluster sync disabled: cannot subscribe");
            sync.ready.store(true, Relaxed);
            return;
        }
    };
    let publisher = tokio::spawn(publish(Arc::clone(&sync), client.clone(), rx, cancel.clone()));
    let wait = Duration::from_secs_f64(state.cfg.sync_snapshot_timeout_secs);
    tokio::select! {
        () = cancel.cancelled() => {}
        () = fetch_snapshot(&state, &sync, &client, wait) => {}
    }
    sync.ready.store(true, Relaxed);
    let responder = tokio::spawn(answer_snapshots(Arc::clone(&sync), client.clone(), cancel.clone()));
    apply_events(&state, &sync, events, cancel).await;
    let _ = publisher.await;
    let _ = responder.await;
    // Bounded: with the server down a flush waits for a reconnect that may never come.
    let _ = tokio::time::timeout(Duration::from_secs(1), client.flush()).await;
}

fn max_message(client: &async_nats::Client) -> usize {
    match client.server_info().max_payload {
        0 => MAX_MESSAGE,
        n => n.min(MAX_MESSAGE),
    }
}

/// The publisher: batches the queue's events and publishes them, with a heartbeat when
/// idle. A batch NATS does not take within a second is dropped (counted).
async fn publish(
    sync: Arc<ReplicaSync>,
    client: async_nats::Client,
    mut rx: mpsc::Receiver<Out>,
    cancel: CancellationToken,
) {
    let mut seq = 0u64;
    let mut buf: Vec<Out> = Vec::with_capacity(MAX_BATCH_EVENTS);
    loop {
        let first = tokio::select! {
            () = cancel.cancelled() => break,
            e = rx.recv() => e,
            () = tokio::time::sleep(HEARTBEAT) => None,
        };
        if let Some(e) = first {
            buf.push(e);
            tokio::time::sleep(BATCH_WINDOW).await;
            while buf.len() < MAX_BATCH_EVENTS {
                match rx.try_recv() {
                    Ok(e) => buf.push(e),
                    Err(_) => break,
                }
            }
        }
        let limit = max_message(&client);
        let mut events = Vec::with_capacity(buf.len());
        let mut size = 64;
        for e in buf.drain(..) {
            let ev = match e {
                Out::Routed(r) => {
                    sync.recent.lock().push(Arc::new((*r).clone()));
                    WireEvent::Routed(*r)
                }
                Out::FirstToken(id) => WireEvent::FirstToken(id),
                Out::Done(id) => WireEvent::Done(id),
            };
            let n = match &ev {
                WireEvent::Routed(r) => r.size_estimate(),
                _ => 16,
            };
            if size + n > limit / 2 && !events.is_empty() {
                send_batch(&sync, &client, &mut seq, std::mem::take(&mut events)).await;
                size = 64;
            }
            size += n;
            events.push(ev);
        }
        send_batch(&sync, &client, &mut seq, events).await;
    }
}

async fn send_batch(sync: &ReplicaSync, client: &async_nats::Client, seq: &mut u64, events: Vec<WireEvent>) {
    let n = events.len() as u64;
    let batch = Batch { replica: sync.replica.clone(), seq: *seq, sent_unix_ns: unix_ns(), events };
    *seq += 1;
    let payload = match rmp_serde::to_vec_named(&batch) {
        Ok(p) => Bytes::from(p),
        Err(e) => {
            tracing::error!(error = %e, "cannot encode a sync batch");
            sync.count("dropped", n);
            return;
        }
    };
    let sent = tokio::time::timeout(Duration::from_secs(1), client.publish(sync.events_subject.clone(), payload)).await;
    match sent {
        Ok(Ok(())) => sync.count("published", n),
        _ => {
            sync.count("dropped", n);
            tracing::debug!(events = n, "sync batch not published (NATS down or slow)");
        }
    }
}

/// What this replica knows of one other replica.
#[derive(Debug)]
struct Peer {
    last_seq: u64,
    heard: Instant,
    tickets: HashMap<u64, (LoadTicket, Instant)>,
}

/// The subscriber: applies the other replicas' batches; sweeps gone peers and stale
/// tickets once a second.
async fn apply_events(
    state: &Arc<AppState>,
    sync: &ReplicaSync,
    mut events: async_nats::Subscriber,
    cancel: CancellationToken,
) {
    let mut peers: HashMap<String, Peer> = HashMap::new();
    let mut tickets = 0usize;
    let ttl = Duration::from_secs_f64(state.cfg.request_timeout_secs) + TICKET_GRACE;
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = events.next() => match m { Some(m) => m, None => break },
            _ = sweep.tick() => {
                let now = Instant::now();
                peers.retain(|name, p| {
                    let alive = now.duration_since(p.heard) < PEER_SILENCE;
                    if !alive {
                        tracing::info!(replica = %name, "cluster peer silent: its in-flight load is released");
                    }
                    alive
                });
                for p in peers.values_mut() {
                    p.tickets.retain(|_, (_, deadline)| *deadline > now);
                }
                tickets = peers.values().map(|p| p.tickets.len()).sum();
                state.metrics.sync_remote_in_flight.set(tickets as i64);
                state.metrics.sync_peers.set(peers.len() as i64);
                continue;
            }
        };
        let batch: Batch = match rmp_serde::from_slice(&msg.payload) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %e, "undecodable sync batch ignored");
                continue;
            }
        };
        if batch.replica == sync.replica {
            continue;
        }
        let lag = unix_ns().saturating_sub(batch.sent_unix_ns) as f64 / 1e9;
        state.metrics.sync_lag_seconds.observe(lag);
        let now = Instant::now();
        if !peers.contains_key(&batch.replica) && peers.len() >= MAX_PEERS {
            continue;
        }
        let peer = peers.entry(batch.replica.clone()).or_insert_with(|| {
            tracing::info!(replica = %batch.replica, "cluster peer joined");
            Peer { last_seq: batch.seq, heard: now, tickets: HashMap::new() }
        });
        if batch.seq > peer.last_seq + 1 {
            state.metrics.sync_gaps.inc_by(batch.seq - peer.last_seq - 1);
        } else if batch.seq < peer.last_seq {
            // The replica restarted under the same id: what it had in flight is gone.
            tickets -= peer.tickets.len();
            peer.tickets.clear();
        }
        peer.last_seq = batch.seq;
        peer.heard = now;
        for ev in batch.events {
            match ev {
                WireEvent::Routed(r) => {
                    let Some(w) = state.fleet.by_url(&r.worker) else {
                        sync.count("unknown_worker", 1);
                        continue;
                    };
                    if tickets < MAX_REMOTE_TICKETS {
                        let t = w.remote_load.dispatched(r.uncached, r.decode);
                        if peer.tickets.insert(r.id, (t, now + ttl)).is_none() {
                            tickets += 1;
                        }
                    }
                    let outcome =
                        if commit(state, &r, w.id, Wait::Yield).await { "applied" } else { "policy_mismatch" };
                    sync.count(outcome, 1);
                    sync.recent.lock().push(Arc::new(r));
                }
                WireEvent::FirstToken(id) => {
                    if let Some((t, _)) = peer.tickets.get_mut(&id) {
                        t.first_token();
                    }
                }
                WireEvent::Done(id) => {
                    if peer.tickets.remove(&id).is_some() {
                        tickets -= 1;
                    }
                }
            }
        }
        state.metrics.sync_remote_in_flight.set(tickets as i64);
    }
}

/// How [`commit`] takes the router's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Take it when free, yielding to the runtime between tries ([`COMMIT_TRIES`], then
    /// wait for it): live events never queue ahead of this replica's own decisions.
    Yield,
    /// Wait for it (the start-up snapshot, before the replica is ready).
    Block,
}

/// Tries of a live event's commit before it waits for the lock like a local commit.
const COMMIT_TRIES: usize = 64;

/// Commits another replica's routed request to this replica's router of its model when it
/// runs the same policy; `false` when it does not (the event's keys would not match).
async fn commit(state: &AppState, r: &RoutedEvent, worker: WorkerId, wait: Wait) -> bool {
    let now = state.now();
    let routers = match (r.pool, &state.pd) {
        (0, _) => &state.routers,
        (1, Some(pd)) => &pd.prefill,
        (2, Some(pd)) => &pd.decode,
        // A pool this replica does not have: the load applies, the prefix does not.
        _ => return false,
    };
    let router = routers.get(&r.model, now);
    if *router.policy_name != *r.policy {
        return false;
    }
    let hashes: Vec<BlockHash>;
    let mut view = RequestView {
        model: &r.model,
        text: None,
        token_ids: None,
        blocks: None,
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        session_id: r.session.as_deref(),
        role: Role::Both,
    };
    match &r.prefix {
        WirePrefix::None => {}
        WirePrefix::Text(t) => view.text = Some(t),
        WirePrefix::Tokens(t) => view.token_ids = Some(t),
        WirePrefix::Blocks(b, bs) => {
            hashes = b.iter().map(|&h| BlockHash(h)).collect();
            view.blocks = Some(BlockSeq { block_tokens: *bs, hashes: &hashes });
        }
    }
    let key = RequestKey {
        blocks: r.blocks.iter().map(|&h| BlockHash(h)).collect(),
        block_tokens: r.block_tokens,
        worker_kv_tokens: state.fleet.by_id(worker).and_then(|w| w.core_capacity().kv_tokens),
    };
    if wait == Wait::Yield {
        for _ in 0..COMMIT_TRIES {
            if router.try_commit(&view, &key, worker, now) {
                return true;
            }
            tokio::task::yield_now().await;
        }
    }
    router.commit(&view, &key, worker, now);
    true
}

/// Asks the cluster for a snapshot and applies the first answering replica's events (the
/// prefix part only: their requests are over). Returns when the last chunk is in, no
/// replica answers, or `wait` passes.
async fn fetch_snapshot(state: &AppState, sync: &ReplicaSync, client: &async_nats::Client, wait: Duration) {
    if wait.is_zero() {
        return;
    }
    let started = Instant::now();
    let inbox = client.new_inbox();
    let Ok(mut sub) = client.subscribe(inbox.clone()).await else { return };
    let ask = client.publish_with_reply(sync.snapshot_subject.clone(), inbox, Bytes::from(sync.replica.clone()));
    if !matches!(tokio::time::timeout(wait, ask).await, Ok(Ok(()))) {
        tracing::info!("no snapshot: NATS is not reachable; routing on local state");
        return;
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut from: Option<String> = None;
    let (mut applied, mut next_part) = (0u64, 0u32);
    loop {
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(m)) => m,
            Ok(None) | Err(_) => {
                tracing::info!(events = applied, "snapshot wait ended before the last part; routing on what arrived");
                break;
            }
        };
        if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            tracing::info!("no other replica in the cluster yet: starting with an empty index");
            break;
        }
        let Ok(chunk) = rmp_serde::from_slice::<SnapshotChunk>(&msg.payload) else { continue };
        if from.get_or_insert_with(|| chunk.replica.clone()) != &chunk.replica || chunk.part != next_part {
            continue;
        }
        next_part += 1;
        for r in chunk.events {
            if let Some(w) = state.fleet.by_url(&r.worker) {
                commit(state, &r, w.id, Wait::Block).await;
                applied += 1;
                sync.recent.lock().push(Arc::new(r));
            }
        }
        if chunk.last {
            tracing::info!(
                events = applied,
                from = from.as_deref().unwrap_or("?"),
                secs = started.elapsed().as_secs_f64(),
                "snapshot applied"
            );
            break;
        }
    }
    sync.count("snapshot", applied);
    let _ = sub.unsubscribe().await;
}

/// Answers snapshot requests (one replica of the queue group answers each): the recent
/// routed events in chunks that fit a NATS message.
async fn answer_snapshots(sync: Arc<ReplicaSync>, client: async_nats::Client, cancel: CancellationToken) {
    let Ok(mut requests) = client.queue_subscribe(sync.snapshot_subject.clone(), "snapshot".into()).await else {
        tracing::error!("cannot answer snapshot requests: subscribe failed");
        return;
    };
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = requests.next() => match m { Some(m) => m, None => break },
        };
        let Some(reply) = msg.reply else { continue };
        let events: Vec<Arc<RoutedEvent>> = sync.recent.lock().events.iter().cloned().collect();
        let limit = max_message(&client) / 2;
        let mut part = 0u32;
        let mut chunk: Vec<RoutedEvent> = Vec::new();
        let mut size = 64;
        let total = events.len();
        for (i, e) in events.into_iter().enumerate() {
            size += e.size_estimate();
            chunk.push(e.as_ref().clone());
            let last = i + 1 == total;
            if size > limit || last {
                let c = SnapshotChunk { replica: sync.replica.clone(), part, last, events: std::mem::take(&mut chunk) };
                part += 1;
                size = 64;
                if !publish_chunk(&client, &reply, &c).await {
                    break;
                }
            }
        }
        if total == 0 {
            let c = SnapshotChunk { replica: sync.replica.clone(), part: 0, last: true, events: Vec::new() };
            publish_chunk(&client, &reply, &c).await;
        }
        tracing::info!(events = total, parts = part.max(1), "snapshot sent to a starting replica");
    }
}

async fn publish_chunk(client: &async_nats::Client, reply: &async_nats::Subject, c: &SnapshotChunk) -> bool {
    let Ok(payload) = rmp_serde::to_vec_named(c) else { return false };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), client.publish(reply.clone(), Bytes::from(payload))).await,
        Ok(Ok(()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_round_trips_through_msgpack() {
        let b = Batch {
            replica: "r1".into(),
            seq: 7,
            sent_unix_ns: 1,
            events: vec![
                WireEvent::Routed(RoutedEvent {
                    id: 3,
                    model: "m".into(),
                    worker: "http://127.0.0.1:1".into(),
                    policy: "cache_aware".into(),
                    prefix: WirePrefix::Text("héllo".into()),
                    blocks: vec![1, 2],
                    block_tokens: 16,
                    session: Some("s".into()),
                    input_tokens: 2,
                    output_tokens: None,
                    uncached: 2,
                    decode: 258,
                    pool: 1,
                }),
                WireEvent::FirstToken(3),
                WireEvent::Done(3),
            ],
        };
        let bytes = rmp_serde::to_vec_named(&b).expect("encode");
        assert_eq!(rmp_serde::from_slice::<Batch>(&bytes).expect("decode"), b);
    }

    #[test]
    fn an_older_replicas_routed_event_without_a_pool_decodes_as_the_main_pool() {
        // The event as replicas before the `pool` field encoded it.
        #[derive(Serialize)]
        struct Older {
            id: u64,
            model: String,
            worker: String,
            policy: String,
            prefix: WirePrefix,
            blocks: Vec<u64>,
            block_tokens: u64,
            session: Option<String>,
            input_tokens: u32,
            output_tokens: Option<u32>,
            uncached: u64,
            decode: u64,
        }
        let old = Older {
            id: 3,
            model: "m".into(),
            worker: "http://w:1".into(),
            policy: "cache_aware".into(),
            prefix: WirePrefix::None,
            blocks: vec![1, 2],
            block_tokens: 16,
            session: None,
            input_tokens: 40,
            output_tokens: Some(4),
            uncached: 40,
            decode: 4,
        };
        let ev: RoutedEvent = rmp_serde::from_slice(&rmp_serde::to_vec(&old).expect("encode")).expect("decode");
        assert_eq!((ev.id, ev.pool, ev.blocks.len()), (3, Pool::Main as u8, 2));
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary() {
        let t = "é".repeat(MAX_EVENT_TEXT);
        let cut = cut_text(&t);
        assert!(cut.len() <= MAX_EVENT_TEXT && cut.len() >= MAX_EVENT_TEXT - 1, "{}", cut.len());
        assert!(t.starts_with(&cut));
    }

    #[test]
    fn the_snapshot_log_keeps_its_bounds() {
        let mut r = Recent::default();
        let ev = RoutedEvent {
            id: 0,
            model: String::new(),
            worker: String::new(),
            policy: String::new(),
            prefix: WirePrefix::Text("x".repeat(1 << 20)),
            blocks: Vec::new(),
            block_tokens: 0,
            session: None,
            input_tokens: 1,
            output_tokens: None,
            uncached: 0,
            decode: 0,
            pool: 0,
        };
        let e = Arc::new(ev);
        for _ in 0..100 {
            r.push(Arc::clone(&e));
        }
        assert!(r.bytes <= SNAPSHOT_MAX_BYTES, "{}", r.bytes);
        assert_eq!(r.events.len(), SNAPSHOT_MAX_BYTES / e.size_estimate());
    }
}
