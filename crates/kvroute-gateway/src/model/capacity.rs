//! A worker's capacity facts, as configured, registered or reported by the worker.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A worker's capacity facts (Cognitora cgn-router's node capacity; kv_score's `w_cap` term
/// and its `load_signal = "seed"` utilisation read them). Every field is optional: a
/// worker's capacity is the configuration's fields (`[capacity."URL"]`) over its
/// registration's (etcd) over what the worker itself reports (SGLang `/server_info`,
/// llama.cpp `/props`) over the defaults ([`kvroute_core::types::Capacity::default`]:
/// TP 1, 2-byte dtype, 80 GiB, 1 free model slot, 256 concurrent requests).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Capacity {
    /// Tensor-parallel size (GPUs per worker).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// Weight data type: `fp32`, `fp16`, `bf16`, `fp8`, `int8`, `int4` (or the long names
    /// `float32`, `float16`, `bfloat16`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Accelerator memory, GiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vram_gb: Option<f64>,
    /// Model (or LoRA adapter) slots free for loading another model; 0 takes the worker's
    /// capacity term to 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_model_slots: Option<u32>,
    /// Most concurrent requests the worker accepts (SGLang `max_running_requests`,
    /// llama.cpp `total_slots`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    /// LoRA adapters the worker holds at once (SGLang `max_loras_per_batch`, vLLM
    /// `--max-loras`): the router's multiplexer loads an adapter on a worker with a slot
    /// free first ([`crate::lora`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_loras: Option<u32>,
    /// Longest context the worker serves, tokens (vLLM `/v1/models` `max_model_len`, SGLang
    /// `context_length`, llama.cpp `n_ctx`): shown in `/workers`, not scored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// llama.cpp slots (`llama-server --parallel`, `/props` `total_slots`): with
    /// `llama_slot_routing` the router tracks what each slot holds and names a request's
    /// slot ([`kvroute_core::slots`]). Unset for engines without slots (vLLM, SGLang).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub llama_slots: Option<u32>,
    /// Tokens the worker's KV cache holds (SGLang `/server_info` `max_total_num_tokens`,
    /// vLLM `vllm:cache_config_info` `num_gpu_blocks × block_size`, llama.cpp `/props`
    /// `total_slots × n_ctx`): `prefill_cost` and `least_ttft` size their estimate of what
    /// the worker caches to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_tokens: Option<u64>,
    /// Fields this version does not know: ignored in a registration (a newer sidecar may
    /// add some), refused in the configuration file.
    #[serde(flatten, skip_serializing)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

impl Capacity {
    /// The fields set here, over `base`'s.
    pub fn over(&self, base: &Capacity) -> Capacity {
        Capacity {
            tp_size: self.tp_size.or(base.tp_size),
            dtype: self.dtype.clone().or_else(|| base.dtype.clone()),
            vram_gb: self.vram_gb.or(base.vram_gb),
            free_model_slots: self.free_model_slots.or(base.free_model_slots),
            max_concurrent: self.max_concurrent.or(base.max_concurrent),
            max_loras: self.max_loras.or(base.max_loras),
            max_model_len: self.max_model_len.or(base.max_model_len),
            llama_slots: self.llama_slots.or(base.llama_slots),
            kv_tokens: self.kv_tokens.or(base.kv_tokens),
            unknown: BTreeMap::new(),
        }
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`CapacityError`] naming the field.
    pub fn check(&self) -> Result<(), CapacityError> {
        let bad = |field: &'static str, message: String| Err(CapacityError { field, message });
        if let Some(d) = &self.dtype
            && dtype_bytes(d).is_none()
        {
            return bad("dtype", format!("unknown `{d}` (fp32, fp16, bf16, fp8, int8, int4)"));
        }
        if self.tp_size == Some(0) {
            return bad("tp_size", "expected at least 1".into());
        }
        if let Some(n) = self.llama_slots
            && !(1..=kvroute_core::slots::MAX_SLOTS as u32).contains(&n)
        {
            return bad("llama_slots", format!("{n}, expected 1 to {}", kvroute_core::slots::MAX_SLOTS));
        }
        if self.max_concurrent == Some(0) {
            return bad("max_concurrent", "expected at least 1".into());
        }
        if self.kv_tokens == Some(0) {
            return bad("kv_tokens", "expected at least 1".into());
        }
        if self.vram_gb.is_some_and(|v| !(v.is_finite() && v > 0.0 && v <= 1e6)) {
            return bad("vram_gb", "expected a positive number of GiB".into());
        }
        Ok(())
    }

    /// The routing core's capacity: these fields over the defaults (normalisation:
    /// `dtype` to bytes per element, `tp_size` and `max_concurrent` at least 1).
    pub fn core(&self) -> kvroute_core::types::Capacity {
        let mut c = kvroute_core::types::Capacity::default();
        if let Some(t) = self.tp_size {
            c.tp_size = t.max(1);
        }
        if let Some(b) = self.dtype.as_deref().and_then(dtype_bytes) {
            c.dtype_bytes = b;
        }
        if let Some(v) = self.vram_gb.filter(|v| v.is_finite() && *v > 0.0) {
            c.vram_gib = v;
        }
        if let Some(f) = self.free_model_slots {
            c.free_model_slots = f;
        }
        if let Some(m) = self.max_concurrent {
            c.max_concurrent = m.max(1);
        }
        c.kv_tokens = self.kv_tokens.filter(|&k| k > 0);
        c
    }
}

/// A capacity value out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct CapacityError {
    /// The field (`dtype`, `tp_size`, …).
    pub field: &'static str,
    /// What is wrong with its value.
    pub message: String,
}

/// Bytes per weight element of a data type name (`int4` rounds up to 1).
pub fn dtype_bytes(d: &str) -> Option<u32> {
    match d.to_ascii_lowercase().as_str() {
        "fp32" | "float32" => Some(4),
        "fp16" | "float16" | "bf16" | "bfloat16" => Some(2),
        "fp8" | "int8" | "int4" => Some(1),
        _ => None,
    }
}
