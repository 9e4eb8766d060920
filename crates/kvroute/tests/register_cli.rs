//! `kvroute register` against a real etcd (Debian `etcd-server`, given by `KVROUTE_ETCD_BIN`):
//! the worker's key exists while its `/health` passes, lapses with its lease when the worker
//! goes away, comes back with it, and is revoked at once when the sidecar stops.

use etcd_client::Client;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::{Proc, free_port};
#[path = "../../kvroute-gateway/tests/common/etcd.rs"]
mod etcd;

/// The registration's value, or `None` when the key does not exist.
async fn registration(c: &mut Client, key: &str) -> Option<(serde_json::Value, i64)> {
    let r = c.get(key, None).await.expect("get");
    let kv = r.kvs().first()?;
    Some((serde_json::from_slice(kv.value()).expect("JSON record"), kv.lease()))
}

/// Polls until `registration(key).is_some() == present`; fails after 30 s.
async fn wait_for(c: &mut Client, key: &str, present: bool) {
    for _ in 0..600 {
        if registration(c, key).await.is_some() == present {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} did not become {} within 30 s", if present { "present" } else { "absent" });
}

async fn serve_worker(listener: tokio::net::TcpListener, stop: CancellationToken) {
    let cfg = EngineSimConfig { time_scale: 50.0, ..EngineSimConfig::default() };
    tokio::spawn(engine_sim::serve(listener, cfg, async move { stop.cancelled().await }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (Debian etcd-server): KVROUTE_ETCD_BIN=$(command -v etcd) scripts/test.sh"]
async fn the_sidecar_registers_while_healthy_lets_the_lease_lapse_and_revokes_on_exit() {
    let e = etcd::Etcd::start(free_port()).await;
    let mut ec = e.client().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let url = format!("http://{addr}");
    let stop = CancellationToken::new();
    serve_worker(listener, stop.clone()).await;
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["register", "--etcd", &e.url, "--url", &url, "--ttl-secs", "3", "--check-interval-secs", "0.3"])
        .args(["--model", "sim-llama-3-8b", "--role", "decode", "--label", "zone=a", "--max-concurrent", "8"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut sidecar = Proc(child);
    let key = format!("/kvroute/workers/127.0.0.1_{}", addr.port());

    wait_for(&mut ec, &key, true).await;
    let (rec, lease) = registration(&mut ec, &key).await.expect("registered");
    assert_eq!(rec["url"], url.as_str());
    assert_eq!(rec["role"], "decode");
    assert_eq!(rec["models"][0], "sim-llama-3-8b");
    assert_eq!(rec["labels"]["zone"], "a");
    assert_eq!(rec["capacity"]["max_concurrent"], 8);
    assert_ne!(lease, 0, "the key is attached to a lease");

    // The worker goes away: the lease is no longer renewed and etcd deletes the key.
    stop.cancel();
    wait_for(&mut ec, &key, false).await;
    // It comes back on the same address: registered again under a new lease.
    let stop2 = CancellationToken::new();
    serve_worker(tokio::net::TcpListener::bind(addr).await.expect("rebind"), stop2.clone()).await;
    wait_for(&mut ec, &key, true).await;
    let (_, lease2) = registration(&mut ec, &key).await.expect("registered again");
    assert_ne!(lease2, lease, "a new lease after the lapse");

    // SIGTERM: the sidecar revokes its lease before it exits, so the key is gone at once
    // (without the revoke it would outlive the process by up to the 3 s TTL).
    let pid = sidecar.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let status = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Some(s) = sidecar.0.try_wait().expect("wait") {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the sidecar exits on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(registration(&mut ec, &key).await.is_none(), "the key outlived the sidecar: lease not revoked");
    let ttl = ec.lease_time_to_live(lease2, None).await.expect("ttl").ttl();
    assert_eq!(ttl, -1, "the lease was revoked");
    stop2.cancel();
}

#[test]
fn bad_flags_are_refused_naming_the_flag() {
    for (args, flag) in [
        (&["--url", "ftp://x:1"][..], "url"),
        (&["--url", "http://x:1", "--role", "leader"], "--role"),
        (&["--url", "http://x:1", "--ttl-secs", "1"], "--ttl-secs"),
        (&["--url", "http://x:1", "--label", "novalue"], "--label"),
        (&["--url", "http://x:1", "--dtype", "fp6"], "dtype"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["register", "--etcd", "http://127.0.0.1:1"])
            .args(args)
            .output()
            .expect("run");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
