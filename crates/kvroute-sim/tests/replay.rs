//! Replay: determinism across runs, and the precise prefix state (engine cache contents
//! plus the predict-on-route window) against the approximate one.

use kvroute_core::types::{BlockHash, Nanos};
use kvroute_sim::engine::Profile;
use kvroute_sim::replay::{KvOracle, KvPull, PrefixState, ReplayConfig, ReplayResult, replay};
use kvroute_sim::trace::TraceRequest;
use kvroute_sim::types::{KvMigration, TransferModel};

fn req(at_ms: u64, blocks: &[u64]) -> TraceRequest {
    TraceRequest {
        tenant: None,
        arrival: Nanos::from_millis(at_ms),
        input_tokens: blocks.len() as u32 * 512,
        output_tokens: 16,
        blocks: blocks.iter().map(|b| BlockHash(*b)).collect(),
        block_tokens: 512,
        session: None,
        turn: 0,
    }
}

fn cfg(policy: &str, engines: usize, prefix_state: PrefixState) -> ReplayConfig {
    let profile = Profile::named("h100-llama3-8b").expect("profile");
    ReplayConfig { seed: 7, max_waiting: 64, prefix_state, ..ReplayConfig::new(policy, engines, profile) }
}

fn run(trace: &[TraceRequest], c: &ReplayConfig) -> ReplayResult {
    replay(trace, c, &mut |_| {}).expect("replay")
}

/// A synthetic multi-tenant trace: 300 requests from 12 shared prefixes of 2–9 blocks,
/// each with a private suffix, arriving every 40 ms.
fn synthetic() -> Vec<TraceRequest> {
    (0..300u64)
        .map(|i| {
            let tenant = (i * 7) % 12;
            let shared = 2 + tenant % 8;
            let mut b: Vec<u64> = (0..shared).map(|k| 1000 * (tenant + 1) + k).collect();
            b.push(1_000_000 + i);
            req(i * 40, &b)
        })
        .collect()
}

#[test]
fn the_same_seed_gives_the_same_outcomes_for_every_policy_and_prefix_state() {
    let trace = synthetic();
    let states = [PrefixState::Approximate, PrefixState::Precise { predict_window: Nanos::from_secs(2) }];
    for name in kvroute_core::registry::names() {
        for state in states {
            let c = cfg(name, 4, state);
            let a = serde_json::to_string(&run(&trace, &c).outcomes).expect("json");
            let b = serde_json::to_string(&run(&trace, &c).outcomes).expect("json");
            assert_eq!(a, b, "{name} {}", state.as_str());
        }
    }
}

#[test]
fn a_kv_oracle_gives_each_request_what_the_fleet_holds_wherever_it_is_sent() {
    // round_robin spreads each tenant's requests over the 5 engines (12 tenants in turn, so
    // each tenant meets every engine): alone, an engine finds a tenant's shared prefix only
    // when it ran that tenant before.
    let trace = synthetic();
    let cached = |engines: usize, kv_oracle: KvOracle| -> u64 {
        let c = ReplayConfig { kv_oracle, ..cfg("round_robin", engines, PrefixState::Approximate) };
        run(&trace, &c).outcomes.iter().map(|o| u64::from(o.cached_tokens)).sum()
    };
    let (off, fleet, store) = (cached(5, KvOracle::Off), cached(5, KvOracle::Fleet), cached(5, KvOracle::Store));
    assert!(fleet > off, "cached tokens: {fleet} with the fleet oracle, {off} without");
    // Every request after its tenant's first (≥ 480 ms later, its prefill long done) finds
    // the whole shared prefix; the private last block never.
    let mut seen = std::collections::HashSet::new();
    let expected: u64 = (0..300u64).map(|i| (i * 7) % 12).filter(|t| !seen.insert(*t)).map(|t| (2 + t % 8) * 512).sum();
    assert_eq!(store, expected, "cached tokens with the store oracle");
    assert_eq!(fleet, expected, "nothing is evicted here, so the fleet holds what the store does");
    // One engine already holds everything the fleet holds.
    assert_eq!(cached(1, KvOracle::Fleet), cached(1, KvOracle::Off));
}

