//! Replica sync over NATS: the router replicas of one cluster share what each routed, so a
//! request sees the whole cluster's prefix state and in-flight load whichever replica it
//! lands on (`nats`, `cluster`).
//!
//! ```text
//! request path: a request whose commit the cluster applied in full within
//!   `sync_refresh_secs` sends nothing (the load totals carry its load); the others
//!   ──try_send──► queue (65,536) ──► publisher: batches ≤ 1,024 events gathered
//!                                                  over `sync_batch_ms` (20 ms), with this
//!                                                  replica's in-flight load per worker as
//!                                                  totals (those that changed; all each
//!                                                  heartbeat); a prompt's start the cluster
//!                                                  has seen goes as its chunk chain (`chunks`)
//!                                                  └─► kvroute.<cluster>.events  (msgpack)
//! kvroute.<cluster>.events ──► subscriber: skip own, count gaps, rebuild prompts, apply:
//!      routed     → the model's router commits it (prefix index, sessions) when it runs
//!                   the same policy
//!      load       → each worker's remote counters move from the peer's last totals to
//!                   these
//!      first token, done, and routed events of versions before totals → per-request
//!                   remote load tickets, as those versions send their load
//!      spent      → (beside the events) what the sender took from an API key's rate-limit
//!                   buckets, taken from this replica's buckets for the same key
//! kvroute.<cluster>.snapshot (queue group) ◄── a starting replica's request; one peer
//!      answers with its recent routed events in chunks; ready when they are applied or
//!      `sync_snapshot_timeout_secs` passes
//! ```
//!
//! The request path hashes what the request's commit reads (a map of the identities
//! applied in full, in 16 shards, says whether to send it), builds an event and
//! `try_send`s it to a bounded queue: a full queue, or NATS down, drops events (counted,
//! `kvroute_sync_events_total{outcome="dropped"}`) and never delays or fails a request.
//! Every batch carries the replica id and a sequence number; a receiver counts the
//! batches it never saw (`kvroute_sync_gaps_total`). A peer's load totals leave the counters when it says
//! goodbye, restarts or falls silent for [`PEER_SILENCE`]; remote load tickets (peers of
//! versions before totals) close on their `done` event, then, or [`TICKET_GRACE`] after
//! `request_timeout_secs`; so a replica that dies leaves no load behind.
//!
//! Dynamo's router replica sync (`--router-replica-sync`, NATS) and SMG's tree gossip
//! solve the same problem; Ray Serve's PrefixCacheAffinityRouter shares one tree actor.
//! Workers that publish KV events need no prefix sync (every replica subscribes to the
//! engines), but their load is shared all the same.

use crate::routers::ModelRouter;
use kvroute_core::ledger::WorkerLoad;
use kvroute_core::policy::RequestKey;
use kvroute_core::types::RequestView;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use tokio::sync::mpsc;

/// Events waiting to be published; beyond this the request path drops them.
pub const QUEUE: usize = 65_536;
/// Most events in one published batch.
pub const MAX_BATCH_EVENTS: usize = 1024;
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
/// Most bytes of routed events kept for snapshots (estimated; the prefix journal keeps
/// [`JOURNAL_MAX_BYTES`]).
pub const SNAPSHOT_MAX_BYTES: usize = 8 << 20;
/// Most bytes of routed events the prefix journal (`state_dir`) keeps (estimated).
pub const JOURNAL_MAX_BYTES: usize = 64 << 20;
/// Most routed events remembered as applied by the cluster (`sync_refresh_secs`), by a
/// hash of what their commit reads: about 2 MiB.
pub const ANNOUNCED_MAX: std::num::NonZeroUsize = std::num::NonZeroUsize::new(32_768).unwrap();
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
    /// Prompt text as the first `chunks` chunks of the chain named `base`, which every
    /// replica learned from earlier prompts ([`super::chunks`]), then `rest`. A receiver
    /// without the chain applies the event without its prompt (`outcome="unresolved"`).
    /// Replicas before this variant cannot read a batch that has one.
    TextRef {
        /// The last shared chunk's name.
        base: u64,
        /// Chunks shared.
        chunks: u32,
        /// The text after them.
        rest: String,
    },
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
    /// The cluster applied this same event in full within `sync_refresh_secs`: it came
    /// without its prompt and block hashes, and receivers open its load ticket and skip
    /// its commit (`kvroute_sync_events_total{outcome="repeat"}`). Sent by versions between
    /// repeats and load totals; this version sends no such event (its load totals carry
    /// the load) and reads theirs. Absent (false) when sent in full.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub repeat: bool,
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
    /// The event of dispatch `id` that `a` announces.
    pub fn of(a: &Announce<'_>, id: u64) -> RoutedEvent {
        a.commit_view().to_event(id, a.uncached, a.decode)
    }

    /// What a receiver's commit of this event reads, borrowed.
    fn commit_view(&self) -> CommitView<'_> {
        let prefix = match &self.prefix {
            WirePrefix::None => PrefixView::None,
            WirePrefix::Text(t) => PrefixView::Text(t),
            WirePrefix::Tokens(t) => PrefixView::Tokens(t),
            WirePrefix::Blocks(b, bs) => PrefixView::Blocks(Words::Plain(b), *bs),
            WirePrefix::TextRef { .. } => PrefixView::Unresolved,
        };
        CommitView {
            model: &self.model,
            worker: &self.worker,
            policy: &self.policy,
            session: self.session.as_deref(),
            prefix,
            blocks: Words::Plain(&self.blocks),
            block_tokens: self.block_tokens,
            pool: self.pool,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
        }
    }

    /// A hash of what a receiver's commit of this event reads (model, pool, policy,
    /// worker, prompt, block hashes, token counts, session): equal for two events whose
    /// commits record the same thing, and to [`Announce`]'s before its event is built.
    /// `None` for an event with nothing to commit or with an unresolved reference.
    pub(crate) fn commit_identity(&self) -> Option<u64> {
        self.commit_view().identity()
    }

    pub(crate) fn size_estimate(&self) -> usize {
        let prefix = match &self.prefix {
            WirePrefix::None => 0,
            WirePrefix::Text(t) => t.len(),
            WirePrefix::Tokens(t) => t.len() * 5,
            WirePrefix::Blocks(b, _) => b.len() * 9,
            WirePrefix::TextRef { rest, .. } => 16 + rest.len(),
        };
        // (A repeat has no prefix and no blocks.)
        200 + self.model.len() + self.worker.len() + prefix + self.blocks.len() * 9
    }
}

