//! Each reference system's stated routing behaviour (SGLang router cache_aware, Ray Serve
//! PrefixCacheAffinityRouter, Cognitora cgn-router's KV score), reproduced through the public registry API.

use kvroute_core::policy::kv_score::tie_hash;
use kvroute_core::policy::{Branch, Decision, PickCtx, Policy, fallbacks, route};
use kvroute_core::registry::build;
use kvroute_core::types::{Health, Nanos, RequestView, WorkerId, WorkerView};
use rand_core::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;

fn fleet(loads: &[u32]) -> Vec<WorkerView> {
    loads
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let mut w = WorkerView::idle(WorkerId(i as u32));
            w.in_flight = l;
            w
        })
        .collect()
}

fn go(p: &mut dyn Policy, text: &str, c: &[WorkerView], seed: u64) -> Decision {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet: None };
    route(p, &RequestView::from_text("m", text), c, &mut ctx).expect("routable")
}

const DOC: &str = "You are a helpful assistant. The following document describes the system in detail. ";

// ---- SGLang router: cache_aware ----

#[test]
fn cache_aware_imbalanced_needs_both_rules() {
    let mut p = build("cache_aware", &serde_json::Value::Null).expect("build");
    let prompt = DOC.repeat(4);
    // Warm worker 2 with the prompt.
    go(p.as_mut(), &prompt, &fleet(&[0, 0, 0]), 1);
    // abs diff 33 > 32 and 40 > 1.0001 × 7 → imbalanced → least loaded (worker 0), not worker 2.
    let d = go(p.as_mut(), &prompt, &fleet(&[7, 20, 40]), 1);
    assert_eq!((d.branch, d.worker), (Branch::Imbalanced, WorkerId(0)));
    // abs diff 32 is not > 32 → balanced → prefix match wins despite load.
    let d = go(p.as_mut(), &prompt, &fleet(&[8, 20, 40]), 1);
    assert_eq!(d.branch, Branch::HighMatch);
    // Relative rule fails: 1.0001 × 1,000,000 ≥ 1,000,033 → balanced.
    let mut p = build("cache_aware", &serde_json::json!({"balance_rel_threshold": 1.0001})).expect("build");
    go(p.as_mut(), &prompt, &fleet(&[0, 0, 0]), 1);
    let d = go(p.as_mut(), &prompt, &fleet(&[1_000_000, 1_000_033, 1_000_010]), 1);
    assert_ne!(d.branch, Branch::Imbalanced);
}

#[test]
fn cache_aware_high_match_goes_to_holder_low_match_to_smallest_tree() {
    let mut p = build("cache_aware", &serde_json::Value::Null).expect("build");
    let a = format!("{DOC}{}", "alpha ".repeat(50));
    let first = go(p.as_mut(), &a, &fleet(&[0, 0, 0]), 1);
    // Same prompt again with a small extension: match rate > 0.5 → the holder.
    let d = go(p.as_mut(), &format!("{a} and more"), &fleet(&[0, 0, 0]), 1);
    assert_eq!((d.branch, d.worker), (Branch::HighMatch, first.worker));
    assert!(d.matched as usize >= a.len());
    // An unrelated prompt: low match → a worker with an empty tree, not the holder.
    let d = go(p.as_mut(), &"zzz unrelated ".repeat(30), &fleet(&[0, 0, 0]), 1);
    assert_eq!(d.branch, Branch::LowMatch);
    assert_ne!(d.worker, first.worker);
}

#[test]
fn cache_aware_misses_rotate_instead_of_pinning_the_first_worker() {
    let mut p = build("cache_aware", &serde_json::Value::Null).expect("build");
    let mut seen = std::collections::HashSet::new();
    // Equal tiny prompts so trees stay equal-sized: rotation must spread them.
    for i in 0..4 {
        seen.insert(go(p.as_mut(), &format!("{i}"), &fleet(&[0, 0, 0, 0]), 1).worker);
    }
    assert_eq!(seen.len(), 4);
}