#[test]
fn precise_views_carry_the_engines_real_cache_and_predictions_cover_bursts() {
    // A 20-block prompt, then 1 ms later (long before its prefill ends) a sibling sharing
    // those 20 blocks. cache_aware (match rate > 0.5 → holder) shows the difference.
    let first: Vec<u64> = (0..20).collect();
    let mut second = first.clone();
    second.push(99);
    let trace = vec![req(0, &first), req(1, &second)];
    let worker = |state| -> (Option<u32>, Option<u32>) {
        let r = run(&trace, &cfg("cache_aware", 2, state));
        (r.outcomes[0].worker, r.outcomes[1].worker)
    };
    // Approximate: the policy's own tree remembers where the first went.
    let (a, b) = worker(PrefixState::Approximate);
    assert_eq!(a, b);
    // Precise with the window: the prediction stands in for the BlockStored still to come.
    let (a, b) = worker(PrefixState::Precise { predict_window: Nanos::from_secs(2) });
    assert_eq!(a, b);
    // Precise without it: the engine has stored nothing yet, so nothing is cached anywhere
    // and the sibling goes to the emptier worker.
    let (a, b) = worker(PrefixState::Precise { predict_window: Nanos(0) });
    assert_ne!(a, b);

    // Once the first prefill is over, the engine's own cache is what counts: the sibling 30 s
    // later finds it (engine-reported cached tokens), window or not.
    let trace = vec![req(0, &first), req(30_000, &second)];
    let r = run(&trace, &cfg("cache_aware", 2, PrefixState::Precise { predict_window: Nanos(0) }));
    assert_eq!(r.outcomes[0].worker, r.outcomes[1].worker);
    assert_eq!(r.outcomes[1].cached_tokens, 20 * 512);
}

/// Disaggregated replay: long prompts are split (prefill engine, KV transfer, decode
/// engine), short ones run colocated on a decode engine, and the outcomes say so.
#[test]
fn pd_replay_splits_long_prompts_and_charges_the_transfer() {
    use kvroute_sim::pd::{PdConfig, TransferModel, replay_pd};
    // 40 requests: even ones 6 blocks (3072 tokens, split), odd ones 2 blocks (colocated).
    let trace: Vec<TraceRequest> = (0..40u64)
        .map(|i| {
            let n = if i % 2 == 0 { 6 } else { 2 };
            let b: Vec<u64> = (0..n).map(|k| 100 * (i % 4) + k).collect();
            req(i * 50, &b)
        })
        .collect();
    let mut pd = PdConfig::new(1, 2);
    pd.transfer = TransferModel { kv_bytes_per_token: 131_072, link_gbytes_per_s: 25.0, latency_secs: 0.01 };
    let c = cfg("prefill_cost", 3, PrefixState::Approximate);
    let r = replay_pd(&trace, &c, &pd, &mut |_| {}).expect("pd replay");
    assert_eq!(r.pd.as_ref(), Some(&pd));
    let delay = pd.transfer.delay(3072);
    for (i, o) in r.outcomes.iter().enumerate() {
        assert!(!o.rejected, "request {i} rejected");
        let (ft, fin) = (o.first_token.expect("first token"), o.finished.expect("finished"));
        assert!(fin >= ft && ft > o.arrival);
        if i % 2 == 0 {
            assert_eq!(o.prefill_worker, Some(0), "request {i}: split onto the prefill engine");
            assert!(matches!(o.worker, Some(1 | 2)), "request {i}: decoded on a decode engine");
            assert_eq!(o.transfer_bytes, 3072 * 131_072);
            // The decode engine's first token comes after the prefill and the transfer.
            assert!(ft.0 - o.arrival.0 > delay.0, "request {i}: TTFT includes the transfer");
        } else {
            assert_eq!(o.prefill_worker, None, "request {i}: colocated");
            assert!(matches!(o.worker, Some(1 | 2)));
            assert_eq!(o.transfer_bytes, 0);
        }
    }
    // Repeated prefixes hit the prefill engine's cache (requests 0/4/8/... share blocks).
    assert!(r.outcomes.iter().step_by(2).skip(4).any(|o| o.cached_tokens > 0));
    let rep = kvroute_sim::report::summarise(&r, 1.0, (0, 1), kvroute_sim::report::Slo { ttft_s: 2.0, tpot_s: 0.1 });
    let s = rep.pd.expect("pd summary");
    assert_eq!((s.split_requests, s.colocated_requests), (20, 20));
    assert_eq!(s.transfer_bytes, 20 * 3072 * 131_072);
    assert!(s.split_hit_ratio > 0.0 && s.prefill_busy > 0.0 && s.decode_busy > 0.0);
    // Same seed, same outcomes.
    let again = replay_pd(&trace, &c, &pd, &mut |_| {}).expect("pd replay");
    assert_eq!(serde_json::to_string(&r.outcomes).ok(), serde_json::to_string(&again.outcomes).ok());
    // P + D must match the engine count.
    assert!(replay_pd(&trace, &cfg("prefill_cost", 4, PrefixState::Approximate), &pd, &mut |_| {}).is_err());
}