/// The hasher of [`RoutedEvent::commit_identity`]: every piece with its length first, so
/// that no two sequences of pieces hash the same bytes.
struct Identity(xxhash_rust::xxh3::Xxh3);

impl Identity {
    fn bytes(&mut self, b: &[u8]) {
        self.0.update(&(b.len() as u64).to_le_bytes());
        self.0.update(b);
    }

    /// `xs` in runs of 64 words (a long list costs a few calls, not one per word).
    fn words(&mut self, xs: impl IntoIterator<Item = u64>) {
        let mut xs = xs.into_iter();
        let mut buf = [0u8; 512];
        loop {
            let mut n = 0;
            for x in xs.by_ref().take(64) {
                buf[n..n + 8].copy_from_slice(&x.to_le_bytes());
                n += 8;
            }
            if n == 0 {
                break;
            }
            self.bytes(&buf[..n]);
        }
    }
}

/// Block hashes as a [`CommitView`] reads them: an event's own words, or a request key's
/// hashes (the same numbers).
#[derive(Clone, Copy)]
enum Words<'a> {
    Plain(&'a [u64]),
    Hashes(&'a [kvroute_core::types::BlockHash]),
}

impl Words<'_> {
    fn is_empty(self) -> bool {
        match self {
            Words::Plain(w) => w.is_empty(),
            Words::Hashes(h) => h.is_empty(),
        }
    }

    fn to_vec(self) -> Vec<u64> {
        match self {
            Words::Plain(w) => w.to_vec(),
            Words::Hashes(h) => h.iter().map(|h| h.0).collect(),
        }
    }

    fn hash_into(self, h: &mut Identity) {
        match self {
            Words::Plain(w) => h.words(w.iter().copied()),
            Words::Hashes(b) => h.words(b.iter().map(|x| x.0)),
        }
    }
}

/// A prefix key borrowed: [`WirePrefix`] as a commit reads it.
#[derive(Clone, Copy)]
enum PrefixView<'a> {
    None,
    Text(&'a str),
    Tokens(&'a [u32]),
    Blocks(Words<'a>, u32),
    /// A [`WirePrefix::TextRef`] not resolved: no identity.
    Unresolved,
}

/// What a routed event's commit reads, borrowed from the event
/// ([`RoutedEvent::commit_identity`]) or from the [`Announce`] it is built from, with the
/// event's limits applied ([`MAX_EVENT_TEXT`], [`MAX_EVENT_TOKENS`], [`MAX_EVENT_BLOCKS`]):
/// so the request path knows a request's identity, and whether the cluster applied it
/// already, before it builds anything.
struct CommitView<'a> {
    model: &'a str,
    worker: &'a str,
    policy: &'a str,
    session: Option<&'a str>,
    prefix: PrefixView<'a>,
    blocks: Words<'a>,
    block_tokens: u64,
    pool: u8,
    input_tokens: u32,
    output_tokens: Option<u32>,
}

impl CommitView<'_> {
    /// See [`RoutedEvent::commit_identity`].
    fn identity(&self) -> Option<u64> {
        if matches!(self.prefix, PrefixView::Unresolved)
            || matches!(self.prefix, PrefixView::None) && self.blocks.is_empty()
        {
            return None;
        }
        let mut h = Identity(xxhash_rust::xxh3::Xxh3::new());
        h.bytes(self.model.as_bytes());
        h.bytes(self.worker.as_bytes());
        h.bytes(self.policy.as_bytes());
        h.bytes(self.session.map_or(&[0xff][..], str::as_bytes));
        match self.prefix {
            PrefixView::None | PrefixView::Unresolved => h.bytes(&[0]),
            PrefixView::Text(t) => {
                h.bytes(&[1]);
                h.bytes(t.as_bytes());
            }
            PrefixView::Tokens(t) => {
                h.bytes(&[2]);
                h.words(t.iter().map(|&x| u64::from(x)));
            }
            PrefixView::Blocks(b, bs) => {
                h.bytes(&[3]);
                b.hash_into(&mut h);
                h.bytes(&bs.to_le_bytes());
            }
        }
        h.bytes(&[4]);
        self.blocks.hash_into(&mut h);
        h.bytes(&[5]);
        h.words([
            self.block_tokens,
            u64::from(self.pool),
            u64::from(self.input_tokens),
            self.output_tokens.map_or(u64::MAX, u64::from),
        ]);
        Some(h.0.digest())
    }

    /// The event of dispatch `id`, with `uncached` prompt tokens to prefill and `decode` to
    /// decode.
    fn to_event(&self, id: u64, uncached: u64, decode: u64) -> RoutedEvent {
        let prefix = match self.prefix {
            PrefixView::None | PrefixView::Unresolved => WirePrefix::None,
            PrefixView::Text(t) => WirePrefix::Text(t.to_string()),
            PrefixView::Tokens(t) => WirePrefix::Tokens(t.to_vec()),
            PrefixView::Blocks(b, bs) => WirePrefix::Blocks(b.to_vec(), bs),
        };
        RoutedEvent {
            id,
            model: self.model.to_string(),
            worker: self.worker.to_string(),
            policy: self.policy.to_string(),
            prefix,
            blocks: self.blocks.to_vec(),
            block_tokens: self.block_tokens,
            session: self.session.map(str::to_string),
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            uncached,
            decode,
            pool: self.pool,
            repeat: false,
        }
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
    /// The sender's last batch: it is stopping, and the receivers release what it had in
    /// flight at once instead of after [`PEER_SILENCE`]. Absent (false) from versions that
    /// did not send one.
    #[serde(default)]
    pub bye: bool,
    /// The sending process: random at each start ([`ReplicaSync::instance`]). Receivers
    /// follow each (replica, instance) apart, so two processes under one replica id (a
    /// misconfiguration) do not read as one replica whose sequence jumps back and forth,
    /// and a new instance is a restart. 0 from versions that did not send one.
    #[serde(default)]
    pub instance: u64,
    /// What the sender took from limited API keys' buckets since its last report of each
    /// key ([`crate::api_keys::ClusterSpend`]); absent when empty, and ignored by versions
    /// before it (a map field they do not know).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spent: Vec<KeySpend>,
    /// The sender shares its in-flight load as per-worker totals ([`Batch::load`]): a
    /// receiver opens no load ticket for its routed events, and the sender sends no event
    /// for a request the cluster applied in full within `sync_refresh_secs`, nor the
    /// first-token and done events of requests it did not send in full (it sends those
    /// for the full ones, which versions before totals hold tickets for). Absent (false)
    /// from those versions.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub load_totals: bool,
    /// With [`Batch::load_totals`]: the sender's own in-flight load on each worker whose
    /// totals changed since its previous batch, and on every worker at least every
    /// [`HEARTBEAT`]; a worker it no longer has load on goes once with zeros.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load: Vec<WireLoad>,
}

/// One worker's in-flight load as one replica reports it ([`Batch::load`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireLoad {
    /// The worker's URL (ids differ between replicas).
    pub worker: String,
    /// Requests dispatched and not yet closed.
    pub in_flight: u32,
    /// Of those, requests without a first token yet.
    pub waiting: u32,
    /// Uncached prompt tokens of the waiting requests.
    pub prefill: u64,
    /// Prompt + expected output tokens of requests past their first token.
    pub decode: u64,
}

