//! Configuration reload on SIGHUP through the library entry point
//! (`kvroute_gateway::serve_with_reload`), with a configuration source reading a TOML file
//! and real SIGHUPs sent to this test process.
//!
//! A SIGHUP goes to the whole process, so every case runs in one test function, one after
//! the other, each waiting (bounded) for its reload to be counted before the next signal.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::{ConfigSource, GatewayConfig};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

/// A fresh directory, removed when the guard drops (also on a panic).
fn scratch_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("kvroute-{name}-")).tempdir().expect("temp dir")
}

/// The configuration file's text: an ephemeral port, `policy`, `urls`, then `extra` lines
/// (last, so they may open a table).
fn file_text(policy: &str, extra: &str, urls: &[&str]) -> String {
    let urls: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    // drain_delay_secs as in `common::config`, which the first file must equal.
    let token = common::ADMIN_TOKEN;
    format!(
        "port = 0\nadmin_token = \"{token}\"\npolicy = \"{policy}\"\nexpose_decision_headers = true\nworker_urls = [{}]\ndrain_delay_secs = 0.0\n{extra}\n",
        urls.join(", ")
    )
}

/// Rewrites the file in one step (a rename), as an editor or a deploy tool would.
fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write config");
    std::fs::rename(&tmp, path).expect("replace config");
}

fn sighup() {
    let pid = std::process::id().to_string();
    let ok = std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("run kill").success();
    assert!(ok, "kill -HUP failed");
}

