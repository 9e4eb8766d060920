//! Decision time of every policy at 8, 64 and 256 workers with an index warmed by the whole
//! Mooncake conversation trace, tree insert/match, and index memory per cached block.
//!
//! Run: `cargo bench -p kvroute-core --bench decision`. Besides Criterion's estimates it
//! prints p50/p99 per policy (each call timed on its own) and bytes per cached block.

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_core::policy::{PickCtx, Policy, route};
use kvroute_core::radix::RadixTree;
use kvroute_core::registry;
use kvroute_core::types::{BlockHash, BlockSeq, Nanos, RequestView, Role, WorkerId, WorkerView};
use rand_core::SeedableRng;
use std::hint::black_box;
use std::time::Instant;

struct TraceReq {
    input: u32,
    blocks: Vec<BlockHash>,
}

fn mooncake() -> Vec<TraceReq> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_trace.jsonl");
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| TraceReq {
            input: v["input_length"].as_u64().unwrap_or(0) as u32,
            blocks: v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).map(BlockHash).collect())
                .unwrap_or_default(),
        })
        .collect()
}

fn fleet(n: usize) -> Vec<WorkerView> {
    (0..n)
        .map(|i| {
            let mut w = WorkerView::idle(WorkerId(i as u32));
            w.in_flight = (i % 7) as u32;
            w.pending_prefill_tokens = (i as u64 % 5) * 1000;
            w
        })
        .collect()
}

fn view<'a>(r: &'a TraceReq, text: Option<&'a str>) -> RequestView<'a> {
    RequestView {
        model: "m",
        text,
        token_ids: None,
        blocks: Some(BlockSeq { block_tokens: 512, hashes: &r.blocks }),
        input_tokens: r.input,
        output_tokens: Some(256),
        session_id: None,
        role: Role::Both,
    }
}

/// A policy warmed with the whole trace on `n` workers.
fn warmed(name: &str, trace: &[TraceReq], n: usize) -> Box<dyn Policy> {
    let mut p = registry::build(name, &serde_json::Value::Null).unwrap_or_else(|e| panic!("{e}"));
    let c = fleet(n);
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    for (i, r) in trace.iter().enumerate() {
        let mut ctx = PickCtx { now: Nanos::from_millis(i as u64), rng: &mut rng };
        let _ = route(p.as_mut(), &view(r, None), &c, &mut ctx);
    }
    p
}

/// The probe: a 4,096-token request (8 Mooncake blocks, the first shared with the trace's
/// system prompt) carrying 16,384 characters of text as well.
fn probe(trace: &[TraceReq]) -> (TraceReq, String) {
    let mut blocks = trace.iter().find(|r| r.blocks.len() >= 8).map(|r| r.blocks[..8].to_vec()).unwrap_or_default();
    blocks[7] = BlockHash(u64::MAX - 7);
    let text = "You are a helpful assistant. Answer the question using the documents. ".repeat(235);
    (TraceReq { input: 4096, blocks }, text[..16_384].to_string())
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
    let (pr, text) = probe(&trace);
    let mut summary = Vec::new();
    for n in [8usize, 64, 256] {
        let mut g = c.benchmark_group(format!("decision/{n}_workers"));
        g.sample_size(20)
            .measurement_time(std::time::Duration::from_secs(1))
            .warm_up_time(std::time::Duration::from_millis(300));
        for name in registry::names() {
            let p = warmed(name, &trace, n);
            let cands = fleet(n);
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
            let req = view(&pr, Some(&text));
            g.bench_function(name, |b| {
                b.iter(|| {
                    let mut ctx = PickCtx { now: Nanos::from_secs(4000), rng: &mut rng };
                    black_box(kvroute_core::policy::decide(p.as_ref(), black_box(&req), &cands, &mut ctx).ok())
                })
            });
            // p50/p99 of single decisions (key + pick + fallbacks; no commit).
            let mut h = hdrhistogram::Histogram::<u64>::new(3).unwrap_or_else(|e| panic!("{e}"));
            for _ in 0..20_000 {
                let mut ctx = PickCtx { now: Nanos::from_secs(4000), rng: &mut rng };
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