/// Two documents (4 blocks of 16 tokens each) on one llama.cpp engine with 2 slots and no
/// host cache (`cpu-smollm2-135m`): each document's conversations arrive in overlapping
/// pairs (the second while the first still decodes), alternating A, B, A, B…
fn two_documents(slot_routing: bool) -> u64 {
    let mut trace = Vec::new();
    for k in 0..12u64 {
        let doc = if k % 2 == 0 { 1 } else { 100 };
        for j in 0..2u64 {
            let blocks: Vec<BlockHash> = (doc..doc + 4).chain([1_000 + 10 * k + j]).map(BlockHash).collect();
            trace.push(TraceRequest {
                tenant: None,
                arrival: Nanos::from_millis(20_000 * k + 100 * j),
                input_tokens: 80,
                output_tokens: 64,
                blocks,
                block_tokens: 16,
                session: None,
                turn: 0,
            });
        }
    }
    let c = ReplayConfig {
        profile: Profile::named("cpu-smollm2-135m").expect("profile"),
        slot_routing,
        ..cfg("least_ttft", 1, PrefixState::Approximate)
    };
    run(&trace, &c).outcomes.iter().map(|o| u64::from(o.cached_tokens)).sum()
}

#[test]
fn slot_routing_keeps_each_document_in_its_slot() {
    // Unpinned, the second request of each pair takes the other slot and overwrites the
    // other document there; pinned, it waits for its document's slot.
    let (without, with) = (two_documents(false), two_documents(true));
    assert!(with > without, "cached tokens: {with} with slot routing, {without} without");
    // With slot routing every request but the first of each document finds it (4 blocks).
    assert_eq!(with, 22 * 64, "cached tokens with slot routing");
}

