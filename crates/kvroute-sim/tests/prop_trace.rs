//! Property tests of the trace readers (`kvroute_sim::trace::read_from`), beside the
//! cargo-fuzz target `trace_read`: generated valid lines come back as the same requests,
//! sorted by arrival; a bad line is refused naming its line number; any bytes give requests
//! or an error.

use kvroute_sim::trace::{TraceError, TraceFormat, read_from};
use proptest::prelude::*;
use std::path::Path;

proptest! {
    #[test]
    fn mooncake_lines_are_read_back(
        rows in prop::collection::vec((0u64..10_000_000, 1u64..100_000, 1u64..4096, prop::collection::vec(any::<u32>(), 0..8)), 1..20),
    ) {
        let text: String = rows
            .iter()
            .map(|(ts, i, o, h)| format!("{}\n", serde_json::json!({"timestamp": ts, "input_length": i, "output_length": o, "hash_ids": h})))
            .collect();
        let trace = read_from(text.as_bytes(), Path::new("t.jsonl"), TraceFormat::Mooncake).expect("valid");
        prop_assert_eq!(trace.len(), rows.len());
        prop_assert!(trace.windows(2).all(|w| w[0].arrival <= w[1].arrival));
        let mut want: Vec<(u64, u32, u32)> = rows.iter().map(|(ts, i, o, _)| (ts * 1_000_000, *i as u32, *o as u32)).collect();
        want.sort();
        let mut got: Vec<(u64, u32, u32)> = trace.iter().map(|r| (r.arrival.0, r.input_tokens, r.output_tokens)).collect();
        got.sort();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn a_bad_line_is_refused_naming_it(good in 0usize..10, bad in "[a-z{}\\[\\]:,\"]{1,20}") {
        let mut text = String::new();
        for k in 0..good {
            text.push_str(&format!("{}\n", serde_json::json!({"timestamp": k, "input_length": 10, "output_length": 5, "hash_ids": [k]})));
        }
        text.push_str(&bad);
        text.push('\n');
        match read_from(text.as_bytes(), Path::new("t.jsonl"), TraceFormat::Mooncake) {
            Err(TraceError::Field { line, .. }) => prop_assert_eq!(line, good + 1),
            other => prop_assert!(false, "expected an error naming line {}, got {:?}", good + 1, other.map(|t| t.len())),
        }
    }

    #[test]
    fn any_bytes_give_requests_or_an_error(body in prop::collection::vec(any::<u8>(), 0..512), f in 0usize..3) {
        let format = [TraceFormat::Mooncake, TraceFormat::Session, TraceFormat::Azure][f];
        let _ = read_from(body.as_slice(), Path::new("t"), format);
    }
}
