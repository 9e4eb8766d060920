//! `kvroute replay --pd P:D` as a process, on a slice of the vendored Mooncake trace: a
//! colocated 4-engine run and two disaggregated splits of the same 4 engines all report,
//! the split runs count their split requests and KV bytes, and bad PD flags are refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn mooncake() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/traces/mooncake_conversation_trace.jsonl")
}

/// A fresh directory under the system temp dir for one test, removed when the guard drops
/// (also on a panic).
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("kvroute-replay-pd-{name}-")).tempdir().expect("scratch dir")
}

/// `kvroute replay` on the first 600 requests of the Mooncake trace with `extra` flags.
fn replay(extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["replay", "--quiet", "--policy", "prefill_cost", "--limit", "600", "--rate-scale", "2"])
        .arg("--trace")
        .arg(mooncake())
        .args(extra)
        .output()
        .expect("run kvroute replay")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("read json")).expect("json")
}

#[test]
fn colocated_and_disaggregated_runs_of_one_slice_all_report() {
    let dir = scratch("runs");
    let mut docs = Vec::new();
    for (name, flags) in [
        ("colocated", &["--engines", "4"][..]),
        ("pd13", &["--pd", "1:3"][..]),
        ("pd22", &["--pd", "2:2", "--engines", "4"][..]),
    ] {
        let path = dir.path().join(format!("{name}.json"));
        let path_s = path.to_string_lossy().to_string();
        let out = replay(&[flags, &["--json", &path_s]].concat());
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(stdout.contains("prefill_cost"), "{name}: {stdout}");
        assert_eq!(stdout.contains("prefill/decode"), name != "colocated", "{name}: {stdout}");
        docs.push((name, json(&path)));
    }
    for (name, v) in &docs {
        assert_eq!(v["engines"], 4, "{name}");
        let r = &v["reports"][0];
        assert_eq!(r["requests"], 600, "{name}");
        assert!(r["completed"].as_u64().expect("completed") > 500, "{name}: {r}");
        assert!(r["hit_ratio"].as_f64().expect("hit ratio") > 0.0, "{name}: {r}");
        assert!(r["ttft_p50_s"].as_f64().expect("ttft") > 0.0, "{name}: {r}");
        assert!(r["goodput_rps"].as_f64().is_some(), "{name}: {r}");
        assert_eq!(r["worker_share"].as_array().map(Vec::len), Some(4), "{name}");
        if *name == "colocated" {
            assert!(r.get("pd").is_none() && v.get("pd").is_none(), "a colocated report keeps its shape: {r}");
            continue;
        }
        let pd = &r["pd"];
        let split = pd["split_requests"].as_u64().expect("split requests");
        let colocated = pd["colocated_requests"].as_u64().expect("colocated requests");
        assert!(split > 0, "{name}: {pd}");
        assert_eq!(split + colocated, 600, "{name}: {pd}");
        assert!(pd["transfer_bytes"].as_u64().expect("bytes") > 0, "{name}: {pd}");
        assert!(pd["transfer_mean_s"].as_f64().expect("transfer time") > 0.0, "{name}: {pd}");
        assert!(pd["prefill_busy"].as_f64().expect("busy") > 0.0, "{name}: {pd}");
        assert_eq!(pd["decode_policy"], "least_load");
        assert_eq!(pd["transfer"]["kv_bytes_per_token"], 131_072);
        assert_eq!(v["pd"]["prefill_engines"], if *name == "pd13" { 1 } else { 2 });
    }
    // Same trace, same split: the bytes copied do not depend on the P:D ratio.
    assert_eq!(docs[1].1["reports"][0]["pd"]["transfer_bytes"], docs[2].1["reports"][0]["pd"]["transfer_bytes"]);
}

#[test]
fn bad_pd_flags_are_refused_with_a_message() {
    for (flags, expected) in [
        (&["--pd", "1:3", "--engines", "8"][..], "--engines 8 disagrees with --pd 1:3"),
        (&["--pd", "0:4"][..], "at least one prefill and one decode engine"),
        (&["--pd", "two:2"][..], "expected P:D"),
        (&["--pd", "1:1", "--decode-policy", "nope"][..], "--decode-policy"),
        (&["--pd", "1:1", "--kv-link-gbytes-per-s", "0"][..], "--kv-link-gbytes-per-s"),
        (&["--pd", "1:1", "--kv-bytes-per-token", "0"][..], "--kv-bytes-per-token"),
        (&["--colocate-below-tokens", "100"][..], "--pd"),
        (&["--decode-policy", "random"][..], "--pd"),
    ] {
        let out = replay(flags);
        assert!(!out.status.success(), "{flags:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{flags:?}: {err}");
    }
}