impl WireLoad {
    /// `l` on `worker`.
    pub fn of(worker: &str, l: WorkerLoad) -> WireLoad {
        WireLoad {
            worker: worker.to_string(),
            in_flight: l.in_flight,
            waiting: l.waiting,
            prefill: l.pending_prefill_tokens,
            decode: l.decode_tokens,
        }
    }

    /// The counters it reports.
    pub fn load(&self) -> WorkerLoad {
        WorkerLoad {
            in_flight: self.in_flight,
            waiting: self.waiting,
            pending_prefill_tokens: self.prefill,
            decode_tokens: self.decode,
        }
    }
}

/// Requests and tokens one replica admitted for one API key ([`Batch::spent`]).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeySpend {
    /// The key's [`crate::api_keys::ClusterSpend::id`].
    pub key: u64,
    /// Requests taken from its request bucket.
    pub requests: u64,
    /// Tokens taken from its token bucket.
    pub tokens: u64,
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
    /// What limited API keys' buckets hold spent now, as the answering replica follows the
    /// cluster's spends ([`SpendShadow`]): the starting replica takes it from its full
    /// buckets, so a restart does not hand every key a fresh minute. Absent when empty,
    /// and ignored by versions before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spent: Vec<KeySpend>,
}

/// How far each limited API key's buckets are spent, as this replica follows the cluster's
/// spends (its own and the ones it applied): a shadow of the buckets' GCRA (the `governor`
/// crate's algorithm, which does not expose its state), kept by the sync's tasks off the
/// request path, for the snapshot a starting replica asks for. Per key and bucket, the
/// theoretical arrival time `tat`: a spend of `n` cells at `t` moves it to
/// `max(tat, t) + n × T` (T = one minute over the limit), never past `t` + one minute (a
/// bucket never owes); the cells spent at `t` are `(tat − t) / T`, rounded up. Keys whose
/// buckets are full again are forgotten when a snapshot reads the shadow
/// ([`SpendShadow::spent_at`]) or the map grows past twice [`crate::api_keys::MAX_KEYS`]:
/// one entry per limited key spent from in the last minute, and a spend is recorded only
/// for a key a key file lists. A spend a starting replica receives live while its snapshot
/// is being answered may be in both: it then takes that spend twice (it errs towards
/// refusing).
#[derive(Debug, Default)]
pub struct SpendShadow {
    keys: std::collections::HashMap<u64, Shadow>,
}

#[derive(Debug, Clone, Copy)]
struct Shadow {
    /// Requests and tokens per minute.
    limits: (u32, u32),
    /// The two buckets' theoretical arrival times, ns on the caller's clock.
    tat: [u64; 2],
}

/// A minute, ns: every bucket holds one minute of its limit.
const MINUTE_NS: u64 = 60_000_000_000;

impl SpendShadow {
    /// Records `requests` and `tokens` spent at `now` (ns) for key `id` with `limits`.
    pub fn record(&mut self, id: u64, limits: (u32, u32), requests: u64, tokens: u64, now: u64) {
        // Keys a reload removed are forgotten once their buckets are full again: by a
        // snapshot's read, or here when the map has grown past twice the keys a file holds.
        if self.keys.len() >= 2 * crate::api_keys::MAX_KEYS && !self.keys.contains_key(&id) {
            self.keys.retain(|_, s| s.tat.iter().any(|&t| t > now));
        }
        let s = self.keys.entry(id).or_insert(Shadow { limits, tat: [0, 0] });
        s.limits = limits;
        for (i, (limit, n)) in [(limits.0, requests), (limits.1, tokens)].into_iter().enumerate() {
            if limit > 0 && n > 0 {
                let t = MINUTE_NS / u64::from(limit);
                let tat = s.tat[i].max(now).saturating_add(n.saturating_mul(t));
                s.tat[i] = tat.min(now + MINUTE_NS);
            }
        }
    }

