//! The bytes of an ext_proc message still arriving, covered by the body budget before
//! tonic decodes the message.
//!
//! tonic assembles a gRPC message whole before the picker sees it: a buffered request body
//! is one message of up to `max_body_bytes` (+ 64 KiB). Without this, every ext_proc stream
//! of every gateway connection could hold one such message half-sent, outside the body
//! budget (`max_buffered_body_bytes`): 4,096 streams a connection, each up to 32 MiB. Each
//! stream's HTTP/2 body is wrapped ([`Metered`]): it follows the gRPC framing (a flag byte,
//! a 4-byte big-endian length, the message) and covers the bytes of the message arriving
//! with a [`BodyHold`], from its first byte until its last, when tonic decodes it and the
//! picker takes the message into its own hold (the request body's, as `serve` holds a
//! body). A message the budget cannot cover fails the stream's request half; the picker
//! answers the request with the refusal (503, or 429 past the tenant's share) as an
//! immediate response ([`StreamBudget::refusal`]).
//!
//! The tenant is known once the picker has read the request headers (the stream's first
//! message) and checked its key; the messages that start after that ([`StreamBudget::set_share`])
//! are also taken from the tenant's share (in full-duplex mode the gateway sends the first
//! body chunk right behind the headers: a message that began before that is taken from the
//! budget alone). Once the request body is read
//! ([`StreamBudget::request_read`]) nothing more is metered: the rest of the stream is the
//! response the gateway relays, in chunks of its own buffer's size.

use crate::body_budget::{BodyBudget, BodyHold};
use axum::body::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use kvroute_protocol::api_error::ApiError;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

/// No tenant share known (yet) for the stream.
const NO_SHARE: usize = usize::MAX;

/// What the picker and the wrapped body of one ext_proc stream share.
#[derive(Debug)]
pub struct StreamBudget {
    /// The tenant's share ([`crate::tenant::Tenancy::share`]), [`NO_SHARE`] until known.
    share: AtomicUsize,
    /// Why the budget refused a message of the stream.
    refused: OnceLock<ApiError>,
    /// The request body is read: later messages (the response's, from the gateway) are
    /// not metered.
    read: AtomicBool,
}

impl StreamBudget {
    fn new() -> Self {
        StreamBudget { share: AtomicUsize::new(NO_SHARE), refused: OnceLock::new(), read: AtomicBool::new(false) }
    }

    /// Takes the messages that start from now on from the tenant's `share` as well
    /// (`None`: no tenant, or a router that bounds none).
    pub fn set_share(&self, share: Option<usize>) {
        self.share.store(share.unwrap_or(NO_SHARE), Relaxed);
    }

    /// Stops metering: the request's body is read, and what the gateway sends from now on
    /// is the response it observes (headers, and chunks of the gateway's own size), which
    /// a full budget must not cut.
    pub fn request_read(&self) {
        self.read.store(true, Relaxed);
    }

    /// The refusal (503 over the budget, 429 over the tenant's share) that failed the
    /// stream's request half, when that is why it failed.
    pub fn refusal(&self) -> Option<ApiError> {
        self.refused.get().cloned()
    }

    fn share(&self) -> Option<usize> {
        Some(self.share.load(Relaxed)).filter(|s| *s != NO_SHARE)
    }
}

/// Where a stream's bytes are in the gRPC framing: the 5-byte prefix of a message (a
/// compression flag and the message's length, big-endian), then the message.
#[derive(Debug, Default)]
struct Framing {
    prefix: [u8; 5],
    /// Prefix bytes read of the message arriving.
    prefix_read: usize,
    /// Its bytes still to come once the prefix is read.
    left: u64,
    /// Its bytes read so far, the prefix included.
    read: u64,
}

impl Framing {
    /// Reads `data`; returns whether a message ended in it. [`Framing::read`] is then the
    /// bytes read of the message arriving after it (0 when none is).
    fn advance(&mut self, mut data: &[u8]) -> bool {
        let mut ended = false;
        while !data.is_empty() {
            if self.prefix_read < 5 {
                let n = (5 - self.prefix_read).min(data.len());
                self.prefix[self.prefix_read..self.prefix_read + n].copy_from_slice(&data[..n]);
                self.prefix_read += n;
                self.read += n as u64;
                data = &data[n..];
                if self.prefix_read == 5 {
                    let [_, a, b, c, d] = self.prefix;
                    self.left = u64::from(u32::from_be_bytes([a, b, c, d]));
                }
            } else {
                let n = self.left.min(data.len() as u64);
                self.left -= n;
                self.read += n;
                data = &data[n as usize..];
            }
            if self.prefix_read == 5 && self.left == 0 {
                *self = Framing::default();
                ended = true;
            }
        }
        ended
    }
}

/// An ext_proc stream's request body (the gateway's messages), its arriving message
/// covered by the body budget (module docs).
pub struct Metered<B> {
    inner: B,
    budget: BodyBudget,
    stream: Arc<StreamBudget>,
    framing: Framing,
    /// Covers [`Framing::read`] of the message arriving.
    hold: Option<BodyHold>,
    /// The budget refused: the body has ended (with that error).
    failed: bool,
}

