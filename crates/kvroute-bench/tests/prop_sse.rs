//! Property tests of the load generator's SSE tap (`kvroute_bench::runner::SseTap`), beside
//! the cargo-fuzz target `sse_tap`: a stream of N chunks and `[DONE]` gives N data events
//! and one end marker wherever the bytes are cut, and any bytes give events or an error.

use kvroute_bench::runner::{SseEvent, SseTap};
use proptest::prelude::*;

fn feed_in_pieces(body: &[u8], cuts: &[usize]) -> Result<Vec<SseEvent>, &'static str> {
    let mut tap = SseTap::default();
    let mut out = Vec::new();
    let mut at = 0;
    for &c in cuts {
        let end = (at + c).min(body.len());
        tap.feed(&body[at..end], &mut out)?;
        at = end;
    }
    tap.feed(&body[at..], &mut out)?;
    Ok(out)
}

proptest! {
    #[test]
    fn every_chunk_is_one_event_wherever_the_stream_is_cut(
        chunks in prop::collection::vec(".{0,30}", 0..12),
        cuts in prop::collection::vec(0usize..64, 0..16),
        comments in any::<bool>(),
    ) {
        let mut body = String::new();
        for (i, c) in chunks.iter().enumerate() {
            if comments {
                body.push_str(": keep-alive\n\n");
            }
            let v = serde_json::json!({"id": i, "choices": [{"delta": {"content": c}}]});
            body.push_str(&format!("data: {v}\n\n"));
        }
        body.push_str("data: [DONE]\n\n");
        let events = feed_in_pieces(body.as_bytes(), &cuts).expect("a well-formed stream");
        prop_assert_eq!(events.len(), chunks.len() + 1);
        prop_assert_eq!(events.last(), Some(&SseEvent::Done));
        for (i, (ev, c)) in events.iter().zip(&chunks).enumerate() {
            let SseEvent::Data(v) = ev else { return Err(TestCaseError::fail(format!("event {i} is not data"))) };
            prop_assert_eq!(v["id"].as_u64(), Some(i as u64));
            prop_assert_eq!(v["choices"][0]["delta"]["content"].as_str(), Some(c.as_str()));
        }
    }

    #[test]
    fn any_bytes_give_events_or_an_error(
        body in prop::collection::vec(any::<u8>(), 0..512), cuts in prop::collection::vec(0usize..64, 0..8),
    ) {
        let _ = feed_in_pieces(&body, &cuts);
    }
}
