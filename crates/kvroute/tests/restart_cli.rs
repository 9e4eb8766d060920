//! A router restarted with the same `state_dir` routes on the prefix state it had: each
//! document goes back to the worker that holds it, with its prefix matched, where a router
//! started without that state matches nothing.

mod common;

use common::{Proc, client};
use std::process::Command;
use std::time::Duration;

/// A router on `workers` with `state_dir` (decision headers exposed, drain delay 0).
async fn router(workers: &str, state_dir: &std::path::Path) -> (Proc, String) {
    let dir = state_dir.to_str().expect("utf-8");
    let a =
        ["--worker-urls", workers, "--expose-decision-headers", "true", "--state-dir", dir, "--drain-delay-secs", "0"];
    common::serve(&a).await
}

/// Sends document `d` with `question`; returns the worker and the decision header.
async fn ask(router: &str, d: usize, question: &str) -> (String, String) {
    let doc = format!("document {d}: ") + &format!("section {d} of a long shared text about caches. ").repeat(60);
    let body = serde_json::json!({
        "model": "sim-llama-3-8b",
        "messages": [{"role": "user", "content": format!("{doc}\n{question}")}],
        "max_tokens": 2,
    });
    let r = client().post(format!("{router}/v1/chat/completions")).json(&body).send().await.expect("send");
    assert_eq!(r.status(), 200);
    let h = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    (h("x-kvroute-worker"), h("x-kvroute-decision"))
}

/// `matched=N/M` of a decision header: N.
fn matched(decision: &str) -> u64 {
    decision
        .split("matched=")
        .nth(1)
        .and_then(|m| m.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no matched= in `{decision}`"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_routes_on_the_prefix_state_it_saved() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (_engines, urls) = common::engine_sims(3, "50").await;
    let workers = urls.join(",");
    let dir = tempfile::tempdir().expect("state dir");
    let (first, url) = router(&workers, dir.path()).await;
    let mut placed = Vec::new();
    for d in 0..6 {
        placed.push(ask(&url, d, "first question").await.0);
    }
    // SIGTERM: the router drains and writes its prefix state on the way out.
    let pid = first.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let mut first = first;
    for _ in 0..600 {
        if first.0.try_wait().expect("wait").is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(first.0.try_wait().expect("wait").is_some(), "the router did not exit within 30 s of SIGTERM");
    assert!(dir.path().join("prefix-state.msgpack").exists(), "the prefix state was saved");

    let (_second, url) = router(&workers, dir.path()).await;
    // Ready only once the saved state is restored: /workers says how much, and how old.
    let w: serde_json::Value =
        client().get(format!("{url}/workers")).send().await.expect("workers").json().await.expect("json");
    assert_eq!(w["prefix_state"]["restored"], true, "{w}");
    assert_eq!(w["prefix_state"]["restored_events"], 6, "{w}");
    assert!(w["prefix_state"]["restored_age_secs"].as_u64().is_some_and(|a| a < 600), "{w}");
    for (d, was) in placed.iter().enumerate() {
        let (worker, decision) = ask(&url, d, "second question").await;
        assert_eq!(&worker, was, "document {d} back on its worker: {decision}");
        assert!(matched(&decision) > 0, "document {d} matched after the restart: {decision}");
    }
    // Control: a router without that state matches nothing on its first requests.
    let empty = tempfile::tempdir().expect("state dir");
    let (_third, url) = router(&workers, empty.path()).await;
    let (_, decision) = ask(&url, 0, "second question").await;
    assert_eq!(matched(&decision), 0, "a fresh router matched something: {decision}");
}