impl<B> Metered<B> {
    /// `inner`, metered against `budget`; the picker's side of it is the returned
    /// [`StreamBudget`].
    pub fn new(inner: B, budget: BodyBudget) -> (Self, Arc<StreamBudget>) {
        let stream = Arc::new(StreamBudget::new());
        let m = Metered {
            inner,
            budget,
            stream: Arc::clone(&stream),
            framing: Framing::default(),
            hold: None,
            failed: false,
        };
        (m, stream)
    }

    /// Reads `data` into the framing and covers the message arriving after it.
    ///
    /// # Errors
    /// The budget's refusal (also kept in the [`StreamBudget`]).
    fn cover(&mut self, data: &[u8]) -> Result<(), ApiError> {
        if self.stream.read.load(Relaxed) {
            self.hold = None;
            return Ok(());
        }
        if self.framing.advance(data) {
            // The message (or messages) that ended are tonic's now, and the picker's once
            // it takes them: a new hold for the one arriving.
            self.hold = None;
        }
        let read = self.framing.read;
        if read == 0 {
            return Ok(());
        }
        let stream = &self.stream;
        let hold = self.hold.get_or_insert_with(|| self.budget.hold(stream.share()));
        hold.cover(read).inspect_err(|e| {
            let _ = stream.refused.set(e.clone());
        })
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Ok(f)) => f,
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => {
                self.hold = None;
                return Poll::Ready(None);
            }
        };
        if let Some(data) = frame.data_ref()
            && let Err(e) = self.cover(data)
        {
            self.failed = true;
            self.hold = None;
            let status = tonic::Status::resource_exhausted(e.message);
            return Poll::Ready(Some(Err(Box::new(status))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::gauge::Gauge;

    /// A gRPC message of `len` bytes with its prefix.
    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[test]
    fn the_framing_follows_messages_split_and_joined_anyhow() {
        let mut wire = message(3000);
        wire.extend(message(0));
        wire.extend(message(10));
        for cut in [1, 2, 5, 6, 999, 3004, 3005, 3006, 3010, 3011] {
            let mut f = Framing::default();
            let mut ended = 0;
            for chunk in wire.chunks(cut) {
                ended += usize::from(f.advance(chunk));
                assert!(f.read < 3005, "a message is never read past its end");
            }
            assert!(ended >= 1, "cut {cut}");
            assert_eq!(f.read, 0, "cut {cut}: every message ended");
        }
        let mut f = Framing::default();
        assert!(!f.advance(&wire[..2000]));
        assert_eq!(f.read, 2000);
        assert!(f.advance(&wire[2000..3012]), "the first two end, the third has begun");
        assert_eq!(f.read, 2);
    }

    #[test]
    fn the_message_arriving_is_covered_until_it_ends_and_a_refusal_is_kept() {
        let shown = Gauge::default();
        let budget = BodyBudget::new(8 * 1024, None, shown.clone());
        let (mut a, sa) = Metered::new((), budget.clone());
        let wire = message(6 * 1024);
        a.cover(&wire[..4096]).expect("4 KiB of 8");
        assert_eq!(shown.get(), 4096);
        let (mut b, sb) = Metered::new((), budget.clone());
        b.cover(&message(5 * 1024)[..4096]).expect("the other 4 KiB");
        let e = a.cover(&wire[4096..5000]).expect_err("the budget is spent");
        assert_eq!(e.status.as_u16(), 503);
        assert_eq!(sa.refusal().map(|r| r.status.as_u16()), Some(503));
        assert!(sb.refusal().is_none());
        drop(b);
        a.cover(&wire[5000..]).expect("b gave its 4 KiB back");
        assert_eq!(shown.get(), 0, "the message ended: tonic's and the picker's now");
        drop(a);
        assert_eq!(budget.available_bytes(), 8 * 1024);
    }

    #[test]
    fn messages_that_start_once_the_tenant_is_known_take_from_its_share() {
        let budget = BodyBudget::new(64 * 1024, Some((2, 4 * 1024)), Gauge::default());
        let (mut m, s) = Metered::new((), budget.clone());
        m.cover(&message(6 * 1024)[..5 * 1024]).expect("no tenant known yet: the budget alone");
        s.set_share(Some(1));
        let second = message(6 * 1024);
        let mut rest = message(6 * 1024)[5 * 1024..].to_vec();
        rest.extend_from_slice(&second[..3 * 1024]);
        m.cover(&rest).expect("3 KiB of the tenant's 4");
        let e = m.cover(&second[3 * 1024..5 * 1024]).expect_err("past the tenant's share");
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(s.refusal().map(|r| r.status.as_u16()), Some(429));
        s.request_read();
        m.cover(&second[3 * 1024..]).expect("the request is read: nothing is metered");
        assert_eq!(budget.available_bytes(), 64 * 1024);
    }
}
