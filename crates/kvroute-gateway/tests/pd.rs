//! Prefill/decode disaggregation through the gateway, with engine-sim playing prefill and
//! decode workers in both protocols: SGLang's bootstrap room (both workers at once) and
//! vLLM's `kv_transfer_params` (prefill, then decode). Long prompts are split, short ones
//! colocated; each pool has its own policy and admission limit; a failing prefill or decode
//! worker is replaced before anything reaches the client.

use kvroute_core::types::Role;
use kvroute_engine_sim::{self as engine_sim, EngineSim, EngineSimConfig};
use kvroute_gateway::pd::{PdConfig, PdProtocol, PrefillWorker};
use serde_json::{Value, json};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

fn sim(role: Role) -> EngineSimConfig {
    EngineSimConfig {
        time_scale: 50.0,
        role,
        bootstrap_port: (role == Role::Prefill).then_some(0),
        bootstrap_timeout_secs: 5.0,
        ..EngineSimConfig::default()
    }
}

struct Fleet {
    prefill: Vec<(String, Arc<EngineSim>)>,
    decode: Vec<(String, Arc<EngineSim>)>,
}

async fn fleet(prefill: Vec<EngineSimConfig>, decode: Vec<EngineSimConfig>, stop: &CancellationToken) -> Fleet {
    let mut f = Fleet { prefill: Vec::new(), decode: Vec::new() };
    for c in prefill {
        f.prefill.push(engine_sim::spawn_local(c, stop.clone()).await.expect("prefill worker"));
    }
    for c in decode {
        f.decode.push(engine_sim::spawn_local(c, stop.clone()).await.expect("decode worker"));
    }
    f
}

fn config(f: &Fleet, protocol: PdProtocol) -> kvroute_gateway::GatewayConfig {
    let mut cfg = common::config(&[], "cache_aware");
    cfg.pd = PdConfig {
        enabled: true,
        protocol,
        prefill: f
            .prefill
            .iter()
            .map(|(u, s)| PrefillWorker { url: u.clone(), bootstrap_port: s.bootstrap_port() })
            .collect(),
        decode: f.decode.iter().map(|(u, _)| u.clone()).collect(),
        colocate_below_tokens: 64,
        ..PdConfig::default()
    };
    cfg
}

/// A prompt of about `tokens` tokens (4 characters each) starting with `head`.
fn prompt(head: &str, tokens: usize) -> String {
    let mut p = head.to_string();
    while p.len() < tokens * 4 {
        p.push_str(" the cache router sends each request to a worker");
    }
    p
}

fn chat(content: &str, stream: bool) -> Value {
    json!({"model": "sim-llama-3-8b", "max_tokens": 6, "stream": stream,
        "messages": [{"role": "user", "content": content}]})
}

struct Answer {
    status: u16,
    decision: String,
    worker: String,
    text: String,
}

async fn send(c: &reqwest::Client, router: &str, body: &Value) -> Answer {
    let r = guard(c.post(format!("{router}/v1/chat/completions")).json(body).send()).await.expect("send");
    let h = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (status, decision, worker) = (r.status().as_u16(), h("x-kvroute-decision"), h("x-kvroute-worker"));
    let text = guard(r.text()).await.expect("body");
    Answer { status, decision, worker, text }
}

