//! `sticky`: B3 `cache_aware_proxy.py`'s `pick_sticky`, hard session affinity.
//!
//! A bound session always returns to its worker, whatever its load; an unbound one goes to the
//! least-loaded worker and is bound there when the request is committed. A request without a
//! session id is routed as `load_only`. Branches `sticky`, `new_binding`, `least_load`.

use super::B3;
use crate::policy::{Branch, Decision};
use crate::types::{BlockHash, RequestView, WorkerView};

impl B3 {
    pub(super) fn pick_sticky(
        &self,
        req: &RequestView<'_>,
        blocks: &[BlockHash],
        c: &[WorkerView],
    ) -> Option<Decision> {
        let Some(sid) = req.session_id else {
            return self.pick_load_only(req, blocks, c);
        };
        if let Some(bound) = self.affinity.get(sid)
            && let Some(w) = c.iter().find(|w| w.id == bound && w.is_routable())
        {
            let t = self.terms(w, req, blocks);
            return Some(self.decision(&t, Branch::Sticky));
        }
        // The binding is made when the request is committed (`on_routed`).
        let mut d = self.pick_load_only(req, blocks, c)?;
        d.branch = Branch::NewBinding;
        Some(d)
    }
}
