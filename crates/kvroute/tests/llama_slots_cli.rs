//! `kvroute serve --llama-slot-routing auto` (the default) against engine simulators that
//! answer like llama-server (`--profile cpu-smollm2-135m`: `/props` with 2 slots, `id_slot`):
//! slot routing is turned on for the worker that keeps prompts only in its slots and left off
//! for the one with a host-memory prompt cache (`--host-prompt-cache`, as llama.cpp's
//! `--cache-ram`). The same check on real llama-servers is in `llama_e2e.rs`.

mod common;

use common::client;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_slot_routing_follows_each_workers_prompt_cache() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut procs = Vec::new();
    let mut urls = Vec::new();
    for host_cache in ["16", "0"] {
        let port = common::free_port();
        let args: Vec<String> = [
            "engine-sim",
            "--port",
            &port.to_string(),
            "--time-scale",
            "20",
            "--profile",
            "cpu-smollm2-135m",
            "--host-prompt-cache",
            host_cache,
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect();
        procs.push(common::spawn_kvroute(&args));
        urls.push(format!("http://127.0.0.1:{port}"));
    }
    for u in &urls {
        common::wait_ok(u, "/health").await;
    }
    let (_router, url) = common::serve(&["--worker-urls", &urls.join(",")]).await;
    let c = client();
    let flags = common::slot_routing_flags(&c, &url).await;
    assert_eq!(
        flags,
        [(serde_json::json!(true), serde_json::json!(false)), (serde_json::json!(false), serde_json::json!(true))]
    );
}
