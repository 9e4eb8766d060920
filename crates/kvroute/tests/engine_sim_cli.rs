//! `kvroute engine-sim` as a process: serves, reports prefix-cache hits, and crashes on
//! request when failure injection says so.

use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::{Proc, free_port};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_caches_prefixes_and_crashes_when_told() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["engine-sim", "--port", &port.to_string(), "--time-scale", "50", "--crash-after", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn engine-sim");
    let mut p = Proc(child);
    let base = format!("http://127.0.0.1:{port}");
    let c = reqwest::Client::new();
    let mut up = false;
    for _ in 0..300 {
        if c.get(format!("{base}/health")).send().await.is_ok_and(|r| r.status().is_success()) {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "engine-sim did not come up");
    let prompt = "A long shared system prompt about routing. ".repeat(60);
    let body = serde_json::json!({"model": "sim-llama-3-8b", "prompt": prompt, "max_tokens": 2});
    let mut cached = Vec::new();
    for _ in 0..2 {
        let r =
            tokio::time::timeout(Duration::from_secs(60), c.post(format!("{base}/v1/completions")).json(&body).send())
                .await
                .expect("hang guard")
                .expect("send");
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.expect("json");
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached"));
    }
    assert_eq!(cached[0], 0, "cold");
    assert!(cached[1] > 500, "warm repeat must hit the prefix cache: {cached:?}");
    // Third request: crash injected.
    let r = tokio::time::timeout(Duration::from_secs(60), c.post(format!("{base}/v1/completions")).json(&body).send())
        .await
        .expect("hang guard");
    assert!(r.is_err(), "the process should have exited");
    let status = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Some(s) = p.0.try_wait().expect("wait") {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("exit");
    assert_eq!(status.code(), Some(3));
}
