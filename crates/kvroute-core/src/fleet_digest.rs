//! What a scoring decision needs from every worker of a fleet, kept between decisions by
//! whoever keeps the workers' views, so a decision reads only the workers that can win.
//!
//! A scoring policy such as least_ttft ranks a request's workers by a charge built from
//! fleet-wide figures (the mean load and waiting queue) and from each worker's queue; to
//! rule a worker out it needs a lower bound of its charge, and to find the workers whose
//! bound is low it would otherwise read every view on every decision — at 1,024 workers
//! that pass was half of least_ttft's decision (docs/lab/2026-11-28-least-ttft-survey.md).
//! A [`FleetDigest`] keeps those figures as the views change: the sums the means divide,
//! the routable workers bucketed by `(load, waiting)` and ordered within a bucket by queued
//! prefill (a lower bound of the charge grows with each of the three), each worker's
//! position by id, and how many routable workers carry each load. Keeping it costs
//! O(log n) per changed view ([`FleetDigest::update`]); a decision given one through
//! [`crate::policy::PickCtx::fleet`] reads the buckets' heads and the few workers whose
//! bound can reach the best, and decides exactly as the full scan does (least_ttft and
//! prefill_cost read it; a property test, `least_ttft::tests`, compares both policies'
//! scans over random fleets). B3's lmetric and capped, and unified's LMetric fallback,
//! read the buckets: a worker holding nothing of a prompt scores `(pending + prompt) ×
//! load`, least at the head of the lowest loads' buckets, and the workers tying it are a
//! bucket's range (`b3::unified`'s tests compare both with the scan). The prefix policies
//! (SGLang router cache_aware, Ray Serve PrefixCacheAffinityRouter) read from it what their
//! pass over the views gave them (`policy::util::FleetScan::of_kept`: the load range, the
//! routable ids as a set, whether ids follow positions) and, on an imbalanced fleet, the
//! least loaded (or, all routable, draw two by position). `tests/prop_core.rs` checks that
//! every policy that reads a digest decides with it as without it.
//!
//! A digest made with [`FleetDigest::with_terms`] also keeps the least and most of a few
//! figures of each routable view a policy names ([`ViewTerms`]): kv_score (Cognitora
//! cgn-router's score) normalises its terms by the fleet's most power, capacity and
//! queued work, and bounds the workers holding none of a prompt by the fleet's least util
//! and power, so with one it reads only the prefix holders' views when they decide alone;
//! with nothing cached, the extremes show when every worker ties, and positions kept in
//! util order ([`ViewTerms::ordered`]) give the least loaded first when only they do.
//!
//! Where most of the fleet can win (more routable workers idle than `64 + n / 8`, as on an
//! over-provisioned fleet where every idle worker holding nothing of a prompt ties),
//! collecting and ordering that many positions would cost more than a pass over the views.
//! So the digest also keeps its idle and its zero-load workers as bits by position
//! ([`FleetDigest::idle_at`], [`FleetDigest::zero_load`]): least_ttft and prefill_cost
//! charge the idle workers holding nothing of the prompt alike and take them as one class
//! beside the few other contenders; the B3 scorers (lmetric, capped, unified) score a
//! worker with no request 0, the least there is, so the zero-load workers are their least
//! or their tied set. Either way O(n / 64) plus the contenders, however idle the fleet; a
//! decision reads the views only when more than `64 + n / 8` busy workers can win.
//!
//! Pure data: no clock, no lock. A policy says which digest it reads
//! ([`crate::policy::Policy::fleet_digest`]). The replay keeps one beside its views and
//! updates it for the engines that moved; `kvroute bench decision` builds one with its
//! fleet; the gateway keeps one with each copy of a model's kept views.

use crate::radix::TenantSet;
use crate::types::{WorkerId, WorkerView};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The means over the routable candidates a scoring policy reads before it scores them,
/// read in one pass, or from a [`FleetDigest`] ([`crate::policy::util::mean_load`],
/// [`crate::policy::util::mean_max_concurrent`] and [`crate::policy::util::mean_waiting`]
/// are its fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetMeans {
    /// [`crate::policy::util::mean_load`] (`None` when no candidate is routable).
    pub load: Option<f64>,
    /// [`crate::policy::util::mean_max_concurrent`] (`None` when no candidate is routable).
    pub max_concurrent: Option<f64>,
    /// [`crate::policy::util::mean_waiting`] (0 when no candidate is routable).
    pub waiting: f64,
}

