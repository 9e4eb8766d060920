//! The replica sync's tasks (`crate::cluster::sync` for the protocol and its bounds):
//! connect to NATS, publish this replica's events in batches, apply the peers', and ask for
//! and answer snapshots.

use super::sync::*;
use crate::app::AppState;
use bytes::Bytes;
use futures_util::StreamExt;
use kvroute_core::ledger::{AtomicLoad, LoadTicket, WorkerLoad};
use kvroute_core::policy::RequestKey;
use kvroute_core::types::{BlockHash, BlockSeq, RequestView, Role, WorkerId};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

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
    let publisher = tokio::spawn(publish(Arc::clone(&state), Arc::clone(&sync), client.clone(), rx, cancel.clone()));
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

/// The publisher: batches the queue's events and this replica's load totals and publishes
/// them, with a heartbeat when idle. A batch NATS does not take within a second is dropped
/// (counted).
async fn publish(
    state: Arc<AppState>,
    sync: Arc<ReplicaSync>,
    client: async_nats::Client,
    mut rx: mpsc::Receiver<Out>,
    cancel: CancellationToken,
) {
    let mut seq = 0u64;
    let mut buf: Vec<Out> = Vec::with_capacity(MAX_BATCH_EVENTS);
    let mut report = LoadReport::default();
    loop {
        // Woken by an event, or by a change of load that queued none (a request left to
        // the load totals): its batch goes one window later, as an event's would.
        let (first, woken) = tokio::select! {
            () = cancel.cancelled() => break,
            e = rx.recv() => (e, true),
            () = sync.load_changed.notified() => (None, true),
            () = tokio::time::sleep(HEARTBEAT) => (None, false),
        };
        if woken {
            buf.extend(first);
            tokio::time::sleep(sync.batch_window).await;
            while buf.len() < MAX_BATCH_EVENTS {
                match rx.try_recv() {
                    Ok(e) => buf.push(e),
                    Err(_) => break,
                }
            }
        }
        publish_buffered(&sync, &client, &mut seq, &mut buf, &mut report, &state.fleet).await;
    }
    // Stopping (the requests have drained): what is still queued — the `done` events of the
    // last requests — then a goodbye, so the peers release this replica's load at once.
    while let Ok(e) = rx.try_recv() {
        buf.push(e);
    }
    publish_buffered(&sync, &client, &mut seq, &mut buf, &mut report, &state.fleet).await;
    let bye = Batch {
        replica: sync.replica.clone(),
        seq,
        sent_unix_ns: unix_ns(),
        events: Vec::new(),
        bye: true,
        instance: sync.instance,
        spent: Vec::new(),
        load_totals: true,
        load: Vec::new(),
    };
    if let Ok(payload) = rmp_serde::to_vec_named(&bye) {
        let _ =
            tokio::time::timeout(Duration::from_secs(1), client.publish(sync.events_subject.clone(), payload.into()))
                .await;
    }
}

/// Most requests sent in full whose first-token and done events are still to go
/// ([`LoadReport::full_ids`]); past it such events are not sent (replicas before load
/// totals then hold those requests' tickets until their deadline).
const MAX_FULL_IDS: usize = 65_536;

/// What the publisher keeps between batches for this replica's load totals
/// ([`Batch::load`]).
#[derive(Debug, Default)]
struct LoadReport {
    /// The totals last sent per worker URL (the fleet's own string, shared), and the
    /// number of the last report that saw the worker with load; zeros kept until the
    /// next full report.
    sent: HashMap<Arc<str>, (WorkerLoad, u64)>,
    /// Reports made (the numbers in `sent`).
    reports: u64,
    /// When every worker's totals last went.
    full_at: Option<Instant>,
    /// Requests whose routed event went in full and whose done event has not: their
    /// first-token and done events still go, for replicas of versions before totals (at
    /// most [`MAX_FULL_IDS`]).
    full_ids: HashSet<u64>,
}