    /// The cells each key's buckets hold spent at `now` (ns), keys with nothing spent left
    /// out; forgets those.
    pub fn spent_at(&mut self, now: u64) -> Vec<KeySpend> {
        self.keys.retain(|_, s| s.tat.iter().any(|&t| t > now));
        let cells = |tat: u64, limit: u32| {
            // Rounded up: a bucket short of part of a cell has no cell to give.
            if limit == 0 { 0 } else { tat.saturating_sub(now).div_ceil(MINUTE_NS / u64::from(limit)) }
        };
        self.keys
            .iter()
            .map(|(&key, s)| KeySpend {
                key,
                requests: cells(s.tat[0], s.limits.0),
                tokens: cells(s.tat[1], s.limits.1),
            })
            .filter(|k| k.requests > 0 || k.tokens > 0)
            .collect()
    }

    /// Keys followed.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is followed.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[derive(Debug)]
pub(crate) enum Out {
    /// A routed event the cluster did not apply in full within `sync_refresh_secs`.
    Routed(Box<RoutedEvent>),
    FirstToken(u64),
    Done(u64),
    /// A key's spend to report ([`ReplicaSync::spent`]); its counts are taken when the
    /// batch is built.
    Spent(Arc<crate::api_keys::ClusterSpend>),
}

/// Recent routed events (this replica's and the ones it applied), the source of snapshots
/// and of the prefix journal: at most [`SNAPSHOT_MAX_EVENTS`] and `max_bytes` (estimated).
#[derive(Debug)]
pub(crate) struct Recent {
    pub(crate) events: VecDeque<Arc<RoutedEvent>>,
    pub(crate) bytes: usize,
    max_bytes: usize,
}

impl Recent {
    /// An empty log of at most `max_bytes` (estimated).
    pub(crate) fn bounded(max_bytes: usize) -> Self {
        Recent { events: VecDeque::new(), bytes: 0, max_bytes }
    }

    pub(crate) fn push(&mut self, e: Arc<RoutedEvent>) {
        self.bytes += e.size_estimate();
        self.events.push_back(e);
        while self.events.len() > SNAPSHOT_MAX_EVENTS || self.bytes > self.max_bytes {
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
    /// This process's instance under that id: random at each start, never 0 ([`Batch::instance`]).
    pub instance: u64,
    pub(crate) events_subject: String,
    pub(crate) snapshot_subject: String,
    tx: mpsc::Sender<Out>,
    pub(crate) rx: Mutex<Option<mpsc::Receiver<Out>>>,
    next_id: AtomicU64,
    pub(crate) ready: AtomicBool,
    pub(crate) recent: Mutex<Recent>,
    /// Prompt text chunks this replica announced or applied ([`super::chunks`]).
    pub(crate) chunks: Mutex<super::chunks::ChunkStore>,
    /// The cluster's API-key spends, followed for snapshots ([`SpendShadow`]).
    pub(crate) shadow: Mutex<SpendShadow>,
    /// When the routed events this replica sent or applied in full were last sent, by
    /// [`RoutedEvent::commit_identity`] (seconds on [`ReplicaSync::clock_secs`]; at most
    /// [`ANNOUNCED_MAX`], least recently used out): [`ANNOUNCED_SHARDS`] maps by the
    /// identity's top bits, so requests read it without one lock for all.
    announced: Box<[Mutex<Announced>]>,
    /// `kvroute_sync_events_total{outcome="repeat_skipped"}`, counted on the request path.
    repeat_skipped: prometheus_client::metrics::counter::Counter,
    /// Wakes the publisher when a request that queued no event changed the load (its
    /// dispatch, first token and end): the totals then go within `sync_batch_ms`.
    pub(crate) load_changed: tokio::sync::Notify,
    /// `sync_refresh_secs`: a request whose event the cluster applied in full within it
    /// is not sent (its load goes in the totals); 0 = never.
    refresh_secs: u64,
    /// `sync_batch_ms`: how long the publisher gathers events after the first of a batch.
    pub(crate) batch_window: Duration,
    /// The chunks' clock ([`ReplicaSync::clock_secs`]).
    started: std::time::Instant,
    outcomes: prometheus_client::metrics::family::Family<
        crate::metrics::OutcomeLabel,
        prometheus_client::metrics::counter::Counter,
    >,
}

/// One shard of [`ReplicaSync::announced`].
type Announced = lru::LruCache<u64, u64, foldhash::fast::FixedState>;

/// Shards of the map of routed events applied in full (a power of two).
const ANNOUNCED_SHARDS: usize = 16;
/// Entries of one shard.
const ANNOUNCED_SHARD_MAX: std::num::NonZeroUsize =
    std::num::NonZeroUsize::new(ANNOUNCED_MAX.get() / ANNOUNCED_SHARDS).unwrap();

/// A dispatch's sync handle: sends `first token` once and `done` when dropped, for a
/// dispatch whose routed event was queued; for one left to the load totals it wakes the
/// publisher instead, so the totals go within `sync_batch_ms`.
#[derive(Debug)]
pub struct SharedTicket {
    sync: Arc<ReplicaSync>,
    id: u64,
    first: bool,
    queued: bool,
}

impl SharedTicket {
    /// The first token came back.
    pub fn first_token(&mut self) {
        if !self.first {
            self.first = true;
            if self.queued {
                self.sync.send(Out::FirstToken(self.id));
            } else {
                self.sync.load_changed.notify_one();
            }
        }
    }
}

impl Drop for SharedTicket {
    fn drop(&mut self) {
        if self.queued {
            self.sync.send(Out::Done(self.id));
        } else {
            self.sync.load_changed.notify_one();
        }
    }
}

/// What [`ReplicaSync::routed`] announces: `req`, decided by `router` on `key` in `pool`, was
/// sent to `worker_url` with `uncached` prompt tokens to prefill and `decode` to decode.
#[derive(Clone, Copy)]
pub struct Announce<'a> {
    /// The pool whose routers decided.
    pub pool: Pool,
    /// The model's router that decided (its policy name; whether it indexes prompts).
    pub router: &'a ModelRouter,
    /// The request's key (block hashes).
    pub key: &'a RequestKey,
    /// The request.
    pub req: &'a RequestView<'a>,
    /// The worker it was sent to.
    pub worker_url: &'a str,
    /// Prompt tokens the worker prefills.
    pub uncached: u64,
    /// Tokens the worker decodes.
    pub decode: u64,
}

/// `t`'s first [`MAX_EVENT_TEXT`] bytes at most, cut at a character boundary.
fn cut_text(t: &str) -> &str {
    &t[..t.floor_char_boundary(MAX_EVENT_TEXT)]
}

impl<'a> Announce<'a> {
    /// What the commit of the event it announces reads ([`RoutedEvent::of`] builds the
    /// event from it). Only a policy that indexes the prompt itself needs the prompt; the
    /// others record the key's block hashes (`blocks`), 9 bytes per block instead of the
    /// prompt's bytes.
    fn commit_view(&self) -> CommitView<'a> {
        let Announce { pool, router, key, req, worker_url, .. } = *self;
        let prefix = if !router.records_request_prefix {
            PrefixView::None
        } else if let Some(t) = req.text.filter(|t| !t.is_empty()) {
            PrefixView::Text(cut_text(t))
        } else if let Some(t) = req.token_ids.filter(|t| !t.is_empty()) {
            PrefixView::Tokens(&t[..t.len().min(MAX_EVENT_TOKENS)])
        } else if let Some(b) = req.blocks.filter(|b| !b.hashes.is_empty()) {
            PrefixView::Blocks(Words::Hashes(&b.hashes[..b.hashes.len().min(MAX_EVENT_BLOCKS)]), b.block_tokens)
        } else {
            PrefixView::None
        };
        CommitView {
            model: req.model,
            worker: worker_url,
            policy: &router.policy_name,
            session: req.session_id,
            prefix,
            blocks: Words::Hashes(&key.blocks[..key.blocks.len().min(MAX_EVENT_BLOCKS)]),
            block_tokens: key.block_tokens,
            pool: pool as u8,
            input_tokens: req.input_tokens,
            output_tokens: req.output_tokens,
        }
    }
}

impl ReplicaSync {
    /// The sync of a replica named `replica` (a random id when `None`) in `cluster`, whose
    /// events the cluster applied in full within `refresh_secs` are not sent (0: all are;
    /// `sync_refresh_secs`) and the others published in batches gathered over `batch_window`
    /// after their first event (`sync_batch_ms`); it sends nothing until
    /// [`super::sync_task::run`] connects it.
    pub fn new(
        cluster: &str,
        replica: Option<&str>,
        refresh_secs: u64,
        batch_window: Duration,
        metrics: &crate::metrics::Metrics,
    ) -> Arc<Self> {
        let replica = replica.map_or_else(random_id, str::to_string);
        let (tx, rx) = mpsc::channel(QUEUE);
        for outcome in ["published", "dropped", "applied", "repeat", "repeat_skipped", "unresolved"] {
            drop(metrics.sync_events.get_or_create(&crate::metrics::OutcomeLabel { outcome: outcome.into() }));
        }
        let repeat_skipped = metrics
            .sync_events
            .get_or_create(&crate::metrics::OutcomeLabel { outcome: "repeat_skipped".into() })
            .clone();
        Arc::new(ReplicaSync {
            replica,
            instance: crate::model::random::os_random_u64().max(1),
            events_subject: format!("kvroute.{cluster}.events"),
            snapshot_subject: format!("kvroute.{cluster}.snapshot"),
            tx,
            rx: Mutex::new(Some(rx)),
            next_id: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            recent: Mutex::new(Recent::bounded(SNAPSHOT_MAX_BYTES)),
            chunks: Mutex::default(),
            shadow: Mutex::default(),
            announced: (0..ANNOUNCED_SHARDS)
                .map(|_| {
                    Mutex::new(lru::LruCache::with_hasher(ANNOUNCED_SHARD_MAX, foldhash::fast::FixedState::default()))
                })
                .collect(),
            repeat_skipped,
            load_changed: tokio::sync::Notify::new(),
            refresh_secs,
            batch_window,
            started: std::time::Instant::now(),
            outcomes: metrics.sync_events.clone(),
        })
    }

