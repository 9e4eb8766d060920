//! Cognitora cgn-router's kv_score through `kvroute serve`: replicas that list the same
//! workers in another order break ties alike, and prompts shorter than one block spread.

mod common;

use common::{Proc, client};

async fn router(workers: &[String]) -> (Proc, String) {
    common::serve(&["--worker-urls", &workers.join(","), "--policy", "kv_score", "--expose-decision-headers", "true"])
        .await
}

async fn worker_for(router: &str, prompt: &str) -> (String, String) {
    let body = serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1});
    let r = client().post(format!("{router}/v1/chat/completions")).json(&body).send().await.expect("send");
    assert_eq!(r.status(), 200);
    let h = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    (h("x-kvroute-worker"), h("x-kvroute-decision"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_reordered_workers_break_ties_alike_and_short_prompts_spread() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (_engines, urls) = common::engine_sims(4, "50").await;
    let (_a, a) = router(&urls).await;
    let reversed: Vec<String> = urls.iter().rev().cloned().collect();
    let (_b, b) = router(&reversed).await;
    let doc = "a long document that fills several blocks of the prefix hash. ".repeat(20);
    let mut short_workers = std::collections::HashSet::new();
    for i in 0..8 {
        // Idle workers, a prompt neither replica has seen: a tie, broken the same way.
        let prompt = format!("document {i}: {doc}");
        let (wa, da) = worker_for(&a, &prompt).await;
        let (wb, db) = worker_for(&b, &prompt).await;
        assert!(da.contains("branch=tie_break"), "{da}");
        assert_eq!(wa, wb, "prompt {i}: {da} / {db}");
        let (w, d) = worker_for(&a, &format!("hi {i}")).await;
        assert!(d.contains("branch=tie_break"), "{d}");
        short_workers.insert(w);
    }
    assert!(short_workers.len() > 1, "eight short prompts all went to {short_workers:?}");
}
