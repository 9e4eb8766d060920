//! Several tenants on one router: the prompt-caching side channel is closed.
//!
//! The attack (a probe of the router found it): tenant B wants tenant A's PIN, which follows
//! a system prompt both use. B sends the prompt with each candidate PIN and reads how much of
//! it the router found cached (`x-kvroute-decision: …; matched=N/M`): the right PIN matches
//! more, because A's request put it in the shared prefix index. These tests replay it under
//! `cache_aware` (character radix tree) and `least_ttft` (block hashes) and show that
//! - by default no decision header reaches a client at all;
//! - with the headers exposed, tenant isolation (the default) makes B's observations the same
//!   whatever A's PIN is, while without isolation the same attack recovers it (the control
//!   that shows the probe measures something real);
//! - the salt reaches the engine (`cache_salt`), so B's `usage.cached_tokens` does not reveal
//!   A's prompt either.
//!
//! Every connection is to 127.0.0.1 with simulated workers.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig, Profile};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

/// The system prompt both tenants send (256 bytes: 4 text blocks of 64 bytes).
fn system() -> String {
    let s: String = (0..8).map(|i| format!("Rule {i}: be brief and exact. ")).collect::<String>();
    format!("{s:.<256}")
}

/// A prompt: the system prompt, the PIN, and padding to the end of its 64-byte block.
fn prompt(pin: &str) -> String {
    format!("{}{:.<64}", system(), format!("The customer's PIN is {pin}."))
}

const CANDIDATES: [&str; 6] = ["1111", "4071", "5550", "8362", "9204", "0000"];

fn chat(content: &str) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": content}],
        "max_tokens": 2})
}

/// A router over `workers` with two API-key tenants.
fn config(workers: &[String], policy: &str, keys: &std::path::Path) -> GatewayConfig {
    GatewayConfig {
        api_key_file: Some(keys.display().to_string()),
        worker_urls: workers.to_vec(),
        ..common::config(&[], policy)
    }
}

/// The two tenants' API-key file; removed when the returned path drops (also on a panic).
fn key_file(name: &str) -> tempfile::TempPath {
    let file = tempfile::Builder::new()
        .prefix(&format!("kvroute-tenants-{name}-"))
        .suffix(".txt")
        .tempfile()
        .expect("temp file")
        .into_temp_path();
    std::fs::write(&file, "sk-victim team-a\nsk-attacker team-b\n").expect("write keys");
    file
}

/// What the attacker sees: per candidate, the decision header's matched count (or `None`
/// when there is no header), and `usage.prompt_tokens_details.cached_tokens`.
type Seen = Vec<(Option<u64>, u64)>;

/// A fresh router with `cfg`; the victim sends its PIN prompt twice, then the attacker
/// probes every candidate. Returns what the attacker saw.
async fn attack(cfg: GatewayConfig, victim_pin: &str) -> Seen {
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(cfg, stop.clone()).await;
    let c = reqwest::Client::new();
    let send = |key: &'static str, text: String| {
        let c = c.clone();
        let r = r.clone();
        async move {
            let resp = guard(c.post(format!("{r}/v1/chat/completions")).bearer_auth(key).json(&chat(&text)).send())
                .await
                .expect("send");
            assert_eq!(resp.status(), 200);
            let matched = resp.headers().get("x-kvroute-decision").map(|v| {
                let d = v.to_str().expect("ascii");
                let m = d.split("matched=").nth(1).expect("matched").split('/').next().expect("n");
                m.parse::<u64>().expect("number")
            });
            assert_eq!(matched.is_some(), resp.headers().contains_key("x-kvroute-worker"));
            let v: serde_json::Value = resp.json().await.expect("json");
            (matched, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
        }
    };
    for _ in 0..2 {
        send("sk-victim", prompt(victim_pin)).await;
    }
    let mut seen = Vec::new();
    for pin in CANDIDATES {
        seen.push(send("sk-attacker", prompt(pin)).await);
    }
    stop.cancel();
    seen
}

/// The candidate with the largest matched count, when one stands out.
fn guess(seen: &Seen) -> Option<&'static str> {
    let best = seen.iter().filter_map(|s| s.0).max()?;
    let at: Vec<usize> = seen.iter().enumerate().filter(|(_, s)| s.0 == Some(best)).map(|(i, _)| i).collect();
    (at.len() == 1).then(|| CANDIDATES[at[0]])
}