#[test]
fn closed_sessions_send_a_turn_after_the_previous_one_ends() {
    // A conversation's second turn (8,704 tokens) is recorded 1 ms after its first (8,192):
    // too early for the first to have answered. Open loop it arrives then; closed loop when
    // the first has finished, and its TTFT counts from there. A session-less request keeps
    // its time.
    let doc: Vec<u64> = (1..=16).collect();
    let mut first = req(0, &doc);
    first.session = Some("conv".into());
    let mut second = req(1, &[doc.as_slice(), &[17]].concat());
    second.session = Some("conv".into());
    second.turn = 1;
    let other = req(20, &[9]);
    let trace = vec![first, second, other];
    let open = run(&trace, &cfg("least_ttft", 1, PrefixState::Approximate));
    let closed = run(&trace, &ReplayConfig { closed_sessions: true, ..cfg("least_ttft", 1, PrefixState::Approximate) });
    assert_eq!(open.outcomes[1].arrival, Nanos::from_millis(1));
    let done = closed.outcomes[0].finished.expect("the first turn finished");
    assert!(done > Nanos::from_millis(1), "the first turn ends after 1 ms: {done:?}");
    assert_eq!(closed.outcomes[1].arrival, done);
    assert_eq!(closed.outcomes[1].cached_tokens, 16 * 512);
    let ttft = |r: &ReplayResult| r.outcomes[1].first_token.expect("first token").saturating_sub(r.outcomes[1].arrival);
    assert!(ttft(&closed) < ttft(&open), "closed {:?} against open {:?}", ttft(&closed), ttft(&open));
    assert_eq!(closed.outcomes[2].arrival, Nanos::from_millis(20));
    assert!(closed.outcomes.iter().all(|o| o.finished.is_some()));
}

#[test]
fn session_concurrency_starts_a_queued_session_when_one_ends() {
    // Three one-request sessions at 0, 1 and 2 ms, two at a time: the third starts when the
    // first of the other two ends, not at its trace time; without the limit it keeps it.
    let trace: Vec<TraceRequest> = (0..3u64)
        .map(|i| {
            let mut r = req(i, &[10 * i + 1, 10 * i + 2]);
            r.session = Some(format!("s{i}"));
            r
        })
        .collect();
    let free = run(&trace, &cfg("round_robin", 2, PrefixState::Approximate));
    assert_eq!(free.outcomes[2].arrival, Nanos::from_millis(2));
    let two = run(&trace, &ReplayConfig { session_concurrency: 2, ..cfg("round_robin", 2, PrefixState::Approximate) });
    let first_end = two.outcomes[..2].iter().map(|o| o.finished.expect("finished")).min().expect("two requests");
    assert!(first_end > Nanos::from_millis(2), "a request takes longer than 2 ms: {first_end:?}");
    assert_eq!(two.outcomes[2].arrival, first_end);
    assert!(two.outcomes.iter().all(|o| o.finished.is_some() && !o.rejected));
}

/// Four identical one-block requests at time 0, one per engine (round robin), on engines
/// sharing `host_cores` cores.
fn four_at_once(host_cores: u32) -> ReplayResult {
    four_at_once_slowed(host_cores, &[])
}

/// As [`four_at_once`], with a measured slow-down per number of busy engines.
fn four_at_once_slowed(host_cores: u32, host_slowdown: &[f64]) -> ReplayResult {
    let trace: Vec<TraceRequest> = (0..4u64).map(|i| req(0, &[100 + i])).collect();
    run(
        &trace,
        &ReplayConfig {
            host_cores,
            host_slowdown: host_slowdown.to_vec(),
            ..cfg("round_robin", 4, PrefixState::Approximate)
        },
    )
}

#[test]
fn a_measured_slow_down_replaces_processor_sharing() {
    let ttft = |r: &ReplayResult, i: usize| r.outcomes[i].first_token.expect("first token").0;
    let end = |r: &ReplayResult, i: usize| r.outcomes[i].finished.expect("finished").0;
    let alone = four_at_once(0);
    // The measured list says what two cores' sharing says: the same times.
    let (shared, listed) = (four_at_once(2), four_at_once_slowed(0, &[1.0, 1.0, 1.5, 2.0]));
    for i in 0..4 {
        assert_eq!((ttft(&listed, i), end(&listed, i)), (ttft(&shared, i), end(&shared, i)), "request {i}");
    }
    // Past the list's end its last value grows with the busy engines: 1.1 × 4 / 2 = 2.2 at
    // four busy engines, whatever `host_cores` says.
    let past = four_at_once_slowed(4, &[1.0, 1.1]);
    for i in 0..4 {
        let want = (2.2 * ttft(&alone, i) as f64) as u64;
        assert!(ttft(&past, i).abs_diff(want) <= 2, "TTFT {} against {want}", ttft(&past, i));
    }
    // A slow-down below 1 is no speed-up.
    let below = four_at_once_slowed(0, &[0.5, 0.9, 0.5, 0.99]);
    for i in 0..4 {
        assert_eq!(ttft(&below, i), ttft(&alone, i), "request {i}");
    }
}

