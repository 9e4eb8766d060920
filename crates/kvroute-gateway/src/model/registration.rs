//! The registry's worker record: the JSON value of `PREFIX/workers/<id>` in etcd, written
//! by `kvroute register` and read by every router replica.

use super::capacity::{Capacity, CapacityError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Largest worker record or policy value read from etcd, bytes.
pub const MAX_VALUE_BYTES: usize = 64 << 10;
/// Most labels a worker record may carry.
pub const MAX_LABELS: usize = 32;

pub use kvroute_core::types::Role;

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
    /// Its bootstrap server's port (SGLang prefill workers in a disaggregated fleet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// Free-form labels (at most [`MAX_LABELS`]).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A worker record refused by [`WorkerRecord::parse`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Larger than [`MAX_VALUE_BYTES`].
    #[error("record of {bytes} bytes (at most {MAX_VALUE_BYTES})")]
    TooLarge {
        /// Its size.
        bytes: usize,
    },
    /// Not JSON of a worker record's shape.
    #[error("not a worker record: {reason}")]
    NotARecord {
        /// The JSON parser's message.
        reason: String,
    },
    /// The URL is refused.
    #[error("url: {0}")]
    Url(#[from] crate::model::worker_url::WorkerUrlError),
    /// Too many or bad model names.
    #[error("models: at most 256 names of 1 to 256 bytes")]
    Models,
    /// Too many or too long labels.
    #[error("labels: at most {MAX_LABELS}, keys up to 128 and values up to 256 bytes")]
    Labels,
    /// A capacity value out of range.
    #[error("capacity.{0}")]
    Capacity(#[from] CapacityError),
}

impl WorkerRecord {
    /// Parses and checks a record (size, URL, counts and lengths).
    ///
    /// # Errors
    /// [`RecordError`] naming the field at fault.
    pub fn parse(value: &[u8]) -> Result<WorkerRecord, RecordError> {
        if value.len() > MAX_VALUE_BYTES {
            return Err(RecordError::TooLarge { bytes: value.len() });
        }
        let mut r: WorkerRecord =
            serde_json::from_slice(value).map_err(|e| RecordError::NotARecord { reason: e.to_string() })?;
        r.url = crate::model::worker_url::check_worker_url(&r.url)?;
        if r.models.len() > 256 || r.models.iter().any(|m| m.is_empty() || m.len() > 256) {
            return Err(RecordError::Models);
        }
        if r.labels.len() > MAX_LABELS || r.labels.iter().any(|(k, v)| k.len() > 128 || v.len() > 256) {
            return Err(RecordError::Labels);
        }
        r.capacity.check()?;
        Ok(r)
    }

    /// The routing core's capacity for this worker: the stated fields over the defaults.
    pub fn core_capacity(&self) -> kvroute_core::types::Capacity {
        self.capacity.core()
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
            let e = WorkerRecord::parse(bad).expect_err("refused").to_string();
            assert!(e.contains(field), "{e}");
        }
        let big = format!(r#"{{"url": "http://x:1", "labels": {{"k": "{}"}}}}"#, "v".repeat(MAX_VALUE_BYTES));
        assert!(WorkerRecord::parse(big.as_bytes()).expect_err("too big").to_string().contains("bytes"));
    }
}
