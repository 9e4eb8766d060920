//! Property tests of the routing core's invariants.

use kvroute_core::block_index::{BlockIndex, BlockIndexConfig};
use kvroute_core::ledger::LoadLedger;
use kvroute_core::policy::{PickCtx, fallbacks, route};
use kvroute_core::radix::RadixTree;
use kvroute_core::registry::{build, names};
use kvroute_core::types::{BlockHash, Health, Nanos, RequestView, WorkerId, WorkerView};
use proptest::prelude::*;
use rand_core::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;

/// Short keys over a small alphabet so that prefixes are shared often.
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..4, 0..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn fallbacks_are_the_head_of_the_fleet_sorted_by_load_and_round_robin_picks_the_kth_routable(
        fleet in prop::collection::vec((0u32..20, 0u8..4), 0..300),
        exclude in 0u32..300,
        turns in 1usize..5,
    ) {
        let views: Vec<WorkerView> = fleet
            .iter()
            .enumerate()
            .map(|(i, &(load, h))| {
                let mut w = WorkerView::idle(WorkerId(i as u32));
                w.in_flight = load;
                w.health = if h == 0 { Health::Unhealthy } else { Health::Healthy };
                w
            })
            .collect();
        // The full sort the fast path replaces.
        let mut all: Vec<(u32, WorkerId)> =
            views.iter().filter(|w| w.is_routable() && w.id != WorkerId(exclude)).map(|w| (w.load(), w.id)).collect();
        all.sort_unstable();
        let want: Vec<WorkerId> = all.into_iter().take(kvroute_core::policy::MAX_FALLBACKS).map(|(_, id)| id).collect();
        let got = kvroute_core::policy::fallbacks_by_load(&views, WorkerId(exclude));
        prop_assert_eq!(got.to_vec(), want);
        // Round robin visits the routable workers in order, as indexing the collected list did.
        let routable: Vec<WorkerId> = views.iter().filter(|w| w.is_routable()).map(|w| w.id).collect();
        let mut p = build("round_robin", &serde_json::Value::Null).expect("build");
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        for t in 0..turns * routable.len().max(1) {
            let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None };
            match route(p.as_mut(), &RequestView::from_text("m", "x"), &views, &mut ctx) {
                Ok(d) => prop_assert_eq!(d.worker, routable[t % routable.len()]),
                Err(_) => prop_assert!(routable.is_empty()),
            }
        }
    }

    #[test]
    fn match_never_exceeds_input_and_insert_is_found(
        inserts in prop::collection::vec((key(), 0u32..6), 1..30),
        probe in key(),
    ) {
        let mut t: RadixTree<u8> = RadixTree::new();
        for (i, (k, w)) in inserts.iter().enumerate() {
            t.insert(k, WorkerId(*w), Nanos(i as u64));
            let m = t.prefix_match(k, None);
            prop_assert_eq!(m.matched, k.len());
            if !k.is_empty() {
                prop_assert!(m.tenants.contains(&WorkerId(*w)));
            }
        }
        let m = t.prefix_match(&probe, None);
        prop_assert!(m.matched <= probe.len());
        prop_assert_eq!(m.tenants.is_empty(), m.matched == 0);
        // `holds` (a binary search, as policies ask it per candidate) answers as a linear
        // search of the holders would.
        for w in 0..6 {
            prop_assert_eq!(m.holds(WorkerId(w)), m.tenants.contains(&WorkerId(w)));
        }
        prop_assert!(t.check_invariants().is_ok(), "{:?}", t.check_invariants());
    }

    #[test]
    fn the_block_index_answers_as_a_set_of_blocks_per_worker(
        // (worker, first block, blocks, remove?): chains over a small alphabet, so that
        // many workers hold the same leading blocks and insertion orders vary.
        ops in prop::collection::vec((0u32..40, 0u64..3, 1usize..5, any::<bool>()), 1..80),
        probe in prop::collection::vec(0u64..3, 1..6),
    ) {
        let mut ix = BlockIndex::new(BlockIndexConfig { ttl_secs: 1e9, max_entries: 1 << 20 });
        let mut model: std::collections::HashMap<u32, std::collections::HashSet<u64>> = Default::default();
        for (w, first, n, remove) in &ops {
            let chain: Vec<BlockHash> = (0..*n as u64).map(|i| BlockHash(first * 10 + i)).collect();
            if *remove {
                ix.remove(WorkerId(*w), &chain);
                chain.iter().for_each(|h| { model.entry(*w).or_default().remove(&h.0); });
            } else {
                ix.store(WorkerId(*w), &chain, Nanos(0));
                model.entry(*w).or_default().extend(chain.iter().map(|h| h.0));
            }
        }
        let probe: Vec<BlockHash> = probe.iter().enumerate().map(|(i, b)| BlockHash(b * 10 + i as u64)).collect();
        let held = |w: u32| probe.iter().take_while(|h| model.get(&w).is_some_and(|s| s.contains(&h.0))).count();
        let mut all = Vec::new();
        ix.overlaps(&probe, Nanos(0), &mut all);
        let expected: Vec<(WorkerId, usize)> =
            (0..40).filter(|w| held(*w) > 0).map(|w| (WorkerId(w), held(w))).collect();
        prop_assert_eq!(all, expected);
        for w in 0..40 {
            prop_assert_eq!(ix.overlap(WorkerId(w), &probe, Nanos(0)), held(w));
        }
        prop_assert_eq!(ix.entries(), model.values().map(|s| s.len()).sum::<usize>());
    }

    #[test]
    fn cached_tokens_of_many_workers_at_once_equals_one_by_one(
        // (worker, first token, blocks, tier: 0 GPU, 1 CPU, 2 removed from the GPU, 3 predicted)
        ops in prop::collection::vec((0u32..12, 0u32..3, 1usize..5, 0u8..4), 1..60),
        probe_first in 0u32..3,
        probe_len in 1usize..6,
        lower_weight in 0.0f64..1.0,
    ) {
        use kvroute_core::hash::{HashAlgo, hash_token_blocks};
        use kvroute_core::precise::{PreciseConfig, PreciseIndex, StoredBlocks, Tier};
        let bs = 2usize;
        // A prompt's tokens: its first token picks one of three prefixes, then 0, 1, 2, ...
        let tokens = |first: u32, blocks: usize| -> Vec<u32> {
            (0..blocks * bs).map(|i| if i == 0 { first } else { 100 + i as u32 }).collect()
        };
        let engine = |first: u32, k: usize| u64::from(first) * 1000 + k as u64 + 1;
        let mut ix = PreciseIndex::new(PreciseConfig { lower_tier_weight: lower_weight, ..PreciseConfig::default() });
        // The gateway keeps two copies (a clone made empty) and applies every event to each,
        // in turn (the first one written alternates).
        let mut twin = ix.clone();
        for (i, (w, first, n, tier)) in ops.iter().enumerate() {
            let t = tokens(*first, *n);
            let eh: Vec<u64> = (0..*n).map(|k| engine(*first, k)).collect();
            let w = WorkerId(*w);
            let apply = |ix: &mut PreciseIndex| match tier {
                0 | 1 => {
                    let tier = if *tier == 0 { Tier::Gpu } else { Tier::Lower };
                    let ev = StoredBlocks { engine_hashes: &eh, parent: None, token_ids: &t, block_size: bs as u32, tier };
                    ix.stored(w, ev, Nanos(0));
                }
                2 => ix.removed(w, &eh, Tier::Gpu),
                _ => {
                    let mut own = Vec::new();
                    hash_token_blocks(&t, bs, usize::MAX, HashAlgo::Xxh3, &mut own);
                    ix.predict(w, &own, Nanos(0), Nanos(10));
                }
            };
            if i % 2 == 0 {
                apply(&mut ix);
                apply(&mut twin);
            } else {
                apply(&mut twin);
                apply(&mut ix);
            }
        }
        let mut probe = Vec::new();
        hash_token_blocks(&tokens(probe_first, probe_len), bs, usize::MAX, HashAlgo::Xxh3, &mut probe);
        // Workers 0..14: two never seen, some in no event; every one in a shuffled order.
        let ids: Vec<WorkerId> = (0..14u32).rev().map(WorkerId).collect();
        let mut many = Vec::new();
        ix.cached_tokens_many(&ids, &probe, bs as u32, Nanos(5), &mut many);
        let one: Vec<Option<u64>> = ids.iter().map(|w| ix.cached_tokens(*w, &probe, bs as u32, Nanos(5))).collect();
        prop_assert_eq!(&many, &one);
        let mut from_twin = Vec::new();
        twin.cached_tokens_many(&ids, &probe, bs as u32, Nanos(5), &mut from_twin);
        prop_assert_eq!(&many, &from_twin, "the two copies answer alike");
        prop_assert_eq!(ix.stats(), twin.stats());
    }

    #[test]
    fn eviction_respects_budget_and_leaves_no_empty_leaves(
        inserts in prop::collection::vec((key(), 0u32..6), 1..40),
        budget in 0usize..120,
        removed in 0u32..6,
    ) {
        let mut t: RadixTree<u8> = RadixTree::new();
        for (i, (k, w)) in inserts.iter().enumerate() {
            t.insert(k, WorkerId(*w), Nanos(i as u64));
        }
        t.evict_to(budget);
        prop_assert!(t.total_size() <= budget, "size {} > budget {}", t.total_size(), budget);
        prop_assert!(t.check_invariants().is_ok(), "{:?}", t.check_invariants());
        t.remove_tenant(WorkerId(removed));
        prop_assert_eq!(t.tenant_size(WorkerId(removed)), 0);
        prop_assert!(t.check_invariants().is_ok(), "{:?}", t.check_invariants());
    }

    #[test]
    fn ledger_returns_to_zero(ops in prop::collection::vec((0u32..4, 0u64..5000, 0u8..3, any::<bool>()), 0..60)) {
        let mut l = LoadLedger::new();
        let mut tickets = Vec::new();
        for (w, tokens, end, first) in &ops {
            let mut t = l.dispatched(WorkerId(*w), *tokens, *tokens / 2);
            if *first {
                l.first_token(&mut t);
            }
            tickets.push((t, *end));
        }
        prop_assert_eq!(l.is_idle(), ops.is_empty());
        for (t, end) in tickets {
            match end {
                0 => l.completed(t),
                1 => l.cancelled(t),
                _ => l.failed(t),
            }
        }
        prop_assert!(l.is_idle());
        for w in 0..4 {
            let v = l.get(WorkerId(w));
            prop_assert_eq!((v.in_flight, v.waiting, v.pending_prefill_tokens, v.decode_tokens), (0, 0, 0, 0));
        }
    }

    #[test]
    fn unhealthy_workers_are_never_chosen(
        policy in prop::sample::select(names()),
        health in prop::collection::vec(0u8..3, 1..10),
        loads in prop::collection::vec(0u32..50, 10),
        prompts in prop::collection::vec("[ab ]{0,64}", 1..12),
        seed in any::<u64>(),
    ) {
        let mut p = build(policy, &serde_json::Value::Null).expect("build");
        let fleet: Vec<WorkerView> = health.iter().enumerate().map(|(i, h)| {
            let mut w = WorkerView::idle(WorkerId(i as u32));
            w.health = [Health::Healthy, Health::Draining, Health::Unhealthy][*h as usize];
            w.in_flight = loads[i];
            w
        }).collect();
        let any_healthy = fleet.iter().any(WorkerView::is_routable);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        for (i, text) in prompts.iter().enumerate() {
            let mut req = RequestView::from_text("m", text);
            let sid = format!("s{}", i % 3);
            req.session_id = Some(&sid);
            let mut ctx = PickCtx { now: Nanos::from_millis(i as u64), rng: &mut rng, fleet: None };
            match route(p.as_mut(), &req, &fleet, &mut ctx) {
                Ok(d) => {
                    prop_assert!(any_healthy);
                    prop_assert_eq!(fleet[d.worker.index()].health, Health::Healthy);
                    for f in &fallbacks(&d, &fleet) {
                        prop_assert_eq!(fleet[f.index()].health, Health::Healthy);
                        prop_assert_ne!(*f, d.worker);
                    }
                    prop_assert!(d.matched <= d.key_len);
                }
                Err(_) => prop_assert!(!any_healthy),
            }
        }
    }

    #[test]
    fn same_seed_same_decisions(
        policy in prop::sample::select(names()),
        prompts in prop::collection::vec("[abc ]{0,48}", 1..20),
        loads in prop::collection::vec(0u32..20, 5),
        seed in any::<u64>(),
    ) {
        let run = || {
            let mut p = build(policy, &serde_json::Value::Null).expect("build");
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
            let mut out = Vec::new();
            for (i, text) in prompts.iter().enumerate() {
                let fleet: Vec<WorkerView> = loads.iter().enumerate().map(|(w, l)| {
                    let mut v = WorkerView::idle(WorkerId(w as u32));
                    v.in_flight = (*l + i as u32) % 23;
                    v
                }).collect();
                let mut ctx = PickCtx { now: Nanos::from_millis(i as u64 * 10), rng: &mut rng, fleet: None };
                let d = route(p.as_mut(), &RequestView::from_text("m", text), &fleet, &mut ctx).expect("route");
                out.push((d.worker, d.branch, d.matched));
            }
            out
        };
        prop_assert_eq!(run(), run());
    }
}