#[test]
fn cache_aware_tree_stays_within_max_tree_size_between_eviction_passes() {
    // SGLang router trims the tree every `eviction_interval_secs` (60 s); kvroute also holds
    // the budget on insert, so distinct prompts cannot grow it without bound in between.
    let budget = 2_000;
    let mut p = build("cache_aware", &serde_json::json!({"max_tree_size": budget})).expect("build");
    let mut most = 0;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
    for i in 0..300 {
        let prompt = format!("{i:05} distinct prompt {}", "x".repeat(80));
        let mut ctx = PickCtx { now: Nanos::from_secs(i + 1), rng: &mut rng, fleet: None };
        route(p.as_mut(), &RequestView::from_text("m", &prompt), &fleet(&[0, 0, 0]), &mut ctx).expect("routable");
        most = most.max(p.index_size() as usize);
        assert!(p.index_size() as usize <= budget + prompt.len(), "prompt {i}: tree {} > budget", p.index_size());
    }
    assert!(most > budget / 2, "the tree was used ({most})");
    // The most recent prompt is still there in full.
    let last = format!("{:05} distinct prompt {}", 299, "x".repeat(80));
    let mut ctx = PickCtx { now: Nanos::from_secs(400), rng: &mut rng, fleet: None };
    let d = route(p.as_mut(), &RequestView::from_text("m", &last), &fleet(&[0, 0, 0]), &mut ctx).expect("routable");
    assert_eq!((d.branch, d.matched as usize), (Branch::HighMatch, last.len()));
}

// ---- Ray Serve PrefixCacheAffinityRouter: prefix_affinity ----

#[test]
fn prefix_affinity_three_tiers() {
    let mut p = build("prefix_affinity", &serde_json::Value::Null).expect("build");
    let prompt = DOC.repeat(3);
    let first = go(p.as_mut(), &prompt, &fleet(&[0, 0, 0, 0]), 7);
    // Tier 2a: balanced and match rate ≥ 0.1 → the replica holding the match.
    for seed in 0..20 {
        let d = go(p.as_mut(), &prompt, &fleet(&[3, 3, 3, 3]), seed);
        assert_eq!((d.branch, d.worker), (Branch::HighMatch, first.worker), "seed {seed}");
    }
    // Tier 2b: match rate < 0.1 → smallest tenants (never the holder, whose tenant is big).
    // Three misses fill the three empty tenants one by one.
    let mut filled = std::collections::HashSet::new();
    for seed in 0..3 {
        let d = go(p.as_mut(), &format!("Q{seed}: {}", "x".repeat(200)), &fleet(&[0, 0, 0, 0]), seed);
        assert_eq!(d.branch, Branch::LowMatch);
        assert_ne!(d.worker, first.worker, "seed {seed}");
        assert!(filled.insert(d.worker), "seed {seed}: went to a non-empty tenant");
    }
    // Tier 1: spread 11 > 10 → Power of Two Choices over everyone, ignoring the prefix.
    let mut loads = [0, 0, 0, 0];
    loads[first.worker.index()] = 11;
    let mut holder_hits = 0;
    for seed in 0..40 {
        let d = go(p.as_mut(), &prompt, &fleet(&loads), seed);
        assert_eq!(d.branch, Branch::Imbalanced);
        holder_hits += usize::from(d.worker == first.worker);
    }
    assert_eq!(holder_hits, 0, "P2C never prefers the loaded holder over an idle worker");
    // Spread exactly 10 is balanced.
    loads[first.worker.index()] = 10;
    assert_eq!(go(p.as_mut(), &prompt, &fleet(&loads), 3).branch, Branch::HighMatch);
}

#[test]
fn prefix_affinity_forgets_dead_replicas() {
    let mut p = build("prefix_affinity", &serde_json::Value::Null).expect("build");
    let prompt = DOC.repeat(3);
    let first = go(p.as_mut(), &prompt, &fleet(&[0, 0]), 1);
    p.on_worker_removed(first.worker);
    assert_eq!(p.index_size() as usize, 0);
}

// ---- Cognitora cgn-router: kv_score ----

