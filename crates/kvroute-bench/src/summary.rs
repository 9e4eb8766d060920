//! Percentiles, throughput, goodput, errors and worker shares of a run.

use crate::runner::{Outcome, RequestResult};
/// The SLO of goodput (shared with `kvroute replay`): a request is good when it succeeded
/// and both its TTFT and its TPOT (reported units, after the latency scale) are within it.
pub use kvroute_sim::latency::Slo;
use kvroute_sim::latency::{Latencies, LatencySummary, histogram as hist, quantile as q, record as rec};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Summary of one run. Latencies are in seconds multiplied by `latency_scale` (1 = wall
/// clock; with engine simulators running N× faster than real time, N gives simulated seconds).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    /// Name of the run (router and policy).
    pub label: String,
    /// Multiplier applied to every latency.
    pub latency_scale: f64,
    /// Requests released.
    pub requests: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests refused for load (429, 503, 529).
    pub rejected: u64,
    /// Requests that failed otherwise.
    pub errors: u64,
    /// Failures and rejections by kind (`http 500`, `timeout`, `rejected 503`, …).
    pub failures: BTreeMap<String, u64>,
    /// First send to last completion, wall seconds.
    pub wall_s: f64,
    /// Successful requests per second (wall seconds × `latency_scale`: simulated seconds
    /// for simulated engines, like the latencies).
    pub throughput_rps: f64,
    /// Output tokens of successful requests per (scaled) second.
    pub output_tok_s: f64,
    /// Successful requests within the SLO per (scaled) second.
    pub goodput_rps: f64,
    /// The SLO of `goodput_rps`.
    pub slo: Slo,
    /// TTFT (streaming runs; 0 otherwise), TPOT and E2E, scaled seconds; serialised as
    /// flat `ttft_p50_s`, … fields.
    #[serde(flatten)]
    pub latency: LatencySummary,
    /// Inter-token latency p50 over every gap between content chunks.
    pub itl_p50_s: f64,
    /// Inter-token latency p99.
    pub itl_p99_s: f64,
    /// Σ cached / Σ prompt tokens over answers that report `cached_tokens`; `None` when none do.
    pub cached_token_ratio: Option<f64>,
    /// p99 of send time − scheduled time, wall seconds (open loop: > 0 means the client or
    /// the in-flight bound held requests back).
    pub send_lag_p99_s: f64,
    /// Share of successful requests per worker named by `x-kvroute-worker`.
    pub worker_share: BTreeMap<String, f64>,
    /// TTFT CDF points (seconds, fraction), for plots.
    #[serde(skip)]
    pub ttft_cdf: Vec<(f64, f64)>,
}

/// Summarises `results` of a run labelled `label`. `latency_scale` multiplies every latency
/// (and the SLO is compared with scaled values).
pub fn summarise(label: &str, results: &[RequestResult], latency_scale: f64, slo: Slo) -> Summary {
    let k = if latency_scale.is_finite() && latency_scale > 0.0 { latency_scale } else { 1.0 };
    let (mut lat, mut itl, mut lag) = (Latencies::default(), hist(), hist());
    let (mut ok, mut rejected, mut errors, mut good, mut out_tok) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut cached, mut prompt, mut reported) = (0u64, 0u64, false);
    let mut failures = BTreeMap::new();
    let mut workers: BTreeMap<String, u64> = BTreeMap::new();
    let (mut first, mut last) = (f64::INFINITY, 0.0f64);
    for r in results {
        first = first.min(r.sent_s);
        last = last.max(r.sent_s + r.e2e_s);
        rec(&mut lag, (r.sent_s - r.scheduled_s).max(0.0));
        match &r.outcome {
            Outcome::Ok => {}
            Outcome::Rejected(s) => {
                rejected += 1;
                *failures.entry(format!("rejected {s}")).or_insert(0) += 1;
                continue;
            }
            Outcome::Error(e) => {
                errors += 1;
                *failures.entry(e.clone()).or_insert(0) += 1;
                continue;
            }
        }
        ok += 1;
        out_tok += u64::from(r.output_tokens);
        if let Some(w) = &r.worker {
            *workers.entry(w.clone()).or_insert(0) += 1;
        }
        if let (Some(c), Some(p)) = (r.cached_tokens, r.prompt_tokens) {
            reported = true;
            cached += u64::from(c);
            prompt += u64::from(p);
        }
        for g in &r.itl_s {
            rec(&mut itl, g * k);
        }
        let t = r.ttft_s.map(|t| t * k);
        let tp = match t {
            Some(t) if r.output_tokens > 1 => Some((r.e2e_s * k - t).max(0.0) / f64::from(r.output_tokens - 1)),
            _ => None,
        };
        lat.record(t, tp, r.e2e_s * k);
        // Without a streamed first token, E2E stands in for TTFT in the SLO check.
        if slo.met(t.unwrap_or(r.e2e_s * k), tp) {
            good += 1;
        }
    }
    let wall = if results.is_empty() { 0.0 } else { (last - first).max(1e-9) };
    // Rates are per second of the same clock as the latencies (wall × latency scale).
    let per_s = |x: u64| if wall > 0.0 { x as f64 / (wall * k) } else { 0.0 };
    let total_served: u64 = workers.values().sum();
    Summary {
        label: label.to_string(),
        latency_scale: k,
        requests: results.len() as u64,
        ok,
        rejected,
        errors,
        failures,
        wall_s: wall,
        throughput_rps: per_s(ok),
        output_tok_s: per_s(out_tok),
        goodput_rps: per_s(good),
        slo,
        latency: lat.summary(),
        itl_p50_s: q(&itl, 0.5),
        itl_p99_s: q(&itl, 0.99),
        cached_token_ratio: reported.then(|| cached as f64 / prompt.max(1) as f64),
        send_lag_p99_s: q(&lag, 0.99),
        worker_share: workers.into_iter().map(|(w, n)| (w, n as f64 / total_served.max(1) as f64)).collect(),
        ttft_cdf: lat.ttft_cdf(),
    }
}

