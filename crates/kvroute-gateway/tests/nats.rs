//! Cluster sync on a real NATS server (Debian `nats-server`, given by `KVROUTE_NATS_BIN`):
//! replicas share prefix state and in-flight load, a starting replica takes a peer's
//! snapshot, three synced replicas hit the engines' caches like one router, and NATS or a
//! replica dying fails no request. Ignored by default; `scripts/test.sh` runs them when
//! `KVROUTE_NATS_BIN` is set, and CI requires them.

use futures_util::StreamExt;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::{eventually, guard};
#[path = "common/nats.rs"]
mod nats;
use nats::{Nats, fleet_hit_ratio, metric};

const MODEL: &str = "sim-llama-3-8b";

use common::free_port;

async fn workers(n: usize, time_scale: f64, stop: &CancellationToken) -> Vec<String> {
    let mut urls = Vec::new();
    for _ in 0..n {
        let cfg = EngineSimConfig { time_scale, ..EngineSimConfig::default() };
        urls.push(engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker").0);
    }
    urls
}

fn synced(nats: Option<&str>, workers: &[String]) -> GatewayConfig {
    synced_with(nats, workers, "cache_aware")
}

fn synced_with(nats: Option<&str>, workers: &[String], policy: &str) -> GatewayConfig {
    let urls: Vec<&str> = workers.iter().map(String::as_str).collect();
    GatewayConfig {
        nats: nats.map(str::to_string),
        cluster: "test".into(),
        sync_snapshot_timeout_secs: 2.0,
        ..common::config(&urls, policy)
    }
}

/// A document of about `chars` characters, distinct from its first word on.
fn document(d: usize, chars: usize) -> String {
    let mut x = (d as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut s = format!("Document {d}.");
    while s.len() < chars {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(&format!(" w{}", x % 5000));
    }
    s
}

fn ask(doc: &str, question: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": MODEL, "max_tokens": max_tokens, "stream": stream, "messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": question}]})
}

/// Waits (bounded) until `router`'s `/readiness` answers 200: healthy workers and, with
/// NATS, its start-up snapshot in (so its subscription to the cluster's events is active).
async fn ready(c: &reqwest::Client, router: &str) {
    eventually("replica ready", async || {
        c.get(format!("{router}/readiness")).send().await.is_ok_and(|r| r.status() == 200)
    })
    .await;
}

async fn dry_run(c: &reqwest::Client, router: &str, body: &serde_json::Value) -> serde_json::Value {
    guard(c.post(format!("{router}/debug/route")).json(body).send()).await.expect("dry run").json().await.expect("json")
}

async fn remote_in_flight(c: &reqwest::Client, router: &str, worker: &str) -> u64 {
    let v: serde_json::Value =
        guard(c.get(format!("{router}/workers")).send()).await.expect("workers").json().await.expect("json");
    v["workers"].as_array().expect("rows").iter().find(|w| w["url"] == worker).expect("worker row")["remote_in_flight"]
        .as_u64()
        .expect("remote_in_flight")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NATS (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn replicas_share_prefix_state_and_load_and_a_new_replica_starts_from_a_snapshot() {
    let nats = Nats::start(free_port()).await;
    let stop = CancellationToken::new();
    let ws = workers(4, 1.0, &stop).await;
    let (a, _) = common::start_router(synced(Some(&nats.url), &ws), stop.clone()).await;
    let (b, _) = common::start_router(synced(Some(&nats.url), &ws), stop.clone()).await;
    let c = common::client();
    ready(&c, &a).await;
    ready(&c, &b).await;

    // Prefix state: a document routed through A is matched by B on the same worker.
    let doc = document(0, 4000);
    let r = guard(c.post(format!("{a}/v1/chat/completions")).json(&ask(&doc, "first question?", 2, false)).send())
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let on = r.headers()["x-kvroute-worker"].to_str().expect("header").to_string();
    let next = ask(&doc, "second question?", 2, false);
    eventually("B matches A's document on A's worker", async || {
        let v = dry_run(&c, &b, &next).await;
        v["worker"] == on.as_str() && v["matched"].as_u64().unwrap_or(0) > 3000
    })
    .await;
    assert_eq!(metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await, 1.0, "B applied A's one event");

    // The next question on the document goes out as the document's chunk chain (which B
    // learned from the first event) and the new tail: B rebuilds the whole prompt, and
    // matches it as far as A does.
    let r = guard(c.post(format!("{a}/v1/chat/completions")).json(&next).send()).await.expect("send");
    assert_eq!(r.status(), 200);
    eventually("B applied A's second event", async || {
        metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await == 2.0
    })
    .await;
    assert_eq!(metric(&c, &b, "kvroute_sync_events_total{outcome=\"unresolved\"}").await, 0.0);
    let (on_a, on_b) = (dry_run(&c, &a, &next).await, dry_run(&c, &b, &next).await);
    assert_eq!((&on_b["worker"], &on_b["matched"]), (&on_a["worker"], &on_a["matched"]), "A {on_a} B {on_b}");

    // The same request again through A, to the same worker: the cluster applied it in full
    // a moment ago, so A sends no event for it (its load goes in A's totals) and B commits
    // nothing new.
    let r = guard(c.post(format!("{a}/v1/chat/completions")).json(&next).send()).await.expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-worker"].to_str().expect("header"), on_a["worker"].as_str().expect("worker"));
    eventually("A left it to its load totals", async || {
        metric(&c, &a, "kvroute_sync_events_total{outcome=\"repeat_skipped\"}").await == 1.0
    })
    .await;
    assert_eq!(metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await, 2.0, "no second commit");
    assert_eq!(metric(&c, &b, "kvroute_sync_events_total{outcome=\"repeat\"}").await, 0.0, "nothing to apply");
    let on_b = dry_run(&c, &b, &next).await;
    assert_eq!((&on_b["worker"], &on_b["matched"]), (&on_a["worker"], &on_a["matched"]), "A {on_a} B {on_b}");

    // Load: a stream open through A counts on its worker in B's view until it ends.
    let long = guard(
        c.post(format!("{a}/v1/chat/completions"))
            .json(&ask(&document(1, 400), "write a long answer", 4000, true))
            .send(),
    )
    .await
    .expect("stream");
    assert_eq!(long.status(), 200);
    let busy = long.headers()["x-kvroute-worker"].to_str().expect("header").to_string();
    let mut body = long.bytes_stream();
    let first = guard(body.next()).await.expect("a first chunk").expect("bytes");
    assert!(!first.is_empty());
    eventually("B sees A's open stream on its worker", async || remote_in_flight(&c, &b, &busy).await == 1).await;
    assert_eq!(remote_in_flight(&c, &a, &busy).await, 0, "A counts its own stream once, as its own");
    drop(body);
    eventually("the stream's load leaves B's view when A's client goes away", async || {
        remote_in_flight(&c, &b, &busy).await == 0
    })
    .await;

    // A replica starting later takes a peer's snapshot: ready only once it has it, and its
    // first decision already matches the document.
    let (n, _) = common::start_router(synced(Some(&nats.url), &ws), stop.clone()).await;
    ready(&c, &n).await;
    let v = dry_run(&c, &n, &next).await;
    assert_eq!(v["worker"], on.as_str(), "the new replica routes with the cluster's prefix state: {v}");
    assert!(v["matched"].as_u64().unwrap_or(0) > 3000, "{v}");
    assert!(metric(&c, &n, "kvroute_sync_events_total{outcome=\"snapshot\"}").await >= 1.0);
    stop.cancel();
}

/// Sends `docs` × `per_doc` questions, each document's questions spread over the rounds,
/// to `routers` in turn (a client-side round robin), 3 at a time, `passes` times over;
/// returns the failures.
async fn shared_prefix_workload(routers: &[String], docs: usize, per_doc: usize, passes: usize) -> usize {
    let c = common::client();
    let texts: Vec<String> = (0..docs).map(|d| document(100 + d, 3000)).collect();
    let mut order = Vec::new();
    for _ in 0..passes {
        for round in 0..per_doc {
            for d in 0..docs {
                order.push((d, round));
            }
        }
    }
    let sends = order.into_iter().enumerate().map(|(i, (d, round))| {
        let router = routers[i % routers.len()].clone();
        let body = ask(&texts[d], &format!("question {round} about document {d}?"), 2, false);
        let c = c.clone();
        async move {
            match guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await {
                Ok(r) if r.status() == 200 => 0,
                Ok(r) => {
                    eprintln!("{} {}", r.status(), r.text().await.unwrap_or_default());
                    1
                }
                Err(e) => {
                    eprintln!("{e}");
                    1
                }
            }
        }
    });
    futures_util::stream::iter(sends).buffer_unordered(3).collect::<Vec<usize>>().await.iter().sum()
}

/// One run of the workload: `replicas` routers running `policy` (synced over `nats` or
/// not) in front of 4 fresh engines; the engines' hit ratio.
async fn hit_ratio(replicas: usize, nats: Option<&str>, policy: &str) -> f64 {
    hit_ratio_of(replicas, nats, policy, |_| {}, 1).await.0
}

/// [`hit_ratio`] with the routers' configuration changed by `tweak` and the workload sent
/// `passes` times over; also the requests the routers did not send (`outcome="repeat_skipped"`:
/// repeats, which the totals carry).
async fn hit_ratio_of(
    replicas: usize,
    nats: Option<&str>,
    policy: &str,
    tweak: impl Fn(&mut GatewayConfig),
    passes: usize,
) -> (f64, f64) {
    let stop = CancellationToken::new();
    let ws = workers(4, 50.0, &stop).await;
    let mut routers = Vec::new();
    for _ in 0..replicas {
        let mut cfg = synced_with(nats, &ws, policy);
        tweak(&mut cfg);
        routers.push(common::start_router(cfg, stop.clone()).await.0);
    }
    let c = common::client();
    for r in &routers {
        ready(&c, r).await;
    }
    let failed = shared_prefix_workload(&routers, 16, 4, passes).await;
    assert_eq!(failed, 0, "failed requests");
    let ratio = fleet_hit_ratio(&ws).await;
    let mut repeats = 0.0;
    for r in &routers {
        repeats += metric(&c, r, "kvroute_sync_events_total{outcome=\"repeat_skipped\"}").await;
    }
    stop.cancel();
    (ratio, repeats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NATS (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn three_synced_replicas_hit_the_cache_like_one_router() {
    let nats = Nats::start(free_port()).await;
    // cache_aware's events carry the prompt (its tree indexes text); prefill_cost's carry
    // only block hashes.
    for policy in ["cache_aware", "prefill_cost"] {
        let one = hit_ratio(1, None, policy).await;
        let three_synced = hit_ratio(3, Some(&nats.url), policy).await;
        let three_alone = hit_ratio(3, None, policy).await;
        eprintln!(
            "{policy}: fleet prefix-cache hit ratio: one router {one:.3}, 3 synced {three_synced:.3}, 3 alone {three_alone:.3}"
        );
        assert!(
            (one - three_synced).abs() <= 0.05,
            "{policy}: 3 synced replicas {three_synced:.3} against one router {one:.3}"
        );
        assert!(
            three_synced >= 1.5 * three_alone,
            "{policy}: 3 synced {three_synced:.3} against 3 without sync {three_alone:.3}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NATS (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn repeats_left_to_the_load_totals_keep_the_cluster_s_hit_ratio() {
    let nats = Nats::start(free_port()).await;
    // The workload twice over: in the second pass every question goes to another replica
    // than the first time (64 requests a pass over 3 replicas), which applied the first
    // in full and so sends no event for it: its load goes in that replica's totals.
    for policy in ["cache_aware", "prefill_cost"] {
        let (full, none) = hit_ratio_of(3, Some(&nats.url), policy, |c| c.sync_refresh_secs = 0, 2).await;
        let (repeated, repeats) = hit_ratio_of(3, Some(&nats.url), policy, |_| {}, 2).await;
        eprintln!(
            "{policy}: 3 synced replicas, every event in full {full:.3}, repeats left to the load totals {repeated:.3} ({repeats} not sent)"
        );
        assert_eq!(none, 0.0, "{policy}: sync_refresh_secs = 0 sends no repeat");
        assert!(repeats >= 32.0, "{policy}: {repeats} requests not sent of 128 asked twice");
        assert!((full - repeated).abs() <= 0.05, "{policy}: {repeated:.3} with repeats against {full:.3}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NATS (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn nats_or_a_replica_dying_fails_no_request() {
    let port = free_port();
    let nats = Nats::start(port).await;
    let stop = CancellationToken::new();
    let ws = workers(2, 50.0, &stop).await;
    let stop_a = CancellationToken::new();
    let (a, _) = common::start_router(synced(Some(&nats.url), &ws), stop_a.clone()).await;
    let (b, _) = common::start_router(synced(Some(&nats.url), &ws), stop.clone()).await;
    let c = common::client();
    ready(&c, &a).await;
    ready(&c, &b).await;
    let send = async |router: &str, i: usize| -> bool {
        let body = ask(&document(i % 5, 800), &format!("q{i}"), 2, false);
        let r = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await;
        match r {
            Ok(r) if r.status() == 200 => true,
            Ok(r) => {
                eprintln!("request {i} via {router}: {} {}", r.status(), r.text().await.unwrap_or_default());
                false
            }
            Err(e) => {
                eprintln!("request {i} via {router}: {e}");
                false
            }
        }
    };
    let mut failed = 0;
    let mut i = 0;
    let mut batch = async |routers: &[&str], n: usize| {
        for _ in 0..n {
            if !send(routers[i % routers.len()], i).await {
                failed += 1;
            }
            i += 1;
        }
    };
    batch(&[&a, &b], 20).await;
    eventually("B applies A's events", async || {
        metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await >= 5.0
    })
    .await;

    // NATS killed mid-run: both route on local state.
    drop(nats);
    eventually("both replicas notice NATS is down", async || {
        metric(&c, &a, "kvroute_nats_connected").await == 0.0 && metric(&c, &b, "kvroute_nats_connected").await == 0.0
    })
    .await;
    batch(&[&a, &b], 20).await;

    // NATS back on the same port: both reconnect and events flow again.
    let _nats = Nats::start(port).await;
    eventually("both replicas reconnect", async || {
        metric(&c, &a, "kvroute_nats_connected").await == 1.0 && metric(&c, &b, "kvroute_nats_connected").await == 1.0
    })
    .await;
    let before = metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await;
    batch(&[&a, &b], 20).await;
    eventually("B applies A's events after the reconnect", async || {
        metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await > before
    })
    .await;

    // A replica stopped: the other goes on, and nothing of A's stays in its view. (SIGKILL
    // of a replica process with a stream in flight: tests/cluster_cli.rs in the kvroute
    // crate.)
    stop_a.cancel();
    batch(&[&b], 20).await;
    eventually("B releases what A had in flight", async || {
        metric(&c, &b, "kvroute_sync_remote_in_flight").await == 0.0
    })
    .await;
    // A stopped cleanly: its goodbye took it out of B's view, not 10 s of silence.
    eventually("B hears A's goodbye", async || metric(&c, &b, "kvroute_sync_peers").await == 0.0).await;
    assert_eq!(metric(&c, &b, "kvroute_sync_peers_left_total{outcome=\"goodbye\"}").await, 1.0);
    assert_eq!(metric(&c, &b, "kvroute_sync_peers_left_total{outcome=\"silent\"}").await, 0.0);
    assert_eq!(failed, 0, "requests failed");
    stop.cancel();
}

/// A disaggregated fleet behind two synced replicas: a split request through A teaches B's
/// prefill pool its prefix, so B sends the next request sharing it to the same prefill
/// worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nats-server (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn split_requests_teach_the_other_replicas_prefill_pool() {
    use kvroute_core::types::Role;
    use kvroute_gateway::pd::{PdConfig, PrefillWorker};
    let nats = Nats::start(free_port()).await;
    let stop = CancellationToken::new();
    let mut pd = PdConfig { enabled: true, colocate_below_tokens: 64, ..PdConfig::default() };
    for role in [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode] {
        let cfg = EngineSimConfig {
            time_scale: 50.0,
            role,
            bootstrap_port: (role == Role::Prefill).then_some(0),
            ..EngineSimConfig::default()
        };
        let (url, sim) = engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker");
        match role {
            Role::Prefill => pd.prefill.push(PrefillWorker { url, bootstrap_port: sim.bootstrap_port() }),
            _ => pd.decode.push(url),
        }
    }
    let replica = || GatewayConfig { pd: pd.clone(), ..synced(Some(&nats.url), &[]) };
    let (a, _) = common::start_router(replica(), stop.clone()).await;
    let (b, _) = common::start_router(replica(), stop.clone()).await;
    let c = common::client();
    ready(&c, &a).await;
    ready(&c, &b).await;
    let doc = document(2, 4000);
    let r = guard(c.post(format!("{a}/v1/chat/completions")).json(&ask(&doc, "first question?", 2, false)).send())
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let decision = r.headers()["x-kvroute-decision"].to_str().expect("header").to_string();
    let prefill = decision
        .strip_prefix("pd=prefill:")
        .and_then(|d| d.split(',').next())
        .unwrap_or_else(|| panic!("split: {decision}"))
        .to_string();
    let next = ask(&doc, "second question?", 2, false);
    eventually("B's prefill pool matches A's document on A's prefill worker", async || {
        let v = dry_run(&c, &b, &next).await;
        v["placement"] == "split"
            && v["prefill"]["worker"] == prefill.as_str()
            && v["prefill"]["matched"].as_u64().unwrap_or(0) > 3000
    })
    .await;
    stop.cancel();
}

/// Two routers started with the same `replica_id` (a pod template that sets it) do not sync
/// with each other: each counts the other's batches as `duplicate_replica_id` (and logs an
/// error) instead of skipping them silently. A third replica follows the two processes
/// apart (each batch names its process): no sequence gaps, two peers — where it read one
/// replica whose sequence jumped back and forth, counting gaps and dropping its load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nats-server (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn two_replicas_under_one_id_are_reported() {
    let nats = Nats::start(free_port()).await;
    let stop = CancellationToken::new();
    let ws = workers(2, 50.0, &stop).await;
    let same = |ws: &[String]| GatewayConfig { replica_id: Some("same".into()), ..synced(Some(&nats.url), ws) };
    let (a, _) = common::start_router(same(&ws), stop.clone()).await;
    let (b, _) = common::start_router(same(&ws), stop.clone()).await;
    let (third, _) = common::start_router(synced(Some(&nats.url), &ws), stop.clone()).await;
    let c = common::client();
    for r in [&a, &b, &third] {
        ready(&c, r).await;
    }
    // A publishes more batches than B, so their sequence numbers part.
    for (i, r) in [&a, &a, &a, &a, &b, &a, &b].into_iter().enumerate() {
        let q = ask(&document(i, 800), "q", 2, false);
        let answer = guard(c.post(format!("{r}/v1/chat/completions")).json(&q).send()).await.expect("send");
        assert_eq!(answer.status(), 200);
        // Each request's events published before the next (a batch of their own).
        eventually("the third replica applies the request", async || {
            metric(&c, &third, "kvroute_sync_events_total{outcome=\"applied\"}").await >= (i + 1) as f64
        })
        .await;
    }
    eventually("B reports A's batches under its own id", async || {
        metric(&c, &b, "kvroute_sync_events_total{outcome=\"duplicate_replica_id\"}").await >= 1.0
    })
    .await;
    assert_eq!(metric(&c, &b, "kvroute_sync_events_total{outcome=\"applied\"}").await, 0.0);
    assert_eq!(metric(&c, &third, "kvroute_sync_gaps_total").await, 0.0);
    // Set by the once-a-second sweep.
    eventually("the third replica counts two peers", async || metric(&c, &third, "kvroute_sync_peers").await == 2.0)
        .await;
    stop.cancel();
}

/// An API key's limits are the cluster's: what one replica admits for a key, the others
/// take from their own buckets for it, so two replicas together allow a key `rpm=2` two
/// requests a minute, not four. Another key's buckets are not touched. A replica starting
/// later starts with the buckets as spent as its peers', not full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nats-server (Debian nats-server): KVROUTE_NATS_BIN=$(command -v nats-server) scripts/test.sh"]
async fn a_key_s_rate_limit_holds_across_the_replicas() {
    let nats = Nats::start(free_port()).await;
    let stop = CancellationToken::new();
    let ws = workers(1, 50.0, &stop).await;
    let file = tempfile::Builder::new().prefix("kvroute-cluster-keys-").suffix(".txt").tempfile().expect("temp file");
    // rpm=2 refills one request every 30 s: none within the test.
    std::fs::write(file.path(), "sk-shared team-a rpm=2\nsk-other team-b rpm=2\n").expect("write keys");
    let keyed = || GatewayConfig {
        api_key_file: Some(file.path().display().to_string()),
        ..synced_with(Some(&nats.url), &ws, "round_robin")
    };
    let (a, _) = common::start_router(keyed(), stop.clone()).await;
    let (b, _) = common::start_router(keyed(), stop.clone()).await;
    let c = common::client();
    ready(&c, &a).await;
    ready(&c, &b).await;
    let send = async |router: &str, key: &str| {
        let q = ask("Shared limits.", "q", 2, false);
        let r = c.post(format!("{router}/v1/chat/completions")).bearer_auth(key).json(&q).send();
        guard(r).await.expect("send").status().as_u16()
    };
    let spends = async |router: &str| metric(&c, router, "kvroute_sync_events_total{outcome=\"spend_applied\"}").await;

    assert_eq!(send(&a, "sk-shared").await, 200, "the key's first request, on A");
    eventually("B takes A's spend from its buckets", async || spends(&b).await >= 1.0).await;
    assert_eq!(send(&b, "sk-shared").await, 200, "its second, on B");
    assert_eq!(send(&b, "sk-shared").await, 429, "a third on B: the cluster's minute is used");
    eventually("A takes B's spend from its buckets", async || spends(&a).await >= 1.0).await;
    assert_eq!(send(&a, "sk-shared").await, 429, "and on A");
    assert_eq!(send(&b, "sk-other").await, 200, "another key's buckets are its own");
    assert_eq!(metric(&c, &b, "kvroute_sync_events_total{outcome=\"spend_unknown_key\"}").await, 0.0);

    // A replica that starts now (a restart, a rollout) takes the snapshot of how far each
    // key's buckets are spent: no fresh minute for sk-shared, one request left of sk-other's.
    eventually("A takes B's spend of the other key", async || spends(&a).await >= 2.0).await;
    let (n, _) = common::start_router(keyed(), stop.clone()).await;
    ready(&c, &n).await;
    assert_eq!(send(&n, "sk-shared").await, 429, "the new replica knows the minute is used");
    assert_eq!(send(&n, "sk-other").await, 200, "the other key's second request");
    assert_eq!(send(&n, "sk-other").await, 429, "and no third");
    stop.cancel();
}
