//! Per-policy results of a replay: metrics, terminal table, JSON/CSV and plots.

pub use crate::latency::Slo;
use crate::latency::{Latencies, LatencySummary};
use crate::types::ReplayResult;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// Summary of one replay.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// Policy name (with a suffix for trace variants such as `lmetric+capped`).
    pub policy: String,
    /// Arrival-rate multiplier of the run.
    pub rate_scale: f64,
    /// Offered load, requests per second.
    pub offered_rps: f64,
    /// Requests in the trace.
    pub requests: u64,
    /// Requests completed.
    pub completed: u64,
    /// Share of requests rejected.
    pub rejection_rate: f64,
    /// Prompt tokens served from prefix caches / prompt tokens of admitted requests.
    pub hit_ratio: f64,
    /// One shared never-evicting cache's hit ratio on the same trace (upper bound).
    pub infinite_cache_hit_ratio: f64,
    /// TTFT, TPOT and E2E (simulated seconds); serialised as flat `ttft_p50_s`, … fields.
    #[serde(flatten)]
    pub latency: LatencySummary,
    /// Output tokens per second over the makespan.
    pub throughput_tok_s: f64,
    /// Completed requests per second over the makespan.
    pub throughput_rps: f64,
    /// Requests per second meeting the SLO.
    pub goodput_rps: f64,
    /// The SLO used for goodput.
    pub slo: Slo,
    /// Max over mean of per-engine busy time (1.0 = perfectly even).
    pub load_imbalance: f64,
    /// Share of requests per engine.
    pub worker_share: Vec<f64>,
    /// Decisions per branch label.
    pub branches: std::collections::BTreeMap<String, u64>,
    /// TTFT CDF points (seconds, fraction) for plots.
    #[serde(skip)]
    pub ttft_cdf: Vec<(f64, f64)>,
    /// Prefill/decode disaggregation figures of a `--pd` run (absent otherwise, and then
    /// not serialised: colocated reports keep their shape).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdSummary>,
    /// What the KV mover did (`--kv-migration`), serialised flat (`kv_restores`,
    /// `kv_saves`, …); absent otherwise.
    #[serde(flatten)]
    pub kv_migration: Option<crate::types::KvMigrationCounts>,
    /// What the KV pulls did (`--kv-pull`), serialised flat (`kv_pulls`,
    /// `kv_pulled_tokens`, `kv_pull_secs`); absent otherwise.
    #[serde(flatten)]
    pub kv_pull: Option<crate::types::KvPullCounts>,
    /// How far the policy's TTFT predictions were from the TTFTs the engines gave (for a
    /// policy that predicts, `least_ttft`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_prediction: Option<PredictionError>,
}

/// The error of a policy's TTFT predictions over the completed requests it predicted:
/// `(predicted − measured) / measured` per request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PredictionError {
    /// Requests with a prediction and a first token.
    pub samples: u64,
    /// Median of the absolute relative error (0.1 = off by 10 %).
    pub median_abs: f64,
    /// 90th percentile of the absolute relative error.
    pub p90_abs: f64,
    /// Median of the signed relative error (> 0: predictions too long).
    pub median_signed: f64,
}

impl PredictionError {
    /// The error of `pairs` of (predicted, measured) seconds, the measured ones > 0;
    /// `None` when there are none.
    pub fn of(pairs: impl IntoIterator<Item = (f64, f64)>) -> Option<PredictionError> {
        let mut signed: Vec<f64> = pairs
            .into_iter()
            .filter(|&(p, m)| p.is_finite() && m.is_finite() && m > 0.0)
            .map(|(p, m)| (p - m) / m)
            .collect();
        if signed.is_empty() {
            return None;
        }
        let mut abs: Vec<f64> = signed.iter().map(|e| e.abs()).collect();
        abs.sort_by(f64::total_cmp);
        signed.sort_by(f64::total_cmp);
        // Nearest rank of a sorted, non-empty list.
        let at = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Some(PredictionError {
            samples: signed.len() as u64,
            median_abs: at(&abs, 0.5),
            p90_abs: at(&abs, 0.9),
            median_signed: at(&signed, 0.5),
        })
    }
}

