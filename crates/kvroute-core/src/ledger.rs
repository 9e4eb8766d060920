//! The router-side load ledger: per-worker counters moved by explicit request transitions.
//!
//! ```text
//! dispatched ──first_token──► decoding ──completed──► (gone)
//!     │                          │
//!     └──── cancelled / failed ◄─┘
//! ```
//!
//! Each dispatched request gets a [`Ticket`] that remembers what it added, so every path
//! out of the state machine subtracts exactly that: counters always return to zero once
//! every ticket is closed (property-tested). Closing a ticket twice is impossible: the
//! closing transitions take it by value.
//!
//! Counters follow B3 `cache_aware_proxy.py`'s per-instance state: `num_requests` (in flight),
//! `pending_prefill_tokens` (uncached prompt tokens not yet prefilled) and
//! `ongoing_decode_tokens`, plus `waiting` (no first token yet).

use crate::types::{WorkerId, WorkerView};
use crate::view_changes::ViewChanges;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Counters of one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    /// Requests dispatched and not yet closed.
    pub in_flight: u32,
    /// Requests dispatched that have not produced a first token.
    pub waiting: u32,
    /// Uncached prompt tokens of waiting requests.
    pub pending_prefill_tokens: u64,
    /// Prompt + expected output tokens of requests past their first token.
    pub decode_tokens: u64,
}

/// The state of one request in the ledger. Not `Clone`: exactly one owner closes it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket must be closed with completed/cancelled/failed or counters leak"]
pub struct Ticket {
    worker: WorkerId,
    prefill_tokens: u64,
    decode_tokens: u64,
    first_token_seen: bool,
}

impl Ticket {
    /// The worker this request was dispatched to.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }
    /// Whether the first token was recorded.
    pub fn first_token_seen(&self) -> bool {
        self.first_token_seen
    }
}

/// Per-worker load counters indexed by dense [`WorkerId`].
#[derive(Debug, Clone, Default)]
pub struct LoadLedger {
    loads: Vec<WorkerLoad>,
}

impl LoadLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(&mut self, w: WorkerId) -> &mut WorkerLoad {
        if self.loads.len() <= w.index() {
            self.loads.resize(w.index() + 1, WorkerLoad::default());
        }
        &mut self.loads[w.index()]
    }

    /// Counters of `w` (zero for an unknown worker).
    pub fn get(&self, w: WorkerId) -> WorkerLoad {
        self.loads.get(w.index()).copied().unwrap_or_default()
    }

    /// Copies `w`'s counters into a worker view.
    pub fn fill(&self, view: &mut WorkerView) {
        let l = self.get(view.id);
        view.in_flight = l.in_flight;
        view.waiting = l.waiting;
        view.pending_prefill_tokens = l.pending_prefill_tokens;
        view.decode_tokens = l.decode_tokens;
    }

    /// A request was sent to `worker`. `uncached_prompt_tokens` is the prompt minus the
    /// part expected to be served from the worker's cache (the whole prompt when unknown);
    /// `decode_tokens` is what it will weigh once decoding (prompt + expected output).
    pub fn dispatched(&mut self, worker: WorkerId, uncached_prompt_tokens: u64, decode_tokens: u64) -> Ticket {
        let s = self.slot(worker);
        s.in_flight += 1;
        s.waiting += 1;
        s.pending_prefill_tokens += uncached_prompt_tokens;
        Ticket { worker, prefill_tokens: uncached_prompt_tokens, decode_tokens, first_token_seen: false }
    }

    /// The first token arrived: prefill is done, decoding starts. Idempotent.
    pub fn first_token(&mut self, t: &mut Ticket) {
        if t.first_token_seen {
            return;
        }
        t.first_token_seen = true;
        let (p, d) = (t.prefill_tokens, t.decode_tokens);
        let s = self.slot(t.worker);
        s.waiting -= 1;
        s.pending_prefill_tokens -= p;
        s.decode_tokens += d;
    }

    fn close(&mut self, mut t: Ticket) {
        // Undo exactly what is still outstanding.
        if !t.first_token_seen {
            let p = t.prefill_tokens;
            let s = self.slot(t.worker);
            s.waiting -= 1;
            s.pending_prefill_tokens -= p;
            t.first_token_seen = true;
        } else {
            let d = t.decode_tokens;
            self.slot(t.worker).decode_tokens -= d;
        }
        self.slot(t.worker).in_flight -= 1;
    }

    /// The request finished normally.
    pub fn completed(&mut self, t: Ticket) {
        self.close(t);
    }
    /// The client went away (stream dropped) before the request finished.
    pub fn cancelled(&mut self, t: Ticket) {
        self.close(t);
    }
    /// The worker failed the request.
    pub fn failed(&mut self, t: Ticket) {
        self.close(t);
    }

    /// Forget a removed worker's counters (its open tickets must still be closed; closing
    /// them afterwards recreates and zeroes the slot).
    pub fn is_idle(&self) -> bool {
        self.loads.iter().all(|l| *l == WorkerLoad::default())
    }
}

