//! `lmetric`: B3 `cache_aware_proxy.py`'s `pick_lmetric`, the study's main baseline.
//!
//! `score = (pending_prefill_tokens + max(0, input − cache_hit)) × num_requests`; the first
//! worker with the strictly smallest score wins (Python's `<`). Branch `score`. No session
//! affinity, no overload break.

use super::{B3, Terms};
use crate::policy::{Branch, Decision};
use crate::types::{BlockHash, RequestView, WorkerView};

impl B3 {
    pub(super) fn pick_lmetric(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
    ) -> Option<Decision> {
        let mut best: Option<Terms> = None;
        let mut hits = self.cached.hits(blocks);
        for w in c.iter().filter(|w| w.is_routable()) {
            let t = self.terms_of(w, req, blocks, hits.get(w.id));
            if best.is_none_or(|b| t.score < b.score) {
                best = Some(t);
            }
        }
        best.map(|t| self.decision(&t, Branch::Score))
    }
}
