//! `load_only`: B3 `cache_aware_proxy.py`'s `pick_load_only`, the control without cache or
//! affinity.
//!
//! The first worker with the fewest `num_requests` (Python's `min` returns the first seen, so
//! ties pin worker 0 at low load — kept on purpose: the study reports it as part of its
//! result). Branch `least_load`.

use super::B3;
use crate::policy::{Branch, Decision};
use crate::types::{BlockHash, RequestView, WorkerView};

impl B3 {
    pub(super) fn pick_load_only(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
    ) -> Option<Decision> {
        let w = c.iter().filter(|w| w.is_routable()).min_by_key(|w| w.load())?;
        let t = self.terms(w, req, blocks);
        Some(self.decision(&t, Branch::LeastLoad))
    }
}
