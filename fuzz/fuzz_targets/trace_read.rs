//! Fuzzes the trace readers (`kvroute_sim::trace::read_from`): Mooncake JSONL, session JSONL
//! and Azure CSV (the first byte picks the format). Any input must give requests or an
//! error naming the line and field — never panic.
#![no_main]

use kvroute_sim::trace::{TraceFormat, read_from};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [sel, body @ ..] = data else { return };
    let format = match sel % 3 {
        0 => TraceFormat::Mooncake,
        1 => TraceFormat::Session,
        _ => TraceFormat::Azure,
    };
    if let Ok(trace) = read_from(body, std::path::Path::new("fuzz.trace"), format) {
        assert!(!trace.is_empty());
        assert!(trace.windows(2).all(|w| w[0].arrival <= w[1].arrival), "not sorted by arrival");
    }
});