/// What disaggregation did in one replay ([`crate::pd::replay_pd`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdSummary {
    /// Prefill engines (engines `0..P` in `worker_share`).
    pub prefill_engines: usize,
    /// Decode engines (engines `P..P+D`).
    pub decode_engines: usize,
    /// Prompts of at most this many tokens ran colocated.
    pub colocate_below_tokens: u32,
    /// Decode policy (the prefill policy is the report's `policy`).
    pub decode_policy: String,
    /// The transfer model.
    pub transfer: crate::types::TransferModel,
    /// Requests routed split (prefill engine, then decode engine).
    pub split_requests: u64,
    /// Requests routed colocated on a decode engine.
    pub colocated_requests: u64,
    /// KV bytes copied from prefill to decode engines (split requests whose prefill ended).
    pub transfer_bytes: u64,
    /// Mean transfer time of those copies, simulated seconds.
    pub transfer_mean_s: f64,
    /// Prefix-cache hit ratio of completed split requests: the prefill engines' hit tokens
    /// over their prompt tokens.
    pub split_hit_ratio: f64,
    /// Prefix-cache hit ratio of completed colocated requests (the decode engines').
    pub colocated_hit_ratio: f64,
    /// Mean busy time of the prefill engines over the makespan, 0–1.
    pub prefill_busy: f64,
    /// Mean busy time of the decode engines over the makespan, 0–1.
    pub decode_busy: f64,
}

/// Summarises `r`. `infinite` is the trace's infinite-cache `(hit, total)` tokens.
pub fn summarise(r: &ReplayResult, rate_scale: f64, infinite: (u64, u64), slo: Slo) -> PolicyReport {
    let mut lat = Latencies::default();
    let (mut completed, mut rejected, mut good) = (0u64, 0u64, 0u64);
    let (mut hit, mut queried, mut out_tokens) = (0u64, 0u64, 0u64);
    let n_workers = r.busy_ns.len();
    let mut per_worker = vec![0u64; n_workers];
    let mut branches = std::collections::BTreeMap::new();
    let first_arrival = r.outcomes.iter().map(|o| o.arrival.0).min().unwrap_or(0);
    let last_arrival = r.outcomes.iter().map(|o| o.arrival.0).max().unwrap_or(0);
    let mut last_finish = first_arrival;
    for o in &r.outcomes {
        if !o.branch.is_empty() {
            *branches.entry(o.branch.to_string()).or_insert(0) += 1;
        }
        if let Some(w) = o.worker {
            per_worker[w as usize] += 1;
        }
        // A split request counts on its prefill engine too.
        if let Some(w) = o.prefill_worker {
            per_worker[w as usize] += 1;
        }
        if o.rejected {
            rejected += 1;
            continue;
        }
        let (Some(ft), Some(fin)) = (o.first_token, o.finished) else { continue };
        completed += 1;
        hit += o.cached_tokens as u64;
        queried += o.input_tokens as u64;
        out_tokens += o.output_tokens as u64;
        last_finish = last_finish.max(fin.0);
        let t = ft.0.saturating_sub(o.arrival.0) as f64 / 1e9;
        let tp =
            (o.output_tokens > 1).then(|| fin.0.saturating_sub(ft.0) as f64 / 1e9 / f64::from(o.output_tokens - 1));
        lat.record(Some(t), tp, fin.0.saturating_sub(o.arrival.0) as f64 / 1e9);
        if slo.met(t, tp) {
            good += 1;
        }
    }
    let makespan = (last_finish.saturating_sub(first_arrival) as f64 / 1e9).max(1e-9);
    let span = (last_arrival.saturating_sub(first_arrival) as f64 / 1e9).max(1e-9);
    let total = r.outcomes.len() as u64;
    let mean_busy = r.busy_ns.iter().sum::<u64>() as f64 / n_workers.max(1) as f64;
    let max_busy = r.busy_ns.iter().copied().max().unwrap_or(0) as f64;
    PolicyReport {
        policy: r.policy.clone(),
        rate_scale,
        offered_rps: total as f64 / span,
        requests: total,
        completed,
        rejection_rate: rejected as f64 / total.max(1) as f64,
        hit_ratio: hit as f64 / queried.max(1) as f64,
        infinite_cache_hit_ratio: infinite.0 as f64 / infinite.1.max(1) as f64,
        latency: lat.summary(),
        throughput_tok_s: out_tokens as f64 / makespan,
        throughput_rps: completed as f64 / makespan,
        goodput_rps: good as f64 / makespan,
        slo,
        load_imbalance: if mean_busy > 0.0 { max_busy / mean_busy } else { 1.0 },
        worker_share: per_worker.iter().map(|&n| n as f64 / total.max(1) as f64).collect(),
        branches,
        ttft_cdf: lat.ttft_cdf(),
        pd: r.pd.as_ref().map(|pd| pd_summary(r, pd, makespan)),
        kv_migration: r.kv_migration,
        kv_pull: r.kv_pull,
        ttft_prediction: PredictionError::of(r.outcomes.iter().filter(|o| !o.rejected).filter_map(|o| {
            let measured = o.first_token?.0.checked_sub(o.arrival.0)? as f64 / 1e9;
            Some((o.predicted_ttft_s?, measured))
        })),
    }
}