/// One worker's load counters as atomics, for a front end whose requests run concurrently
/// (the gateway): opening and settling a request touches only that worker's counters, with
/// no lock. Same transitions as [`LoadLedger`]; settle with a [`LoadTicket`].
#[derive(Debug, Default)]
pub struct AtomicLoad {
    in_flight: AtomicU32,
    waiting: AtomicU32,
    pending_prefill_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    /// Requests ever dispatched here (monotonic).
    dispatches: AtomicU64,
    /// Where each transition is marked, and as which worker ([`AtomicLoad::watch`]).
    watch: std::sync::OnceLock<(Arc<ViewChanges>, WorkerId)>,
}

impl AtomicLoad {
    /// From now on, marks worker `id` in `changes` after each transition of these counters
    /// (a dispatch, a first token, a close), so a reader that keeps views re-reads it
    /// ([`crate::view_changes`]). Set once; a second call changes nothing and returns false.
    pub fn watch(&self, changes: Arc<ViewChanges>, id: WorkerId) -> bool {
        self.watch.set((changes, id)).is_ok()
    }

    #[inline]
    fn changed(&self) {
        if let Some((c, id)) = self.watch.get() {
            c.mark(*id);
        }
    }

    /// Requests ever dispatched to this worker: a decision made on a view of the counters
    /// read at count `n` is stale when this is no longer `n` (another request was sent
    /// there meanwhile).
    #[inline]
    pub fn dispatches(&self) -> u64 {
        self.dispatches.load(Relaxed)
    }

    /// The counters now (each read on its own: a consistent snapshot is not needed for
    /// routing, and every counter returns to zero when its requests settle).
    #[inline]
    pub fn get(&self) -> WorkerLoad {
        WorkerLoad {
            in_flight: self.in_flight.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            pending_prefill_tokens: self.pending_prefill_tokens.load(Relaxed),
            decode_tokens: self.decode_tokens.load(Relaxed),
        }
    }

    /// Moves the counters from `from` to `to`: another router's last reported totals on
    /// this worker and the ones it reports now (the gateway's replica sync, whose peers
    /// send their in-flight load as totals rather than per request). The counters hold the
    /// sum of what every reporter last said, so each goes back to zero when its reporters'
    /// totals do ([`WorkerLoad::default`] undoes a reporter). A rise in requests counts as
    /// a dispatch ([`AtomicLoad::dispatches`]), so a decision made on the view before it is
    /// stale.
    pub fn shift(&self, from: WorkerLoad, to: WorkerLoad) {
        if from == to {
            return;
        }
        fn by32(a: &AtomicU32, from: u32, to: u32) {
            if to > from {
                a.fetch_add(to - from, Relaxed);
            } else if from > to {
                a.fetch_sub(from - to, Relaxed);
            }
        }
        fn by64(a: &AtomicU64, from: u64, to: u64) {
            if to > from {
                a.fetch_add(to - from, Relaxed);
            } else if from > to {
                a.fetch_sub(from - to, Relaxed);
            }
        }
        by32(&self.in_flight, from.in_flight, to.in_flight);
        by32(&self.waiting, from.waiting, to.waiting);
        by64(&self.pending_prefill_tokens, from.pending_prefill_tokens, to.pending_prefill_tokens);
        by64(&self.decode_tokens, from.decode_tokens, to.decode_tokens);
        if to.in_flight > from.in_flight {
            self.dispatches.fetch_add(1, Relaxed);
        }
        self.changed();
    }

