//! `kvroute replay` as a process: the same seed gives the same JSON bytes, an arrival seed
//! gives another realisation of the same trace, and bad flag combinations are refused with
//! a message.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A small Mooncake-format trace: 120 requests in bursts of 6 per whole second, two
/// conversations' worth of shared prefixes, so spreading and routing both matter.
fn trace(dir: &Path) -> PathBuf {
    let mut body = String::new();
    for i in 0..120u64 {
        let group = i % 4;
        let turn = i / 4;
        let hashes: Vec<u64> =
            [group * 1000, group * 1000 + 1].into_iter().chain((0..turn % 5).map(|t| group * 1000 + 10 + t)).collect();
        body.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 20, \"hash_ids\": {:?}}}\n",
            (i / 6) * 1000,
            hashes.len() * 512,
            hashes
        ));
    }
    let p = dir.join("burst.jsonl");
    std::fs::write(&p, body).expect("write trace");
    p
}

/// A fresh directory under the system temp dir for one test, removed when the guard drops
/// (also on a panic).
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("kvroute-replay-cli-{name}-")).tempdir().expect("scratch dir")
}

fn replay(trace: &Path, json: &Path, extra: &[&str]) -> std::process::Output {
    replay_on_two(trace, json, &["--policy", "prefill_cost,round_robin", "--rate-scale", "4"], extra)
}

/// `kvroute replay --quiet --engines 2` of `trace` with `head` then `extra`, JSON to `json`.
fn replay_on_two(trace: &Path, json: &Path, head: &[&str], extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["replay", "--quiet", "--engines", "2"])
        .args(head)
        .arg("--trace")
        .arg(trace)
        .arg("--json")
        .arg(json)
        .args(extra)
        .output()
        .expect("run kvroute replay")
}

fn ttfts(json: &Path) -> (String, Vec<f64>) {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json).expect("read json")).expect("json");
    let arrivals = v["arrivals"].as_str().expect("arrivals").to_string();
    let means =
        v["reports"].as_array().expect("reports").iter().map(|r| r["ttft_mean_s"].as_f64().expect("mean")).collect();
    (arrivals, means)
}