/// The [`PdSummary`] of a PD replay whose makespan is `makespan` seconds.
fn pd_summary(r: &ReplayResult, pd: &crate::types::PdConfig, makespan: f64) -> PdSummary {
    let (mut split, mut colocated, mut bytes, mut copies, mut delay_s) = (0u64, 0u64, 0u64, 0u64, 0.0f64);
    let mut hits = [(0u64, 0u64); 2]; // (hit, queried) of split, colocated
    for o in &r.outcomes {
        let is_split = o.prefill_worker.is_some();
        match (is_split, o.worker) {
            (true, _) => split += 1,
            (false, Some(_)) => colocated += 1,
            (false, None) => {}
        }
        if o.transfer_bytes > 0 {
            bytes += o.transfer_bytes;
            copies += 1;
            delay_s += pd.transfer.delay(u64::from(o.input_tokens)).as_secs_f64();
        }
        if !o.rejected && o.first_token.is_some() && o.finished.is_some() {
            let h = &mut hits[usize::from(!is_split)];
            h.0 += u64::from(o.cached_tokens);
            h.1 += u64::from(o.input_tokens);
        }
    }
    let p = pd.prefill_engines.min(r.busy_ns.len());
    let busy = |b: &[u64]| b.iter().sum::<u64>() as f64 / 1e9 / b.len().max(1) as f64 / makespan;
    PdSummary {
        prefill_engines: pd.prefill_engines,
        decode_engines: pd.decode_engines,
        colocate_below_tokens: pd.colocate_below_tokens,
        decode_policy: pd.decode_policy.clone(),
        transfer: pd.transfer,
        split_requests: split,
        colocated_requests: colocated,
        transfer_bytes: bytes,
        transfer_mean_s: if copies > 0 { delay_s / copies as f64 } else { 0.0 },
        split_hit_ratio: hits[0].0 as f64 / hits[0].1.max(1) as f64,
        colocated_hit_ratio: hits[1].0 as f64 / hits[1].1.max(1) as f64,
        prefill_busy: busy(&r.busy_ns[..p]).min(1.0),
        decode_busy: busy(&r.busy_ns[p..]).min(1.0),
    }
}

