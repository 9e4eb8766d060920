//! End to end on real engines: `kvroute serve` in front of two llama.cpp `llama-server`
//! workers running a real model (SmolLM2-135M), with multi-turn conversations built from
//! the real MT-bench questions (`data/traces/mtbench_question.jsonl`, vendored).
//!
//! Turn 2 of a conversation re-sends turn 1's prompt, the model's answer and the second
//! question, so it shares turn 1's whole prompt as a prefix. llama.cpp reports how many
//! prompt tokens it served from its cache in `timings.cache_n`: exact proof of a hit.
//!
//! - `cache_aware`: every turn 2 must go to the worker of its turn 1 and reuse most of
//!   turn 1's prompt from the cache;
//! - `round_robin` with sequential requests: turn 2 lands on the other worker and reuses
//!   (almost) nothing;
//! - `--llama-slot-routing` on one worker with two documents: without it llama-server's
//!   slots swap the documents and both miss; with it each stays in its slot.
//! - the KV mover (`--kv-migration-dir`, workers with `--slot-save-path` on one directory):
//!   a document's slot is saved on the worker that ran it; with that worker gone, the next
//!   request on the document is restored into the other worker's slot and served from it.
//!
//! Needs `KVROUTE_LLAMA_SERVER` and `KVROUTE_LLAMA_MODEL` (set by `.ci/run` from
//! `scripts/llama-workers.sh paths`). Without them the test says it skipped, unless
//! `KVROUTE_REQUIRE_LLAMA=1`, which makes their absence a failure (CI sets it).

use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Conversations per policy (each is 2 requests).
const CONVERSATIONS: usize = 6;
/// Tokens generated per answer (small: the test is about prefill and routing).
const MAX_TOKENS: u32 = 12;

mod common;
use common::{Proc, free_port};

/// Why the tests of this file are ignored by default (`scripts/test.sh` runs them when the
/// variables are set, and lists them as skipped when they are not).
const NEEDS: &str =
    "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)";

/// The llama-server binary and model; a test of this file run without them fails (it was
/// asked for explicitly, so passing without running would be a lie).
fn llama_env() -> (PathBuf, PathBuf) {
    let bin = std::env::var_os("KVROUTE_LLAMA_SERVER").map(PathBuf::from);
    let model = std::env::var_os("KVROUTE_LLAMA_MODEL").map(PathBuf::from);
    match (bin, model) {
        (Some(b), Some(m)) if b.exists() && m.exists() => (b, m),
        _ => panic!("{NEEDS}: they are not set to existing files"),
    }
}

fn start_worker(bin: &PathBuf, model: &PathBuf, port: u16) -> Proc {
    start_worker_with_cache_ram(bin, model, port, "0")
}

/// A llama-server with `--cache-ram MIB` (its host-memory prompt cache; "0" turns it off).
fn start_worker_with_cache_ram(bin: &PathBuf, model: &PathBuf, port: u16, cache_ram_mib: &str) -> Proc {
    start_worker_with(bin, model, port, &["-np", "2", "--cache-ram", cache_ram_mib])
}

/// A llama-server (one thread, 4,096-token context) with `args` added.
fn start_worker_with(bin: &PathBuf, model: &PathBuf, port: u16, args: &[&str]) -> Proc {
    let child = Command::new(bin)
        .args(["-m"])
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["-t", "1", "-c", "4096", "--metrics", "--slots", "--no-webui"])
        .args(args)
        .args(["--alias", "smollm2", "--seed", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start llama-server");
    Proc(child)
}

async fn wait_healthy(client: &reqwest::Client, url: &str) {
    for _ in 0..600 {
        if let Ok(r) = client.get(format!("{url}/health")).send().await
            && r.status().is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{url} did not become healthy within 120 s");
}

fn mtbench() -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/mtbench_question.jsonl");
    let text = std::fs::read_to_string(path).expect("read mtbench_question.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let t = v["turns"].as_array()?;
            Some((t.first()?.as_str()?.to_owned(), t.get(1)?.as_str()?.to_owned()))
        })
        .collect()
}