impl LoadReport {
    /// The totals for the next batch: each worker of `fleet` whose load changed since the
    /// last report, and at least every [`HEARTBEAT`] every worker with load (or with load
    /// since the previous such report, as zeros), and zeros for workers gone from the fleet.
    ///
    /// Each worker's counters are read; only those with load, and those reported before,
    /// are looked up by URL (a fleet of 4,096 mostly idle workers costs a pass over its
    /// counters, not 4,096 look-ups).
    fn changes(&mut self, fleet: &crate::fleet::Fleet, now: Instant) -> Vec<WireLoad> {
        let full = self.full_at.is_none_or(|t| now.duration_since(t) >= HEARTBEAT);
        self.reports += 1;
        let this = self.reports;
        let list = fleet.load();
        let mut out = Vec::new();
        for w in list.iter() {
            let l = w.load.get();
            if l == WorkerLoad::default() {
                continue;
            }
            match self.sent.get_mut(&*w.url) {
                Some((prev, seen)) => {
                    *seen = this;
                    if *prev != l || full {
                        *prev = l;
                        out.push(WireLoad::of(&w.url, l));
                    }
                }
                None => {
                    self.sent.insert(Arc::clone(&w.url), (l, this));
                    out.push(WireLoad::of(&w.url, l));
                }
            }
        }
        // Workers reported before that this pass did not see with load: idle now, or gone.
        let mut gone = Vec::new();
        for (url, (prev, seen)) in &mut self.sent {
            if *seen == this {
                continue;
            }
            if list.by_url(url).is_some() {
                if *prev != WorkerLoad::default() || full {
                    *prev = WorkerLoad::default();
                    out.push(WireLoad::of(url, WorkerLoad::default()));
                }
            } else if full {
                gone.push(Arc::clone(url));
            }
        }
        if full {
            self.full_at = Some(now);
            for u in gone {
                self.sent.remove(&u);
                out.push(WireLoad::of(&u, WorkerLoad::default()));
            }
            self.sent.retain(|_, (l, _)| *l != WorkerLoad::default());
        }
        out
    }
}

/// Publishes the events in `buf` (emptied) and this replica's load totals in batches that
/// fit a NATS message; only the totals (a heartbeat) when it is empty. API keys' spends go
/// with the events they were queued among. (A routed event the cluster applied in full
/// within `sync_refresh_secs` was never queued: [`ReplicaSync::routed`].)
async fn publish_buffered(
    sync: &ReplicaSync,
    client: &async_nats::Client,
    seq: &mut u64,
    buf: &mut Vec<Out>,
    report: &mut LoadReport,
    fleet: &crate::fleet::Fleet,
) {
    let limit = max_message(client);
    let mut events = Vec::with_capacity(buf.len());
    let mut spent = Vec::new();
    let mut size = 64;
    for e in buf.drain(..) {
        let ev = match e {
            Out::Routed(mut r) => {
                let wire = sync.on_the_wire(&mut r);
                sync.recent.lock().push(Arc::from(r));
                if report.full_ids.len() < MAX_FULL_IDS {
                    report.full_ids.insert(wire.id);
                }
                WireEvent::Routed(wire)
            }
            Out::FirstToken(id) if report.full_ids.contains(&id) => WireEvent::FirstToken(id),
            Out::Done(id) if report.full_ids.remove(&id) => WireEvent::Done(id),
            Out::FirstToken(_) | Out::Done(_) => continue,
            Out::Spent(s) => {
                let (requests, tokens) = s.take();
                if requests > 0 || tokens > 0 {
                    sync.shadow.lock().record(s.id, s.limits, requests, tokens, sync.clock_ns());
                    spent.push(KeySpend { key: s.id, requests, tokens });
                    size += 32;
                }
                continue;
            }
        };
        let n = match &ev {
            WireEvent::Routed(r) => r.size_estimate(),
            _ => 16,
        };
        if size + n > limit / 2 && !(events.is_empty() && spent.is_empty()) {
            send_batch(sync, client, seq, std::mem::take(&mut events), std::mem::take(&mut spent), Vec::new()).await;
            size = 64;
        }
        size += n;
        events.push(ev);
    }
    let mut load = Vec::new();
    for l in report.changes(fleet, Instant::now()) {
        let n = 40 + l.worker.len();
        if size + n > limit / 2 && !(events.is_empty() && spent.is_empty() && load.is_empty()) {
            let (e, s, l) = (std::mem::take(&mut events), std::mem::take(&mut spent), std::mem::take(&mut load));
            send_batch(sync, client, seq, e, s, l).await;
            size = 64;
        }
        size += n;
        load.push(l);
    }
    send_batch(sync, client, seq, events, spent, load).await;
}