/// `kvroute_config_reloads_total{outcome}` from `/metrics` (0 when absent).
async fn reloads(c: &reqwest::Client, r: &str, outcome: &str) -> u64 {
    let text = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let prefix = format!("kvroute_config_reloads_total{{outcome=\"{outcome}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.trim().parse().expect("counter"))
}

/// Every reload counted so far, whatever its outcome.
async fn all_reloads(c: &reqwest::Client, r: &str) -> u64 {
    reloads(c, r, "applied").await + reloads(c, r, "unchanged").await + reloads(c, r, "invalid").await
}

/// Sends a SIGHUP, waits until its reload is counted, and checks it was the `n`-th with
/// `outcome`.
async fn reload_and_wait(c: &reqwest::Client, r: &str, outcome: &str, n: u64) {
    let before = all_reloads(c, r).await;
    sighup();
    guard(async {
        while all_reloads(c, r).await == before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(reloads(c, r, outcome).await, n, "reload #{} was not the {n}-th `{outcome}`", before + 1);
}

async fn policy(c: &reqwest::Client, r: &str) -> serde_json::Value {
    c.get(format!("{r}/policy")).send().await.expect("policy").json().await.expect("json")
}

async fn workers(c: &reqwest::Client, r: &str) -> Vec<String> {
    let v: serde_json::Value = c.get(format!("{r}/workers")).send().await.expect("workers").json().await.expect("json");
    let mut urls: Vec<String> =
        v["workers"].as_array().expect("rows").iter().map(|w| w["url"].as_str().expect("url").to_string()).collect();
    urls.sort();
    urls
}

/// The `x-kvroute-decision` header of one chat request (a body of about 1.2 kB).
async fn decision(c: &reqwest::Client, r: &str) -> String {
    let content = "hello ".repeat(200);
    let body = serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": content}],
        "max_tokens": 2});
    let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&body).send()).await.expect("chat");
    assert_eq!(resp.status(), 200);
    resp.headers()["x-kvroute-decision"].to_str().expect("ascii").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_policy_knobs_and_workers_and_an_invalid_file_keeps_the_config_in_effect() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop_w = CancellationToken::new();
    let sim = || EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() };
    let (w1, _s1) = engine_sim::spawn_local(sim(), stop_w.clone()).await.expect("worker 1");
    let (w2, _s2) = engine_sim::spawn_local(sim(), stop_w.clone()).await.expect("worker 2");
    let (w3, _s3) = engine_sim::spawn_local(sim(), stop_w.clone()).await.expect("worker 3");
    let dir = scratch_dir("reload");
    let path = dir.path().join("kvroute.toml");
    write(&path, &file_text("round_robin", "", &[&w1]));
    let source: ConfigSource = {
        let path = path.clone();
        Arc::new(move || {
            let text = std::fs::read_to_string(&path)?;
            Ok(GatewayConfig::from_toml(&text)?)
        })
    };
    let cfg = source().expect("the first file is valid");
    assert_eq!(cfg, common::config(&[&w1], "round_robin"), "the file holds the test configuration");

    let stop = CancellationToken::new();
    let (r, server) = common::start_router_with_reload(cfg, Some(source), stop.clone()).await;
    let c = common::client();
    for outcome in ["applied", "unchanged", "invalid"] {
        let text = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
        assert!(text.contains(&format!("kvroute_config_reloads_total{{outcome=\"{outcome}\"}} 0")), "{outcome}");
    }
    assert!(decision(&c, &r).await.contains("policy=round_robin"));

    // The file as it was: nothing changes.
    reload_and_wait(&c, &r, "unchanged", 1).await;
    assert_eq!(policy(&c, &r).await["policy"], "round_robin");

    // A new policy with a knob: every model switches, and requests show it.
    write(&path, &file_text("cache_aware", "[policy_knobs]\ncache_threshold = 0.25", &[&w1]));
    reload_and_wait(&c, &r, "applied", 1).await;
    let p = policy(&c, &r).await;
    assert_eq!(p["policy"], "cache_aware", "{p}");
    assert_eq!(p["knobs"]["cache_threshold"], 0.25, "{p}");
    let d = decision(&c, &r).await;
    assert!(d.contains("policy=cache_aware"), "{d}");

    // The same policy without the knob: patched back to its default, no switch.
    write(&path, &file_text("cache_aware", "", &[&w1]));
    reload_and_wait(&c, &r, "applied", 2).await;
    let p = policy(&c, &r).await;
    assert_eq!(p["policy"], "cache_aware", "{p}");
    assert_eq!(p["knobs"]["cache_threshold"], 0.5, "{p}");

    // A worker added through the admin API is never removed by a reload.
    let resp = c.post(format!("{r}/add_worker?url={w3}")).send().await.expect("add_worker");
    assert_eq!(resp.status(), 200);

    // A worker added to the list, then the first one dropped from it.
    write(&path, &file_text("cache_aware", "", &[&w1, &w2]));
    reload_and_wait(&c, &r, "applied", 3).await;
    let mut want = vec![w1.clone(), w2.clone(), w3.clone()];
    want.sort();
    assert_eq!(workers(&c, &r).await, want);
    write(&path, &file_text("cache_aware", "", &[&w2]));
    reload_and_wait(&c, &r, "applied", 4).await;
    let mut want = vec![w2.clone(), w3.clone()];
    want.sort();
    assert_eq!(workers(&c, &r).await, want, "w1 removed, the admin-added w3 kept");

    // Invalid files: bad TOML, then a bad value. Nothing changes.
    write(&path, "policy = \"round_robin\nworker_urls = [");
    reload_and_wait(&c, &r, "invalid", 1).await;
    write(&path, &file_text("no_such_policy", "", &[&w1]));
    reload_and_wait(&c, &r, "invalid", 2).await;
    // The router's own listener as a worker: it would loop; the whole file is refused.
    write(&path, &file_text("round_robin", "", &[&w1, &r]));
    reload_and_wait(&c, &r, "invalid", 3).await;
    assert_eq!(policy(&c, &r).await["policy"], "cache_aware");
    assert_eq!(workers(&c, &r).await, want, "the workers are as they were");
    assert!(decision(&c, &r).await.contains("policy=cache_aware"));

    // A key that needs a restart: logged, left as it is, nothing live changes.
    write(&path, &file_text("cache_aware", "max_body_bytes = 1000", &[&w2]));
    reload_and_wait(&c, &r, "unchanged", 2).await;
    assert!(decision(&c, &r).await.contains("policy=cache_aware"), "a request over 1000 bytes is still served");
    assert_eq!(reloads(&c, &r, "applied").await, 4);
    assert_eq!(reloads(&c, &r, "invalid").await, 3);

    // The client's keep-alive connections closed first, so the drain has nothing to wait for.
    drop(c);
    stop.cancel();
    guard(server).await.expect("join").expect("serve");
    stop_w.cancel();
}