#[test]
fn kv_score_tie_break_is_stable_across_calls_and_processes() {
    // Pinned values: the tie hash must never change between versions or processes.
    assert_eq!(tie_hash(WorkerId(0), 42), tie_hash(WorkerId(0), 42));
    let pinned = [tie_hash(WorkerId(0), 0x1234), tie_hash(WorkerId(1), 0x1234), tie_hash(WorkerId(7), 0xdead_beef)];
    assert_eq!(pinned, [PINNED_0, PINNED_1, PINNED_2], "{pinned:x?}");
    // Identical idle workers tie; the same prompt goes to the same worker every time, in
    // fresh policy instances too (as if in another process).
    let prompt = DOC.repeat(2);
    let mut winners = std::collections::HashSet::new();
    for _ in 0..5 {
        let mut p = build("kv_score", &serde_json::Value::Null).expect("build");
        for seed in 0..5 {
            let d = go(p.as_mut(), &prompt, &fleet(&[0, 0, 0, 0]), seed);
            winners.insert(d.worker);
            if d.matched == 0 {
                assert_eq!(d.branch, Branch::TieBreak);
            }
        }
    }
    assert_eq!(winners.len(), 1);
}

// xxh3-64 (seed ROOT_SEED) of worker id u32 LE ‖ prefix hash u64 LE, pinned at first release.
const PINNED_0: u64 = 0x5682_f3c5_ff2a_62b0;
const PINNED_1: u64 = 0x7726_5e44_d221_f6c3;
const PINNED_2: u64 = 0x8cbd_803d_34d6_4c6b;

#[test]
fn kv_score_overlap_beats_small_load_difference_and_loses_to_saturation() {
    let mut p = build("kv_score", &serde_json::Value::Null).expect("build");
    let prompt = DOC.repeat(2);
    let mut c = fleet(&[0, 0]);
    let first = go(p.as_mut(), &prompt, &c, 1).worker;
    let other = WorkerId(1 - first.0);
    // Holder slightly busier: 0.55 overlap outweighs 0.25 × 10/256.
    c[first.index()].in_flight = 10;
    assert_eq!(go(p.as_mut(), &prompt, &c, 1).worker, first);
    // Make load dominate live (w_load 0.9): a saturated holder (util 1.0) now loses.
    p.set_knobs(&serde_json::json!({"w_kv": 0.1, "w_load": 0.9})).expect("knobs");
    c[first.index()].in_flight = 256;
    assert_eq!(go(p.as_mut(), &prompt, &c, 1).worker, other);
}

/// kv_score with Cognitora cgn-router's own defaults (64 leading tokens, the saturating
/// utilisation); kvroute's defaults differ (the whole prompt, the queue).
fn kv_score_seed() -> Box<dyn Policy> {
    build("kv_score", &serde_json::Value::Null).expect("build")
}

/// kvroute's alternative to cgn-router's kv_score defaults: the whole prompt, xxh3, queues.
fn kv_score_whole_prompt() -> Box<dyn Policy> {
    build("kv_score", &serde_json::json!({"prefix_tokens": 1_048_576, "hash": "xxh3", "load_signal": "queue"}))
        .expect("build")
}

#[test]
fn kv_score_defaults_are_cognitora_cgn_routers() {
    let k = kv_score_seed().knobs();
    for (knob, v) in [
        ("prefix_tokens", serde_json::json!(64)),
        ("block_tokens", serde_json::json!(16)),
        ("hash", serde_json::json!("blake3")),
        ("load_signal", serde_json::json!("seed")),
        ("epsilon", serde_json::json!(0.01)),
        ("w_kv", serde_json::json!(0.55)),
        ("w_load", serde_json::json!(0.25)),
        ("w_pwr", serde_json::json!(0.1)),
        ("w_cap", serde_json::json!(0.1)),
    ] {
        assert_eq!(k[knob], v, "{knob}");
    }
}

