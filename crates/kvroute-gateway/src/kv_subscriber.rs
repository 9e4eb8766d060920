//! The router side of engine KV events (vLLM's `vllm/distributed/kv_events.py`, which SGLang
//! follows): one ZeroMQ SUB subscriber per worker feeding the shared
//! [`kvroute_core::precise::PreciseIndex`], and each worker's startup parity check. The
//! request side (a request's token ids, cached) is [`crate::kv_tokens`].
//!
//! The subscribers do not write the index themselves: they queue what they read (a batch,
//! a worker to track or to clear) to one applier over a bounded queue ([`APPLY_QUEUE`]), in
//! each subscriber's order, and the applier makes up to [`OPS_PER_WRITE`] queued ones in
//! one write of the index's copies ([`crate::twin::Twin`]).
//!
//! Sequence tracking per (worker, data-parallel rank):
//! - on each (re)connection, the worker's replay socket (DEALER → ROUTER) is asked for
//!   everything it still holds, so a router that starts in front of busy engines routes
//!   precisely before their next event;
//! - the first batch seen with a sequence above 0, or a gap (`seq > last + 1`), asks the
//!   replay socket for the missing batches and applies them first;
//! - a sequence that goes back means the publisher restarted: the worker's state is cleared
//!   and rebuilt from what follows (and from the replay buffer of the new process);
//! - `AllBlocksCleared` clears the worker.
//!
//! The parity check is run again while it is inconclusive (an idle engine publishes
//! nothing), at most [`PARITY_RETRIES`] more times, [`PARITY_RETRY_EVERY`] apart.
//!
//! Only the main attention group (`group_idx` 0) is indexed. Everything is bounded: the
//! replay exchange has a timeout and a batch limit, the applier's queue has a bound,
//! reconnects back off, the token cache holds at most
//! [`crate::kv_tokens::TOKEN_CACHE_TOKENS`] tokens.

use crate::app::AppState;
use crate::metrics::WorkerLabel;
use bytes::Bytes;
use kvroute_core::precise::{PreciseIndex, StoredBlocks, Tier};
use kvroute_core::types::{Nanos, WorkerId};
use kvroute_protocol::kv_events::{EventBatch, KvEvent, REPLAY_END, decode, parse_frames};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend};

/// Most batches taken from one replay answer.
pub const MAX_REPLAY_BATCHES: usize = 100_000;
/// Time allowed for one replay exchange.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Most operations (mostly event batches, from any worker) the applier makes in one write
/// of the precise index. One write per batch capped ingestion beside long decisions at a
/// few thousand batches a second (a write waits for the decisions reading the copy it
/// writes); 32 a write reached 0.8-1.1 M block events/s from 1,024 engines in `kvroute
/// bench kv-events --batches-per-lock 32` (docs/benchmarks.md).
pub const OPS_PER_WRITE: usize = 32;
/// Bound of the queue from the subscribers to the applier, operations; a full queue holds
/// the subscribers back (their publishers' messages wait in ZeroMQ, which drops past its
/// high-water mark, and a gap is then replayed).
pub const APPLY_QUEUE: usize = 4096;

/// What a subscriber asks of the precise index, applied in its order by the one applier
/// ([`applier`]).
enum Op {
    /// Start tracking a worker.
    Track(WorkerId),
    /// The worker's publisher restarted: forget what it said.
    Clear(WorkerId),
    /// One batch of the worker's events.
    Apply(WorkerId, WorkerLabel, Vec<KvEvent>),
}

/// The subscribers' end of the applier's queue.
type Ops = tokio::sync::mpsc::Sender<Op>;

