//! Helpers shared by policies: the request's prefix key, per-key-kind radix trees, and
//! small selection routines (least load with rotation, Power of Two Choices).

use crate::fleet_digest::FleetDigest;
use crate::policy::{MatchUnit, Rng};
use crate::radix::{PrefixMatch, RadixTree, TenantSet};
use crate::types::{BlockHash, Nanos, RequestView, WorkerId, WorkerView};
use smallvec::SmallVec;
use std::collections::BTreeSet;

/// The prefix key of a request, in the best form it carries: routing text (bytes), else
/// token ids, else precomputed block hashes.
#[derive(Debug, Clone, Copy)]
pub enum PrefixKey<'a> {
    /// UTF-8 bytes of the routing text.
    Text(&'a [u8]),
    /// Token ids.
    Tokens(&'a [u32]),
    /// Chained block hashes.
    Blocks(&'a [BlockHash]),
}

impl<'a> PrefixKey<'a> {
    /// The key of `req`, or `None` when it has none (or an empty one).
    pub fn of(req: &RequestView<'a>) -> Option<Self> {
        let key = if let Some(t) = req.text.filter(|t| !t.is_empty()) {
            PrefixKey::Text(t.as_bytes())
        } else if let Some(t) = req.token_ids.filter(|t| !t.is_empty()) {
            PrefixKey::Tokens(t)
        } else if let Some(b) = req.blocks.filter(|b| !b.hashes.is_empty()) {
            PrefixKey::Blocks(b.hashes)
        } else {
            return None;
        };
        Some(key)
    }
    /// Length in the key's own units.
    pub fn len(&self) -> usize {
        match self {
            PrefixKey::Text(t) => t.len(),
            PrefixKey::Tokens(t) => t.len(),
            PrefixKey::Blocks(b) => b.len(),
        }
    }
    /// Whether the key is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Unit of the key's length.
    pub fn unit(&self) -> MatchUnit {
        match self {
            PrefixKey::Text(_) => MatchUnit::Chars,
            PrefixKey::Tokens(_) => MatchUnit::Tokens,
            PrefixKey::Blocks(_) => MatchUnit::Blocks,
        }
    }
}

/// One radix tree per key kind (text bytes, token ids, block hashes), so a router whose
/// requests carry different kinds of keys never compares a byte with a token. In practice
/// one kind is used per deployment; sizes and budgets are summed over the three.
///
/// Beside the trees it keeps the tenants ordered by the symbols they hold, updated by every
/// insert, eviction and removal (O(log tenants) each), so the tenant with the smallest
/// tree — where SGLang router cache_aware and Ray Serve PrefixCacheAffinityRouter send a
/// request that matches little — is found without a pass over the fleet
/// ([`fewest_symbols`]).
#[derive(Debug, Default, Clone)]
pub struct PrefixTrees {
    text: RadixTree<u8>,
    tokens: RadixTree<u32>,
    blocks: RadixTree<BlockHash>,
    /// `(symbols held over the three trees, tenant)` for every tenant holding at least one.
    by_size: BTreeSet<(usize, WorkerId)>,
    /// The size each tenant has in `by_size`, by [`WorkerId::index`] (0: not in it).
    sized: Vec<usize>,
    /// The tenants in `by_size`.
    held: TenantSet,
}

impl PrefixTrees {
    /// Deepest match of `key` among `allowed` tenants. O(len(key)).
    pub fn prefix_match(&self, key: PrefixKey<'_>, allowed: Option<&TenantSet>) -> PrefixMatch {
        match key {
            PrefixKey::Text(k) => self.text.prefix_match(k, allowed),
            PrefixKey::Tokens(k) => self.tokens.prefix_match(k, allowed),
            PrefixKey::Blocks(k) => self.blocks.prefix_match(k, allowed),
        }
    }
    /// Records that `tenant` holds `key` at `now`. O(len(key) + log tenants).
    pub fn insert(&mut self, key: PrefixKey<'_>, tenant: WorkerId, now: Nanos) {
        match key {
            PrefixKey::Text(k) => self.text.insert(k, tenant, now),
            PrefixKey::Tokens(k) => self.tokens.insert(k, tenant, now),
            PrefixKey::Blocks(k) => self.blocks.insert(k, tenant, now),
        }
        self.resized(tenant);
    }
    /// Symbols `tenant` holds over all trees. O(1).
    pub fn tenant_size(&self, tenant: WorkerId) -> usize {
        self.text.tenant_size(tenant) + self.tokens.tenant_size(tenant) + self.blocks.tenant_size(tenant)
    }
    /// Symbols stored over all trees. O(1).
    pub fn total_size(&self) -> usize {
        self.text.total_size() + self.tokens.total_size() + self.blocks.total_size()
    }
    /// Evicts LRU leaves until all trees together hold at most `budget` symbols, at most
    /// `max_pairs` (tenant, leaf) pairs per tree in this call; returns whether the trees are
    /// still over budget (call again, after releasing any lock).
    pub fn evict_to(&mut self, budget: usize, max_pairs: usize) -> bool {
        // A set, not a list: a pass evicting millions of pairs notes each tenant once.
        let mut shrunk = TenantSet::new();
        let others = self.tokens.total_size() + self.blocks.total_size();
        self.text.evict_toward_noting(budget.saturating_sub(others), max_pairs, |t| shrunk.insert(t));
        let others = self.text.total_size() + self.blocks.total_size();
        self.tokens.evict_toward_noting(budget.saturating_sub(others), max_pairs, |t| shrunk.insert(t));
        let others = self.text.total_size() + self.tokens.total_size();
        self.blocks.evict_toward_noting(budget.saturating_sub(others), max_pairs, |t| shrunk.insert(t));
        for t in shrunk.iter() {
            self.resized(t);
        }
        self.total_size() > budget
    }
    /// Forgets `tenant` everywhere.
    pub fn remove_tenant(&mut self, tenant: WorkerId) {
        self.text.remove_tenant(tenant);
        self.tokens.remove_tenant(tenant);
        self.blocks.remove_tenant(tenant);
        self.resized(tenant);
    }

    /// Brings `tenant`'s place in the size order up to date. O(log tenants).
    fn resized(&mut self, tenant: WorkerId) {
        let now = self.tenant_size(tenant);
        let i = tenant.index();
        if self.sized.len() <= i {
            self.sized.resize(i + 1, 0);
        }
        let was = std::mem::replace(&mut self.sized[i], now);
        if was == now {
            return;
        }
        if was > 0 {
            self.by_size.remove(&(was, tenant));
        }
        if now > 0 {
            self.by_size.insert((now, tenant));
            self.held.insert(tenant);
        } else {
            self.held.remove(tenant);
        }
    }

    /// Whether the size order is each tenant's [`PrefixTrees::tenant_size`]; for tests.
    ///
    /// # Errors
    /// The first tenant whose place is wrong.
    #[doc(hidden)]
    pub fn check_size_order(&self) -> Result<(), String> {
        for (i, &kept) in self.sized.iter().enumerate() {
            let t = WorkerId(i.min(u32::MAX as usize) as u32);
            let (size, listed) = (self.tenant_size(t), self.by_size.contains(&(kept, t)));
            if size != kept || (kept > 0) != listed || (kept > 0) != self.held.contains(t) {
                return Err(format!("{t:?}: holds {size}, kept as {kept} (listed {listed})"));
            }
        }
        let sized = self.sized.iter().filter(|&&s| s > 0).count();
        if self.by_size.len() != sized {
            return Err(format!("{} tenants listed, {sized} holding something", self.by_size.len()));
        }
        Ok(())
    }
}

/// Most candidates [`fewest_symbols`] looks at in its kept order (tied at the least size,
/// or skipped as not routable candidates) before it falls back to a pass over the fleet:
/// this many, or a sixteenth of the candidates when that is more (each one looked at costs
/// a lookup by id, a few times what the pass spends on a worker).
pub const FEWEST_ORDER_LIMIT: usize = 64;

/// The positions in `c` of the routable candidates holding the fewest symbols in `trees`
/// ([`PrefixTrees::tenant_size`], 0 for a worker the trees do not know), in candidate order:
/// what a pass computing every candidate's size finds, taken from the trees' kept size order
/// when every routable candidate is approximate and the candidates are in id order (`scan`
/// is [`FleetScan::of`] `c`). Then O(ties × log workers) instead of O(workers); the pass
/// otherwise, or when more than [`FEWEST_ORDER_LIMIT`] (or a sixteenth of the candidates)
/// tie or are skipped.
/// Empty when no candidate is routable.
pub fn fewest_symbols(trees: &PrefixTrees, c: &[WorkerView], scan: &FleetScan) -> SmallVec<[u32; 8]> {
    if let Some(at) = fewest_by_order(trees, c, scan) {
        return at;
    }
    fewest_by_pass(trees, c)
}

/// [`fewest_symbols`] by a pass over every routable candidate.
fn fewest_by_pass(trees: &PrefixTrees, c: &[WorkerView]) -> SmallVec<[u32; 8]> {
    let mut best = usize::MAX;
    let mut out = SmallVec::new();
    for (i, w) in c.iter().enumerate().filter(|(_, w)| w.is_routable()) {
        let size = trees.tenant_size(w.id);
        if size < best {
            best = size;
            out.clear();
        }
        if size == best {
            out.push(i.min(u32::MAX as usize) as u32);
        }
    }
    out
}

/// The position of worker `id` in candidates `c` sorted by strictly increasing id (`None`
/// when it is not one): at once where ids are positions (a fleet numbered from 0 with none
/// removed), else by binary search. O(log workers).
fn position_by_id(c: &[WorkerView], id: WorkerId) -> Option<usize> {
    match c.get(id.index()) {
        Some(w) if w.id == id => Some(id.index()),
        _ => c.binary_search_by_key(&id, |w| w.id).ok(),
    }
}

/// [`fewest_symbols`] from the trees' kept size order alone, or `None` where that does not
/// apply — a precise candidate, candidates not in id order, none routable, or more than
/// the limit tied or skipped — and a pass over the candidates is needed (a caller that
/// wants the least loaded of the smallest then does better with one pass over both, as
/// SGLang router cache_aware's low-match branch does: thousands may tie). The answer's
/// workers are counted or gathered from the bitsets and the order first and looked up in
/// `c` only once they are known to be few: at 16,384 workers the views outgrow the
/// caches, and each lookup can cost more than the pass spends on a dozen workers.
pub fn fewest_by_order(trees: &PrefixTrees, c: &[WorkerView], scan: &FleetScan) -> Option<SmallVec<[u32; 8]>> {
    if scan.any_precise || !scan.by_id || scan.load_range.is_none() {
        return None;
    }
    let limit = FEWEST_ORDER_LIMIT.max(c.len() / 16);
    let mut ids: SmallVec<[WorkerId; 8]> = SmallVec::new();
    // Every routable candidate is in `approx`. Those holding nothing have size 0, the
    // least there is.
    match scan.approx.difference_len(&trees.held) {
        0 => {
            let (mut least, mut skipped) = (None, 0);
            for &(size, id) in &trees.by_size {
                if least.is_some_and(|l| size > l) {
                    break;
                }
                if !scan.approx.contains(id) {
                    skipped += 1;
                    if skipped > limit {
                        return None;
                    }
                    continue;
                }
                if ids.len() == limit {
                    return None;
                }
                least = Some(size);
                ids.push(id);
            }
        }
        n if n <= limit => ids.extend(scan.approx.difference(&trees.held)),
        _ => return None,
    }
    let at = |id: WorkerId| position_by_id(c, id).map(|i| i.min(u32::MAX as usize) as u32);
    // A routable candidate exists and holds something or nothing, so one was found.
    let out: Option<SmallVec<[u32; 8]>> = ids.into_iter().map(at).collect();
    out.filter(|o| !o.is_empty())
}

/// One pass over the candidates, what the prefix policies (SGLang router cache_aware, Ray
/// Serve PrefixCacheAffinityRouter) read before they match a request: the routable
/// workers' load range, the approximate workers the tree answers for, the best precise
/// match rate, and whether the candidates are in ascending id order (then the tree's
/// holders, sorted by id, are already in candidate order). O(workers).
#[derive(Debug, Clone, Default)]
pub struct FleetScan {
    /// `(least, most)` [`WorkerView::load`] over the routable candidates; `None` when none
    /// is routable.
    pub load_range: Option<(u32, u32)>,
    /// The routable candidates without [`WorkerView::cached_tokens`].
    approx: TenantSet,
    /// The best precise match rate in [0, 1] (0 when there is no precise worker).
    best_precise: f64,
    /// Whether a routable candidate has [`WorkerView::cached_tokens`].
    any_precise: bool,
    /// Whether the candidates' ids strictly increase.
    by_id: bool,
}

impl FleetScan {
    /// The scan of `c` for `req` (its prompt tokens give the precise workers' rates).
    pub fn of(c: &[WorkerView], req: &RequestView<'_>) -> Self {
        let input = u64::from(req.input_tokens.max(1));
        let mut approx = TenantSet::with_capacity(c.len());
        // Locals, not the struct's fields: kept in registers across the loop.
        let (mut lo, mut hi, mut routable) = (u32::MAX, 0u32, false);
        let (mut best_precise, mut any_precise, mut by_id) = (0.0_f64, false, true);
        let mut last: Option<WorkerId> = None;
        // `approx` is filled a word at a time: the ids of a run of candidates within one
        // word are gathered in a register (one store per word, not a load and a store per
        // id, each waiting on the last).
        let (mut word, mut bits) = (0usize, 0u64);
        for w in c {
            by_id &= last.is_none_or(|l| l < w.id);
            last = Some(w.id);
            if !w.is_routable() {
                continue;
            }
            let l = w.load();
            (lo, hi, routable) = (lo.min(l), hi.max(l), true);
            match w.cached_tokens {
                // Rates are finite, so the maximum does not depend on the order taken.
                Some(t) => {
                    any_precise = true;
                    best_precise = best_precise.max(precise_rate(t, input));
                }
                None => {
                    let (at, bit) = (w.id.index() / 64, w.id.index() % 64);
                    if at != word && bits != 0 {
                        approx.insert_word(word, bits);
                        bits = 0;
                    }
                    (word, bits) = (at, bits | 1 << bit);
                }
            }
        }
        if bits != 0 {
            approx.insert_word(word, bits);
        }
        FleetScan { load_range: routable.then_some((lo, hi)), approx, best_precise, any_precise, by_id }
    }

    /// The scan of `c` for `req`, read from `fleet` (a digest of `c`) when it is usable
    /// for `c` ([`FleetDigest::usable_for`]: no routable view carries an engine-reported
    /// count, so every routable worker is approximate and none precise) without a pass:
    /// the load range from its load map, the routable ids from its set (O(workers / 64)).
    pub fn of_kept(fleet: Option<&FleetDigest>, c: &[WorkerView], req: &RequestView<'_>) -> Self {
        match fleet.filter(|f| f.usable_for(c)) {
            Some(f) => FleetScan {
                load_range: f.load_range(),
                approx: f.routable_ids().clone(),
                best_precise: 0.0,
                any_precise: false,
                by_id: f.ids_increasing(),
            },
            None => FleetScan::of(c, req),
        }
    }
}

/// A precise worker's match rate: its engine's `cached` tokens over the prompt's `input`
/// (at least 1), at most 1.
fn precise_rate(cached: u64, input: u64) -> f64 {
    cached.min(input) as f64 / input as f64
}

/// The best prefix match of a request over the routable workers, mixing the two sources of
/// prefix state per worker: a worker with [`WorkerView::cached_tokens`] set (it publishes
/// KV events) is matched by the engine's count, every other worker by the policy's own
/// approximate tree. Match rates (matched / prompt, in each source's unit) are compared.
#[derive(Debug, Clone, Default)]
pub struct BestMatch {
    /// Best match rate in [0, 1].
    pub rate: f64,
    /// Every routable worker reaching `rate` (empty when `rate` is 0), in candidate order.
    pub holders: SmallVec<[WorkerId; 8]>,
    /// The positions of `holders` in the candidates, for [`BestMatch::least_loaded_holders`].
    holder_at: SmallVec<[u32; 8]>,
    /// The tree's deepest match among the approximate workers, in the key's unit.
    tree: PrefixMatch,
    /// [`FleetScan`]'s `by_id` of the candidates: a worker's view is found by binary search.
    by_id: bool,
}

impl BestMatch {
    /// Matches `key` (of `req`) over `c`: precise workers by their engine count, the others
    /// in `trees`. With no precise worker this is exactly `trees.prefix_match` over the
    /// routable set. O(len(key) + workers × log(holders)).
    pub fn of(trees: &PrefixTrees, key: PrefixKey<'_>, req: &RequestView<'_>, c: &[WorkerView]) -> Self {
        Self::with_scan(trees, key, req, c, &FleetScan::of(c, req))
    }

    /// [`BestMatch::of`] with the candidates' [`FleetScan`] already taken (`scan` must be
    /// `FleetScan::of(c, req)`). When every routable candidate is approximate and the
    /// candidates are in id order, the holders are the tree's (sorted by id, so in
    /// candidate order) and no second pass is made: O(len(key) + holders × log(workers)).
    pub fn with_scan(
        trees: &PrefixTrees,
        key: PrefixKey<'_>,
        req: &RequestView<'_>,
        c: &[WorkerView],
        scan: &FleetScan,
    ) -> Self {
        let tree = trees.prefix_match(key, Some(&scan.approx));
        let tree_rate = tree.matched as f64 / key.len().max(1) as f64;
        let best = tree_rate.max(scan.best_precise);
        let mut m = BestMatch { rate: best, tree, by_id: scan.by_id, ..BestMatch::default() };
        if best <= 0.0 {
            return m;
        }
        if !scan.any_precise && scan.by_id {
            // The tree's tenants are the routable approximate workers holding its deepest
            // match (`approx` allowed no other), and `best` is the tree's rate.
            for &id in &m.tree.tenants {
                if let Some(i) = position_by_id(c, id) {
                    m.holders.push(id);
                    m.holder_at.push(i.min(u32::MAX as usize) as u32);
                }
            }
        } else {
            m.holders_by_pass(req, c, tree_rate);
        }
        m
    }

    /// The holders by a pass over `c`: a precise worker reaching the best rate, an
    /// approximate one holding the tree's match when the tree reaches it.
    fn holders_by_pass(&mut self, req: &RequestView<'_>, c: &[WorkerView], tree_rate: f64) {
        let input = u64::from(req.input_tokens.max(1));
        for (i, w) in c.iter().enumerate().filter(|(_, w)| w.is_routable()) {
            let hit = match w.cached_tokens {
                Some(t) => precise_rate(t, input) >= self.rate,
                None => tree_rate >= self.rate && self.tree.holds(w.id),
            };
            if hit {
                self.holders.push(w.id);
                self.holder_at.push(i.min(u32::MAX as usize) as u32);
            }
        }
    }

    /// The least loaded of [`BestMatch::holders`] (all of them when tied), in candidate
    /// order; `c` must be the candidates the match was made over. O(holders).
    pub fn least_loaded_holders(&self, c: &[WorkerView]) -> SmallVec<[WorkerId; 8]> {
        least_loaded_at(c, &self.holder_at)
    }

    /// What `w` holds of the request, as `(matched, total, unit)` for a decision: the
    /// engine's tokens for a precise worker, the tree's deepest match for a holder of it,
    /// else nothing.
    pub fn matched_on(
        &self,
        w: WorkerId,
        key: PrefixKey<'_>,
        req: &RequestView<'_>,
        c: &[WorkerView],
    ) -> (u64, u64, MatchUnit) {
        let view = if self.by_id { position_by_id(c, w).map(|i| &c[i]) } else { c.iter().find(|v| v.id == w) };
        if let Some(t) = view.and_then(|v| v.cached_tokens) {
            let input = u64::from(req.input_tokens);
            return (t.min(input), input, MatchUnit::Tokens);
        }
        let matched = if self.tree.holds(w) { self.tree.matched } else { 0 };
        (matched as u64, key.len() as u64, key.unit())
    }
}

/// Routable candidates' ids as a tenant set.
pub fn routable_set(candidates: &[WorkerView]) -> TenantSet {
    TenantSet::from_ids(candidates.iter().filter(|w| w.is_routable()).map(|w| w.id))
}

/// Among routable candidates accepted by `keep`, those minimising `key`, in candidate order.
pub fn argmin_by<K: Ord + Copy>(
    candidates: &[WorkerView],
    keep: impl Fn(&WorkerView) -> bool,
    key: impl Fn(&WorkerView) -> K,
) -> SmallVec<[WorkerId; 8]> {
    argmin_of(candidates.iter().filter(|w| w.is_routable() && keep(w)), key)
}

/// The least loaded ([`WorkerView::load`]) of the candidates at positions `at` of `c` (all
/// of them when tied), in the order of `at`. O(len(at)).
pub fn least_loaded_at(c: &[WorkerView], at: &[u32]) -> SmallVec<[WorkerId; 8]> {
    argmin_of(at.iter().filter_map(|&i| c.get(i as usize)), WorkerView::load)
}

/// The workers of `views` minimising `key`, in their order.
fn argmin_of<'a, K: Ord + Copy>(
    views: impl Iterator<Item = &'a WorkerView>,
    key: impl Fn(&WorkerView) -> K,
) -> SmallVec<[WorkerId; 8]> {
    let mut best: Option<K> = None;
    let mut out = SmallVec::new();
    for w in views {
        let k = key(w);
        match best {
            Some(b) if k > b => {}
            Some(b) if k == b => out.push(w.id),
            _ => {
                best = Some(k);
                out.clear();
                out.push(w.id);
            }
        }
    }
    out
}

/// A tie-break rotation counter. An atomic, so a decision can take `&self`: advancing it
/// records nothing about a request, it only spreads ties (and concurrent decisions) over
/// the tied workers.
///
/// A clone shares the counter: the two copies of a policy that the gateway keeps
/// ([`Twin::twin`](crate::policy::Twin::twin)) spread ties as one, whichever copy a
/// decision reads.
#[derive(Debug, Default, Clone)]
pub struct Rotation(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl Rotation {
    /// The next rotation step (a wrapping count).
    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Tests: the count [`Rotation::next`] returns next.
    #[cfg(test)]
    pub(crate) fn peek(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Tests: sets the count [`Rotation::next`] returns next.
    #[cfg(test)]
    pub(crate) fn set(&self, to: u64) {
        self.0.store(to, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Picks `tied[rotation % len]` and advances the rotation when there is a real tie, so a
/// tie does not always land on the first candidate. `None` when `tied` is empty.
pub fn rotate(tied: &[WorkerId], rotation: &Rotation) -> Option<WorkerId> {
    match tied.len() {
        0 => None,
        1 => Some(tied[0]),
        n => Some(tied[(rotation.next() % n as u64) as usize]),
    }
}

/// [`rotate`] over the candidates at positions `at` of `c` listed in any order: the one at
/// the k-th least position (`k` the rotation's step when there is a real tie), as
/// `rotate` over their ids in candidate order picks it. O(len(at)).
pub fn rotate_at(c: &[WorkerView], at: &mut [u32], rotation: &Rotation) -> Option<WorkerId> {
    let i = match at.len() {
        0 => return None,
        1 => at[0],
        n => *at.select_nth_unstable((rotation.next() % n as u64) as usize).1,
    };
    c.get(i as usize).map(|w| w.id)
}

/// Positions in a bit set, one bit a position (bit `p % 64` of word `p / 64`), as the
/// fleet digest keeps its zero-load and idle workers
/// ([`crate::fleet_digest::FleetDigest`]): how many are set. O(words).
pub fn bits_count(bits: &[u64]) -> usize {
    bits.iter().map(|w| w.count_ones() as usize).sum()
}

/// The `k`-th least position set in `bits` (0: the least), `None` past the last: what
/// [`rotate_at`] picks among tied workers listed as bits. O(words).
pub fn bits_nth(bits: &[u64], k: usize) -> Option<usize> {
    bits_nth_from(bits, 0, k)
}

/// The least position set in `bits` at `from` or after.
pub fn bits_next(bits: &[u64], from: usize) -> Option<usize> {
    bits_nth_from(bits, from, 0)
}

/// The `k`-th least position set in `bits` at `from` or after (0: the least).
pub fn bits_nth_from(bits: &[u64], from: usize, mut k: usize) -> Option<usize> {
    let start = from / 64;
    for (i, &w) in bits.iter().enumerate().skip(start) {
        let mut w = if i == start { w & (u64::MAX << (from % 64)) } else { w };
        let n = w.count_ones() as usize;
        if k >= n {
            k -= n;
            continue;
        }
        for _ in 0..k {
            w &= w - 1;
        }
        return Some(i * 64 + w.trailing_zeros() as usize);
    }
    None
}

/// How many positions are set in `bits` from `from` to before `to`.
pub fn bits_count_in(bits: &[u64], from: usize, to: usize) -> usize {
    let to = to.min(bits.len() * 64);
    let (mut n, mut lo) = (0, from);
    while lo < to {
        let (word, shift) = (lo / 64, lo % 64);
        let len = (to - lo).min(64 - shift);
        let mask = if len == 64 { u64::MAX } else { ((1u64 << len) - 1) << shift };
        n += (bits[word] & mask).count_ones() as usize;
        lo += len;
    }
    n
}

/// Whether position `pos` is set in `bits` (a position past the end is not).
pub fn bits_has(bits: &[u64], pos: usize) -> bool {
    bits.get(pos / 64).is_some_and(|w| w >> (pos % 64) & 1 == 1)
}

/// Sets (`on`) or clears position `pos` of `bits` (a position past the end is ignored).
pub fn bits_set(bits: &mut [u64], pos: usize, on: bool) {
    if let Some(w) = bits.get_mut(pos / 64) {
        if on {
            *w |= 1 << (pos % 64);
        } else {
            *w &= !(1 << (pos % 64));
        }
    }
}

/// Power of Two Choices over `set` (ids of routable candidates): two distinct members drawn
/// uniformly, the lower `load()` wins, the first drawn on a tie. `None` when `set` is empty.
pub fn power_of_two(set: &[WorkerId], candidates: &[WorkerView], rng: Rng<'_>) -> Option<WorkerId> {
    let load = |id: WorkerId| candidates.iter().find(|w| w.id == id).map_or(u32::MAX, WorkerView::load);
    let (a, b) = two_draws(set.len(), rng)?;
    Some(match b {
        Some(b) if load(set[b]) < load(set[a]) => set[b],
        _ => set[a],
    })
}

/// [`power_of_two`] over every routable candidate of `candidates`: the same draws and the
/// same choice as `power_of_two(&routable_ids(candidates), candidates, rng)` (ids being
/// distinct), the drawn workers' views read by position instead of looked up by id.
pub fn power_of_two_routable(candidates: &[WorkerView], rng: Rng<'_>) -> Option<WorkerId> {
    let at: SmallVec<[u32; 16]> = candidates
        .iter()
        .enumerate()
        .filter(|(_, w)| w.is_routable())
        .map(|(i, _)| i.min(u32::MAX as usize) as u32)
        .collect();
    power_of_two_at(candidates, &at, rng)
}

/// [`power_of_two`] over the candidates at positions `at` of `candidates` (distinct, in
/// range): the same draws and the same choice as over their ids, the drawn views read by
/// position. `None` when `at` is empty.
pub fn power_of_two_at(candidates: &[WorkerView], at: &[u32], rng: Rng<'_>) -> Option<WorkerId> {
    power_of_two_by(candidates, at.len(), |i| at[i] as usize, rng)
}

/// [`power_of_two_routable`] where every candidate is routable (a fleet digest says so):
/// the same draws and choice, without listing the positions.
pub fn power_of_two_all(candidates: &[WorkerView], rng: Rng<'_>) -> Option<WorkerId> {
    power_of_two_by(candidates, candidates.len(), |i| i, rng)
}

/// Power of Two Choices over `n` members, the i-th at position `pos(i)` of `candidates`.
fn power_of_two_by(
    candidates: &[WorkerView],
    n: usize,
    pos: impl Fn(usize) -> usize,
    rng: Rng<'_>,
) -> Option<WorkerId> {
    let view = |i: usize| candidates.get(pos(i));
    let (a, b) = two_draws(n, rng)?;
    let first = view(a)?;
    Some(match b.and_then(view) {
        Some(second) if second.load() < first.load() => second.id,
        _ => first.id,
    })
}

/// Power of Two Choices' draws over `n` members: `None` when there is none, the only one
/// when there is one, else two distinct indices drawn uniformly (Floyd's draw of the second).
fn two_draws(n: usize, rng: Rng<'_>) -> Option<(usize, Option<usize>)> {
    match n {
        0 => None,
        1 => Some((0, None)),
        n => {
            let a = (rng.next_u64() % n as u64) as usize;
            let mut b = (rng.next_u64() % (n as u64 - 1)) as usize;
            if b >= a {
                b += 1;
            }
            Some((a, Some(b)))
        }
    }
}

/// Ids of routable candidates, in candidate order.
pub fn routable_ids(candidates: &[WorkerView]) -> SmallVec<[WorkerId; 16]> {
    candidates.iter().filter(|w| w.is_routable()).map(|w| w.id).collect()
}

pub use crate::fleet_digest::{FleetMeans, MeanSums};

/// Mean [`WorkerView::load`] over routable candidates, `None` when there is none.
pub fn mean_load(candidates: &[WorkerView]) -> Option<f64> {
    FleetMeans::of(candidates).load
}

/// Mean `max_concurrent` (requests a worker runs at once: SGLang `max_running_requests`,
/// llama.cpp slots, 0 read as 1) over the routable candidates; `None` when none is routable.
pub fn mean_max_concurrent(candidates: &[WorkerView]) -> Option<f64> {
    FleetMeans::of(candidates).max_concurrent
}

/// Mean router-side waiting requests (dispatched, no first token yet) over the routable
/// candidates; 0 when none is routable.
pub fn mean_waiting(candidates: &[WorkerView]) -> f64 {
    FleetMeans::of(candidates).waiting
}

/// Per-session state of session-aware policies — by default the worker a session is bound
/// to, for `capped` its turn count ([`SessionTurns`]): a bounded LRU map keyed by the stable
/// hash of the session id ([`crate::hash::stable_hash`]), so a trace with millions of
/// sessions cannot grow the router without bound (an evicted session behaves as a new one).
#[derive(Debug, Clone)]
pub struct SessionTable<V = WorkerId> {
    map: lru::LruCache<u64, V>,
}

/// Turns routed per session (`capped`).
pub type SessionTurns = SessionTable<u32>;

impl<V: Copy> SessionTable<V> {
    /// A table keeping at most `max_sessions` sessions (at least 1).
    pub fn new(max_sessions: usize) -> Self {
        SessionTable { map: lru::LruCache::new(Self::cap(max_sessions)) }
    }

    fn cap(n: usize) -> std::num::NonZeroUsize {
        std::num::NonZeroUsize::new(n.max(1)).unwrap_or(std::num::NonZeroUsize::MIN)
    }

    fn key(session: &str) -> u64 {
        crate::hash::stable_hash(session.as_bytes())
    }

    /// What is kept for `session`. Read-only: the entry is marked recently used when the
    /// request is committed ([`SessionTable::bind`], [`SessionTurns::record`]), not when a
    /// decision reads it.
    pub fn get(&self, session: &str) -> Option<V> {
        self.map.peek(&Self::key(session)).copied()
    }

    /// Changes the bound, evicting least recently used sessions beyond it.
    pub fn resize(&mut self, max_sessions: usize) {
        self.map.resize(Self::cap(max_sessions));
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl SessionTurns {
    /// Counts one more turn of `session` (and marks it recently used).
    pub fn record(&mut self, session: &str) {
        let n = self.map.get_or_insert_mut(Self::key(session), || 0);
        *n = n.saturating_add(1);
    }
}

impl SessionTable<WorkerId> {
    /// Binds `session` to `worker`, replacing any binding (and marking it recently used).
    pub fn bind(&mut self, session: &str, worker: WorkerId) {
        self.map.put(Self::key(session), worker);
    }

    /// Drops every binding to `worker` (it left the fleet). O(bindings).
    pub fn forget_worker(&mut self, worker: WorkerId) {
        let stale: Vec<u64> = self.map.iter().filter(|(_, w)| **w == worker).map(|(k, _)| *k).collect();
        for k in stale {
            self.map.pop(&k);
        }
    }
}

/// Shortest `eviction_interval_secs` accepted, seconds (1 ms): a shorter one rounds to
/// 0 ns, or costs a replay one eviction pass per simulated nanosecond.
pub const MIN_EVICTION_INTERVAL_SECS: f64 = 1e-3;

/// Longest `eviction_interval_secs` accepted, seconds (10^7 s, the longest trace a replay
/// takes; a longer interval means no eviction at all).
pub const MAX_EVICTION_INTERVAL_SECS: f64 = 1e7;

/// Checks an `eviction_interval_secs` knob: from [`MIN_EVICTION_INTERVAL_SECS`] to
/// [`MAX_EVICTION_INTERVAL_SECS`].
///
/// # Errors
/// A message naming the knob and its range.
pub fn check_eviction_interval(secs: f64) -> Result<(), String> {
    if !(MIN_EVICTION_INTERVAL_SECS..=MAX_EVICTION_INTERVAL_SECS).contains(&secs) {
        return Err(format!("eviction_interval_secs must be in [0.001, 1e7] seconds, got {secs:e}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_sets_count_and_select_positions_as_a_list_of_them_does() {
        let list = [0usize, 5, 63, 64, 70, 127, 128, 200];
        let mut bits = vec![0u64; 4];
        for &p in &list {
            bits_set(&mut bits, p, true);
        }
        assert_eq!(bits_count(&bits), list.len());
        for from in 0..260 {
            let after: Vec<usize> = list.iter().copied().filter(|&p| p >= from).collect();
            for k in 0..=after.len() {
                assert_eq!(bits_nth_from(&bits, from, k), after.get(k).copied(), "from {from}, k {k}");
            }
            assert_eq!(bits_next(&bits, from), after.first().copied());
            assert_eq!(bits_has(&bits, from), list.contains(&from));
            for to in from..260 {
                let n = list.iter().filter(|&&p| p >= from && p < to).count();
                assert_eq!(bits_count_in(&bits, from, to), n, "{from}..{to}");
            }
        }
        assert_eq!(bits_nth(&bits, 3), Some(64));
        bits_set(&mut bits, 64, false);
        bits_set(&mut bits, 9999, true);
        assert_eq!(bits_nth(&bits, 3), Some(70));
    }
}
