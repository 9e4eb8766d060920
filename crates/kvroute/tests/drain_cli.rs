//! `kvroute serve` exits on SIGTERM within its drain deadline even when the NATS server of
//! its cluster sync and the etcd of its registry are gone: a replica with `--nats` used to
//! log "draining" and stay alive (a NATS flush waiting for a reconnect that never came)
//! until a second signal or the orchestrator's SIGKILL. Real nats-server and etcd (Debian
//! `nats-server`, `etcd-server`, given by `KVROUTE_NATS_BIN` and `KVROUTE_ETCD_BIN`);
//! ignored by default, run by `scripts/test.sh` when both are set (CI requires them). The
//! exit is awaited behind a hang guard far above the drain deadline; no assertion is on time.

use std::process::Command;
use std::time::Duration;

mod common;
use common::{free_port, spawn_kvroute, wait_ok};
#[allow(dead_code)] // only the server is used here
#[path = "../../kvroute-gateway/tests/common/etcd.rs"]
mod etcd;
#[allow(dead_code)] // only the server is used here
#[path = "../../kvroute-gateway/tests/common/nats.rs"]
mod nats;

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nats-server and etcd (Debian nats-server, etcd-server): KVROUTE_NATS_BIN and KVROUTE_ETCD_BIN, scripts/test.sh"]
async fn sigterm_exits_within_the_drain_deadline_with_nats_and_etcd_stopped() {
    let nats = nats::Nats::start(free_port()).await;
    let etcd = etcd::Etcd::start(free_port()).await;
    let wport = free_port();
    let _worker = spawn_kvroute(&args(&["engine-sim", "--port", &wport.to_string()]));
    let worker = format!("http://127.0.0.1:{wport}");
    wait_ok(&worker, "/health").await;
    let port = free_port();
    let mut a = args(&["serve", "--port", &port.to_string(), "--worker-urls", &worker]);
    a.extend(args(&["--nats", &nats.url, "--cluster", "drain-test", "--etcd", &etcd.url]));
    a.extend(args(&["--drain-timeout-secs", "3", "--drain-delay-secs", "1", "--health-interval-secs", "0.5"]));
    let mut router = spawn_kvroute(&a);
    let url = format!("http://127.0.0.1:{port}");
    // Ready: the NATS start-up snapshot is in and the worker is healthy.
    wait_ok(&url, "/readiness").await;
    // Both servers go away, then the orchestrator sends SIGTERM.
    drop(nats);
    drop(etcd);
    let pid = router.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let status = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(s) = router.0.try_wait().expect("wait") {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("hang guard: kvroute serve still running 60 s after SIGTERM (drain_timeout_secs is 3)");
    assert!(status.success(), "a drain that ran out is still a clean exit: {status}");
}
