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
}

impl BodyBudget {
    /// A budget of `bytes` (rounded up to whole KiB; at most what a semaphore counts, about
    /// 2^61 KiB), whose holds are shown in `held` (bytes).
    pub fn new(bytes: u64, held: Gauge) -> BodyBudget {
        let permits = bytes.div_ceil(UNIT).min(Semaphore::MAX_PERMITS as u64) as usize;
        BodyBudget { permits: Arc::new(Semaphore::new(permits)), bytes, held }
    }

    /// An empty hold on this budget, for one body.
    pub fn hold(&self) -> BodyHold {
        BodyHold { budget: self.clone(), permit: None, bytes: 0 }
    }

    /// Bytes of the budget no body holds now (whole KiB).
    pub fn available_bytes(&self) -> u64 {
        self.permits.available_permits() as u64 * UNIT
    }
}

/// One body's share of the [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct BodyHold {
    budget: BodyBudget,
    permit: Option<OwnedSemaphorePermit>,
    /// Bytes covered by `permit`.
    bytes: u64,
}

impl BodyHold {
    /// Makes the hold cover `total` bytes of the body (a total, not an increment: the
    /// body's length so far, or its announced `Content-Length`). Never waits.
    ///
    /// # Errors
    /// 503 with `Retry-After: 1` when the budget cannot cover them now; the hold keeps what
    /// it had (the caller drops it with the request).
    pub fn cover(&mut self, total: u64) -> Result<(), ApiError> {
        if total <= self.bytes {
            return Ok(());
        }
        let have = self.permit.as_ref().map_or(0, |p| p.num_permits() as u64);
        let need = total.div_ceil(UNIT).saturating_sub(have);
        let more = u32::try_from(need)
            .ok()
            .and_then(|n| Arc::clone(&self.budget.permits).try_acquire_many_owned(n).ok())
            .ok_or_else(|| self.refusal())?;
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
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.budget.held.dec_by(gauge_bytes(self.bytes));
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
        let budget = BodyBudget::new(10 * 1024, shown.clone());
        let mut a = budget.hold();
        a.cover(4000).expect("4 KiB of 10");
        a.cover(6000).expect("6 KiB of 10");
        assert_eq!(a.bytes(), 6 * 1024);
        let mut b = budget.hold();
        b.cover(4096).expect("the last 4 KiB");
        assert_eq!(shown.get(), 10 * 1024);
        let mut c = budget.hold();
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
    fn a_total_past_what_a_semaphore_counts_is_refused_not_wrapped() {
        let budget = BodyBudget::new(u64::MAX, Gauge::default());
        let mut a = budget.hold();
        assert!(a.cover(u64::MAX).is_err());
        a.cover(1 << 40).expect("a TiB of an unbounded budget");
    }
}
