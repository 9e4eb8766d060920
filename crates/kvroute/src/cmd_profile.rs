//! `kvroute profile show`: an engine profile's constants and the prefill time it predicts
//! for (cached, new) points, to check a profile against a measured grid point by point
//! (scripts/fit-profile.py fits one; data/gpu/ holds the H100 grid the built-in
//! `h100-llama3-8b` is fitted to).

use anyhow::{Context, bail};
use std::io::Write;

/// Flags of `kvroute profile`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, clap::Subcommand)]
enum Cmd {
    /// Show a profile's constants, and its predicted prefill seconds at --prefill points.
    Show(Show),
}

/// Flags of `kvroute profile show`.
#[derive(Debug, clap::Args)]
struct Show {
    /// The profile (h100-llama3-8b, h100-llama3-8b-roofline, a100-llama3-8b, cpu-smollm2-135m).
    name: String,
    /// A profile file (TOML) over NAME, as replay's --profile-file.
    #[arg(long)]
    profile_file: Option<std::path::PathBuf>,
    /// Overrides of profile constants as a JSON object, as replay's --profile-set.
    #[arg(long)]
    profile_set: Option<String>,
    /// `CACHED,NEW`: a prefill of NEW tokens on CACHED tokens already in the KV cache (one
    /// step, nothing else running). Repeatable.
    #[arg(long, value_name = "CACHED,NEW")]
    prefill: Vec<String>,
    /// Read the points from a measured grid (JSON lines `{"event": "grid", "cached", "new",
    /// "s"}`, as data/gpu/h100-llama3-8b-prefill-grid.jsonl) and print the error at each.
    #[arg(long)]
    grid: Option<std::path::PathBuf>,
    /// Print JSON: `{"profile": {...}, "prefill": [{"cached", "new", "prefill_s"[, "measured_s",
    /// "error"]}]}`.
    #[arg(long)]
    json: bool,
    /// Print the profile's constants as TOML (a starting point for --profile-file).
    #[arg(long, conflicts_with = "json")]
    toml: bool,
}

/// One point: its cached and new tokens, and the measured seconds when from a grid.
type Point = (u64, u64, Option<f64>);

/// Runs `kvroute profile`.
///
/// # Errors
/// An unknown profile, a bad file or override, a malformed `--prefill` or grid line (named).
pub fn run(a: Args) -> anyhow::Result<()> {
    let Cmd::Show(a) = a.cmd;
    let profile = crate::sim_args::load_profile(&a.name, a.profile_file.as_deref(), a.profile_set.as_deref())?;
    let mut points = a.prefill.iter().map(|p| parse_point(p)).collect::<anyhow::Result<Vec<Point>>>()?;
    if let Some(g) = &a.grid {
        points.extend(read_grid(g)?);
    }
    let mut out = std::io::stdout().lock();
    if a.toml {
        write!(out, "{}", toml::to_string(&profile)?)?;
        return Ok(out.flush()?);
    }
    let rows: Vec<serde_json::Value> = points
        .iter()
        .map(|&(c, n, m)| {
            let s = profile.prefill_secs(c, n);
            let mut v = serde_json::json!({"cached": c, "new": n, "prefill_s": s});
            if let Some(m) = m {
                v["measured_s"] = m.into();
                v["error"] = (s / m - 1.0).into();
            }
            v
        })
        .collect();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &serde_json::json!({"profile": profile, "prefill": rows}))?;
        writeln!(out)?;
        return Ok(out.flush()?);
    }
    write!(out, "{}", toml::to_string(&profile)?)?;
    if !rows.is_empty() {
        writeln!(out, "\n{:>8} {:>7} {:>11} {:>11} {:>7}", "cached", "new", "prefill ms", "measured", "error")?;
    }
    for r in &rows {
        let ms = |k: &str| r[k].as_f64().map_or(String::from("-"), |x| format!("{:.1}", x * 1e3));
        let err = r["error"].as_f64().map_or(String::from("-"), |e| format!("{:+.1}%", e * 100.0));
        let (c, n) = (r["cached"].as_u64().unwrap_or(0), r["new"].as_u64().unwrap_or(0));
        writeln!(out, "{c:>8} {n:>7} {:>11} {:>11} {err:>7}", ms("prefill_s"), ms("measured_s"))?;
    }
    for (label, min_new) in [("with new >= 256", 256), ("in all", 0)] {
        let errs: Vec<f64> = rows
            .iter()
            .filter(|r| r["new"].as_u64().is_some_and(|n| n >= min_new))
            .filter_map(|r| r["error"].as_f64())
            .map(f64::abs)
            .collect();
        if let Some(w) = errs.iter().copied().reduce(f64::max) {
            writeln!(out, "worst relative error {:.1}% over the {} measured points {label}", w * 100.0, errs.len())?;
        }
    }
    Ok(out.flush()?)
}

/// `CACHED,NEW` → (cached, new).
fn parse_point(p: &str) -> anyhow::Result<Point> {
    let (c, n) = p.split_once(',').with_context(|| format!("--prefill `{p}`: expected CACHED,NEW"))?;
    let c: u64 = c.trim().parse().with_context(|| format!("--prefill `{p}`: CACHED is not a token count"))?;
    let n: u64 = n.trim().parse().with_context(|| format!("--prefill `{p}`: NEW is not a token count"))?;
    if n == 0 || c > 1 << 24 || n > 1 << 24 {
        bail!("--prefill `{p}`: NEW must be 1 to 16,777,216 and CACHED at most 16,777,216");
    }
    Ok((c, n, None))
}

/// Most grid lines read.
const MAX_GRID_LINES: usize = 100_000;

/// The `{"event": "grid"}` lines of a measured grid.
///
/// # Errors
/// An unreadable file, a malformed line (file and line named), or no grid line at all.
fn read_grid(path: &std::path::Path) -> anyhow::Result<Vec<Point>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--grid {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().take(MAX_GRID_LINES) {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("--grid {}:{}: not JSON", path.display(), i + 1))?;
        if v["event"] != "grid" {
            continue;
        }
        let field = |k: &str| {
            v[k].as_f64().with_context(|| format!("--grid {}:{}: `{k}` is not a number", path.display(), i + 1))
        };
        let (c, n, s) = (field("cached")?, field("new")?, field("s")?);
        if c < 0.0 || n < 1.0 || s <= 0.0 || c > f64::from(1u32 << 24) || n > f64::from(1u32 << 24) {
            bail!("--grid {}:{}: cached 0.., new 1.. (at most 16,777,216) and s > 0 expected", path.display(), i + 1);
        }
        out.push((c as u64, n as u64, Some(s)));
    }
    if out.is_empty() {
        // An empty file or one without grid events printed the constants alone, exit 0.
        bail!("--grid {}: no grid points (no `{{\"event\": \"grid\"}}` lines)", path.display());
    }
    Ok(out)
}
