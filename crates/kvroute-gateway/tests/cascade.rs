//! Model cascade through the gateway (Cognitora cgn-router's cascade): engine-sim workers
//! return log-probabilities from their `quality` knob, so each test knows which steps are
//! confident. A request for a chain's entry model runs on the smallest model first and
//! escalates only below the chain's threshold; a failing step is retried on another worker
//! and does not escalate by itself; an exhausted chain returns the last model's answer.

use kvroute_core::cascade::{CascadeChain, CascadeConfig};
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

async fn worker(model: &str, quality: f64, error_rate: f64, stop: &CancellationToken) -> String {
    let cfg = EngineSimConfig {
        time_scale: 100.0,
        model: model.into(),
        quality,
        error_rate,
        fault_seed: 7,
        ..EngineSimConfig::default()
    };
    engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker").0
}

fn chain(entry: &str, models: &[&str], threshold: f64) -> CascadeChain {
    CascadeChain {
        model: entry.into(),
        models: models.iter().map(|m| m.to_string()).collect(),
        confidence_threshold: threshold,
        max_tokens: Vec::new(),
    }
}

fn config(urls: &[&str], chains: Vec<CascadeChain>) -> kvroute_gateway::GatewayConfig {
    let mut cfg = common::config(urls, "round_robin");
    cfg.cascade = CascadeConfig { chain: chains };
    cfg
}

async fn chat(c: &reqwest::Client, router: &str, body: Value) -> (u16, String, String, Value) {
    let r = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await.expect("send");
    let status = r.status().as_u16();
    let header = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (trail, worker) = (header("x-kvroute-cascade"), header("x-kvroute-worker"));
    let v = r.json().await.unwrap_or(Value::Null);
    (status, trail, worker, v)
}