/// Small budgets (each knob a policy does not have is skipped), so commits and maintenance
/// evict often.
fn small_budgets(p: &mut dyn kvroute_core::policy::Policy) {
    for patch in [
        serde_json::json!({"max_tree_size": 96}),
        serde_json::json!({"eviction_threshold_chars": 96, "eviction_target_chars": 48}),
        serde_json::json!({"max_entries": 24}),
        serde_json::json!({"cache_blocks": 3}),
        serde_json::json!({"max_sessions": 2}),
    ] {
        let _ = p.set_knobs(&patch);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// The gateway keeps two copies of a policy (one read while a writer updates the other)
    /// and reads either: with every write made on both and the tie rotation shared, its
    /// decisions are the ones a single copy makes.
    #[test]
    fn two_copies_read_alternately_decide_as_one_copy(
        policy in prop::sample::select(names()),
        steps in prop::collection::vec(("[abc ]{0,48}", 0u32..6, 0u32..8, 0u8..4), 1..40),
        twin_at in 0usize..40,
        seed in any::<u64>(),
    ) {
        use kvroute_core::policy::{Observation, commit, decide};
        let fleet = |load: u32, i: usize| -> Vec<WorkerView> {
            (0..5u32).map(|w| {
                let mut v = WorkerView::idle(WorkerId(w));
                v.in_flight = (load + w * i as u32) % 7;
                v
            }).collect()
        };
        let mut one = build(policy, &serde_json::Value::Null).expect("build");
        small_budgets(one.as_mut());
        let mut two = [build(policy, &serde_json::Value::Null).expect("build"), build("random", &serde_json::Value::Null).expect("build")];
        small_budgets(two[0].as_mut());
        let mut twinned = false;
        let (mut rng1, mut rng2) = (Xoshiro256PlusPlus::seed_from_u64(seed), Xoshiro256PlusPlus::seed_from_u64(seed));
        for (i, (text, load, session, op)) in steps.iter().enumerate() {
            if i == twin_at.min(steps.len() - 1) {
                two[1] = two[0].twin();
                twinned = true;
            }
            let now = Nanos::from_millis(i as u64 * 700);
            let sid = format!("s{session}");
            let mut req = RequestView::from_text("m", text);
            req.session_id = Some(&sid);
            let views = fleet(*load, i);
            let read = if twinned { i % 2 } else { 0 };
            let mut ctx1 = PickCtx { now, rng: &mut rng1, fleet: None };
            let r1 = decide(one.as_ref(), &req, &views, &mut ctx1);
            let mut ctx2 = PickCtx { now, rng: &mut rng2, fleet: None };
            let r2 = decide(two[read].as_ref(), &req, &views, &mut ctx2);
            // A refusal (B3 capped: a session past its turns) must be the same refusal.
            let ((d1, k1), (d2, k2)) = match (r1, r2) {
                (Ok(a), Ok(b)) => (a, b),
                (r1, r2) => {
                    prop_assert_eq!(format!("{:?}", r1.err()), format!("{:?}", r2.err()), "step {}", i);
                    continue;
                }
            };
            prop_assert_eq!(&d1, &d2, "step {}", i);
            prop_assert_eq!(&k1, &k2);
            let copies = if twinned { 2 } else { 1 };
            let obs = Observation { input_tokens: text.len() as u32, ttft_secs: Some(0.01 * f64::from(*load + 1)), cached_tokens: Some(u64::from(*load)), ..Observation::default() };
            // The write each step makes: a commit, plus a maintenance slice or an observation.
            commit(one.as_mut(), &req, &k1, d1.worker, now);
            for p in two.iter_mut().take(copies) {
                commit(p.as_mut(), &req, &k2, d2.worker, now);
            }
            match op {
                0 => {
                    let more = one.maintain(now, 2);
                    for p in two.iter_mut().take(copies) {
                        prop_assert_eq!(p.maintain(now, 2), more);
                    }
                }
                1 => {
                    one.observe(d1.worker, &obs);
                    for p in two.iter_mut().take(copies) {
                        p.observe(d2.worker, &obs);
                    }
                }
                2 => {
                    one.on_worker_removed(WorkerId(*load % 5));
                    for p in two.iter_mut().take(copies) {
                        p.on_worker_removed(WorkerId(*load % 5));
                    }
                }
                _ => {}
            }
            prop_assert_eq!(one.index_size(), two[0].index_size());
            prop_assert_eq!(one.calibration(), two[read].calibration());
        }
    }
}

/// One change to a [`kvroute_core::lru_blocks::WorkerBlockSets`].
#[derive(Debug, Clone)]
enum SetOp {
    /// Insert these hashes on this worker, with this capacity, resizing or not.
    Insert(u32, Vec<u64>, usize, bool),
    /// Forget the worker.
    Remove(u32),
    /// Forget everything.
    Clear,
}

fn set_op() -> impl Strategy<Value = SetOp> {
    prop_oneof![
        12 => (0u32..12, prop::collection::vec(0u64..8, 1..8), 1usize..6, any::<bool>())
            .prop_map(|(w, h, cap, resize)| SetOp::Insert(w, h, cap, resize)),
        2 => (0u32..12).prop_map(SetOp::Remove),
        1 => Just(SetOp::Clear),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The fleet-wide answer from the reverse index is each worker's own LRU set's answer,
    /// through inserts that evict (capacities of 1–5 blocks, prompts up to 7), resizes,
    /// removals and clears, asked in any order, for workers with and without a set.
    #[test]
    fn the_fleet_wide_hits_are_each_worker_s_own_estimate(
        ops in prop::collection::vec(set_op(), 0..80),
        probe in prop::collection::vec(0u64..8, 0..8),
        asked in prop::collection::vec(0u32..14, 0..30),
    ) {
        use kvroute_core::lru_blocks::WorkerBlockSets;
        let mut sets = WorkerBlockSets::default();
        for op in &ops {
            match op {
                SetOp::Insert(w, h, cap, resize) => {
                    let h: Vec<BlockHash> = h.iter().map(|&x| BlockHash(x)).collect();
                    sets.insert(WorkerId(*w), &h, *cap, *resize);
                }
                SetOp::Remove(w) => sets.remove_worker(WorkerId(*w)),
                SetOp::Clear => sets.clear(),
            }
        }
        let probe: Vec<BlockHash> = probe.iter().map(|&x| BlockHash(x)).collect();
        // In increasing id order (the fast path), then in the order asked.
        let mut hits = sets.hits(&probe);
        let holding = (0..14).filter(|&w| sets.hit(WorkerId(w), &probe) > 0).count();
        prop_assert_eq!(hits.len(), holding);
        for w in 0..14 {
            prop_assert_eq!(hits.get(WorkerId(w)), sets.hit(WorkerId(w), &probe) as u64, "worker {}", w);
        }
        let mut hits = sets.hits(&probe);
        for &w in &asked {
            prop_assert_eq!(hits.get(WorkerId(w)), sets.hit(WorkerId(w), &probe) as u64, "worker {} asked out of order", w);
        }
        let total: u64 = (0..12).map(|w| sets.len_of(WorkerId(w)) as u64).sum();
        prop_assert_eq!(sets.total(), total);
        // The reverse index keeps no block nobody holds.
        let held = (0..8u64).filter(|&h| (0..12).any(|w| sets.hit(WorkerId(w), &[BlockHash(h)]) > 0)).count();
        prop_assert_eq!(sets.distinct_blocks(), held);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The prefix policies' match (SGLang router cache_aware, Ray Serve
    /// PrefixCacheAffinityRouter) is the same whether the candidates come in id order (the
    /// tree's holders taken as they are, no second pass) or in another order (a pass over
    /// the candidates): the same rate, holders, least loaded holders and per-worker match,
    /// for fleets of approximate workers, some unroutable, some precise.
    #[test]
    fn the_prefix_match_without_a_second_pass_is_the_pass_s(
        inserts in prop::collection::vec((key(), 0u32..10), 0..40),
        probe in key(),
        fleet in prop::collection::vec((0u32..5, any::<bool>(), prop::option::of(0u64..50)), 1..10),
        precise in any::<bool>(),
        rotate_by in 1usize..9,
    ) {
        use kvroute_core::policy::util::{BestMatch, FleetScan, PrefixKey, PrefixTrees};
        prop_assume!(!probe.is_empty());
        let mut trees = PrefixTrees::default();
        for (i, (k, w)) in inserts.iter().enumerate() {
            if !k.is_empty() {
                trees.insert(PrefixKey::Tokens(&k.iter().map(|&b| u32::from(b)).collect::<Vec<_>>()), WorkerId(*w), Nanos(i as u64));
            }
        }
        let views: Vec<WorkerView> = fleet.iter().enumerate().map(|(i, &(load, down, cached))| {
            let mut w = WorkerView::idle(WorkerId(i as u32 * 2));
            w.in_flight = load;
            if down {
                w.health = Health::Unhealthy;
            }
            w.cached_tokens = cached.filter(|_| precise);
            w
        }).collect();
        // Ids 0, 2, 4, …: the inserts' odd ids and those past the fleet are not candidates.
        let tokens: Vec<u32> = probe.iter().map(|&b| u32::from(b)).collect();
        let mut req = RequestView::from_text("m", "x");
        req.text = None;
        req.token_ids = Some(&tokens);
        req.input_tokens = tokens.len() as u32;
        let key = PrefixKey::of(&req).expect("a key");
        let mut shuffled = views.clone();
        shuffled.rotate_left(rotate_by % views.len());
        shuffled.reverse();
        let sorted_ids = |v: &[WorkerId]| { let mut v = v.to_vec(); v.sort(); v };
        let a = BestMatch::with_scan(&trees, key, &req, &views, &FleetScan::of(&views, &req));
        let b = BestMatch::of(&trees, key, &req, &shuffled);
        prop_assert_eq!(a.rate, b.rate);
        prop_assert_eq!(sorted_ids(&a.holders), sorted_ids(&b.holders));
        // Every holder once, routable, in candidate order.
        prop_assert!(a.holders.windows(2).all(|p| p[0] < p[1]));
        prop_assert_eq!(sorted_ids(&a.least_loaded_holders(&views)), sorted_ids(&b.least_loaded_holders(&shuffled)));
        for w in &views {
            prop_assert_eq!(a.matched_on(w.id, key, &req, &views), b.matched_on(w.id, key, &req, &shuffled));
            prop_assert!(!a.holders.contains(&w.id) || w.is_routable());
        }
        let scan = FleetScan::of(&views, &req);
        let loads: Vec<u32> = views.iter().filter(|w| w.is_routable()).map(|w| w.load()).collect();
        prop_assert_eq!(scan.load_range, loads.iter().min().map(|&lo| (lo, *loads.iter().max().expect("one"))));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Power of Two Choices read by position draws and chooses as the lookup by id over the
    /// routable ids does, with the same random stream, whatever the fleet's health and order.
    #[test]
    fn power_of_two_by_position_is_power_of_two_by_id(
        fleet in prop::collection::vec((0u32..6, any::<bool>()), 0..20),
        seed in any::<u64>(),
    ) {
        use kvroute_core::policy::util::{power_of_two, power_of_two_routable, routable_ids};
        let views: Vec<WorkerView> = fleet.iter().enumerate().map(|(i, &(load, down))| {
            let mut w = WorkerView::idle(WorkerId((i as u32 * 7919) % 101));
            w.in_flight = load;
            if down {
                w.health = Health::Unhealthy;
            }
            w
        }).collect();
        let ids: std::collections::HashSet<_> = views.iter().map(|w| w.id).collect();
        prop_assume!(ids.len() == views.len());
        for round in 0..4u64 {
            let mut a = Xoshiro256PlusPlus::seed_from_u64(seed ^ round);
            let mut b = Xoshiro256PlusPlus::seed_from_u64(seed ^ round);
            prop_assert_eq!(power_of_two(&routable_ids(&views), &views, &mut a), power_of_two_routable(&views, &mut b));
        }
    }
}

/// An operation on a prefix tree set: insert a key for a worker, evict to a budget, or
/// remove a worker.
#[derive(Debug, Clone)]
enum TreeOp {
    Insert(Vec<u8>, u32, bool),
    Evict(usize, usize),
    Remove(u32),
}

fn tree_op() -> impl Strategy<Value = TreeOp> {
    prop_oneof![
        // Short keys, so that workers often hold the same number of symbols.
        6 => (prop_oneof![prop::collection::vec(0u8..2, 0..3), prop::collection::vec(0u8..3, 0..6)], 0u32..10, any::<bool>())
            .prop_map(|(k, w, text)| TreeOp::Insert(k, w, text)),
        1 => (0usize..60, 1usize..8).prop_map(|(b, m)| TreeOp::Evict(b, m)),
        1 => (0u32..10).prop_map(TreeOp::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// SGLang router cache_aware and Ray Serve PrefixCacheAffinityRouter send a request that
    /// matches little to the smallest tree. The trees keep their tenants ordered by size
    /// through inserts (text and token keys), evictions and removals, and the smallest
    /// routable candidates read from that order are the ones a pass over every candidate
    /// finds — in the same order, with the same least loaded among them — for fleets in id
    /// order and not, some unroutable, some precise: fleets of up to 8 workers, where every
    /// routable one often holds something, and of 80–120, where more hold nothing than the
    /// order is read for.
    #[test]
    fn the_smallest_trees_from_the_kept_order_are_the_pass_s(
        ops in prop::collection::vec(tree_op(), 0..60),
        fleet in prop_oneof![
            prop::collection::vec((0u32..4, 0u8..3, any::<bool>()), 1..8),
            prop::collection::vec((0u32..4, 0u8..8, any::<bool>()), 80..120),
        ],
        precise in any::<bool>(),
        shuffle in any::<bool>(),
    ) {
        use kvroute_core::policy::util::{FleetScan, PrefixKey, PrefixTrees, argmin_by, fewest_symbols, least_loaded_at};
        let mut trees = PrefixTrees::default();
        for (i, op) in ops.iter().enumerate() {
            match op {
                TreeOp::Insert(k, w, text) if !k.is_empty() => {
                    let tokens: Vec<u32> = k.iter().map(|&b| u32::from(b)).collect();
                    let key = if *text { PrefixKey::Text(k) } else { PrefixKey::Tokens(&tokens) };
                    trees.insert(key, WorkerId(*w), Nanos(i as u64));
                }
                TreeOp::Insert(..) => {}
                TreeOp::Evict(budget, pairs) => { trees.evict_to(*budget, *pairs); }
                TreeOp::Remove(w) => trees.remove_tenant(WorkerId(*w)),
            }
            prop_assert_eq!(trees.check_size_order(), Ok(()));
        }
        let mut views: Vec<WorkerView> = fleet.iter().enumerate().map(|(i, &(load, health, cached))| {
            let mut w = WorkerView::idle(WorkerId(i as u32));
            w.in_flight = load;
            if health == 0 {
                w.health = Health::Unhealthy;
            }
            w.cached_tokens = (precise && cached).then_some(7);
            w
        }).collect();
        if shuffle {
            views.reverse();
        }
        let req = RequestView::from_text("m", "x");
        let scan = FleetScan::of(&views, &req);
        let at = fewest_symbols(&trees, &views, &scan);
        let ids: Vec<WorkerId> = at.iter().map(|&i| views[i as usize].id).collect();
        let pass = argmin_by(&views, |_| true, |w| trees.tenant_size(w.id));
        prop_assert_eq!(&ids, &pass.to_vec());
        let pass = argmin_by(&views, |_| true, |w| (trees.tenant_size(w.id), w.load()));
        prop_assert_eq!(least_loaded_at(&views, &at).to_vec(), pass.to_vec());
    }
}

/// The policies that read a fleet digest ([`kvroute_core::policy::Policy::fleet_digest`]).
fn digest_readers() -> Vec<&'static str> {
    names()
        .iter()
        .copied()
        .filter(|n| build(n, &serde_json::Value::Null).is_ok_and(|p| p.fleet_digest().is_some()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every policy that reads a fleet digest (the replay and the benches keep one beside
    /// their views) decides with it as without it: two copies fed the same commits, one
    /// deciding with the digest, the other reading every view, over fleets whose loads
    /// (often imbalanced), queues and health change between requests, listed in id order
    /// or not.
    #[test]
    fn a_policy_decides_with_the_fleet_digest_as_without_it(
        policy in prop::sample::select(digest_readers()),
        prompts in prop::collection::vec("[abc ]{0,48}", 1..16),
        fleet in prop::collection::vec((0u32..80, 0u32..4, 0u64..4, 0u8..8), 1..12),
        reversed in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut with = build(policy, &serde_json::Value::Null).expect("build");
        let mut without = build(policy, &serde_json::Value::Null).expect("build");
        let mut digest = with.fleet_digest().expect("a digest reader");
        let (mut ra, mut rb) = (Xoshiro256PlusPlus::seed_from_u64(seed), Xoshiro256PlusPlus::seed_from_u64(seed));
        for (i, text) in prompts.iter().enumerate() {
            let views: Vec<WorkerView> = fleet
                .iter()
                .enumerate()
                .map(|(w, &(load, waiting, pending, h))| {
                    // Candidates in id order, or not.
                    let id = if reversed { fleet.len() - 1 - w } else { w };
                    let mut v = WorkerView::idle(WorkerId(id as u32));
                    v.in_flight = (load + 7 * i as u32) % 83;
                    v.waiting = waiting.min(v.in_flight);
                    v.pending_prefill_tokens = pending * 700;
                    v.health = if h == 0 { Health::Unhealthy } else { Health::Healthy };
                    v
                })
                .collect();
            digest.refresh(&views);
            let req = RequestView::from_text("m", text);
            let now = Nanos::from_millis(i as u64 * 10);
            let a = route(with.as_mut(), &req, &views, &mut PickCtx { now, rng: &mut ra, fleet: Some(&digest) });
            let b = route(without.as_mut(), &req, &views, &mut PickCtx { now, rng: &mut rb, fleet: None });
            prop_assert_eq!(a, b, "request {} to {}", i, policy);
        }
    }
}