/// Runs one subscriber per configured source until `cancel`, the applier they feed, and
/// each worker's startup parity check ([`parity_check`]) when `kv_parity_check` is on.
pub async fn run(s: Arc<AppState>, cancel: CancellationToken) {
    let (ops, queue) = tokio::sync::mpsc::channel(APPLY_QUEUE);
    let applying = tokio::spawn(applier(Arc::clone(&s), queue));
    let mut tasks = Vec::new();
    for src in s.cfg.kv_events.clone() {
        tasks.push(tokio::spawn(subscribe(Arc::clone(&s), src.clone(), ops.clone(), cancel.clone())));
        if s.cfg.kv_parity_check {
            let (s, cancel) = (Arc::clone(&s), cancel.clone());
            tasks.push(tokio::spawn(async move {
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = parity_until_conclusive(&s, &src.worker) => {}
                }
            }));
        }
    }
    drop(ops);
    for t in tasks {
        let _ = t.await;
    }
    // Every sender is gone: the applier finishes what is queued and ends.
    let _ = applying.await;
}

/// Applies the subscribers' operations in their order, up to [`OPS_PER_WRITE`] queued ones
/// in one write of the precise index (each copy in turn), until every subscriber is gone.
async fn applier(s: Arc<AppState>, mut queue: tokio::sync::mpsc::Receiver<Op>) {
    let mut ops = Vec::with_capacity(OPS_PER_WRITE);
    let mut skipped = Vec::with_capacity(OPS_PER_WRITE);
    while queue.recv_many(&mut ops, OPS_PER_WRITE).await > 0 {
        let now = s.now();
        s.precise.write(|ix| {
            skipped.clear();
            skipped.extend(ops.iter().map(|op| match op {
                Op::Track(w) => {
                    ix.track(*w);
                    0
                }
                Op::Clear(w) => {
                    ix.clear(*w);
                    0
                }
                // A worker removed (untracked) while its batches waited in the queue: they
                // are dropped, as a subscriber drops those it reads after the removal.
                Op::Apply(w, _, events) if ix.is_tracked(*w) => apply_events(ix, *w, events, now),
                Op::Apply(..) => 0,
            }));
        });
        for (op, skipped) in ops.drain(..).zip(&skipped) {
            if let Op::Apply(_, label, _) = op {
                s.metrics.kv_batches.get_or_create(&label).inc();
                if *skipped > 0 {
                    s.metrics.kv_skipped.get_or_create(&label).inc_by(*skipped);
                }
            }
        }
    }
}

/// Parity checks after an inconclusive one (an idle engine that published nothing, a
/// worker not up yet): at most this many more, [`PARITY_RETRY_EVERY`] apart.
pub const PARITY_RETRIES: u32 = 10;
/// Time between two parity checks of a worker whose last one was inconclusive.
pub const PARITY_RETRY_EVERY: Duration = Duration::from_secs(30);

/// [`parity_check`] until it is conclusive, at most [`PARITY_RETRIES`] more times.
async fn parity_until_conclusive(s: &Arc<AppState>, worker: &str) {
    for _ in 0..=PARITY_RETRIES {
        if !matches!(parity_check(s, worker).await, Parity::Inconclusive(_)) {
            return;
        }
        tokio::time::sleep(PARITY_RETRY_EVERY).await;
    }
}

fn worker_id(s: &AppState, url: &str) -> Option<WorkerId> {
    let url = url.trim_end_matches('/');
    s.fleet.by_url(url).map(|w| w.id)
}

/// One subscriber's worker id, looked up by URL again only when the fleet's membership
/// changed (its worker list is swapped whole then): with 1,024 engines each publishing
/// tens of batches a second, a batch pays a pointer comparison instead of a look-up (and
/// a URL spelled unlike the table's, a parse).
#[derive(Default)]
struct WorkerIdCache {
    /// The worker list the id was read from (weak: an old list is not kept alive, and its
    /// allocation is not reused while this points at it).
    list: std::sync::Weak<crate::fleet::Listing>,
    id: Option<WorkerId>,
}

impl WorkerIdCache {
    /// The id of the worker at `url` in the current fleet.
    fn get(&mut self, s: &AppState, url: &str) -> Option<WorkerId> {
        let cur = s.fleet.load();
        if !std::ptr::eq(self.list.as_ptr(), Arc::as_ptr(&cur)) {
            self.id = worker_id(s, url);
            self.list = Arc::downgrade(&cur);
        }
        self.id
    }
}

