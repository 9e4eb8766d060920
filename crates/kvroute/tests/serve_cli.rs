//! `kvroute serve` as a process: co-launched workers (SGLang router), config errors naming the
//! key, add/remove of workers under load, and a clean stop that takes the workers with it.

use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::{Proc, free_port};
#[path = "../../kvroute-gateway/tests/common/pki.rs"]
mod pki;

async fn wait_ready(c: &reqwest::Client, url: &str) -> bool {
    for _ in 0..600 {
        if c.get(format!("{url}/readiness")).send().await.is_ok_and(|r| r.status().is_success()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

fn chat(i: usize) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": format!("question {i}")}], "max_tokens": 2})
}

#[test]
fn invalid_config_is_refused_naming_the_key() {
    let dir = tempfile::Builder::new().prefix("kvroute-serve-cli-").tempdir().expect("temp dir");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "policy = \"cache_aware\"\n[policy_knobs]\ncache_treshold = 0.4\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--config", cfg.to_str().expect("utf8"), "--port", "0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("policy_knobs") && err.contains("cache_treshold"), "{err}");
}

/// A file the gateway reads at start that is missing stops it naming the file, and
/// `kvroute serve` does not announce "serving on" before that (it announces once the
/// gateway has read what it needs).
#[test]
fn a_missing_key_or_token_file_stops_the_start_before_serving_is_announced() {
    for flag in ["--api-key-file", "--admin-token-file"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--port", "0", flag, "/nonexistent/kvroute-file"])
            .output()
            .expect("run");
        assert!(!out.status.success(), "{flag}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("/nonexistent/kvroute-file"), "{flag}: {err}");
        assert!(!err.contains("serving on"), "{flag}: {err}");
    }
}

/// Whether the endpoint picker on `epp` answers a gRPC health check over TLS to a client
/// that trusts only `ca` (a new client, so a new connection and handshake).
async fn epp_answers_over_tls(epp: &str, ca: &pki::TestCa) -> bool {
    let root = reqwest::Certificate::from_pem(ca.pem().as_bytes()).expect("CA pem");
    let c = reqwest::Client::builder().tls_certs_only([root]).http2_prior_knowledge().build().expect("client");
    // grpc.health.v1 HealthCheckRequest { service: "liveness" }, framed.
    let mut check = vec![0, 0, 0, 0, 10, 0x0a, 8];
    check.extend_from_slice(b"liveness");
    let call = c
        .post(format!("https://{epp}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(check)
        .send();
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Ok(r)) => r.bytes().await.is_ok_and(|b| b.as_ref() == [0, 0, 0, 0, 2, 0x08, 0x01]),
        _ => false,
    }
}

/// `kvroute serve --tls-cert --tls-key`: HTTPS from the start; a certificate renewed in
/// place is served after SIGHUP, to new connections, and the process keeps running. With
/// `--epp-tls` the endpoint picker's listener serves the same certificate, renewed with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_certificate_is_reloaded_on_sighup() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = pki::scratch_dir("serve-tls");
    let (ca1, ca2) = (pki::TestCa::new("first CA"), pki::TestCa::new("second CA"));
    let (crt, key) = ca1.server_cert(dir.path(), "router");
    let port = free_port();
    let epp = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--port", &port.to_string(), "--tls-cert", crt.to_str().expect("utf8")])
        .args(["--tls-key", key.to_str().expect("utf8"), "--epp-listen", &epp, "--epp-tls"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut router = Proc(child);
    let url = format!("https://127.0.0.1:{port}");
    // One new client (so one new connection and handshake) per check.
    let answers = |ca: &pki::TestCa| {
        let c = pki::client_trusting(ca, true);
        let url = url.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(10), c.get(format!("{url}/health")).send())
                .await
                .is_ok_and(|r| r.is_ok_and(|r| r.status() == 200))
        }
    };
    let mut up = false;
    for _ in 0..600 {
        if answers(&ca1).await {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "kvroute serve never answered over HTTPS");
    assert!(!answers(&ca2).await);
    assert!(epp_answers_over_tls(&epp, &ca1).await, "the endpoint picker serves the main port's certificate");
    assert!(!epp_answers_over_tls(&epp, &ca2).await);

    let (crt2, key2) = ca2.server_cert(dir.path(), "renewed");
    std::fs::rename(&crt2, &crt).expect("replace certificate");
    std::fs::rename(&key2, &key).expect("replace key");
    let pid = router.0.id().to_string();
    assert!(Command::new("kill").args(["-HUP", &pid]).status().expect("kill").success());
    let mut renewed = false;
    for _ in 0..200 {
        if answers(&ca2).await {
            renewed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(renewed, "the renewed certificate was not served after SIGHUP");
    assert!(!answers(&ca1).await, "the old certificate is still served to new connections");
    assert!(epp_answers_over_tls(&epp, &ca2).await, "the endpoint picker serves the renewed certificate");
    assert!(!epp_answers_over_tls(&epp, &ca1).await);
    assert!(router.0.try_wait().expect("wait").is_none(), "SIGHUP ended the process");
}

/// `GET /policy`'s policy name, `None` while the router does not answer.
async fn policy_name(c: &reqwest::Client, url: &str) -> Option<String> {
    let v: serde_json::Value = c.get(format!("{url}/policy")).send().await.ok()?.json().await.ok()?;
    v["policy"].as_str().map(String::from)
}

/// `kvroute serve --config FILE`: SIGHUP reads the file again with the flags on top — a new
/// policy applies live, `--port` still wins over the file (so no key is reported as needing
/// a restart), and an invalid file is refused naming the key while the policy stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_file_with_the_flags_on_top() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = pki::scratch_dir("serve-reload");
    let cfg = dir.path().join("kvroute.toml");
    let log = dir.path().join("stderr.log");
    std::fs::write(&cfg, "policy = \"round_robin\"\n").expect("write");
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--config", cfg.to_str().expect("utf8"), "--port", &port.to_string()])
        .env("KVROUTE_LOG", "info")
        .env("KVROUTE_ADMIN_TOKEN", common::ADMIN_TOKEN)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn");
    let mut router = Proc(child);
    let url = format!("http://127.0.0.1:{port}");
    let c = common::client();
    let hup = |router: &Proc| {
        let pid = router.0.id().to_string();
        assert!(Command::new("kill").args(["-HUP", &pid]).status().expect("kill").success());
    };
    // Each wait is bounded (30 s), a failure rather than a timing assertion.
    let mut up = None;
    for _ in 0..600 {
        up = policy_name(&c, &url).await;
        if up.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(up.as_deref(), Some("round_robin"));

    std::fs::write(&cfg, "policy = \"least_load\"\n").expect("write");
    hup(&router);
    let mut switched = false;
    for _ in 0..600 {
        if policy_name(&c, &url).await.as_deref() == Some("least_load") {
            switched = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(switched, "the new policy was not applied after SIGHUP");

    std::fs::write(&cfg, "policy = \"no_such_policy\"\n").expect("write");
    hup(&router);
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    for _ in 0..600 {
        if read().contains("configuration not reloaded") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = read();
    assert!(text.contains("configuration not reloaded"), "no error logged for the invalid file: {text}");
    assert!(text.contains("`policy`") && text.contains("no_such_policy"), "{text}");
    assert!(!text.contains("need a restart"), "the --port flag was not applied again: {text}");
    assert_eq!(policy_name(&c, &url).await.as_deref(), Some("least_load"), "an invalid file changed the policy");
    assert!(router.0.try_wait().expect("wait").is_none(), "SIGHUP ended the router");
}

/// The router's workers (`GET /list_workers`, SGLang router).
async fn list_urls(c: &reqwest::Client, url: &str) -> Vec<String> {
    let workers: serde_json::Value =
        c.get(format!("{url}/list_workers")).send().await.expect("list").json().await.expect("json");
    workers["urls"].as_array().expect("urls").iter().filter_map(|u| u.as_str().map(String::from)).collect()
}

/// Fails unless every worker of `urls` stops answering within 10 s (`why`: what stopped it).
async fn assert_gone(c: &reqwest::Client, urls: &[String], why: &str) {
    for u in urls {
        let mut gone = false;
        for _ in 0..200 {
            if c.get(format!("{u}/health")).send().await.is_err() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(gone, "launched worker {u} still running after {why}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn co_launched_workers_serve_and_stop_with_the_router() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let port = free_port();
    let bin = env!("CARGO_BIN_EXE_kvroute");
    let a = [
        "serve",
        "--port",
        &port.to_string(),
        "--policy",
        "cache_aware",
        "--health-interval-secs",
        "0.5",
        "--launch-workers",
        "2",
        "--worker-cmd",
        &format!("{bin} engine-sim --port {{port}} --time-scale 50"),
    ];
    let mut router = common::spawn_kvroute(&a.map(String::from));
    let url = format!("http://127.0.0.1:{port}");
    let c = common::client();
    assert!(wait_ready(&c, &url).await, "router with co-launched workers never became ready");
    let urls = list_urls(&c, &url).await;
    assert_eq!(urls.len(), 2);

    // Remove and re-add a worker while requests are flowing: every request gets a clean answer.
    let load = tokio::spawn({
        let c = c.clone();
        let url = url.clone();
        async move {
            let mut statuses = Vec::new();
            for i in 0..60 {
                let r = tokio::time::timeout(
                    Duration::from_secs(60),
                    c.post(format!("{url}/v1/chat/completions")).json(&chat(i)).send(),
                )
                .await
                .expect("hang guard")
                .expect("send");
                statuses.push(r.status().as_u16());
                let _ = r.bytes().await;
            }
            statuses
        }
    });
    for _ in 0..3 {
        let r = c.post(format!("{url}/remove_worker?url={}", urls[0])).send().await.expect("remove");
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(30)).await;
        let r = c.post(format!("{url}/add_worker?url={}", urls[0])).send().await.expect("add");
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let statuses = load.await.expect("join");
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    // SIGHUP without TLS: logged and ignored, the router keeps serving.
    let pid = router.0.id();
    assert!(Command::new("kill").args(["-HUP", &pid.to_string()]).status().expect("kill").success());
    let r = c.post(format!("{url}/v1/chat/completions")).json(&chat(0)).send().await.expect("served after SIGHUP");
    assert_eq!(r.status(), 200);
    assert!(router.0.try_wait().expect("wait").is_none(), "SIGHUP ended the router");

    // SIGTERM: the router drains and its launched workers go away with it.
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let status = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Some(s) = router.0.try_wait().expect("wait") {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("router exits on SIGTERM");
    assert!(status.success(), "{status}");
    assert_gone(&c, &urls, "the router stopped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_dp_size_launches_one_worker_per_rank_and_a_killed_router_leaves_none() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let port = free_port();
    let bin = env!("CARGO_BIN_EXE_kvroute");
    let dir = tempfile::tempdir().expect("dir");
    // Each rank writes what it was given ({rank}, {gpu}, {model_path}, CUDA_VISIBLE_DEVICES),
    // then becomes an engine-sim.
    let cmd = format!(
        "sh -c 'echo {{rank}} {{gpu}} {{model_path}} $CUDA_VISIBLE_DEVICES > {}/rank{{rank}}; exec {bin} engine-sim --port {{port}} --time-scale 50'",
        dir.path().display()
    );
    let a = ["serve", "--port", &port.to_string(), "--dp-size", "2", "--model-path", "m/odel", "--worker-cmd", &cmd];
    let mut router = common::spawn_kvroute(&a.map(String::from));
    let url = format!("http://127.0.0.1:{port}");
    let c = common::client();
    assert!(wait_ready(&c, &url).await, "router with --dp-size 2 never became ready");
    let urls = list_urls(&c, &url).await;
    assert_eq!(urls.len(), 2, "{urls:?}");
    for rank in 0..2 {
        let seen = std::fs::read_to_string(dir.path().join(format!("rank{rank}"))).expect("the rank's file");
        assert_eq!(seen.trim(), format!("{rank} {rank} m/odel {rank}"));
    }
    // SIGKILL: no drain, no cleanup code; the kernel's parent-death signal takes the workers.
    router.0.kill().expect("SIGKILL");
    let _ = router.0.wait();
    assert_gone(&c, &urls, "the router was killed").await;
}