    /// Seconds since this sync was made: the clock of the chunks' refresh
    /// ([`super::chunks::REFRESH_SECS`]).
    fn clock_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Nanoseconds since this sync was made: the clock of [`SpendShadow`].
    pub(crate) fn clock_ns(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64
    }

    /// Whether the start-up snapshot was applied (or its wait ended).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Relaxed)
    }

    /// Queues `e` for the publisher; `false` (counted as dropped) when the queue is full.
    fn send(&self, e: Out) -> bool {
        let queued = self.tx.try_send(e).is_ok();
        if !queued {
            self.count("dropped", 1);
        }
        queued
    }

    pub(crate) fn count(&self, outcome: &str, n: u64) {
        self.outcomes.get_or_create(&crate::metrics::OutcomeLabel { outcome: outcome.into() }).inc_by(n);
    }

    /// `r` as it goes on the wire: a prompt text as the chunk chain the cluster already
    /// holds and the rest ([`WirePrefix::TextRef`]) when it shares one, else as it is.
    pub(crate) fn on_the_wire(&self, r: &mut RoutedEvent) -> RoutedEvent {
        self.on_the_wire_at(r, self.clock_secs())
    }

    /// [`ReplicaSync::on_the_wire`] at `now`, seconds on [`ReplicaSync::clock_secs`].
    fn on_the_wire_at(&self, r: &mut RoutedEvent, now: u64) -> RoutedEvent {
        // The prompt is set aside while the rest of the event is cloned.
        let prompt = std::mem::replace(&mut r.prefix, WirePrefix::None);
        let mut wire = r.clone();
        wire.prefix = match &prompt {
            WirePrefix::Text(t) => {
                let e = self.chunks.lock().encode_at(t, now);
                if e.chunks == 0 {
                    WirePrefix::Text(e.rest)
                } else {
                    WirePrefix::TextRef { base: e.base, chunks: e.chunks, rest: e.rest }
                }
            }
            other => other.clone(),
        };
        r.prefix = prompt;
        wire
    }

    /// The shard of [`ReplicaSync::announced`] that holds `identity`.
    fn announced(&self, identity: u64) -> &Mutex<Announced> {
        &self.announced[(identity >> (64 - ANNOUNCED_SHARDS.trailing_zeros())) as usize]
    }