#[test]
fn a_slow_down_that_is_not_positive_is_an_error() {
    let trace = vec![req(0, &[1])];
    // 1e300 overflowed the simulated clock (printed as a better result).
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300, 1000.5] {
        let c = ReplayConfig { host_slowdown: vec![1.0, bad], ..cfg("round_robin", 2, PrefixState::Approximate) };
        let err = replay(&trace, &c, &mut |_| {}).expect_err("not a slow-down");
        assert!(err.to_string().contains("host_slowdown"), "{err}");
    }
}

#[test]
fn engines_sharing_cores_slow_down_when_more_are_busy_than_cores() {
    let alone = four_at_once(0);
    let ttft = |r: &ReplayResult, i: usize| r.outcomes[i].first_token.expect("first token").0;
    let end = |r: &ReplayResult, i: usize| r.outcomes[i].finished.expect("finished").0;
    // Four cores for four busy engines: nothing changes.
    let four = four_at_once(4);
    for i in 0..4 {
        assert_eq!((ttft(&four, i), end(&four, i)), (ttft(&alone, i), end(&alone, i)), "request {i}");
    }
    // Two cores for four busy engines: each runs at half speed, start to end (the four stay
    // busy together), to the nanosecond but for rounding.
    let two = four_at_once(2);
    for i in 0..4 {
        assert!(ttft(&two, i).abs_diff(2 * ttft(&alone, i)) <= 2, "TTFT {} against {}", ttft(&two, i), ttft(&alone, i));
        assert!(end(&two, i).abs_diff(2 * end(&alone, i)) <= 4, "end {} against {}", end(&two, i), end(&alone, i));
    }
}

#[test]
fn an_engine_busy_alone_on_shared_cores_runs_at_full_speed_and_slows_when_others_join() {
    // One request at 0; three more join later, while it still decodes.
    let mut trace = vec![req(0, &[1])];
    let alone = run(&trace, &cfg("round_robin", 4, PrefixState::Approximate));
    let shared = ReplayConfig { host_cores: 2, ..cfg("round_robin", 4, PrefixState::Approximate) };
    let one = run(&trace, &shared);
    assert_eq!(one.outcomes[0].first_token, alone.outcomes[0].first_token);
    assert_eq!(one.outcomes[0].finished, alone.outcomes[0].finished);
    let first = alone.outcomes[0].first_token.expect("first token").0;
    let at = Nanos(first + 1_000);
    trace.extend((0..3u64).map(|i| TraceRequest { arrival: at, ..req(0, &[10 + i]) }));
    let busy = run(&trace, &shared);
    assert_eq!(busy.outcomes[0].first_token, alone.outcomes[0].first_token, "its prefill ran alone");
    let (slow, fast) = (busy.outcomes[0].finished.expect("finished"), alone.outcomes[0].finished.expect("finished"));
    assert!(slow > fast, "its decode shared two cores with three other engines: {slow:?} against {fast:?}");
}

#[test]
fn a_load_generators_client_sends_the_next_turn_when_the_answer_is_in() {
    // A turn recorded 10 s after the first: closed sessions keep that gap (a person's think
    // time); a load generator's client (`session_concurrency`) sends it at the first's end.
    let mut first = req(0, &[1, 2]);
    first.session = Some("conv".into());
    let mut second = req(10_000, &[1, 2, 3]);
    second.session = Some("conv".into());
    second.turn = 1;
    let trace = vec![first, second];
    let person = run(&trace, &ReplayConfig { closed_sessions: true, ..cfg("least_ttft", 1, PrefixState::Approximate) });
    assert_eq!(person.outcomes[1].arrival, Nanos::from_millis(10_000));
    let client =
        run(&trace, &ReplayConfig { session_concurrency: 1, ..cfg("least_ttft", 1, PrefixState::Approximate) });
    assert_eq!(Some(client.outcomes[1].arrival), client.outcomes[0].finished);
}