async fn send_batch(
    sync: &ReplicaSync,
    client: &async_nats::Client,
    seq: &mut u64,
    events: Vec<WireEvent>,
    spent: Vec<KeySpend>,
    load: Vec<WireLoad>,
) {
    let n = (events.len() + spent.len()) as u64;
    let batch = Batch {
        replica: sync.replica.clone(),
        seq: *seq,
        sent_unix_ns: unix_ns(),
        events,
        bye: false,
        instance: sync.instance,
        spent,
        load_totals: true,
        load,
    };
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
    /// Its requests' load tickets (a peer that sends per-request load).
    tickets: HashMap<u64, (LoadTicket, Instant)>,
    /// Its load totals (a peer that sends [`Batch::load`]).
    load: PeerLoad,
}

/// One peer's reported in-flight load ([`Batch::load`]), added to the workers' remote
/// counters; taken out again when dropped or cleared (the peer gone, restarted, or saying
/// goodbye), as a ticket is.
#[derive(Debug, Default)]
struct PeerLoad {
    /// Per worker URL: the counters the totals were added to and the totals.
    by_url: HashMap<String, (Arc<AtomicLoad>, WorkerLoad)>,
    /// The sum of its totals' requests.
    in_flight: u64,
}

impl PeerLoad {
    /// Applies reported totals: each worker's counters move from the peer's last totals
    /// to these. A worker this replica does not know is skipped (the peer reports every
    /// worker with load again within [`HEARTBEAT`]); one replaced in the fleet since (a
    /// new entry under its URL) loses the old totals and gets the new.
    fn apply(&mut self, fleet: &crate::fleet::Fleet, entries: &[WireLoad]) {
        if entries.is_empty() {
            return;
        }
        let list = fleet.load();
        for e in entries {
            let to = e.load();
            let now = list.by_url(&e.worker).map(|w| Arc::clone(&w.remote_load));
            let (counters, from) = match (self.by_url.remove(&e.worker), now) {
                (Some((held, from)), Some(now)) if Arc::ptr_eq(&held, &now) => (held, from),
                (old, now) => {
                    if let Some((held, from)) = old {
                        held.shift(from, WorkerLoad::default());
                        self.in_flight -= u64::from(from.in_flight);
                    }
                    match now {
                        Some(now) => (now, WorkerLoad::default()),
                        None => continue,
                    }
                }
            };
            counters.shift(from, to);
            self.in_flight = self.in_flight - u64::from(from.in_flight) + u64::from(to.in_flight);
            if to != WorkerLoad::default() {
                self.by_url.insert(e.worker.clone(), (counters, to));
            }
        }
    }

    /// Takes every total out of the workers' counters.
    fn clear(&mut self) {
        for (_, (counters, from)) in self.by_url.drain() {
            counters.shift(from, WorkerLoad::default());
        }
        self.in_flight = 0;
    }
}

impl Drop for PeerLoad {
    fn drop(&mut self) {
        self.clear();
    }
}

/// The subscriber: applies the other replicas' batches; sweeps gone peers and stale
/// tickets once a second.
async fn apply_events(
    state: &Arc<AppState>,
    sync: &ReplicaSync,
    mut events: async_nats::Subscriber,
    cancel: CancellationToken,
) {
    let ttl = Duration::from_secs_f64(state.cfg.request_timeout_secs) + TICKET_GRACE;
    let mut peers = Peers { by_name: HashMap::new(), superseded: VecDeque::new(), tickets: 0, ttl };
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    let mut warned: Option<Instant> = None;
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = events.next() => match m { Some(m) => m, None => break },
            _ = sweep.tick() => {
                peers.sweep(&state.metrics);
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
            // NATS does not send this connection its own batches back (`no_echo`): another
            // process runs under this replica's id.
            duplicate_id(sync, &batch, &mut warned);
            continue;
        }
        let lag = unix_ns().saturating_sub(batch.sent_unix_ns) as f64 / 1e9;
        state.metrics.sync_lag_seconds.observe(lag);
        peers.apply(state, sync, batch).await;
    }
}

/// A batch published under this replica's own id by another process: counted
/// (`duplicate_replica_id`, its events) and logged at most once a minute. Each of the two
/// skips the other's batches as its own (the other replicas follow both apart by their
/// [`Batch::instance`], [`Peers::admit`]): the ids must differ.
fn duplicate_id(sync: &ReplicaSync, batch: &Batch, warned: &mut Option<Instant>) {
    sync.count("duplicate_replica_id", batch.events.len().max(1) as u64);
    if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
        *warned = Some(Instant::now());
        tracing::error!(
            replica = %sync.replica,
            "another router publishes under this replica's id: the two do not sync with each other and the \
             other replicas mix them up; give each replica its own replica_id (or leave it unset: a random one)"
        );
    }
}