impl FleetMeans {
    /// The means of `candidates`.
    pub fn of(candidates: &[WorkerView]) -> Self {
        let mut sums = MeanSums::default();
        for w in candidates.iter().filter(|w| w.is_routable()) {
            sums.add(w);
        }
        sums.means()
    }
}

/// The sums [`FleetMeans`] divides, for a policy that reads the means in a pass over the
/// fleet it makes anyway: [`MeanSums::add`] each routable candidate, then
/// [`MeanSums::means`] is [`FleetMeans::of`] the candidates. The sums are of integers, kept
/// as integers (a floating-point sum is exact, and the same, while under 2^53; integer
/// additions do not hold up the pass that makes them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeanSums {
    n: u64,
    load: u64,
    conc: u64,
    waiting: u64,
}

impl MeanSums {
    /// Adds one routable candidate.
    #[inline]
    pub fn add(&mut self, w: &WorkerView) {
        self.add_parts(w.load(), w.capacity.max_concurrent.max(1), w.waiting);
    }

    /// Adds one routable candidate by its [`WorkerView::load`], `max_concurrent` (0 read
    /// as 1) and [`WorkerView::waiting`].
    #[inline]
    pub(crate) fn add_parts(&mut self, load: u32, conc: u32, waiting: u32) {
        self.n += 1;
        self.load = self.load.saturating_add(u64::from(load));
        self.conc = self.conc.saturating_add(u64::from(conc));
        self.waiting = self.waiting.saturating_add(u64::from(waiting));
    }

    /// Takes back what [`MeanSums::add_parts`] added with the same arguments (the sums of
    /// fewer than 2^32 workers' `u32` fields never saturate, so this is exact).
    pub(crate) fn remove_parts(&mut self, load: u32, conc: u32, waiting: u32) {
        self.n = self.n.saturating_sub(1);
        self.load = self.load.saturating_sub(u64::from(load));
        self.conc = self.conc.saturating_sub(u64::from(conc));
        self.waiting = self.waiting.saturating_sub(u64::from(waiting));
    }

    /// The means of the candidates added.
    pub fn means(&self) -> FleetMeans {
        let n = self.n as f64;
        let mean = |sum: u64| (self.n > 0).then(|| sum as f64 / n);
        FleetMeans {
            load: mean(self.load),
            max_concurrent: mean(self.conc),
            waiting: mean(self.waiting).unwrap_or(0.0),
        }
    }
}

/// The fields of one worker's view the digest reads ([`FleetDigest`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rec {
    id: WorkerId,
    routable: bool,
    /// [`WorkerView::load`].
    load: u32,
    /// [`WorkerView::waiting`].
    waiting: u32,
    /// `max_concurrent`, 0 read as 1 (as the means read it).
    conc: u32,
    /// [`WorkerView::pending_prefill_tokens`].
    pending: u64,
    /// Whether the view carries an engine-reported cached count
    /// ([`WorkerView::cached_tokens`]), which depends on the request.
    precise: bool,
}

impl Rec {
    fn of(w: &WorkerView) -> Rec {
        Rec {
            id: w.id,
            routable: w.is_routable(),
            load: w.load(),
            waiting: w.waiting,
            conc: w.capacity.max_concurrent.max(1),
            pending: w.pending_prefill_tokens,
            precise: w.cached_tokens.is_some(),
        }
    }

    /// No request and no queued prefill.
    fn is_idle(&self) -> bool {
        self.load == 0 && self.pending == 0
    }

    /// The key of its bucket: its load and its waiting requests counted up to its load
    /// (what the decode charge of the waiting requests reads).
    fn bucket(&self) -> (u32, u32) {
        (self.load, self.waiting.min(self.load))
    }
}

