//! Fuzzes the SSE tap of the load generator (`kvroute_bench::runner::SseTap`): any body,
//! cut into pieces at any points, must give events or an error — never panic — and the
//! same events whatever the cuts.
#![no_main]

use kvroute_bench::runner::SseTap;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [cut, body @ ..] = data else { return };
    let mut whole = SseTap::default();
    let mut a = Vec::new();
    let ra = whole.feed(body, &mut a);
    // The same body in pieces of `cut` bytes (1..=256).
    let step = usize::from(*cut).max(1);
    let mut pieces = SseTap::default();
    let mut b = Vec::new();
    let mut rb = Ok(());
    for p in body.chunks(step) {
        rb = pieces.feed(p, &mut b);
        if rb.is_err() {
            break;
        }
    }
    if ra.is_ok() && rb.is_ok() {
        assert_eq!(a, b, "events depend on where the body was cut");
    }
});
