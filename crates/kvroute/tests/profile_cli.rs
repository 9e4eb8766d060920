//! `kvroute profile show`: a profile's predictions at given points and against a measured
//! grid, its constants as TOML that `--profile-file` reads back, and clear errors.

use std::process::{Command, Output, Stdio};

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute")).args(args).stdin(Stdio::null()).output().expect("run kvroute")
}

fn grid() -> String {
    format!("{}/../../data/gpu/h100-llama3-8b-prefill-grid.jsonl", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn points_are_predicted_and_a_continued_prefill_costs_more_per_new_token() {
    let out = kvroute(&["profile", "show", "h100-llama3-8b", "--prefill", "0,256", "--prefill", "32768,256", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = v["prefill"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0]["cached"].as_u64(), rows[0]["new"].as_u64()), (Some(0), Some(256)));
    let (fresh, continued) = (rows[0]["prefill_s"].as_f64().expect("s"), rows[1]["prefill_s"].as_f64().expect("s"));
    assert!(fresh > 0.0 && continued > fresh, "256 new tokens after 32k cached cost more: {fresh} vs {continued}");
    assert_eq!(v["profile"]["name"], "h100-llama3-8b");
}

#[test]
fn the_grid_is_compared_point_by_point_and_the_toml_round_trips() {
    let out = kvroute(&["profile", "show", "h100-llama3-8b", "--grid", &grid(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = v["prefill"].as_array().expect("rows");
    assert_eq!(rows.len(), 30, "every grid line of the H100 grid");
    for r in rows {
        let (s, m, e) = (r["prefill_s"].as_f64(), r["measured_s"].as_f64(), r["error"].as_f64());
        let (s, m, e) = (s.expect("predicted"), m.expect("measured"), e.expect("error"));
        assert!((s / m - 1.0 - e).abs() < 1e-9, "{r}");
    }
    // The TOML of a profile, changed and read back as a file, is that profile.
    let toml = kvroute(&["profile", "show", "a100-llama3-8b", "--toml"]);
    assert!(toml.status.success());
    let text = String::from_utf8(toml.stdout).expect("utf-8").replace("kv_tokens = 420000", "kv_tokens = 1234");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("p.toml");
    std::fs::write(&file, text).expect("write");
    let out = kvroute(&["profile", "show", "h100-llama3-8b", "--profile-file", file.to_str().expect("path"), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["profile"]["name"], "a100-llama3-8b");
    assert_eq!(v["profile"]["kv_tokens"], 1234);
}

#[test]
fn bad_input_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "kv_tokens = 0\n").expect("write");
    let unknown = dir.path().join("unknown.toml");
    std::fs::write(&unknown, "prefill_per_tokn_s = 1\n").expect("write");
    for (args, says) in [
        (vec!["profile", "show", "no-such"], "unknown profile `no-such`"),
        (vec!["profile", "show", "h100-llama3-8b", "--prefill", "12"], "expected CACHED,NEW"),
        (vec!["profile", "show", "h100-llama3-8b", "--prefill", "1,0"], "NEW must be"),
        (vec!["profile", "show", "h100-llama3-8b", "--profile-file", bad.to_str().expect("p")], "kv_tokens"),
        (
            vec!["profile", "show", "h100-llama3-8b", "--profile-file", unknown.to_str().expect("p")],
            "line 1: unknown field `prefill_per_tokn_s`",
        ),
    ] {
        let out = kvroute(&args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn constants_of_the_wrong_kind_are_named_with_what_they_must_be() {
    // These said only `invalid number`, or `invalid type: null, expected f64` for nan/inf.
    let dir = tempfile::tempdir().expect("tempdir");
    for (i, (content, says)) in [
        ("kv_tokens = -5", "kv_tokens: must be a whole number from 0 to 18446744073709551615, got -5"),
        ("kv_tokens = 1.5", "kv_tokens: must be a whole number from 0 to 18446744073709551615, got 1.5"),
        ("slots = -1", "slots: must be a whole number from 0 to 4294967295, got -1"),
        ("step_overhead_s = nan", "step_overhead_s: must be a finite number, got NaN"),
        ("step_overhead_s = -inf", "step_overhead_s: must be a finite number, got -inf"),
        ("step_overhead_s = \"x\"", "step_overhead_s: must be a number, got \"x\""),
    ]
    .into_iter()
    .enumerate()
    {
        let file = dir.path().join(format!("p{i}.toml"));
        // A good constant first: the error names the bad one's line.
        std::fs::write(&file, format!("max_batch = 64\n{content}\n")).expect("write");
        let file = file.to_str().expect("path");
        let out = kvroute(&["profile", "show", "h100-llama3-8b", "--profile-file", file]);
        assert!(!out.status.success(), "{content}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("--profile-file {file}: line 2: {says}")), "{content}: {err}");
    }
    let out = kvroute(&["profile", "show", "h100-llama3-8b", "--profile-set", r#"{"kv_tokens": -1}"#]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--profile-set: kv_tokens: must be a whole number"), "{err}");
}

#[test]
fn a_grid_without_grid_points_is_refused() {
    // Both ran with no comparison and exit 0.
    let dir = tempfile::tempdir().expect("tempdir");
    for (i, content) in ["", "{\"event\":\"other\"}\n"].into_iter().enumerate() {
        let file = dir.path().join(format!("g{i}.jsonl"));
        std::fs::write(&file, content).expect("write");
        let file = file.to_str().expect("path");
        let out = kvroute(&["profile", "show", "h100-llama3-8b", "--grid", file, "--json"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(&format!("--grid {file}: no grid points")), "{content:?}: {err}");
    }
}