/// A peer process: its replica id and its instance ([`Batch::instance`]).
type PeerKey = (String, u64);

/// Instances replaced by a newer one under the same replica id that are remembered: one
/// of them heard from again is a second process under that id, not a late batch.
const SUPERSEDED_KEPT: usize = 64;

/// The other replicas heard from, and the load tickets of theirs this replica holds.
struct Peers {
    by_name: HashMap<PeerKey, Peer>,
    /// Instances a newer one of the same replica replaced (oldest first, at most
    /// [`SUPERSEDED_KEPT`]).
    superseded: VecDeque<PeerKey>,
    /// Tickets held, over every peer (new ones are taken up to [`MAX_REMOTE_TICKETS`]).
    tickets: usize,
    /// How long a ticket is held without its `Done`: the request timeout and a grace.
    ttl: Duration,
}

impl Peers {
    /// Forgets the peers silent for [`PEER_SILENCE`] (their in-flight load is released) and
    /// the tickets past their deadline; sets the remote in-flight and peer gauges.
    fn sweep(&mut self, metrics: &crate::metrics::Metrics) {
        let now = Instant::now();
        self.by_name.retain(|(name, _), p| {
            let alive = now.duration_since(p.heard) < PEER_SILENCE;
            if !alive {
                tracing::info!(replica = %name, "cluster peer silent: its in-flight load is released");
                crate::metrics::count_outcome(&metrics.sync_peers_left, "silent");
            }
            alive
        });
        for p in self.by_name.values_mut() {
            p.tickets.retain(|_, (_, deadline)| *deadline > now);
        }
        self.tickets = self.by_name.values().map(|p| p.tickets.len()).sum();
        metrics.sync_remote_in_flight.set(self.remote_in_flight());
        metrics.sync_peers.set(self.by_name.len() as i64);
    }

    /// A process not heard from before, `key`: the restart of its replica when another
    /// instance of that replica is known (that one's tickets dropped, it is forgotten and
    /// remembered as replaced), or a second process under the replica's id when it is
    /// itself a replaced instance (logged; both followed apart from then on). Returns
    /// whether there is room for it ([`MAX_PEERS`]).
    fn admit(&mut self, key: &PeerKey, metrics: &crate::metrics::Metrics) -> bool {
        if self.superseded.contains(key) {
            tracing::error!(
                replica = %key.0,
                "two routers publish under one replica id: followed apart here, but they do not sync with each \
                 other; give each replica its own replica_id (or leave it unset: a random one)"
            );
            self.superseded.retain(|k| k != key);
        } else {
            let older: Vec<PeerKey> =
                self.by_name.keys().filter(|(r, i)| *r == key.0 && *i != key.1).cloned().collect();
            for old in older {
                // Restarted: what the old process had in flight is gone.
                if let Some(p) = self.by_name.remove(&old) {
                    self.tickets -= p.tickets.len();
                }
                if self.superseded.len() == SUPERSEDED_KEPT {
                    self.superseded.pop_front();
                }
                self.superseded.push_back(old);
            }
            metrics.sync_remote_in_flight.set(self.remote_in_flight());
        }
        self.by_name.len() < MAX_PEERS
    }

