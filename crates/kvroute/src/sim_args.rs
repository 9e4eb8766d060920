//! Flags and helpers shared by `kvroute replay` and `kvroute advise` (the profile flags
//! also by `kvroute engine-sim`, the profile loader by `kvroute profile show`): they run
//! simulated engines, so the engine profile, its overrides and the number of parallel
//! replays mean the same in each.
//!
//! Flags that mean the same but are documented differently in each command (the arrival
//! and host flags, `--trace`, `--max-output`, `--tenant-isolation`) stay in each command,
//! so that every flag keeps its help text.

use anyhow::{Context, bail};
use kvroute_sim::engine::Profile;
use kvroute_sim::trace::TraceRequest;

/// The simulated engines' profile: `--profile`, `--profile-file` and `--profile-set`.
#[derive(Debug, clap::Args)]
pub struct ProfileArgs {
    /// Engine profile (h100-llama3-8b, h100-llama3-8b-roofline, a100-llama3-8b,
    /// cpu-smollm2-135m; docs/profiles.md).
    #[arg(long, default_value = "h100-llama3-8b")]
    pub profile: String,
    /// Overrides of profile constants as a JSON object, e.g. '{"kv_tokens": 200000}'.
    #[arg(long)]
    pub profile_set: Option<String>,
    /// A profile file (TOML, the constants of `kvroute profile show NAME --toml`; e.g. one
    /// written by scripts/fit-profile.py) over --profile; --profile-set applies after it.
    #[arg(long)]
    pub profile_file: Option<std::path::PathBuf>,
}

impl ProfileArgs {
    /// The named profile with the file and the overrides applied ([`load_profile`]).
    pub fn load(&self) -> anyhow::Result<Profile> {
        load_profile(&self.profile, self.profile_file.as_deref(), self.profile_set.as_deref())
    }
}

/// `--jobs`: how many replays run at once.
#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    /// Parallel replays (default: available cores).
    #[arg(long)]
    pub jobs: Option<usize>,
}

impl JobsArgs {
    /// `--jobs`, or the available cores; at least 1.
    pub fn jobs(&self) -> usize {
        self.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1)
    }
}

/// Loads the named profile, then the constants of `file` (TOML) over it, then the JSON
/// overrides `set`; the result is validated.
///
/// # Errors
/// An unknown name; a file that cannot be read, is not TOML or names an unknown constant
/// (the message names the file, and the line of the syntax error or of the constant); bad
/// JSON; a constant of the wrong kind (a negative or fractional count, a string where a
/// number goes, a TOML `nan` or `inf`) or out of range: named, with its line and what it
/// must be.
pub(crate) fn load_profile(name: &str, file: Option<&std::path::Path>, set: Option<&str>) -> anyhow::Result<Profile> {
    let base = Profile::named(name)
        .with_context(|| format!("--profile: unknown profile `{name}`; known: {}", Profile::NAMES.join(", ")))?;
    let mut v = serde_json::to_value(&base)?;
    if let Some(path) = file {
        let what = format!("--profile-file {}", path.display());
        let text = std::fs::read_to_string(path).with_context(|| what.clone())?;
        // Each constant with where it stands, set one at a time so that an error names its line.
        let table: std::collections::BTreeMap<String, toml::Spanned<toml::Value>> =
            toml::from_str(&text).with_context(|| what.clone())?;
        let mut constants: Vec<_> = table.into_iter().collect();
        constants.sort_by_key(|(_, x)| x.span().start);
        for (k, x) in constants {
            let line = text[..x.span().start.min(text.len())].matches('\n').count() + 1;
            let one = toml::Table::from_iter([(k, x.into_inner())]);
            toml_constants(one)
                .and_then(|patch| overlay(&mut v, &patch))
                .map_err(|e| anyhow::anyhow!("{what}: line {line}: {e}"))?;
        }
    }
    if let Some(set) = set {
        let patch: serde_json::Value = serde_json::from_str(set).context("--profile-set: not JSON")?;
        overlay(&mut v, &patch).map_err(|e| anyhow::anyhow!("--profile-set: {e}"))?;
    }
    let what = match (file, set) {
        (Some(p), _) => format!("--profile-file {}", p.display()),
        (None, Some(_)) => "--profile-set".to_string(),
        (None, None) => return Ok(base),
    };
    let prof: Profile = serde_json::from_value(v).with_context(|| what.clone())?;
    prof.validate().map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    Ok(prof)
}

/// A profile file's table as JSON. TOML's `nan` and `inf` have no JSON form (serde_json
/// writes them as `null`, and the error then spoke of a `null` that is not in the file):
/// they are refused here, naming the key.
fn toml_constants(table: toml::Table) -> anyhow::Result<serde_json::Value> {
    fn non_finite(v: &toml::Value) -> Option<f64> {
        match v {
            toml::Value::Float(f) if !f.is_finite() => Some(*f),
            toml::Value::Array(a) => a.iter().find_map(non_finite),
            toml::Value::Table(t) => t.values().find_map(non_finite),
            _ => None,
        }
    }
    for (k, v) in &table {
        if let Some(f) = non_finite(v) {
            bail!("{k}: must be a finite number, got {f}");
        }
    }
    Ok(serde_json::to_value(table)?)
}

/// Sets every key of the object `patch` on the object `v` (a [`Profile`] as JSON), refusing
/// a key whose value does not fit its constant, named with what it must be
/// ([`kvroute_core::policy::bad_patch_key`]; serde's own message names no key).
fn overlay(v: &mut serde_json::Value, patch: &serde_json::Value) -> anyhow::Result<()> {
    let base = v.clone();
    let (Some(obj), Some(p)) = (v.as_object_mut(), patch.as_object()) else {
        bail!("expected an object (a table of profile constants)");
    };
    for (k, x) in p {
        obj.insert(k.clone(), x.clone());
    }
    if let Err(e) = serde_json::from_value::<Profile>(v.clone()) {
        match kvroute_core::policy::bad_patch_key::<Profile>(&base, p) {
            Some(b) => bail!("{}: {}", b.key, b.message),
            None => return Err(e.into()),
        }
    }
    Ok(())
}

/// Caps every request's output tokens at `cap` (`--max-output`, as `kvroute bench` and
/// `kvroute demo` send them); `None` leaves them.
///
/// # Errors
/// A cap of 0.
pub(crate) fn cap_outputs(trace: &mut [TraceRequest], cap: Option<u32>) -> anyhow::Result<()> {
    let Some(cap) = cap else { return Ok(()) };
    kvroute_bench::workload::check_max_output(cap).map_err(anyhow::Error::msg)?;
    for r in trace {
        r.output_tokens = r.output_tokens.min(cap);
    }
    Ok(())
}

/// `--host-slowdown` (of `kvroute replay` and `kvroute advise`): every value a slow-down.
///
/// # Errors
/// The first value that is not positive and finite, named with the flag.
pub(crate) fn check_host_slowdown(list: &[f64]) -> anyhow::Result<()> {
    match kvroute_sim::replay::not_a_slowdown(list) {
        Some(bad) => {
            let bad = if bad.abs() < 1e6 { bad.to_string() } else { format!("{bad:e}") };
            let max = kvroute_sim::replay::MAX_HOST_SLOWDOWN;
            bail!("--host-slowdown: {bad} is not a positive slow-down of at most {max} (1 = as fast as alone)")
        }
        None => Ok(()),
    }
}
