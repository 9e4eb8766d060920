//! Traffic capture (`record`): every request the gateway dispatches, written as one line of
//! a privacy-safe trace that `kvroute replay --trace` and `kvroute bench --trace` read back.
//!
//! A line is the session-JSONL form of the Mooncake trace (`kvroute_sim::trace`):
//!
//! ```json
//! {"timestamp": 1234.5, "input_length": 812, "output_length": 64,
//!  "hash_ids": [4410857023412398, 7000153322008211], "block_size": 16,
//!  "session_id": "user-42", "turn_id": 3}
//! ```
//!
//! - `timestamp`: milliseconds since the recording started (the request's arrival).
//! - `input_length`: prompt tokens (exact with token ids or a local tokenizer, else the
//!   text estimate of 4 bytes a token); `output_length`: the worker's
//!   `usage.completion_tokens` for a non-streamed answer; for a stream, its usage chunk's
//!   count when it sends one, else its SSE data events (what it carried, if it ended
//!   early); else the request's `max_tokens` (a request that failed before its answer).
//! - `hash_ids`: one id per full block of `block_size` tokens (`record_block_tokens`;
//!   without token ids, `4 × block_size` bytes of text), prefix-chained as in
//!   [`kvroute_core::hash`], so two requests share their first *i* ids exactly when they
//!   share their first *i* blocks. Each id is the chained hash re-keyed with a random salt
//!   drawn at start and never written, cut to 53 bits (exact in every JSON reader): no
//!   text is written, and ids cannot be matched against the hashes of guessed prompts.
//!   Recordings of two processes (or two starts) therefore do not share ids.
//! - `session_id`: the request's session (the `x-session-id` header, else
//!   the body's `user`), else the prefix group of its first two blocks (Mooncake's stand-in), else
//!   one per request; `turn_id`: its number within the session in this recording.
//! - `tenant` (only with tenant isolation): the request's cache scope, an id re-keyed like
//!   `hash_ids`; `hash_ids` are of the prompt alone, so replay can model the hit that
//!   isolation costs (`kvroute replay --tenant-isolation`).
//!
//! Bounded: lines wait in a queue of [`QUEUE`] (beyond it they are dropped and counted,
//! `kvroute_record_lines_total{outcome="dropped"}`), are written by a thread of their own
//! off the request path, and the file rotates at `record_max_bytes`: `FILE` becomes
//! `FILE.1` (and `FILE.1` `FILE.2`, …), keeping `record_files` files in all.

use crate::metrics::{Metrics, OutcomeLabel};
use kvroute_core::hash::{HashAlgo, hash_text_blocks, hash_token_blocks};
use kvroute_core::types::{BlockHash, estimate_tokens};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::Serialize;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokio::sync::mpsc;

/// Lines waiting to be written; beyond this, lines are dropped (counted).
pub const QUEUE: usize = 65_536;
/// Most blocks hashed per request (a 1 M-token prompt at 16-token blocks).
pub const MAX_BLOCKS: usize = 65_536;
/// Sessions whose turn numbers are tracked; past this the table starts again.
pub const MAX_SESSIONS: usize = 1 << 20;
/// Largest 53-bit id: JSON numbers are exact up to 2^53 in every reader.
const ID_MASK: u64 = (1 << 53) - 1;

/// One recorded request (a trace line).
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    /// Arrival, milliseconds since the recording started.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// Salted prefix-chained block ids.
    pub hash_ids: Vec<u64>,
    /// Tokens per block of `hash_ids`.
    pub block_size: u32,
    /// Session.
    pub session_id: String,
    /// Turn within the session in this recording (set by the writer).
    pub turn_id: u64,
    /// The request's cache scope (its tenant, or group of `shared_prefix_tenants`) when
    /// tenant isolation salted its key: the salt re-keyed like `hash_ids`. Absent when it was
    /// not salted. Replay keys each tenant's blocks apart by it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<u64>,
}

/// The gateway's recorder: builds lines on the request path, writes them on its own thread.
#[derive(Debug)]
pub struct Recorder {
    start: Instant,
    salt: u64,
    block_tokens: u32,
    tx: mpsc::Sender<Line>,
    outcomes: Family<OutcomeLabel, Counter>,
}

/// A request being recorded: written when [`Pending::finish`] is called or, with the
/// request's `max_tokens` as its output, when dropped unfinished.
#[derive(Debug)]
pub struct Pending {
    line: Option<Line>,
    max_tokens: Option<u32>,
    tx: mpsc::Sender<Line>,
    outcomes: Family<OutcomeLabel, Counter>,
}