/// Follows one worker's KV-event publisher until `cancel`: connects (with backoff),
/// applies its batches, and reconnects when the connection is lost.
async fn subscribe(s: Arc<AppState>, src: crate::config::KvEventSource, ops: Ops, cancel: CancellationToken) {
    let label = WorkerLabel {
        worker: crate::model::worker_url::check_worker_url(&src.worker)
            .unwrap_or_else(|_| src.worker.trim_end_matches('/').to_string()),
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut sock = match connect(&src, &cancel, &mut backoff).await {
            Ok(sock) => sock,
            Err(Stop::Retry) => continue,
            Err(Stop::Cancelled) => return,
        };
        tracing::info!(worker = %label.worker, endpoint = %src.endpoint, "kv events: subscribed");
        if let Stop::Cancelled =
            follow(&Follow { s: &s, src: &src, label: &label, ops: &ops }, &mut sock, &cancel).await
        {
            return;
        }
    }
}

/// Why a subscription ended, or did not start.
enum Stop {
    /// `cancel`: the subscriber stops.
    Cancelled,
    /// The connection failed or was lost: connect again.
    Retry,
}

/// Connects to the publisher and subscribes to everything; after a failed connect, waits
/// `backoff` (doubled for the next time, up to 5 s; reset once connected).
async fn connect(
    src: &crate::config::KvEventSource,
    cancel: &CancellationToken,
    backoff: &mut Duration,
) -> Result<zeromq::SubSocket, Stop> {
    let mut sock = zeromq::SubSocket::new();
    let connected = tokio::select! {
        () = cancel.cancelled() => return Err(Stop::Cancelled),
        r = sock.connect(&src.endpoint) => r,
    };
    if let Err(e) = connected.map(|_| ()) {
        tracing::warn!(endpoint = %src.endpoint, error = %e, "kv events: cannot connect; retrying");
        tokio::select! {
            () = cancel.cancelled() => return Err(Stop::Cancelled),
            () = tokio::time::sleep(*backoff) => {}
        }
        *backoff = (*backoff * 2).min(Duration::from_secs(5));
        return Err(Stop::Retry);
    }
    if let Err(e) = sock.subscribe("").await {
        tracing::warn!(endpoint = %src.endpoint, error = %e, "kv events: subscribe failed");
        return Err(Stop::Retry);
    }
    *backoff = Duration::from_millis(100);
    Ok(sock)
}

/// Queues the batches of one connection for the applier in sequence order per
/// data-parallel rank (a gap is replayed first when the worker has a replay socket), until
/// the connection is lost, `cancel`, or the applier is gone.
async fn follow(f: &Follow<'_>, sock: &mut zeromq::SubSocket, cancel: &CancellationToken) -> Stop {
    let Follow { s, src, label, .. } = *f;
    let mut last: HashMap<Option<i64>, u64> = HashMap::new();
    let mut ids = WorkerIdCache::default();
    // What the engine published before this subscription (the router just started, or the
    // connection was lost): asked of its replay socket now, not at the next live batch.
    if let (Some(r), Some(w)) = (&src.replay, worker_id(s, &label.worker)) {
        if f.track(w).await.is_err() {
            return Stop::Cancelled;
        }
        let got = replay(f, w, r, 0, u64::MAX).await;
        s.metrics.kv_replayed.get_or_create(label).inc_by(got);
    }
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => return Stop::Cancelled,
            m = sock.recv() => m,
        };
        let Ok(msg) = msg else {
            tracing::warn!(endpoint = %src.endpoint, "kv events: connection lost; reconnecting");
            return Stop::Retry;
        };
        let Some(w) = ids.get(s, &label.worker) else { continue };
        let Some((seq, batch)) = read_batch(s, label, &msg.into_vec()) else { continue };
        let rank = batch.dp_rank;
        let Ok(expected) = f.expected_seq(w, last.get(&rank).copied(), seq).await else { return Stop::Cancelled };
        if seq > expected {
            s.metrics.kv_gaps.get_or_create(label).inc();
            if let Some(r) = &src.replay {
                let got = replay(f, w, r, expected, seq).await;
                s.metrics.kv_replayed.get_or_create(label).inc_by(got);
            }
        }
        if f.track(w).await.is_err() || f.apply(w, batch.events).await.is_err() {
            return Stop::Cancelled;
        }
        last.insert(rank, seq);
    }
}