#[test]
fn kv_score_with_the_seed_defaults_hashes_the_first_64_tokens_whatever_the_block_size() {
    use kvroute_core::types::{BlockHash, BlockSeq};
    // Two trace requests (512-token blocks) sharing only their first block: 64 tokens lie
    // inside that block, so the holder of block 0 has full overlap for the second request,
    // exactly as with 64 real tokens of a shared system prompt.
    let mut p = kv_score_seed();
    static A: [BlockHash; 4] = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)];
    static B: [BlockHash; 4] = [BlockHash(1), BlockHash(9), BlockHash(10), BlockHash(11)];
    static E: [BlockHash; 5] = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4), BlockHash(5)];
    let view = |h: &'static [BlockHash]| RequestView {
        blocks: Some(BlockSeq { block_tokens: 512, hashes: h }),
        input_tokens: 2048,
        ..RequestView::from_text("m", "")
    };
    let c = fleet(&[0, 0, 0, 0]);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
    let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet: None };
    let first = route(p.as_mut(), &view(&A), &c, &mut ctx).expect("routable");
    let second = route(p.as_mut(), &view(&B), &c, &mut ctx).expect("routable");
    assert_eq!(second.worker, first.worker);
    assert_eq!((second.matched, second.key_len), (1, 1), "one 512-token block covers the 64-token prefix");
    // With 16-token blocks (KV events) the same 64 tokens are four blocks.
    let mut p = kv_score_seed();
    let ev = RequestView { blocks: Some(BlockSeq { block_tokens: 16, hashes: &E }), input_tokens: 80, ..view(&A) };
    let d = route(p.as_mut(), &ev, &c, &mut ctx).expect("routable");
    assert_eq!(d.key_len, 4);
}

#[test]
fn kv_score_over_the_whole_prompt_by_queue_spreads_a_shared_system_prompt_and_the_defaults_do_not() {
    use kvroute_core::types::{BlockHash, BlockSeq};
    // Requests share block 0 (the system prompt) and nothing else. With cgn-router's
    // defaults the holder of block 0 has full overlap for every one of them and gets them
    // all, however long its queue; over the whole prompt (1 of 4 blocks) with the queue
    // signal, the worker's queued prefill counts against it.
    static A: [BlockHash; 4] = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)];
    static B: [BlockHash; 4] = [BlockHash(1), BlockHash(9), BlockHash(10), BlockHash(11)];
    let view = |h: &'static [BlockHash]| RequestView {
        blocks: Some(BlockSeq { block_tokens: 512, hashes: h }),
        input_tokens: 2048,
        ..RequestView::from_text("m", "")
    };
    for (mut p, spreads) in [(kv_score_whole_prompt(), true), (kv_score_seed(), false)] {
        let mut c = fleet(&[0, 0, 0, 0]);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet: None };
        let first = route(p.as_mut(), &view(&A), &c, &mut ctx).expect("routable").worker;
        // The holder now has that request's prefill queued.
        c[first.index()].in_flight = 1;
        c[first.index()].pending_prefill_tokens = 2048;
        let second = route(p.as_mut(), &view(&B), &c, &mut ctx).expect("routable");
        assert_eq!(second.worker != first, spreads, "{} {:?}", p.knobs(), second);
        if spreads {
            assert_eq!(second.key_len, 4, "the whole prompt is the key");
        }
    }
}

#[test]
fn engine_reported_cached_tokens_override_the_policies_own_estimate() {
    // Worker 1 reports (from KV events) that it holds 300 of the prompt's tokens; worker 0
    // publishes no events and has never seen the prompt. Both policies follow the engine.
    let prompt = DOC.repeat(16); // 336 tokens at 4 characters per token
    let mut c = fleet(&[1, 1]);
    c[1].cached_tokens = Some(300);
    for name in ["prefill_cost", "kv_score", "cache_aware", "prefix_affinity", "lmetric", "unified"] {
        let mut p = build(name, &serde_json::Value::Null).expect("build");
        let d = go(p.as_mut(), &prompt, &c, 1);
        assert_eq!(d.worker, WorkerId(1), "{name}");
        if name != "kv_score" {
            assert_eq!((d.matched, d.unit), (300, kvroute_core::policy::MatchUnit::Tokens), "{name}");
        }
    }
    let mut p = build("prefill_cost", &serde_json::Value::Null).expect("build");
    let d = go(p.as_mut(), &prompt, &c, 1);
    assert_eq!((d.matched, d.unit), (300, kvroute_core::policy::MatchUnit::Tokens));
    // The engine says worker 1 evicted it all: the router's own memory of having sent the
    // prompt there does not count for a worker with events.
    c[1].cached_tokens = Some(0);
    c[0].in_flight = 2;
    let d = go(p.as_mut(), &prompt, &c, 1);
    assert_eq!((d.worker, d.matched), (WorkerId(1), 0));
}

