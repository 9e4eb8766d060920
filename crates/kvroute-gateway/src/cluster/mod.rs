//! Cluster mode: a worker registry and a live policy shared by every router replica
//! through etcd ([`etcd`]).
//!
//! Layout under the key prefix (default `/kvroute`, `etcd_prefix`):
//! - `PREFIX/workers/<id>`: one worker, a [`WorkerRecord`] as JSON, normally attached to a
//!   lease that `kvroute register` keeps alive while the worker's `/health` passes. A put
//!   adds or updates the worker in every router; a delete, or the lease expiring, removes it
//!   and its entries from every prefix index.
//! - `PREFIX/routing/policy` (or `etcd_policy_key`): the live policy,
//!   `{"policy": NAME, "knobs": {...}}`, or Cognitora cgn-router's
//!   `{"w_kv":..,"w_load":..,"w_pwr":..,"w_cap":..}` (kv_score's weights), applied through
//!   [`crate::admin::apply_policy`].
//!
//! The registry follows Cognitora cgn-router's etcd node registry (`cluster/registry.rs`,
//! `cluster/watcher.rs`) and its live weights at `/cognitora/routing/policy`.

pub mod etcd;
pub mod register;
pub mod sync;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Largest worker record or policy value read from etcd, bytes.
pub const MAX_VALUE_BYTES: usize = 64 << 10;
/// Most labels a worker record may carry.
pub const MAX_LABELS: usize = 32;

pub use kvroute_core::types::Role;

/// A worker's hardware, as its registration states it (Cognitora cgn-router's node
/// capacity; kv_score's `w_cap` term reads it).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Capacity {
    /// Tensor-parallel size (GPUs per worker).
    pub tp_size: Option<u32>,
    /// Weight data type: `fp32`, `fp16`, `bf16`, `fp8`, `int8`, `int4`.
    pub dtype: Option<String>,
    /// Accelerator memory, GiB.
    pub vram_gb: Option<f64>,
    /// Most concurrent requests the worker accepts.
    pub max_concurrent: Option<u32>,
}

/// One registered worker: the JSON value of `PREFIX/workers/<id>`. Unknown fields are
/// ignored (a newer sidecar may add some).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Base URL (http or https), validated and normalised like `worker_urls`.
    pub url: String,
    /// Models served; empty = discover them from the worker's `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// Prefill, decode or both.
    #[serde(default)]
    pub role: Role,
    /// Hardware.
    #[serde(default)]
    pub capacity: Capacity,
    /// Free-form labels (at most [`MAX_LABELS`]).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl WorkerRecord {
    /// Parses and checks a record (size, URL, counts and lengths).
    ///
    /// # Errors
    /// A message naming the field at fault.
    pub fn parse(value: &[u8]) -> Result<WorkerRecord, String> {
        if value.len() > MAX_VALUE_BYTES {
            return Err(format!("record of {} bytes (at most {MAX_VALUE_BYTES})", value.len()));
        }
        let mut r: WorkerRecord = serde_json::from_slice(value).map_err(|e| format!("not a worker record: {e}"))?;
        r.url = crate::config::check_worker_url(&r.url).map_err(|e| format!("url: {e}"))?;
        if r.models.len() > 256 || r.models.iter().any(|m| m.is_empty() || m.len() > 256) {
            return Err("models: at most 256 names of 1 to 256 bytes".into());
        }
        if r.labels.len() > MAX_LABELS || r.labels.iter().any(|(k, v)| k.len() > 128 || v.len() > 256) {
            return Err(format!("labels: at most {MAX_LABELS}, keys up to 128 and values up to 256 bytes"));
        }
        if let Some(d) = &r.capacity.dtype
            && dtype_bytes(d).is_none()
        {
            return Err(format!("capacity.dtype: unknown `{d}` (fp32, fp16, bf16, fp8, int8, int4)"));
        }
        Ok(r)
    }

    /// The routing core's capacity for this worker: the stated fields over the defaults.
    pub fn core_capacity(&self) -> kvroute_core::types::Capacity {
        let mut c = kvroute_core::types::Capacity::default();
        let s = &self.capacity;
        if let Some(t) = s.tp_size {
            c.tp_size = t.max(1);
        }
        if let Some(b) = s.dtype.as_deref().and_then(dtype_bytes) {
            c.dtype_bytes = b;
        }
        if let Some(v) = s.vram_gb.filter(|v| v.is_finite() && *v > 0.0) {
            c.vram_gib = v;
        }
        if let Some(m) = s.max_concurrent {
            c.max_concurrent = m.max(1);
        }
        c
    }
}

/// Bytes per weight element of a data type name (`int4` rounds up to 1).
fn dtype_bytes(d: &str) -> Option<u32> {
    match d.to_ascii_lowercase().as_str() {
        "fp32" | "float32" => Some(4),
        "fp16" | "float16" | "bf16" | "bfloat16" => Some(2),
        "fp8" | "int8" | "int4" => Some(1),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_checked_and_normalised() {
        let r = WorkerRecord::parse(
            br#"{"url": "HTTP://gpu-1:8000/", "models": ["llama"], "role": "decode",
                 "capacity": {"tp_size": 2, "dtype": "fp8", "vram_gb": 80, "max_concurrent": 64},
                 "labels": {"zone": "a"}, "future_field": 1}"#,
        )
        .expect("valid");
        assert_eq!(r.url, "http://gpu-1:8000");
        assert_eq!(r.role, Role::Decode);
        let c = r.core_capacity();
        assert_eq!((c.tp_size, c.dtype_bytes, c.max_concurrent), (2, 1, 64));
        let minimal = WorkerRecord::parse(br#"{"url": "http://10.0.0.1:8000"}"#).expect("url only");
        assert_eq!(minimal.role, Role::Both);
        assert_eq!(minimal.core_capacity(), kvroute_core::types::Capacity::default());
        for (bad, field) in [
            (&br#"{"url": "ftp://x"}"#[..], "url"),
            (br#"{"models": []}"#, "url"),
            (br#"{"url": "http://x:1", "role": "leader"}"#, "leader"),
            (br#"{"url": "http://x:1", "capacity": {"dtype": "fp6"}}"#, "dtype"),
            (br#"not json"#, "not a worker record"),
        ] {
            let e = WorkerRecord::parse(bad).expect_err("refused");
            assert!(e.contains(field), "{e}");
        }
        let big = format!(r#"{{"url": "http://x:1", "labels": {{"k": "{}"}}}}"#, "v".repeat(MAX_VALUE_BYTES));
        assert!(WorkerRecord::parse(big.as_bytes()).expect_err("too big").contains("bytes"));
    }
}