/// A message's sequence number and decoded batch (skipped events and fields counted);
/// `None`, counted as an error, when it is malformed.
fn read_batch(s: &AppState, label: &WorkerLabel, frames: &[Bytes]) -> Option<(u64, EventBatch)> {
    let (seq, payload) = match parse_frames(frames) {
        Ok((_, seq, p)) => (seq, p),
        Err(e) => {
            s.metrics.kv_errors.get_or_create(label).inc();
            tracing::debug!(error = %e, "kv events: bad message");
            return None;
        }
    };
    match decode(&payload) {
        Ok((b, stats)) => {
            let skipped = stats.unknown_events + stats.unknown_fields;
            if skipped > 0 {
                s.metrics.kv_skipped.get_or_create(label).inc_by(skipped);
            }
            Some((seq, b))
        }
        Err(e) => {
            s.metrics.kv_errors.get_or_create(label).inc();
            tracing::debug!(error = %e, "kv events: bad batch");
            None
        }
    }
}

/// What one subscription works with: the state, its source and label, and the applier's
/// queue.
#[derive(Clone, Copy)]
struct Follow<'a> {
    s: &'a AppState,
    src: &'a crate::config::KvEventSource,
    label: &'a WorkerLabel,
    ops: &'a Ops,
}

/// The applier is gone (the router is stopping).
struct Gone;

impl Follow<'_> {
    /// Queues `op` for the applier, waiting while its queue is full.
    async fn send(&self, op: Op) -> Result<(), Gone> {
        self.ops.send(op).await.map_err(|_| Gone)
    }

    /// The sequence number expected from a rank whose last batch was `last`: a `seq` not
    /// past it means the publisher restarted, and everything it said before is void (the
    /// worker's state is cleared; 0 is expected).
    async fn expected_seq(&self, w: WorkerId, last: Option<u64>, seq: u64) -> Result<u64, Gone> {
        Ok(match last {
            None => 0,
            Some(l) if seq <= l => {
                self.s.metrics.kv_restarts.get_or_create(self.label).inc();
                tracing::info!(worker = %self.label.worker, seq, last = l, "kv events: publisher restarted; state cleared");
                self.send(Op::Clear(w)).await?;
                0
            }
            Some(l) => l + 1,
        })
    }

    /// Tracks `w` in the precise index unless it is already.
    async fn track(&self, w: WorkerId) -> Result<(), Gone> {
        if self.s.precise.read().is_tracked(w) { Ok(()) } else { self.send(Op::Track(w)).await }
    }

    /// Queues one batch's events of `w` for the applier.
    async fn apply(&self, w: WorkerId, events: Vec<KvEvent>) -> Result<(), Gone> {
        self.send(Op::Apply(w, self.label.clone(), events)).await
    }
}

/// Applies one batch's `events` of worker `w` to the precise index `ix` at `now`, as the
/// applier does to each copy of the index (also what `kvroute bench kv-events` times).
/// Returns the events skipped: those of a KV-cache group other than the main attention
/// group (`group_idx` 0).
pub fn apply_events(ix: &mut PreciseIndex, w: WorkerId, events: &[KvEvent], now: Nanos) -> u64 {
    let mut skipped = 0u64;
    for e in events {
        match e {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, group_idx } => {
                if *group_idx != 0 {
                    skipped += 1;
                    continue;
                }
                let ev = StoredBlocks {
                    engine_hashes: block_hashes,
                    parent: *parent_block_hash,
                    token_ids,
                    block_size: *block_size,
                    tier: Tier::of_medium(medium.as_deref()),
                };
                ix.stored(w, ev, now);
            }
            KvEvent::BlockRemoved { block_hashes, medium, group_idx } => {
                if *group_idx != 0 {
                    skipped += 1;
                    continue;
                }
                ix.removed(w, block_hashes, Tier::of_medium(medium.as_deref()));
            }
            KvEvent::AllBlocksCleared => ix.clear(w),
        }
    }
    skipped
}

