//! Decision time of every policy at 8, 256, 1,024 and 4,096 workers with an index warmed by the whole
//! Mooncake conversation trace, tree insert/match, and index memory per cached block.
//!
//! Run: `cargo bench -p kvroute-core --bench decision`. Besides Criterion's estimates it
//! prints p50/p99 per policy (each call timed on its own) and bytes per cached block. A
//! policy that reads the fleet's digest ([`kvroute_core::fleet_digest::FleetDigest`]) is
//! given one, as the replay gives it; `kvroute bench decision --no-digest` times decisions
//! without one.

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_core::decision_bench::{TraceReq, fleet, parse_mooncake, probe, view, warmed};
use kvroute_core::policy::PickCtx;
use kvroute_core::radix::RadixTree;
use kvroute_core::registry;
use kvroute_core::types::{Nanos, WorkerId};
use rand_core::SeedableRng;
use std::hint::black_box;
use std::time::Instant;

fn mooncake() -> Vec<TraceReq> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_trace.jsonl");
    parse_mooncake(&std::fs::read_to_string(path).unwrap_or_default()).unwrap_or_default()
}

#[expect(
    clippy::disallowed_methods,
    reason = "a benchmark times the core with the wall clock; the core itself never reads it"
)]
fn bench_decisions(c: &mut Criterion) {
    let trace = mooncake();
    if trace.is_empty() {
        eprintln!("trace not found; skipping");
        return;
    }
    let (pr, text) = probe(&trace, 4096);
    let mut summary = Vec::new();
    for n in [8usize, 256, 1024, 4096] {
        let mut g = c.benchmark_group(format!("decision/{n}_workers"));
        g.sample_size(20)
            .measurement_time(std::time::Duration::from_secs(1))
            .warm_up_time(std::time::Duration::from_millis(300));
        for name in registry::names() {
            let cands = fleet(n);
            // The views' digest, kept beside them as the replay keeps it (least_ttft, prefill_cost, kv_score, the B3 scorers and the prefix policies read one).
            let p = warmed(name, &trace, &cands).unwrap_or_else(|e| panic!("{e}"));
            let digest = p.fleet_digest().map(|mut d| {
                d.refresh(&cands);
                d
            });
            let digest = digest.as_ref();
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
            let req = view(&pr, Some(&text));
            g.bench_function(name, |b| {
                b.iter(|| {
                    let mut ctx = PickCtx { now: Nanos::from_secs(4000), rng: &mut rng, fleet: digest };
                    black_box(kvroute_core::policy::decide(p.as_ref(), black_box(&req), &cands, &mut ctx).ok())
                })
            });
            // p50/p99 of single decisions (key + pick + fallbacks; no commit).
            let mut h = hdrhistogram::Histogram::<u64>::new(3).unwrap_or_else(|e| panic!("{e}"));
            for _ in 0..20_000 {
                let mut ctx = PickCtx { now: Nanos::from_secs(4000), rng: &mut rng, fleet: digest };
                let t = Instant::now();
                let _ = black_box(kvroute_core::policy::decide(p.as_ref(), black_box(&req), &cands, &mut ctx));
                let _ = h.record(t.elapsed().as_nanos() as u64);
            }
            summary.push((n, name, h.value_at_quantile(0.5), h.value_at_quantile(0.99), p.index_size()));
        }
        g.finish();
    }
    println!("\nworkers policy            p50_ns   p99_ns  ns/prompt-token(p50)  index_size");
    for (n, name, p50, p99, size) in summary {
        println!("{n:>7} {name:<16} {p50:>8} {p99:>8} {:>20.2} {size:>11}", p50 as f64 / 4096.0);
    }
}

fn bench_tree(c: &mut Criterion) {
    let text = "You are a helpful assistant. Answer the question using the documents. ".repeat(235);
    let mut g = c.benchmark_group("radix");
    for len in [1024usize, 4096, 16_384] {
        let key = &text.as_bytes()[..len];
        let mut t: RadixTree<u8> = RadixTree::new();
        for w in 0..64u32 {
            let mut k = key.to_vec();
            k[len / 2] = w as u8;
            t.insert(&k, WorkerId(w), Nanos(w as u64));
        }
        g.bench_function(format!("match_{len}_chars"), |b| b.iter(|| black_box(t.prefix_match(black_box(key), None))));
        g.bench_function(format!("insert_{len}_chars"), |b| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                t.insert(black_box(key), WorkerId((i % 64) as u32), Nanos(100 + i));
            })
        });
    }
    g.finish();
}

/// Heap bytes per cached block of the block index, measured by filling it.
fn index_memory(_c: &mut Criterion) {
    use kvroute_core::block_index::{BlockIndex, BlockIndexConfig};
    let trace = mooncake();
    let mut idx = BlockIndex::new(BlockIndexConfig { ttl_secs: 1e9, max_entries: 1 << 24 });
    let before = mem_kib();
    for (i, r) in trace.iter().enumerate() {
        idx.record(WorkerId((i % 8) as u32), &r.blocks, Nanos(i as u64));
    }
    let after = mem_kib();
    let entries = idx.entries();
    if let (Some(b), Some(a)) = (before, after) {
        println!(
            "block index: {} entries ({} blocks) from the Mooncake trace on 8 workers: {:.1} bytes/entry (RSS delta {} KiB)",
            entries,
            idx.blocks(),
            (a.saturating_sub(b) * 1024) as f64 / entries.max(1) as f64,
            a.saturating_sub(b)
        );
    }
}

fn mem_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}

criterion_group!(benches, index_memory, bench_tree, bench_decisions);
criterion_main!(benches);
