//! `kvroute engine-sim --role prefill|decode` as processes: the role flags reach the worker
//! (`/server_info`, `/metrics`), an SGLang-style request sent to both at once is decoded
//! with the prefill's KV, and role flags that make no sense are refused.

use std::process::Command;
use std::time::Duration;

mod common;
use common::{free_port, spawn_kvroute, wait_ok};

async fn post(c: &reqwest::Client, url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    tokio::time::timeout(Duration::from_secs(60), async {
        let r = c.post(url).json(body).send().await.expect("send");
        (r.status().as_u16(), r.json().await.expect("json"))
    })
    .await
    .expect("hang guard")
}

async fn get_json(c: &reqwest::Client, url: &str) -> serde_json::Value {
    c.get(url).send().await.expect("send").json().await.expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_and_a_decode_process_hand_the_kv_over() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (pp, dp, bp) = (free_port(), free_port(), free_port());
    let args = |port: u16, extra: &[&str]| -> Vec<String> {
        ["engine-sim", "--port", &port.to_string(), "--time-scale", "100"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let _p = spawn_kvroute(&args(
        pp,
        &["--role", "prefill", "--bootstrap-port", &bp.to_string(), "--kv-link-gbytes-per-s", "50"],
    ));
    let _d = spawn_kvroute(&args(dp, &["--role", "decode", "--bootstrap-port", "0", "--bootstrap-timeout-secs", "30"]));
    let (prefill, decode) = (format!("http://127.0.0.1:{pp}"), format!("http://127.0.0.1:{dp}"));
    wait_ok(&prefill, "/health").await;
    wait_ok(&decode, "/health").await;
    let c = reqwest::Client::new();
    let (pi, di) =
        (get_json(&c, &format!("{prefill}/server_info")).await, get_json(&c, &format!("{decode}/server_info")).await);
    assert_eq!(pi["disaggregation_mode"], "prefill");
    assert_eq!(pi["disaggregation_bootstrap_port"], bp);
    assert_eq!(di["disaggregation_mode"], "decode");
    assert!(di["disaggregation_bootstrap_port"].as_u64().is_some_and(|p| p > 0), "{di}");
    let body = serde_json::json!({"model": "sim-llama-3-8b", "prompt": "a shared system prompt ".repeat(400),
        "max_tokens": 6, "bootstrap_host": "127.0.0.1", "bootstrap_port": bp, "bootstrap_room": 4242});
    let (pu, du) = (format!("{prefill}/v1/completions"), format!("{decode}/v1/completions"));
    let ((ps, pv), (ds, dv)) = tokio::join!(post(&c, &pu, &body), post(&c, &du, &body));
    assert_eq!((ps, ds), (200, 200), "{pv}\n{dv}");
    assert_eq!(pv["usage"]["completion_tokens"], 1);
    assert_eq!(dv["usage"]["completion_tokens"], 6);
    let tokens = dv["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    let m = c.get(format!("{decode}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert!(m.contains("kvroute_sim_pd_transfers_total 1"), "{m}");
    assert!(m.contains(&format!("kvroute_sim_pd_transfer_bytes_total {}", tokens * 131_072)), "{m}");
    assert!(m.contains("kvroute_sim_role{role=\"decode\"} 1"), "{m}");
}

#[test]
fn role_flags_that_make_no_sense_are_refused() {
    for (flags, expected) in [
        (&["--bootstrap-port", "9000"][..], "--bootstrap-port needs --role prefill or decode"),
        (&["--role", "prefill", "--kv-link-gbytes-per-s", "0"][..], "--kv-link-gbytes-per-s"),
        (&["--role", "decode", "--bootstrap-timeout-secs", "0"][..], "--bootstrap-timeout-secs"),
        (&["--role", "middle"][..], "--role"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["engine-sim", "--port", "0"])
            .args(flags)
            .output()
            .expect("run kvroute engine-sim");
        assert!(!out.status.success(), "{flags:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{flags:?}: {err}");
    }
}
