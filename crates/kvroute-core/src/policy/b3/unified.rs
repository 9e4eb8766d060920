//! `unified`: B3 `cache_aware_proxy.py`'s `pick_unified`, gated affinity with an LMetric
//! fallback.
//!
//! Sticks to the session's worker only when its hit ratio `cache_hit / max(input, 1) >
//! hit_ratio_threshold` and its `num_requests ≤ max(mean, 1) × overload_factor`; otherwise
//! LMetric with the 4-key tie-break (score, new prefill, num_requests, then a round-robin
//! counter among the workers tied on the first three). Branches `sticky`, `affinity_broken`,
//! `tie_break`, `score`.
//!
//! Given a [`FleetDigest`] of the candidates, the fallback reads the views of the workers
//! holding the prompt's first block and, of the others (whose new prefill is the whole
//! prompt, so their score grows with their queued prefill and their load), only the
//! positions the digest's buckets show can tie: the tied set, and so the decision, is the
//! scan's (a property test compares them over random fleets).

use super::{B3, Holders, Kept, MAX_BUCKETS_WALKED, Terms, holds};
use crate::fleet_digest::FleetDigest;
use crate::lru_blocks::Hits;
use crate::policy::util::{bits_count, bits_nth, bits_set, mean_load};
use crate::policy::{Branch, Decision};
use crate::types::{BlockHash, RequestView, WorkerView};
use smallvec::SmallVec;

/// LMetric's order of a worker: (score, new prefill tokens, num_requests), least first.
type Key = (u128, u64, u64);

/// A worker's [`Key`] from its terms.
fn key_of(t: &Terms) -> Key {
    (t.score, t.new_prefill, t.bs)
}

/// Positions in the candidates of the workers tied on the least [`Key`] (the scan lists
/// them in the candidates' order, the digest in its own).
type Tied = SmallVec<[usize; 16]>;

impl B3 {
    pub(super) fn pick_unified(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
        fleet: Option<&FleetDigest>,
    ) -> Option<Decision> {
        let fleet = fleet.filter(|f| f.usable_for(c));
        let mut was_bound = false;
        if let Some(sid) = req.session_id
            && let Some(bound) = self.affinity.get(sid)
        {
            was_bound = true;
            let view = match fleet {
                Some(f) => f.position(bound).and_then(|i| c.get(i)).filter(|w| w.id == bound && w.is_routable()),
                None => c.iter().find(|w| w.is_routable() && w.id == bound),
            };
            if let Some(a) = view {
                let avg_reqs = fleet.map_or_else(|| mean_load(c), |f| f.means().load)?.max(1.0);
                let t = self.terms(a, req, blocks);
                let hit_ratio = t.cache_hit as f64 / (req.input_tokens.max(1)) as f64;
                if hit_ratio > self.cfg.hit_ratio_threshold && t.bs as f64 <= avg_reqs * self.cfg.overload_factor {
                    return Some(self.decision(&t, Branch::Sticky));
                }
            }
        }
        // LMetric fallback with the 4-key tie-break; the chosen one's terms are computed
        // again (the same inputs, the same terms).
        let mut hits = self.cached.hits(blocks);
        let input = u64::from(req.input_tokens);
        // A fleet with a worker that has no request: the tied set as bits by position,
        // however many tie; else the digest's walk, else the views.
        let zero = fleet.and_then(|f| self.zero_load_tied(Kept { req, blocks, c, f, hits: &hits }));
        let kept = fleet
            .filter(|_| zero.is_none())
            .and_then(|f| Some((f, self.holders_kept(Kept { req, blocks, c, f, hits: &hits })?)));
        let (at, branch) = match zero {
            Some(bits) => match bits_count(&bits) {
                0 => return None,
                1 => (bits_nth(&bits, 0)?, Branch::Score),
                n => (bits_nth(&bits, (self.rr_counter.next() % n as u64) as usize)?, Branch::TieBreak),
            },
            None => {
                let mut tied = match kept.as_ref().and_then(|(f, holders)| tied_kept(f, input, holders)) {
                    Some(t) => t,
                    None => self.tied_scan(req, blocks, c, &mut hits),
                };
                // The rotation's pick among the tied in the candidates' order: the k-th
                // least position (a selection, as the digest lists them in its own order).
                match tied.len() {
                    0 => return None,
                    1 => (tied[0], Branch::Score),
                    n => (*tied.select_nth_unstable((self.rr_counter.next() % n as u64) as usize).1, Branch::TieBreak),
                }
            }
        };
        let w = &c[at];
        hits.rewind();
        let winner = self.terms_of(w, req, blocks, hits.get(w.id));
        // The session is (re)bound to the worker it is sent to when it is committed.
        let branch = if was_bound { Branch::AffinityBroken } else { branch };
        Some(self.decision(&winner, branch))
    }

