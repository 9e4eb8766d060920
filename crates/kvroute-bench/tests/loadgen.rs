//! The load generator against real HTTP servers: engine-sim workers (streaming, usage,
//! cached tokens, injected failures) and a stub that refuses with 429.

use kvroute_bench::runner::{Api, Mode, Outcome, RunConfig, run, run_conversations};
use kvroute_bench::summary::{Slo, summarise};
use kvroute_bench::workload::{Arrivals, BenchRequest, Conversation, SharedPrefix, independent, shared_prefix};
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn cfg(url: &str, mode: Mode, api: Api) -> RunConfig {
    RunConfig {
        url: url.to_string(),
        model: "sim-llama-3-8b".into(),
        api,
        stream: true,
        mode,
        max_concurrency: 8,
        duration: None,
        timeout: Duration::from_secs(30),
    }
}

async fn sim(c: EngineSimConfig) -> (String, CancellationToken) {
    let stop = CancellationToken::new();
    let (url, _) = engine_sim::spawn_local(c, stop.clone()).await.expect("start engine-sim");
    (url, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_honours_timestamps_and_records_streams() {
    let (url, stop) = sim(EngineSimConfig { time_scale: 20.0, ..EngineSimConfig::default() }).await;
    // 3 groups × 4 questions sharing a 600-token system prompt, 40 requests/s.
    let shape =
        SharedPrefix { groups: 3, prompts_per_group: 4, system_tokens: 600, question_tokens: 20, output_tokens: 6 };
    let reqs = shared_prefix(shape, Arrivals::Constant(40.0), 1);
    for api in [Api::Chat, Api::Completions] {
        let res = run(&cfg(&url, Mode::Open, api), &reqs, None).await.expect("client");
        assert_eq!(res.len(), reqs.len(), "one record per request");
        for (r, q) in res.iter().zip(&reqs) {
            assert_eq!(r.outcome, Outcome::Ok, "{r:?}");
            assert_eq!(r.status, Some(200));
            assert!((r.scheduled_s - q.at.as_secs_f64()).abs() < 1e-9);
            // Never early; late only by scheduling noise (generous bound, not a speed goal).
            assert!(r.sent_s + 1e-3 >= r.scheduled_s, "sent before its time: {r:?}");
            assert!(r.sent_s - r.scheduled_s < 2.0, "send lag: {r:?}");
            let ttft = r.ttft_s.expect("streamed first token");
            assert!(ttft > 0.0 && ttft <= r.e2e_s);
            assert_eq!(r.output_tokens, 6, "usage.completion_tokens");
            assert_eq!(r.itl_s.len(), 5, "one gap per token after the first");
            assert!(r.prompt_tokens.is_some_and(|p| p >= 600));
        }
        // Every group's later questions hit its cached system prompt on the single worker.
        let cached: u64 = res.iter().filter_map(|r| r.cached_tokens).map(u64::from).sum();
        assert!(cached >= 9 * 500, "cached tokens reported: {cached}");
        let s = summarise("sim", &res, 20.0, Slo { ttft_s: 100.0, tpot_s: 100.0 });
        assert_eq!((s.ok, s.rejected, s.errors), (12, 0, 0));
        assert!(s.cached_token_ratio.is_some_and(|c| c > 0.3));
        assert!(s.latency.ttft_p50_s > 0.0 && s.latency.ttft_p99_s >= s.latency.ttft_p50_s);
        assert_eq!(s.goodput_rps, s.throughput_rps);
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_counts_and_cycles_with_a_duration() {
    let (url, stop) = sim(EngineSimConfig { instant: true, ..EngineSimConfig::default() }).await;
    let reqs = independent(5, Arrivals::Constant(1.0), 20, 1, 3);
    let mut c = cfg(&url, Mode::Closed, Api::Chat);
    c.max_concurrency = 2;
    let res = run(&c, &reqs, None).await.expect("client");
    assert_eq!(res.len(), 5, "closed loop without a duration sends the workload once");
    assert!(res.iter().all(|r| r.outcome == Outcome::Ok && r.output_tokens == 1));
    c.duration = Some(Duration::from_millis(300));
    let res = run(&c, &reqs, None).await.expect("client");
    assert!(res.len() > 5, "with a duration the workload cycles: {}", res.len());
    assert!(res.windows(2).all(|w| w[0].index < w[1].index));
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_rejections_are_counted_not_hidden() {
    // Every request fails with 500.
    let (url, stop) = sim(EngineSimConfig { error_rate: 1.0, ..EngineSimConfig::default() }).await;
    let reqs = independent(4, Arrivals::Constant(100.0), 10, 2, 0);
    let res = run(&cfg(&url, Mode::Open, Api::Chat), &reqs, None).await.expect("client");
    assert!(res.iter().all(|r| r.outcome == Outcome::Error("http 500".into())), "{res:?}");
    // Unknown model: 404.
    let mut c = cfg(&url, Mode::Open, Api::Completions);
    c.model = "nope".into();
    let res = run(&c, &reqs, None).await.expect("client");
    assert!(res.iter().all(|r| r.outcome == Outcome::Error("http 404".into())));
    stop.cancel();
    // Nobody listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let res = run(&cfg(&format!("http://127.0.0.1:{port}"), Mode::Open, Api::Chat), &reqs, None).await.expect("client");
    assert!(res.iter().all(|r| r.outcome == Outcome::Error("connect".into())), "{res:?}");
    // A router shedding load with 429 and 503.
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(|body: String| async move {
            if body.contains("\"user\":\"s\"") {
                axum::http::StatusCode::SERVICE_UNAVAILABLE
            } else {
                axum::http::StatusCode::TOO_MANY_REQUESTS
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(l, app).await });
    let mut reqs = reqs;
    reqs[0] = BenchRequest { session: Some("s".into()), ..reqs[0].clone() };
    let res = run(&cfg(&url, Mode::Open, Api::Chat), &reqs, None).await.expect("client");
    let s = summarise("shed", &res, 1.0, Slo { ttft_s: 1.0, tpot_s: 1.0 });
    assert_eq!((s.ok, s.rejected, s.errors), (0, 4, 0));
    assert_eq!(s.failures.get("rejected 503"), Some(&1));
    assert_eq!(s.failures.get("rejected 429"), Some(&3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_carry_each_answer_into_the_next_turn() {
    let (url, stop) = sim(EngineSimConfig { time_scale: 20.0, ..EngineSimConfig::default() }).await;
    let long = "Explain how a prefix cache lets a second turn skip prefill. ".repeat(20);
    let convs: Vec<Conversation> = (0..3)
        .map(|i| Conversation {
            at: Duration::from_millis(20 * i),
            system: Some(format!("You are assistant {i}. {long}").into()),
            turns: vec![format!("Question {i}?").into(), "And then?".into(), "Last one.".into()],
            max_tokens: 24,
        })
        .collect();
    let res = run_conversations(&cfg(&url, Mode::Open, Api::Chat), &convs, None).await.expect("client");
    assert_eq!(res.len(), 9, "three turns of three conversations");
    for (i, r) in res.iter().enumerate() {
        assert_eq!((r.index, &r.outcome), (i, &Outcome::Ok), "{r:?}");
        assert!(!r.answer.is_empty(), "the answer text is kept: {r:?}");
    }
    for c in res.chunks(3) {
        let p: Vec<u32> = c.iter().map(|r| r.prompt_tokens.expect("usage")).collect();
        // Each turn's prompt holds the previous prompt, its answer and the new question.
        assert!(p[1] > p[0] + 10 && p[2] > p[1] + 10, "prompts grow by the answers: {p:?}");
        // And the worker serves the previous turn's prompt from its cache.
        for k in 1..3 {
            let cached = c[k].cached_tokens.expect("cached tokens reported");
            assert!(cached + 32 >= p[k - 1], "turn {k} reused {cached} of the previous {} tokens", p[k - 1]);
        }
    }
    stop.cancel();
}
