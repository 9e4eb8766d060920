//! `lmetric`: B3 `cache_aware_proxy.py`'s `pick_lmetric`, the study's main baseline.
//!
//! `score = (pending_prefill_tokens + max(0, input − cache_hit)) × num_requests`; the first
//! worker with the strictly smallest score wins (Python's `<`). Branch `score`. No session
//! affinity, no overload break.
//!
//! Given a [`FleetDigest`] of the candidates, it reads the views of the workers holding the
//! prompt's first block and, of the others, the digest's load buckets (as `unified` does:
//! a worker holding nothing scores `(pending + N) × load`, never below `N × load`): the
//! least score, and the least position that has it, are the scan's (a property test
//! compares them over random fleets). A worker with no request scores 0: the first of
//! them is read from the digest's zero-load bits, however idle the fleet.

use super::{B3, Holders, Kept, MAX_BUCKETS_WALKED, Terms, holds};
use crate::fleet_digest::FleetDigest;
use crate::lru_blocks::Hits;
use crate::policy::util::bits_nth;
use crate::policy::{Branch, Decision};
use crate::types::{BlockHash, RequestView, WorkerView};

impl B3 {
    pub(super) fn pick_lmetric(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
        fleet: Option<&FleetDigest>,
    ) -> Option<Decision> {
        let mut hits = self.cached.hits(blocks);
        let fleet = fleet.filter(|f| f.usable_for(c));
        // A worker with no request scores 0, the least there is: the first of them, or a
        // holder before it that also scores 0 (nothing queued, the whole prompt cached).
        if let Some(f) = fleet.filter(|_| req.input_tokens > 0)
            && let Some(zero) = bits_nth(f.zero_load(), 0)
        {
            let at = self
                .zero_score_holders(Kept { req, blocks, c, f, hits: &hits })
                .iter()
                .map(|h| h.0 as usize)
                .fold(zero, usize::min);
            let t = self.terms_of(&c[at], req, blocks, hits.get(c[at].id));
            return Some(self.decision(&t, Branch::Score));
        }
        let holders = fleet.and_then(|f| Some((f, self.holders_kept(Kept { req, blocks, c, f, hits: &hits })?)));
        let kept = holders.and_then(|(f, holders)| first_least_kept(f, u64::from(req.input_tokens), &holders));
        let best = match kept {
            Some(at) => at.map(|i| self.terms_of(&c[i], req, blocks, hits.get(c[i].id))),
            None => self.first_least_scan(req, blocks, c, &mut hits),
        };
        best.map(|t| self.decision(&t, Branch::Score))
    }

    /// The first routable worker with the least score, by one pass over every view.
    pub(super) fn first_least_scan(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
        hits: &mut Hits,
    ) -> Option<Terms> {
        let mut best: Option<Terms> = None;
        for w in c.iter().filter(|w| w.is_routable()) {
            let t = self.terms_of(w, req, blocks, hits.get(w.id));
            if best.is_none_or(|b| t.score < b.score) {
                best = Some(t);
            }
        }
        best
    }
}

/// [`B3::first_least_scan`]'s position read from `f`, a digest describing the candidates
/// (no view carries an engine-reported count), for a prompt of `input` tokens (more than
/// 0) whose first block `holders` hold ([`B3::holders_kept`]): the others' least score is
/// read from the digest's buckets, walked by increasing load until `N × load` passes the
/// least score found. `Some(None)` when no worker is routable; `None` (read the views)
/// when the walk passes [`MAX_BUCKETS_WALKED`] buckets.
pub(super) fn first_least_kept(f: &FleetDigest, input: u64, holders: &Holders) -> Option<Option<usize>> {
    // (score, position), least first: the holders'.
    let mut best: Option<(u128, usize)> = None;
    for (i, t) in holders {
        keep_least(&mut best, (t.score, *i as usize));
    }
    let holds = |pos: u32| holds(holders, pos);
    for (walked, (load, _, set)) in f.buckets().enumerate() {
        let floor = u128::from(input) * u128::from(load);
        if best.is_some_and(|b| floor > b.0) {
            break;
        }
        if walked == MAX_BUCKETS_WALKED {
            return None;
        }
        // The bucket's least score among those holding nothing: its least pending.
        let Some(&(pending, _)) = set.iter().find(|e| !holds(e.1)) else { continue };
        let charge = pending.saturating_add(input);
        let s = u128::from(charge) * u128::from(load);
        if best.is_some_and(|b| s > b.0) {
            continue;
        }
        // The least position scoring `s` here: the first of one pending (or of a bucket
        // whose pending are all equal, as an idle fleet's are: its order is by position),
        // else (load 0, or a saturated charge: every pending from there up) the least of
        // the range.
        let uniform = set.first().zip(set.last()).is_some_and(|(a, b)| a.0 == b.0);
        let one = uniform || (load > 0 && charge < u64::MAX);
        let hi = if one { pending } else { u64::MAX };
        let mut tying = set.range((pending, 0)..=(hi, u32::MAX)).filter(|e| !holds(e.1)).map(|e| e.1 as usize);
        let first = if one { tying.next() } else { tying.min() };
        if let Some(i) = first {
            keep_least(&mut best, (s, i));
        }
    }
    Some(best.map(|b| b.1))
}

/// Keeps the least (score, position) of `best` and `x`.
fn keep_least(best: &mut Option<(u128, usize)>, x: (u128, usize)) {
    *best = Some(best.map_or(x, |b| b.min(x)));
}