    /// Applies one batch of another replica: its sequence number (gaps counted; one that
    /// goes back, from a version without instances, drops the replica's tickets), then each
    /// event — a routed request committed to this replica's router and its load ticket
    /// taken, a first token, a request done. A new process beyond [`MAX_PEERS`] is ignored.
    async fn apply(&mut self, state: &AppState, sync: &ReplicaSync, batch: Batch) {
        let now = Instant::now();
        let key: PeerKey = (batch.replica.clone(), batch.instance);
        if !self.by_name.contains_key(&key) && !self.admit(&key, &state.metrics) {
            return;
        }
        let peer = self.by_name.entry(key.clone()).or_insert_with(|| {
            tracing::info!(replica = %batch.replica, "cluster peer joined");
            Peer { last_seq: batch.seq, heard: now, tickets: HashMap::new(), load: PeerLoad::default() }
        });
        if batch.seq > peer.last_seq + 1 {
            state.metrics.sync_gaps.inc_by(batch.seq - peer.last_seq - 1);
        } else if batch.seq < peer.last_seq {
            // The replica restarted under the same id: what it had in flight is gone.
            self.tickets -= peer.tickets.len();
            peer.tickets.clear();
            peer.load.clear();
        }
        if batch.bye {
            // Stopping: what it had in flight has ended or will not be reported.
            tracing::info!(replica = %batch.replica, "cluster peer left: its in-flight load is released");
            crate::metrics::count_outcome(&state.metrics.sync_peers_left, "goodbye");
            self.tickets -= peer.tickets.len();
            self.by_name.remove(&key);
            state.metrics.sync_remote_in_flight.set(self.remote_in_flight());
            state.metrics.sync_peers.set(self.by_name.len() as i64);
            return;
        }
        peer.last_seq = batch.seq;
        peer.heard = now;
        // Outcomes counted once per batch: [applied, policy_mismatch, unresolved,
        // unknown_worker, repeat].
        let mut outcomes = [0u64; 5];
        for ev in batch.events {
            match ev {
                WireEvent::Routed(mut r) => {
                    let resolved = r.repeat || sync.resolve(&mut r);
                    if !resolved {
                        outcomes[2] += 1;
                    }
                    let Some(w) = state.fleet.by_url(&r.worker) else {
                        outcomes[3] += 1;
                        continue;
                    };
                    // A peer that sends load totals has its load in them.
                    if !batch.load_totals && self.tickets < MAX_REMOTE_TICKETS {
                        let t = w.remote_load.dispatched(r.uncached, r.decode);
                        if peer.tickets.insert(r.id, (t, now + self.ttl)).is_none() {
                            self.tickets += 1;
                        }
                    }
                    outcomes[apply_prefix(state, sync, r, w.id, resolved).await] += 1;
                }
                WireEvent::FirstToken(id) => {
                    if let Some((t, _)) = peer.tickets.get_mut(&id) {
                        t.first_token();
                    }
                }
                WireEvent::Done(id) => {
                    if peer.tickets.remove(&id).is_some() {
                        self.tickets -= 1;
                    }
                }
            }
        }
        let names = ["applied", "policy_mismatch", "unresolved", "unknown_worker", "repeat"];
        for (outcome, n) in names.into_iter().zip(outcomes) {
            if n > 0 {
                sync.count(outcome, n);
            }
        }
        peer.load.apply(&state.fleet, &batch.load);
        take_spent(state, sync, &batch.spent);
        state.metrics.sync_remote_in_flight.set(self.remote_in_flight());
    }

    /// Requests the other replicas have in flight as this replica counts them: tickets
    /// and totals.
    fn remote_in_flight(&self) -> i64 {
        (self.tickets as u64 + self.by_name.values().map(|p| p.load.in_flight).sum::<u64>()) as i64
    }
}

/// Commits another replica's routed event `r` (its prompt reference `resolved` or not)
/// to `worker` in this replica's router and keeps it for snapshots; a repeat neither (its
/// full event was applied within `sync_refresh_secs`). The index of its outcome in
/// [`Peers::apply`]'s counts: 0 applied, 1 policy mismatch, 4 repeat.
async fn apply_prefix(state: &AppState, sync: &ReplicaSync, r: RoutedEvent, worker: WorkerId, resolved: bool) -> usize {
    if r.repeat {
        return 4;
    }
    let applied = commit(state, &r, worker, Wait::Yield).await;
    if applied && resolved {
        sync.applied_in_full(&r);
    }
    sync.recent.lock().push(Arc::new(r));
    usize::from(!applied)
}

/// Takes another replica's API-key spends (live, or a snapshot's) from this replica's
/// buckets for the same keys, and follows them for later snapshots (`spend_applied`); a key
/// this replica does not list, or not limited here, is counted `spend_unknown_key` (its
/// file differs, or it has none).
fn take_spent(state: &AppState, sync: &ReplicaSync, spent: &[KeySpend]) {
    if spent.is_empty() {
        return;
    }
    let keys = state.api_keys.as_ref().map(crate::api_keys::KeyFile::keys);
    let mut applied = 0;
    let mut shadow = sync.shadow.lock();
    let now = sync.clock_ns();
    for s in spent {
        if let Some(e) = keys.as_ref().and_then(|k| k.by_spend_id(s.key)) {
            e.take_spent(s.requests, s.tokens);
            if let Some(c) = &e.spend {
                shadow.record(s.key, c.limits, s.requests, s.tokens, now);
            }
            applied += 1;
        }
    }
    drop(shadow);
    if applied > 0 {
        sync.count("spend_applied", applied);
    }
    if applied < spent.len() as u64 {
        sync.count("spend_unknown_key", spent.len() as u64 - applied);
    }
}