/// Waits (bounded: the hang guard) until `check` holds.
async fn until<F: std::future::Future<Output = bool>>(mut check: impl FnMut() -> F) {
    guard(async {
        while !check().await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

/// With `reload_watch_secs`, no signal is needed: a changed configuration file is applied
/// and a changed key file read again at the next look, an invalid file is counted once
/// (not at every look), and files that did not change are not reloaded at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_watch_applies_what_changed_without_a_signal() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop_w = CancellationToken::new();
    let sim = EngineSimConfig { instant: true, ..EngineSimConfig::default() };
    let (w1, _s1) = engine_sim::spawn_local(sim, stop_w.clone()).await.expect("worker");
    let dir = scratch_dir("watch");
    let (path, keys) = (dir.path().join("kvroute.toml"), dir.path().join("keys.txt"));
    write(&keys, "sk-a team-a\nsk-b team-b\n");
    let extra = format!("reload_watch_secs = 1.0\napi_key_file = \"{}\"", keys.display());
    write(&path, &file_text("round_robin", &extra, &[&w1]));
    let source: ConfigSource = {
        let path = path.clone();
        Arc::new(move || Ok(GatewayConfig::from_toml(&std::fs::read_to_string(&path)?)?))
    };
    let cfg = source().expect("the first file is valid");
    let stop = CancellationToken::new();
    let (r, server) = common::start_router_with_reload(cfg, Some(source), stop.clone()).await;
    let c = common::client();
    let chat = |key: &'static str| {
        let body = serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2});
        let rb = reqwest::Client::new().post(format!("{r}/v1/chat/completions")).bearer_auth(key).json(&body);
        async move { guard(rb.send()).await.expect("chat").status().as_u16() }
    };
    assert_eq!((chat("sk-a").await, chat("sk-b").await), (200, 200));

    write(&path, &file_text("least_load", &extra, &[&w1]));
    until(|| async { policy(&c, &r).await["policy"] == "least_load" }).await;
    write(&keys, "sk-a team-a\n");
    until(|| async { chat("sk-b").await == 401 }).await;
    assert_eq!(chat("sk-a").await, 200, "a key left in the file");

    write(&path, "policy = \"round_robin\nworker_urls = [");
    until(|| async { reloads(&c, &r, "invalid").await == 1 }).await;
    // Looks go on every second; the invalid file is not counted again, and nothing that
    // did not change is reloaded (no `unchanged` reload ever).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(reloads(&c, &r, "invalid").await, 1);
    assert_eq!(reloads(&c, &r, "applied").await, 1);
    assert_eq!(reloads(&c, &r, "unchanged").await, 0);
    assert_eq!(policy(&c, &r).await["policy"], "least_load", "an invalid file kept the policy in effect");
    drop(c);
    stop.cancel();
    guard(server).await.expect("join").expect("serve");
    stop_w.cancel();
}

/// `kvroute_admin_token_reloads_total{outcome}` from `/metrics` (0 when absent).
async fn token_reloads(c: &reqwest::Client, r: &str, outcome: &str) -> u64 {
    let text = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let prefix = format!("kvroute_admin_token_reloads_total{{outcome=\"{outcome}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.trim().parse().expect("counter"))
}

/// `admin_token_file` with the file watch: the admin API, and the decision headers the
/// admin token unlocks, follow the file's token without a restart or a signal (a Secret
/// rotated in place); a file left empty keeps the token in effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_rotates_with_its_file() {
    let stop_w = CancellationToken::new();
    let sim = EngineSimConfig { instant: true, ..EngineSimConfig::default() };
    let (w1, _s1) = engine_sim::spawn_local(sim, stop_w.clone()).await.expect("worker");
    let dir = scratch_dir("admin-token");
    let token = dir.path().join("token");
    write(&token, "token-one\n");
    let cfg = GatewayConfig {
        admin_token: None,
        admin_token_file: Some(token.display().to_string()),
        reload_watch_secs: 1.0,
        expose_decision_headers: false,
        ..common::config(&[&w1], "round_robin")
    };
    let stop = CancellationToken::new();
    let (r, server) = common::start_router(cfg, stop.clone()).await;
    let c = reqwest::Client::new();
    let admin = |t: &'static str| {
        let rb = c.get(format!("{r}/workers")).bearer_auth(t);
        async move { guard(rb.send()).await.expect("workers").status().as_u16() }
    };
    // Whether a chat presenting `t` as `x-kvroute-admin-token` is told where it went.
    let sees_decision = |t: &'static str| {
        let body = serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2});
        let rb = c.post(format!("{r}/v1/chat/completions")).header("x-kvroute-admin-token", t).json(&body);
        async move { guard(rb.send()).await.expect("chat").headers().contains_key("x-kvroute-worker") }
    };
    assert_eq!((admin("token-one").await, admin("token-two").await), (200, 401));
    assert!(sees_decision("token-one").await && !sees_decision("token-two").await);

    write(&token, "token-two\n");
    until(|| async { admin("token-two").await == 200 }).await;
    assert_eq!(admin("token-one").await, 401, "the old token is refused from then on");
    assert!(sees_decision("token-two").await && !sees_decision("token-one").await);
    assert_eq!(token_reloads(&c, &r, "applied").await, 1);

    write(&token, " \n");
    until(|| async { token_reloads(&c, &r, "invalid").await == 1 }).await;
    assert_eq!(admin("token-two").await, 200, "an empty file keeps the token in effect");
    drop(c);
    stop.cancel();
    guard(server).await.expect("join").expect("serve");
    stop_w.cancel();
}
