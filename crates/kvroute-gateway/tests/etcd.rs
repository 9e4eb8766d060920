//! Cluster mode on a real etcd (Debian `etcd-server`, given by `KVROUTE_ETCD_BIN`): the worker
//! registry (put, delete, lease expiry), the live policy key (a swap under load, Cognitora
//! cgn-router's weights, invalid values keeping the last good policy), and etcd down at
//! startup and mid-run with no failed request. Ignored by default; `scripts/test.sh` runs
//! them when `KVROUTE_ETCD_BIN` is set, and CI requires them.

use etcd_client::PutOptions;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::{eventually, guard};
#[path = "common/etcd.rs"]
mod etcd;
use common::free_port;
use etcd::Etcd;

fn chat(i: usize) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": format!("question {i}")}],
        "max_tokens": 2})
}

async fn worker(stop: &CancellationToken) -> String {
    let cfg = EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() };
    engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker").0
}

fn cluster_config(etcd_url: &str, static_workers: &[&str]) -> GatewayConfig {
    GatewayConfig { etcd: vec![etcd_url.to_string()], ..common::config(static_workers, "cache_aware") }
}

async fn worker_urls(c: &reqwest::Client, r: &str) -> Vec<String> {
    let v: serde_json::Value =
        c.get(format!("{r}/list_workers")).send().await.expect("list").json().await.expect("json");
    let mut urls: Vec<String> =
        v["urls"].as_array().expect("urls").iter().filter_map(|u| u.as_str().map(String::from)).collect();
    urls.sort();
    urls
}