#[test]
fn kv_score_weights_change_live_in_their_one_home() {
    use kvroute_core::policy::kv_score::KvScore;
    let mut p = KvScore::new(Default::default());
    p.set_knobs(&serde_json::json!({"w_kv": 0.0, "w_load": 1.0, "w_pwr": 0.0, "w_cap": 0.0})).expect("valid weights");
    assert_eq!(p.knobs()["w_load"], serde_json::json!(1.0));
    let mut c = fleet(&[5, 1]);
    c[0].capacity.max_concurrent = 10;
    c[1].capacity.max_concurrent = 10;
    assert_eq!(go(&mut p, "hello", &c, 1).worker, WorkerId(1));
}

#[test]
fn kv_score_weights_change_through_a_shared_reference_and_other_knobs_do_not() {
    use kvroute_core::policy::kv_score::KvScore;
    let mut p = KvScore::new(Default::default());
    let mut c = fleet(&[5, 1]);
    c[0].capacity.max_concurrent = 10;
    c[1].capacity.max_concurrent = 10;
    // Only the capacity term: worker 0 is the larger one.
    c[0].capacity.vram_gib = 80.0;
    c[1].capacity.vram_gib = 40.0;
    let only = |w: &str| {
        let mut v = serde_json::json!({"w_kv": 0.0, "w_load": 0.0, "w_pwr": 0.0, "w_cap": 0.0});
        v[w] = serde_json::json!(1.0);
        v
    };
    {
        let shared: &KvScore = &p;
        shared.set_live_knobs(&only("w_cap")).expect("live").expect("valid");
    }
    assert_eq!(go(&mut p, "hello", &c, 1).worker, WorkerId(0), "capacity alone picks the larger worker");
    {
        let shared: &KvScore = &p;
        shared.set_live_knobs(&only("w_load")).expect("live").expect("valid");
        let bad = shared.set_live_knobs(&serde_json::json!({"w_kv": -1.0})).expect("live");
        assert!(bad.expect_err("negative weight").to_string().contains("w_kv"));
        assert!(shared.set_live_knobs(&serde_json::json!({"w_kv": 0.5, "ttl_secs": 5.0})).is_none());
    }
    assert_eq!(p.knobs()["w_load"], serde_json::json!(1.0), "the refused patch changed nothing");
    assert_eq!(go(&mut p, "hello", &c, 1).worker, WorkerId(1), "load alone picks the less loaded worker");
}

// ---- all policies ----

#[test]
fn no_policy_ever_picks_an_unhealthy_worker() {
    for name in kvroute_core::registry::names() {
        let mut p = build(name, &serde_json::Value::Null).expect("build");
        let mut c = fleet(&[0, 0, 0]);
        // Warm worker 0 then make it unhealthy.
        go(p.as_mut(), &DOC.repeat(3), &c, 1);
        c[0].health = Health::Unhealthy;
        c[1].health = Health::Draining;
        for seed in 0..10 {
            let d = go(p.as_mut(), &DOC.repeat(3), &c, seed);
            assert_eq!(d.worker, WorkerId(2), "{name}");
            assert!(!fallbacks(&d, &c).contains(&WorkerId(0)), "{name}");
        }
    }
}

#[test]
fn all_unhealthy_is_an_error_not_a_panic() {
    for name in kvroute_core::registry::names() {
        let mut p = build(name, &serde_json::Value::Null).expect("build");
        let mut c = fleet(&[0, 0]);
        for w in &mut c {
            w.health = Health::Unhealthy;
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None };
        assert!(route(p.as_mut(), &RequestView::from_text("m", "hi"), &c, &mut ctx).is_err(), "{name}");
        assert!(route(p.as_mut(), &RequestView::from_text("m", "hi"), &[], &mut ctx).is_err(), "{name}");
    }
}