    /// Copies the counters into `view`.
    #[inline]
    pub fn fill(&self, view: &mut WorkerView) {
        let l = self.get();
        view.in_flight = l.in_flight;
        view.waiting = l.waiting;
        view.pending_prefill_tokens = l.pending_prefill_tokens;
        view.decode_tokens = l.decode_tokens;
    }

    /// A request was sent with `uncached_prompt_tokens` to prefill and `decode_tokens`
    /// expected output tokens. The ticket settles the counters on every path: explicitly,
    /// or when it is dropped (a client that went away), so nothing leaks.
    pub fn dispatched(self: &Arc<Self>, uncached_prompt_tokens: u64, decode_tokens: u64) -> LoadTicket {
        self.dispatches.fetch_add(1, Relaxed);
        self.open(uncached_prompt_tokens, decode_tokens)
    }

    /// [`AtomicLoad::dispatched`] only if no request was dispatched here since the count
    /// read `seen` ([`AtomicLoad::dispatches`]): an atomic compare-and-swap, so of two
    /// decisions made in parallel on the same view of this worker only one opens its
    /// ticket. `None`: the other won; nothing changed.
    pub fn dispatched_if(
        self: &Arc<Self>,
        seen: u64,
        uncached_prompt_tokens: u64,
        decode_tokens: u64,
    ) -> Option<LoadTicket> {
        self.dispatches.compare_exchange(seen, seen.wrapping_add(1), Relaxed, Relaxed).ok()?;
        Some(self.open(uncached_prompt_tokens, decode_tokens))
    }

    fn open(self: &Arc<Self>, uncached_prompt_tokens: u64, decode_tokens: u64) -> LoadTicket {
        self.in_flight.fetch_add(1, Relaxed);
        self.waiting.fetch_add(1, Relaxed);
        self.pending_prefill_tokens.fetch_add(uncached_prompt_tokens, Relaxed);
        self.changed();
        LoadTicket {
            load: Arc::clone(self),
            prefill_tokens: uncached_prompt_tokens,
            decode_tokens,
            first_token_seen: false,
            closed: false,
        }
    }
}

/// An open request on an [`AtomicLoad`]. [`LoadTicket::first_token`] moves it from waiting
/// to decoding; [`LoadTicket::close`], or dropping the ticket, takes it out. Closing twice
/// is a no-op.
#[derive(Debug)]
pub struct LoadTicket {
    load: Arc<AtomicLoad>,
    prefill_tokens: u64,
    decode_tokens: u64,
    first_token_seen: bool,
    closed: bool,
}

impl LoadTicket {
    /// The first output token arrived: prefill is over.
    pub fn first_token(&mut self) {
        if self.first_token_seen || self.closed {
            return;
        }
        self.first_token_seen = true;
        let l = &self.load;
        l.waiting.fetch_sub(1, Relaxed);
        l.pending_prefill_tokens.fetch_sub(self.prefill_tokens, Relaxed);
        l.decode_tokens.fetch_add(self.decode_tokens, Relaxed);
        l.changed();
    }

    /// The request ended (completed, failed or cancelled).
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        let l = &self.load;
        if self.first_token_seen {
            l.decode_tokens.fetch_sub(self.decode_tokens, Relaxed);
        } else {
            l.waiting.fetch_sub(1, Relaxed);
            l.pending_prefill_tokens.fetch_sub(self.prefill_tokens, Relaxed);
        }
        l.in_flight.fetch_sub(1, Relaxed);
        l.changed();
        self.closed = true;
    }

    /// Whether the ticket is still open.
    pub fn is_open(&self) -> bool {
        !self.closed
    }
}