/// How [`commit`] takes the router's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
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
pub(crate) async fn commit(state: &AppState, r: &RoutedEvent, worker: WorkerId, wait: Wait) -> bool {
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
        // A reference is resolved before it gets here (`ReplicaSync::resolve`).
        WirePrefix::None | WirePrefix::TextRef { .. } => {}
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
        tracing::warn!("no snapshot: NATS is not reachable; routing on local state");
        return;
    }
    // The events name workers by URL: those registered in etcd must be in the fleet first
    // (the answer waits in the subscription meanwhile).
    if !state.registry_settled(crate::app::REGISTRY_WAIT).await {
        tracing::warn!("etcd's workers not listed yet: applying the snapshot for the workers known now");
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut from: Option<String> = None;
    let (mut applied, mut unknown, mut next_part) = (0u64, 0u64, 0u32);
    loop {
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(m)) => m,
            // The client buffers the ask while NATS is down, so an unreachable server
            // shows only here, as silence.
            Ok(None) | Err(_) if client.connection_state() != async_nats::connection::State::Connected => {
                tracing::warn!("no snapshot: NATS is not reachable; routing on local state");
                break;
            }
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
        take_spent(state, sync, &chunk.spent);
        for mut r in chunk.events {
            sync.resolve(&mut r);
            if let Some(w) = state.fleet.by_url(&r.worker) {
                commit(state, &r, w.id, Wait::Block).await;
                applied += 1;
                sync.recent.lock().push(Arc::new(r));
            } else {
                unknown += 1;
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
    sync.count("unknown_worker", unknown);
    let _ = sub.unsubscribe().await;
}

/// Answers snapshot requests (one replica of the queue group answers each): how far the
/// limited API keys' buckets are spent ([`SpendShadow`]), then the recent routed events, in
/// parts that fit a NATS message.
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
        let spent = sync.shadow.lock().spent_at(sync.clock_ns());
        let parts = snapshot_parts(&sync.replica, &events, spent, max_message(&client) / 2);
        let n = parts.len();
        for c in &parts {
            if !publish_chunk(&client, &reply, c).await {
                break;
            }
        }
        tracing::info!(events = events.len(), parts = n, "snapshot sent to a starting replica");
    }
}