async fn counter(c: &reqwest::Client, router: &str, series: &str) -> f64 {
    let text = guard(c.get(format!("{router}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

/// Both protocols, streamed and not: long prompts split (the decision names both workers,
/// the decode worker answers), short ones colocated on a decode worker; a second prompt
/// sharing a long prefix goes to the same prefill worker, whose prefix cache then serves it.
async fn split_and_colocate(protocol: PdProtocol) {
    let stop = CancellationToken::new();
    let f =
        fleet(vec![sim(Role::Prefill), sim(Role::Prefill)], vec![sim(Role::Decode), sim(Role::Decode)], &stop).await;
    let (router, _) = common::start_router(config(&f, protocol), stop.clone()).await;
    let c = common::client();
    let decode_urls: Vec<&str> = f.decode.iter().map(|(u, _)| u.as_str()).collect();

    let long = prompt("a long shared system prompt", 400);
    let a = send(&c, &router, &chat(&format!("{long} first question"), false)).await;
    assert_eq!(a.status, 200, "{}: {}", protocol.as_str(), a.text);
    let first_prefill = a
        .decision
        .strip_prefix("pd=prefill:")
        .and_then(|d| d.split(',').next())
        .unwrap_or_else(|| panic!("the decision names the prefill worker: {}", a.decision))
        .to_string();
    assert!(a.decision.contains(&format!(",decode:{}", a.worker)), "and the decode worker: {}", a.decision);
    assert!(decode_urls.contains(&a.worker.as_str()), "the decode worker answers");
    let v: Value = serde_json::from_str(&a.text).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");

    // Prefix-aware prefill placement: the same prefill worker, and its cache serves it.
    let (_, psim) = f.prefill.iter().find(|(u, _)| *u == first_prefill).expect("a prefill worker");
    let hits_before = psim.stats().prefix_hit_tokens;
    let b = send(&c, &router, &chat(&format!("{long} second question"), true)).await;
    assert_eq!(b.status, 200, "{}", b.text);
    assert!(b.decision.starts_with(&format!("pd=prefill:{first_prefill},")), "{}", b.decision);
    assert!(b.text.contains("data: [DONE]"), "streamed from the decode worker: {}", b.text);
    assert!(psim.stats().prefix_hit_tokens > hits_before + 300, "the second prefill reused the first's blocks");
    let transfers: u64 = f.decode.iter().map(|(_, s)| s.pd_counters().transfers).sum();
    assert_eq!(transfers, 2, "each split request's KV went to its decode worker");

    // A short prompt runs on one worker: a decode worker, since no `both` worker exists.
    let short = send(&c, &router, &chat("hi", false)).await;
    assert_eq!(short.status, 200, "{}", short.text);
    assert!(short.decision.starts_with("pd=colocated; policy=least_load"), "{}", short.decision);
    assert!(decode_urls.contains(&short.worker.as_str()));
    // The dry run shows the placement and, for a split, each pool's decision.
    let dry = |body: Value| {
        let (c, router) = (c.clone(), router.clone());
        async move {
            let r = guard(c.post(format!("{router}/debug/route")).json(&body).send()).await.expect("dry run");
            r.json::<Value>().await.expect("json")
        }
    };
    let v = dry(chat(&format!("{long} third question"), false)).await;
    assert_eq!(v["placement"], "split", "{v}");
    assert_eq!(v["prefill"]["worker"], first_prefill.as_str(), "the prefix's prefill worker: {v}");
    assert_eq!(v["decode"]["policy"], "least_load", "{v}");
    let v = dry(chat("hi", false)).await;
    assert_eq!((v["placement"].as_str(), v["policy"].as_str()), (Some("colocated"), Some("least_load")), "{v}");
    assert_eq!(counter(&c, &router, "kvroute_pd_requests_total{outcome=\"split\"}").await, 2.0);
    assert_eq!(counter(&c, &router, "kvroute_pd_requests_total{outcome=\"colocated\"}").await, 1.0);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_splits_long_prompts_and_colocates_short_ones() {
    split_and_colocate(PdProtocol::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_splits_long_prompts_and_colocates_short_ones() {
    split_and_colocate(PdProtocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_has_its_own_admission_limit() {
    let stop = CancellationToken::new();
    let slow = |role| EngineSimConfig { time_scale: 1.0, ..sim(role) };
    let f = fleet(vec![slow(Role::Prefill)], vec![slow(Role::Decode)], &stop).await;
    let mut cfg = config(&f, PdProtocol::Sglang);
    cfg.pd.max_in_flight_decode = 1;
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = common::client();
    // A long decode holds the decode pool's only permit while its stream is open.
    let mut body = chat(&prompt("hold", 200), true);
    body["max_tokens"] = json!(4000);
    let held = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await.expect("send");
    assert_eq!(held.status(), 200);
    let refused = send(&c, &router, &chat(&prompt("another", 200), false)).await;
    assert_eq!(refused.status, 503, "{}", refused.text);
    assert!(refused.text.contains("too many decode requests"), "{}", refused.text);
    // Short prompts colocated on a decode worker are admitted in the decode pool too.
    let short = send(&c, &router, &chat("hi", false)).await;
    assert_eq!(short.status, 503, "{}", short.text);
    drop(held);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_or_decode_worker_is_replaced_before_the_client_sees_anything() {
    let stop = CancellationToken::new();
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let broken = |role| EngineSimConfig { error_rate: 1.0, fault_seed: 3, ..sim(role) };
        let f = fleet(
            vec![broken(Role::Prefill), sim(Role::Prefill)],
            vec![broken(Role::Decode), sim(Role::Decode)],
            &stop,
        )
        .await;
        let mut cfg = config(&f, protocol);
        cfg.pd.prefill_policy = "round_robin".into();
        cfg.pd.decode_policy = "round_robin".into();
        cfg.max_worker_retries = 1;
        let (router, _) = common::start_router(cfg, stop.clone()).await;
        let c = common::client();
        for i in 0..4 {
            let stream = i % 2 == 1;
            let a = send(&c, &router, &chat(&prompt(&format!("request {i}"), 200), stream)).await;
            assert_eq!(a.status, 200, "{} request {i}: {}", protocol.as_str(), a.text);
            assert_eq!(a.worker, f.decode[1].0, "the healthy decode worker answers");
            assert!(a.decision.starts_with(&format!("pd=prefill:{},", f.prefill[1].0)), "{}", a.decision);
        }
        let p = counter(&c, &router, "kvroute_pd_failures_total{outcome=\"prefill\"}").await;
        let d = counter(&c, &router, "kvroute_pd_failures_total{outcome=\"decode\"}").await;
        assert!(p >= 1.0 && d >= 1.0, "{}: prefill failures {p}, decode failures {d}", protocol.as_str());
    }
    stop.cancel();
}

/// A request no prefill worker could serve is counted on the prefill worker that failed it
/// last, not on the decode worker it was paired with (which did nothing wrong and is not
/// charged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_every_prefill_worker_failed_is_counted_on_a_prefill_worker() {
    let stop = CancellationToken::new();
    let broken = EngineSimConfig { error_rate: 1.0, fault_seed: 3, ..sim(Role::Prefill) };
    let f = fleet(vec![broken], vec![sim(Role::Decode)], &stop).await;
    let mut cfg = config(&f, PdProtocol::Sglang);
    cfg.max_worker_retries = 1;
    cfg.max_total_retries = 1;
    let cfg_pd = cfg.pd.clone();
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = common::client();
    let a = send(&c, &router, &chat(&prompt("no prefill", 200), false)).await;
    assert_eq!(a.status, 502, "{}", a.text);
    let text = guard(c.get(format!("{router}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    let failed = |url: &str| {
        text.lines()
            .filter(|l| l.starts_with("kvroute_requests_total{") && l.contains(&format!("worker=\"{url}\"")))
            .filter(|l| l.contains("outcome=\"upstream_error\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(failed(&f.prefill[0].0), 1.0, "{text}");
    assert_eq!(failed(&f.decode[0].0), 0.0, "{text}");
    // Counted under the pools' policies, as the decision header names them, not the main
    // policy, which routes nothing with PD on.
    let pools = format!("policy=\"{}+{}\"", cfg_pd.prefill_policy, cfg_pd.decode_policy);
    let counted: Vec<&str> = text.lines().filter(|l| l.starts_with("kvroute_requests_total{")).collect();
    assert!(!counted.is_empty() && counted.iter().all(|l| l.contains(&pools)), "{pools}: {counted:?}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handshake_has_a_timeout_and_a_stream_failing_after_its_first_byte_ends_with_an_error_event() {
    let stop = CancellationToken::new();
    // A prefill worker that never answers: the handshake times out, the pair fails.
    let hung = EngineSimConfig { hang_rate: 1.0, ..sim(Role::Prefill) };
    let f = fleet(vec![hung], vec![sim(Role::Decode)], &stop).await;
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let mut cfg = config(&f, protocol);
        cfg.pd.handshake_timeout_secs = 0.5;
        let (router, _) = common::start_router(cfg, stop.clone()).await;
        let c = common::client();
        let a = send(&c, &router, &chat(&prompt("stuck", 200), false)).await;
        assert_eq!(a.status, 502, "{}: {}", protocol.as_str(), a.text);
        assert!(a.text.contains("handshake timeout"), "{}", a.text);
    }

    // A decode worker that sends one chunk and then stalls: an SSE error event.
    let (stalling, stop_s) = common::stalling_worker(Arc::default()).await;
    let good = fleet(vec![sim(Role::Prefill)], vec![], &stop).await;
    let mut cfg = config(&good, PdProtocol::Sglang);
    cfg.pd.decode = vec![stalling];
    cfg.stream_idle_timeout_secs = 0.3;
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = common::client();
    let a = send(&c, &router, &chat(&prompt("stall", 200), true)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert!(a.text.starts_with("data: {\"choices\":[]}"), "{}", a.text);
    assert!(a.text.contains("stream_idle_timeout_secs") && a.text.contains("\"code\":504"), "{}", a.text);
    stop_s.cancel();
    stop.cancel();
}

/// The pools' policies change live through the one policy apply: `PUT /policy` with
/// `prefill`/`decode` fields sets them (checked before anything changes) and `GET /policy`
/// shows them; a router without disaggregation refuses those fields.
#[tokio::test]
async fn put_policy_sets_the_prefill_and_decode_pools_policies() {
    guard(pools_policies()).await;
}

async fn pools_policies() {
    let stop = CancellationToken::new();
    let f = fleet(vec![sim(Role::Prefill)], vec![sim(Role::Decode)], &stop).await;
    let (router, _) = common::start_router(config(&f, PdProtocol::Sglang), stop.clone()).await;
    let c = common::client();
    let get = |c: &reqwest::Client| {
        let url = format!("{router}/policy");
        let c = c.clone();
        async move { c.get(url).send().await.expect("get").json::<Value>().await.expect("json") }
    };
    let before = get(&c).await;
    assert_eq!(before["prefill"]["policy"], "cache_aware", "{before}");
    assert_eq!(before["decode"]["policy"], "least_load", "{before}");
    // A bad pool knob changes nothing, the main policy included.
    let bad = json!({"policy": "round_robin", "prefill": {"policy": "cache_aware", "knobs": {"no_such_knob": 1}}});
    let r = c.put(format!("{router}/policy")).json(&bad).send().await.expect("put");
    assert_eq!(r.status(), 400);
    let after_bad = get(&c).await;
    assert_eq!(after_bad["policy"], before["policy"], "{after_bad}");
    assert_eq!(after_bad["prefill"]["policy"], "cache_aware");
    let good = json!({"prefill": {"policy": "round_robin"}, "decode": {"knobs": {}}});
    let r = c.put(format!("{router}/policy")).json(&good).send().await.expect("put");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    let after = get(&c).await;
    assert_eq!(after["prefill"]["policy"], "round_robin", "{after}");
    assert_eq!(after["decode"]["policy"], "least_load", "{after}");
    assert_eq!(after["policy"], before["policy"], "the main policy stays: {after}");
    // Requests are still split and served.
    let a = send(&c, &router, &chat(&prompt("after the switch", 400), false)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert!(a.decision.contains("policy=round_robin+least_load"), "{}", a.decision);

    // Without disaggregation the fields are refused, naming the field.
    let (plain, _) = common::start_router(common::config(&[f.decode[0].0.as_str()], "cache_aware"), stop.clone()).await;
    let r = c.put(format!("{plain}/policy")).json(&json!({"prefill": {"policy": "round_robin"}})).send().await;
    let r = r.expect("put");
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap_or_default().contains("prefill"));
    stop.cancel();
}