impl Drop for LoadTicket {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dispatch_on_a_stale_view_is_refused_and_changes_nothing() {
        let load = Arc::new(AtomicLoad::default());
        let seen = load.dispatches();
        // Two decisions read the worker at the same count; the first to dispatch wins.
        let first = load.dispatched_if(seen, 100, 10).expect("the first dispatch");
        let before = load.get();
        assert!(load.dispatched_if(seen, 50, 10).is_none(), "the second saw a stale count");
        assert_eq!(load.get(), before);
        assert_eq!(load.dispatches(), seen + 1);
        // Made again on a fresh read, it goes through; plain dispatches count too.
        let second = load.dispatched_if(load.dispatches(), 50, 10).expect("a fresh dispatch");
        let third = load.dispatched(0, 1);
        assert_eq!(load.dispatches(), seen + 3);
        assert_eq!(load.get().in_flight, 3);
        assert_eq!(load.get().pending_prefill_tokens, 150);
        drop((first, second, third));
        assert_eq!(load.get().in_flight, 0);
    }

    #[test]
    fn all_paths_return_to_zero() {
        let mut l = LoadLedger::new();
        let w = WorkerId(3);
        let mut a = l.dispatched(w, 100, 150);
        let b = l.dispatched(w, 10, 20);
        let mut c = l.dispatched(WorkerId(0), 5, 5);
        assert_eq!(l.get(w), WorkerLoad { in_flight: 2, waiting: 2, pending_prefill_tokens: 110, decode_tokens: 0 });
        l.first_token(&mut a);
        l.first_token(&mut a);
        assert_eq!(l.get(w), WorkerLoad { in_flight: 2, waiting: 1, pending_prefill_tokens: 10, decode_tokens: 150 });
        l.completed(a);
        l.cancelled(b);
        l.first_token(&mut c);
        l.failed(c);
        assert!(l.is_idle());
    }

    #[test]
    fn atomic_tickets_settle_on_every_path_including_drop() {
        let load = Arc::new(AtomicLoad::default());
        let mut a = load.dispatched(100, 150);
        let b = load.dispatched(10, 20);
        let mut c = load.dispatched(5, 5);
        assert_eq!(load.get(), WorkerLoad { in_flight: 3, waiting: 3, pending_prefill_tokens: 115, decode_tokens: 0 });
        a.first_token();
        a.first_token();
        assert_eq!(load.get(), WorkerLoad { in_flight: 3, waiting: 2, pending_prefill_tokens: 15, decode_tokens: 150 });
        c.close();
        c.close();
        drop(b); // a client that went away before its first byte
        drop(a); // ... and one that went away mid-stream
        drop(c);
        assert_eq!(load.get(), WorkerLoad::default());
    }

    #[test]
    fn shifted_totals_add_to_tickets_and_undo_to_zero() {
        let load = Arc::new(AtomicLoad::default());
        let t = load.dispatched(10, 20);
        let l =
            |in_flight, waiting, p, d| WorkerLoad { in_flight, waiting, pending_prefill_tokens: p, decode_tokens: d };
        let (a1, a2, b1) = (l(3, 2, 300, 40), l(1, 0, 0, 15), l(2, 2, 50, 0));
        let seen = load.dispatches();
        load.shift(WorkerLoad::default(), a1);
        assert!(load.dispatches() > seen, "more requests: a decision on the old view is stale");
        load.shift(WorkerLoad::default(), b1);
        assert_eq!(load.get(), l(6, 5, 360, 40));
        let seen = load.dispatches();
        load.shift(a1, a2);
        assert_eq!(load.dispatches(), seen, "fewer requests are no dispatch");
        assert_eq!(load.get(), l(4, 3, 60, 15));
        load.shift(a2, WorkerLoad::default());
        load.shift(b1, WorkerLoad::default());
        drop(t);
        assert_eq!(load.get(), WorkerLoad::default());
    }
}
