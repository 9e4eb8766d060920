//! One latency summary for every report kvroute prints — `kvroute replay` (simulated
//! engines), `kvroute bench` and `kvroute bench compare` (real HTTP): TTFT, TPOT and E2E
//! percentiles from HDR histograms, and the SLO that goodput counts against.
//!
//! Units: every input and output is in seconds; histograms hold microseconds (1 µs to
//! 2^55 µs, about 1.1 billion years, 3 significant digits), so a percentile is exact to
//! 0.1 % for any latency the simulated clock can hold (u64 nanoseconds, at most ~585 years).
//! A latency beyond the range (only a non-finite one in practice) is counted at the top
//! and its percentiles read as `inf`, never as a smaller number. One histogram takes
//! ~380 KiB.

use hdrhistogram::Histogram;

/// Service-level objective of goodput: a request is good when it succeeded and both its
/// TTFT and its TPOT are within these (seconds, in the report's clock).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Slo {
    /// Maximum TTFT, seconds.
    pub ttft_s: f64,
    /// Maximum TPOT, seconds.
    pub tpot_s: f64,
}

impl Slo {
    /// The objective of the `--slo-ttft` and `--slo-tpot` flags (`kvroute replay`,
    /// `kvroute bench`): each bound a finite number of seconds > 0. A negative or NaN bound
    /// made every request miss (good/s 0.00), an infinite one made every request meet it.
    ///
    /// # Errors
    /// The flag and value of the first bound that is not.
    pub fn from_flags(ttft_s: f64, tpot_s: f64) -> Result<Slo, String> {
        for (flag, v) in [("--slo-ttft", ttft_s), ("--slo-tpot", tpot_s)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{flag}: {v} must be a finite number of seconds > 0"));
            }
        }
        Ok(Slo { ttft_s, tpot_s })
    }

    /// Whether a request with this TTFT and TPOT (seconds; `None` TPOT for a single-token
    /// answer) meets the objective.
    pub fn met(&self, ttft_s: f64, tpot_s: Option<f64>) -> bool {
        ttft_s <= self.ttft_s && tpot_s.unwrap_or(0.0) <= self.tpot_s
    }
}

/// TTFT, TPOT and E2E of the requests of one run, seconds. Zero where nothing was recorded
/// (e.g. TTFT of a non-streamed HTTP run).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    /// TTFT mean.
    pub ttft_mean_s: f64,
    /// TTFT p50.
    pub ttft_p50_s: f64,
    /// TTFT p90.
    pub ttft_p90_s: f64,
    /// TTFT p99.
    pub ttft_p99_s: f64,
    /// TPOT p50: per request `(e2e − ttft) / (output tokens − 1)`.
    pub tpot_p50_s: f64,
    /// TPOT p99.
    pub tpot_p99_s: f64,
    /// E2E mean.
    pub e2e_mean_s: f64,
    /// E2E p50.
    pub e2e_p50_s: f64,
    /// E2E p99.
    pub e2e_p99_s: f64,
}

/// Upper bound of the histograms, microseconds (2^55 µs, ~1.1 billion years): twice the
/// longest time the simulated u64-nanosecond clock holds (`u64::MAX` ns ≈ 1.8 × 10^16 µs),
/// so no latency of a replay or a bench run reaches it.
const MAX_US: u64 = 1 << 55;

/// A fresh microsecond histogram (also used for other per-request durations, e.g. ITL).
pub fn histogram() -> Histogram<u64> {
    // Constant, valid bounds.
    #[allow(clippy::expect_used)]
    Histogram::new_with_bounds(1, MAX_US, 3).expect("valid histogram bounds")
}

/// Records `secs` into a microsecond histogram: at least 1 µs; a value over the range
/// (2^55 µs), infinite or NaN is counted at the top, where [`quantile`] reads `inf`.
pub fn record(h: &mut Histogram<u64>, secs: f64) {
    let us = if secs.is_finite() { (secs * 1e6).round().max(1.0) as u64 } else { MAX_US };
    let _ = h.record(us.clamp(1, MAX_US));
}

/// The `quantile` (0.0–1.0) of a microsecond histogram, seconds: the top of its 0.1 %
/// bucket, so never below the true value (the bottom for quantile 0); 0 when empty, `inf`
/// when it falls on values recorded over the range.
pub fn quantile(h: &Histogram<u64>, quantile: f64) -> f64 {
    if h.is_empty() {
        return 0.0;
    }
    let us = h.value_at_quantile(quantile);
    if us >= h.lowest_equivalent(MAX_US) { f64::INFINITY } else { us as f64 / 1e6 }
}

/// Accumulates the latencies of completed requests; [`Latencies::summary`] reads them out.
#[derive(Debug, Clone)]
pub struct Latencies {
    ttft: Histogram<u64>,
    tpot: Histogram<u64>,
    e2e: Histogram<u64>,
    ttft_sum: f64,
    e2e_sum: f64,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies { ttft: histogram(), tpot: histogram(), e2e: histogram(), ttft_sum: 0.0, e2e_sum: 0.0 }
    }
}

