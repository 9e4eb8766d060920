//! `[pd]`: prefill/decode disaggregation's pools, policies and limits (`crate::pd`).

use kvroute_core::types::Role;
use serde::{Deserialize, Serialize};

/// How the router hands a request from the prefill worker to the decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PdProtocol {
    /// SGLang: the request gets `bootstrap_host`, `bootstrap_port` and a random
    /// `bootstrap_room` and goes to both workers at once; the decode worker fetches the KV
    /// cache from the prefill worker's bootstrap server. The decode answer is the client's,
    /// the prefill answer is drained.
    #[default]
    Sglang,
    /// vLLM disaggregated serving (NIXL connector): the prefill worker gets the request with
    /// `kv_transfer_params: {"do_remote_decode": true}`, `max_tokens: 1`, `stream: false`;
    /// the decode worker then gets the original request with the `kv_transfer_params` the
    /// prefill answer returned.
    Vllm,
}

impl PdProtocol {
    /// `sglang` or `vllm`.
    pub fn as_str(self) -> &'static str {
        match self {
            PdProtocol::Sglang => "sglang",
            PdProtocol::Vllm => "vllm",
        }
    }
}

/// One prefill worker of the configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillWorker {
    /// Base URL.
    pub url: String,
    /// Its bootstrap server's port (SGLang `--disaggregation-bootstrap-port`); unset: what
    /// the worker's `/server_info` says (`disaggregation_bootstrap_port`), else none (the
    /// request then carries `"bootstrap_port": null`, and SGLang uses its default 8998).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// `[pd]`: prefill/decode disaggregation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PdConfig {
    /// Split long prompts between a prefill and a decode worker.
    pub enabled: bool,
    /// The hand-over protocol the workers speak.
    pub protocol: PdProtocol,
    /// Prefill workers.
    pub prefill: Vec<PrefillWorker>,
    /// Decode workers' base URLs.
    pub decode: Vec<String>,
    /// Policy of the prefill pool (prefix-aware: a prefill worker that holds the prefix
    /// skips that part of the prefill).
    pub prefill_policy: String,
    /// Its knobs.
    pub prefill_policy_knobs: toml::Table,
    /// Policy of the decode pool (load-aware: decode is memory-bandwidth bound and gains
    /// nothing from a prefix).
    pub decode_policy: String,
    /// Its knobs.
    pub decode_policy_knobs: toml::Table,
    /// Prompts of at most this many tokens run on one worker.
    pub colocate_below_tokens: u32,
    /// In-flight split requests per model on the prefill side.
    pub max_in_flight_prefill: u32,
    /// In-flight split requests per model on the decode side.
    pub max_in_flight_decode: u32,
    /// Longest wait for the prefill worker's answer (the hand-over of the KV cache), seconds:
    /// beyond it the pair is retried, or the request fails with 504.
    pub handshake_timeout_secs: f64,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            enabled: false,
            protocol: PdProtocol::Sglang,
            prefill: Vec::new(),
            decode: Vec::new(),
            prefill_policy: "cache_aware".into(),
            prefill_policy_knobs: toml::Table::new(),
            decode_policy: "least_load".into(),
            decode_policy_knobs: toml::Table::new(),
            colocate_below_tokens: 2048,
            max_in_flight_prefill: 4096,
            max_in_flight_decode: 4096,
            handshake_timeout_secs: 60.0,
        }
    }
}

/// A knobs table as JSON, for the policy registry.
pub(crate) fn json(t: &toml::Table) -> serde_json::Value {
    serde_json::to_value(t).unwrap_or(serde_json::Value::Null)
}

impl PdConfig {
    /// Checks URLs, policies and limits.
    ///
    /// # Errors
    /// `(key, message)`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let e = |k: &str, m: String| (format!("pd.{k}"), m);
        if self.prefill.len() + self.decode.len() > crate::model::worker_url::MAX_WORKERS {
            return Err(e("prefill", format!("at most {} workers", crate::model::worker_url::MAX_WORKERS)));
        }
        for p in &self.prefill {
            crate::model::worker_url::check_worker_url(&p.url).map_err(|m| e("prefill", m.to_string()))?;
        }
        for d in &self.decode {
            crate::model::worker_url::check_worker_url(d).map_err(|m| e("decode", m.to_string()))?;
        }
        for (k, policy, knobs) in [
            ("prefill_policy", &self.prefill_policy, &self.prefill_policy_knobs),
            ("decode_policy", &self.decode_policy, &self.decode_policy_knobs),
        ] {
            kvroute_core::registry::build(policy, &json(knobs)).map_err(|x| e(k, x.to_string()))?;
        }
        if self.max_in_flight_prefill == 0 || self.max_in_flight_decode == 0 {
            return Err(e("max_in_flight_prefill", "both limits must be at least 1".into()));
        }
        let t = self.handshake_timeout_secs;
        if !(t.is_finite() && t > 0.0 && t <= 3600.0) {
            return Err(e("handshake_timeout_secs", format!("expected 0 to 3600 seconds, got {t}")));
        }
        if self.enabled && (self.prefill.is_empty() || self.decode.is_empty()) {
            tracing::info!("pd: enabled with the prefill or the decode list empty; roles come from the etcd registry");
        }
        Ok(())
    }

    /// The role and bootstrap port the configuration gives `url` (normalised), if any.
    pub fn role_of(&self, url: &str) -> Option<(Role, Option<u16>)> {
        let same = |u: &str| crate::model::worker_url::check_worker_url(u).is_ok_and(|u| u == url);
        if let Some(p) = self.prefill.iter().find(|p| same(&p.url)) {
            return Some((Role::Prefill, p.bootstrap_port));
        }
        self.decode.iter().any(|d| same(d)).then_some((Role::Decode, None))
    }

    /// Every configured URL, prefill workers first.
    pub fn urls(&self) -> impl Iterator<Item = &str> {
        self.prefill.iter().map(|p| p.url.as_str()).chain(self.decode.iter().map(String::as_str))
    }
}