    /// [`B3::tied_scan`]'s set read from `f` (a digest describing `c`) when some routable
    /// worker has no request (load 0) and the prompt has tokens (`N`): a holder of its
    /// first block that scores 0 ([`B3::zero_score_holders`]) has a key below `(0, N, 0)`
    /// (its new prefill is less than `N`), and every other worker of load 0 holds nothing
    /// and has that key, the least of those holding nothing. So the tied set is the
    /// holders scoring 0 with the least key when there are any, else every zero-load
    /// worker — as bits by position however many tie: O(workers / 64 + holders).
    /// `None` when no routable worker has load 0.
    fn zero_load_tied(&self, k: Kept<'_, '_>) -> Option<Vec<u64>> {
        let zero = k.f.zero_load();
        if k.req.input_tokens == 0 || zero.iter().all(|w| *w == 0) {
            return None;
        }
        let holders = self.zero_score_holders(k);
        let Some(best) = holders.iter().map(|h| key_of(&h.1)).min() else { return Some(zero.to_vec()) };
        let mut bits = vec![0; zero.len()];
        for h in holders.iter().filter(|h| key_of(&h.1) == best) {
            bits_set(&mut bits, h.0 as usize, true);
        }
        Some(bits)
    }

    /// The tied workers by one pass over every routable view (an idle fleet ties whole).
    fn tied_scan(&self, req: &RequestView<'_>, blocks: &[BlockHash], c: &[WorkerView], hits: &mut Hits) -> Tied {
        let mut best: Option<Key> = None;
        let mut tied = Tied::new();
        for (i, w) in c.iter().enumerate().filter(|(_, w)| w.is_routable()) {
            let k = key_of(&self.terms_of(w, req, blocks, hits.get(w.id)));
            match best {
                Some(b) if k > b => {}
                Some(b) if k == b => tied.push(i),
                _ => {
                    best = Some(k);
                    tied.clear();
                    tied.push(i);
                }
            }
        }
        tied
    }
}

/// [`B3::tied_scan`] read from `f`, a digest describing the candidates (no view carries an
/// engine-reported count, [`FleetDigest::usable_for`]), for a prompt of `input` tokens
/// (more than 0) whose first block `holders` hold ([`B3::holders_kept`]): every other
/// routable worker's new prefill is the whole prompt `N`, so its key is `((pending + N) ×
/// load, N, load)`, least at the least pending of its load, and no less than `N × load` —
/// the digest's buckets, walked by increasing load, give the least and the positions that
/// tie it. `None` (read the views) when the walk passes [`MAX_BUCKETS_WALKED`] buckets.
fn tied_kept(f: &FleetDigest, input: u64, holders: &Holders) -> Option<Tied> {
    let holds = |pos: u32| holds(holders, pos);
    let others = least_of_others(f, input, holds)?;
    let best = holders.iter().map(|h| key_of(&h.1)).chain(others.map(|o| o.key(input))).min();
    let mut tied = Tied::new();
    if let Some(o) = others.filter(|o| Some(o.key(input)) == best) {
        o.positions(f, input, holds, &mut tied);
    }
    tied.extend(holders.iter().filter(|h| Some(key_of(&h.1)) == best).map(|h| h.0 as usize));
    Some(tied)
}

/// The least key among the routable workers that hold nothing of the prompt: their load,
/// and the least `pending + N` (saturating) of that load.
#[derive(Debug, Clone, Copy)]
struct Others {
    load: u32,
    charge: u64,
}

