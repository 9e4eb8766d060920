//! `[kv_migration]`: the KV mover for llama.cpp workers (`crate::kv_move`).

use serde::{Deserialize, Serialize};

/// `[kv_migration]`: move a cached prompt prefix to the worker a request is sent to,
/// through llama.cpp's slot files (`llama-server --slot-save-path DIR`, `POST
/// /slots/{id}?action=save|restore`). Needs `llama_slot_routing` on for the workers (the
/// mover saves and restores the slots the router pins requests to). Restart to change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvMigrationConfig {
    /// Turn the mover on.
    pub enabled: bool,
    /// The workers' `--slot-save-path` as this router sees it: the same directory on one
    /// host, or a shared filesystem mounted on every worker and on the router. The router
    /// names, bounds and removes the files it asks workers to write there.
    pub slot_save_dir: Option<std::path::PathBuf>,
    /// A prompt shorter than this is not saved, and a restore that adds fewer tokens to the
    /// slot's hit is not tried, tokens.
    pub min_tokens: u32,
    /// Most files kept in `slot_save_dir`; the least recently used goes first.
    pub max_files: usize,
    /// Most bytes kept in `slot_save_dir`, all files together, MiB.
    pub max_mib: u64,
    /// A file not saved or restored for this long is removed, seconds.
    pub file_ttl_secs: u64,
    /// Saves in flight at once, fleet-wide; a prompt that ends while this many are running
    /// is not saved.
    pub max_concurrent_saves: usize,
    /// Longest a save or restore call may take, seconds; a restore that times out is
    /// abandoned and the request recomputes.
    pub timeout_secs: f64,
    /// A worker's restore speed before its first restore is measured, tokens/s (llama.cpp,
    /// SmolLM2-135M on one core here: 1,202 tokens in 6.6 ms, ~180,000/s).
    pub restore_tokens_per_sec: f64,
    /// Fixed cost of one restore call, seconds (the HTTP round trip, opening the file).
    pub restore_overhead_secs: f64,
    /// A worker's prefill speed before its answers are measured, tokens/s (the same worker
    /// prefilled ~100 tokens/s); then learned from the TTFT of its answers.
    pub prefill_tokens_per_sec: f64,
}

impl Default for KvMigrationConfig {
    fn default() -> Self {
        KvMigrationConfig {
            enabled: false,
            slot_save_dir: None,
            min_tokens: 1024,
            max_files: 256,
            max_mib: 8 * 1024,
            file_ttl_secs: 900,
            max_concurrent_saves: 2,
            timeout_secs: 30.0,
            restore_tokens_per_sec: 100_000.0,
            restore_overhead_secs: 0.02,
            prefill_tokens_per_sec: 2_000.0,
        }
    }
}

/// Most files `max_files` may allow.
pub const MAX_FILES: usize = 65_536;

impl KvMigrationConfig {
    /// Checks the section; the message names the field.
    ///
    /// # Errors
    /// `(field, message)` for a missing `slot_save_dir` while enabled, or a value out of range.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.enabled && self.slot_save_dir.is_none() {
            return Err((
                "slot_save_dir",
                "required with enabled = true: the workers' --slot-save-path as this router sees it".into(),
            ));
        }
        if !(1..=MAX_FILES).contains(&self.max_files) {
            return Err(("max_files", format!("must be in 1..={MAX_FILES}, got {}", self.max_files)));
        }
        if self.max_mib == 0 {
            return Err(("max_mib", "must be at least 1".into()));
        }
        if self.max_concurrent_saves == 0 || self.max_concurrent_saves > 64 {
            return Err(("max_concurrent_saves", format!("must be in 1..=64, got {}", self.max_concurrent_saves)));
        }
        let positive = [
            ("timeout_secs", self.timeout_secs),
            ("restore_tokens_per_sec", self.restore_tokens_per_sec),
            ("prefill_tokens_per_sec", self.prefill_tokens_per_sec),
        ];
        for (field, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err((field, format!("must be a finite number > 0, got {v}")));
            }
        }
        if !(self.restore_overhead_secs.is_finite() && self.restore_overhead_secs >= 0.0) {
            return Err((
                "restore_overhead_secs",
                format!("must be a finite number >= 0, got {}", self.restore_overhead_secs),
            ));
        }
        Ok(())
    }
}