/// The terminal table of several runs: one row each.
pub fn table(rows: &[Summary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<28} {:>7} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "run",
        "ok",
        "rej",
        "err",
        "req/s",
        "good/s",
        "TTFT avg",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "E2E p99",
        "cached"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<28} {:>7} {:>6} {:>6} {:>8.2} {:>8.2} {:>8.3} {:>8.3} {:>8.3} {:>8.4} {:>8.3} {:>7}",
            r.label,
            r.ok,
            r.rejected,
            r.errors,
            r.throughput_rps,
            r.goodput_rps,
            r.latency.ttft_mean_s,
            r.latency.ttft_p50_s,
            r.latency.ttft_p99_s,
            r.latency.tpot_p50_s,
            r.latency.e2e_p99_s,
            r.cached_token_ratio.map_or_else(|| "-".into(), |c| format!("{:.1}%", c * 100.0)),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(i: usize, outcome: Outcome, ttft: Option<f64>, e2e: f64, out: u32) -> RequestResult {
        RequestResult {
            index: i,
            scheduled_s: i as f64,
            sent_s: i as f64 + 0.5,
            outcome,
            status: Some(200),
            ttft_s: ttft,
            e2e_s: e2e,
            itl_s: vec![0.01; out.saturating_sub(1) as usize],
            output_tokens: out,
            prompt_tokens: Some(100),
            cached_tokens: Some(50),
            worker: Some(format!("w{}", i % 2)),
            answer: String::new(),
        }
    }

    #[test]
    fn counts_rejections_and_errors_apart_and_scales_latency() {
        let rs = vec![
            res(0, Outcome::Ok, Some(0.1), 0.2, 11),
            res(1, Outcome::Ok, Some(0.3), 0.4, 11),
            res(2, Outcome::Rejected(503), None, 0.01, 0),
            res(3, Outcome::Error("timeout".into()), None, 5.0, 0),
        ];
        let s = summarise("x", &rs, 10.0, Slo { ttft_s: 2.0, tpot_s: 0.5 });
        assert_eq!((s.requests, s.ok, s.rejected, s.errors), (4, 2, 1, 1));
        assert_eq!(s.failures.get("rejected 503"), Some(&1));
        assert_eq!(s.failures.get("timeout"), Some(&1));
        assert!((s.latency.ttft_mean_s - 2.0).abs() < 1e-9, "×10: 1 s and 3 s, mean {}", s.latency.ttft_mean_s);
        // TPOT of request 0: (2 − 1) / 10 = 0.1 s; request 1: (4 − 3) / 10.
        assert!((s.latency.tpot_p50_s - 0.1).abs() < 1e-3, "{}", s.latency.tpot_p50_s);
        // Goodput: only request 0 meets TTFT ≤ 2 s.
        assert_eq!(s.cached_token_ratio, Some(0.5));
        assert_eq!(s.worker_share.get("w0"), Some(&0.5));
        // Wall: first send 0.5 s, last end 3.5 + 5.0 s.
        assert!((s.wall_s - 8.0).abs() < 1e-9);
        assert!((s.goodput_rps - 1.0 / 80.0).abs() < 1e-9, "per simulated second: 1 / (8 s × 10)");
        assert!((s.send_lag_p99_s - 0.5).abs() < 1e-3);
        assert!(table(&[s]).contains("50.0%"));
    }

    #[test]
    fn empty_run_is_all_zero() {
        let s = summarise("none", &[], 1.0, Slo { ttft_s: 1.0, tpot_s: 1.0 });
        assert_eq!((s.requests, s.ok, s.throughput_rps), (0, 0, 0.0));
        assert_eq!(s.cached_token_ratio, None);
    }
}
