//! A real etcd server for the cluster tests: the Debian `etcd-server` binary, given by
//! `KVROUTE_ETCD_BIN`, started on free 127.0.0.1 ports with its data in a temporary directory
//! and killed on drop.
//!
//! It runs with etcd's default gRPC keep-alive enforcement (no `--grpc-keepalive-*` flags:
//! a client pinging more often than every 5 s is sent GOAWAY `too_many_pings`), as
//! operators run it: a test must never pass only because its etcd tolerates a client that
//! a production etcd would disconnect.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The etcd binary from `KVROUTE_ETCD_BIN`; fails the test, naming the package, without it.
pub fn etcd_binary() -> String {
    match std::env::var("KVROUTE_ETCD_BIN") {
        Ok(p) if std::path::Path::new(&p).is_file() => p,
        _ => panic!(
            "this test needs a real etcd: install the Debian package etcd-server and run it with \
             KVROUTE_ETCD_BIN=$(command -v etcd) (scripts/test.sh does when it is set)"
        ),
    }
}

/// An ephemeral loopback port for etcd's peer listener, other than `client_port` (the
/// kernel can hand one port to two binds in a row once the first is released).
fn peer_port(client_port: u16) -> u16 {
    loop {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port");
        if port != client_port {
            return port;
        }
    }
}

/// A running etcd; killed and its data removed on drop.
pub struct Etcd {
    child: Child,
    /// Holds its data directory; removed when dropped, after `Drop` killed the child.
    _dir: tempfile::TempDir,
    /// Its client URL, `http://127.0.0.1:PORT`.
    pub url: String,
}

impl Etcd {
    /// Starts etcd with its client API on `client_port` and waits (bounded) until its
    /// `/health` answers.
    pub async fn start(client_port: u16) -> Etcd {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bin = etcd_binary();
        let peer = peer_port(client_port);
        let dir = tempfile::Builder::new().prefix(&format!("kvroute-etcd-{client_port}-")).tempdir().expect("temp dir");
        // A data directory etcd creates itself, as it would on a first start.
        let data = dir.path().join("data");
        let url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new(bin)
            .args(["--name", "kvroute-test", "--data-dir", data.to_str().expect("utf8")])
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("kvroute-test={peer_url}")])
            .args(["--logger", "zap", "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        let etcd = Etcd { child, _dir: dir, url };
        let c = reqwest::Client::new();
        for _ in 0..400 {
            let ok = c
                .get(format!("{}/health", etcd.url))
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return etcd;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("etcd on {} not healthy within 20 s", etcd.url);
    }

    /// An etcd client connected to this server.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.url.as_str()], None).await.expect("etcd client")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `_dir` is removed after this, when the fields drop.
    }
}