/// One hot 1,536-token document shared by three requests in four, five cold ones taking
/// the fourth, each request the document and its own 32-token question, one every 4 s.
fn hot_document() -> Vec<TraceRequest> {
    (0..48u64)
        .map(|k| {
            let doc = if k % 4 == 3 { 1 + (k / 4) % 5 } else { 0 };
            let blocks: Vec<BlockHash> = (0..96)
                .map(|b| 10_000 * (doc + 1) + b)
                .chain([1_000_000 + 2 * k, 1_000_001 + 2 * k])
                .map(BlockHash)
                .collect();
            TraceRequest {
                tenant: None,
                arrival: Nanos::from_millis(4_000 * k),
                input_tokens: 98 * 16,
                output_tokens: 8,
                blocks,
                block_tokens: 16,
                session: None,
                turn: 0,
            }
        })
        .collect()
}

fn mean_ttft(r: &ReplayResult) -> f64 {
    let t: Vec<f64> =
        r.outcomes.iter().filter_map(|o| Some(o.first_token?.saturating_sub(o.arrival).as_secs_f64())).collect();
    t.iter().sum::<f64>() / t.len().max(1) as f64
}

#[test]
fn kv_migration_restores_a_hot_document_into_idle_slots_and_lowers_the_mean_ttft() {
    let trace = hot_document();
    let slots = ReplayConfig {
        profile: Profile::named("cpu-smollm2-135m").expect("profile"),
        slot_routing: true,
        ..cfg("least_ttft", 2, PrefixState::Approximate)
    };
    let kv = ReplayConfig { kv_migration: Some(KvMigration::default()), ..slots.clone() };
    let (without, with) = (run(&trace, &slots), run(&trace, &kv));
    assert!(without.kv_migration.is_none());
    let k = with.kv_migration.expect("the mover's counts");
    assert!(k.kv_saves > 0 && k.kv_restores > 0, "{k:?}");
    assert_eq!(k.kv_saved_bytes, k.kv_saved_tokens * 23_040, "{k:?}");
    // Every restore read a saved document and its answer (1,568 prompt tokens + 7 generated).
    assert_eq!(k.kv_restored_tokens, k.kv_restores * 1_575, "{k:?}");
    assert!(with.outcomes.iter().all(|o| o.finished.is_some()), "every request finished");
    let (a, b) = (mean_ttft(&without), mean_ttft(&with));
    assert!(b < a, "mean TTFT {b:.2} s with the mover, {a:.2} s without; {k:?}");
    // Cached tokens up: the restored prefixes count as hits.
    let hits = |r: &ReplayResult| r.outcomes.iter().map(|o| u64::from(o.cached_tokens)).sum::<u64>();
    assert!(hits(&with) > hits(&without));
}

#[test]
fn kv_migration_without_slot_routing_is_a_config_error() {
    let c = ReplayConfig {
        profile: Profile::named("cpu-smollm2-135m").expect("profile"),
        kv_migration: Some(KvMigration::default()),
        ..cfg("least_ttft", 2, PrefixState::Approximate)
    };
    let e = replay(&hot_document(), &c, &mut |_| {}).expect_err("refused").to_string();
    assert!(e.contains("kv_migration") && e.contains("slot routing"), "{e}");
}

/// Two requests on the same 8-block prefix, 5 s apart (the second with one block more),
/// round robin over 2 engines: the second goes to the engine that does not hold it.
fn a_prefix_twice() -> Vec<TraceRequest> {
    let prefix: Vec<u64> = (1..=8).collect();
    let longer: Vec<u64> = (1..=9).collect();
    vec![req(0, &prefix), req(5_000, &longer)]
}