/// Asks `endpoint` for batches `from..until` and queues them for the applier in order;
/// returns how many were queued. Bounded by [`REPLAY_TIMEOUT`] and [`MAX_REPLAY_BATCHES`].
async fn replay(f: &Follow<'_>, w: WorkerId, endpoint: &str, from: u64, until: u64) -> u64 {
    let Follow { s, label, .. } = *f;
    let work = async {
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
        let req = zeromq::ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())])
            .map_err(|e| e.to_string())?;
        dealer.send(req).await.map_err(|e| e.to_string())?;
        let mut applied = 0u64;
        for _ in 0..MAX_REPLAY_BATCHES {
            let frames = dealer.recv().await.map_err(|e| e.to_string())?.into_vec();
            // [b"", seq, payload]; tolerate a missing empty delimiter frame.
            let n = frames.len();
            if n < 2 {
                return Err(format!("replay answer of {n} frames"));
            }
            let (seq, payload) = (&frames[n - 2], &frames[n - 1]);
            if seq.as_ref() == REPLAY_END {
                break;
            }
            let seq = u64::from_be_bytes(seq.as_ref().try_into().map_err(|_| "sequence frame is not 8 bytes")?);
            if seq < from || seq >= until {
                continue;
            }
            match decode(payload) {
                Ok((b, _)) => {
                    f.apply(w, b.events).await.map_err(|Gone| "the router is stopping".to_string())?;
                    applied += 1;
                }
                Err(_) => {
                    s.metrics.kv_errors.get_or_create(label).inc();
                }
            }
        }
        Ok::<u64, String>(applied)
    };
    match tokio::time::timeout(REPLAY_TIMEOUT, work).await {
        Ok(Ok(n)) => {
            tracing::info!(worker = %label.worker, from, until, applied = n, "kv events: gap replayed");
            n
        }
        Ok(Err(e)) => {
            tracing::warn!(worker = %label.worker, error = %e, "kv events: replay failed");
            0
        }
        Err(_) => {
            tracing::warn!(worker = %label.worker, "kv events: replay timed out");
            0
        }
    }
}

/// How long the parity check waits for the subscription to settle before probing.
pub const PARITY_SETTLE: Duration = Duration::from_secs(1);
/// How long the parity check waits for the probe's `BlockStored`.
pub const PARITY_TIMEOUT: Duration = Duration::from_secs(15);

/// How long the parity check keeps waiting for the probe's blocks once other blocks arrived.
pub const PARITY_GRACE: Duration = Duration::from_secs(3);

/// Result of a worker's startup parity check (gauge `kvroute_kv_parity`: 1, 0, −1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parity {
    /// The router's own hashes of the probe found every full block the engine stored.
    Ok {
        /// Full blocks of the probe prompt.
        blocks: u64,
    },
    /// Blocks were stored after the probe but the router's hashes of the probe find fewer
    /// than all of them: the router's tokens (tokenizer, chat template) or block size do
    /// not match the engine's.
    Mismatch {
        /// Probe tokens the index finds cached under the router's hashes.
        matched: u64,
        /// Probe tokens in full blocks.
        expected: u64,
    },
    /// No usable answer: no events after the probe, or the probe could not be sent or
    /// tokenized (the reason).
    Inconclusive(String),
}

