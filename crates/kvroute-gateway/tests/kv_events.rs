//! engine-sim publishes KV events over ZeroMQ in vLLM's wire format: the blocks stored and
//! removed decode back, in both encodings, and missed batches can be replayed.

use bytes::Bytes;
use kvroute_core::hash::{HashAlgo, hash_text_blocks};
use kvroute_engine_sim::Profile;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig, pseudo_tokens};
use kvroute_protocol::kv_events::{Encoding, KvEvent, REPLAY_END, decode, parse_frames};
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend};

mod common;
use common::start_router;

use common::free_port;

async fn recv_batch(sub: &mut zeromq::SubSocket) -> (u64, Vec<KvEvent>) {
    let msg = tokio::time::timeout(Duration::from_secs(30), sub.recv()).await.expect("hang guard").expect("recv");
    let (topic, seq, payload) = parse_frames(&msg.into_vec()).expect("3 frames");
    assert_eq!(topic, "kv-events");
    let (batch, stats) = decode(&payload).expect("decodes");
    assert_eq!(stats.unknown_events + stats.unknown_fields, 0);
    (seq, batch.events)
}

async fn run(enc: Encoding) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (pport, rport) = (free_port(), free_port());
    let mut profile = Profile::named("h100-llama3-8b").expect("profile");
    profile.kv_tokens = 16 * 16; // 16 blocks: the second prompt (11 blocks) evicts part of the first
    let cfg = EngineSimConfig {
        profile,
        time_scale: 50.0,
        kv_events: Some(format!("tcp://127.0.0.1:{pport}")),
        kv_replay: Some(format!("tcp://127.0.0.1:{rport}")),
        kv_encoding: enc,
        ..EngineSimConfig::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let (url, _sim) = engine_sim::spawn_local(cfg, stop.clone()).await.expect("start a simulated worker");
    tokio::time::sleep(Duration::from_millis(200)).await; // the publisher binds
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{pport}")).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    tokio::time::sleep(Duration::from_millis(300)).await; // PUB/SUB slow joiner

    let c = reqwest::Client::new();
    let first = "0123456789abcdef".repeat(40); // 640 chars = 160 tokens = 10 blocks
    let second = "ZYXWVUTSRQPONMLK".repeat(40);
    for p in [&first, &second] {
        let r = c
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({"model": "sim-llama-3-8b", "prompt": p, "max_tokens": 1}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
    }
    let mut expected = Vec::new();
    hash_text_blocks(&first, 16, usize::MAX, HashAlgo::Xxh3, &mut expected);
    let want: Vec<u64> = expected.iter().map(|h| h.0).collect();

    // Live: batches arrive on the SUB socket with consecutive sequence numbers. (PUB/SUB
    // may drop the first ones while the subscription propagates; replay recovers them.)
    let mut live = Vec::new();
    loop {
        let (seq, events) = recv_batch(&mut sub).await;
        live.push(seq);
        if events.iter().any(|e| matches!(e, KvEvent::BlockRemoved { .. })) {
            break;
        }
    }
    assert!(live.windows(2).all(|w| w[1] == w[0] + 1), "{live:?}");

    // Replay everything from seq 0 over DEALER → ROUTER.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&format!("tcp://127.0.0.1:{rport}")).await.expect("connect replay");
    let req =
        zeromq::ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())]).expect("msg");
    dealer.send(req).await.expect("send replay request");
    let mut replayed = Vec::new();
    let mut stored = Vec::new();
    let mut removed = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), dealer.recv()).await.expect("hang guard").expect("recv");
        let f = m.into_vec();
        let seq = f.iter().rev().nth(1).expect("seq frame").clone();
        if seq.as_ref() == REPLAY_END {
            break;
        }
        replayed.push(u64::from_be_bytes(seq.as_ref().try_into().expect("8 bytes")));
        let (batch, _) = decode(f.last().expect("payload")).expect("replayed batch decodes");
        for e in batch.events {
            match e {
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, .. } => {
                    assert_eq!(block_size, 16);
                    assert_eq!(medium.as_deref(), Some("GPU"));
                    stored.push((block_hashes, parent_block_hash, token_ids));
                }
                KvEvent::BlockRemoved { block_hashes, .. } => removed.extend(block_hashes),
                KvEvent::AllBlocksCleared => {}
            }
        }
    }
    // Sequence numbers start at 0 and increase by one; the live ones are among them.
    assert_eq!(replayed, (0..replayed.len() as u64).collect::<Vec<_>>());
    assert!(live.iter().all(|s| replayed.contains(s)));
    // The first prompt's 10 blocks were stored as one chain from the root, with its tokens.
    let (hashes, parent, tokens) = &stored[0];
    assert_eq!(hashes, &want);
    assert_eq!(*parent, None);
    assert_eq!(tokens, &pseudo_tokens(&first)[..160]);
    // The second prompt evicted blocks of the first, tail first.
    assert!(!removed.is_empty());
    assert!(removed.iter().all(|h| want.contains(h)), "{removed:?}");
    assert!(removed.contains(&want[9]));
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_round_trip_map_encoding() {
    run(Encoding::Map).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_round_trip_legacy_encoding() {
    run(Encoding::Legacy).await;
}

async fn metric(client: &reqwest::Client, router: &str, name: &str, worker: &str) -> f64 {
    let text = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("worker=\"{worker}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The sample of `name` for `worker`, or `None` while `/metrics` has none yet.
async fn gauge(client: &reqwest::Client, router: &str, name: &str, worker: &str) -> Option<f64> {
    let text = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("worker=\"{worker}\"")))
        .find_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

/// A PUB socket on a free loopback port standing in for an engine's publisher, and its endpoint.
async fn bind_publisher() -> (zeromq::PubSocket, String) {
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(&endpoint).await.expect("bind pub");
    (publisher, endpoint)
}

/// Publishes one batch of `events` with sequence `seq` in `enc`, as engines do.
async fn publish(publisher: &mut zeromq::PubSocket, seq: u64, events: Vec<KvEvent>, enc: Encoding) {
    use kvroute_protocol::kv_events::{EventBatch, encode, frames};
    let batch = EventBatch { ts: 0.0, events, dp_rank: None };
    let msg = zeromq::ZmqMessage::try_from(frames("", seq, encode(&batch, enc).into())).expect("msg");
    publisher.send(msg).await.expect("publish");
}

/// The router learns a worker's cache from its KV events alone: a prompt sent to the worker
/// directly (bypassing the router, before the router even started) is recovered through the
/// replay socket as soon as the router connects (no later event needed), the router hashes the events' token ids itself (the published hashes are
/// salted, as vLLM's are per process), and routes an extension of that prompt to the
/// worker with `prefix=precise` and the engine-reported cached tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_on_precise_prefix_state_recovered_from_engine_events() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut workers = Vec::new();
    let mut sources = Vec::new();
    for salt in [0x1111_u64, 0x2222] {
        let (pport, rport) = (free_port(), free_port());
        let cfg = EngineSimConfig {
            time_scale: 50.0,
            kv_events: Some(format!("tcp://127.0.0.1:{pport}")),
            kv_replay: Some(format!("tcp://127.0.0.1:{rport}")),
            kv_hash_salt: salt,
            ..EngineSimConfig::default()
        };
        let (url, _) = engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker");
        sources.push(kvroute_gateway::config::KvEventSource {
            worker: url.clone(),
            endpoint: format!("tcp://127.0.0.1:{pport}"),
            replay: Some(format!("tcp://127.0.0.1:{rport}")),
        });
        workers.push(url);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = reqwest::Client::new();
    let complete = |base: String, prompt: String| {
        let c = c.clone();
        async move {
            let r = c
                .post(format!("{base}/v1/completions"))
                .json(&serde_json::json!({"model": "sim-llama-3-8b", "prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 200);
            r
        }
    };
    let doc: String = (0..120).map(|i| format!("fact {i:03} of the shared document. ")).collect();
    // Worker 1 serves the document directly: the router never sees this request.
    complete(workers[1].clone(), doc.clone()).await;

    let gw = kvroute_gateway::GatewayConfig {
        port: 0,
        expose_decision_headers: true,
        policy: "prefill_cost".into(),
        worker_urls: workers.clone(),
        kv_events: sources,
        ..Default::default()
    };
    let (router, task) = start_router(gw, stop.clone()).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // subscriptions propagate

    // No new traffic: on connecting, the router asks worker 1's replay socket for what it
    // published before the router started.
    let mut recovered = false;
    for _ in 0..100 {
        if metric(&c, &router, "kvroute_kv_event_replayed_total", &workers[1]).await > 0.0 {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(recovered, "the router never replayed worker 1's earlier batches");

    // An extension of the document through the router goes to worker 1, precisely.
    let r = complete(router.clone(), format!("{doc}And one more question?")).await;
    let header = |r: &reqwest::Response, h: &str| {
        r.headers().get(h).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string()
    };
    let decision = header(&r, "x-kvroute-decision");
    assert_eq!(header(&r, "x-kvroute-worker"), workers[1], "{decision}");
    assert!(decision.contains("prefix=precise"), "{decision}");
    // matched=N/M tokens: the document's full 16-token blocks (engine-sim: 4 bytes a token).
    let want = (doc.len() as u64 / 4) / 16 * 16;
    let matched: u64 = decision
        .split("matched=")
        .nth(1)
        .and_then(|m| m.split('/').next())
        .and_then(|n| n.parse().ok())
        .expect("matched in the header");
    assert_eq!(matched, want, "{decision}");
    let body: serde_json::Value = r.json().await.expect("json");
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], want, "the engine agrees: {body}");
    // The startup parity check passed on both workers: the router's tokens of a probe chat
    // request hash to exactly the blocks the engine stored.
    for w in &workers {
        let mut v = None;
        for _ in 0..300 {
            v = gauge(&c, &router, "kvroute_kv_parity", w).await;
            if v.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(v, Some(1.0), "parity of {w}");
    }
    stop.cancel();
    let _ = task.await;
}

/// A publisher restart (sequence going back) clears what the router knew of that worker,
/// and a malformed message is counted, not fatal. The test is the engine here: it publishes
/// batches itself on a PUB socket for a worker whose HTTP side is engine-sim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restart_clears_the_worker_and_garbage_is_counted() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop = tokio_util::sync::CancellationToken::new();
    let (w0, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker 0");
    let (w1, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker 1");
    let (mut publisher, endpoint) = bind_publisher().await;
    // 512-token approximate blocks: worker 0 (no events) may serve the 256-token document
    // while the router waits for worker 1's events, and its approximate index must not match
    // the document afterwards — only worker 1's precise state can.
    let mut knobs = toml::Table::new();
    knobs.insert("block_tokens".into(), toml::Value::Integer(512));
    let gw = kvroute_gateway::GatewayConfig {
        port: 0,
        expose_decision_headers: true,
        policy: "prefill_cost".into(),
        policy_knobs: knobs,
        worker_urls: vec![w0.clone(), w1.clone()],
        kv_events: vec![kvroute_gateway::config::KvEventSource { worker: w1.clone(), endpoint, replay: None }],
        kv_parity_check: false,
        ..Default::default()
    };
    let (router, task) = start_router(gw, stop.clone()).await;
    let c = reqwest::Client::new();
    let mut seq = 0u64;
    // Empty batches until the subscription is live.
    let mut live = false;
    for _ in 0..100 {
        publish(&mut publisher, seq, Vec::new(), Encoding::Legacy).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if metric(&c, &router, "kvroute_kv_event_batches_total", &w1).await >= 1.0 {
            live = true;
            break;
        }
    }
    assert!(live, "the router never received a batch");
    let doc = "abcdefghijklmnop".repeat(64); // 1,024 chars = 256 tokens = 16 blocks
    let tokens = pseudo_tokens(&doc);
    let stored = KvEvent::BlockStored {
        block_hashes: (0..16).map(|i| 0xdead_0000 + i).collect(),
        parent_block_hash: None,
        token_ids: tokens,
        block_size: 16,
        medium: Some("GPU".into()),
        group_idx: 0,
    };
    publish(&mut publisher, seq, vec![stored], Encoding::Legacy).await;
    // Garbage: counted as an error, the subscriber carries on.
    let junk = zeromq::ZmqMessage::try_from(vec![Bytes::from_static(b"t"), Bytes::from_static(b"short")]).expect("msg");
    publisher.send(junk).await.expect("publish junk");
    let ask = async || {
        let r = c
            .post(format!("{router}/v1/completions"))
            .json(&serde_json::json!({"model": "sim-llama-3-8b", "prompt": format!("{doc} more"), "max_tokens": 1}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
        let worker = r.headers().get("x-kvroute-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        let d = r.headers().get("x-kvroute-decision").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        (worker, d)
    };
    let mut seen = false;
    for _ in 0..50 {
        let (worker, d) = ask().await;
        if d.contains("matched=256/") {
            assert_eq!(worker, w1, "{d}");
            assert!(d.contains("prefix=precise"), "{d}");
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen, "the stored blocks never reached the router");
    assert!(metric(&c, &router, "kvroute_kv_event_errors_total", &w1).await >= 1.0);

    // The publisher restarts: its sequence starts again at 0.
    publish(&mut publisher, 0, Vec::new(), Encoding::Legacy).await;
    let mut cleared = false;
    for _ in 0..100 {
        if metric(&c, &router, "kvroute_kv_event_restarts_total", &w1).await >= 1.0 {
            cleared = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(cleared, "the restart was not noticed");
    let (worker, d) = ask().await;
    assert!(d.contains("matched=0/"), "worker 1's blocks must be gone after the restart: {d}");
    if worker == w1 {
        assert!(d.contains("prefix=precise"), "{d}");
    }
    stop.cancel();
    let _ = task.await;
}

/// Predict-on-route: engines publish `BlockStored` only when a prefill ends, so a sibling
/// that arrives before it must still follow the first request. The test is both engines'
/// publisher here and never publishes the first request's blocks: with the window the
/// sibling goes to the first request's worker with its prefix counted (`prefix=precise`);
/// with the window off, it finds nothing cached anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predict_on_route_sends_siblings_after_the_first_request_before_block_stored() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    for window in [600.0, 0.0] {
        let stop = tokio_util::sync::CancellationToken::new();
        let mut workers = Vec::new();
        let mut publishers = Vec::new();
        let mut sources = Vec::new();
        for _ in 0..2 {
            let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
            let (publisher, endpoint) = bind_publisher().await;
            sources.push(kvroute_gateway::config::KvEventSource { worker: w.clone(), endpoint, replay: None });
            workers.push(w);
            publishers.push(publisher);
        }
        let gw = kvroute_gateway::GatewayConfig {
            port: 0,
            expose_decision_headers: true,
            policy: "prefill_cost".into(),
            worker_urls: workers.clone(),
            kv_events: sources,
            kv_predict_window_secs: window,
            kv_parity_check: false,
            ..Default::default()
        };
        let (router, task) = start_router(gw, stop.clone()).await;
        let c = reqwest::Client::new();
        // Each engine announces one unrelated block (the router learns its block size),
        // repeated until the subscription is live.
        for (i, publisher) in publishers.iter_mut().enumerate() {
            let mut live = false;
            for seq in 0..100u64 {
                let ev = KvEvent::BlockStored {
                    block_hashes: vec![seq],
                    parent_block_hash: None,
                    token_ids: (0..16).map(|t| 90_000 + t).collect(),
                    block_size: 16,
                    medium: None,
                    group_idx: 0,
                };
                publish(publisher, seq, vec![ev], Encoding::Map).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                if metric(&c, &router, "kvroute_kv_event_batches_total", &workers[i]).await >= 1.0 {
                    live = true;
                    break;
                }
            }
            assert!(live, "worker {i}'s events never reached the router");
        }
        let doc: String = (0..64).map(|i| format!("shared system prompt line {i:02}. ")).collect();
        let send = async |prompt: String| {
            let r = c
                .post(format!("{router}/v1/completions"))
                .json(&serde_json::json!({"model": "sim-llama-3-8b", "prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 200);
            let h = |n: &str| r.headers().get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
            (h("x-kvroute-worker"), h("x-kvroute-decision"))
        };
        let (first, d1) = send(format!("{doc}First question?")).await;
        assert!(d1.contains("matched=0/") && d1.contains("prefix=precise"), "{d1}");
        let (second, d2) = send(format!("{doc}Second question?")).await;
        let want = (doc.len() as u64 / 4) / 16 * 16; // the document's full 16-token blocks
        if window > 0.0 {
            assert_eq!(second, first, "{d2}");
            assert!(d2.contains(&format!("matched={want}/")) && d2.contains("prefix=precise"), "{d2}");
        } else {
            assert!(d2.contains("matched=0/") && d2.contains("prefix=precise"), "{d2}");
        }
        stop.cancel();
        let _ = task.await;
    }
}

/// The parity check catches a router whose tokens do not hash to what the engine stores:
/// here the engine (the test's publisher) stores blocks of other tokens than the ones its
/// `/tokenize` returns, as an engine with another chat template or tokenizer would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parity_check_reports_a_tokenizer_mismatch() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop = tokio_util::sync::CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let (mut publisher, endpoint) = bind_publisher().await;
    let gw = kvroute_gateway::GatewayConfig {
        port: 0,
        expose_decision_headers: true,
        policy: "prefill_cost".into(),
        worker_urls: vec![w.clone()],
        kv_events: vec![kvroute_gateway::config::KvEventSource { worker: w.clone(), endpoint, replay: None }],
        ..Default::default()
    };
    let (router, task) = start_router(gw, stop.clone()).await;
    let c = reqwest::Client::new();
    let mut parity = None;
    for seq in 0..300u64 {
        // Blocks of shifted token ids: the "engine" tokenizes differently from its /tokenize.
        let ev = KvEvent::BlockStored {
            block_hashes: vec![seq + 1],
            parent_block_hash: None,
            token_ids: (0..16).map(|t| 50_000 + t + seq as u32).collect(),
            block_size: 16,
            medium: None,
            group_idx: 0,
        };
        publish(&mut publisher, seq, vec![ev], Encoding::Map).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        parity = gauge(&c, &router, "kvroute_kv_parity", &w).await;
        if parity.is_some() {
            break;
        }
    }
    assert_eq!(parity, Some(0.0), "a mismatch must set kvroute_kv_parity to 0");
    stop.cancel();
    let _ = task.await;
}