fn precise(policy: &str) -> ReplayConfig {
    cfg(policy, 2, PrefixState::Precise { predict_window: Nanos::from_secs(2) })
}

#[test]
fn a_kv_pull_copies_the_held_prefix_to_the_engine_the_request_goes_to_and_costs_the_transfer() {
    let trace = a_prefix_twice();
    let plain = precise("round_robin");
    let pull = KvPull::default();
    let with = ReplayConfig { kv_pull: Some(pull), ..plain.clone() };
    let (a, b) = (run(&trace, &plain), run(&trace, &with));
    for r in [&a, &b] {
        assert_ne!(r.outcomes[0].worker, r.outcomes[1].worker, "round robin spreads the two");
    }
    assert!(a.kv_pull.is_none());
    assert_eq!(a.outcomes[1].cached_tokens, 0, "without the pull the other engine computes it all");
    // The 8 held blocks (4,096 tokens) arrive by the pull: 2 ms + 4,096 × 128 KiB at 50 GB/s.
    assert_eq!(b.outcomes[1].cached_tokens, 4096);
    let k = b.kv_pull.expect("the pulls' counts");
    assert_eq!((k.kv_pulls, k.kv_pulled_tokens), (1, 4096), "{k:?}");
    let secs = 0.002 + 4096.0 * 131_072.0 / 50e9;
    assert!((k.kv_pull_secs - secs).abs() < 1e-8, "{k:?}");
    let ttft = |r: &ReplayResult| {
        let o = &r.outcomes[1];
        o.first_token.expect("first token").saturating_sub(o.arrival).as_secs_f64()
    };
    // Against a free copy (the fleet oracle), the request is later by the transfer exactly.
    let free = run(&trace, &ReplayConfig { kv_oracle: KvOracle::Fleet, ..plain.clone() });
    assert_eq!(free.outcomes[1].cached_tokens, 4096);
    assert!((ttft(&b) - ttft(&free) - secs).abs() < 1e-6, "{} s against {} s free", ttft(&b), ttft(&free));
    assert!(ttft(&b) < ttft(&a), "{} s with the pull, {} s recomputing", ttft(&b), ttft(&a));
    assert!(b.outcomes.iter().all(|o| o.finished.is_some()));
    // What a view credits an engine with: the gain net of the transfer, in prefill tokens.
    let credit = pull.credit(&plain.profile, 0, 4096);
    assert!(credit > 3000 && credit < 4096, "{credit}");
    assert_eq!(pull.credit(&plain.profile, 0, 255), 0, "below min_tokens");
    // A network too slow to beat the prefill: nothing is pulled.
    let transfer = TransferModel { link_gbytes_per_s: 0.001, ..pull.transfer };
    let slow = ReplayConfig { kv_pull: Some(KvPull { transfer, ..pull }), ..plain.clone() };
    let s = run(&trace, &slow);
    assert_eq!(s.kv_pull.expect("counts").kv_pulls, 0);
    assert_eq!(s.outcomes[1].cached_tokens, 0);
}

#[test]
fn a_kv_pull_needs_the_precise_prefix_state_and_a_paged_cache() {
    let trace = a_prefix_twice();
    let approximate =
        ReplayConfig { kv_pull: Some(KvPull::default()), ..cfg("least_ttft", 2, PrefixState::Approximate) };
    let slots = ReplayConfig {
        profile: Profile::named("cpu-smollm2-135m").expect("profile"),
        kv_pull: Some(KvPull::default()),
        ..precise("least_ttft")
    };
    for (c, what) in [(approximate, "precise"), (slots, "paged")] {
        let e = replay(&trace, &c, &mut |_| {}).expect_err("refused").to_string();
        assert!(e.contains("kv_pull") && e.contains(what), "{e}");
    }
}