/// A deterministic ~300-token reference document per conversation (as in workload (b)
/// of docs/real-engines.md, the peers' side-by-side measurement), so each conversation has a substantial prefix.
fn document(i: usize) -> String {
    const WORDS: &[&str] = &[
        "harbor", "lantern", "copper", "violet", "maple", "granite", "meadow", "engine", "bridge", "tower", "signal",
        "ledger", "archive", "compass", "anchor", "beacon", "orchard", "river", "mountain", "forest",
    ];
    let mut s = format!("Reference document {i}. ");
    let mut x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for _ in 0..220 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

struct Turn {
    worker: String,
    answer: String,
    prompt_tokens: u64,
    cache_n: u64,
}

async fn chat(client: &reqwest::Client, router: &str, messages: &Value) -> Turn {
    chat_decided(client, router, messages).await.0
}

/// [`chat`], with the response's `x-kvroute-decision` header (empty when the router does
/// not send it).
async fn chat_decided(client: &reqwest::Client, router: &str, messages: &Value) -> (Turn, String) {
    let body = json!({"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0});
    let resp = client.post(format!("{router}/v1/chat/completions")).json(&body).send().await.expect("send");
    assert!(resp.status().is_success(), "status {}", resp.status());
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let worker = header("x-kvroute-worker").expect("x-kvroute-worker header");
    let decision = header("x-kvroute-decision").unwrap_or_default();
    let v: Value = resp.json().await.expect("json body");
    let turn = Turn {
        worker,
        answer: v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned(),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        cache_n: v["timings"]["cache_n"].as_u64().expect("llama.cpp timings.cache_n"),
    };
    (turn, decision)
}

/// Runs `CONVERSATIONS` two-turn conversations (starting at question `offset`) through a
/// fresh `kvroute serve` with `policy` (and `extra` flags); returns (turn 1, turn 2) per
/// conversation and the router's `/metrics` text at the end.
async fn run_policy(policy: &str, workers: &[String], offset: usize, extra: &[&str]) -> (Vec<(Turn, Turn)>, String) {
    let port = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy])
        .args(["--expose-decision-headers", "true"])
        .args(extra)
        .arg("--worker-urls")
        .args(workers)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let _router = Proc(cmd.spawn().expect("start kvroute serve"));
    let router = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client");
    wait_healthy(&client, &router).await;

    let questions = mtbench();
    let mut out = Vec::new();
    for (i, (q1, q2)) in questions.iter().skip(offset).take(CONVERSATIONS).enumerate() {
        let system = json!({"role": "system", "content": document(offset + i)});
        let m1 = json!([system, {"role": "user", "content": q1}]);
        let t1 = chat(&client, &router, &m1).await;
        let m2 = json!([system, {"role": "user", "content": q1}, {"role": "assistant", "content": t1.answer},
                        {"role": "user", "content": q2}]);
        let t2 = chat(&client, &router, &m2).await;
        out.push((t1, t2));
    }
    let metrics = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    (out, metrics)
}

/// The value of the sample of `name` whose labels contain `label` (or any, when empty).
fn sample(metrics: &str, name: &str, label: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"]
async fn cache_aware_keeps_conversations_on_their_worker_and_round_robin_does_not() {
    let (bin, model) = llama_env();
    // reqwest is built without a default TLS provider (ring is chosen explicitly).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ports = [free_port(), free_port()];
    let _w: Vec<Proc> = ports.iter().map(|&p| start_worker(&bin, &model, p)).collect();
    let workers: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let client = reqwest::Client::new();
    for w in &workers {
        wait_healthy(&client, w).await;
    }

    // With the model's own tokenizer loaded locally (--tokenizer): routing keys carry the
    // worker's exact token ids, checked against each worker at startup.
    let model_arg = model.to_str().expect("utf-8 model path");
    let (aware, metrics) = run_policy("cache_aware", &workers, 0, &["--tokenizer", model_arg]).await;
    for w in &workers {
        assert_eq!(sample(&metrics, "kvroute_tokenizer_parity", w), Some(1.0), "parity with {w}:\n{metrics}");
    }
    let ok = sample(&metrics, "kvroute_local_tokenize_total", "outcome=\"ok\"");
    assert_eq!(ok, Some((2 * CONVERSATIONS) as f64), "every request tokenized locally:\n{metrics}");
    for (i, (t1, t2)) in aware.iter().enumerate() {
        eprintln!(
            "cache_aware conv {i}: turn1 {} ({} tok) turn2 {} ({} tok, cache_n {})",
            t1.worker, t1.prompt_tokens, t2.worker, t2.prompt_tokens, t2.cache_n
        );
        assert_eq!(t2.worker, t1.worker, "conversation {i}: turn 2 left its turn-1 worker");
        assert!(
            t2.cache_n * 10 >= t1.prompt_tokens * 9,
            "conversation {i}: turn 2 reused {} of turn 1's {} prompt tokens",
            t2.cache_n,
            t1.prompt_tokens
        );
    }
    let used: std::collections::BTreeSet<&str> = aware.iter().map(|(t1, _)| t1.worker.as_str()).collect();
    assert_eq!(used.len(), 2, "cold first turns should spread over both idle workers");

    let (rr, _) = run_policy("round_robin", &workers, CONVERSATIONS, &[]).await;
    for (i, (t1, t2)) in rr.iter().enumerate() {
        eprintln!(
            "round_robin conv {i}: turn1 {} ({} tok) turn2 {} ({} tok, cache_n {})",
            t1.worker, t1.prompt_tokens, t2.worker, t2.prompt_tokens, t2.cache_n
        );
        assert_ne!(t2.worker, t1.worker, "conversation {i}: sequential round robin must alternate workers");
        assert!(
            t2.cache_n * 2 < t1.prompt_tokens,
            "conversation {i}: turn 2 on another worker cannot reuse turn 1's prompt ({} of {})",
            t2.cache_n,
            t1.prompt_tokens
        );
    }
}

/// llama-server's own token ids of a chat: `/apply-template`, then `/tokenize` with special
/// tokens added and parsed (what its chat endpoint does).
async fn server_tokens(client: &reqwest::Client, url: &str, messages: &Value) -> Vec<u32> {
    let r: Value = client
        .post(format!("{url}/apply-template"))
        .json(&json!({"messages": messages}))
        .send()
        .await
        .expect("apply-template")
        .json()
        .await
        .expect("json");
    let prompt = r["prompt"].as_str().expect("prompt").to_owned();
    let r: Value = client
        .post(format!("{url}/tokenize"))
        .json(&json!({"content": prompt, "add_special": true, "parse_special": true}))
        .send()
        .await
        .expect("tokenize")
        .json()
        .await
        .expect("json");
    r["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().expect("id") as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"]
async fn local_gguf_tokenizer_gives_llama_servers_tokens_for_every_mtbench_conversation() {
    let (bin, model) = llama_env();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let port = free_port();
    let _w = start_worker(&bin, &model, port);
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
    wait_healthy(&client, &url).await;
    let tk = kvroute_gateway::tokenizer::LocalTokenizer::load(&model).expect("load the GGUF tokenizer");
    let questions = mtbench();
    assert!(questions.len() >= 80, "MT-bench has 80 two-turn questions, read {}", questions.len());
    let mut compared = 0;
    for (i, (q1, q2)) in questions.iter().enumerate() {
        // Turn 1 without a system message (the template adds its default one), turn 2 with a
        // reference document, an answer full of digits and punctuation, and the second question.
        let t1 = json!([{"role": "user", "content": q1}]);
        let t2 = json!([{"role": "system", "content": document(i)}, {"role": "user", "content": q1},
            {"role": "assistant", "content": format!("Answer {i}: 1,234.5 — \"quoted\", it's fine.\n\n- item")},
            {"role": "user", "content": q2}]);
        for messages in [t1, t2] {
            let local = tk
                .request_tokens(kvroute_protocol::openai::Api::Chat, &json!({"model": "smollm2", "messages": messages}))
                .expect("local tokens");
            let server = server_tokens(&client, &url, &messages).await;
            assert_eq!(local, server, "question {i}: local and llama-server tokens differ");
            compared += 1;
        }
    }
    // And the count the engine itself reports for a real chat request.
    let messages = json!([{"role": "user", "content": questions[0].0}]);
    let local = tk
        .request_tokens(kvroute_protocol::openai::Api::Chat, &json!({"model": "smollm2", "messages": messages}))
        .expect("local tokens");
    let r: Value = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "smollm2", "messages": messages, "max_tokens": 1}))
        .send()
        .await
        .expect("chat")
        .json()
        .await
        .expect("json");
    assert_eq!(r["usage"]["prompt_tokens"].as_u64(), Some(local.len() as u64));
    eprintln!("{compared} prompts: local tokens equal llama-server's");
}