/// A fixed-width terminal table of `reports`.
pub fn table(reports: &[PolicyReport]) -> String {
    let mut s = String::new();
    let w = label_width(reports);
    let _ = writeln!(
        s,
        "{:<w$} {:>5} {:>7} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>6}",
        "policy",
        "rate",
        "hit%",
        "rej%",
        "ttft_avg",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "tpot_p99",
        "e2e_p99",
        "tok/s",
        "good/s",
        "imbal"
    );
    for r in reports {
        let _ = writeln!(
            s,
            "{:<w$} {:>5.2} {:>7.2} {:>6.2} {:>8.3} {:>8.3} {:>8.3} {:>8.4} {:>8.4} {:>8.2} {:>8.0} {:>7.2} {:>6.2}",
            r.policy,
            r.rate_scale,
            r.hit_ratio * 100.0,
            r.rejection_rate * 100.0,
            r.latency.ttft_mean_s,
            r.latency.ttft_p50_s,
            r.latency.ttft_p99_s,
            r.latency.tpot_p50_s,
            r.latency.tpot_p99_s,
            r.latency.e2e_p99_s,
            r.throughput_tok_s,
            r.goodput_rps,
            r.load_imbalance
        );
    }
    if reports.iter().any(|r| r.pd.is_some()) {
        let _ = writeln!(
            s,
            "{:<w$} {:>5} {:>7} {:>9} {:>10} {:>8} {:>8} {:>8} {:>7} {:>7}",
            "prefill/decode", "rate", "P:D", "split", "xfer_GB", "xfer_ms", "split_h%", "coloc_h%", "P_busy", "D_busy"
        );
        for r in reports {
            let Some(pd) = &r.pd else { continue };
            let _ = writeln!(
                s,
                "{:<w$} {:>5.2} {:>7} {:>9} {:>10.2} {:>8.2} {:>8.2} {:>8.2} {:>7.2} {:>7.2}",
                r.policy,
                r.rate_scale,
                format!("{}:{}", pd.prefill_engines, pd.decode_engines),
                pd.split_requests,
                pd.transfer_bytes as f64 / 1e9,
                pd.transfer_mean_s * 1e3,
                pd.split_hit_ratio * 100.0,
                pd.colocated_hit_ratio * 100.0,
                pd.prefill_busy,
                pd.decode_busy
            );
        }
    }
    kv_table(&mut s, reports);
    for r in reports {
        if let Some(e) = &r.ttft_prediction {
            let _ = writeln!(
                s,
                "{} x{}: TTFT predicted within {:.0}% (median) / {:.0}% (p90) of the engines' over {} requests, median bias {:+.0}%",
                r.policy,
                r.rate_scale,
                e.median_abs * 100.0,
                e.p90_abs * 100.0,
                e.samples,
                e.median_signed * 100.0
            );
        }
    }
    if let Some(r) = reports.first() {
        let _ = writeln!(
            s,
            "infinite-cache upper bound of this trace: {:.2}% of prompt tokens (one shared cache that never evicts)",
            r.infinite_cache_hit_ratio * 100.0
        );
    }
    s
}

/// Width of [`table`]'s first column: 18, or the longest policy label.
fn label_width(reports: &[PolicyReport]) -> usize {
    reports.iter().map(|r| r.policy.chars().count()).max().unwrap_or(0).max(18)
}

/// The KV mover's lines of [`table`], for the reports that have them, and the KV pulls'.
fn kv_table(s: &mut String, reports: &[PolicyReport]) {
    let w = label_width(reports);
    for r in reports {
        let Some(k) = &r.kv_pull else { continue };
        let mean_ms = if k.kv_pulls > 0 { k.kv_pull_secs * 1e3 / k.kv_pulls as f64 } else { 0.0 };
        let _ = writeln!(
            s,
            "{:<w$} x{}: {} KV pulls, {} tokens, {mean_ms:.1} ms each on average",
            r.policy, r.rate_scale, k.kv_pulls, k.kv_pulled_tokens
        );
    }
    if reports.iter().all(|r| r.kv_migration.is_none()) {
        return;
    }
    let w = label_width(reports);
    let _ = writeln!(
        s,
        "{:<w$} {:>5} {:>8} {:>10} {:>10} {:>8} {:>10} {:>9} {:>9} {:>7}",
        "kv migration", "rate", "restores", "rest_tok", "rest_ms", "saves", "saved_MB", "save_ms", "not_worth", "files"
    );
    for r in reports {
        let Some(k) = &r.kv_migration else { continue };
        let mean_ms = |secs: f64, n: u64| if n > 0 { secs * 1e3 / n as f64 } else { 0.0 };
        let _ = writeln!(
            s,
            "{:<w$} {:>5.2} {:>8} {:>10} {:>10.2} {:>8} {:>10.1} {:>9.2} {:>9} {:>7}",
            r.policy,
            r.rate_scale,
            k.kv_restores,
            k.kv_restored_tokens,
            mean_ms(k.kv_restore_secs, k.kv_restores),
            k.kv_saves,
            k.kv_saved_bytes as f64 / 1e6,
            mean_ms(k.kv_save_secs, k.kv_saves),
            k.kv_restores_not_worth,
            k.kv_files_held
        );
    }
}