impl Pending {
    /// Writes the line with `output_tokens` (at least 1).
    pub fn finish(mut self, output_tokens: u32) {
        self.send(output_tokens);
    }

    fn send(&mut self, output_tokens: u32) {
        if let Some(mut line) = self.line.take() {
            line.output_length = output_tokens.max(1);
            if self.tx.try_send(line).is_err() {
                crate::metrics::count_outcome(&self.outcomes, "dropped");
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let out = self.max_tokens.unwrap_or(1);
        self.send(out);
    }
}

/// Where and how to record (`record*` keys of the configuration).
#[derive(Debug, Clone)]
pub struct RecordConfig {
    /// The trace file.
    pub path: PathBuf,
    /// Size at which the file rotates, bytes (≥ 4 KiB).
    pub max_bytes: u64,
    /// Files kept in all, the current one included (≥ 1).
    pub files: u32,
    /// Tokens per block of `hash_ids` (≥ 1).
    pub block_tokens: u32,
}

impl Recorder {
    /// Opens (appends to) the trace file and starts the writer thread.
    ///
    /// # Errors
    /// The file cannot be opened for appending, or the thread cannot be started.
    pub fn start(cfg: &RecordConfig, metrics: &Metrics) -> anyhow::Result<Recorder> {
        let outcomes = metrics.record_lines.clone();
        for o in ["written", "dropped", "error"] {
            drop(outcomes.get_or_create(&OutcomeLabel { outcome: o.into() }));
        }
        let file = open_append(&cfg.path)?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let writer = Writer {
            path: cfg.path.clone(),
            size: file.metadata().map_or(0, |m| m.len()),
            out: std::io::BufWriter::new(file),
            max_bytes: cfg.max_bytes,
            files: cfg.files,
            turns: HashMap::new(),
            outcomes: outcomes.clone(),
        };
        std::thread::Builder::new()
            .name("kvroute-record".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| anyhow::anyhow!("record: cannot start the writer thread: {e}"))?;
        Ok(Recorder {
            start: Instant::now(),
            salt: crate::model::random::os_random_u64(),
            block_tokens: cfg.block_tokens,
            tx,
            outcomes,
        })
    }

    /// Starts recording a request that arrived at `arrived` with `token_ids` (else `text`),
    /// `session` and `max_tokens`.
    pub fn begin(
        &self,
        arrived: Instant,
        text: &str,
        token_ids: Option<&[u32]>,
        session: Option<&str>,
        max_tokens: Option<u32>,
    ) -> Pending {
        // A tenant's salted key: the prompt is recorded without the salt, the scope apart.
        let (salt, text) = kvroute_core::tenant::split_text(text);
        let (token_salt, token_ids) = match token_ids.map(kvroute_core::tenant::split_tokens) {
            Some((s, t)) => (s, Some(t)),
            None => (None, None),
        };
        let tenant = salt.or(token_salt).map(|s| self.id(s.0));
        let mut blocks: Vec<BlockHash> = Vec::new();
        let bt = self.block_tokens as usize;
        let input = match token_ids {
            Some(t) => {
                hash_token_blocks(t, bt, MAX_BLOCKS, HashAlgo::Xxh3, &mut blocks);
                t.len().min(u32::MAX as usize) as u32
            }
            None => {
                hash_text_blocks(text, bt, MAX_BLOCKS, HashAlgo::Xxh3, &mut blocks);
                estimate_tokens(text)
            }
        };
        let hash_ids: Vec<u64> = blocks.iter().map(|b| self.id(b.0)).collect();
        let session_id = match (session, hash_ids.as_slice()) {
            (Some(s), _) => s.to_string(),
            (None, [a, b, ..]) => format!("p{a}-{b}"),
            (None, _) => format!("r{}", self.id(arrived.duration_since(self.start).as_nanos() as u64)),
        };
        let line = Line {
            timestamp: arrived.saturating_duration_since(self.start).as_secs_f64() * 1e3,
            input_length: input.max(1),
            output_length: 1,
            hash_ids,
            block_size: self.block_tokens,
            session_id,
            turn_id: 0,
            tenant,
        };
        Pending { line: Some(line), max_tokens, tx: self.tx.clone(), outcomes: self.outcomes.clone() }
    }

    fn id(&self, h: u64) -> u64 {
        HashAlgo::Xxh3.chain(self.salt, &h.to_le_bytes()) & ID_MASK
    }
}

fn open_append(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("record: cannot open {} for appending: {e}", path.display()))
}

struct Writer {
    path: PathBuf,
    size: u64,
    out: std::io::BufWriter<std::fs::File>,
    max_bytes: u64,
    files: u32,
    turns: HashMap<String, u64>,
    outcomes: Family<OutcomeLabel, Counter>,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Line>) {
        while let Some(mut line) = rx.blocking_recv() {
            if self.turns.len() >= MAX_SESSIONS && !self.turns.contains_key(&line.session_id) {
                self.turns.clear();
            }
            let turn = self.turns.entry(line.session_id.clone()).or_insert(0);
            line.turn_id = *turn;
            *turn += 1;
            let outcome = match self.write(&line) {
                Ok(()) => "written",
                Err(e) => {
                    tracing::warn!(error = %e, file = %self.path.display(), "record: a line was not written");
                    "error"
                }
            };
            if rx.is_empty() {
                let _ = self.out.flush();
            }
            // Counted once flushed, so a reader who sees the count sees the line too.
            crate::metrics::count_outcome(&self.outcomes, outcome);
        }
        let _ = self.out.flush();
    }

