//! `unified`: B3 `cache_aware_proxy.py`'s `pick_unified`, gated affinity with an LMetric
//! fallback.
//!
//! Sticks to the session's worker only when its hit ratio `cache_hit / max(input, 1) >
//! hit_ratio_threshold` and its `num_requests ≤ max(mean, 1) × overload_factor`; otherwise
//! LMetric with the 4-key tie-break (score, new prefill, num_requests, then a round-robin
//! counter among the workers tied on the first three). Branches `sticky`, `affinity_broken`,
//! `tie_break`, `score`.

use super::{B3, Terms};
use crate::policy::util::mean_load;
use crate::policy::{Branch, Decision};
use crate::types::{BlockHash, RequestView, WorkerView};

impl B3 {
    pub(super) fn pick_unified(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
    ) -> Option<Decision> {
        let routable = || c.iter().filter(|w| w.is_routable());
        let avg_reqs = mean_load(c)?.max(1.0);
        let mut was_bound = false;
        if let Some(sid) = req.session_id
            && let Some(bound) = self.affinity.get(sid)
        {
            was_bound = true;
            if let Some(a) = routable().find(|w| w.id == bound) {
                let t = self.terms(a, req, blocks);
                let hit_ratio = t.cache_hit as f64 / (req.input_tokens.max(1)) as f64;
                if hit_ratio > self.cfg.hit_ratio_threshold && t.bs as f64 <= avg_reqs * self.cfg.overload_factor {
                    return Some(self.decision(&t, Branch::Sticky));
                }
            }
        }
        // LMetric fallback with the 4-key tie-break.
        let all: smallvec::SmallVec<[Terms; 16]> = routable().map(|w| self.terms(w, req, blocks)).collect();
        let best = all.iter().map(|t| (t.score, t.new_prefill, t.bs)).min()?;
        let tied: smallvec::SmallVec<[&Terms; 16]> =
            all.iter().filter(|t| (t.score, t.new_prefill, t.bs) == best).collect();
        let (winner, branch) = if tied.len() > 1 {
            let w = tied[(self.rr_counter.next() % tied.len() as u64) as usize];
            (*w, Branch::TieBreak)
        } else {
            (*tied[0], Branch::Score)
        };
        // The session is (re)bound to the worker it is sent to when it is committed.
        let branch = if was_bound { Branch::AffinityBroken } else { branch };
        Some(self.decision(&winner, branch))
    }
}