/// A fleet's views as a scoring decision reads them, kept up to date view by view (module
/// docs). Built from the views ([`FleetDigest::new`]); after a view at position `i`
/// changes, [`FleetDigest::update`]`(i, view)`; after many changed, or the fleet's length
/// did, [`FleetDigest::refresh`]. A decision trusts the digest to describe the views it is
/// given with them: [`FleetDigest::describes`] checks that (a pass over the views, for
/// tests and debug builds).
///
/// Memory: ~40 bytes a worker in the records, plus a map entry and an ordered-set entry
/// for each and a bit of the routable id set (about 100 bytes a worker in all).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetDigest {
    recs: Vec<Rec>,
    /// The first position of each id (a fast hash: ids are the router's own numbers).
    positions: HashMap<WorkerId, u32, foldhash::fast::FixedState>,
    /// Whether some id appears twice (then positions by id are not trusted).
    duplicate_ids: bool,
    /// Whether some id is not above the one before it (ids out of position order).
    ids_unordered: bool,
    /// The routable workers' ids.
    routable_ids: TenantSet,
    /// The routable workers as `(pending prefill tokens, position)`, by `(load, waiting up
    /// to load)`.
    buckets: BTreeMap<(u32, u32), BTreeSet<(u64, u32)>>,
    /// Routable workers by load.
    loads: BTreeMap<u32, u32>,
    /// The sums of [`FleetMeans`] over the routable workers.
    sums: MeanSums,
    /// Routable workers whose view carries an engine-reported cached count.
    precise: u32,
    /// Routable idle workers: no request, no queued prefill.
    idle: u32,
    /// Bit `pos` set: the worker at `pos` is routable with no request (load 0).
    zero_load: Vec<u64>,
    /// Bit `pos` set: the worker at `pos` is routable and idle (load 0, no queued prefill).
    idle_at: Vec<u64>,
    /// The terms kept ([`FleetDigest::with_terms`]) and their values, if any.
    terms: Option<Box<KeptTerms>>,
}

impl FleetDigest {
    /// The digest of `views` (positions are indices into `views`).
    pub fn new(views: &[WorkerView]) -> FleetDigest {
        let mut d = FleetDigest::default();
        d.refresh(views);
        d
    }

    /// An empty digest that also keeps, over the routable workers, the least and most of
    /// each of `terms`' figures ([`FleetDigest::term_min`], [`FleetDigest::term_max`]);
    /// bring it to a fleet with [`FleetDigest::refresh`]. The figures cost 32 bytes a
    /// worker, plus an ordered-map entry per distinct value of each; a changed view, an
    /// ordered-map update per figure.
    pub fn with_terms(terms: &'static ViewTerms) -> FleetDigest {
        FleetDigest { terms: Some(Box::new(KeptTerms::empty(terms))), ..FleetDigest::default() }
    }

