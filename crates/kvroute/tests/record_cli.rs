//! `kvroute serve --record FILE`: live traffic through the gateway written as a trace that
//! keeps no text, shares leading block ids exactly where prompts share a prefix, counts the
//! worker's output tokens, keeps sessions, rotates at its size limit, replays with
//! `kvroute replay --trace`, and gets advice from `kvroute advise`. Real processes on 127.0.0.1; every wait has a hang guard.

use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::{Proc, free_port, spawn_kvroute, wait_ok};

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// A document of about 800 bytes whose words all carry `d`.
fn document(d: usize) -> String {
    (0..100).map(|i| format!("doc{d}w{} ", (i * 7919 + d * 31) % 997)).collect()
}

fn body(doc: &str, question: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 3, "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]})
}

/// Engine-sims and a router recording to `file` with `extra` flags, once ready.
async fn fleet(file: &std::path::Path, extra: &[&str]) -> (Vec<Proc>, String) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut procs = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..2 {
        let port = free_port();
        procs.push(spawn_kvroute(&args(&["engine-sim", "--port", &port.to_string(), "--time-scale", "50"])));
        urls.push(format!("http://127.0.0.1:{port}"));
    }
    for u in &urls {
        wait_ok(u, "/health").await;
    }
    let port = free_port();
    let mut a = args(&["serve", "--port", &port.to_string(), "--worker-urls", &urls.join(",")]);
    a.extend(args(&["--record", file.to_str().expect("utf-8")]));
    a.extend(args(extra));
    procs.push(spawn_kvroute(&a));
    let router = format!("http://127.0.0.1:{port}");
    wait_ok(&router, "/readiness").await;
    (procs, router)
}

/// The file's lines once it has `n` of them (fails after 30 s).
async fn lines(file: &std::path::Path, n: usize) -> Vec<serde_json::Value> {
    for _ in 0..300 {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let got: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if got.len() >= n {
            return got.iter().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{} did not reach {n} lines within 30 s", file.display());
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v["hash_ids"].as_array().expect("hash_ids").iter().map(|x| x.as_u64().expect("id")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_traffic_keeps_no_text_shares_prefix_ids_and_replays() {
    let dir = std::env::temp_dir().join(format!("kvroute-record-cli-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let file = dir.join("trace.jsonl");
    let (_procs, router) = fleet(&file, &["--record-block-tokens", "4"]).await;
    let c = reqwest::Client::new();
    let mut sent = 0;
    for d in 0..3 {
        for q in 0..4 {
            let mut req = c.post(format!("{router}/v1/chat/completions")).json(&body(
                &document(d),
                &format!("question {q}?"),
                q == 0,
            ));
            if d == 2 {
                req = req.header("x-session-id", "alice");
            }
            let r = tokio::time::timeout(Duration::from_secs(60), req.send()).await.expect("hang guard").expect("send");
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await.expect("body");
            sent += 1;
        }
    }
    let got = lines(&file, sent).await;
    assert_eq!(got.len(), sent);

    // No text: not one word of a document or question.
    let raw = std::fs::read_to_string(&file).expect("read");
    assert!(!raw.contains("doc0w") && !raw.contains("question"), "{raw}");

    // Requests of one document share their leading ids (the document is ~800 bytes, 16
    // bytes a block at 4 tokens); different documents share none.
    for d in 0..3 {
        let mine: Vec<Vec<u64>> = got[d * 4..d * 4 + 4].iter().map(ids).collect();
        for m in &mine {
            assert!(m.len() >= 45, "blocks of document {d}: {}", m.len());
            assert_eq!(m[..45], mine[0][..45], "document {d}'s requests share its blocks");
        }
    }
    assert_ne!(ids(&got[0])[0], ids(&got[4])[0]);
    for v in &got {
        assert_eq!(v["block_size"], 4);
        assert_eq!(v["output_length"], 3, "the worker's output tokens, streamed or not: {v}");
        let input = v["input_length"].as_u64().expect("input_length");
        assert!(input >= 4 * ids(v).len() as u64, "{v}");
    }
    // Sessions: the header's, and a prefix group otherwise; turns counted per session.
    let alice: Vec<&serde_json::Value> = got.iter().filter(|v| v["session_id"] == "alice").collect();
    assert_eq!(alice.len(), 4);
    assert_eq!(alice.iter().map(|v| v["turn_id"].as_u64().expect("turn")).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(got[0]["session_id"].as_str().expect("session").starts_with('p'));
    let t: Vec<f64> = got.iter().map(|v| v["timestamp"].as_f64().expect("timestamp")).collect();
    assert!(t.windows(2).all(|w| w[0] <= w[1]), "arrival order: {t:?}");

    // It replays.
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["replay", "--trace", file.to_str().expect("utf-8"), "--policy", "round_robin,cache_aware"])
        .args(["--engines", "2"])
        .stdin(Stdio::null())
        .output()
        .expect("run replay");
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("cache_aware"), "{stdout}");

    // And advice from it: on documents shared by several requests, a prefix-aware policy
    // beats round robin (which sends each document's requests to both engines).
    let advice = dir.join("advice.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["advise", "--trace", file.to_str().expect("utf-8"), "--engines", "2", "--realisations", "2"])
        .args(["--policies", "round_robin,cache_aware", "--current", "round_robin", "--no-knob-search"])
        .args(["--json", advice.to_str().expect("utf-8")])
        .stdin(Stdio::null())
        .output()
        .expect("run advise");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&advice).expect("advice written")).expect("json");
    assert_eq!(v["recommended"]["policy"], "cache_aware", "{stdout}");
    assert_eq!(v["ranking"].as_array().expect("ranking").len(), 2);
    assert!(v["mean_ttft_change_pct"].as_f64().expect("change") < 0.0, "{stdout}");
    assert!(stdout.contains("kvroute serve --policy cache_aware"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_rotates_at_its_size_limit_and_keeps_its_file_count() {
    let dir = std::env::temp_dir().join(format!("kvroute-record-rot-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let file = dir.join("trace.jsonl");
    let (_procs, router) =
        fleet(&file, &["--record-block-tokens", "2", "--record-max-bytes", "4096", "--record-files", "2"]).await;
    let c = reqwest::Client::new();
    // Each line carries ~140 ids of up to 16 digits (~2.5 KB): two lines pass 4 KiB.
    for i in 0..12 {
        let r = c
            .post(format!("{router}/v1/chat/completions"))
            .json(&body(&document(10 + i), "q", false))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
    }
    let rotated = dir.join("trace.jsonl.1");
    for _ in 0..300 {
        if rotated.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(rotated.exists(), "trace.jsonl.1 after 12 lines of ~3 KB");
    assert!(!dir.join("trace.jsonl.2").exists(), "two files kept in all");
    for f in [&file, &rotated] {
        let len = std::fs::metadata(f).expect("file").len();
        assert!(len <= 4096, "{} is {len} bytes", f.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn advise_refuses_bad_input_naming_the_flag() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mooncake_conversation_trace.jsonl");
    for (extra, says) in [
        (vec!["--policies", "no_such_policy"], "--policies: unknown policy `no_such_policy`"),
        (vec!["--realisations", "0"], "--realisations"),
        (vec!["--engines", "0"], "--engines"),
        (vec!["--current", "nope"], "--current"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["advise", "--trace", trace, "--limit", "50"])
            .args(&extra)
            .stdin(Stdio::null())
            .output()
            .expect("run advise");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["advise", "--trace", "/nonexistent/trace.jsonl"])
        .stdin(Stdio::null())
        .output()
        .expect("run advise");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--trace /nonexistent/trace.jsonl"));
}
