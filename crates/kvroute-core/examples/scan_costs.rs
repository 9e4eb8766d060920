//! Benchmark aid (not a test): what one pass over a fleet's views costs, piece by piece, next
//! to a whole decision — the decision benchmark's fleet and warmed policy, 20,000 timings of
//! each, p10 / p50 / p99 in nanoseconds.
//!
//! `cargo run --release -p kvroute-core --example scan_costs -- [WORKERS] [POLICY] [TRACE]`
//! (defaults 1024, cache_aware, data/traces/mooncake_conversation_trace.jsonl from the
//! repository's root). Read the p99s beside `scripts/vm-stalls.py`: on a VM a timing of
//! more than a few microseconds can contain the host's stall.

// A benchmark times with the wall clock; the core itself never reads it.
#![allow(clippy::disallowed_methods)]

use kvroute_core::decision_bench::{fleet, parse_mooncake, probe, view, warmed};
use kvroute_core::policy::util::{FleetScan, argmin_by};
use kvroute_core::policy::{PickCtx, decide};
use kvroute_core::radix::TenantSet;
use kvroute_core::types::{Nanos, WorkerView};
use rand_core::SeedableRng;
use std::hint::black_box;
use std::time::Instant;

fn time(name: &str, mut f: impl FnMut()) {
    let mut v: Vec<u64> = (0..20_000)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64
        })
        .collect();
    v.sort_unstable();
    println!("{name:40} p10 {:7} p50 {:7} p99 {:7}", v[2_000], v[10_000], v[19_800]);
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).map_or(Ok(1024), |s| s.parse().map_err(|e| format!("WORKERS: {e}")))?;
    let policy = args.get(2).map_or("cache_aware", String::as_str);
    let path = args.get(3).map_or("data/traces/mooncake_conversation_trace.jsonl", String::as_str);
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let trace = parse_mooncake(&text)?;
    let (pr, probe_text) = probe(&trace, 4096);
    let c = fleet(n);
    let p = warmed(policy, &trace, &c)?;
    let req = view(&pr, Some(&probe_text));
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
    // Tree sizes as cache_aware's low-match branch reads them (any spread will do).
    let sizes: Vec<usize> = (0..n).map(|i| (i * 7919) % 1000 + 5).collect();
    println!("{n} workers, {} bytes a view", std::mem::size_of::<WorkerView>());
    time(&format!("decide ({policy})"), || {
        let mut ctx = PickCtx { now: Nanos::from_secs(4000), rng: &mut rng, fleet: None };
        let _ = black_box(decide(p.as_ref(), black_box(&req), &c, &mut ctx));
    });
    time("FleetScan::of (prefix policies' pass)", || {
        black_box(FleetScan::of(black_box(&c), &req));
    });
    time("sum of in_flight", || {
        black_box(black_box(&c[..]).iter().map(|w| u64::from(w.in_flight)).sum::<u64>());
    });
    time("sum of load()", || {
        black_box(black_box(&c[..]).iter().map(|w| u64::from(w.load())).sum::<u64>());
    });
    time("sum of routable ids", || {
        black_box(black_box(&c[..]).iter().filter(|w| w.is_routable()).map(|w| u64::from(w.id.0)).sum::<u64>());
    });
    time("min and max of in_flight", || {
        let it = black_box(&c[..]).iter().map(|w| w.in_flight);
        black_box((it.clone().min(), it.max()));
    });
    time("min and max of load(), routable", || {
        let (mut lo, mut hi) = (u32::MAX, 0);
        for w in black_box(&c[..]).iter().filter(|w| w.is_routable()) {
            let l = w.load();
            (lo, hi) = (lo.min(l), hi.max(l));
        }
        black_box((lo, hi));
    });
    time("routable ids into a TenantSet", || {
        black_box(TenantSet::from_ids(black_box(&c[..]).iter().filter(|w| w.is_routable()).map(|w| w.id)));
    });
    time("argmin_by load()", || {
        black_box(argmin_by(black_box(&c), |_| true, WorkerView::load));
    });
    time("argmin_by (tree size, load())", || {
        let sz = black_box(&sizes);
        black_box(argmin_by(black_box(&c), |_| true, |w| (sz.get(w.id.index()).copied().unwrap_or(0), w.load())));
    });
    Ok(())
}