#[test]
fn arrival_seeds_are_reproducible_realisations_of_one_trace() {
    let dir = scratch("realisations");
    let t = trace(dir.path());
    let out = |name: &str| dir.path().join(name);
    for (name, extra) in [
        ("even1", &[][..]),
        ("even2", &[][..]),
        ("a1", &["--arrival-seed", "1"][..]),
        ("a1b", &["--arrival-seed", "1"][..]),
        ("a2", &["--arrival-seed", "2"][..]),
    ] {
        let o = replay(&t, &out(name), extra);
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let bytes = |name: &str| std::fs::read(out(name)).expect("read");
    assert_eq!(bytes("even1"), bytes("even2"), "same flags, same bytes");
    assert_eq!(bytes("a1"), bytes("a1b"), "same arrival seed, same bytes");
    let (even, even_ttft) = ttfts(&out("even1"));
    let (a1, a1_ttft) = ttfts(&out("a1"));
    let (_, a2_ttft) = ttfts(&out("a2"));
    assert_eq!(even, "even spread");
    assert_eq!(a1, "random spread, seed 1");
    assert_eq!(even_ttft.len(), 2);
    assert_ne!(a1_ttft, even_ttft, "random instants change the outcome");
    assert_ne!(a1_ttft, a2_ttft, "another seed, another realisation");
}

#[test]
fn an_arrival_seed_with_no_spread_is_refused() {
    let dir = scratch("conflict");
    let t = trace(dir.path());
    let o = replay(&t, &dir.path().join("x.json"), &["--arrival-seed", "1", "--no-spread"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--arrival-seed") && err.contains("--no-spread"), "{err}");
}

#[test]
fn a_host_slowdown_that_is_not_a_slow_down_is_refused_and_a_measured_one_replays() {
    let dir = scratch("slowdown");
    let t = trace(dir.path());
    let bad = replay(&t, &dir.path().join("x.json"), &["--host-slowdown", "1,0"]);
    let ok = replay(&t, &dir.path().join("y.json"), &["--host-slowdown", "1,1.06,1.5,2.1"]);
    let (_, slowed) = ttfts(&dir.path().join("y.json"));
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--host-slowdown") && err.contains('0'), "{err}");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(!slowed.is_empty() && slowed.iter().all(|x| x.is_finite() && *x > 0.0), "{slowed:?}");
}

#[test]
fn a_trace_slice_replays_only_its_sessions_from_time_zero_and_outputs_are_capped() {
    let dir = scratch("slice");
    let t = trace(dir.path());
    let json = dir.path().join("slice.json");
    // Seconds 5 to 15 of the trace (60 requests, 15 per group): groups are the sessions.
    let out =
        replay(&t, &json, &["--trace-start", "5", "--trace-window", "10", "--min-turns", "15", "--max-output", "7"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).expect("json")).expect("parse");
    assert_eq!(v["requests"], 60, "{v}");
    for r in v["reports"].as_array().expect("reports") {
        assert_eq!(r["requests"], 60);
        let tok = r["throughput_tok_s"].as_f64().expect("tok/s");
        assert!(tok > 0.0);
    }
    // Longer than any session in the span: nothing left, said so.
    let out = replay(&t, &json, &["--trace-start", "5", "--trace-window", "10", "--min-turns", "16"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no requests"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = replay(&t, &json, &["--max-output", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-output"));
}

#[test]
fn slot_routing_runs_every_policy_on_a_slotted_profile_and_is_refused_without_slots() {
    let dir = scratch("slots");
    let t = trace(dir.path());
    let json = dir.path().join("slots.json");
    let o = replay(&t, &json, &["--profile", "cpu-smollm2-135m", "--prefix-state", "approximate,slots"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).expect("read json")).expect("json");
    let mut labels: Vec<String> = v["reports"]
        .as_array()
        .expect("reports")
        .iter()
        .map(|r| r["policy"].as_str().expect("policy").to_string())
        .collect();
    labels.sort();
    // round_robin is prefix-blind, but the slot it takes changes its hits: it runs twice.
    assert_eq!(labels, ["prefill_cost", "prefill_cost/slots", "round_robin", "round_robin/slots"]);
    let o = replay(&t, &dir.path().join("h100.json"), &["--prefix-state", "slots"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--prefix-state slots") && err.contains("h100-llama3-8b"), "{err}");
}

#[test]
fn a_kv_oracle_replay_is_labelled_as_a_bound_and_refused_where_there_is_no_paged_cache() {
    let dir = scratch("oracle");
    let t = trace(dir.path());
    let ok = replay(&t, &dir.path().join("x.json"), &["--kv-oracle", "fleet"]);
    let slots = replay(&t, &dir.path().join("y.json"), &["--kv-oracle", "store", "--profile", "cpu-smollm2-135m"]);
    let bad = replay(&t, &dir.path().join("z.json"), &["--kv-oracle", "everything"]);
    let v: Option<serde_json::Value> =
        std::fs::read(dir.path().join("x.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let v = v.expect("the oracle replay's JSON");
    let labels: Vec<&str> =
        v["reports"].as_array().expect("reports").iter().map(|r| r["policy"].as_str().expect("policy")).collect();
    assert_eq!(labels, ["prefill_cost/oracle-fleet", "round_robin/oracle-fleet"]);
    assert!(!slots.status.success());
    let err = String::from_utf8_lossy(&slots.stderr);
    assert!(err.contains("--kv-oracle") && err.contains("slots"), "{err}");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("everything"));
}

/// A Mooncake-format trace of one hot document: 40 requests, one every 8 s, three in four
/// on a 1,536-token document (three 512-token blocks), the rest on five cold ones, each
/// with its own 64-token question (a partial fourth block).
fn hot_document(dir: &Path) -> PathBuf {
    let mut body = String::new();
    for k in 0..40u64 {
        let doc = if k % 4 == 3 { 1 + (k / 4) % 5 } else { 0 };
        let hashes = [100 * doc, 100 * doc + 1, 100 * doc + 2, 10_000 + k];
        body.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": 1600, \"output_length\": 8, \"hash_ids\": {:?}}}\n",
            8_000 * k,
            hashes
        ));
    }
    let p = dir.join("hot.jsonl");
    std::fs::write(&p, body).expect("write trace");
    p
}

#[test]
fn kv_migration_restores_on_a_hot_document_and_is_refused_without_slots() {
    let dir = scratch("kv");
    let t = hot_document(dir.path());
    let run =
        |json: &str, extra: &[&str]| replay_on_two(&t, &dir.path().join(json), &["--policy", "least_ttft"], extra);
    let cpu = ["--profile", "cpu-smollm2-135m", "--prefix-state"];
    let plain = run("slots.json", &[&cpu[..], &["slots"]].concat());
    let kv = run("kv.json", &[&cpu[..], &["slots", "--kv-migration"]].concat());
    let no_slots = run("x.json", &[&cpu[..], &["approximate", "--kv-migration"]].concat());
    let gpu = run("y.json", &["--kv-migration", "--profile", "h100-llama3-8b"]);
    let read = |name: &str| -> Option<serde_json::Value> {
        std::fs::read(dir.path().join(name)).ok().and_then(|b| serde_json::from_slice(&b).ok())
    };
    let (a, b) = (read("slots.json"), read("kv.json"));
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    assert!(kv.status.success(), "{}", String::from_utf8_lossy(&kv.stderr));
    let (a, b) = (a.expect("the slots replay's JSON"), b.expect("the kv replay's JSON"));
    let (a, b) = (&a["reports"][0], &b["reports"][0]);
    assert_eq!(a["policy"], "least_ttft/slots");
    assert_eq!(b["policy"], "least_ttft/slots+kv");
    assert!(a.get("kv_restores").is_none(), "{a}");
    let restores = b["kv_restores"].as_u64().expect("kv_restores");
    assert!(restores > 0 && b["kv_saves"].as_u64().expect("kv_saves") > 0, "{b}");
    let mean = |r: &serde_json::Value| r["ttft_mean_s"].as_f64().expect("ttft_mean_s");
    assert!(mean(b) < mean(a), "mean TTFT {} s with --kv-migration, {} s without", mean(b), mean(a));
    assert!(String::from_utf8_lossy(&kv.stdout).contains("kv migration"), "the table has the mover's lines");
    for (o, what) in [(&no_slots, "--prefix-state slots"), (&gpu, "h100-llama3-8b")] {
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--kv-migration") && err.contains(what), "{err}");
    }
}

#[test]
fn kv_pull_runs_on_the_precise_state_reports_its_pulls_and_refuses_the_rest() {
    let dir = scratch("kv-pull");
    let t = trace(dir.path());
    let head = ["--policy", "least_ttft,round_robin", "--rate-scale", "4"];
    let run = |json: &str, extra: &[&str]| replay_on_two(&t, &dir.path().join(json), &head, extra);
    let ok = run("pull.json", &["--prefix-state", "precise", "--kv-pull", "50"]);
    let approximate = run("x.json", &["--kv-pull", "50"]);
    let zero = run("y.json", &["--prefix-state", "precise", "--kv-pull", "0"]);
    let slots = run("z.json", &["--prefix-state", "precise", "--kv-pull", "50", "--profile", "cpu-smollm2-135m"]);
    let json: Option<serde_json::Value> =
        std::fs::read(dir.path().join("pull.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let json = json.expect("the replay's JSON");
    let reports = json["reports"].as_array().expect("reports");
    let labels: Vec<&str> = reports.iter().filter_map(|r| r["policy"].as_str()).collect();
    assert_eq!(labels, ["least_ttft/precise+pull", "round_robin/pull"]);
    for r in reports {
        assert!(r["kv_pulls"].as_u64().is_some() && r["kv_pulled_tokens"].as_u64().is_some(), "{r}");
    }
    assert!(String::from_utf8_lossy(&ok.stdout).contains("KV pulls"), "the table has the pulls' lines");
    for (o, what) in [(&approximate, "--prefix-state precise"), (&zero, "positive"), (&slots, "slots")] {
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--kv-pull") && err.contains(what), "{err}");
    }
}

/// Inputs that saturated the nanosecond clock (and hung the replay at 100 % CPU) are refused
/// before replaying, naming the line and field, the flag or the knob.
#[test]
fn arrivals_past_the_clock_and_tiny_eviction_intervals_are_refused() {
    let dir = scratch("saturate");
    let json = dir.path().join("out.json");
    let big = dir.path().join("big.jsonl");
    std::fs::write(&big, "{\"timestamp\": 2e13, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n")
        .expect("write trace");
    let out = replay_on_two(&big, &json, &["--policy", "round_robin"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("big.jsonl:1: field `timestamp`"), "{err}");
    let t = trace(dir.path());
    for (head, what) in [
        (&["--policy", "round_robin", "--rate-scale", "1e-300"][..], "--rate-scale: "),
        (&["--policy", "round_robin", "--rate-scale", "1e-6"][..], "--rate-scale: "),
        (&["--policy", "cache_aware", "--knobs", "{\"eviction_interval_secs\": 1e-10}"][..], "eviction_interval_secs"),
    ] {
        let out = replay_on_two(&t, &json, head, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(what), "{head:?}: {err}");
    }
}

#[test]
fn a_sample_fraction_outside_zero_to_one_is_refused_naming_the_flag() {
    // NaN and 2 ran as 1 without a word; -1 said "no requests left after sampling".
    let dir = scratch("sample");
    let t = trace(dir.path());
    let json = dir.path().join("out.json");
    for bad in ["NaN", "2", "-1", "0", "inf"] {
        let out = replay_on_two(&t, &json, &["--policy", "round_robin"], &[&format!("--sample={bad}")]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--sample: ") && err.contains("(0, 1]"), "{bad}: {err}");
    }
    let out = replay_on_two(&t, &json, &["--policy", "round_robin"], &["--sample", "0.5"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn slo_bounds_that_are_not_positive_seconds_are_refused_naming_the_flag() {
    // -1 and NaN made good/s 0.00, inf counted every request, without a word.
    let dir = scratch("slo");
    let t = trace(dir.path());
    let json = dir.path().join("out.json");
    for (bad, flag) in
        [("--slo-ttft=-1", "--slo-ttft: "), ("--slo-ttft=NaN", "--slo-ttft: "), ("--slo-tpot=inf", "--slo-tpot: ")]
    {
        let out = replay_on_two(&t, &json, &["--policy", "round_robin"], &[bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(flag) && err.contains("> 0"), "{bad}: {err}");
    }
}

/// `kvroute replay … | head -1`: a reader that closes the pipe before the table is printed
/// ends the replay quietly (success, as `kvroute policies`), where `println!`'s panic
/// printed a panic message and a backtrace (exit 101).
#[test]
fn a_closed_pipe_ends_the_replay_without_a_panic() {
    let dir = scratch("closed-pipe");
    let t = trace(dir.path());
    // The read end is closed before the child starts: every write it makes fails with EPIPE.
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["replay", "--engines", "2", "--policy", "round_robin", "--trace"])
        .arg(&t)
        .stdout(std::process::Stdio::from(writer))
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}