    /// Whether an event whose commit reads `v` goes to the cluster at `now`: `false` when
    /// its policy's commits are idempotent (`may_repeat`), `sync_refresh_secs` is not 0 and
    /// the cluster applied the same event in full within it — the load totals then carry
    /// its load ([`Batch::load`]); else it is remembered as applied at `now` and its
    /// identity returned with `true` (`None`: nothing to remember).
    fn goes_in_full(&self, v: &CommitView<'_>, may_repeat: bool, now: u64) -> (bool, Option<u64>) {
        if !may_repeat || self.refresh_secs == 0 {
            return (true, None);
        }
        let Some(id) = v.identity() else { return (true, None) };
        let mut seen = self.announced(id).lock();
        if seen.get(&id).is_some_and(|&t| now.saturating_sub(t) < self.refresh_secs) {
            return (false, None);
        }
        seen.put(id, now);
        (true, Some(id))
    }

    /// Remembers that another replica's event `r` (its reference resolved) was applied
    /// here in full now: this replica's own event for the same commit is not sent until
    /// `refresh_secs` have passed.
    pub(crate) fn applied_in_full(&self, r: &RoutedEvent) {
        if self.refresh_secs == 0 {
            return;
        }
        if let Some(id) = r.commit_identity() {
            self.announced(id).lock().put(id, self.clock_secs());
        }
    }

    /// Turns a received event's [`WirePrefix::TextRef`] back into its text, and learns the
    /// chunks of any text it carries. `false` when the chain is not known here: the prefix
    /// is then [`WirePrefix::None`] (the event's load and blocks still apply).
    pub(crate) fn resolve(&self, r: &mut RoutedEvent) -> bool {
        match std::mem::replace(&mut r.prefix, WirePrefix::None) {
            WirePrefix::TextRef { base, chunks, rest } => {
                let e = super::chunks::Encoded { base, chunks, rest };
                match self.chunks.lock().resolve_at(&e, self.clock_secs()) {
                    Some(t) => r.prefix = WirePrefix::Text(t),
                    None => return false,
                }
            }
            WirePrefix::Text(t) => {
                self.chunks.lock().learn_at(&t, self.clock_secs());
                r.prefix = WirePrefix::Text(t);
            }
            other => r.prefix = other,
        }
        true
    }

    /// Counts `requests` and `tokens` taken from a limited API key's buckets here, for the
    /// other replicas to take from theirs ([`Batch::spent`]). Never blocks: the key is
    /// queued once until its next batch; when the queue is full its counts wait for the
    /// key's next request.
    pub fn spent(&self, spend: &Arc<crate::api_keys::ClusterSpend>, requests: u64, tokens: u64) {
        if spend.add(requests, tokens) && self.tx.try_send(Out::Spent(Arc::clone(spend))).is_err() {
            spend.unqueue();
        }
    }

    /// Announces that a request was sent (see [`Announce`]). Never blocks: a full queue
    /// drops the event. A request whose event the cluster applied in full within
    /// `sync_refresh_secs` builds and queues nothing
    /// (`kvroute_sync_events_total{outcome="repeat_skipped"}`): the load totals carry its
    /// load.
    pub fn routed(self: &Arc<Self>, a: Announce<'_>) -> SharedTicket {
        let id = self.next_id.fetch_add(1, Relaxed);
        let queued = self.announce_at(&a, id, self.clock_secs());
        SharedTicket { sync: Arc::clone(self), id, first: false, queued }
    }

    /// Queues `a`'s event as dispatch `id` unless it goes as load only at `now`
    /// ([`ReplicaSync::goes_in_full`]); whether it was queued.
    fn announce_at(&self, a: &Announce<'_>, id: u64, now: u64) -> bool {
        let view = a.commit_view();
        let (full, remembered) = self.goes_in_full(&view, a.router.idempotent_commits, now);
        if !full {
            self.repeat_skipped.inc();
            self.load_changed.notify_one();
            return false;
        }
        let queued = self.send(Out::Routed(Box::new(view.to_event(id, a.uncached, a.decode))));
        if !queued && let Some(identity) = remembered {
            // Not sent after all: the next such request goes in full.
            self.announced(identity).lock().pop(&identity);
        }
        queued
    }
}

fn random_id() -> String {
    format!("r{:016x}", crate::model::random::os_random_u64())
}

