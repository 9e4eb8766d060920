//! The request pipeline's contracts, end to end on 127.0.0.1 with simulated workers:
//! admission and dry runs record nothing; a client that goes away leaves no load behind;
//! retries follow SGLang router's rules; an ejected worker needs a real inference request to
//! come back, and at most `max_ejection_share` of the workers are out at once; a knob change
//! reschedules eviction.
//!
//! Waits are bounded polls behind a hang guard (a failure, never a timing assertion).

use kvroute_engine_sim::Profile;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::{config as cfg, guard};

async fn worker(cfg: EngineSimConfig) -> (String, CancellationToken) {
    let stop = CancellationToken::new();
    let (url, _sim) = engine_sim::spawn_local(cfg, stop.clone()).await.expect("start a simulated worker");
    (url, stop)
}

fn fast() -> EngineSimConfig {
    let mut profile = Profile::named("h100-llama3-8b").expect("profile");
    profile.prefill_per_token_s = 1e-4;
    EngineSimConfig { profile, time_scale: 50.0, ..EngineSimConfig::default() }
}

fn chat(content: &str) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": content}],
        "max_tokens": 5})
}

/// An unlabelled sample of `name` on the router's `/metrics` (0 when absent).
async fn metric(c: &reqwest::Client, router: &str, name: &str) -> f64 {
    let text = guard(c.get(format!("{router}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// (in_flight, waiting, pending_prefill_tokens) summed over the router's workers.
async fn ledger(c: &reqwest::Client, router: &str) -> (u64, u64, u64) {
    let v: serde_json::Value =
        guard(c.get(format!("{router}/workers")).send()).await.expect("workers").json().await.expect("json");
    v["workers"].as_array().expect("rows").iter().fold((0, 0, 0), |(a, b, p), w| {
        let n = |k: &str| w[k].as_u64().unwrap_or(0);
        (a + n("in_flight"), b + n("waiting"), p + n("pending_prefill_tokens"))
    })
}

async fn post(c: &reqwest::Client, url: String, body: &serde_json::Value) -> reqwest::Response {
    guard(c.post(url).json(body).send()).await.expect("send")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_rejections_and_dry_runs_record_nothing_and_a_gone_client_leaves_no_load() {
    let (hung, stop_w) = worker(EngineSimConfig { hang_rate: 1.0, ..fast() }).await;
    let mut config = cfg(&[&hung], "cache_aware");
    config.max_in_flight_per_model = 1;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    // One request holds the model's only permit (the worker never answers).
    let holder = {
        let (c, url) = (c.clone(), format!("{r}/v1/chat/completions"));
        tokio::spawn(async move { c.post(url).json(&chat(&"held prompt. ".repeat(50))).send().await })
    };
    guard(async {
        while ledger(&c, &r).await.0 != 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let size = metric(&c, &r, "kvroute_index_size").await;
    let load = ledger(&c, &r).await;
    assert!(size > 0.0, "the sent request was committed to the index");
    for i in 0..5 {
        let resp = post(&c, format!("{r}/v1/chat/completions"), &chat(&format!("rejected {i} ").repeat(40))).await;
        assert_eq!(resp.status(), 503, "admission limit 1");
    }
    // /generate without `model` is admitted under the fleet's one model, so it meets the
    // same limit (it used to be counted apart, under "*").
    let resp = post(&c, format!("{r}/generate"), &serde_json::json!({"text": "no model named", "stream": false})).await;
    assert_eq!(resp.status(), 503, "a request without `model` bypassed the model's admission limit");
    for i in 0..20 {
        let mut body = chat(&format!("dry run {i} ").repeat(40));
        body["user"] = format!("session-{i}").into();
        let resp = post(&c, format!("{r}/debug/route"), &body).await;
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(metric(&c, &r, "kvroute_index_size").await, size, "a 503 or a dry run changed the prefix index");
    assert_eq!(ledger(&c, &r).await, load, "a 503 or a dry run changed the load counters");
    // The client of the held request goes away: its load is settled, not leaked.
    holder.abort();
    guard(async {
        while ledger(&c, &r).await != (0, 0, 0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_model_names_share_one_admission_limit_and_unserved_ones_are_refused_first() {
    // Workers that list no models serve any name: every name is admitted under one limit.
    let (hung, stop_w) = worker(EngineSimConfig { hang_rate: 1.0, model: String::new(), ..fast() }).await;
    let mut config = cfg(&[&hung], "cache_aware");
    config.max_in_flight_per_model = 1;
    config.request_timeout_secs = 5.0;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let named = |model: &str| serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5});
    let holder = {
        let (c, url, body) = (c.clone(), format!("{r}/v1/chat/completions"), named("model-a"));
        tokio::spawn(async move { c.post(url).json(&body).send().await })
    };
    guard(async {
        while ledger(&c, &r).await.0 != 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    for i in 0..20 {
        let resp = post(&c, format!("{r}/v1/chat/completions"), &named(&format!("made-up-{i}"))).await;
        // Before: each new name got a limit of its own, was sent to the hung worker and
        // timed out (504).
        assert_eq!(resp.status(), 503, "a new model name opened a fresh admission limit");
    }
    let text = guard(c.get(format!("{r}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    assert!(!text.contains("made-up-"), "a made-up model name became a metric series");
    assert!(text.contains("kvroute_admission_rejections_total{model=\"*\"} 20"), "{text}");
    holder.abort();
    stop.cancel();
    stop_w.cancel();

    // Workers that list their models: a name none of them lists is a 404 before admission,
    // so it neither takes a permit nor creates a series.
    let (w, stop_w) = worker(fast()).await;
    let mut config = cfg(&[&w], "cache_aware");
    config.max_in_flight_per_model = 1;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let resp = post(&c, format!("{r}/v1/chat/completions"), &named("not-served")).await;
    assert_eq!(resp.status(), 404);
    let err: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(err["error"]["param"], "model", "{err}");
    let resp = post(&c, format!("{r}/v1/chat/completions"), &named("sim-llama-3-8b")).await;
    assert_eq!(resp.status(), 200, "the served model is admitted");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_passing_health_and_failing_inference_stays_out_after_max_worker_retries() {
    let (bad, stop_bad) = worker(EngineSimConfig { error_rate: 1.0, ..fast() }).await;
    let (good, stop_good) = worker(fast()).await;
    let mut config = cfg(&[&bad, &good], "round_robin");
    // Health checks pass often: before the fix they brought the worker back every few checks.
    config.health.interval_secs = 0.05;
    config.health.success_threshold = 1;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    for i in 0..40 {
        let resp = post(&c, format!("{r}/v1/chat/completions"), &chat(&format!("q{i}"))).await;
        assert_eq!(resp.status(), 200, "request {i}: no client-visible error while a healthy worker exists");
        assert_eq!(resp.headers()["x-kvroute-worker"].to_str().expect("ascii"), good);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The only failed attempts: the max_worker_retries (3) that ejected it. Its inference
    // probes (1 s, then 2 s, 4 s, ... up to 60 s apart) are not client requests.
    let retries = metric(&c, &r, "kvroute_retries_total").await;
    assert!((1.0..=3.0).contains(&retries), "failed attempts on the bad worker: {retries}");
    let v: serde_json::Value = guard(c.get(format!("{r}/workers")).send()).await.expect("w").json().await.expect("j");
    let row = v["workers"].as_array().expect("rows").iter().find(|w| w["url"] == bad.as_str()).cloned().expect("row");
    assert_eq!(row["ejected"], true, "{v}");
    // SGLang router's list drops a worker that failed max_worker_retries times: it is
    // listed apart, not among the workers requests may go to.
    let v: serde_json::Value =
        guard(c.get(format!("{r}/list_workers")).send()).await.expect("l").json().await.expect("j");
    assert_eq!(v, serde_json::json!({"urls": [good], "ejected": [bad]}));
    stop.cancel();
    stop_bad.cancel();
    stop_good.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_are_bounded_by_max_total_retries_exactly() {
    let (a, stop_a) = worker(EngineSimConfig { error_rate: 1.0, ..fast() }).await;
    let (b, stop_b) = worker(EngineSimConfig { error_rate: 1.0, ..fast() }).await;
    let (c3, stop_c) = worker(EngineSimConfig { error_rate: 1.0, ..fast() }).await;
    let mut config = cfg(&[&a, &b, &c3], "round_robin");
    config.health.interval_secs = 3600.0;
    config.max_worker_retries = 3;
    config.max_total_retries = 6;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let resp = post(&c, format!("{r}/v1/chat/completions"), &chat("fails everywhere")).await;
    assert_eq!(resp.status(), 502);
    let v: serde_json::Value = guard(resp.json()).await.expect("json error");
    let msg = v["error"]["message"].as_str().expect("message");
    assert!(msg.contains("6 made, 6 at most"), "{msg}");
    // 3 on the chosen worker, 3 on the next, none on the third: 5 retries after the first.
    assert_eq!(metric(&c, &r, "kvroute_retries_total").await, 5.0);
    stop.cancel();
    for s in [stop_a, stop_b, stop_c] {
        s.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turning_eviction_on_live_evicts() {
    let (w, stop_w) = worker(fast()).await;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(cfg(&[&w], "prefix_affinity"), stop.clone()).await;
    let c = common::client();
    for i in 0..10 {
        let resp = post(&c, format!("{r}/v1/chat/completions"), &chat(&format!("prompt {i} ").repeat(30))).await;
        assert_eq!(resp.status(), 200);
    }
    assert!(metric(&c, &r, "kvroute_index_size").await > 100.0);
    // Eviction was off at start (Ray Serve's default): turned on live, it must run.
    let patch = serde_json::json!({"knobs": {"do_eviction": true, "eviction_interval_secs": 0.1,
        "eviction_threshold_chars": 100, "eviction_target_chars": 50}});
    let resp = guard(c.put(format!("{r}/policy")).json(&patch).send()).await.expect("put");
    assert_eq!(resp.status(), 200);
    guard(async {
        while metric(&c, &r, "kvroute_index_size").await > 50.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_failing_half_their_requests_are_not_all_ejected_and_retries_hide_the_failures() {
    let mut workers = Vec::new();
    for seed in 0..4 {
        workers.push(worker(EngineSimConfig { error_rate: 0.5, fault_seed: seed, ..fast() }).await);
    }
    let urls: Vec<&str> = workers.iter().map(|(u, _)| u.as_str()).collect();
    let config = cfg(&urls, "round_robin");
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let mut ok = 0;
    let mut most_out = 0;
    for i in 0..200 {
        let resp = post(&c, format!("{r}/v1/chat/completions"), &chat(&format!("half {i}"))).await;
        if resp.status() == 200 {
            ok += 1;
        } else {
            eprintln!("request {i}: {} {}", resp.status(), resp.text().await.unwrap_or_default());
        }
        if i % 10 == 0 {
            let v: serde_json::Value =
                guard(c.get(format!("{r}/workers")).send()).await.expect("w").json().await.expect("j");
            let out = v["workers"].as_array().expect("rows").iter().filter(|w| w["ejected"] == true).count();
            most_out = most_out.max(out);
        }
    }
    // Each request may try 6 times (3 on a worker, then 3 on the next): with every attempt
    // failing with probability 0.5, 1 in 64 requests fails on average (≈ 3 of 200). Before
    // the ejection cap all four workers were out within seconds and ~10 % succeeded.
    assert!(ok >= 190, "{ok} of 200 requests succeeded");
    assert!(most_out <= 2, "{most_out} of 4 workers were ejected at once (max_ejection_share 0.5)");
    let text = guard(c.get(format!("{r}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    // Both outcome series exist from the start at 0; the failures above must have moved them.
    let ejections: f64 = text
        .lines()
        .filter(|l| l.starts_with("kvroute_worker_ejections_total{outcome="))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(ejections > 0.0, "ejection outcomes are counted:\n{text}");
    stop.cancel();
    for (_, s) in workers {
        s.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_id_prompt_over_max_prompt_tokens_is_refused_naming_the_field() {
    let (w, stop_w) = worker(fast()).await;
    let mut config = cfg(&[&w], "cache_aware");
    config.max_prompt_tokens = 1000;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let ids = |n: u32| (0..n).collect::<Vec<u32>>();
    let at_limit = serde_json::json!({"model": "sim-llama-3-8b", "prompt": ids(1000), "max_tokens": 1});
    assert_eq!(post(&c, format!("{r}/v1/completions"), &at_limit).await.status(), 200);
    for (path, body) in [
        ("/v1/completions", serde_json::json!({"model": "sim-llama-3-8b", "prompt": ids(1001)})),
        ("/generate", serde_json::json!({"input_ids": ids(5000)})),
    ] {
        let resp = post(&c, format!("{r}{path}"), &body).await;
        assert_eq!(resp.status(), 400, "{path}");
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        assert!(v["error"]["message"].as_str().expect("message").contains("more than 1000 token ids"), "{v}");
    }
    assert_eq!(ledger(&c, &r).await, (0, 0, 0));
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_ends_with_an_error_event_and_a_worker_that_never_answers_gets_504() {
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (stalling, stop_s) = common::stalling_worker(std::sync::Arc::clone(&requests)).await;
    let mut config = cfg(&[&stalling], "round_robin");
    config.stream_idle_timeout_secs = 0.3;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let mut body = chat("hello");
    body["stream"] = true.into();
    // Before: the client waited for request_timeout_secs (600 s) with the stream open.
    let resp = post(&c, format!("{r}/v1/chat/completions"), &body).await;
    assert_eq!(resp.status(), 200);
    let text = guard(resp.text()).await.expect("the stream ends");
    assert!(text.starts_with("data: {\"choices\":[]}"), "{text}");
    assert!(text.contains("stream_idle_timeout_secs") && text.contains("\"code\":504"), "{text}");
    // A stream is never retried once bytes reached the client.
    assert_eq!(requests.load(std::sync::atomic::Ordering::Relaxed), 1, "the stream was sent again");
    guard(async {
        while ledger(&c, &r).await != (0, 0, 0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    stop.cancel();
    stop_s.cancel();

    // A worker that never sends headers: 504 JSON once the first-byte deadline passes.
    let (hung, stop_w) = worker(EngineSimConfig { hang_rate: 1.0, ..fast() }).await;
    let mut config = cfg(&[&hung], "round_robin");
    config.stream_first_byte_timeout_secs = 0.3;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let resp = post(&c, format!("{r}/v1/chat/completions"), &body).await;
    assert_eq!(resp.status(), 504);
    let v: serde_json::Value = resp.json().await.expect("json");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("sent no response")), "{v}");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_decided_in_parallel_lands_as_if_decided_one_by_one() {
    // 4 workers that never answer, least_load: 16 requests sent at once must end 4 on each
    // worker, as 16 sent one after another do. Decisions run in parallel; one that read a
    // worker's load before another request was sent there is made again
    // (kvroute_decisions_redone_total) instead of piling onto it. A least_load decision is
    // so short that two rarely race here (this test passed with the re-decision off too);
    // the refused stale dispatch itself is tested in kvroute-core's ledger, and the effect
    // on slower decisions is measured in docs/real-engines.md.
    let mut workers = Vec::new();
    for _ in 0..4 {
        workers.push(worker(EngineSimConfig { hang_rate: 1.0, ..fast() }).await);
    }
    let urls: Vec<&str> = workers.iter().map(|(u, _)| u.as_str()).collect();
    let mut config = cfg(&urls, "least_load");
    config.max_in_flight_per_model = 64;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let held: Vec<_> = (0..16)
        .map(|i| {
            let (c, url) = (c.clone(), format!("{r}/v1/chat/completions"));
            tokio::spawn(async move { c.post(url).json(&chat(&format!("burst {i}"))).send().await })
        })
        .collect();
    guard(async {
        while ledger(&c, &r).await.0 != 16 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let v: serde_json::Value =
        guard(c.get(format!("{r}/workers")).send()).await.expect("workers").json().await.expect("json");
    let per_worker: Vec<u64> =
        v["workers"].as_array().expect("rows").iter().map(|w| w["in_flight"].as_u64().unwrap_or(0)).collect();
    assert_eq!(per_worker, vec![4, 4, 4, 4], "requests in flight per worker");
    for h in held {
        h.abort();
    }
    stop.cancel();
    for (_, s) in workers {
        s.cancel();
    }
}