/// Writes `reports` as CSV (one row per policy and rate). When any report has
/// [`PolicyReport::pd`], nine columns follow (`pd_prefill_engines`, `pd_decode_engines`,
/// `pd_split_requests`, `pd_transfer_bytes`, `pd_transfer_mean_s`, `pd_split_hit_ratio`,
/// `pd_colocated_hit_ratio`, `pd_prefill_busy`, `pd_decode_busy`; empty for a colocated
/// report); otherwise the columns are the colocated ones only. When any report has
/// [`PolicyReport::kv_migration`], five columns follow (`kv_restores`,
/// `kv_restored_tokens`, `kv_saves`, `kv_saved_tokens`, `kv_saved_bytes`; empty for a
/// report without the mover).
///
/// # Errors
/// I/O or CSV errors.
pub fn write_csv(path: &Path, reports: &[PolicyReport]) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_path(path)?;
    let with_pd = reports.iter().any(|r| r.pd.is_some());
    let with_kv = reports.iter().any(|r| r.kv_migration.is_some());
    let mut header = csv_header(with_pd);
    if with_kv {
        header.extend(KV_COLUMNS);
    }
    w.write_record(header)?;
    for r in reports {
        let mut row = csv_row(r, with_pd);
        if with_kv {
            match &r.kv_migration {
                Some(k) => row.extend(
                    [k.kv_restores, k.kv_restored_tokens, k.kv_saves, k.kv_saved_tokens, k.kv_saved_bytes]
                        .map(|n| n.to_string()),
                ),
                None => row.extend(std::iter::repeat_n(String::new(), KV_COLUMNS.len())),
            }
        }
        w.write_record(row)?;
    }
    w.flush()?;
    Ok(())
}

/// The KV mover's CSV columns ([`write_csv`]).
const KV_COLUMNS: [&str; 5] = ["kv_restores", "kv_restored_tokens", "kv_saves", "kv_saved_tokens", "kv_saved_bytes"];

/// The CSV's column names ([`write_csv`]).
fn csv_header(with_pd: bool) -> Vec<&'static str> {
    let mut header = vec![
        "policy",
        "rate_scale",
        "offered_rps",
        "requests",
        "completed",
        "rejection_rate",
        "hit_ratio",
        "infinite_cache_hit_ratio",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "throughput_tok_s",
        "throughput_rps",
        "goodput_rps",
        "load_imbalance",
    ];
    if with_pd {
        header.extend([
            "pd_prefill_engines",
            "pd_decode_engines",
            "pd_split_requests",
            "pd_transfer_bytes",
            "pd_transfer_mean_s",
            "pd_split_hit_ratio",
            "pd_colocated_hit_ratio",
            "pd_prefill_busy",
            "pd_decode_busy",
        ]);
    }
    header
}

