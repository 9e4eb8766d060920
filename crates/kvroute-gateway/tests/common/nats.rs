//! A real NATS server for the cluster-sync tests: the Debian `nats-server` binary, given by
//! `KVROUTE_NATS_BIN`, started on a free 127.0.0.1 port and killed on drop; and the
//! readings those tests share (a Prometheus series, the engines' prefix-cache hit ratio).
//! Included by the gateway's `tests/nats.rs` and the CLI's `tests/cluster_cli.rs`.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The nats-server binary from `KVROUTE_NATS_BIN`; fails the test, naming the package,
/// without it.
pub fn nats_binary() -> String {
    match std::env::var("KVROUTE_NATS_BIN") {
        Ok(p) if std::path::Path::new(&p).is_file() => p,
        _ => panic!(
            "this test needs a real NATS server: install the Debian package nats-server and run it with \
             KVROUTE_NATS_BIN=$(command -v nats-server) (scripts/test.sh does when it is set)"
        ),
    }
}

/// A running nats-server; killed on drop.
pub struct Nats {
    child: Child,
    /// Its client URL, `nats://127.0.0.1:PORT`.
    pub url: String,
}

impl Nats {
    /// Starts nats-server on `port` and waits (bounded) until it sends its `INFO` line.
    pub async fn start(port: u16) -> Nats {
        let child = Command::new(nats_binary())
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        let nats = Nats { child, url: format!("nats://127.0.0.1:{port}") };
        for _ in 0..400 {
            if let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 4];
                if matches!(tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut buf)).await, Ok(Ok(_)))
                    && &buf == b"INFO"
                {
                    return nats;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("nats-server on {port} did not answer within 20 s");
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sum of `series` (a name, or a name with the start of its labels) in `url`'s
/// `/metrics`.
pub async fn metric(c: &reqwest::Client, url: &str, series: &str) -> f64 {
    let text = c.get(format!("{url}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(series) && l[series.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The fleet's prefix-cache hit ratio of prompt tokens, from the engines' own counters.
pub async fn fleet_hit_ratio(workers: &[String]) -> f64 {
    let c = reqwest::Client::new();
    let (mut hits, mut queries) = (0.0, 0.0);
    for w in workers {
        hits += metric(&c, w, "vllm:prefix_cache_hits_total").await;
        queries += metric(&c, w, "vllm:prefix_cache_queries_total").await;
    }
    assert!(queries > 0.0, "the engines counted no prompt tokens");
    hits / queries
}