/// One llama-server worker (2 slots, `--cache-ram 0`) behind `kvroute serve --policy
/// least_ttft` with or without `--llama-slot-routing`: documents A and B are run once each
/// (one per slot); a long streamed answer on A is decoding when another request on A
/// arrives; then one on B. Returns llama.cpp's `timings.cache_n` of those two, the prompt
/// tokens of the first request on A, and the router's `kvroute_llama_slot_waits_total`.
async fn two_documents_one_worker(bin: &PathBuf, model: &PathBuf, slot_routing: bool) -> (u64, u64, u64, f64) {
    use futures_util::StreamExt;
    let port = free_port();
    let _w = start_worker(bin, model, port);
    let worker = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client");
    wait_healthy(&client, &worker).await;
    let rport = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", &rport.to_string(), "--policy", "least_ttft"])
        .args(["--expose-decision-headers", "true"])
        .args(["--llama-slot-routing", if slot_routing { "true" } else { "false" }])
        .arg("--tokenizer")
        .arg(model)
        .args(["--worker-urls", &worker])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let _router = Proc(cmd.spawn().expect("start kvroute serve"));
    let router = format!("http://127.0.0.1:{rport}");
    wait_healthy(&client, &router).await;
    let ask = |doc: usize, question: &str| json!([{"role": "system", "content": document(doc)}, {"role": "user", "content": question}]);
    let first = chat(&client, &router, &ask(100, "Summarise the document.")).await;
    chat(&client, &router, &ask(101, "Summarise the document.")).await;
    // A long answer on A (EOS ignored): A's slot stays busy until the stream ends.
    let body = json!({"model": "smollm2", "messages": ask(100, "List every word of the document."), "max_tokens": 160,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let resp = client.post(format!("{router}/v1/chat/completions")).json(&body).send().await.expect("send");
    assert!(resp.status().is_success(), "status {}", resp.status());
    let mut chunks = resp.bytes_stream();
    chunks.next().await.expect("a first chunk").expect("chunk");
    let (c, r) = (client.clone(), router.clone());
    let m = ask(100, "Which word comes first?");
    let second = tokio::spawn(async move { chat(&c, &r, &m).await });
    while let Some(chunk) = chunks.next().await {
        chunk.expect("stream chunk");
    }
    let a = second.await.expect("join");
    let b = chat(&client, &router, &ask(101, "Which word comes last?")).await;
    let metrics = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    (a.cache_n, b.cache_n, first.prompt_tokens, sample(&metrics, "kvroute_llama_slot_waits_total", "").unwrap_or(0.0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"]
async fn llama_slot_routing_keeps_two_documents_in_their_slots_on_llama_server() {
    let (bin, model) = llama_env();
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Without slot routing llama-server puts the second request on A in B's idle slot
    // (recomputing A there), and the next request on B finds B in neither slot.
    let (a, b, prompt, waits) = two_documents_one_worker(&bin, &model, false).await;
    eprintln!("without slot routing: A cache_n {a}, B cache_n {b} (prompt {prompt} tokens), waits {waits}");
    assert!(a * 2 < prompt && b * 2 < prompt, "the slot swap: A {a}, B {b} of ~{prompt}");
    // With it, the request on A names A's slot and waits for it; B keeps its slot.
    let (a, b, prompt, waits) = two_documents_one_worker(&bin, &model, true).await;
    eprintln!("with slot routing: A cache_n {a}, B cache_n {b} (prompt {prompt} tokens), waits {waits}");
    assert!(a * 10 >= prompt * 8 && b * 10 >= prompt * 8, "kept in their slots: A {a}, B {b} of ~{prompt}");
    assert_eq!(waits, 1.0);
}

/// `--llama-slot-routing auto` (the default) on real llama-servers: the join probe finds
/// llama.cpp's host-memory prompt cache on a worker started with `--cache-ram 512` and
/// leaves slot routing off there, and finds none on a `--cache-ram 0` worker and turns it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"]
async fn llama_slot_routing_auto_tells_a_host_prompt_cache_from_none_on_llama_server() {
    let (bin, model) = llama_env();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (p1, p2) = (free_port(), free_port());
    let _w1 = start_worker_with_cache_ram(&bin, &model, p1, "512");
    let _w2 = start_worker_with_cache_ram(&bin, &model, p2, "0");
    let (w1, w2) = (format!("http://127.0.0.1:{p1}"), format!("http://127.0.0.1:{p2}"));
    let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client");
    wait_healthy(&client, &w1).await;
    wait_healthy(&client, &w2).await;
    let (rport, aport) = (free_port(), free_port());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", &rport.to_string()])
        .args(["--admin-listen", &format!("127.0.0.1:{aport}")])
        .args(["--worker-urls", &format!("{w1},{w2}")])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let admin = format!("http://127.0.0.1:{aport}");
    let _router = Proc(cmd.spawn().expect("start kvroute serve"));
    wait_healthy(&client, &format!("http://127.0.0.1:{rport}")).await;
    let flags = common::slot_routing_flags(&client, &admin).await;
    eprintln!("host_prompt_cache, slot_routing per worker (cache-ram 512, cache-ram 0): {flags:?}");
    assert_eq!(flags, [(json!(true), json!(false)), (json!(false), json!(true))]);
}

/// Two one-slot llama-servers sharing a `--slot-save-path`, and a `kvroute serve` with the
/// KV mover (least_ttft, slot routing, decision headers, an admin listener) in front of the
/// first `routed` of them.
struct MoverFleet {
    workers: Vec<String>,
    router: String,
    admin: String,
    client: reqwest::Client,
    _router: Proc,
    _workers: Vec<Proc>,
    dir: tempfile::TempDir,
}

async fn mover_fleet(routed: usize) -> MoverFleet {
    let (bin, model) = llama_env();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().expect("slot dir");
    let slot_dir = dir.path().to_str().expect("utf-8 path").to_string();
    let ports = [free_port(), free_port()];
    let procs: Vec<Proc> = ports
        .iter()
        .map(|&p| start_worker_with(&bin, &model, p, &["-np", "1", "--cache-ram", "0", "--slot-save-path", &slot_dir]))
        .collect();
    let workers: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client");
    for w in &workers {
        wait_healthy(&client, w).await;
    }
    let (rport, aport) = (free_port(), free_port());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", &rport.to_string(), "--policy", "least_ttft"])
        .args(["--admin-listen", &format!("127.0.0.1:{aport}")])
        .args(["--expose-decision-headers", "true", "--llama-slot-routing", "true"])
        .args(["--kv-migration-dir", &slot_dir, "--kv-migration-min-tokens", "256"])
        .arg("--tokenizer")
        .arg(&model)
        .args(["--worker-urls", &workers[..routed].join(",")])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let router_proc = Proc(cmd.spawn().expect("start kvroute serve"));
    let (router, admin) = (format!("http://127.0.0.1:{rport}"), format!("http://127.0.0.1:{aport}"));
    wait_healthy(&client, &router).await;
    MoverFleet { workers, router, admin, client, _router: router_proc, _workers: procs, dir }
}

/// Waits (up to 30 s) for the router's first slot save and returns the saved count.
async fn wait_saved(client: &reqwest::Client, router: &str) -> f64 {
    let mut saved = 0.0;
    for _ in 0..300 {
        let m = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
        saved = sample(&m, "kvroute_kv_migrations_total", "outcome=\"saved\"").unwrap_or(0.0);
        if saved >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    saved
}

/// The KV mover on two one-slot llama-servers sharing a `--slot-save-path`: a ~600-token
/// document runs on one of them (the holder) and its slot is saved; the holder leaves the
/// router (`/remove_worker`: draining or gone); the next request on the document goes to
/// the other worker, which restores the file into its slot first and reports the document
/// as cached (`timings.cache_n`). The router's own files are named by it, counted in its
/// metrics, and nothing restored for a different document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"]
async fn kv_migration_restores_a_saved_prefix_on_another_llama_server() {
    let f = mover_fleet(2).await;
    let (client, router, admin) = (f.client.clone(), f.router.clone(), f.admin.clone());
    let dir_path = f.dir.path();
    let doc = format!("{} {}", document(200), document(201));
    let ask = |q: &str| json!([{"role": "system", "content": doc}, {"role": "user", "content": q}]);
    let first = chat(&client, &router, &ask("Summarise the document.")).await;
    assert!(first.prompt_tokens >= 400, "a long document: {} tokens", first.prompt_tokens);
    // The holder's slot is saved in the background once the answer is in.
    let saved = wait_saved(&client, &router).await;
    assert_eq!(saved, 1.0, "the document's slot was saved");
    let files: Vec<String> = std::fs::read_dir(dir_path)
        .expect("read slot dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    assert!(files.len() == 1 && files[0].starts_with("kvroute-") && files[0].ends_with(".bin"), "{files:?}");
    // The holder leaves the router; the next request on the document goes to the other one.
    let r = client.post(format!("{admin}/remove_worker?url={}", first.worker)).send().await.expect("remove");
    assert!(r.status().is_success(), "remove_worker: {}", r.status());
    let (t, decision) = chat_decided(&client, &router, &ask("Which word comes first?")).await;
    let (worker, cache_n, prompt) = (t.worker, t.cache_n, t.prompt_tokens);
    eprintln!("holder {}, then {worker}: cache_n {cache_n} of {prompt}; decision: {decision}", first.worker);
    assert_ne!(worker, first.worker);
    assert!(decision.contains("kv_restore="), "{decision}");
    // Everything up to the question is served from the restored slot.
    assert!(
        cache_n * 10 >= first.prompt_tokens * 8,
        "restored: cache_n {cache_n} of the document's {}",
        first.prompt_tokens
    );
    let m = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(sample(&m, "kvroute_kv_migrations_total", "outcome=\"restored\""), Some(1.0));
    assert!(sample(&m, "kvroute_kv_migration_bytes_total", "op=\"restore\"").unwrap_or(0.0) > 1e6);
    // A different document finds no file: nothing is restored for it.
    let other = json!([{"role": "system", "content": document(202)}, {"role": "user", "content": "Summarise."}]);
    let t = chat(&client, &router, &other).await;
    assert!(t.cache_n * 2 < t.prompt_tokens, "another document is not served from the file: {}", t.cache_n);
    let m = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(sample(&m, "kvroute_kv_migrations_total", "outcome=\"restored\""), Some(1.0));
}

/// The KV mover when the holder is busy (issue #46's test): two one-slot llama-servers
/// sharing a `--slot-save-path`. The router starts with worker A only, so the document's
/// first request runs there and A's slot is saved; a long answer on the same document then
/// keeps A's only slot busy. Worker B joins (`/add_worker`), and the next request on the
/// document goes to B after a restore of A's file into B's idle slot, which B reports as
/// cached (`timings.cache_n`), instead of waiting for A or recomputing the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs llama.cpp: KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"]
async fn kv_migration_restores_past_a_busy_holder() {
    let f = mover_fleet(1).await;
    let (client, router, admin) = (f.client.clone(), f.router.clone(), f.admin.clone());
    let (a, b) = (f.workers[0].clone(), f.workers[1].clone());
    let doc = format!("{} {}", document(300), document(301));
    let ask = |q: &str| json!([{"role": "system", "content": doc}, {"role": "user", "content": q}]);
    let first = chat(&client, &router, &ask("Summarise the document.")).await;
    assert_eq!(first.worker, a);
    let saved = wait_saved(&client, &router).await;
    assert_eq!(saved, 1.0, "the document's slot was saved");
    // A long answer on the document keeps A's only slot busy (streamed; the first chunk
    // means it runs). `ignore_eos` is llama.cpp's, passed through by the router.
    let long = json!({"model": "smollm2", "messages": ask("List every word of the document."), "max_tokens": 2000,
                      "ignore_eos": true, "stream": true, "temperature": 0});
    let mut busy = client.post(format!("{router}/v1/chat/completions")).json(&long).send().await.expect("send");
    assert!(busy.status().is_success(), "status {}", busy.status());
    assert_eq!(busy.headers()["x-kvroute-worker"].to_str().expect("ascii"), a);
    assert!(busy.chunk().await.expect("stream").is_some(), "the long answer started");
    // B joins; the next request on the document goes there after a restore.
    let r = client.post(format!("{admin}/add_worker?url={b}")).send().await.expect("add");
    assert!(r.status().is_success(), "add_worker: {}", r.status());
    let (t, decision) = chat_decided(&client, &router, &ask("Which word comes first?")).await;
    let (worker, cache_n) = (t.worker, t.cache_n);
    eprintln!("holder {a} busy, then {worker}: cache_n {cache_n}; decision: {decision}");
    assert_eq!(worker, b, "the request went past the busy holder");
    assert!(decision.contains("kv_restore="), "{decision}");
    assert!(cache_n * 10 >= first.prompt_tokens * 8, "restored: cache_n {cache_n} of {}", first.prompt_tokens);
    // The long answer was still running on A: the restore did not wait for it.
    assert!(busy.chunk().await.expect("stream").is_some(), "A's long answer still streaming");
    drop(busy);
    let m = client.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(sample(&m, "kvroute_kv_migrations_total", "outcome=\"restored\""), Some(1.0));
}