pub(crate) fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
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
            bye: false,
            instance: 9,
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
                    repeat: false,
                }),
                WireEvent::FirstToken(3),
                WireEvent::Done(3),
            ],
            spent: vec![KeySpend { key: 5, requests: 1, tokens: 300 }],
            load_totals: true,
            load: vec![WireLoad::of(
                "http://127.0.0.1:1",
                WorkerLoad { in_flight: 1, waiting: 1, pending_prefill_tokens: 9, decode_tokens: 0 },
            )],
        };
        let bytes = rmp_serde::to_vec_named(&b).expect("encode");
        assert_eq!(rmp_serde::from_slice::<Batch>(&bytes).expect("decode"), b);
    }

    #[test]
    fn key_spends_are_a_field_older_replicas_skip_and_absent_from_their_batches() {
        // The batch as replicas before `spent` read and wrote it.
        #[derive(Debug, Serialize, Deserialize, PartialEq)]
        struct Older {
            replica: String,
            seq: u64,
            sent_unix_ns: u64,
            events: Vec<WireEvent>,
            bye: bool,
            instance: u64,
        }
        let new = Batch {
            replica: "r1".into(),
            seq: 2,
            sent_unix_ns: 3,
            events: vec![WireEvent::Done(4)],
            bye: false,
            instance: 5,
            spent: vec![KeySpend { key: 6, requests: 1, tokens: 7 }],
            load_totals: true,
            load: vec![WireLoad::of("http://w:1", WorkerLoad { in_flight: 2, ..WorkerLoad::default() })],
        };
        let older: Older = rmp_serde::from_slice(&rmp_serde::to_vec_named(&new).expect("encode")).expect("decode");
        assert_eq!(older.events, new.events, "an older replica still reads the events");
        let from_older: Batch =
            rmp_serde::from_slice(&rmp_serde::to_vec_named(&older).expect("encode")).expect("decode");
        assert!(from_older.spent.is_empty());
        assert!(!from_older.load_totals && from_older.load.is_empty(), "an older replica's load goes per request");
        let no_spend = Batch { spent: Vec::new(), load_totals: false, load: Vec::new(), ..new };
        assert_eq!(
            rmp_serde::to_vec_named(&no_spend).expect("encode"),
            rmp_serde::to_vec_named(&older).expect("encode"),
            "a batch without spends or load totals is encoded as before"
        );
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

    fn routed_with(prefix: WirePrefix) -> RoutedEvent {
        RoutedEvent {
            id: 1,
            model: "m".into(),
            worker: "http://127.0.0.1:9".into(),
            policy: "cache_aware".into(),
            prefix,
            blocks: Vec::new(),
            block_tokens: 0,
            session: None,
            input_tokens: 900,
            output_tokens: Some(4),
            uncached: 900,
            decode: 4,
            pool: 0,
            repeat: false,
        }
    }

    /// `e` as another replica decodes it.
    fn over_the_wire(e: &RoutedEvent) -> RoutedEvent {
        let bytes = rmp_serde::to_vec_named(&WireEvent::Routed(e.clone())).expect("encode");
        match rmp_serde::from_slice(&bytes).expect("decode") {
            WireEvent::Routed(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_prompt_whose_start_the_cluster_has_seen_goes_as_a_reference_and_comes_back_whole() {
        let metrics = crate::metrics::Metrics::new();
        let (a, b, late) = (
            ReplicaSync::new("c", Some("a"), 10, Duration::from_millis(5), &metrics),
            ReplicaSync::new("c", Some("b"), 10, Duration::from_millis(5), &metrics),
            ReplicaSync::new("c", Some("late"), 10, Duration::from_millis(5), &metrics),
        );
        let document: String = (0..600).map(|i| format!("w{} ", i * 7919 % 1009)).collect();
        let first = format!("{document}first question?");
        let w1 = a.on_the_wire(&mut routed_with(WirePrefix::Text(first.clone())));
        assert_eq!(w1.prefix, WirePrefix::Text(first.clone()), "nothing is shared yet");
        let mut r1 = over_the_wire(&w1);
        assert!(b.resolve(&mut r1));
        assert_eq!(r1.prefix, WirePrefix::Text(first));

        let second = format!("{document}and a second question?");
        let w2 = a.on_the_wire(&mut routed_with(WirePrefix::Text(second.clone())));
        let WirePrefix::TextRef { rest, .. } = &w2.prefix else { panic!("{:?}", w2.prefix) };
        assert!(rest.len() < 300 && w2.size_estimate() < 600, "{} bytes of {}", rest.len(), second.len());
        let mut r2 = over_the_wire(&w2);
        assert!(b.resolve(&mut r2));
        assert_eq!(r2, routed_with(WirePrefix::Text(second)), "everything else as sent");

        // A replica that never saw the document applies the event without its prompt.
        let mut r3 = over_the_wire(&w2);
        assert!(!late.resolve(&mut r3));
        assert_eq!(r3, routed_with(WirePrefix::None));
    }

    #[test]
    fn an_event_the_cluster_applied_in_full_is_not_sent_again_until_its_refresh() {
        let metrics = crate::metrics::Metrics::new();
        let (a, b, never) = (
            ReplicaSync::new("c", Some("a"), 10, Duration::from_millis(5), &metrics),
            ReplicaSync::new("c", Some("b"), 10, Duration::from_millis(5), &metrics),
            ReplicaSync::new("c", Some("n"), 0, Duration::from_millis(5), &metrics),
        );
        let event = |p: WirePrefix| RoutedEvent { blocks: vec![7, 8], ..routed_with(p) };
        let goes = |s: &ReplicaSync, e: &RoutedEvent, may_repeat: bool, now: u64| {
            s.goes_in_full(&e.commit_view(), may_repeat, now).0
        };
        let r = event(WirePrefix::Text("a system prompt and a question".into()));
        assert!(goes(&a, &r, true, 0));
        // The same event within the refresh: not sent (the load totals carry its load).
        assert!(!goes(&a, &r, true, 9));
        assert!(goes(&a, &r, true, 10), "the refresh sends it whole again");
        // Another worker, another prompt, a session: not the same commit (each then
        // repeats in its turn).
        let other_worker = RoutedEvent { worker: "http://127.0.0.1:2".into(), ..r.clone() };
        let other_prompt = event(WirePrefix::Text("another question".into()));
        let with_session = RoutedEvent { session: Some("s".into()), ..r.clone() };
        let other_session = RoutedEvent { session: Some("t".into()), ..r.clone() };
        for e in [other_worker, other_prompt, with_session, other_session] {
            assert!(goes(&a, &e, true, 11), "{e:?}");
            assert!(!goes(&a, &e, true, 12), "{e:?}");
        }
        // A policy whose commits are not idempotent (B3 capped counts a session's turns).
        for now in [13, 14] {
            assert!(goes(&a, &r, false, now));
        }
        // A replica that applied a peer's full event does not send its own.
        let mut got = over_the_wire(&a.on_the_wire(&mut r.clone()));
        assert!(b.resolve(&mut got));
        b.applied_in_full(&got);
        assert!(!goes(&b, &r, true, 0));
        // `sync_refresh_secs = 0`: every event in full.
        for now in [0, 1] {
            assert!(goes(&never, &r, true, now));
        }
    }

    #[test]
    fn a_request_the_cluster_applied_queues_nothing_and_its_identity_is_its_event_s() {
        let metrics = crate::metrics::Metrics::new();
        let sync = ReplicaSync::new("c", Some("a"), 10, Duration::from_millis(5), &metrics);
        let mut rx = sync.rx.lock().take().expect("receiver");
        let routers = crate::routers::Routers::new("cache_aware", serde_json::json!({}), 1, 1).expect("policy");
        let router = routers.get("m", kvroute_core::types::Nanos(0));
        assert!(router.records_request_prefix && router.idempotent_commits);
        let key = RequestKey {
            blocks: (1..=5).map(kvroute_core::types::BlockHash).collect(),
            block_tokens: 16,
            worker_kv_tokens: None,
        };
        let long = "é".repeat(MAX_EVENT_TEXT);
        let tokens: Vec<u32> = (0..MAX_EVENT_TOKENS as u32 + 9).collect();
        let hashes: Vec<_> = (0..MAX_EVENT_BLOCKS as u64 + 3).map(kvroute_core::types::BlockHash).collect();
        let seq = kvroute_core::types::BlockSeq { block_tokens: 16, hashes: &hashes };
        let text = RequestView { session_id: Some("s"), output_tokens: Some(7), ..RequestView::from_text("m", &long) };
        let token_ids = RequestView { text: None, token_ids: Some(&tokens), ..RequestView::from_text("m", "") };
        let blocks = RequestView { text: None, blocks: Some(seq), ..RequestView::from_text("m", "") };
        let nothing = RequestView::from_text("m", "");
        let shorter = RequestView { input_tokens: 9, ..nothing };
        let announce = |req| Announce {
            pool: Pool::Main,
            router: &router,
            key: &key,
            req,
            worker_url: "http://127.0.0.1:9",
            uncached: 300,
            decode: 7,
        };
        for req in [&text, &token_ids, &blocks, &nothing] {
            let a = announce(req);
            let event = RoutedEvent::of(&a, 3);
            // The event's limits hold, and the identity reads what the event carries.
            match &event.prefix {
                WirePrefix::Text(t) => assert_eq!(t, cut_text(&long)),
                WirePrefix::Tokens(t) => assert_eq!(t.len(), MAX_EVENT_TOKENS),
                WirePrefix::Blocks(b, 16) => assert_eq!(b.len(), MAX_EVENT_BLOCKS),
                other => assert_eq!(other, &WirePrefix::None),
            }
            let id = a.commit_view().identity();
            assert!(id.is_some());
            assert_eq!(id, event.commit_identity(), "{:?}", event.prefix);
            assert_eq!(id, over_the_wire(&event).commit_identity(), "as a peer reads it");
        }
        let plain = RoutedEvent::of(&announce(&nothing), 0);
        let other = RoutedEvent::of(&announce(&shorter), 0);
        assert_ne!(plain.commit_identity(), other.commit_identity());

        // The first request is queued in full, with its first token and its end.
        let mut first = sync.routed(announce(&text));
        first.first_token();
        drop(first);
        assert!(matches!(rx.try_recv(), Ok(Out::Routed(r)) if r.prefix == WirePrefix::Text(cut_text(&long).into())));
        assert!(matches!(rx.try_recv(), Ok(Out::FirstToken(_))));
        assert!(matches!(rx.try_recv(), Ok(Out::Done(_))));
        // The same request again: nothing built or queued, counted; its dispatch, first
        // token and end each wake the publisher, whose load totals carry it.
        use futures_util::FutureExt;
        assert!(sync.load_changed.notified().now_or_never().is_none());
        let mut again = sync.routed(announce(&text));
        assert!(sync.load_changed.notified().now_or_never().is_some(), "dispatched");
        again.first_token();
        assert!(sync.load_changed.notified().now_or_never().is_some(), "first token");
        drop(again);
        assert!(sync.load_changed.notified().now_or_never().is_some(), "done");
        assert!(rx.try_recv().is_err());
        let skipped =
            metrics.sync_events.get_or_create(&crate::metrics::OutcomeLabel { outcome: "repeat_skipped".into() }).get();
        assert_eq!(skipped, 1);
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary() {
        let t = "é".repeat(MAX_EVENT_TEXT);
        let cut = cut_text(&t);
        assert!(cut.len() <= MAX_EVENT_TEXT && cut.len() >= MAX_EVENT_TEXT - 1, "{}", cut.len());
        assert!(t.starts_with(cut));
    }

    #[test]
    fn the_spend_shadow_follows_a_bucket_s_gcra() {
        let s = 1_000_000_000u64; // a second, ns
        let mut sh = SpendShadow::default();
        // rpm=60: a request every second refills; tpm=0: tokens unlimited.
        sh.record(7, (60, 0), 30, 5000, 10 * s);
        assert_eq!(sh.spent_at(10 * s), [KeySpend { key: 7, requests: 30, tokens: 0 }]);
        // Ten seconds later, ten requests have come back; half a second later, not an
        // eleventh.
        assert_eq!(sh.spent_at(20 * s)[0].requests, 20);
        assert_eq!(sh.spent_at(20 * s + s / 2)[0].requests, 20);
        // More than a minute's worth empties the bucket, and no more.
        sh.record(7, (60, 0), 500, 0, 20 * s);
        assert_eq!(sh.spent_at(20 * s)[0].requests, 60);
        // A minute later the bucket is full again: the key is forgotten.
        assert!(sh.spent_at(80 * s).is_empty());
        assert!(sh.is_empty());
        // Tokens: tpm=600 (one every 0.1 s), spent in two steps.
        sh.record(8, (0, 600), 1, 100, 0);
        sh.record(8, (0, 600), 1, 200, s);
        assert_eq!(sh.spent_at(s), [KeySpend { key: 8, requests: 0, tokens: 290 }]);
        assert_eq!(sh.len(), 1);
    }

    #[test]
    fn the_snapshot_log_keeps_its_bounds() {
        let mut r = Recent::bounded(SNAPSHOT_MAX_BYTES);
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
            repeat: false,
        };
        let e = Arc::new(ev);
        for _ in 0..100 {
            r.push(Arc::clone(&e));
        }
        assert!(r.bytes <= SNAPSHOT_MAX_BYTES, "{}", r.bytes);
        assert_eq!(r.events.len(), SNAPSHOT_MAX_BYTES / e.size_estimate());
    }
}