    /// The terms this digest keeps, if any ([`FleetDigest::with_terms`]).
    pub fn terms(&self) -> Option<&'static ViewTerms> {
        self.terms.as_ref().map(|t| t.terms)
    }

    /// The least of term `i`'s figure over the routable workers (`None` when no routable
    /// worker's figure is a number, or the digest keeps no terms or fewer).
    pub fn term_min(&self, i: usize) -> Option<f64> {
        self.terms.as_ref()?.sets.get(i)?.min()
    }

    /// The most of term `i`'s figure over the routable workers ([`FleetDigest::term_min`]).
    pub fn term_max(&self, i: usize) -> Option<f64> {
        self.terms.as_ref()?.sets.get(i)?.max()
    }

    /// Whether every routable worker has the same figure for term `i`, bit for bit, and it
    /// is a number (false when no worker is routable or the digest keeps no such term).
    pub fn term_uniform(&self, i: usize) -> bool {
        self.terms.as_ref().and_then(|t| t.sets.get(i)).is_some_and(|m| m.0.len() == 1 && m.1 == 0)
    }

    /// The positions of the routable workers in increasing figure of term `i` (ties by
    /// position), for a term the digest keeps in order ([`ViewTerms::ordered`]); workers
    /// whose figure is not a number are left out. `None` for a term not kept in order.
    pub fn term_order(&self, i: usize) -> Option<impl Iterator<Item = usize> + '_> {
        let set = self.terms.as_ref()?.order.get(i)?.as_ref()?;
        Some(set.iter().map(|&(_, pos)| pos as usize))
    }

    /// Whether some routable worker's figure for term `i` is not a number (false when the
    /// digest keeps no such term).
    pub fn term_has_nan(&self, i: usize) -> bool {
        self.terms.as_ref().and_then(|t| t.sets.get(i)).is_some_and(|m| m.1 > 0)
    }

    /// `(least, most)` [`WorkerView::load`] over the routable workers, `None` when none is
    /// routable (what [`crate::policy::util::FleetScan`] reads in a pass). O(log n).
    pub fn load_range(&self) -> Option<(u32, u32)> {
        Some((*self.loads.first_key_value()?.0, *self.loads.last_key_value()?.0))
    }

    /// The positions of the routable workers carrying the least load, in the digest's
    /// order (by waiting, queued prefill, then position). O(those workers).
    pub fn least_loaded(&self) -> impl Iterator<Item = u32> + '_ {
        let least = self.loads.first_key_value().map(|(&l, _)| l);
        self.buckets
            .iter()
            .take_while(move |(k, _)| Some(k.0) == least)
            .flat_map(|(_, set)| set.iter().map(|&(_, pos)| pos))
    }

    /// The routable workers' ids as a set.
    pub fn routable_ids(&self) -> &TenantSet {
        &self.routable_ids
    }

    /// Whether the workers' ids strictly increase with their position.
    pub fn ids_increasing(&self) -> bool {
        !self.ids_unordered
    }

    /// Routable workers.
    pub fn routable_count(&self) -> usize {
        self.sums.n as usize
    }

    /// Workers described.
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    /// Whether it describes no worker.
    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    /// Brings the digest up to `views`: records the views that changed (all of them when the
    /// length did). O(n) to compare, plus O(log n) per changed view.
    pub fn refresh(&mut self, views: &[WorkerView]) {
        if views.len() != self.recs.len() {
            let terms = self.terms.take().map(|t| Box::new(KeptTerms::empty(t.terms)));
            let words = views.len().div_ceil(64);
            *self = FleetDigest {
                recs: Vec::with_capacity(views.len()),
                terms,
                zero_load: vec![0; words],
                idle_at: vec![0; words],
                ..FleetDigest::default()
            };
            for (i, w) in views.iter().enumerate() {
                let r = Rec::of(w);
                self.recs.push(r);
                if let Some(t) = self.terms.as_mut() {
                    t.values.push(t.terms.of(w));
                }
                self.enter(i, &r);
            }
            self.index_positions();
            return;
        }
        for (i, w) in views.iter().enumerate() {
            self.update(i, w);
        }
    }

    /// Records that the view at position `pos` is now `view`: O(log n). A position past the
    /// end is a caller's error and is ignored in release builds (the digest then no longer
    /// [`describes`](FleetDigest::describes) the views; [`FleetDigest::refresh`] repairs it).
    pub fn update(&mut self, pos: usize, view: &WorkerView) {
        let Some(&old) = self.recs.get(pos) else {
            debug_assert!(false, "position {pos} past the digest's {} workers", self.recs.len());
            return;
        };
        let new = Rec::of(view);
        let values = self.terms.as_ref().map(|t| t.terms.of(view));
        let same_terms = match (&self.terms, &values) {
            (Some(t), Some(v)) => t.values.get(pos).is_some_and(|old| same_figures(old, v)),
            _ => true,
        };
        if new == old && same_terms {
            return;
        }
        self.leave(pos, &old);
        self.recs[pos] = new;
        if let (Some(t), Some(v)) = (self.terms.as_mut(), values) {
            t.values[pos] = v;
        }
        self.enter(pos, &new);
        if new.id != old.id {
            self.index_positions();
        }
        if self.duplicate_ids {
            // A removed id may be another routable worker's too.
            self.routable_ids = TenantSet::from_ids(self.recs.iter().filter(|r| r.routable).map(|r| r.id));
        }
    }

    /// Whether the digest describes exactly `views` (a pass over them).
    pub fn describes(&self, views: &[WorkerView]) -> bool {
        views.len() == self.recs.len()
            && views.iter().zip(&self.recs).all(|(w, r)| Rec::of(w) == *r)
            && self
                .terms
                .as_ref()
                .is_none_or(|t| views.iter().zip(&t.values).all(|(w, v)| same_figures(&t.terms.of(w), v)))
    }

    /// The means over the routable workers ([`FleetMeans::of`] the views).
    pub fn means(&self) -> FleetMeans {
        self.sums.means()
    }

    /// The position of `id`'s view, `None` when it is not in the fleet or ids repeat.
    pub fn position(&self, id: WorkerId) -> Option<usize> {
        if self.duplicate_ids {
            return None;
        }
        self.positions.get(&id).map(|&p| p as usize)
    }

    /// Whether a decision may read the fleet from the digest instead of from `views`: it
    /// describes as many views, every id once, and no routable view carries an
    /// engine-reported cached count (which depends on the request, so the digest does not
    /// keep it). A policy also reads the views when the fleet is
    /// [`mostly_idle`](FleetDigest::mostly_idle).
    pub fn usable_for(&self, views: &[WorkerView]) -> bool {
        debug_assert!(
            views.len() != self.recs.len() || self.describes(views),
            "a digest kept out of step with its views"
        );
        views.len() == self.recs.len() && !self.duplicate_ids && self.precise == 0
    }

    /// The routable workers bucketed: `(load, waiting up to load)` and the bucket's
    /// `(pending prefill tokens, position)` in increasing order, buckets in increasing key
    /// order.
    pub(crate) fn buckets(&self) -> impl Iterator<Item = (u32, u32, &BTreeSet<(u64, u32)>)> {
        self.buckets.iter().map(|(&(load, waiting), set)| (load, waiting, set))
    }

    /// Routable workers by load, in increasing load.
    pub(crate) fn loads(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.loads.iter().map(|(&l, &n)| (l, n))
    }

    /// The most workers a decision reading the digest scores before it reads the views
    /// instead: `64 + n / 8`. Past that most of the fleet can win (an idle
    /// over-provisioned fleet, where every idle worker ties), and a pass over the views,
    /// in order, is cheaper than collecting and ordering positions from the buckets
    /// (measured on the replay of 10,000 engines: docs/lab/2026-11-29-fleet-digest.md).
    pub(crate) fn contenders_cap(&self) -> usize {
        64 + self.recs.len() / 8
    }

    /// Whether more routable workers are idle than `64 + n / 8` (n the workers): on
    /// such a fleet (over-provisioned, or between bursts) every idle worker that holds
    /// nothing of a prompt can win, and a decision takes them as a class
    /// ([`FleetDigest::idle_at`]) instead of listing them.
    pub fn mostly_idle(&self) -> bool {
        self.idle as usize > self.contenders_cap()
    }

    /// The routable workers with no request (load 0), one bit a position (bit `p % 64` of
    /// word `p / 64`).
    pub fn zero_load(&self) -> &[u64] {
        &self.zero_load
    }

    /// The routable idle workers (load 0, no queued prefill), one bit a position.
    pub fn idle_at(&self) -> &[u64] {
        &self.idle_at
    }

    /// Whether the worker at `pos` is routable.
    pub(crate) fn routable(&self, pos: usize) -> bool {
        self.recs.get(pos).is_some_and(|r| r.routable)
    }

    fn enter(&mut self, pos: usize, r: &Rec) {
        if !r.routable {
            return;
        }
        self.sums.add_parts(r.load, r.conc, r.waiting);
        self.routable_ids.insert(r.id);
        self.buckets.entry(r.bucket()).or_default().insert((r.pending, pos as u32));
        *self.loads.entry(r.load).or_default() += 1;
        self.precise += u32::from(r.precise);
        self.idle += u32::from(r.is_idle());
        let (word, bit) = (pos / 64, 1u64 << (pos % 64));
        if r.load == 0 {
            self.zero_load[word] |= bit;
        }
        if r.is_idle() {
            self.idle_at[word] |= bit;
        }
        if let Some(t) = self.terms.as_mut() {
            let values = t.values[pos];
            for (set, &x) in t.sets.iter_mut().zip(&values) {
                set.insert(x);
            }
            for (order, &x) in t.order.iter_mut().zip(&values) {
                if let Some(o) = order.as_mut().filter(|_| !x.is_nan()) {
                    o.insert((Multiset::key(x), pos as u32));
                }
            }
        }
    }

    fn leave(&mut self, pos: usize, r: &Rec) {
        if !r.routable {
            return;
        }
        self.sums.remove_parts(r.load, r.conc, r.waiting);
        self.routable_ids.remove(r.id);
        if let Some(set) = self.buckets.get_mut(&r.bucket()) {
            set.remove(&(r.pending, pos as u32));
            if set.is_empty() {
                self.buckets.remove(&r.bucket());
            }
        }
        if let Some(n) = self.loads.get_mut(&r.load) {
            *n -= 1;
            if *n == 0 {
                self.loads.remove(&r.load);
            }
        }
        self.precise -= u32::from(r.precise);
        self.idle -= u32::from(r.is_idle());
        let (word, bit) = (pos / 64, 1u64 << (pos % 64));
        self.zero_load[word] &= !bit;
        self.idle_at[word] &= !bit;
        if let Some(t) = self.terms.as_mut() {
            let values = t.values[pos];
            for (set, &x) in t.sets.iter_mut().zip(&values) {
                set.remove(x);
            }
            for (order, &x) in t.order.iter_mut().zip(&values) {
                if let Some(o) = order.as_mut() {
                    o.remove(&(Multiset::key(x), pos as u32));
                }
            }
        }
    }

    fn index_positions(&mut self) {
        self.positions.clear();
        self.duplicate_ids = false;
        self.ids_unordered = self.recs.windows(2).any(|w| w[0].id >= w[1].id);
        for (i, r) in self.recs.iter().enumerate() {
            match self.positions.entry(r.id) {
                std::collections::hash_map::Entry::Occupied(_) => self.duplicate_ids = true,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(i as u32);
                }
            }
        }
    }
}