/// One report's CSV row, times and ratios to 6 decimals ([`write_csv`]).
fn csv_row(r: &PolicyReport, with_pd: bool) -> Vec<String> {
    let f = |x: f64| format!("{x:.6}");
    let mut row = vec![
        r.policy.clone(),
        f(r.rate_scale),
        f(r.offered_rps),
        r.requests.to_string(),
        r.completed.to_string(),
        f(r.rejection_rate),
        f(r.hit_ratio),
        f(r.infinite_cache_hit_ratio),
        f(r.latency.ttft_mean_s),
        f(r.latency.ttft_p50_s),
        f(r.latency.ttft_p90_s),
        f(r.latency.ttft_p99_s),
        f(r.latency.tpot_p50_s),
        f(r.latency.tpot_p99_s),
        f(r.latency.e2e_p50_s),
        f(r.latency.e2e_p99_s),
        f(r.throughput_tok_s),
        f(r.throughput_rps),
        f(r.goodput_rps),
        f(r.load_imbalance),
    ];
    if with_pd {
        match &r.pd {
            Some(pd) => row.extend([
                pd.prefill_engines.to_string(),
                pd.decode_engines.to_string(),
                pd.split_requests.to_string(),
                pd.transfer_bytes.to_string(),
                f(pd.transfer_mean_s),
                f(pd.split_hit_ratio),
                f(pd.colocated_hit_ratio),
                f(pd.prefill_busy),
                f(pd.decode_busy),
            ]),
            None => row.extend(std::iter::repeat_n(String::new(), 9)),
        }
    }
    row
}

/// Font used for PNG and SVG plots: `KVROUTE_FONT`, else DejaVu Sans from the usual system
/// paths. `None` when no font is found (plots are then skipped with a warning).
pub fn find_font() -> Option<Vec<u8>> {
    let mut candidates: Vec<std::path::PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("KVROUTE_FONT") {
        candidates.push(p.into());
    }
    for p in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ] {
        candidates.push(p.into());
    }
    candidates.into_iter().find_map(|p| std::fs::read(p).ok())
}

/// Registers the plot font once. Returns false when none is available.
pub fn register_font() -> bool {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REGISTERED.get_or_init(|| {
        let Some(bytes) = find_font() else { return false };
        let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, leaked).is_ok()
    })
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

const COLORS: [plotters::style::RGBColor; 10] = [
    plotters::style::RGBColor(31, 119, 180),
    plotters::style::RGBColor(255, 127, 14),
    plotters::style::RGBColor(44, 160, 44),
    plotters::style::RGBColor(214, 39, 40),
    plotters::style::RGBColor(148, 103, 189),
    plotters::style::RGBColor(140, 86, 75),
    plotters::style::RGBColor(227, 119, 194),
    plotters::style::RGBColor(127, 127, 127),
    plotters::style::RGBColor(188, 189, 34),
    plotters::style::RGBColor(23, 190, 207),
];

fn color(i: usize) -> plotters::style::ShapeStyle {
    use plotters::style::Color;
    let c = COLORS[i % COLORS.len()];
    if i >= COLORS.len() { c.stroke_width(2).filled().stroke_width(1) } else { c.stroke_width(2) }
}

/// One line of a CDF plot: a label and its `(x, fraction)` points, sorted by x.
pub type CdfSeries<'a> = (&'a str, &'a [(f64, f64)]);