    fn write(&mut self, line: &Line) -> anyhow::Result<()> {
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        if self.size > 0 && self.size + bytes.len() as u64 > self.max_bytes {
            self.rotate()?;
        }
        self.out.write_all(&bytes)?;
        self.size += bytes.len() as u64;
        Ok(())
    }

    /// `FILE.{n-1}` → `FILE.{n}` down to `FILE` → `FILE.1`, the oldest beyond `files`
    /// removed, and a new `FILE`.
    fn rotate(&mut self) -> anyhow::Result<()> {
        self.out.flush()?;
        let name = |k: u32| {
            let mut p = self.path.clone().into_os_string();
            p.push(format!(".{k}"));
            PathBuf::from(p)
        };
        if self.files <= 1 {
            std::fs::remove_file(&self.path)?;
        } else {
            let _ = std::fs::remove_file(name(self.files - 1));
            for k in (1..self.files - 1).rev() {
                let _ = std::fs::rename(name(k), name(k + 1));
            }
            std::fs::rename(&self.path, name(1))?;
        }
        self.out = std::io::BufWriter::new(open_append(&self.path)?);
        self.size = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorder(block_tokens: u32) -> Recorder {
        let (tx, _rx) = mpsc::channel(4);
        Recorder { start: Instant::now(), salt: 7, block_tokens, tx, outcomes: Family::default() }
    }

    #[test]
    fn shared_prefixes_share_leading_ids_and_no_text_is_kept() {
        let r = recorder(4);
        let doc = "a document of some length, ".repeat(10);
        let a = r.begin(Instant::now(), &format!("{doc} first question"), None, None, Some(8));
        let b = r.begin(Instant::now(), &format!("{doc} second one"), None, Some("s1"), None);
        let (la, lb) = (a.line.clone().expect("line"), b.line.clone().expect("line"));
        let shared = doc.len() / 16;
        assert!(la.hash_ids.len() > shared && lb.hash_ids.len() > shared);
        assert_eq!(la.hash_ids[..shared], lb.hash_ids[..shared]);
        assert!(la.hash_ids.iter().all(|&h| h <= ID_MASK));
        assert_eq!(lb.session_id, "s1");
        assert!(la.session_id.starts_with('p'));
        let json = serde_json::to_string(&la).expect("json");
        assert!(!json.contains("document") && !json.contains("question"), "{json}");
    }

    #[test]
    fn token_ids_are_blocked_by_tokens_and_the_salt_changes_every_id() {
        let r = recorder(2);
        let ids: Vec<u32> = (0..9).collect();
        let p = r.begin(Instant::now(), "", Some(&ids), None, None);
        let line = p.line.clone().expect("line");
        assert_eq!(line.input_length, 9);
        assert_eq!(line.hash_ids.len(), 4, "full blocks only");
        let mut other = recorder(2);
        other.salt = 8;
        let q = other.begin(Instant::now(), "", Some(&ids), None, None);
        let l2 = q.line.clone().expect("line");
        assert!(line.hash_ids.iter().zip(&l2.hash_ids).all(|(a, b)| a != b));
    }
}