/// The most figures a [`ViewTerms`] names.
pub const MAX_TERMS: usize = 4;

/// A figure of one worker's view that a policy bounds by the fleet's least or most of it.
pub type Figure = fn(&WorkerView) -> f64;

/// Figures of a worker's view whose least and most over the routable workers a
/// [`FleetDigest`] made with [`FleetDigest::with_terms`] keeps: a policy that normalises
/// its score by fleet maxima, or bounds the workers it does not score by fleet extremes,
/// reads them there instead of in a pass over the views (kv_score, Cognitora cgn-router's
/// four-term score). A figure that is not a number (`NaN`) is left out of the least and
/// most, as a comparison-based maximum leaves it out, and counted
/// ([`FleetDigest::term_has_nan`]).
#[derive(Debug)]
pub struct ViewTerms {
    /// Names the set, so a policy can check that a digest keeps its own figures.
    pub name: &'static str,
    /// At most [`MAX_TERMS`] figures; term `i` is `figures[i]`.
    pub figures: &'static [Figure],
    /// The terms whose routable workers' positions are also kept in increasing figure
    /// ([`FleetDigest::term_order`]): an ordered-set entry a worker and an ordered-set
    /// update a changed view each.
    pub ordered: &'static [usize],
}

impl ViewTerms {
    /// The figures of `w` (unused slots 0).
    fn of(&self, w: &WorkerView) -> [f64; MAX_TERMS] {
        let mut out = [0.0; MAX_TERMS];
        for (o, f) in out.iter_mut().zip(self.figures) {
            *o = f(w);
        }
        out
    }
}

