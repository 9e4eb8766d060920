//! The request bodies the router holds at once, bounded (`max_buffered_body_bytes`).
//!
//! `max_body_bytes` bounds one body; this bounds their sum. A body is read whole (the
//! router routes on the prompt, and resends the body on a retry) and kept until the
//! request's answer begins; without a budget, `max_connections` (8,192) HTTP/1
//! connections — or fewer HTTP/2 ones, each with many streams, or endpoint-picker streams
//! — each sending a body just under the 32 MiB limit and then waiting out
//! `body_read_timeout_secs` would make the router hold 256 GiB. Every body takes its bytes
//! from one budget as they arrive (from `Content-Length` at once when the client sends
//! one); a body the budget cannot hold is refused with 503 and `Retry-After` before more
//! of it is read, and its bytes go back to the budget when its request is answered or
//! refused ([`BodyHold`] dropped).
//!
//! The budget counts the body's bytes as read, in KiB; what the router builds from a body
//! (the parsed prompt, a salted copy) is not counted.
//!
//! When the router knows its tenants, each tenant also has a share of the budget
//! (`max_buffered_body_bytes_per_tenant`, [`crate::model::shares::Shares`]): a body past
//! its tenant's share is refused with 429 and `Retry-After`, so one tenant's slow or large
//! bodies leave the rest of the budget to the others. A share is an atomic count, taken before the budget
//! and given back with it; no lock is taken on a request's way.

use kvroute_protocol::api_error::ApiError;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget's unit, bytes: a body holds `ceil(bytes / UNIT)` permits.
const UNIT: u64 = 1024;

/// The budget shared by every request of one router (`serve` and the endpoint picker).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    /// `max_buffered_body_bytes`, for messages.
    bytes: u64,
    /// `kvroute_buffered_body_bytes`: what the holds cover now.
    held: Gauge,
    /// Each tenant's share (KiB), when the router knows tenants and bounds them.
    shares: Option<Arc<crate::model::shares::Shares>>,
    /// A share's bound in bytes, for messages.
    share_bytes: u64,
}

impl BodyBudget {
    /// A budget of `bytes` (rounded up to whole KiB; at most what a semaphore counts, about
    /// 2^61 KiB), whose holds are shown in `held` (bytes), with `shares` per tenant — how
    /// many, and the bytes of each (rounded up to whole KiB) — or none.
    pub fn new(bytes: u64, shares: Option<(usize, u64)>, held: Gauge) -> BodyBudget {
        let permits = bytes.div_ceil(UNIT).min(Semaphore::MAX_PERMITS as u64) as usize;
        let share_bytes = shares.map_or(0, |(_, b)| b);
        let shares = shares.map(|(n, b)| Arc::new(crate::model::shares::Shares::new(n, b.div_ceil(UNIT))));
        BodyBudget { permits: Arc::new(Semaphore::new(permits)), bytes, held, shares, share_bytes }
    }

    /// An empty hold on this budget, for one body of the tenant whose share is `share`
    /// (`None`: a request with no tenant, or a router that bounds none).
    pub fn hold(&self, share: Option<usize>) -> BodyHold {
        let share = share.filter(|_| self.shares.is_some());
        BodyHold { budget: self.clone(), permit: None, bytes: 0, share }
    }

    /// The per-tenant shares (KiB held), when there are any.
    pub fn shares(&self) -> Option<&crate::model::shares::Shares> {
        self.shares.as_deref()
    }

    /// Bytes of the budget no body holds now (whole KiB).
    pub fn available_bytes(&self) -> u64 {
        self.permits.available_permits() as u64 * UNIT
    }
}

/// One body's share of the [`BodyBudget`] (and of its tenant's share), given back when
/// dropped.
#[derive(Debug)]
pub struct BodyHold {
    budget: BodyBudget,
    permit: Option<OwnedSemaphorePermit>,
    /// Bytes covered by `permit` (and taken from the tenant's share).
    bytes: u64,
    /// The tenant's share, when bounded.
    share: Option<usize>,
}

impl BodyHold {
    /// Makes the hold cover `total` bytes of the body (a total, not an increment: the
    /// body's length so far, or its announced `Content-Length`). Never waits.
    ///
    /// # Errors
    /// 429 with `Retry-After: 1` when the tenant's share cannot cover them now, 503 with
    /// `Retry-After: 1` when the budget cannot; the hold keeps what it had (the caller drops
    /// it with the request).
    pub fn cover(&mut self, total: u64) -> Result<(), ApiError> {
        if total <= self.bytes {
            return Ok(());
        }
        let have = self.permit.as_ref().map_or(0, |p| p.num_permits() as u64);
        let need = total.div_ceil(UNIT).saturating_sub(have);
        let tenant = self.budget.shares.as_deref().zip(self.share);
        if let Some((shares, i)) = tenant
            && !shares.take(i, need)
        {
            return Err(self.tenant_refusal());
        }
        let Some(more) =
            u32::try_from(need).ok().and_then(|n| Arc::clone(&self.budget.permits).try_acquire_many_owned(n).ok())
        else {
            if let Some((shares, i)) = tenant {
                shares.give(i, need);
            }
            return Err(self.refusal());
        };
        match &mut self.permit {
            Some(p) => p.merge(more),
            None => self.permit = Some(more),
        }
        self.bytes = (have + need) * UNIT;
        self.budget.held.inc_by(gauge_bytes(need * UNIT));
        Ok(())
    }

