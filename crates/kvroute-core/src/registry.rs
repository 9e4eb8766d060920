//! Build a policy by name; list every policy with its knobs, defaults and source.
//!
//! Knobs are passed as a JSON object (the gateway converts its TOML config and flags to
//! JSON); unknown knobs are rejected with an error naming them.

use crate::policy::{KnobError, Policy};
use serde::Serialize;

/// One policy knob, for `kvroute policies` and the configuration reference.
#[derive(Debug, Clone, Serialize)]
pub struct KnobInfo {
    /// Knob name as used in config, flags and `PUT /policy`.
    pub name: &'static str,
    /// Default value.
    pub default: serde_json::Value,
    /// Unit or range, e.g. "requests", "0.0-1.0", "seconds".
    pub unit: &'static str,
    /// What it does.
    pub doc: &'static str,
}

/// One registered policy.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyInfo {
    /// Registry name.
    pub name: &'static str,
    /// Where the behaviour comes from (seed file, paper or system).
    pub source: &'static str,
    /// One-line summary.
    pub summary: &'static str,
    /// Knobs with defaults.
    pub knobs: Vec<KnobInfo>,
}

/// Why a policy could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// No policy of that name.
    #[error("unknown policy `{name}`; known policies: {known}")]
    Unknown {
        /// The name asked for.
        name: String,
        /// Comma-separated registered names.
        known: String,
    },
    /// Bad knobs.
    #[error(transparent)]
    Knobs(#[from] KnobError),
}

/// Names of every registered policy, in listing order.
pub fn names() -> Vec<&'static str> {
    list().into_iter().map(|p| p.name).collect()
}

/// Every registered policy with its knobs and defaults.
pub fn list() -> Vec<PolicyInfo> {
    todo!()
}

/// Builds policy `name` with `knobs` (a JSON object; `null` or `{}` for the defaults).
///
/// # Errors
/// [`BuildError::Unknown`] for an unknown name, [`BuildError::Knobs`] for an unknown knob
/// or an out-of-range value.
pub fn build(name: &str, knobs: &serde_json::Value) -> Result<Box<dyn Policy>, BuildError> {
    let _ = (name, knobs);
    todo!()
}