fn draw_cdf<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    series: &[CdfSeries<'_>],
    max_x: f64,
    title: &str,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    root.fill(&WHITE)?;
    // Latencies span orders of magnitude (a cache hit is ~50 ms, a herded queue minutes),
    // so the x axis is logarithmic from just below the smallest TTFT to `max_x`.
    let min_x =
        series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)).filter(|x| *x > 0.0).fold(f64::INFINITY, f64::min);
    let min_x = if min_x.is_finite() { (min_x * 0.8).max(1e-4) } else { 1e-3 };
    let max_x = max_x.max(min_x * 10.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((min_x..max_x).log_scale(), 0.0..1.0)?;
    chart.configure_mesh().x_desc("TTFT (s, log scale)").y_desc("fraction of requests").draw()?;
    for (i, (label, points)) in series.iter().enumerate() {
        let style = color(i);
        chart
            .draw_series(LineSeries::new(
                points.iter().copied().filter(|(x, _)| *x <= max_x).map(|(x, y)| (x.max(min_x), y)),
                style,
            ))?
            .label(label.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Writes TTFT CDFs, one line per series, as `<stem>.png` and `<stem>.svg`; the x axis is
/// logarithmic and ends at `max_x` seconds (points beyond it are cut).
///
/// # Errors
/// Plotting or I/O errors; "no font" when none is available.
pub fn plot_cdf_series(stem: &Path, series: &[CdfSeries<'_>], max_x: f64, title: &str) -> PlotResult {
    use plotters::prelude::*;
    if !register_font() {
        return Err("no TrueType font found for plots (set KVROUTE_FONT or install fonts-dejavu-core)".into());
    }
    let png = stem.with_extension("png");
    draw_cdf(BitMapBackend::new(&png, (900, 560)).into_drawing_area(), series, max_x, title)?;
    let svg = stem.with_extension("svg");
    draw_cdf(SVGBackend::new(&svg, (900, 560)).into_drawing_area(), series, max_x, title)?;
    Ok(())
}

/// Writes the TTFT CDF per policy as `<stem>.png` and `<stem>.svg` (x axis to 1.2 × the
/// largest p99).
///
/// # Errors
/// Plotting or I/O errors; "no font" when none is available.
pub fn plot_ttft_cdf(stem: &Path, reports: &[PolicyReport], title: &str) -> PlotResult {
    let max_x = reports.iter().map(|r| r.latency.ttft_p99_s).fold(0.1_f64, f64::max) * 1.2;
    let series: Vec<CdfSeries<'_>> = reports.iter().map(|r| (r.policy.as_str(), r.ttft_cdf.as_slice())).collect();
    plot_cdf_series(stem, &series, max_x, title)
}

fn draw_shares<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    rows: &[(&str, &[f64])],
    title: &str,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    root.fill(&WHITE)?;
    let workers = rows.iter().map(|(_, s)| s.len()).max().unwrap_or(1).max(1);
    let max_y = rows.iter().flat_map(|(_, s)| s.iter().copied()).fold(0.05_f64, f64::max) * 1.15;
    let groups = rows.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..groups as f64, 0.0..max_y.min(1.0))?;
    chart.configure_mesh().disable_x_mesh().x_labels(0).y_desc("share of requests").draw()?;
    // Group labels are drawn at the centre of each group (router on one line, policy on the
    // next) rather than by the axis, whose tick positions need not fall on groups.
    let font = ("sans-serif", 12).into_font();
    for (g, (label, _)) in rows.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let (first, second) = label.split_once(' ').unwrap_or((label, ""));
        for (k, line) in [first, second].into_iter().enumerate() {
            let style = TextStyle::from(font.clone()).pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Top,
            ));
            root.draw(&Text::new(line.to_string(), (x, y + 4 + 14 * k as i32), style))?;
        }
    }
    let width = 0.8 / workers as f64;
    for w in 0..workers {
        let style = color(w).filled();
        chart
            .draw_series(rows.iter().enumerate().filter_map(|(g, (_, shares))| {
                let v = *shares.get(w)?;
                let x0 = g as f64 + 0.1 + w as f64 * width;
                Some(Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], style))
            }))?
            .label(format!("worker {w}"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], style));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// Writes a grouped bar chart of each run's share of requests per worker as `<stem>.png` and
/// `<stem>.svg`: one group per `(label, shares)` row, one bar per worker.
///
/// # Errors
/// Plotting or I/O errors; "no font" when none is available.
pub fn plot_worker_shares(stem: &Path, rows: &[(&str, &[f64])], title: &str) -> PlotResult {
    use plotters::prelude::*;
    if !register_font() {
        return Err("no TrueType font found for plots (set KVROUTE_FONT or install fonts-dejavu-core)".into());
    }
    let width = (160 * rows.len().max(1) as u32 + 200).clamp(700, 2400);
    let png = stem.with_extension("png");
    draw_shares(BitMapBackend::new(&png, (width, 480)).into_drawing_area(), rows, title)?;
    let svg = stem.with_extension("svg");
    draw_shares(SVGBackend::new(&svg, (width, 480)).into_drawing_area(), rows, title)?;
    Ok(())
}

