//! `kvroute policies` as a process: a reader that closes the pipe early.

use std::process::{Command, Stdio};

#[test]
fn a_closed_pipe_ends_the_listing_without_a_panic() {
    for json in [false, true] {
        // The read end is closed before the child starts: every write it makes fails with EPIPE,
        // as under `kvroute policies | head -1` once head has exited.
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
        cmd.arg("policies");
        if json {
            cmd.arg("--json");
        }
        let out = cmd.stdout(Stdio::from(writer)).stderr(Stdio::piped()).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "json={json}: {:?}\n{err}", out.status);
        assert!(!err.contains("panicked"), "json={json}: {err}");
    }
}

#[test]
fn the_listing_names_each_policy_with_its_source_and_only_the_knobs_it_reads() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute")).args(["policies", "--json"]).output().expect("run");
    assert!(out.status.success());
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let by_name = |n: &str| list.as_array().expect("array").iter().find(|p| p["name"] == n).cloned().expect(n);
    for name in ["lmetric", "load_only", "sticky"] {
        let knobs: Vec<String> = by_name(name)["knobs"]
            .as_array()
            .expect("knobs")
            .iter()
            .map(|k| k["name"].as_str().expect("name").to_owned())
            .collect();
        assert!(!knobs.iter().any(|k| k == "overload_factor" || k == "hit_ratio_threshold"), "{name}: {knobs:?}");
    }
    let text = list.to_string();
    assert!(!text.to_lowercase().contains("seed 00"), "sources are named by their systems: {text}");
}
