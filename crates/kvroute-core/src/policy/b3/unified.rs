//! `unified`: B3 `cache_aware_proxy.py`'s `pick_unified`, gated affinity with an LMetric
//! fallback.
//!
//! Sticks to the session's worker only when its hit ratio `cache_hit / max(input, 1) >
//! hit_ratio_threshold` and its `num_requests ≤ max(mean, 1) × overload_factor`; otherwise
//! LMetric with the 4-key tie-break (score, new prefill, num_requests, then a round-robin
//! counter among the workers tied on the first three). Branches `sticky`, `affinity_broken`,
//! `tie_break`, `score`.

use super::B3;
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
        let mut was_bound = false;
        if let Some(sid) = req.session_id
            && let Some(bound) = self.affinity.get(sid)
        {
            was_bound = true;
            if let Some(a) = routable().find(|w| w.id == bound) {
                let avg_reqs = mean_load(c)?.max(1.0);
                let t = self.terms(a, req, blocks);
                let hit_ratio = t.cache_hit as f64 / (req.input_tokens.max(1)) as f64;
                if hit_ratio > self.cfg.hit_ratio_threshold && t.bs as f64 <= avg_reqs * self.cfg.overload_factor {
                    return Some(self.decision(&t, Branch::Sticky));
                }
            }
        }
        // LMetric fallback with the 4-key tie-break.
        // One pass: the workers tied on the least (score, new prefill, batch), in the
        // candidates' order, kept as positions (an idle fleet ties whole); the chosen one's
        // terms are computed again (the same inputs, the same terms).
        let mut hits = self.cached.hits(blocks);
        let mut best: Option<(u128, u64, u64)> = None;
        let mut tied: smallvec::SmallVec<[usize; 16]> = smallvec::SmallVec::new();
        for (i, w) in c.iter().enumerate().filter(|(_, w)| w.is_routable()) {
            let t = self.terms_of(w, req, blocks, hits.get(w.id));
            let k = (t.score, t.new_prefill, t.bs);
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
        let (at, branch) = match tied.len() {
            0 => return None,
            1 => (tied[0], Branch::Score),
            n => (tied[(self.rr_counter.next() % n as u64) as usize], Branch::TieBreak),
        };
        let w = &c[at];
        let winner = self.terms_of(w, req, blocks, hits.get(w.id));
        // The session is (re)bound to the worker it is sent to when it is committed.
        let branch = if was_bound { Branch::AffinityBroken } else { branch };
        Some(self.decision(&winner, branch))
    }
}
