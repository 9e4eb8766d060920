//! Live policy changes: one [`apply`] for `PUT /policy`, the etcd policy key and a SIGHUP
//! reload, for the main routers and the prefill and decode pools' routers alike. Every part
//! of a change is validated before any part is applied.

use crate::app::AppState;
use crate::routers::Routers;
use std::sync::Arc;

/// Which shapes of a policy value [`apply`] accepts besides its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `PUT /policy` and SIGHUP: the shapes listed on [`apply`].
    Plain,
    /// The etcd policy key: also Cognitora cgn-router's bare `{"w_kv":..}` weights.
    Cognitora,
}

/// A pool's part of a setting: a policy name (`None`: keep the running one) and knobs.
struct PoolChange {
    policy: Option<String>,
    knobs: serde_json::Value,
}

/// Reads `v[field]` as `{"policy": NAME, "knobs": {...}}` and checks it against a fresh
/// policy of that name (or the running one), changing nothing.
fn pool_change(
    v: &serde_json::Map<String, serde_json::Value>,
    field: &'static str,
    routers: Option<&Routers>,
) -> Result<Option<PoolChange>, (&'static str, String)> {
    let Some(x) = v.get(field) else { return Ok(None) };
    let Some(routers) = routers else {
        return Err((field, "disaggregation is off (`[pd]`): there is no such pool".into()));
    };
    let obj = x.as_object().ok_or((field, "expected {\"policy\": NAME, \"knobs\": {...}}".to_string()))?;
    let policy = match obj.get("policy") {
        Some(serde_json::Value::String(p)) => Some(p.clone()),
        Some(_) => return Err((field, "policy: expected a policy name (a string)".into())),
        None => None,
    };
    let knobs = obj.get("knobs").cloned().unwrap_or_else(|| serde_json::json!({}));
    let name = policy.clone().unwrap_or_else(|| routers.policy_name());
    let mut probe =
        kvroute_core::registry::build(&name, &serde_json::json!({})).map_err(|e| (field, format!("{e:#}")))?;
    probe.set_knobs(&knobs).map_err(|e| (field, e.to_string()))?;
    Ok(Some(PoolChange { policy, knobs }))
}

/// Applies a checked pool change.
fn apply_pool(
    s: &AppState,
    routers: &Routers,
    c: PoolChange,
    field: &'static str,
) -> Result<(), (&'static str, String)> {
    match c.policy {
        Some(p) => routers.set_policy(&p, &c.knobs, s.now()).map(drop).map_err(|e| (field, format!("{e:#}"))),
        None => routers.set_knobs(&c.knobs, s.now()).map(drop).map_err(|e| (field, e.to_string())),
    }
}

/// Applies a policy setting — from `PUT /policy`, the cluster's policy key or a SIGHUP reload:
/// - `{"policy": NAME, "knobs": {...}}` switches every model to NAME (a fresh prefix index)
///   unless NAME is already running, in which case only the knobs named change;
/// - `{"knobs": {...}}` or a bare object of knobs patches the running policy's knobs;
/// - with [`Form::Cognitora`], an object of `w_*` weights without `policy` is Cognitora
///   cgn-router's `/cognitora/routing/policy` value and means kv_score with those weights;
/// - a `cascade` field (`{"chain": [{"model", "models", "confidence_threshold",
///   "max_tokens"}, …]}`) replaces the model cascades; alone, it changes nothing else;
/// - `prefill` and `decode` fields (`{"policy": NAME, "knobs": {...}}`, either part optional)
///   set the policy of the prefill and decode pools' routers (disaggregation, `[pd]`) the same
///   way; refused when disaggregation is off.
///
/// Validated before anything changes. Returns the running policy's knobs.
///
/// # Errors
/// The field at fault (`policy`, `knobs`, `cascade`, `prefill` or `decode`) and why.
pub fn apply(s: &AppState, v: &serde_json::Value, form: Form) -> Result<serde_json::Value, (&'static str, String)> {
    let Some(obj) = v.as_object() else { return Err(("knobs", "expected a JSON object".into())) };
    let cascade = match obj.get("cascade") {
        Some(c) => {
            let c: kvroute_core::cascade::CascadeConfig =
                serde_json::from_value(c.clone()).map_err(|e| ("cascade", e.to_string()))?;
            c.validate().map_err(|e| ("cascade", e))?;
            Some(c)
        }
        None => None,
    };
    let prefill = pool_change(obj, "prefill", s.pd.as_ref().map(|p| &p.prefill))?;
    let decode = pool_change(obj, "decode", s.pd.as_ref().map(|p| &p.decode))?;
    let mut rest = obj.clone();
    for k in ["cascade", "prefill", "decode"] {
        rest.remove(k);
    }
    let only_others = rest.is_empty() && (cascade.is_some() || prefill.is_some() || decode.is_some());
    let knobs = if only_others {
        s.routers.knobs()
    } else {
        let v = serde_json::Value::Object(rest.clone());
        let empty = serde_json::json!({});
        let knobs = rest.get("knobs").unwrap_or(&empty);
        let cognitora = form == Form::Cognitora;
        match rest.get("policy") {
            Some(serde_json::Value::String(name)) => {
                s.routers.set_policy(name, knobs, s.now()).map_err(|e| ("policy", format!("{e:#}")))
            }
            Some(_) => Err(("policy", "expected a policy name (a string)".into())),
            None if cognitora && !rest.contains_key("knobs") && rest.keys().any(|k| k.starts_with("w_")) => {
                s.routers.set_policy("kv_score", &v, s.now()).map_err(|e| ("knobs", format!("{e:#}")))
            }
            None => {
                let patch = rest.get("knobs").unwrap_or(&v);
                s.routers.set_knobs(patch, s.now()).map_err(|e| ("knobs", e.to_string()))
            }
        }?
    };
    if let Some(pd) = &s.pd {
        if let Some(c) = prefill {
            apply_pool(s, &pd.prefill, c, "prefill")?;
        }
        if let Some(c) = decode {
            apply_pool(s, &pd.decode, c, "decode")?;
        }
    }
    if let Some(c) = cascade {
        s.cascade.store(Arc::new(c));
    }
    Ok(knobs)
}
