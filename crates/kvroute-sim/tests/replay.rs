//! Replay: determinism across runs, and the precise prefix state (engine cache contents
//! plus the predict-on-route window) against the approximate one.

use kvroute_core::types::{BlockHash, Nanos};
use kvroute_sim::engine::Profile;
use kvroute_sim::replay::{PrefixState, ReplayConfig, ReplayResult, replay};
use kvroute_sim::trace::TraceRequest;

fn req(at_ms: u64, blocks: &[u64]) -> TraceRequest {
    TraceRequest {
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
    ReplayConfig {
        engines,
        profile: Profile::named("h100-llama3-8b").expect("profile"),
        policy: policy.into(),
        knobs: serde_json::Value::Null,
        seed: 7,
        max_waiting: 64,
        engine_signals: true,
        prefix_state,
    }
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
