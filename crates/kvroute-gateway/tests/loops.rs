//! Routing loops are cut: a router refuses its own listener as a worker (`/add_worker`, the
//! configuration at start), a request that already passed through a replica is answered 508
//! there without being dispatched, and two routers listing each other answer 508 after one
//! round instead of recursing. Every connection is to 127.0.0.1.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

fn chat(stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "stream": stream})
}

fn named(replica: &str, urls: &[&str]) -> GatewayConfig {
    GatewayConfig { replica_id: Some(replica.into()), ..common::config(urls, "round_robin") }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_refuses_its_own_listeners_as_workers() {
    let stop = CancellationToken::new();
    let admin_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut config = named("self", &[]);
    config.admin_listen = Some(format!("127.0.0.1:{admin_port}"));
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let port = r.rsplit(':').next().expect("port").to_string();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let c = common::client();
    common::eventually("the admin listener answers", async || c.get(format!("{admin}/workers")).send().await.is_ok())
        .await;
    for own in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}/"),
        format!("http://0.0.0.0:{port}"),
        format!("http://[::ffff:127.0.0.1]:{port}"),
        format!("http://127.0.0.1:{admin_port}"),
    ] {
        let resp = guard(c.post(format!("{admin}/add_worker?url={own}")).send()).await.expect("send");
        assert_eq!(resp.status(), 400, "{own}");
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        assert_eq!(v["error"]["param"], "url", "{v}");
        assert!(v["error"]["message"].as_str().expect("message").contains("own listener"), "{own}: {v}");
    }
    let v: serde_json::Value =
        guard(c.get(format!("{admin}/list_workers")).send()).await.expect("send").json().await.expect("json");
    assert_eq!(v["urls"], serde_json::json!([]), "nothing was added");

    // In the configuration, it stops the start, naming the key.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let me = format!("http://{}", listener.local_addr().expect("addr"));
    let e = guard(kvroute_gateway::serve(listener, named("self2", &[&me]), async {})).await.expect_err("refused");
    assert!(e.to_string().contains("worker_urls") && e.to_string().contains("own listener"), "{e}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_passed_here_before_is_answered_508_without_dispatch() {
    let stop = CancellationToken::new();
    let (w, sim) =
        engine_sim::spawn_local(EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() }, stop.clone())
            .await
            .expect("worker");
    let (r, _task) = common::start_router(named("loop-a", &[&w]), stop.clone()).await;
    let c = reqwest::Client::new();
    for (via, stream) in [("1.1 kvroute-loop-a", false), ("1.0 nginx, 1.1 kvroute-loop-a", true)] {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).header("via", via).json(&chat(stream)).send())
            .await
            .expect("send");
        assert_eq!(resp.status(), 508, "{via}");
        let v: serde_json::Value = guard(resp.json()).await.expect("a JSON error");
        assert!(v["error"]["message"].as_str().expect("message").contains("loop"), "{v}");
    }
    assert_eq!(sim.stats().finished, 0, "nothing was dispatched");
    // Another replica's entry is a hop like any other.
    let resp =
        guard(c.post(format!("{r}/v1/chat/completions")).header("via", "1.1 kvroute-loop-b").json(&chat(false)).send())
            .await
            .expect("send");
    assert_eq!(resp.status(), 200);
    common::eventually("the request without a loop was served", async || sim.stats().finished == 1).await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_listing_each_other_are_cut_after_one_round() {
    let stop = CancellationToken::new();
    // A starts with no worker; B's worker is A; then A is given B (not its own listener).
    let (a, _ta) = common::start_router(named("a", &[]), stop.clone()).await;
    let (b, _tb) = common::start_router(named("b", &[&a]), stop.clone()).await;
    let c = common::client();
    let resp = guard(c.post(format!("{a}/add_worker?url={b}")).send()).await.expect("send");
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap_or_default());
    for stream in [false, true, false] {
        // Without the guard this request went A → B → A → B … until admission ran out.
        let resp = guard(c.post(format!("{a}/v1/chat/completions")).json(&chat(stream)).send()).await.expect("send");
        assert_eq!(resp.status(), 508, "stream: {stream}");
        let v: serde_json::Value = guard(resp.json()).await.expect("a JSON error");
        let m = v["error"]["message"].as_str().expect("message");
        assert!(m.contains("kvroute-a"), "A saw its own entry when the request came back: {v}");
    }
    // Each router answered its requests; neither holds any in flight (nothing recursed on).
    for r in [&a, &b] {
        common::eventually("no request in flight", async || {
            let v: serde_json::Value = c.get(format!("{r}/workers")).send().await.expect("w").json().await.expect("j");
            v["workers"].as_array().is_some_and(|ws| ws.iter().all(|w| w["in_flight"] == 0))
        })
        .await;
    }
    stop.cancel();
}