fn draw_sweep<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    reports: &[PolicyReport],
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(560);
    let mut names: Vec<&str> = reports.iter().map(|r| r.policy.as_str()).collect();
    names.dedup();
    names.sort_unstable();
    names.dedup();
    let max_rate = reports.iter().map(|r| r.offered_rps).fold(0.1, f64::max) * 1.05;
    let max_p99 = reports.iter().map(|r| r.latency.ttft_p99_s).fold(0.1, f64::max) * 1.1;
    let min_p99 =
        (reports.iter().map(|r| r.latency.ttft_p99_s).filter(|v| *v > 0.0).fold(max_p99, f64::min) * 0.5).max(1e-3);
    // Hit ratios of real traces sit far below 1: scale the axis to the data.
    let max_hit = (reports.iter().map(|r| r.hit_ratio).fold(0.0, f64::max) * 1.25).clamp(0.05, 1.0);
    let mut hit = ChartBuilder::on(&left)
        .caption("prefix-cache hit ratio vs offered load", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..max_rate, 0.0..max_hit)?;
    hit.configure_mesh().x_desc("offered load (req/s)").y_desc("hit ratio").draw()?;
    let mut lat = ChartBuilder::on(&right)
        .caption("p99 TTFT vs offered load", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..max_rate, (min_p99..max_p99).log_scale())?;
    lat.configure_mesh().x_desc("offered load (req/s)").y_desc("p99 TTFT (s)").draw()?;
    for (i, name) in names.iter().enumerate() {
        let style = color(i);
        let mut pts: Vec<&PolicyReport> = reports.iter().filter(|r| r.policy == *name).collect();
        pts.sort_by(|a, b| a.offered_rps.total_cmp(&b.offered_rps));
        hit.draw_series(LineSeries::new(pts.iter().map(|r| (r.offered_rps, r.hit_ratio)), style))?
            .label(name.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        lat.draw_series(LineSeries::new(pts.iter().map(|r| (r.offered_rps, r.latency.ttft_p99_s.max(0.001))), style))?;
    }
    hit.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// Writes hit ratio and p99 TTFT against offered load, one line per policy, as
/// `<stem>.png` and `<stem>.svg`.
///
/// # Errors
/// Plotting or I/O errors.
pub fn plot_sweep(stem: &Path, reports: &[PolicyReport]) -> PlotResult {
    use plotters::prelude::*;
    if !register_font() {
        return Err("no TrueType font found for plots (set KVROUTE_FONT or install fonts-dejavu-core)".into());
    }
    let png = stem.with_extension("png");
    draw_sweep(BitMapBackend::new(&png, (1120, 520)).into_drawing_area(), reports)?;
    let svg = stem.with_extension("svg");
    draw_sweep(SVGBackend::new(&svg, (1120, 520)).into_drawing_area(), reports)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::PredictionError;

    #[test]
    fn prediction_errors_are_relative_to_the_measured_ttft() {
        // Predicted (s), measured (s): +100 %, −50 %, exact, +10 %; a measured 0 and a NaN
        // are left out.
        let e = PredictionError::of([(2.0, 1.0), (1.0, 2.0), (3.0, 3.0), (1.1, 1.0), (1.0, 0.0), (f64::NAN, 1.0)])
            .expect("four samples");
        assert_eq!(e.samples, 4);
        // |errors| sorted: 0, 0.1, 0.5, 1.0; the median takes the nearer rank (index 2 of 0..3).
        assert!((e.median_abs - 0.5).abs() < 1e-12, "{e:?}");
        assert!((e.p90_abs - 1.0).abs() < 1e-12, "{e:?}");
        // Signed: −0.5, 0, 0.1, 1.0.
        assert!((e.median_signed - 0.1).abs() < 1e-12, "{e:?}");
        assert_eq!(PredictionError::of([(1.0, 0.0)]), None);
    }
}
