//! engine-sim publishes KV events over ZeroMQ in vLLM's wire format: the blocks stored and
//! removed decode back, in both encodings, and missed batches can be replayed.

use bytes::Bytes;
use kvroute_core::hash::{HashAlgo, hash_text_blocks};
use kvroute_gateway::engine_sim::{self, EngineSimConfig, pseudo_tokens};
use kvroute_gateway::kv_events::{Encoding, KvEvent, REPLAY_END, decode, parse_frames};
use kvroute_sim::engine::Profile;
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port")
}

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

/// The router learns a worker's cache from its KV events alone: a prompt sent to the worker
/// directly (bypassing the router, before the router even started) is recovered through the
/// replay socket, the router hashes the events' token ids itself (the published hashes are
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
        policy: "prefill_cost".into(),
        worker_urls: workers.clone(),
        kv_events: sources,
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let router = format!("http://{}", listener.local_addr().expect("addr"));
    let rstop = stop.clone();
    let task = tokio::spawn(kvroute_gateway::serve(listener, gw, async move { rstop.cancelled().await }));
    for _ in 0..200 {
        if c.get(format!("{router}/health")).send().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await; // subscriptions propagate

    // New traffic on worker 1 (directly again) publishes a batch with a sequence above 0:
    // the router sees the gap and replays the missed batches from the worker.
    let mut recovered = false;
    for i in 0..50 {
        complete(workers[1].clone(), format!("unrelated prompt number {i} ").repeat(8)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        if metric(&c, &router, "kvroute_kv_event_replayed_total", &workers[1]).await > 0.0 {
            recovered = true;
            break;
        }
    }
    assert!(recovered, "the router never replayed worker 1's missed batches");
    assert!(metric(&c, &router, "kvroute_kv_event_gaps_total", &workers[1]).await >= 1.0);

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
    stop.cancel();
    let _ = task.await;
}