fn ask(model: &str, content: &str) -> Value {
    json!({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
}

async fn metrics(c: &reqwest::Client, router: &str) -> String {
    guard(c.get(format!("{router}/metrics")).send()).await.expect("metrics").text().await.expect("text")
}

fn counter(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escalation_happens_only_below_the_threshold_and_usage_is_summed() {
    let stop = CancellationToken::new();
    let small = worker("small", -2.0, 0.0, &stop).await;
    let medium = worker("medium", -0.8, 0.0, &stop).await;
    let large = worker("large", -0.3, 0.0, &stop).await;
    let chains =
        vec![chain("auto", &["small", "medium", "large"], -1.0), chain("cheap", &["small", "medium", "large"], -2.5)];
    let (router, _) = common::start_router(config(&[&small, &medium, &large], chains), stop.clone()).await;
    let c = common::client();

    // The entry models are listed with the workers' models: clients discover them.
    let listed: Value = c.get(format!("{router}/v1/models")).send().await.expect("models").json().await.expect("json");
    let ids: Vec<&str> = listed["data"].as_array().expect("data").iter().filter_map(|m| m["id"].as_str()).collect();
    for m in ["small", "medium", "large", "auto", "cheap"] {
        assert!(ids.contains(&m), "{m} in {ids:?}");
    }
    assert_eq!(ids.len(), 5, "each once: {ids:?}");

    // small answers at -2.0 < -1.0: escalates; medium at -0.8 >= -1.0: accepted.
    let (status, trail, worker, v) = chat(&c, &router, ask("auto", "why is the sky blue")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(trail, "small:-2.00>medium:-0.80");
    assert_eq!(worker, medium);
    assert_eq!(v["model"], "medium");
    assert!(v["choices"][0]["logprobs"].is_null(), "the router's logprobs are removed: {v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    let single = chat(&c, &router, ask("large", "why is the sky blue")).await.3;
    assert_eq!(prompt, 2 * single["usage"]["prompt_tokens"].as_u64().expect("tokens"), "two steps' prompts");
    assert_eq!(v["usage"]["completion_tokens"], 16, "two steps of 8 tokens");
    assert_eq!(v["usage"]["total_tokens"].as_u64(), Some(prompt + 16));

    // A laxer threshold accepts small's answer: no escalation.
    let (status, trail, worker, v) = chat(&c, &router, ask("cheap", "why is the sky blue")).await;
    assert_eq!((status, trail.as_str()), (200, "small:-2.00"), "{v}");
    assert_eq!(worker, small);

    // A client that asks for logprobs keeps them.
    let mut body = ask("auto", "and the sunset red");
    body["logprobs"] = json!(true);
    let v = chat(&c, &router, body).await.3;
    let lps = v["choices"][0]["logprobs"]["content"].as_array().expect("logprobs kept");
    assert_eq!(lps.len(), 8);

    // A model that starts no chain is routed as usual, without the header.
    let (status, trail, worker, _) = chat(&c, &router, ask("small", "plain")).await;
    assert_eq!((status, trail.as_str(), worker.as_str()), (200, "", small.as_str()));

    // Completions and SGLang /generate cascade too, reading their own logprob shapes.
    let r = guard(
        c.post(format!("{router}/v1/completions"))
            .json(&json!({"model": "auto", "prompt": "complete this", "max_tokens": 4}))
            .send(),
    )
    .await
    .expect("send");
    assert_eq!(r.headers()["x-kvroute-cascade"], "small:-2.00>medium:-0.80");
    let v: Value = r.json().await.expect("json");
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    let r = guard(
        c.post(format!("{router}/generate"))
            .json(&json!({"model": "auto", "text": "generate this", "sampling_params": {"max_new_tokens": 4}}))
            .send(),
    )
    .await
    .expect("send");
    assert_eq!(r.headers()["x-kvroute-cascade"], "small:-2.00>medium:-0.80");
    let v: Value = r.json().await.expect("json");
    assert!(v["meta_info"].get("output_token_logprobs").is_none(), "{v}");
    assert_eq!(v["meta_info"]["completion_tokens"], 8);

    let m = metrics(&c, &router).await;
    assert_eq!(counter(&m, "kvroute_cascade_steps_total{model=\"small\",outcome=\"escalated\"}"), 4.0, "{m}");
    assert_eq!(counter(&m, "kvroute_cascade_steps_total{model=\"small\",outcome=\"accepted\"}"), 1.0);
    assert_eq!(counter(&m, "kvroute_cascade_steps_total{model=\"medium\",outcome=\"accepted\"}"), 4.0);
    // small's steps: three chat requests of 8 tokens, a completion and a /generate of 4.
    assert_eq!(counter(&m, "kvroute_cascade_tokens_total{model=\"small\",outcome=\"completion\"}"), 32.0, "{m}");

    // The chains change live through the policy API: a strict threshold reaches large.
    let r = guard(
        c.put(format!("{router}/policy"))
            .json(&json!({"cascade": {"chain": [{"model": "auto", "models": ["small", "medium", "large"],
                "confidence_threshold": -0.5}]}}))
            .send(),
    )
    .await
    .expect("put");
    assert_eq!(r.status(), 200);
    let (_, trail, worker, _) = chat(&c, &router, ask("auto", "third question")).await;
    assert_eq!(trail, "small:-2.00>medium:-0.80>large:-0.30");
    assert_eq!(worker, large);
    let r = guard(c.put(format!("{router}/policy")).json(&json!({"cascade": {"chain": [{"models": []}]}})).send())
        .await
        .expect("put");
    assert_eq!(r.status(), 400, "an invalid chain is refused");
    assert_eq!(chat(&c, &router, ask("auto", "third question")).await.1, "small:-2.00>medium:-0.80>large:-0.30");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_is_retried_and_does_not_escalate_by_itself() {
    let stop = CancellationToken::new();
    let broken = worker("small", -0.2, 1.0, &stop).await;
    let good = worker("small", -0.2, 0.0, &stop).await;
    let large_cfg = EngineSimConfig { time_scale: 100.0, model: "large".into(), ..EngineSimConfig::default() };
    let (large, large_sim) = engine_sim::spawn_local(large_cfg, stop.clone()).await.expect("large");
    let mut cfg = config(&[&broken, &good, &large], vec![chain("auto", &["small", "large"], -1.0)]);
    cfg.max_worker_retries = 1;
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = common::client();
    for i in 0..4 {
        let (status, trail, worker, v) = chat(&c, &router, ask("auto", &format!("question {i}"))).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(trail, "small:-0.20", "request {i}: the failed attempt is retried, not escalated");
        assert_eq!(worker, good);
    }
    let m = metrics(&c, &router).await;
    assert!(counter(&m, "kvroute_retries_total") >= 1.0, "round robin sent some first attempts to the broken worker");
    assert_eq!(large_sim.stats().submitted, 0, "nothing escalated to large");

    // With every worker of the step failing, the request fails at that step.
    let only_broken = config(&[&broken, &large], vec![chain("auto", &["small", "large"], -1.0)]);
    let (router2, _) = common::start_router(only_broken, stop.clone()).await;
    let (status, trail, _, v) = chat(&c, &router2, ask("auto", "doomed")).await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(trail, "small:failed");
    assert_eq!(large_sim.stats().submitted, 0, "a failure does not escalate");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_chain_returns_the_last_answer_and_streams_go_to_the_last_model() {
    let stop = CancellationToken::new();
    let small = worker("small", -3.0, 0.0, &stop).await;
    let large = worker("large", -3.0, 0.0, &stop).await;
    let (router, _) =
        common::start_router(config(&[&small, &large], vec![chain("auto", &["small", "large"], -1.0)]), stop.clone())
            .await;
    let c = common::client();
    let (status, trail, worker, v) = chat(&c, &router, ask("auto", "a hard question")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(trail, "small:-3.00>large:-3.00", "below the threshold everywhere: the last answer");
    assert_eq!(worker, large);
    assert_eq!(v["model"], "large");

    let mut body = ask("auto", "stream it");
    body["stream"] = json!(true);
    let r = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await.expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-cascade"], "large:stream");
    assert_eq!(r.headers()["x-kvroute-worker"], large.as_str());
    let text = guard(r.text()).await.expect("stream");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.contains("\"model\":\"large\""), "{text}");
    stop.cancel();
}