async fn metric(c: &reqwest::Client, r: &str, series: &str) -> f64 {
    let text = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(series) && l[series.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn registry_follows_puts_deletes_and_lease_expiry() {
    let e = Etcd::start(free_port()).await;
    let mut ec = e.client().await;
    let stop_w = CancellationToken::new();
    let (w1, w2, w3) = (worker(&stop_w).await, worker(&stop_w).await, worker(&stop_w).await);
    let stop = CancellationToken::new();
    // w3 is a static worker: etcd may add it too, but never removes it.
    let (r, _t) = common::start_router(cluster_config(&e.url, &[&w3]), stop.clone()).await;
    let c = common::client();
    eventually("etcd connected", async || metric(&c, &r, "kvroute_etcd_connected").await == 1.0).await;

    // A put registers the worker with its role, capacity and labels.
    let rec1 = serde_json::json!({"url": w1, "role": "decode", "models": ["sim-llama-3-8b"],
        "capacity": {"tp_size": 2, "dtype": "bf16", "vram_gb": 80, "max_concurrent": 32}, "labels": {"zone": "a"}});
    ec.put("/kvroute/workers/w1", rec1.to_string(), None).await.expect("put");
    eventually("w1 registered", async || worker_urls(&c, &r).await.contains(&w1)).await;
    let table: serde_json::Value =
        c.get(format!("{r}/workers")).send().await.expect("workers").json().await.expect("json");
    let row = table["workers"].as_array().expect("rows").iter().find(|w| w["url"] == w1.as_str()).expect("w1 row");
    assert_eq!(row["registration"]["role"], "decode", "{row}");
    assert_eq!(row["registration"]["capacity"]["tp_size"], 2, "{row}");
    assert_eq!(row["registration"]["labels"]["zone"], "a", "{row}");
    assert_eq!(metric(&c, &r, "kvroute_etcd_workers").await, 1.0);
    // Requests reach it.
    for i in 0..4 {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(i)).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
    }

    // A lease with no keep-alive: registered, then gone when the lease expires.
    let lease = ec.lease_grant(2, None).await.expect("lease").id();
    let rec2 = serde_json::json!({"url": w2});
    ec.put("/kvroute/workers/w2", rec2.to_string(), Some(PutOptions::new().with_lease(lease))).await.expect("put");
    eventually("w2 registered", async || worker_urls(&c, &r).await.contains(&w2)).await;
    eventually("w2 gone after its lease expired", async || !worker_urls(&c, &r).await.contains(&w2)).await;

    // An invalid record changes nothing; a delete removes the worker; the static worker stays
    // even when a registration of it is deleted.
    ec.put("/kvroute/workers/bad", r#"{"url": "ftp://nowhere"}"#, None).await.expect("put");
    // The router's own listener registered as a worker would loop: refused like a bad record.
    ec.put("/kvroute/workers/self", serde_json::json!({"url": r}).to_string(), None).await.expect("put");
    ec.put("/kvroute/workers/w3", serde_json::json!({"url": w3}).to_string(), None).await.expect("put");
    eventually("etcd_workers counts w1 and w3", async || metric(&c, &r, "kvroute_etcd_workers").await == 2.0).await;
    assert!(!worker_urls(&c, &r).await.contains(&r), "the router's own listener became its worker");
    ec.delete("/kvroute/workers/w1", None).await.expect("delete");
    ec.delete("/kvroute/workers/w3", None).await.expect("delete");
    eventually("w1 deregistered", async || !worker_urls(&c, &r).await.contains(&w1)).await;
    assert_eq!(worker_urls(&c, &r).await, vec![w3.clone()], "only the static worker is left");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn the_policy_key_swaps_the_policy_under_load_and_an_invalid_value_keeps_the_last_good_one() {
    let e = Etcd::start(free_port()).await;
    let mut ec = e.client().await;
    let stop_w = CancellationToken::new();
    let (w1, w2) = (worker(&stop_w).await, worker(&stop_w).await);
    let stop = CancellationToken::new();
    let (r, _t) = common::start_router(cluster_config(&e.url, &[&w1, &w2]), stop.clone()).await;
    let c = common::client();
    eventually("etcd connected", async || metric(&c, &r, "kvroute_etcd_connected").await == 1.0).await;

    // Load runs through every swap; each response must be a 200.
    let done = CancellationToken::new();
    let load = tokio::spawn({
        let (c, r, done) = (c.clone(), r.clone(), done.clone());
        async move {
            let mut statuses = Vec::new();
            let mut i = 0;
            while !done.is_cancelled() && i < 5000 {
                let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(i)).send()).await.expect("send");
                statuses.push(resp.status().as_u16());
                i += 1;
            }
            statuses
        }
    });
    let decision = async |c: &reqwest::Client| {
        let resp = c.post(format!("{r}/v1/chat/completions")).json(&chat(0)).send().await.expect("send");
        resp.headers().get("x-kvroute-decision").and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
    };
    assert!(decision(&c).await.starts_with("policy=cache_aware;"));
    ec.put("/kvroute/routing/policy", r#"{"policy": "round_robin"}"#, None).await.expect("put");
    eventually("round_robin routes", async || decision(&c).await.starts_with("policy=round_robin;")).await;
    // Cognitora cgn-router's value: kv_score with those weights.
    ec.put("/kvroute/routing/policy", r#"{"w_kv": 0.7, "w_load": 0.3, "w_pwr": 0.0, "w_cap": 0.0}"#, None)
        .await
        .expect("put");
    eventually("kv_score routes", async || decision(&c).await.starts_with("policy=kv_score;")).await;
    let p: serde_json::Value = c.get(format!("{r}/policy")).send().await.expect("policy").json().await.expect("json");
    assert_eq!(p["knobs"]["w_kv"], 0.7, "{p}");
    let applied = metric(&c, &r, "kvroute_policy_updates_total{source=\"etcd\",outcome=\"applied\"}").await;
    // Invalid values: an unknown policy, a bad knob, not JSON. Each is refused and counted.
    for bad in [r#"{"policy": "no_such_policy"}"#, r#"{"policy": "cache_aware", "knobs": {"cache_threshold": 7}}"#, "{"]
    {
        let before = metric(&c, &r, "kvroute_policy_updates_total{source=\"etcd\",outcome=\"rejected\"}").await;
        ec.put("/kvroute/routing/policy", bad, None).await.expect("put");
        eventually("the bad value is counted as rejected", async || {
            metric(&c, &r, "kvroute_policy_updates_total{source=\"etcd\",outcome=\"rejected\"}").await == before + 1.0
        })
        .await;
        assert!(decision(&c).await.starts_with("policy=kv_score;"), "a rejected value changed the policy");
    }
    assert_eq!(metric(&c, &r, "kvroute_policy_updates_total{source=\"etcd\",outcome=\"applied\"}").await, applied);
    // A `cascade` field alone sets the model cascades live and leaves the policy as it is.
    ec.put(
        "/kvroute/routing/policy",
        r#"{"cascade": {"chain": [{"model": "auto", "models": ["sim-llama-3-8b"]}]}}"#,
        None,
    )
    .await
    .expect("put");
    let cascade = async |c: &reqwest::Client| {
        let body =
            serde_json::json!({"model": "auto", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        let resp = c.post(format!("{r}/v1/chat/completions")).json(&body).send().await.expect("send");
        resp.headers().get("x-kvroute-cascade").and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
    };
    eventually("the cascade applies", async || cascade(&c).await == "sim-llama-3-8b:-0.10").await;
    assert!(decision(&c).await.starts_with("policy=kv_score;"), "a cascade alone keeps the policy");
    done.cancel();
    let statuses = load.await.expect("load");
    assert!(!statuses.is_empty() && statuses.iter().all(|s| *s == 200), "a request failed during a swap");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn etcd_down_at_startup_and_mid_run_fails_no_request() {
    let port = free_port();
    let etcd_url = format!("http://127.0.0.1:{port}");
    let stop_w = CancellationToken::new();
    let (w1, w2) = (worker(&stop_w).await, worker(&stop_w).await);
    let stop = CancellationToken::new();
    // etcd is not running yet: the router serves its static worker meanwhile.
    let (r, _t) = common::start_router(cluster_config(&etcd_url, &[&w1]), stop.clone()).await;
    let c = common::client();
    let send_ok = async |from: usize, n: usize| {
        for i in from..from + n {
            let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(i)).send()).await.expect("send");
            assert_eq!(resp.status(), 200, "request {i}");
        }
    };
    send_ok(0, 10).await;
    assert_eq!(metric(&c, &r, "kvroute_etcd_connected").await, 0.0);

    // etcd comes up: the router connects (backoff) and picks up a registration.
    let e = Etcd::start(port).await;
    e.client().await.put("/kvroute/workers/w2", serde_json::json!({"url": w2}).to_string(), None).await.expect("put");
    eventually("connected and w2 registered", async || worker_urls(&c, &r).await.contains(&w2)).await;
    assert_eq!(metric(&c, &r, "kvroute_etcd_connected").await, 1.0);

    // etcd dies mid-run: the last known registry stays and no request fails.
    drop(e);
    eventually("etcd_connected drops to 0", async || metric(&c, &r, "kvroute_etcd_connected").await == 0.0).await;
    send_ok(10, 20).await;
    let mut both = vec![w1.clone(), w2.clone()];
    both.sort();
    assert_eq!(worker_urls(&c, &r).await, both, "the registry survives etcd going away");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn registered_roles_make_a_disaggregated_fleet() {
    use kvroute_core::types::Role;
    let e = Etcd::start(free_port()).await;
    let mut ec = e.client().await;
    let stop_w = CancellationToken::new();
    let role = |role: Role| EngineSimConfig {
        time_scale: 50.0,
        role,
        bootstrap_port: (role == Role::Prefill).then_some(0),
        ..EngineSimConfig::default()
    };
    let (p, psim) = engine_sim::spawn_local(role(Role::Prefill), stop_w.clone()).await.expect("prefill");
    let (d, _) = engine_sim::spawn_local(role(Role::Decode), stop_w.clone()).await.expect("decode");
    let mut cfg = cluster_config(&e.url, &[]);
    cfg.pd.enabled = true;
    cfg.pd.colocate_below_tokens = 64;
    let stop = CancellationToken::new();
    let (r, _t) = common::start_router(cfg, stop.clone()).await;
    let c = common::client();
    eventually("etcd connected", async || metric(&c, &r, "kvroute_etcd_connected").await == 1.0).await;
    let port = psim.bootstrap_port().expect("bootstrap port");
    let recs = [
        ("p", serde_json::json!({"url": p, "role": "prefill", "bootstrap_port": port})),
        ("d", serde_json::json!({"url": d, "role": "decode"})),
    ];
    for (k, rec) in recs {
        ec.put(format!("/kvroute/workers/{k}"), rec.to_string(), None).await.expect("put");
    }
    eventually("both registered", async || worker_urls(&c, &r).await.len() == 2).await;
    let long = "the cache router sends each request to a worker ".repeat(10);
    let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 4,
        "messages": [{"role": "user", "content": long}]});
    let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&body).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    let decision = resp.headers()["x-kvroute-decision"].to_str().expect("header").to_string();
    assert!(decision.starts_with(&format!("pd=prefill:{p},decode:{d};")), "{decision}");
    stop.cancel();
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn one_connection_to_an_etcd_with_default_keep_alive_rules_holds_for_60_s() {
    // etcd with its default `--grpc-keepalive-min-time` (5 s): a router or a sidecar that
    // pings more often is disconnected (GOAWAY too_many_pings) and reconnects and re-lists.
    let e = Etcd::start(free_port()).await;
    let mut ec = e.client().await;
    let stop_w = CancellationToken::new();
    let w1 = worker(&stop_w).await;
    let stop = CancellationToken::new();
    let (r, _t) = common::start_router(cluster_config(&e.url, &[]), stop.clone()).await;
    let c = common::client();
    eventually("etcd connected", async || metric(&c, &r, "kvroute_etcd_connected").await == 1.0).await;
    // The registration sidecar holds its lease's keep-alive stream on its own connection; a
    // reconnect would drop the lease and register again under a new one. A 30 s TTL renewed
    // every 10 s (`kvroute register --ttl-secs 30`'s default interval) leaves the stream
    // silent long enough for pings to matter.
    let key = "/kvroute/workers/w1";
    let sidecar = tokio::spawn(kvroute_gateway::cluster::register::run(
        kvroute_gateway::cluster::register::RegisterConfig {
            etcd: vec![e.url.clone()],
            key: key.into(),
            record: kvroute_gateway::cluster::WorkerRecord::parse(
                serde_json::json!({"url": w1}).to_string().as_bytes(),
            )
            .expect("record"),
            ttl_secs: 30,
            check_interval: std::time::Duration::from_secs(10),
            health_path: "/health".into(),
        },
        stop.clone().cancelled_owned(),
    ));
    eventually("w1 registered by the sidecar", async || worker_urls(&c, &r).await.contains(&w1)).await;
    let lease_of = async |ec: &mut etcd_client::Client| {
        ec.get(key, None).await.expect("get").kvs().first().map(|kv| kv.lease()).expect("the key exists")
    };
    let lease = lease_of(&mut ec).await;
    // 60 s of an idle registry: the watches only carry keep-alive pings.
    for i in 0..12 {
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(i)).send()).await.expect("send");
        assert_eq!(resp.status(), 200, "request {i}");
    }
    assert_eq!(lease_of(&mut ec).await, lease, "the sidecar lost its connection and registered again");
    assert_eq!(metric(&c, &r, "kvroute_etcd_connected").await, 1.0);
    assert_eq!(
        metric(&c, &r, "kvroute_etcd_connects_total").await,
        1.0,
        "the router reconnected to etcd (and re-listed the registry) within 60 s"
    );
    stop.cancel();
    guard(sidecar).await.expect("sidecar task").expect("sidecar");
    stop_w.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn a_replica_started_during_an_etcd_outage_routes_to_the_saved_registry_marked_stale_until_etcd_answers() {
    use kvroute_gateway::cluster::last_known;
    let state = tempfile::tempdir().expect("state dir");
    let port = free_port();
    let etcd_url = format!("http://127.0.0.1:{port}");
    let stop_w = CancellationToken::new();
    let (w1, w2) = (worker(&stop_w).await, worker(&stop_w).await);
    let cfg = GatewayConfig {
        state_dir: Some(state.path().join("kvroute").to_str().expect("utf8").to_string()),
        ..cluster_config(&etcd_url, &[])
    };
    let c = common::client();
    let rows = async |r: &str| {
        let v: serde_json::Value =
            c.get(format!("{r}/workers")).send().await.expect("workers").json().await.expect("json");
        v["workers"].as_array().expect("rows").clone()
    };
    let stale_of = |rows: &[serde_json::Value], url: &str| {
        rows.iter().find(|w| w["url"] == url).map(|w| w["registration_stale"].clone()).expect("row")
    };

    // etcd up: the router lists two registrations and writes them to state_dir.
    let e = Etcd::start(port).await;
    let mut ec = e.client().await;
    for (k, url) in [("w1", &w1), ("w2", &w2)] {
        let rec = serde_json::json!({"url": url, "labels": {"name": k}});
        ec.put(format!("/kvroute/workers/{k}"), rec.to_string(), None).await.expect("put");
    }
    let stop = CancellationToken::new();
    let (r, t) = common::start_router(cfg.clone(), stop.clone()).await;
    eventually("both registered", async || worker_urls(&c, &r).await.len() == 2).await;
    assert_eq!(metric(&c, &r, "kvroute_etcd_registry_stale").await, 0.0);
    assert_eq!(stale_of(&rows(&r).await, &w1), false);
    let dir = std::path::PathBuf::from(cfg.state_dir.clone().expect("state_dir"));
    eventually("the registry is saved", async || {
        last_known::load(&dir, "/kvroute").ok().flatten().is_some_and(|l| l.workers.len() == 2)
    })
    .await;
    stop.cancel();
    guard(t).await.expect("router task").expect("router");
    drop(ec);
    drop(e);

    // etcd down: a new replica routes to the saved workers, marked stale.
    let stop = CancellationToken::new();
    let (r, t) = common::start_router(cfg.clone(), stop.clone()).await;
    let mut both = vec![w1.clone(), w2.clone()];
    both.sort();
    eventually("the saved workers are in the fleet", async || worker_urls(&c, &r).await == both).await;
    assert_eq!(metric(&c, &r, "kvroute_etcd_connected").await, 0.0);
    assert_eq!(metric(&c, &r, "kvroute_etcd_registry_stale").await, 1.0);
    let table = rows(&r).await;
    for (name, url) in [("w1", &w1), ("w2", &w2)] {
        assert_eq!(stale_of(&table, url), true, "{table:?}");
        let row = table.iter().find(|w| w["url"] == url.as_str()).expect("row");
        assert_eq!(row["registration"]["labels"]["name"], name, "the saved record: {row}");
    }
    for i in 0..6 {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(i)).send()).await.expect("send");
        assert_eq!(resp.status(), 200, "request {i} on the saved registry");
    }

    // etcd answers with w1 only: its list replaces the saved one and nothing is stale.
    let e = Etcd::start(port).await;
    e.client().await.put("/kvroute/workers/w1", serde_json::json!({"url": w1}).to_string(), None).await.expect("put");
    eventually("stale clears", async || metric(&c, &r, "kvroute_etcd_registry_stale").await == 0.0).await;
    // The router may list before the put lands (then w1 leaves and comes back with it).
    eventually("etcd's list replaced the saved one: w1 only", async || worker_urls(&c, &r).await == [w1.clone()]).await;
    let table = rows(&r).await;
    assert_eq!(stale_of(&table, &w1), false, "{table:?}");
    assert!(
        table.iter().find(|w| w["url"] == w1.as_str()).expect("row")["registration"]["labels"]
            .as_object()
            .expect("labels")
            .is_empty()
    );
    eventually("etcd connected", async || metric(&c, &r, "kvroute_etcd_connected").await == 1.0).await;
    eventually("the new list is saved", async || {
        last_known::load(&dir, "/kvroute").ok().flatten().is_some_and(|l| l.workers.len() == 1)
    })
    .await;
    stop.cancel();
    guard(t).await.expect("router task").expect("router");
    stop_w.cancel();
}