/// Equal figures, bit for bit (a `NaN` equals itself here, so an unchanged view is not
/// re-entered).
fn same_figures(a: &[f64; MAX_TERMS], b: &[f64; MAX_TERMS]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The terms a digest keeps: which, each worker's figures by position, a multiset of each
/// figure over the routable workers, and for the ordered terms the routable positions by
/// `(figure's order key, position)`.
#[derive(Debug, Clone)]
struct KeptTerms {
    terms: &'static ViewTerms,
    values: Vec<[f64; MAX_TERMS]>,
    sets: Vec<Multiset>,
    order: Vec<Option<BTreeSet<(u64, u32)>>>,
}

impl KeptTerms {
    fn empty(terms: &'static ViewTerms) -> KeptTerms {
        // Figures past MAX_TERMS are not kept (their term_min and term_max are None).
        let n = terms.figures.len().min(MAX_TERMS);
        KeptTerms {
            terms,
            values: Vec::new(),
            sets: vec![Multiset::default(); n],
            order: (0..n).map(|i| terms.ordered.contains(&i).then(BTreeSet::new)).collect(),
        }
    }
}

impl PartialEq for KeptTerms {
    fn eq(&self, o: &KeptTerms) -> bool {
        self.terms.name == o.terms.name
            && self.values.len() == o.values.len()
            && self.values.iter().zip(&o.values).all(|(a, b)| same_figures(a, b))
            && self.sets == o.sets
            && self.order == o.order
    }
}

/// Numbers with repeats, ordered as [`f64::total_cmp`] orders them; `NaN`s are only
/// counted.
#[derive(Debug, Clone, Default, PartialEq)]
struct Multiset(BTreeMap<u64, u32>, u32);

impl Multiset {
    /// The key that orders `x` as `total_cmp` does.
    fn key(x: f64) -> u64 {
        crate::select::total_order_key(x)
    }

    fn value(k: u64) -> f64 {
        crate::select::from_total_order_key(k)
    }

    fn insert(&mut self, x: f64) {
        if x.is_nan() {
            self.1 += 1;
        } else {
            *self.0.entry(Self::key(x)).or_default() += 1;
        }
    }

    fn remove(&mut self, x: f64) {
        if x.is_nan() {
            self.1 = self.1.saturating_sub(1);
            return;
        }
        if let std::collections::btree_map::Entry::Occupied(mut e) = self.0.entry(Self::key(x)) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }

    fn min(&self) -> Option<f64> {
        self.0.keys().next().map(|&k| Self::value(k))
    }

    fn max(&self) -> Option<f64> {
        self.0.keys().next_back().map(|&k| Self::value(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Health;
    use proptest::prelude::*;

    fn view(id: u32, (load, waiting, pending, healthy, precise): (u32, u32, u64, bool, bool)) -> WorkerView {
        let mut w = WorkerView::idle(WorkerId(id));
        w.in_flight = load;
        w.waiting = waiting;
        w.pending_prefill_tokens = pending;
        w.cached_tokens = precise.then_some(512);
        if !healthy {
            w.health = Health::Unhealthy;
        }
        w
    }

    /// Figures of the views for the terms' test: one that is `NaN` for some views, one
    /// that repeats across them.
    static TEST_TERMS: ViewTerms = ViewTerms {
        name: "test",
        figures: &[
            |w| if w.waiting == 2 { f64::NAN } else { f64::from(w.in_flight) - 2.0 },
            |w| w.pending_prefill_tokens as f64 * 0.5,
        ],
        ordered: &[0],
    };

    proptest! {
        /// Views changed one at a time, and whole fleets refreshed, leave the digest equal to
        /// one built afresh from the views.
        #[test]
        fn a_digest_kept_view_by_view_equals_one_built_afresh(
            first in proptest::collection::vec((0u32..5, 0u32..3, 0u64..4, proptest::bool::weighted(0.8), proptest::bool::weighted(0.1)), 1..30),
            changes in proptest::collection::vec((0usize..30, (0u32..5, 0u32..3, 0u64..4, proptest::bool::weighted(0.8), proptest::bool::weighted(0.1)), 0u32..3), 0..60),
            regrown in proptest::collection::vec((0u32..5, 0u32..3, 0u64..4, proptest::bool::weighted(0.8), proptest::bool::weighted(0.1)), 1..30),
        ) {
            let mut views: Vec<WorkerView> = first.iter().enumerate().map(|(i, &s)| view(i as u32, s)).collect();
            let mut d = FleetDigest::new(&views);
            let with_terms = |views: &[WorkerView]| {
                let mut d = FleetDigest::with_terms(&TEST_TERMS);
                d.refresh(views);
                d
            };
            let mut t = with_terms(&views);
            for &(pos, spec, id_shift) in &changes {
                let pos = pos % views.len();
                // Sometimes a new id at a position (a worker replaced), once in a while a repeated one.
                let id = views[pos].id.0 + id_shift * 100;
                views[pos] = view(id, spec);
                d.update(pos, &views[pos]);
                t.update(pos, &views[pos]);
                prop_assert_eq!(&d, &FleetDigest::new(&views));
                prop_assert!(d.describes(&views));
                let routable = TenantSet::from_ids(views.iter().filter(|v| v.is_routable()).map(|v| v.id));
                prop_assert_eq!(d.routable_ids(), &routable);
                prop_assert_eq!(d.ids_increasing(), views.windows(2).all(|w| w[0].id < w[1].id));
                prop_assert_eq!(d.means(), FleetMeans::of(&views));
                let bits = |keep: &dyn Fn(&WorkerView) -> bool| {
                    let mut b = vec![0u64; views.len().div_ceil(64)];
                    for (i, _) in views.iter().enumerate().filter(|(_, v)| v.is_routable() && keep(v)) {
                        b[i / 64] |= 1 << (i % 64);
                    }
                    b
                };
                prop_assert_eq!(d.zero_load(), &bits(&|v| v.load() == 0)[..]);
                prop_assert_eq!(d.idle_at(), &bits(&|v| v.load() == 0 && v.pending_prefill_tokens == 0)[..]);
                prop_assert_eq!(&t, &with_terms(&views));
                prop_assert!(t.describes(&views));
                for (i, f) in TEST_TERMS.figures.iter().enumerate() {
                    let xs: Vec<f64> = views.iter().filter(|v| v.is_routable()).map(f).filter(|x| !x.is_nan()).collect();
                    prop_assert_eq!(t.term_min(i), xs.iter().copied().reduce(f64::min));
                    prop_assert_eq!(t.term_max(i), xs.iter().copied().reduce(f64::max));
                }
                prop_assert_eq!(t.routable_count(), views.iter().filter(|v| v.is_routable()).count());
                prop_assert_eq!(t.term_has_nan(0), views.iter().any(|v| v.is_routable() && TEST_TERMS.figures[0](v).is_nan()));
                let f = TEST_TERMS.figures[0];
                let mut want: Vec<usize> = (0..views.len()).filter(|&i| views[i].is_routable() && !f(&views[i]).is_nan()).collect();
                want.sort_by(|&a, &b| f(&views[a]).total_cmp(&f(&views[b])).then(a.cmp(&b)));
                prop_assert_eq!(t.term_order(0).map(|o| o.collect::<Vec<_>>()), Some(want));
                prop_assert!(t.term_order(1).is_none());
                let routable: Vec<f64> = views.iter().filter(|v| v.is_routable()).map(TEST_TERMS.figures[1]).collect();
                prop_assert_eq!(t.term_uniform(1), !routable.is_empty() && routable.iter().all(|x| x.to_bits() == routable[0].to_bits()));
            }
            let again: Vec<WorkerView> = regrown.iter().enumerate().map(|(i, &s)| view(i as u32, s)).collect();
            d.refresh(&again);
            prop_assert_eq!(&d, &FleetDigest::new(&again));
            t.refresh(&again);
            prop_assert_eq!(&t, &with_terms(&again));
            prop_assert_eq!(t.terms().map(|x| x.name), Some("test"));
        }
    }

    #[test]
    fn a_repeated_id_makes_positions_untrusted() {
        let views = vec![view(1, (0, 0, 0, true, false)), view(1, (1, 0, 0, true, false))];
        let d = FleetDigest::new(&views);
        assert_eq!(d.position(WorkerId(1)), None);
        assert!(!d.usable_for(&views));
        let views = vec![view(1, (0, 0, 0, true, false)), view(2, (1, 0, 0, true, true))];
        let d = FleetDigest::new(&views);
        assert_eq!(d.position(WorkerId(2)), Some(1));
        assert!(!d.usable_for(&views), "a precise count depends on the request");
        let views = vec![view(1, (0, 0, 0, true, false)), view(2, (1, 0, 0, false, true))];
        assert!(FleetDigest::new(&views).usable_for(&views), "an unroutable view's count is never read");
    }
}