async fn workers(n: usize, stop: &CancellationToken) -> Vec<String> {
    let mut profile = Profile::named("h100-llama3-8b").expect("profile");
    profile.prefill_per_token_s = 1e-5;
    let mut urls = Vec::new();
    for _ in 0..n {
        let sim = EngineSimConfig { profile: profile.clone(), time_scale: 100.0, ..EngineSimConfig::default() };
        let (u, _) = engine_sim::spawn_local(sim, stop.clone()).await.expect("worker");
        urls.push(u);
    }
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pin_attack_learns_nothing_under_cache_aware_and_least_ttft() {
    let stop_w = CancellationToken::new();
    let ws = workers(2, &stop_w).await;
    let keys = key_file("pin");
    for policy in ["cache_aware", "least_ttft"] {
        // Default: no decision detail reaches a client.
        let mut cfg = config(&ws, policy, &keys);
        cfg.expose_decision_headers = false;
        let seen = attack(cfg, "4071").await;
        assert!(seen.iter().all(|s| s.0.is_none()), "{policy}: a decision header reached a tenant: {seen:?}");

        // Headers exposed (the unsafe setting), isolation on: the same observations
        // whichever PIN the victim sent.
        let a = attack(config(&ws, policy, &keys), "4071").await;
        let b = attack(config(&ws, policy, &keys), "8362").await;
        assert!(a.iter().all(|s| s.0.is_some()));
        assert_eq!(a, b, "{policy}: with isolation the attacker's view depends on the victim's PIN");

        // The control: without isolation the attack works (so the probe is a real one).
        let open = |pin| {
            let mut cfg = config(&ws, policy, &keys);
            cfg.tenant_isolation = false;
            attack(cfg, pin)
        };
        let (a, b) = (open("4071").await, open("8362").await);
        assert_ne!(a, b, "{policy}: without isolation the attacker's view should depend on the PIN");
        if policy == "cache_aware" {
            assert_eq!(guess(&a), Some("4071"), "{policy}: {a:?}");
            assert_eq!(guess(&b), Some("8362"), "{policy}: {b:?}");
        }
    }
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_isolates_by_the_tenant_salt_and_shared_tenants_share() {
    let stop_w = CancellationToken::new();
    let ws = workers(1, &stop_w).await;
    let keys = key_file("salt");
    let text = prompt("4071");
    // The cached tokens the attacker's copy of the victim's prompt gets at the engine.
    let attacker_hit = |cfg: GatewayConfig| {
        let text = text.clone();
        async move {
            let stop = CancellationToken::new();
            let (r, _task) = common::start_router(cfg, stop.clone()).await;
            let c = reqwest::Client::new();
            let mut cached = Vec::new();
            for key in ["sk-victim", "sk-victim", "sk-attacker"] {
                let resp = guard(c.post(format!("{r}/v1/chat/completions")).bearer_auth(key).json(&chat(&text)).send())
                    .await
                    .expect("send");
                assert_eq!(resp.status(), 200);
                let v: serde_json::Value = resp.json().await.expect("json");
                cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens"));
            }
            stop.cancel();
            cached
        }
    };
    let isolated = attacker_hit(config(&ws, "cache_aware", &keys)).await;
    assert!(isolated[1] > 0, "the victim's second request hits its own cache: {isolated:?}");
    assert_eq!(isolated[2], 0, "the attacker hit the victim's cache at the engine: {isolated:?}");

    // A group's salt is neither member's own, so the victim's blocks of the first run are
    // not reused here: the victim misses, then hits, and so does its group's other tenant.
    let mut shared = config(&ws, "cache_aware", &keys);
    shared.shared_prefix_tenants = vec![vec!["team-a".into(), "team-b".into()]];
    let group = attacker_hit(shared).await;
    assert!(group[2] > 0, "tenants of one group share the engine's cache: {group:?}");
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_headers_go_to_the_admin_token_only() {
    let stop_w = CancellationToken::new();
    let ws = workers(1, &stop_w).await;
    let mut cfg = common::config(&[], "cache_aware");
    cfg.worker_urls = ws.clone();
    cfg.expose_decision_headers = false;
    cfg.admin_token = Some("admin-secret".into());
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(cfg, stop.clone()).await;
    let c = reqwest::Client::new();
    let post = |token: Option<&'static str>| {
        let mut rb = c.post(format!("{r}/v1/chat/completions")).json(&chat("hello"));
        if let Some(t) = token {
            rb = rb.header("x-kvroute-admin-token", t);
        }
        guard(rb.send())
    };
    for (token, expect) in [(None, false), (Some("wrong"), false), (Some("admin-secret"), true)] {
        let resp = post(token).await.expect("send");
        assert_eq!(resp.status(), 200);
        for h in ["x-kvroute-worker", "x-kvroute-decision"] {
            assert_eq!(resp.headers().contains_key(h), expect, "{h} with token {token:?}");
        }
    }
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_route_keys_a_dry_run_as_the_named_tenants_request() {
    let stop_w = CancellationToken::new();
    let ws = workers(2, &stop_w).await;
    let keys = key_file("debug");
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config(&ws, "cache_aware", &keys), stop.clone()).await;
    let c = reqwest::Client::new();
    let text = prompt("4071");
    let resp = guard(c.post(format!("{r}/v1/chat/completions")).bearer_auth("sk-victim").json(&chat(&text)).send())
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let matched = |tenant: &'static str| {
        let c = common::client();
        let (r, text) = (r.clone(), text.clone());
        async move {
            let resp = guard(c.post(format!("{r}/debug/route?tenant={tenant}")).json(&chat(&text)).send())
                .await
                .expect("send");
            assert_eq!(resp.status(), 200);
            let v: serde_json::Value = resp.json().await.expect("json");
            (v["matched"].as_u64().expect("matched"), v["key_len"].as_u64().expect("key_len"))
        }
    };
    let (own, len) = matched("team-a").await;
    assert_eq!(own, len, "the victim's own tenant finds its whole prompt");
    let (other, _) = matched("team-b").await;
    assert_eq!(other, 0, "another tenant finds nothing of it");
    stop.cancel();
    stop_w.cancel();
}
