//! Soak: `kvroute serve` (default policy and knobs) in front of 4 `kvroute engine-sim`
//! workers, 8 clients sending distinct long prompts (4–16 KiB of random words, so nearly
//! every prompt is new text for the prefix index) for `KVROUTE_SOAK_SECS` (default 120).
//! The router's resident memory (VmRSS of its process) is sampled every 2 s.
//!
//! The bound, [`RSS_BOUND_MIB`]: cache_aware's tree is held to `max_tree_size` (16,777,216
//! chars by default) on every insert, and it fills within seconds here (each client sends
//! ~10 KiB of new text per request). Measured on the 2-core development machine
//! (`KVROUTE_SOAK_SECS=60 cargo nextest run -p kvroute --test soak --no-capture`): 38,602
//! requests, RSS flat at 79 MiB from the second quarter on. The bound is about 3× that,
//! room for allocator and runtime differences between machines, and a fraction of the
//! ≈ 1 GB the tree reached in 20 s before its budget was held on insert. Memory must also
//! level off: the largest sample of the last quarter may exceed the largest of the second
//! quarter by at most 25 % (a leak grows without bound).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

mod common;
use common::{free_port, spawn_kvroute, wait_ok};

/// Most resident memory the router may hold during the soak, MiB.
const RSS_BOUND_MIB: f64 = 256.0;

fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// xorshift64*: a fixed-seed word source, so runs are comparable.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

fn prompt(state: &mut u64) -> String {
    const WORDS: [&str; 16] = [
        "router", "cache", "prefix", "token", "worker", "decode", "prefill", "block", "tenant", "stream", "latency",
        "queue", "model", "shard", "batch", "kernel",
    ];
    let len = 4096 + (next(state) % 12_288) as usize;
    let mut s = String::with_capacity(len + 16);
    while s.len() < len {
        s.push_str(WORDS[(next(state) % 16) as usize]);
        s.push_str(&format!("{} ", next(state) % 1000));
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_minutes_of_distinct_long_prompts_keep_the_router_under_its_memory_bound() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let secs: u64 = std::env::var("KVROUTE_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(120);
    let mut workers = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..4 {
        let p = free_port();
        workers.push(spawn_kvroute(&[
            "engine-sim".into(),
            "--port".into(),
            p.to_string(),
            "--time-scale".into(),
            "50".into(),
        ]));
        urls.push(format!("http://127.0.0.1:{p}"));
    }
    for u in &urls {
        wait_ok(u, "/health").await;
    }
    let port = free_port();
    let router =
        spawn_kvroute(&["serve".into(), "--port".into(), port.to_string(), "--worker-urls".into(), urls.join(",")]);
    let r = format!("http://127.0.0.1:{port}");
    wait_ok(&r, "/readiness").await;
    let pid = router.0.id();

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut clients = Vec::new();
    for k in 0..8u64 {
        let (r, stop, ok, failed) = (r.clone(), Arc::clone(&stop), Arc::clone(&ok), Arc::clone(&failed));
        clients.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            let mut state = 0x9E37_79B9_7F4A_7C15 ^ (k + 1);
            while !stop.load(Ordering::Relaxed) {
                let body =
                    serde_json::json!({"model": "sim-llama-3-8b", "prompt": prompt(&mut state), "max_tokens": 2});
                let sent = tokio::time::timeout(Duration::from_secs(60), async {
                    let resp = c.post(format!("{r}/v1/completions")).json(&body).send().await.ok()?;
                    let status = resp.status();
                    resp.bytes().await.ok()?;
                    Some(status)
                })
                .await
                .expect("hang guard: no answer within 60 s");
                match sent {
                    Some(s) if s.is_success() => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    let mut samples = Vec::new();
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(secs) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        samples.push(rss_mib(pid).expect("the router's /proc status (it exited?)"));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.expect("client");
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    let max = samples.iter().copied().fold(0.0, f64::max);
    let q = samples.len() / 4;
    let second = samples[q..2 * q].iter().copied().fold(0.0, f64::max);
    let last = samples[3 * q..].iter().copied().fold(0.0, f64::max);
    eprintln!(
        "soak: {secs} s, {ok} ok, {failed} failed, RSS max {max:.0} MiB (2nd quarter {second:.0}, last quarter {last:.0}; bound {RSS_BOUND_MIB})"
    );
    assert!(samples.len() >= 4, "too few samples");
    assert_eq!(failed, 0, "requests failed during the soak");
    assert!(ok > 0);
    assert!(max <= RSS_BOUND_MIB, "router RSS reached {max:.0} MiB (bound {RSS_BOUND_MIB} MiB): {samples:?}");
    assert!(last <= second * 1.25, "router RSS still growing: {samples:?}");
}