#[test]
fn cache_aware_mixes_precise_and_approximate_workers_by_match_rate() {
    // Worker 0 publishes no events (its tree entry counts); worker 1 does (its engine count
    // counts, its tree entry does not).
    let prompt = DOC.repeat(16);
    let mut p = build("cache_aware", &serde_json::Value::Null).expect("build");
    let mut c = fleet(&[1, 1]);
    c[1].cached_tokens = Some(0);
    let view = RequestView::from_text("m", &prompt);
    kvroute_core::policy::record_routed(p.as_mut(), &view, WorkerId(0), Nanos::from_secs(1));
    kvroute_core::policy::record_routed(p.as_mut(), &view, WorkerId(1), Nanos::from_secs(1));
    let d = go(p.as_mut(), &prompt, &c, 1);
    assert_eq!((d.worker, d.unit), (WorkerId(0), kvroute_core::policy::MatchUnit::Chars));
    assert_eq!(d.matched, prompt.len() as u64);
    // Both hold all of it now; the less loaded one of the two wins.
    c[1].cached_tokens = Some(view.input_tokens as u64);
    c[0].in_flight = 2;
    let d = go(p.as_mut(), &prompt, &c, 1);
    assert_eq!(
        (d.worker, d.matched, d.unit),
        (WorkerId(1), view.input_tokens as u64, kvroute_core::policy::MatchUnit::Tokens)
    );
}

// ---- consistent_hash (rendezvous hashing, named workers) ----

#[test]
fn consistent_hash_sends_a_session_to_the_same_named_worker_on_every_replica() {
    // Two replicas list the same six workers (named by a hash of their URL) in opposite
    // orders, so each gives them other ids.
    let names: Vec<u64> = (0..6u64).map(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1)).collect();
    let replica = |order: &[usize]| -> Vec<WorkerView> {
        order
            .iter()
            .enumerate()
            .map(|(id, &n)| {
                let mut w = WorkerView::idle(WorkerId(id as u32));
                w.tie_key = Some(names[n]);
                w
            })
            .collect()
    };
    let a = replica(&[0, 1, 2, 3, 4, 5]);
    let mut b = replica(&[5, 4, 3, 2, 1, 0]);
    let named = |c: &[WorkerView], d: &Decision| c[d.worker.index()].tie_key;
    let mut p = build("consistent_hash", &serde_json::Value::Null).expect("build");
    let mut spread = std::collections::HashSet::new();
    for s in 0..40 {
        let sid = format!("session-{s}");
        let mut req = RequestView::from_text("m", "hello");
        req.session_id = Some(&sid);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet: None };
        let da = route(p.as_mut(), &req, &a, &mut ctx).expect("routable");
        let db = route(p.as_mut(), &req, &b, &mut ctx).expect("routable");
        assert_eq!(named(&a, &da), named(&b, &db), "{sid}: the replicas disagree");
        spread.insert(named(&a, &da));
        // Another worker leaving does not move the session.
        let gone = (da.worker.index() + 1) % a.len();
        let mut fewer = a.clone();
        fewer[gone].health = Health::Unhealthy;
        let df = route(p.as_mut(), &req, &fewer, &mut ctx).expect("routable");
        assert_eq!(df.worker, da.worker, "{sid}");
        // Its own worker leaving moves it to the worker the other replica would pick too.
        b[db.worker.index()].health = Health::Unhealthy;
        let mut left = a.clone();
        left[da.worker.index()].health = Health::Unhealthy;
        let (ma, mb) = (
            route(p.as_mut(), &req, &left, &mut ctx).expect("routable"),
            route(p.as_mut(), &req, &b, &mut ctx).expect("routable"),
        );
        assert_eq!(named(&left, &ma), named(&b, &mb), "{sid}: the replicas disagree after a worker left");
        b[db.worker.index()].health = Health::Healthy;
    }
    assert!(spread.len() >= 4, "40 sessions on {} of 6 workers", spread.len());
}