impl Others {
    fn key(self, input: u64) -> Key {
        (u128::from(self.charge) * u128::from(self.load), input, u64::from(self.load))
    }

    /// Appends the positions of the routable workers holding nothing of the prompt whose
    /// key is this one, in the digest's order (by pending prefill, then position, bucket
    /// by bucket).
    fn positions(self, f: &FleetDigest, input: u64, holds: impl Fn(u32) -> bool, out: &mut Tied) {
        // At load 0 the score is 0 whatever is queued; else `pending + N` must be `charge`
        // (every pending from there up when it saturates).
        let (lo, hi) = match self.load {
            0 => (0, u64::MAX),
            _ if self.charge == u64::MAX => (u64::MAX - input, u64::MAX),
            _ => (self.charge - input, self.charge - input),
        };
        for (_, _, set) in f.buckets().skip_while(|b| b.0 < self.load).take_while(|b| b.0 == self.load) {
            if self.load == 0 {
                // The whole bucket ties (no holder is in it: one of load 0 would win).
                out.reserve(set.len());
            }
            out.extend(set.range((lo, 0)..=(hi, u32::MAX)).filter(|e| !holds(e.1)).map(|e| e.1 as usize));
        }
    }
}

/// The least key among the workers holding nothing of the prompt (`holds` says which
/// positions do), walking the digest's buckets by increasing load until `N × load` (the
/// least score of a load) passes the best found: `Some(None)` when every routable worker
/// holds some, `None` past [`MAX_BUCKETS_WALKED`].
fn least_of_others(f: &FleetDigest, input: u64, holds: impl Fn(u32) -> bool) -> Option<Option<Others>> {
    let mut best: Option<Others> = None;
    for (walked, (load, _, set)) in f.buckets().enumerate() {
        if let Some(b) = best
            && load > b.load
            && u128::from(input) * u128::from(load) >= b.key(input).0
        {
            break;
        }
        if walked == MAX_BUCKETS_WALKED {
            return None;
        }
        // The bucket's least pending prefill among those holding nothing.
        let Some(&(pending, _)) = set.iter().find(|e| !holds(e.1)) else { continue };
        let o = Others { load, charge: pending.saturating_add(input) };
        if best.is_none_or(|b| (o.key(input).0, load) < (b.key(input).0, b.load)) {
            best = Some(o);
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PickCtx;
    use crate::policy::b3::lmetric::first_least_kept;
    use crate::policy::b3::{B3Config, B3Mode};
    use crate::policy::util::bits_has;
    use crate::types::{BlockSeq, Health, Nanos, WorkerId};
    use proptest::prelude::*;
    use rand_core::SeedableRng;

    fn req<'a>(blocks: &'a [BlockHash], input_tokens: u32, session: Option<&'a str>) -> RequestView<'a> {
        RequestView {
            model: "m",
            text: None,
            token_ids: None,
            blocks: Some(BlockSeq { block_tokens: 512, hashes: blocks }),
            input_tokens,
            output_tokens: None,
            session_id: session,
            role: crate::types::Role::Both,
        }
    }

    /// The decision read through a digest of `c`, checked against the one read from the
    /// views from the same point of the tie rotation; neither committed.
    fn peek(p: &B3, r: &RequestView<'_>, c: &[WorkerView]) -> Result<Decision, crate::policy::RouteError> {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        let rotation = p.rr_counter.peek();
        let digest = FleetDigest::new(c);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: Some(&digest) };
        let kept = crate::policy::decide(p, r, c, &mut ctx).map(|d| d.0);
        let after = p.rr_counter.peek();
        p.rr_counter.set(rotation);
        let scan = crate::policy::decide(p, r, c, &mut PickCtx { fleet: None, ..ctx }).map(|d| d.0);
        assert_eq!(kept, scan, "read through a digest");
        assert_eq!(after, p.rr_counter.peek(), "the rotation moved as far");
        scan
    }

    /// One worker of a random fleet: (in_flight, waiting, pending prefill tokens, healthy).
    type Spec = (u32, u32, u64, bool);

    /// `floor` more requests on every worker (a fleet with none idle).
    fn fleet_of(specs: &[Spec], floor: u32, reversed: bool) -> Vec<WorkerView> {
        let mut c: Vec<WorkerView> = specs
            .iter()
            .enumerate()
            .map(|(i, &(in_flight, waiting, pending, healthy))| {
                let mut w = WorkerView::idle(WorkerId(i as u32 * 2));
                w.in_flight = in_flight + floor;
                w.waiting = waiting.min(in_flight);
                w.pending_prefill_tokens = pending;
                if !healthy {
                    w.health = Health::Unhealthy;
                }
                w
            })
            .collect();
        if reversed {
            c.reverse();
        }
        c
    }

    #[test]
    fn a_busy_holder_of_the_whole_prompt_with_nothing_queued_scores_as_an_idle_worker() {
        // Worker 0 runs two requests, has nothing queued and holds the whole prompt (two
        // 512-token blocks): it scores 0, as idle worker 1 does, and comes first.
        let c = fleet_of(&[(2, 0, 0, true), (0, 0, 0, true)], 0, false);
        let blocks = [BlockHash(1), BlockHash(2)];
        for mode in [B3Mode::LMetric, B3Mode::Unified] {
            let mut p = B3::new(mode, B3Config::default());
            crate::policy::record_routed(&mut p, &req(&blocks, 1024, None), c[0].id, Nanos::ZERO);
            let d = peek(&p, &req(&blocks, 1024, None), &c).expect("decides");
            assert_eq!((d.worker, d.score), (c[0].id, Some(0.0)), "{mode:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..Default::default() })]

        /// The fallback read from a digest ties the same workers as the pass over every
        /// view, and so decides (worker, branch, match, score, rotation) as it does; and
        /// lmetric's first of the least score read from it is the scan's.
        #[test]
        fn the_digest_ties_the_workers_a_scan_of_every_view_ties(
            specs in proptest::collection::vec(
                (0u32..5, 0u32..3,
                 prop_oneof![2 => (0u64..4).prop_map(|k| k * 512), 1 => Just(u64::MAX - 300), 1 => Just(u64::MAX)],
                 proptest::bool::weighted(0.9)),
                1..48),
            history in proptest::collection::vec((proptest::collection::vec(0u64..4, 1..5), 0usize..48, 0usize..3), 0..40),
            probe in proptest::collection::vec(0u64..4, 1..5),
            input in prop_oneof![Just(0u32), 1u32..3000],
            session in 0usize..4,
            floor in prop_oneof![Just(0u32), 1u32..3],
            reversed in proptest::bool::ANY,
            rotation in 0u64..1000,
        ) {
            let mut p = B3::new(B3Mode::Unified, B3Config { hit_ratio_threshold: 0.2, ..B3Config::default() });
            // The tie rotation from any point (a pick past the first tied is checked too).
            p.rr_counter.set(rotation);
            let c = fleet_of(&specs, floor, reversed);
            let sessions = ["a", "b"];
            for (prompt, w, s) in &history {
                let blocks: Vec<BlockHash> = prompt.iter().map(|&h| BlockHash(h)).collect();
                let r = req(&blocks, blocks.len() as u32 * 512, sessions.get(*s).copied());
                crate::policy::record_routed(&mut p, &r, c[w % c.len()].id, Nanos::ZERO);
            }
            let blocks: Vec<BlockHash> = probe.iter().map(|&h| BlockHash(h)).collect();
            let r = req(&blocks, input, sessions.get(session).copied());
            let f = FleetDigest::new(&c);
            let mut hits = p.cached.hits(&blocks);
            let holders = p.holders_kept(Kept { req: &r, blocks: &blocks, c: &c, f: &f, hits: &hits });
            if let Some(mut kept) = holders.as_ref().and_then(|h| tied_kept(&f, u64::from(input), h)) {
                kept.sort_unstable();
                let scan = p.tied_scan(&r, &blocks, &c, &mut hits).to_vec();
                prop_assert_eq!(kept.to_vec(), scan.clone());
                // Some worker without a request holds nothing: the same set, as bits.
                if let Some(bits) = p.zero_load_tied(Kept { req: &r, blocks: &blocks, c: &c, f: &f, hits: &hits }) {
                    let listed: Vec<usize> = (0..c.len()).filter(|&i| bits_has(&bits, i)).collect();
                    prop_assert_eq!(listed, scan);
                }
            } else {
                prop_assert!(input == 0 || f.buckets().count() > MAX_BUCKETS_WALKED);
            }
            let _ = peek(&p, &r, &c);
            // lmetric (and capped) over the same fleet and block sets: the first of the
            // least score, read from the digest, is the scan's.
            let mut l = B3::new(B3Mode::LMetric, B3Config::default());
            l.cached = p.cached.clone();
            let mut hits = l.cached.hits(&blocks);
            if let Some(kept) = holders.as_ref().and_then(|h| first_least_kept(&f, u64::from(input), h)) {
                let scan = l.first_least_scan(&r, &blocks, &c, &mut hits).map(|t| t.id);
                prop_assert_eq!(kept.map(|i| c[i].id), scan);
            } else {
                prop_assert!(input == 0 || f.buckets().count() > MAX_BUCKETS_WALKED);
            }
            let _ = peek(&l, &r, &c);
        }
    }

    /// A queue of prefill so long that `pending + N` saturates ties whatever its length
    /// (unified and lmetric).
    #[test]
    fn saturated_charges_tie() {
        let p = B3::new(B3Mode::Unified, B3Config::default());
        let c = fleet_of(&[(1, 0, u64::MAX, true), (1, 0, u64::MAX - 300, true), (2, 0, 0, false)], 0, false);
        let f = FleetDigest::new(&c);
        let cold = [BlockHash(9)];
        let r = req(&cold, 1000, None);
        let none = p
            .holders_kept(Kept { req: &r, blocks: &cold, c: &c, f: &f, hits: &p.cached.hits(&cold) })
            .expect("a prompt");
        let mut tied = tied_kept(&f, 1000, &none).expect("read from the digest");
        tied.sort_unstable();
        assert_eq!(tied.to_vec(), vec![0, 1]);
        assert_eq!(peek(&p, &r, &c).map(|d| d.branch), Ok(Branch::TieBreak));
        // lmetric: the first of them, though its queue is the longer.
        let l = B3::new(B3Mode::LMetric, B3Config::default());
        assert_eq!(first_least_kept(&f, 1000, &none), Some(Some(0)));
        assert_eq!(peek(&l, &r, &c).map(|d| d.worker), Ok(WorkerId(0)));
    }

    /// On the decision bench's light fleet (worker `i` runs `i % 7` requests, nothing
    /// queued) the workers with no request tie; the digest gives them without a pass, in
    /// order, and a warm holder among them wins alone.
    #[test]
    fn an_idle_share_of_the_fleet_ties_from_the_digest() {
        let mut p = B3::new(B3Mode::Unified, B3Config::default());
        let c: Vec<WorkerView> = (0..64)
            .map(|i| {
                let mut w = WorkerView::idle(WorkerId(i));
                w.in_flight = i % 7;
                w
            })
            .collect();
        let f = FleetDigest::new(&c);
        let cold = [BlockHash(9)];
        let r = req(&cold, 4096, None);
        let kept = |p: &B3| {
            tied_kept(
                &f,
                4096,
                &p.holders_kept(Kept { req: &r, blocks: &cold, c: &c, f: &f, hits: &p.cached.hits(&cold) })?,
            )
        };
        let mut tied = kept(&p).expect("read from the digest");
        tied.sort_unstable();
        assert_eq!(tied.to_vec(), (0..64).filter(|i| i % 7 == 0).collect::<Vec<usize>>());
        assert_eq!(peek(&p, &r, &c).map(|d| d.branch), Ok(Branch::TieBreak));
        crate::policy::record_routed(&mut p, &r, WorkerId(14), Nanos::ZERO);
        let tied = kept(&p).expect("read from the digest");
        assert_eq!(tied.to_vec(), vec![14]);
        assert_eq!(peek(&p, &r, &c).map(|d| (d.worker, d.branch)), Ok((WorkerId(14), Branch::Score)));
    }
}
