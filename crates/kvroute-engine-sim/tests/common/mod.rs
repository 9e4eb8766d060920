//! The harness both engine-sim test binaries share: a simulated worker on an ephemeral
//! 127.0.0.1 port, stopped on drop, and its HTTP client calls under a hang guard (a
//! failure, not a timing assertion).

use kvroute_engine_sim::{self as engine_sim, EngineSim, EngineSimConfig};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A running simulated worker.
pub struct Sim {
    /// Its base URL.
    pub url: String,
    /// Its shared state (counters).
    pub sim: Arc<EngineSim>,
    /// The configuration it was started with.
    #[allow(dead_code)] // not every test binary reads it
    pub cfg: EngineSimConfig,
    stop: CancellationToken,
    c: reqwest::Client,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts a simulated worker with `cfg`.
pub async fn sim(cfg: EngineSimConfig) -> Sim {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop = CancellationToken::new();
    let (url, sim) = engine_sim::spawn_local(cfg.clone(), stop.clone()).await.expect("start a simulated worker");
    Sim { url, sim, cfg, stop, c: reqwest::Client::new() }
}

/// `f`, or a failure after 60 s.
async fn guard<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f).await.expect("hang guard")
}

impl Sim {
    /// POST `body` to `path`: status and body text.
    pub async fn post_text(&self, path: &str, body: &Value) -> (u16, String) {
        guard(async {
            let r = self.c.post(format!("{}{path}", self.url)).json(body).send().await.expect("send");
            (r.status().as_u16(), r.text().await.expect("body"))
        })
        .await
    }

    /// POST `body` to `path`: status and JSON body.
    #[allow(dead_code)] // not every test binary posts for JSON
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_text(path, body).await;
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    /// GET `path` as text (a 200 is required).
    pub async fn get_text(&self, path: &str) -> String {
        guard(async {
            let r = self.c.get(format!("{}{path}", self.url)).send().await.expect("send");
            assert_eq!(r.status(), 200, "GET {path}");
            r.text().await.expect("body")
        })
        .await
    }
}
