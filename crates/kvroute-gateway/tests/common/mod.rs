//! Helpers shared by the gateway's integration tests.

use std::time::Duration;

/// Starts the gateway with `cfg` on an ephemeral port until `stop`; returns its URL once it
/// answers `/health` (or after 4 s of trying) and the serving task.
pub async fn start_router(
    cfg: kvroute_gateway::GatewayConfig,
    stop: tokio_util::sync::CancellationToken,
) -> (String, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let router = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(kvroute_gateway::serve(listener, cfg, async move { stop.cancelled().await }));
    let c = reqwest::Client::new();
    for _ in 0..200 {
        if c.get(format!("{router}/health")).send().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (router, task)
}