/// A snapshot answer's parts, each of about `limit` bytes at most: the keys' spends, then
/// the events, numbered from 0, the last marked (one empty part when there is nothing).
fn snapshot_parts(
    replica: &str,
    events: &[Arc<RoutedEvent>],
    spent: Vec<KeySpend>,
    limit: usize,
) -> Vec<SnapshotChunk> {
    let part = |part: usize| SnapshotChunk {
        replica: replica.to_string(),
        part: part.min(u32::MAX as usize) as u32,
        last: false,
        events: Vec::new(),
        spent: Vec::new(),
    };
    let mut parts = Vec::new();
    for keys in spent.chunks((limit / 32).max(1)) {
        parts.push(SnapshotChunk { spent: keys.to_vec(), ..part(parts.len()) });
    }
    let mut chunk = part(parts.len());
    let mut size = 64;
    for e in events {
        size += e.size_estimate();
        chunk.events.push(e.as_ref().clone());
        if size > limit {
            let next = part(parts.len() + 1);
            parts.push(std::mem::replace(&mut chunk, next));
            size = 64;
        }
    }
    if !chunk.events.is_empty() || parts.is_empty() {
        parts.push(chunk);
    }
    if let Some(l) = parts.last_mut() {
        l.last = true;
    }
    parts
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
    use crate::fleet::Fleet;
    use kvroute_core::types::Health;

    /// The report as it was first written (every worker looked up by URL each batch): the
    /// reference [`LoadReport::changes`] must agree with.
    fn reference_changes(
        sent: &mut HashMap<Arc<str>, WorkerLoad>,
        full_at: &mut Option<Instant>,
        fleet: &Fleet,
        now: Instant,
    ) -> Vec<WireLoad> {
        let full = full_at.is_none_or(|t| now.duration_since(t) >= HEARTBEAT);
        let list = fleet.load();
        let mut out = Vec::new();
        for w in list.iter() {
            let l = w.load.get();
            let prev = sent.get(&*w.url).copied();
            if l != prev.unwrap_or_default() || (full && prev.is_some()) {
                out.push(WireLoad::of(&w.url, l));
                sent.insert(Arc::clone(&w.url), l);
            }
        }
        if full {
            *full_at = Some(now);
            let gone: Vec<Arc<str>> = sent.keys().filter(|u| list.by_url(u).is_none()).cloned().collect();
            for u in gone {
                sent.remove(&u);
                out.push(WireLoad::of(&u, WorkerLoad::default()));
            }
            sent.retain(|_, l| *l != WorkerLoad::default());
        }
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// Whatever the workers' load, membership and the time between batches, the report
        /// sends what the reference sends (in any order: each worker at most once).
        #[test]
        fn the_load_report_sends_what_a_look_up_of_every_worker_sends(
            ops in proptest::collection::vec((0u8..5, 0usize..6, 0u64..1200), 1..150),
        ) {
            let f = Fleet::default();
            let url = |i: usize| format!("http://10.0.0.{i}:8000");
            let mut tickets: Vec<(usize, kvroute_core::ledger::LoadTicket)> = Vec::new();
            let (mut report, mut sent, mut full_at) = (LoadReport::default(), HashMap::new(), None);
            let mut now = Instant::now();
            let sorted = |mut v: Vec<WireLoad>| {
                v.sort_by(|a, b| a.worker.cmp(&b.worker));
                v.into_iter().map(|l| (l.worker.clone(), l.load())).collect::<Vec<_>>()
            };
            for (op, i, ms) in ops {
                match op {
                    0 | 1 => {
                        if let Some(w) = f.by_url(&url(i)) {
                            tickets.push((i, w.load.dispatched(ms, 1)));
                        }
                    }
                    2 => {
                        if let Some(at) = tickets.iter().position(|(w, _)| *w == i) {
                            tickets.swap_remove(at);
                        }
                    }
                    3 => {
                        f.add(&url(i), vec![], Health::Healthy).expect("room");
                    }
                    _ => {
                        f.remove(&url(i));
                    }
                }
                now += Duration::from_millis(ms);
                let got = sorted(report.changes(&f, now));
                let want = sorted(reference_changes(&mut sent, &mut full_at, &f, now));
                proptest::prop_assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn load_totals_go_when_they_change_and_again_each_heartbeat_with_zeros_once() {
        let f = Fleet::default();
        let (a, b) = ("http://a:8000", "http://b:8000");
        let wa = f.add(a, vec![], Health::Healthy).expect("room").0;
        f.add(b, vec![], Health::Healthy).expect("room");
        let mut r = LoadReport::default();
        let t0 = Instant::now();
        let urls = |v: &[WireLoad]| v.iter().map(|l| (l.worker.clone(), l.in_flight)).collect::<Vec<_>>();
        assert!(r.changes(&f, t0).is_empty(), "idle workers report nothing");
        let ticket = wa.load.dispatched(100, 10);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let first = r.changes(&f, at(10));
        assert_eq!(urls(&first), [(a.to_string(), 1)]);
        assert_eq!(first[0].load(), wa.load.get(), "the worker's own counters");
        assert!(r.changes(&f, at(20)).is_empty(), "unchanged");
        assert_eq!(urls(&r.changes(&f, at(1000))), [(a.to_string(), 1)], "again at the heartbeat");
        drop(ticket);
        assert_eq!(urls(&r.changes(&f, at(1010))), [(a.to_string(), 0)], "the drop to zero");
        assert_eq!(urls(&r.changes(&f, at(2000))), [(a.to_string(), 0)], "the zero once more at the heartbeat");
        assert!(r.changes(&f, at(3000)).is_empty(), "then nothing");
        let _held = wa.load.dispatched(1, 1);
        r.changes(&f, at(3010));
        f.remove(a);
        assert_eq!(urls(&r.changes(&f, at(4000))), [(a.to_string(), 0)], "a worker gone goes as zeros");
        assert!(r.changes(&f, at(5000)).is_empty());
    }

    #[test]
    fn a_peer_s_totals_move_the_remote_counters_and_leave_with_it() {
        let f = Fleet::default();
        let (a, b) = ("http://a:8000", "http://b:8000");
        let wa = f.add(a, vec![], Health::Healthy).expect("room").0;
        let wb = f.add(b, vec![], Health::Healthy).expect("room").0;
        let l =
            |in_flight, p| WorkerLoad { in_flight, waiting: in_flight, pending_prefill_tokens: p, decode_tokens: 0 };
        let mut one = PeerLoad::default();
        let mut two = PeerLoad::default();
        one.apply(&f, &[WireLoad::of(a, l(3, 300)), WireLoad::of("http://unknown:1", l(9, 9))]);
        two.apply(&f, &[WireLoad::of(a, l(1, 10)), WireLoad::of(b, l(2, 20))]);
        assert_eq!(wa.remote_load.get(), l(4, 310));
        assert_eq!((one.in_flight, two.in_flight), (3, 3), "the unknown worker is skipped");
        one.apply(&f, &[WireLoad::of(a, l(1, 50))]);
        assert_eq!(wa.remote_load.get(), l(2, 60));
        // The worker removed and added again under its URL: a new entry, new counters.
        f.remove(b);
        let wb2 = f.add(b, vec![], Health::Healthy).expect("room").0;
        two.apply(&f, &[WireLoad::of(b, l(5, 5))]);
        assert_eq!((wb.remote_load.get(), wb2.remote_load.get()), (WorkerLoad::default(), l(5, 5)));
        assert_eq!(two.in_flight, 6);
        two.apply(&f, &[WireLoad::of(a, WorkerLoad::default())]);
        assert_eq!(wa.remote_load.get(), l(1, 50));
        drop(one);
        two.clear();
        assert_eq!((wa.remote_load.get(), wb2.remote_load.get()), (WorkerLoad::default(), WorkerLoad::default()));
        assert_eq!(two.in_flight, 0);
        // A report over many workers (the fleet indexed once): the same result.
        let many: Vec<_> =
            (0..12).map(|i| f.add(&format!("http://m{i}:8000"), vec![], Health::Healthy).expect("room").0).collect();
        let mut three = PeerLoad::default();
        let report: Vec<_> = (0..12).map(|i| WireLoad::of(&format!("http://m{i}:8000"), l(i + 1, 1))).collect();
        three.apply(&f, &report);
        assert_eq!(many[11].remote_load.get(), l(12, 1));
        assert_eq!(three.in_flight, (1..=12).sum::<u64>());
        drop(three);
        assert!(many.iter().all(|w| w.remote_load.get() == WorkerLoad::default()));
    }

    fn event(id: u64, text_bytes: usize) -> Arc<RoutedEvent> {
        Arc::new(RoutedEvent {
            id,
            model: "m".into(),
            worker: "http://127.0.0.1:1".into(),
            policy: "cache_aware".into(),
            prefix: WirePrefix::Text("x".repeat(text_bytes)),
            blocks: Vec::new(),
            block_tokens: 16,
            session: None,
            input_tokens: 1,
            output_tokens: None,
            uncached: 1,
            decode: 1,
            pool: 0,
            repeat: false,
        })
    }

    #[test]
    fn a_snapshot_sends_the_keys_spends_first_then_the_events_in_numbered_parts() {
        let spend = |key| KeySpend { key, requests: 1, tokens: 0 };
        let events: Vec<_> = (0..10).map(|i| event(i, 300)).collect();
        let parts = snapshot_parts("r", &events, (0..5).map(spend).collect(), 1100);
        let numbers: Vec<u32> = parts.iter().map(|p| p.part).collect();
        assert_eq!(numbers, (0..parts.len() as u32).collect::<Vec<_>>());
        assert_eq!(parts.iter().filter(|p| p.last).count(), 1);
        assert!(parts.last().expect("parts").last);
        assert_eq!(parts[0].spent.len(), 5, "1,100 bytes hold 34 spends of 32");
        assert!(parts[0].events.is_empty());
        let sent: Vec<u64> = parts.iter().flat_map(|p| p.events.iter().map(|e| e.id)).collect();
        assert_eq!(sent, (0..10).collect::<Vec<_>>(), "every event, in order");
        assert!(parts[1..].iter().all(|p| p.events.len() <= 3 && p.spent.is_empty()));
        // Many spends take several parts; nothing at all is one empty last part.
        let many = snapshot_parts("r", &[], (0..100).map(spend).collect(), 320);
        assert_eq!((many.len(), many.iter().map(|p| p.spent.len()).sum::<usize>()), (10, 100));
        assert!(many[9].last && !many[8].last);
        let none = snapshot_parts("r", &[], Vec::new(), 1000);
        assert_eq!(none.len(), 1);
        assert!(none[0].last && none[0].events.is_empty() && none[0].spent.is_empty());
    }
}
