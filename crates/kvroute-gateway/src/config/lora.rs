//! `[lora]`: the LoRA adapter catalogue the router may load on workers (`crate::lora`).

use serde::{Deserialize, Serialize};

/// Most adapters in the catalogue.
pub const MAX_ADAPTERS: usize = 4096;

/// The runtime-loading endpoint workers speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraApi {
    /// vLLM: `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` (needs
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the worker).
    #[default]
    Vllm,
    /// SGLang: `POST /load_lora_adapter` `{"lora_name", "lora_path"}`.
    Sglang,
}

/// One adapter the router may ask workers to load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraAdapter {
    /// The model name clients ask for (`lora_name`).
    pub name: String,
    /// Where the worker finds it (`lora_path`: a directory or a Hugging Face repository).
    pub path: String,
    /// The base model it applies to: only workers listing this model load it (empty: any
    /// worker).
    #[serde(default)]
    pub base: String,
}

/// `[lora]`: model multiplexing with runtime-loaded LoRA adapters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Ask a worker to load a catalogue adapter that no routable worker has loaded.
    pub load: bool,
    /// The workers' loading endpoint.
    pub api: LoraApi,
    /// Timeout of one load request, seconds.
    pub load_timeout_secs: f64,
    /// Adapters a worker holds when neither the configuration (`capacity.max_loras`), its
    /// registration nor its report (SGLang `max_loras_per_batch`) says (vLLM's
    /// `--max-loras` default is 1).
    pub default_max_loras: u32,
    /// The catalogue.
    pub adapters: Vec<LoraAdapter>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            load: true,
            api: LoraApi::Vllm,
            load_timeout_secs: 120.0,
            default_max_loras: 1,
            adapters: Vec::new(),
        }
    }
}

impl LoraConfig {
    /// Checks the catalogue and limits.
    ///
    /// # Errors
    /// [`LoraConfigError`] naming the field (and the adapter).
    pub fn validate(&self) -> Result<(), LoraConfigError> {
        if !(self.load_timeout_secs.is_finite() && self.load_timeout_secs > 0.0 && self.load_timeout_secs <= 3600.0) {
            return Err(LoraConfigError::LoadTimeout);
        }
        if self.adapters.len() > MAX_ADAPTERS {
            return Err(LoraConfigError::TooMany);
        }
        let mut seen = std::collections::HashSet::new();
        for a in &self.adapters {
            if a.name.trim().is_empty() || a.name.len() > 256 {
                return Err(LoraConfigError::Name);
            }
            if a.path.trim().is_empty() || a.path.len() > 4096 {
                return Err(LoraConfigError::Path { adapter: a.name.clone() });
            }
            if !seen.insert(a.name.as_str()) {
                return Err(LoraConfigError::Twice { adapter: a.name.clone() });
            }
        }
        Ok(())
    }
}

/// A LoRA catalogue refused by [`LoraConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraConfigError {
    /// `load_timeout_secs` out of range.
    #[error("load_timeout_secs: expected 0 to 3600 seconds")]
    LoadTimeout,
    /// More than [`MAX_ADAPTERS`] adapters.
    #[error("adapters: at most {MAX_ADAPTERS}")]
    TooMany,
    /// An adapter name empty or over 256 bytes.
    #[error("adapters: a name is empty or longer than 256 bytes")]
    Name,
    /// An adapter path empty or over 4096 bytes.
    #[error("adapters: `{adapter}`: path is empty or longer than 4096 bytes")]
    Path {
        /// The adapter.
        adapter: String,
    },
    /// An adapter listed twice.
    #[error("adapters: `{adapter}` is listed twice")]
    Twice {
        /// The adapter.
        adapter: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_is_checked() {
        let a = |name: &str| LoraAdapter { name: name.into(), path: "/a".into(), base: String::new() };
        let ok = LoraConfig { adapters: vec![a("x"), a("y")], ..LoraConfig::default() };
        assert!(ok.validate().is_ok());
        let twice = LoraConfig { adapters: vec![a("x"), a("x")], ..LoraConfig::default() };
        assert!(twice.validate().expect_err("twice").to_string().contains("twice"));
        let no_path =
            LoraConfig { adapters: vec![LoraAdapter { path: String::new(), ..a("x") }], ..LoraConfig::default() };
        assert!(no_path.validate().expect_err("path").to_string().contains("path"));
    }
}
