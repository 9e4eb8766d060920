//! `kvroute bench` and `kvroute bench compare` as processes: a synthetic workload against an
//! engine-sim worker (JSON and plots written, every request recorded), clear errors on bad
//! input, and the comparison run to completion (with the peer routers when
//! `KVROUTE_PEERS_DIR` points at their venvs; `KVROUTE_REQUIRE_PEERS=1` makes them mandatory).

use std::process::{Command, Output, Stdio};
use std::time::Duration;

mod common;
use common::{Proc, free_port};

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute")).args(args).stdin(Stdio::null()).output().expect("run kvroute")
}

#[expect(clippy::disallowed_methods, reason = "a plain blocking test helper, outside any runtime")]
fn wait_health(url: &str) {
    for _ in 0..300 {
        if std::net::TcpStream::connect(url.trim_start_matches("http://")).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{url} did not come up");
}

/// An engine-sim process at 50× real time on a free port, and its URL once it accepts
/// connections.
fn engine_sim() -> (Proc, String) {
    let port = free_port();
    let sim = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["engine-sim", "--port", &port.to_string(), "--time-scale", "50"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn engine-sim"),
    );
    let url = format!("http://127.0.0.1:{port}");
    wait_health(&url);
    (sim, url)
}

#[test]
fn bench_records_every_request_and_writes_json_and_plots() {
    let (_sim, url) = engine_sim();
    let dir = tempfile::Builder::new().prefix("kvroute-bench-cli-").tempdir().expect("temp dir");
    let json = dir.path().join("run.json");
    let out = kvroute(&[
        "bench",
        "--url",
        &url,
        "--workload",
        "shared-prefix",
        "--groups",
        "2",
        "--prompts-per-group",
        "3",
        "--system-tokens",
        "300",
        "--question-tokens",
        "10",
        "--output-tokens",
        "3",
        "--rate",
        "20",
        "--latency-scale",
        "50",
        "--json",
        json.to_str().expect("utf-8"),
        "--plots",
        dir.path().to_str().expect("utf-8"),
        "--quiet",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("TTFT p99"), "table printed: {stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("json");
    assert_eq!(v["summary"]["requests"], 6);
    assert_eq!(v["summary"]["ok"], 6);
    assert_eq!(v["summary"]["errors"], 0);
    assert_eq!(v["requests"].as_array().map(Vec::len), Some(6));
    for r in v["requests"].as_array().expect("records") {
        assert_eq!(r["outcome"]["kind"], "ok");
        assert!(r["ttft_s"].as_f64().is_some_and(|t| t > 0.0));
        assert_eq!(r["output_tokens"], 3);
    }
    // The model was discovered from /v1/models; the later questions of each group hit the
    // cached system prompt.
    assert!(v["summary"]["cached_token_ratio"].as_f64().is_some_and(|c| c > 0.2), "{}", v["summary"]);
    if kvroute_sim_font_available() {
        assert!(dir.path().join("bench_ttft_cdf.png").exists() && dir.path().join("bench_ttft_cdf.svg").exists());
    }
}

fn kvroute_sim_font_available() -> bool {
    [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

/// A Mooncake-format trace of three stand-in sessions (depth-2 prefix groups [0, 1], [0, 2],
/// [0, 3]): session 1 has three requests at 1–3 s, session 2 one at 2 s, session 3 two at
/// 4 s and 30 s.
fn sessions_trace(path: &std::path::Path) {
    let line = |t: u64, blocks: &[u64]| {
        format!(
            "{{\"timestamp\": {t}, \"input_length\": {}, \"output_length\": 2, \"hash_ids\": {blocks:?}}}\n",
            512 * blocks.len()
        )
    };
    let body = [
        line(1000, &[0, 1]),
        line(2000, &[0, 2]),
        line(2500, &[0, 1, 10]),
        line(3000, &[0, 1, 10, 11]),
        line(4000, &[0, 3]),
        line(30000, &[0, 3, 20]),
    ]
    .concat();
    std::fs::write(path, body).expect("write trace");
}

#[test]
fn a_trace_slice_sends_only_the_sessions_chosen() {
    let (_sim, url) = engine_sim();
    let dir = tempfile::Builder::new().prefix("kvroute-bench-slice-").tempdir().expect("temp dir");
    let trace = dir.path().join("sessions.jsonl");
    sessions_trace(&trace);
    let json = dir.path().join("run.json");
    // The first 10 s, sessions with at least 2 requests in them: session 1 only (session 3's
    // second request is at 30 s).
    let out = kvroute(&[
        "bench",
        "--url",
        &url,
        "--trace",
        trace.to_str().expect("utf-8"),
        "--trace-window",
        "10",
        "--min-turns",
        "2",
        "--block-tokens",
        "16",
        "--rate-scale",
        "20",
        "--json",
        json.to_str().expect("utf-8"),
        "--quiet",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{err}", String::from_utf8_lossy(&out.stdout));
    // Session 1: 32 + 48 + 64 tokens after scaling 512-token blocks to 16; the second and
    // third requests find 32 and 48 of them in an infinite cache: 80 / 144 = 55.6 %.
    assert!(err.contains("trace: 3 requests, 1 sessions, 144 prompt tokens, infinite-cache bound 55.6 %"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("json");
    assert_eq!(v["summary"]["requests"], 3);
    assert_eq!(v["summary"]["ok"], 3);
    // Bad slices name the flag.
    let t = trace.to_str().expect("utf-8");
    let out = kvroute(&["bench", "--url", &url, "--trace", t, "--trace-window", "0"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--trace-window must be a positive number"));
    let out = kvroute(&["bench", "--url", &url, "--trace", t, "--trace-start", "-1"]);
    assert!(!out.status.success());
    let out = kvroute(&["bench", "--url", &url, "--trace", t, "--min-turns", "4"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the trace slice"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_input_gets_a_clear_message() {
    let out = kvroute(&["bench", "--url", "http://127.0.0.1:9"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exactly one of --trace FILE or --workload"));
    let out = kvroute(&["bench"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--url is required"));
    let bad = tempfile::Builder::new().prefix("kvroute-bad-trace-").suffix(".jsonl").tempfile().expect("temp file");
    std::fs::write(bad.path(), "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": \"ten\"}\n")
        .expect("write trace");
    let out = kvroute(&["bench", "--url", "http://127.0.0.1:9", "--trace", bad.path().to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(":2") && err.contains("input_length"), "names the line and field: {err}");
    let out = kvroute(&["bench", "--url", "http://127.0.0.1:9", "--workload", "poisson", "--rate", "0"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rate must be a positive number"));
    let out = kvroute(&["bench", "compare", "--peers", "haproxy"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown peer `haproxy`"));
}

#[test]
fn compare_runs_to_completion() {
    let peers_dir = std::env::var("KVROUTE_PEERS_DIR").ok().filter(|d| !d.is_empty());
    if peers_dir.is_none() && std::env::var("KVROUTE_REQUIRE_PEERS").is_ok_and(|v| v == "1") {
        panic!("KVROUTE_REQUIRE_PEERS=1 but KVROUTE_PEERS_DIR is not set");
    }
    // Dynamo (NVIDIA's selection service behind scripts/dynamo-shim.py) when its venv is there.
    let dynamo = peers_dir.as_ref().is_some_and(|d| std::path::Path::new(d).join("dynamo/bin/python").exists());
    let peers = match (&peers_dir, dynamo) {
        (Some(_), true) => "sglang-router,vllm-router,smg,dynamo",
        (Some(_), false) => "sglang-router,vllm-router,smg",
        (None, _) => "",
    };
    // The JSON and the log directory (`--log-dir`, created by the run) in one scratch dir.
    let scratch = tempfile::Builder::new().prefix("kvroute-compare-").tempdir().expect("temp dir");
    let json = scratch.path().join("compare.json");
    let logs = scratch.path().join("logs");
    let mut args = vec![
        "bench",
        "compare",
        "--log-dir",
        logs.to_str().expect("utf-8"),
        "--requests",
        "40",
        "--overhead-secs",
        "0.3",
        "--policies",
        "round_robin,cache_aware",
        "--peer-policies",
        "cache_aware",
        "--time-scale",
        "50",
        "--json",
        json.to_str().expect("utf-8"),
        "--quiet",
        "--peers",
        peers,
    ];
    let dir;
    if let Some(d) = &peers_dir {
        dir = d.clone();
        args.extend(["--peers-dir", dir.as_str()]);
    }
    let out = kvroute(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("| router | policy |"), "one table: {stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("json");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2 + if peers_dir.is_some() { 3 } else { 0 } + usize::from(dynamo));
    for r in rows {
        assert!(r["skipped"].is_null(), "{} {} skipped: {}", r["router"], r["policy"], r["skipped"]);
        assert_eq!(r["quality"]["requests"], 40, "{r}");
        assert_eq!(r["quality"]["ok"], 40, "{r}");
        assert!(r["hit_ratio"].as_f64().is_some());
        assert!(r["overhead_c1"]["ok"].as_u64().is_some_and(|n| n > 0));
        let shares: f64 = r["worker_share"].as_array().expect("shares").iter().filter_map(|x| x.as_f64()).sum();
        assert!((shares - 1.0).abs() < 1e-6, "shares sum to 1: {shares}");
    }
}

#[test]
fn bench_decision_prints_one_json_object_per_policy_and_fleet_size() {
    let out = kvroute(&[
        "bench",
        "decision",
        "--workers",
        "4,16",
        "--policy",
        "round_robin,kv_score",
        "--decisions",
        "200",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
        .collect();
    assert_eq!(rows.len(), 4);
    for r in &rows {
        let ns = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
        assert!(ns("p50_ns") > 0 && ns("p50_ns") <= ns("p99_ns") && ns("p99_ns") <= ns("p999_ns"), "{r}");
        assert!(r["policy"].is_string() && r["workers"].is_u64(), "{r}");
    }
    // kv_score indexes the warming trace; round robin keeps no index.
    assert!(rows.iter().any(|r| r["policy"] == "kv_score" && r["index_size"].as_u64() > Some(0)));
    assert!(rows.iter().all(|r| r["policy"] != "round_robin" || r["index_size"] == 0));
    let bad = kvroute(&["bench", "decision", "--policy", "no_such_policy"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown policy `no_such_policy`"));
    let huge = kvroute(&["bench", "decision", "--prompt-tokens", "4000000000"]);
    assert!(String::from_utf8_lossy(&huge.stderr).contains("--prompt-tokens: from 1 to"), "refused before allocating");
    let spread = kvroute(&["bench", "decision", "--in-flight-spread", "0"]);
    assert!(String::from_utf8_lossy(&spread.stderr).contains("--in-flight-spread: from 1 to 256"));
    // A busy fleet: the spread is echoed.
    let busy = kvroute(&[
        "bench",
        "decision",
        "--workers",
        "300",
        "--policy",
        "kv_score",
        "--decisions",
        "20",
        "--in-flight-spread",
        "97",
        "--cold-probe",
        "--json",
    ]);
    assert!(busy.status.success(), "{}", String::from_utf8_lossy(&busy.stderr));
    let r: serde_json::Value = serde_json::from_slice(&busy.stdout).expect("one JSON object");
    assert_eq!((&r["in_flight_spread"], &r["cold_probe"]), (&serde_json::json!(97), &serde_json::json!(true)), "{r}");
}

#[test]
fn bench_decision_with_the_gateway_decides_on_a_fleet_of_that_size_and_its_kept_views() {
    let out = kvroute(&[
        "bench",
        "decision",
        "--workers",
        "3,9",
        "--policy",
        "least_load,least_ttft",
        "--decisions",
        "50",
        "--gateway",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    assert_eq!(rows.iter().map(|r| r["workers"].as_u64()).collect::<Vec<_>>(), [Some(3), Some(3), Some(9), Some(9)]);
    assert!(rows.iter().all(|r| r["gateway"] == true && r["p50_ns"].as_u64() > Some(0)), "{rows:?}");
    // The gateway's kept views carry least_ttft's digest; least_load reads none.
    let digest =
        |policy: &str| rows.iter().filter(|r| r["policy"] == policy).map(|r| r["digest"].clone()).collect::<Vec<_>>();
    assert_eq!(digest("least_ttft"), [true, true], "{rows:?}");
    assert_eq!(digest("least_load"), [false, false], "{rows:?}");
    let fresh = kvroute(&[
        "bench",
        "decision",
        "--workers",
        "9",
        "--policy",
        "least_ttft",
        "--decisions",
        "20",
        "--gateway",
        "--no-digest",
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_slice(&fresh.stdout).expect("one JSON object");
    assert_eq!((&r["gateway"], &r["digest"]), (&serde_json::json!(true), &serde_json::json!(false)), "{r}");
    let big = kvroute(&["bench", "decision", "--workers", "5000", "--gateway"]);
    assert!(
        String::from_utf8_lossy(&big.stderr).contains("at most 4096 workers"),
        "{}",
        String::from_utf8_lossy(&big.stderr)
    );
}

#[test]
fn bench_kv_events_ingests_every_engines_batches_and_decides_on_what_they_stored() {
    let out = kvroute(&["bench", "kv-events", "--engines", "8", "--seconds", "0.2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(f("ingest_alone_block_events_per_s") > 0.0 && f("ingest_while_deciding_block_events_per_s") > 0.0, "{r}");
    for phase in ["decision_alone", "decision_while_ingesting"] {
        let p = &r[phase];
        assert!(p["decisions"].as_u64() > Some(0) && p["p50_ns"].as_u64() <= p["p99_ns"].as_u64(), "{r}");
    }
    // Every engine's system prompt (64 blocks) and chains were stored, chained on a known
    // parent each time, and the cycle's removals found their blocks.
    assert!(r["index"]["stored"].as_u64() > Some(8 * 64), "{r}");
    assert!(r["index"]["removed"].as_u64() > Some(0), "{r}");
    assert_eq!(r["index"]["unknown_parent"], 0, "{r}");
    // What the decisions read is real: engine 0 holds the probe's system prompt, 64 blocks
    // of 16 tokens, and none of its 8 new blocks.
    assert_eq!(r["probe_cached_tokens_on_engine_0"], 64 * 16, "{r}");
    let big = kvroute(&["bench", "kv-events", "--engines", "65536"]);
    assert!(String::from_utf8_lossy(&big.stderr).contains("pre-encoded events; at most"), "refused before encoding");
}

#[test]
fn bench_kv_events_through_zeromq_reaches_a_router_that_applies_every_batch() {
    // Four engines' PUB sockets on 127.0.0.1, a router in the bench's process subscribing
    // to each (its own subscribers and applier), a few hundred batches at a low rate.
    let args = ["bench", "kv-events", "--engines", "4", "--seconds", "0.5", "--zmq", "--rate", "4000", "--json"];
    let out = kvroute(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let sent = r["batches_sent"].as_u64().expect("batches_sent");
    assert!(sent > 0, "{r}");
    // Everything published reached the router's index, in order, decoded.
    assert_eq!(r["batches_applied_after_2s"].as_u64(), Some(sent), "{r}");
    assert_eq!((r["gaps"].as_u64(), r["errors"].as_u64()), (Some(0), Some(0)), "{r}");
    let bad = kvroute(&["bench", "kv-events", "--engines", "4", "--zmq", "--rate", "0"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--rate"), "a clear error");
}