impl Latencies {
    /// Records one completed request: its TTFT (`None` when no first token was seen), TPOT
    /// (`None` for answers of at most one token) and E2E, seconds.
    pub fn record(&mut self, ttft_s: Option<f64>, tpot_s: Option<f64>, e2e_s: f64) {
        if let Some(t) = ttft_s {
            record(&mut self.ttft, t);
            self.ttft_sum += t;
        }
        if let Some(t) = tpot_s {
            record(&mut self.tpot, t);
        }
        record(&mut self.e2e, e2e_s);
        self.e2e_sum += e2e_s;
    }

    /// Means and percentiles of what was recorded.
    pub fn summary(&self) -> LatencySummary {
        let mean = |sum: f64, h: &Histogram<u64>| if h.is_empty() { 0.0 } else { sum / h.len() as f64 };
        LatencySummary {
            ttft_mean_s: mean(self.ttft_sum, &self.ttft),
            ttft_p50_s: quantile(&self.ttft, 0.5),
            ttft_p90_s: quantile(&self.ttft, 0.9),
            ttft_p99_s: quantile(&self.ttft, 0.99),
            tpot_p50_s: quantile(&self.tpot, 0.5),
            tpot_p99_s: quantile(&self.tpot, 0.99),
            e2e_mean_s: mean(self.e2e_sum, &self.e2e),
            e2e_p50_s: quantile(&self.e2e, 0.5),
            e2e_p99_s: quantile(&self.e2e, 0.99),
        }
    }

    /// The TTFT CDF as `(seconds, fraction)` at 201 evenly spaced fractions (empty when no
    /// TTFT was recorded), for plots.
    pub fn ttft_cdf(&self) -> Vec<(f64, f64)> {
        if self.ttft.is_empty() {
            return Vec::new();
        }
        (0..=200).map(|i| i as f64 / 200.0).map(|f| (quantile(&self.ttft, f), f)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_means_and_the_slo() {
        let mut l = Latencies::default();
        for i in 1..=100u32 {
            let t = f64::from(i) / 100.0;
            l.record(Some(t), (i > 1).then_some(0.01), 2.0 * t);
        }
        let s = l.summary();
        assert!((s.ttft_mean_s - 0.505).abs() < 1e-9, "{s:?}");
        assert!((s.ttft_p50_s - 0.5).abs() < 1e-3 && (s.ttft_p99_s - 0.99).abs() < 1e-3, "{s:?}");
        assert!((s.e2e_mean_s - 1.01).abs() < 1e-9 && (s.e2e_p50_s - 1.0).abs() < 2e-3, "{s:?}");
        assert!((s.tpot_p50_s - 0.01).abs() < 1e-4, "{s:?}");
        let cdf = l.ttft_cdf();
        assert_eq!(cdf.len(), 201);
        assert!(cdf.windows(2).all(|w| w[0].0 <= w[1].0));
        let slo = Slo { ttft_s: 0.5, tpot_s: 0.02 };
        assert!(slo.met(0.5, Some(0.02)) && slo.met(0.1, None));
        assert!(!slo.met(0.51, None) && !slo.met(0.1, Some(0.03)));
        // Nothing recorded: zeros, not NaN.
        assert_eq!(Latencies::default().summary(), LatencySummary::default());
        assert!(Latencies::default().ttft_cdf().is_empty());
    }

    #[test]
    fn long_latencies_are_not_capped() {
        // A saturated engine: most TTFTs over the old 10,000 s cap; the mean must not
        // exceed the p99 and the p50 must be the true median.
        let mut l = Latencies::default();
        for i in 1..=100u32 {
            let t = f64::from(i) * 1_000.0; // 1,000 s .. 100,000 s
            l.record(Some(t), None, t);
        }
        let s = l.summary();
        assert!((s.ttft_p50_s - 50_000.0).abs() / 50_000.0 < 1e-3, "{s:?}");
        assert!((s.ttft_p99_s - 99_000.0).abs() / 99_000.0 < 1e-3, "{s:?}");
        assert!(s.ttft_mean_s <= s.ttft_p99_s && s.e2e_mean_s <= s.e2e_p99_s, "{s:?}");
        // The longest time the u64-nanosecond clock holds is still exact to 0.1 %.
        let longest = u64::MAX as f64 / 1e9;
        let mut l = Latencies::default();
        l.record(Some(longest), None, longest);
        let p = l.summary().ttft_p99_s;
        assert!(p >= longest && p <= longest * 1.001, "{p} vs {longest}");
        // Beyond the range: `inf`, not a smaller number.
        let mut l = Latencies::default();
        l.record(Some(f64::INFINITY), None, 1e300);
        assert_eq!(l.summary().ttft_p50_s, f64::INFINITY);
        assert_eq!(l.summary().e2e_p99_s, f64::INFINITY);
    }
}