    /// Bytes this hold covers now (whole KiB).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn refusal(&self) -> ApiError {
        ApiError::new(
            http::StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the router is holding as many request bodies as it may (max_buffered_body_bytes = {} bytes); \
                 retry shortly",
                self.budget.bytes
            ),
        )
        .retry_after(1)
    }

    fn tenant_refusal(&self) -> ApiError {
        let cap_bytes = self.budget.share_bytes;
        ApiError::new(
            http::StatusCode::TOO_MANY_REQUESTS,
            format!(
                "this tenant's request bodies held at once reached its share \
                 (max_buffered_body_bytes_per_tenant = {cap_bytes} bytes); retry shortly"
            ),
        )
        .retry_after(1)
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.budget.held.dec_by(gauge_bytes(self.bytes));
        if let (Some(shares), Some(i)) = (self.budget.shares.as_deref(), self.share) {
            shares.give(i, self.bytes / UNIT);
        }
    }
}

/// `bytes` as the gauge counts them (an i64; a hold never covers more than 2^63 bytes).
fn gauge_bytes(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_share_the_budget_and_give_it_back_when_dropped() {
        let shown = Gauge::default();
        let budget = BodyBudget::new(10 * 1024, None, shown.clone());
        let mut a = budget.hold(None);
        a.cover(4000).expect("4 KiB of 10");
        a.cover(6000).expect("6 KiB of 10");
        assert_eq!(a.bytes(), 6 * 1024);
        let mut b = budget.hold(None);
        b.cover(4096).expect("the last 4 KiB");
        assert_eq!(shown.get(), 10 * 1024);
        let mut c = budget.hold(None);
        let e = c.cover(1).expect_err("nothing left");
        assert_eq!(e.status.as_u16(), 503);
        assert!(e.message.contains("max_buffered_body_bytes = 10240"), "{}", e.message);
        // A refused hold keeps what it had, and the budget is whole again once every hold
        // is dropped.
        assert!(a.cover(6 * 1024 + 1).is_err());
        assert_eq!(a.bytes(), 6 * 1024);
        drop(a);
        c.cover(5 * 1024).expect("a's share is back");
        drop((b, c));
        assert_eq!(budget.available_bytes(), 10 * 1024);
        assert_eq!(shown.get(), 0);
    }

    #[test]
    fn a_tenant_holds_at_most_its_share_and_leaves_the_rest_to_the_others() {
        let shown = Gauge::default();
        let budget = BodyBudget::new(16 * 1024, Some((2, 6 * 1024)), shown.clone());
        let mut a1 = budget.hold(Some(0));
        a1.cover(4 * 1024).expect("4 KiB of tenant 0's 6");
        let mut a2 = budget.hold(Some(0));
        let e = a2.cover(3 * 1024).expect_err("7 KiB would pass tenant 0's share");
        assert_eq!(e.status.as_u16(), 429);
        assert!(e.message.contains("max_buffered_body_bytes_per_tenant = 6144"), "{}", e.message);
        assert!(!e.message.contains("max_buffered_body_bytes ="), "{}", e.message);
        // A refused share takes nothing: tenant 0 may still fill its share, and tenant 1
        // (and a request with no tenant) the rest of the budget.
        a2.cover(2 * 1024).expect("tenant 0's last 2 KiB");
        let mut b = budget.hold(Some(1));
        b.cover(6 * 1024).expect("tenant 1's whole share");
        let mut none = budget.hold(None);
        none.cover(4 * 1024).expect("the budget's last 4 KiB");
        assert_eq!(shown.get(), 16 * 1024);
        // A body its share allows but the budget cannot hold is refused with 503, and
        // gives its share back.
        drop(a2);
        let mut none2 = budget.hold(None);
        none2.cover(2 * 1024).expect("the 2 KiB tenant 0 gave back");
        let mut a3 = budget.hold(Some(0));
        assert_eq!(a3.cover(1024).expect_err("the budget is full").status.as_u16(), 503);
        assert_eq!(budget.shares().map(|t| t.held(0)), Some(4));
        drop((a1, a3, b, none, none2));
        assert_eq!(budget.shares().map(|t| (t.held(0), t.held(1))), Some((0, 0)));
        assert_eq!(budget.available_bytes(), 16 * 1024);
    }

    #[test]
    fn a_total_past_what_a_semaphore_counts_is_refused_not_wrapped() {
        let budget = BodyBudget::new(u64::MAX, None, Gauge::default());
        let mut a = budget.hold(None);
        assert!(a.cover(u64::MAX).is_err());
        a.cover(1 << 40).expect("a TiB of an unbounded budget");
    }
}