/// The startup parity check of one worker (the most common silent failure of precise
/// routing is a router that hashes different tokens than the engine caches): after the
/// subscription settles, sends the worker a probe chat request directly (not through the
/// router), tokenizes it the way requests are ([`crate::kv_tokens::request_tokens`]: the worker's own
/// `/tokenize` with the chat messages), and waits up to [`PARITY_TIMEOUT`] for the
/// engine's `BlockStored` to make the router's own hashes of those tokens match. Logs an
/// error naming the worker on a mismatch, a warning when inconclusive, and sets
/// `kvroute_kv_parity{worker}` to 1 (ok), 0 (mismatch) or −1 (inconclusive).
pub async fn parity_check(s: &Arc<AppState>, worker: &str) -> Parity {
    let worker = worker.trim_end_matches('/').to_string();
    tokio::time::sleep(PARITY_SETTLE).await;
    let p = probe(s, &worker).await;
    let label = WorkerLabel { worker: worker.clone() };
    let gauge = s.metrics.kv_parity.get_or_create(&label);
    match &p {
        Parity::Ok { blocks } => {
            gauge.set(1);
            tracing::info!(worker = %worker, blocks, "kv events: parity check passed");
        }
        Parity::Mismatch { matched, expected } => {
            gauge.set(0);
            tracing::error!(
                worker = %worker, matched, expected,
                "kv events: PARITY CHECK FAILED — the engine stored the probe prompt but the router's own \
                 block hashes of it match only {matched} of {expected} tokens: the router tokenizes \
                 (tokenizer or chat template) or cuts blocks differently from the engine, so precise \
                 routing will miss this worker's cache"
            );
        }
        Parity::Inconclusive(why) => {
            gauge.set(-1);
            tracing::warn!(worker = %worker, reason = %why, "kv events: parity check inconclusive");
        }
    }
    p
}

async fn probe(s: &Arc<AppState>, worker: &str) -> Parity {
    let model = {
        let Some(w) = s.fleet.by_url(worker) else {
            return Parity::Inconclusive("the worker is not registered".into());
        };
        w.models().first().cloned().unwrap_or_default()
    };
    // A prompt no client sends (unique per router start), long enough for several blocks
    // at any block size engines use.
    let nonce = s.now().0 ^ u64::from(std::process::id()).rotate_left(32);
    let text: String = std::iter::once(format!("kvroute KV-event parity probe {nonce:016x}. "))
        .chain(
            (0..48).map(|i| format!("Line {i:02} of the probe checks that router and engine hash the same tokens. ")),
        )
        .collect();
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
    });
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let info = match kvroute_protocol::openai::parse(kvroute_protocol::openai::Api::Chat, &bytes, None) {
        Ok(info) => info,
        Err(e) => return Parity::Inconclusive(format!("probe request: {}", e.message)),
    };
    let Some(w) = worker_id(s, worker) else { return Parity::Inconclusive("the worker is not registered".into()) };
    let tokens = match crate::kv_tokens::request_tokens(s.token_sources(), Some(&body), &info).await {
        Ok(t) => t,
        Err(why) => return Parity::Inconclusive(format!("the probe could not be tokenized ({why})")),
    };
    let stored_before = s.precise.read().stats().stored;
    let sent = s.client.post(format!("{worker}/v1/chat/completions")).timeout(PARITY_TIMEOUT).json(&body).send().await;
    match sent {
        Ok(r) if r.status().is_success() => {}
        Ok(r) => return Parity::Inconclusive(format!("the probe got HTTP {}", r.status())),
        Err(e) => return Parity::Inconclusive(format!("the probe failed: {e}")),
    }
    let deadline = tokio::time::Instant::now() + PARITY_TIMEOUT;
    let mut last = Parity::Inconclusive("no BlockStored event arrived after the probe".into());
    let mut mismatch_since = None;
    loop {
        {
            let ix = s.precise.read();
            if let Some(bs) = ix.block_size(w).filter(|b| *b > 0) {
                let mut h = Vec::new();
                kvroute_core::hash::hash_token_blocks(
                    &tokens,
                    bs as usize,
                    usize::MAX,
                    kvroute_core::hash::HashAlgo::Xxh3,
                    &mut h,
                );
                let expected = h.len() as u64 * u64::from(bs);
                let matched = ix.cached_tokens(w, &h, bs, s.now()).unwrap_or(0);
                if expected > 0 && matched >= expected {
                    return Parity::Ok { blocks: h.len() as u64 };
                }
                if ix.stats().stored > stored_before {
                    last = Parity::Mismatch { matched, expected };
                    mismatch_since.get_or_insert_with(tokio::time::Instant::now);
                }
            }
        }
        // Blocks were stored but not the probe's (as the router hashes it): give the
        // probe's own events a grace period, then report.
        let now = tokio::time::Instant::now();
        if now >= deadline || mismatch_since.is_some_and(|t| now - t >= PARITY_GRACE) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
