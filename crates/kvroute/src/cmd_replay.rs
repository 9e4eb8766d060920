//! `kvroute replay`: replay a request trace through routing policies onto simulated engines.

use anyhow::{Context, bail};
use kvroute_core::types::Nanos;
use kvroute_sim::engine::Profile;
use kvroute_sim::pd::{PdConfig, TransferModel, replay_pd};
use kvroute_sim::replay::{KvOracle, KvPull, PrefixState, ReplayConfig, replay};
use kvroute_sim::report::{PolicyReport, Slo, plot_sweep, plot_ttft_cdf, summarise, table, write_csv};
use kvroute_sim::trace::{self, TraceFormat, TraceRequest};
use kvroute_sim::types::KvMigration;
use std::path::PathBuf;

/// Flags of `kvroute replay`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Trace file: Mooncake JSONL, Azure CSV or session JSONL.
    #[arg(long)]
    pub trace: PathBuf,
    /// Trace format (detected from the file when omitted).
    #[arg(long, value_parser = ["mooncake", "azure", "session"])]
    pub format: Option<String>,
    /// Policies: a name, a comma-separated list, `all` (every registered policy; `capped` as
    /// the trace transform, under `b3`) or `b3`
    /// (B3 `cache_aware_proxy.py`'s matrix: lmetric, load_only, sticky, unified and lmetric on the capped trace).
    #[arg(long, default_value = "all")]
    pub policy: String,
    /// Policy knobs as a JSON object (applied to every policy named; unknown knobs are errors).
    #[arg(long)]
    pub knobs: Option<String>,
    /// Number of simulated engines (default 8; with --pd, P + D: a different value is an error).
    #[arg(long)]
    pub engines: Option<usize>,
    /// Prefill/decode disaggregation: P prefill engines and D decode engines (`P:D`, both >= 1),
    /// replacing --engines. Prompts longer than --colocate-below-tokens run their prefill on a
    /// prefill engine (--prefill-policy), their KV is copied (the --kv-* transfer model) to a
    /// decode engine (--decode-policy, chosen at routing time) which generates the answer;
    /// shorter prompts run colocated on a decode engine.
    #[arg(long, value_name = "P:D")]
    pub pd: Option<String>,
    /// With --pd: prompts of at most this many tokens run colocated on a decode engine.
    #[arg(long, default_value_t = kvroute_sim::pd::DEFAULT_COLOCATE_BELOW_TOKENS, requires = "pd", value_name = "N")]
    pub colocate_below_tokens: u32,
    /// With --pd: the policy routing prefills over the prefill engines (default: each --policy
    /// value; a name, a comma-separated list, `all` or `b3`, as --policy). --knobs apply to it.
    #[arg(long, requires = "pd", value_name = "NAME")]
    pub prefill_policy: Option<String>,
    /// With --pd: the policy routing decode phases and colocated requests over the decode
    /// engines (default knobs).
    #[arg(long, default_value = "least_load", requires = "pd", value_name = "NAME")]
    pub decode_policy: String,
    /// With --pd: KV cache bytes per prompt token copied from prefill to decode (131072 =
    /// 128 KiB, Llama-3-8B fp16: 32 layers x 8 KV heads x 128 dims x 2 x 2 bytes).
    #[arg(long, default_value_t = kvroute_sim::pd::DEFAULT_KV_BYTES_PER_TOKEN, requires = "pd", value_name = "BYTES")]
    pub kv_bytes_per_token: u64,
    /// With --pd: prefill-to-decode link bandwidth, GB/s (25, a 200 Gb/s RDMA NIC).
    #[arg(long, default_value_t = kvroute_sim::pd::DEFAULT_LINK_GBYTES_PER_S, requires = "pd", value_name = "GB/S")]
    pub kv_link_gbytes_per_s: f64,
    /// With --pd: fixed cost of one KV transfer, seconds.
    #[arg(long, default_value_t = 0.0, requires = "pd", value_name = "S", allow_hyphen_values = true)]
    pub kv_transfer_latency_secs: f64,
    #[command(flatten)]
    pub profile: crate::sim_args::ProfileArgs,
    /// Arrival-rate multipliers, comma-separated (a load sweep when several).
    #[arg(long, default_value = "1")]
    pub rate_scale: String,
    /// Which sessions of the trace to replay (a time span, conversations of a minimum
    /// length; the slice's first request becomes time 0).
    #[command(flatten)]
    pub slice: kvroute_bench::cli::TraceSliceArgs,
    /// Cap on every request's output tokens (as `kvroute demo` and `kvroute bench` send).
    #[arg(long)]
    pub max_output: Option<u32>,
    /// Keep this fraction of requests, in (0, 1] (deterministic from --seed).
    #[arg(long, default_value_t = 1.0)]
    pub sample: f64,
    /// Keep only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Apply B3 `cache_aware_proxy.py`'s capped transform with this many turns per session to the trace.
    #[arg(long)]
    pub cap_turns: Option<usize>,
    /// Do not spread requests that share a whole-second timestamp over that second.
    #[arg(long)]
    pub no_spread: bool,
    /// Spread each whole second's requests at uniform random instants drawn from this seed
    /// instead of evenly: another realisation of the trace at the same load (results near
    /// saturation depend on it; average over a few).
    #[arg(long, conflicts_with = "no_spread")]
    pub arrival_seed: Option<u64>,
    /// Seed of the policies' random source and of sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Waiting-queue bound per engine (beyond it requests are rejected).
    #[arg(long, default_value_t = 4096)]
    pub max_waiting: usize,
    /// Hide the engines' own queue/KV counters from the router (ledger only).
    #[arg(long)]
    pub no_engine_signals: bool,
    /// Router prefix state, comma-separated: `approximate` (each policy's own index of what
    /// it routed) and/or `precise` (the engines' real cache contents, as from KV events;
    /// reported as `POLICY/precise`; prefix-blind policies run once) and/or `slots` (with a
    /// profile with llama.cpp slots, e.g. `cpu-smollm2-135m`: the router tracks each
    /// engine's slots and names the slot of every request, as `kvroute serve
    /// --llama-slot-routing` does; reported as `POLICY/slots`, every policy runs).
    #[arg(long, default_value = "approximate")]
    pub prefix_state: String,
    /// Closed-loop sessions: a request arrives no earlier than the end of its session's
    /// previous request (and as late after its trace time as that one arrived), as a chat
    /// client sends a turn once the previous one has answered. For traces of closed-loop
    /// clients (`kvroute bench`'s conversations recorded with `kvroute serve --record`,
    /// whose sessions are the clients' `x-session-id`); not with `--pd`.
    #[arg(long)]
    pub closed_sessions: bool,
    /// A load generator's closed-loop clients, N sessions at a time (implies
    /// `--closed-sessions`): a session's next request arrives the instant its previous one
    /// ends (no recorded think time), the first N sessions start at their trace times and
    /// each later one when a session ends, as `kvroute bench --conversation-concurrency N`
    /// sends them. 0 = no limit. Not with `--pd`.
    #[arg(long, default_value_t = 0)]
    pub session_concurrency: usize,
    /// The engines share this many CPU cores, one thread each (llama.cpp workers on one
    /// host, `scripts/llama-workers.sh`): while n engines are busy, each runs at
    /// min(1, N / n) of the profile's speed, whose times are then an engine's alone on a
    /// core. 0 = every engine has its own hardware. Not with `--pd`.
    #[arg(long, default_value_t = 0)]
    pub host_cores: u32,
    /// The measured slow-down of each busy engine with 1, 2, … engines busy on the shared
    /// host, comma-separated (`scripts/llama-calibrate.py`'s `host_slowdown`, e.g.
    /// `1,1.06,1.55,2.12`): while k engines are busy each runs at 1 / the k-th value of the
    /// profile's speed; past the list, the last value × k / its length. Replaces
    /// `--host-cores`' min(1, N / n). Not with `--pd`.
    #[arg(long, value_delimiter = ',')]
    pub host_slowdown: Vec<f64>,
    /// A bound, not a router: before each request's prefill, copy to its engine at no cost
    /// the longest prefix of it that `fleet` (any engine's KV cache at that moment) or
    /// `store` (every block computed so far, without bound) holds. Route with a load-only
    /// policy (`least_load`, `round_robin`) to see what perfect placement of the cached
    /// prefixes would allow. Reported as `POLICY/oracle-fleet` or `POLICY/oracle-store`.
    /// Not with `--pd` or a profile with llama.cpp slots.
    #[arg(long, default_value = "off", value_parser = ["off", "fleet", "store"])]
    pub kv_oracle: String,
    /// The KV mover of `kvroute serve`'s `[kv_migration]` on the `--prefix-state slots`
    /// runs: a long prompt's slot is saved to a file when its request ends (write-behind,
    /// the slot busy meanwhile), and the best saved prefix is restored into the slot a
    /// request is sent to when that adds at least --kv-min-tokens and reading it beats
    /// recomputing (the profile's kv_restore_secs_per_token, kv_save_secs_per_token and
    /// kv_transfer_overhead_secs). Reported as `POLICY/slots+kv` with kv_restores,
    /// kv_saves, … Needs a profile with llama.cpp slots and `--prefix-state slots`; not
    /// with --pd.
    #[arg(long)]
    pub kv_migration: bool,
    /// On the `--prefix-state precise` runs of a paged-cache profile: when the engine a
    /// request is sent to holds less of its prompt than another engine does (by at least
    /// 256 tokens), copy the longer prefix's KV from that engine first, at GB_PER_SEC
    /// gigabytes a second plus 2 ms a copy (vLLM's NixlConnector or SGLang's transfer
    /// engine over RDMA: 50 for 400 Gb/s), when that beats prefilling it; the request waits
    /// for the copy. The profile's kv_file_bytes_per_token is a token's KV. Reported as
    /// `POLICY/precise+pull` with the pulls' count. Not with --pd or --kv-oracle.
    #[arg(long, value_name = "GB_PER_SEC")]
    pub kv_pull: Option<f64>,
    /// With --kv-migration: prompts shorter than this are not saved, and restores adding
    /// fewer tokens are not tried (`[kv_migration] min_tokens`).
    #[arg(long, default_value_t = 1024, requires = "kv_migration", value_name = "TOKENS")]
    pub kv_min_tokens: u32,
    /// Key each tenant's requests apart, as `kvroute serve` does with tenant isolation (and
    /// an engine honouring vLLM's `cache_salt`): the blocks of trace lines with a `tenant`
    /// are salted per tenant. `false` replays one shared cache, so the two runs show the hit
    /// isolation costs. Lines without a tenant are never salted.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub tenant_isolation: bool,
    /// Predict-on-route window of the precise prefix state, seconds (0 turns it off).
    #[arg(long, default_value_t = 2.0)]
    pub predict_window_secs: f64,
    /// TTFT SLO for goodput, seconds (> 0).
    #[arg(long, default_value_t = 2.0)]
    pub slo_ttft: f64,
    /// TPOT SLO for goodput, seconds (> 0).
    #[arg(long, default_value_t = 0.1)]
    pub slo_tpot: f64,
    /// Write the reports as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the reports as CSV to this file.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Write plots (ttft_cdf.{png,svg}, and sweep.{png,svg} for several rates) into this directory.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
    #[command(flatten)]
    pub jobs: crate::sim_args::JobsArgs,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// One replay to run: policy name, label, rate and whether to cap the trace.
#[derive(Debug, Clone)]
struct Run {
    policy: String,
    label: String,
    rate: f64,
    capped: bool,
    prefix_state: PrefixState,
    slot_routing: bool,
}

fn policies(spec: &str) -> anyhow::Result<Vec<(String, String, bool)>> {
    let names = kvroute_core::registry::names();
    let mut out = Vec::new();
    for p in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match p {
            // `capped` replays as B3 ran it, a transform of the trace (below), not as the live
            // policy that refuses a session's later turns: its TTFT would be over fewer requests.
            "all" => {
                out.extend(names.iter().filter(|n| **n != "capped").map(|n| (n.to_string(), n.to_string(), false)))
            }
            "b3" => {
                for n in ["lmetric", "load_only", "sticky", "unified"] {
                    out.push((n.to_string(), n.to_string(), false));
                }
                out.push(("lmetric".into(), "capped".into(), true));
            }
            "capped" => out.push(("lmetric".into(), "capped".into(), true)),
            n if names.contains(&n) => out.push((n.to_string(), n.to_string(), false)),
            n => {
                // `capped` is a registry name too: listed once, with the groups.
                let rest: Vec<&str> = names.iter().copied().filter(|m| *m != "capped").collect();
                bail!("--policy: unknown policy `{n}`; known: all, b3, capped, {}", rest.join(", "))
            }
        }
    }
    if out.is_empty() {
        bail!("--policy: no policy named");
    }
    Ok(out)
}

/// The `--prefix-state` list: each a prefix state and whether the router tracks slots.
fn parse_prefix_states(spec: &str, window_secs: f64) -> anyhow::Result<Vec<(PrefixState, bool)>> {
    if !(window_secs.is_finite() && window_secs >= 0.0) {
        bail!("--predict-window-secs: {window_secs} must be >= 0");
    }
    let mut out = Vec::new();
    for p in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        out.push(match p {
            "approximate" => (PrefixState::Approximate, false),
            "precise" => (PrefixState::Precise { predict_window: Nanos::from_secs_f64(window_secs) }, false),
            "slots" => (PrefixState::Approximate, true),
            other => bail!("--prefix-state: unknown `{other}`; known: approximate, precise, slots"),
        });
    }
    if out.is_empty() {
        bail!("--prefix-state: none named");
    }
    Ok(out)
}

fn parse_rates(spec: &str) -> anyhow::Result<Vec<f64>> {
    spec.split(',')
        .map(|s| {
            let v: f64 = s.trim().parse().with_context(|| format!("--rate-scale: `{s}` is not a number"))?;
            trace::check_rate_scale(&[], v).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
            Ok(v)
        })
        .collect()
}

/// Reads and transforms the trace as the flags say.
pub fn load_trace(args: &Args) -> anyhow::Result<Vec<TraceRequest>> {
    let format = match args.format.as_deref() {
        Some("mooncake") => Some(TraceFormat::Mooncake),
        Some("azure") => Some(TraceFormat::Azure),
        Some("session") => Some(TraceFormat::Session),
        _ => None,
    };
    if !(args.sample > 0.0 && args.sample <= 1.0) {
        // NaN and 2 ran as 1 (`sample < 1.0` is false for both); -1 kept no request.
        bail!("--sample: {} must be a fraction in (0, 1]", args.sample);
    }
    let mut t = trace::read(&args.trace, format)?;
    match (args.no_spread, args.arrival_seed) {
        (true, _) => {}
        (false, Some(seed)) => trace::spread_seconds_random(&mut t, seed),
        (false, None) => trace::spread_seconds(&mut t),
    }
    if args.slice.is_set() {
        t = args.slice.apply(t)?;
        trace::rebase(&mut t);
    }
    if args.tenant_isolation {
        trace::isolate_tenants(&mut t);
    }
    crate::sim_args::cap_outputs(&mut t, args.max_output)?;
    if args.sample < 1.0 {
        t = trace::sample(t, args.sample, args.seed);
    }
    if let Some(n) = args.cap_turns {
        t = trace::cap_sessions(t, n);
    }
    if let Some(n) = args.limit {
        trace::truncate(&mut t, n);
    }
    if t.is_empty() {
        bail!("{}: no requests left after sampling", args.trace.display());
    }
    Ok(t)
}

/// The disaggregation settings of `--pd P:D` and its companion flags (`None` without --pd).
fn parse_pd(args: &Args) -> anyhow::Result<Option<PdConfig>> {
    let Some(spec) = &args.pd else { return Ok(None) };
    let parse = |s: &str| s.trim().parse::<usize>().ok();
    let Some((p, d)) = spec.split_once(':').and_then(|(p, d)| Some((parse(p)?, parse(d)?))) else {
        bail!("--pd: expected P:D (prefill engines : decode engines), got `{spec}`");
    };
    let pd = PdConfig {
        prefill_engines: p,
        decode_engines: d,
        colocate_below_tokens: args.colocate_below_tokens,
        decode_policy: args.decode_policy.clone(),
        transfer: TransferModel {
            kv_bytes_per_token: args.kv_bytes_per_token,
            link_gbytes_per_s: args.kv_link_gbytes_per_s,
            latency_secs: args.kv_transfer_latency_secs,
        },
    };
    pd.validate().map_err(|e| anyhow::anyhow!(e))?;
    if let Some(e) = args.engines
        && e != p + d
    {
        bail!("--engines {e} disagrees with --pd {p}:{d} ({} engines); give one or the other", p + d);
    }
    kvroute_core::registry::build(&pd.decode_policy, &serde_json::Value::Null)
        .with_context(|| format!("--decode-policy `{}`", pd.decode_policy))?;
    Ok(Some(pd))
}

/// What every replay of one `kvroute replay` shares, from the flags: the fleet, the
/// policies with their knobs, the rates, prefix states and disaggregation settings.
struct Setup {
    profile: Profile,
    knobs: serde_json::Value,
    rates: Vec<f64>,
    pd: Option<PdConfig>,
    kv_oracle: KvOracle,
    /// `(policy, label, capped)` of each `--policy` (or `--prefill-policy`) entry.
    policies: Vec<(String, String, bool)>,
    /// `--prefix-state` entries: a prefix state and whether the router tracks slots.
    states: Vec<(PrefixState, bool)>,
    engines: usize,
    /// `--kv-migration`: the KV mover of the slot-routing runs.
    kv_migration: Option<KvMigration>,
    /// `--kv-pull`: the KV pulls of the precise runs.
    kv_pull: Option<KvPull>,
}

/// The trace as the flags shape it, its capped version (`--policy capped`, `b3`) and its
/// infinite-cache hit (the bound every report is compared with).
struct Traces {
    base: Vec<TraceRequest>,
    capped: Vec<TraceRequest>,
    infinite: (u64, u64),
}

/// Runs `kvroute replay`: reads the settings and the trace, plans one replay per rate,
/// prefix state and policy, runs them in parallel, and reports.
pub fn run(args: Args) -> anyhow::Result<()> {
    let setup = setup(&args)?;
    let base = load_trace(&args)?;
    for &rate in &setup.rates {
        trace::check_rate_scale(&base, rate).map_err(|e| anyhow::anyhow!("--rate-scale: {e}"))?;
    }
    let traces = Traces {
        capped: trace::cap_sessions(base.clone(), kvroute_core::trace::MAX_TURNS),
        infinite: trace::infinite_cache_hit(&base),
        base,
    };
    // Validate every policy's knobs before spending time.
    for (p, _, _) in &setup.policies {
        kvroute_core::registry::build(p, &setup.knobs).with_context(|| format!("--knobs for `{p}`"))?;
    }
    let runs = plan_runs(&setup);
    let reports = replay_all(&args, &setup, &traces, &runs)?;
    print_header(&args, &setup, &traces.base);
    print!("{}", table(&reports));
    if let Some(p) = &args.json {
        write_json(p, &args, &setup, &traces.base, &reports)?;
    }
    if let Some(p) = &args.csv {
        write_csv(p, &reports).with_context(|| format!("--csv {}", p.display()))?;
    }
    if let Some(dir) = &args.plot_dir {
        write_plots(dir, &setup, &reports)?;
    }
    Ok(())
}

/// Parses and cross-checks the flags that configure the replays (the trace aside).
fn setup(args: &Args) -> anyhow::Result<Setup> {
    let profile = args.profile.load()?;
    let knobs: serde_json::Value = match &args.knobs {
        Some(k) => serde_json::from_str(k).context("--knobs: not JSON")?,
        None => serde_json::Value::Null,
    };
    let rates = parse_rates(&args.rate_scale)?;
    let pd = parse_pd(args)?;
    if pd.is_some() && args.closed_sessions {
        bail!("--closed-sessions: not supported with --pd");
    }
    if pd.is_some() && (args.session_concurrency > 0 || args.host_cores > 0 || !args.host_slowdown.is_empty()) {
        bail!("--session-concurrency, --host-cores and --host-slowdown: not supported with --pd");
    }
    crate::sim_args::check_host_slowdown(&args.host_slowdown)?;
    Slo::from_flags(args.slo_ttft, args.slo_tpot).map_err(anyhow::Error::msg)?;
    let kv_oracle = match args.kv_oracle.as_str() {
        "fleet" => KvOracle::Fleet,
        "store" => KvOracle::Store,
        _ => KvOracle::Off,
    };
    if kv_oracle != KvOracle::Off && (pd.is_some() || profile.slots > 0) {
        bail!(
            "--kv-oracle: not supported with --pd or a profile with llama.cpp slots (no paged KV cache to copy into)"
        );
    }
    let policies = policies(args.prefill_policy.as_deref().unwrap_or(&args.policy))?;
    let states = parse_prefix_states(&args.prefix_state, args.predict_window_secs)?;
    if profile.slots == 0 && states.iter().any(|s| s.1) {
        bail!(
            "--prefix-state slots: profile `{}` has no llama.cpp slots (cpu-smollm2-135m has 2; or --profile-set '{{\"slots\": N}}')",
            profile.name
        );
    }
    let engines = match &pd {
        Some(pd) => pd.prefill_engines + pd.decode_engines,
        None => args.engines.unwrap_or(8),
    };
    if engines == 0 {
        bail!("--engines must be at least 1");
    }
    let kv_migration = kv_migration(args, &profile, &states, pd.is_some())?;
    let kv_pull = match args.kv_pull {
        None => None,
        Some(g) if !(g.is_finite() && g > 0.0) => bail!("--kv-pull: {g} is not a positive number of GB/s"),
        Some(_) if pd.is_some() || kv_oracle != KvOracle::Off || profile.slots > 0 => {
            bail!("--kv-pull: not with --pd, --kv-oracle or a profile with llama.cpp slots (no paged KV cache)")
        }
        Some(_) if !states.iter().any(|s| matches!(s.0, PrefixState::Precise { .. }) && !s.1) => {
            bail!("--kv-pull: needs --prefix-state precise (the router must know which engine holds a prefix)")
        }
        Some(g) => Some(KvPull::over(&profile, g).with_context(|| {
            format!("--kv-pull: profile `{}` has kv_file_bytes_per_token 0 (what a token's KV weighs)", profile.name)
        })?),
    };
    Ok(Setup { profile, knobs, rates, pd, kv_oracle, policies, states, engines, kv_migration, kv_pull })
}

/// `--kv-migration` and `--kv-min-tokens`, checked against the profile, the prefix states
/// and `--pd`.
fn kv_migration(
    args: &Args,
    profile: &Profile,
    states: &[(PrefixState, bool)],
    pd: bool,
) -> anyhow::Result<Option<KvMigration>> {
    if !args.kv_migration {
        return Ok(None);
    }
    if profile.slots == 0 {
        bail!(
            "--kv-migration: profile `{}` has no llama.cpp slots to save or restore (cpu-smollm2-135m has 2; or --profile-set '{{\"slots\": N}}')",
            profile.name
        );
    }
    if !states.iter().any(|s| s.1) {
        bail!("--kv-migration: needs --prefix-state slots (the mover restores into the slot the router names)");
    }
    if pd {
        bail!("--kv-migration: not supported with --pd");
    }
    Ok(Some(KvMigration { min_tokens: args.kv_min_tokens, ..KvMigration::default() }))
}

/// One run per rate, prefix state and policy, labelled with its prefix state and oracle;
/// a prefix-blind policy routes the same with either prefix state, so it runs once (slot
/// routing changes which slot it takes: it runs then).
fn plan_runs(setup: &Setup) -> Vec<Run> {
    let prefix_aware: Vec<&str> =
        kvroute_core::registry::list().into_iter().filter(|i| i.prefix_aware).map(|i| i.name).collect();
    let first_plain = setup.states.iter().find(|s| !s.1).map(|s| s.0);
    let mut runs = Vec::new();
    for &rate in &setup.rates {
        for &(prefix_state, slot_routing) in &setup.states {
            for (p, label, cap) in &setup.policies {
                let blind = !prefix_aware.contains(&p.as_str());
                if blind && !slot_routing && Some(prefix_state) != first_plain {
                    continue;
                }
                let label = match prefix_state {
                    _ if slot_routing && setup.kv_migration.is_some() => format!("{label}/slots+kv"),
                    _ if slot_routing => format!("{label}/slots"),
                    PrefixState::Precise { .. } if setup.kv_pull.is_some() && blind => format!("{label}/pull"),
                    PrefixState::Precise { .. } if setup.kv_pull.is_some() => format!("{label}/precise+pull"),
                    PrefixState::Precise { .. } if !blind => format!("{label}/precise"),
                    _ => label.clone(),
                };
                let label = match setup.kv_oracle {
                    KvOracle::Off => label,
                    o => format!("{label}/oracle-{}", o.as_str()),
                };
                runs.push(Run { policy: p.clone(), label, rate, capped: *cap, prefix_state, slot_routing });
            }
        }
    }
    runs
}

/// Runs every replay over `--jobs` threads behind one progress bar; the reports in run
/// order, or the first failure.
fn replay_all(args: &Args, setup: &Setup, traces: &Traces, runs: &[Run]) -> anyhow::Result<Vec<PolicyReport>> {
    let total: u64 = runs.iter().map(|r| if r.capped { traces.capped.len() } else { traces.base.len() } as u64).sum();
    let bar = if args.quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(total) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} replay [{bar:40}] {pos}/{len} requests {msg} ({eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let jobs = args.jobs.jobs();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<parking_lot_free::Slot> = (0..runs.len()).map(|_| parking_lot_free::Slot::default()).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.min(runs.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(run) = runs.get(i) else { break };
                    results[i].set(replay_one(args, setup, traces, run, &bar));
                }
            });
        }
    });
    bar.finish_and_clear();
    let mut reports: Vec<PolicyReport> = Vec::new();
    for (slot, run) in results.into_iter().zip(runs) {
        match slot.take() {
            Some(Ok(r)) => reports.push(r),
            Some(Err(e)) => bail!("replay of `{}` failed: {e}", run.label),
            None => bail!("replay of `{}` did not run", run.label),
        }
    }
    Ok(reports)
}

/// One replay (colocated, or disaggregated with `--pd`) of the trace at `run`'s rate,
/// summarised under `run`'s label; progress goes to `bar`.
fn replay_one(
    args: &Args,
    setup: &Setup,
    traces: &Traces,
    run: &Run,
    bar: &indicatif::ProgressBar,
) -> Result<PolicyReport, String> {
    let mut t = if run.capped { traces.capped.clone() } else { traces.base.clone() };
    trace::scale_rate(&mut t, run.rate);
    let cfg = ReplayConfig {
        engines: setup.engines,
        profile: setup.profile.clone(),
        policy: run.policy.clone(),
        knobs: setup.knobs.clone(),
        seed: args.seed,
        max_waiting: args.max_waiting,
        engine_signals: !args.no_engine_signals,
        prefix_state: run.prefix_state,
        slot_routing: run.slot_routing,
        closed_sessions: args.closed_sessions,
        session_concurrency: args.session_concurrency,
        host_cores: args.host_cores,
        host_slowdown: args.host_slowdown.clone(),
        kv_oracle: setup.kv_oracle,
        kv_migration: setup.kv_migration.filter(|_| run.slot_routing),
        kv_pull: setup.kv_pull.filter(|_| matches!(run.prefix_state, PrefixState::Precise { .. }) && !run.slot_routing),
    };
    let mut last = 0usize;
    let mut tick = |n: usize| {
        bar.inc((n - last) as u64);
        last = n;
    };
    let r = match &setup.pd {
        Some(pd) => replay_pd(&t, &cfg, pd, &mut tick),
        None => replay(&t, &cfg, &mut tick),
    };
    let r = r.map(|mut res| {
        res.policy = run.label.clone();
        summarise(&res, run.rate, traces.infinite, Slo { ttft_s: args.slo_ttft, tpot_s: args.slo_tpot })
    });
    r.map_err(|e| e.to_string())
}

/// The lines above the table: the trace, the fleet, and the disaggregation settings.
fn print_header(args: &Args, setup: &Setup, base: &[TraceRequest]) {
    println!(
        "trace {} ({} requests, {:.0} s), {} engines, profile {}, seed {}",
        args.trace.display(),
        base.len(),
        base.last().map_or(0.0, |r| r.arrival.as_secs_f64()),
        setup.engines,
        setup.profile.name,
        args.seed
    );
    if let Some(pd) = &setup.pd {
        println!(
            "prefill/decode {}:{}: prompts over {} tokens split (prefill policy: the policy column; decode policy {}), \
             KV {} bytes/token over {} GB/s + {} s",
            pd.prefill_engines,
            pd.decode_engines,
            pd.colocate_below_tokens,
            pd.decode_policy,
            pd.transfer.kv_bytes_per_token,
            pd.transfer.link_gbytes_per_s,
            pd.transfer.latency_secs
        );
    }
}

/// `--json`: the trace, the fleet, how arrivals were spread, the reports (and `pd`).
fn write_json(
    p: &std::path::Path,
    args: &Args,
    setup: &Setup,
    base: &[TraceRequest],
    reports: &[PolicyReport],
) -> anyhow::Result<()> {
    let mut doc = serde_json::json!({
        "trace": args.trace.display().to_string(),
        "requests": base.len(),
        "engines": setup.engines,
        "profile": setup.profile,
        "seed": args.seed,
        "arrivals": match (args.no_spread, args.arrival_seed) {
            (true, _) => "trace".to_string(),
            (false, Some(s)) => format!("random spread, seed {s}"),
            (false, None) => "even spread".to_string(),
        },
        "reports": reports,
    });
    if let (Some(pd), Some(obj)) = (&setup.pd, doc.as_object_mut()) {
        obj.insert("pd".into(), serde_json::to_value(pd)?);
    }
    std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n").with_context(|| format!("--json {}", p.display()))?;
    Ok(())
}

/// `--plot-dir`: the TTFT CDF at the first rate, and the sweep over several rates (a plot
/// that fails is a warning).
fn write_plots(dir: &std::path::Path, setup: &Setup, reports: &[PolicyReport]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--plot-dir {}", dir.display()))?;
    let rates = &setup.rates;
    let first_rate: Vec<PolicyReport> = reports.iter().filter(|r| r.rate_scale == rates[0]).cloned().collect();
    let title = match &setup.pd {
        Some(pd) => format!("TTFT CDF, PD {}:{}, rate x{}", pd.prefill_engines, pd.decode_engines, rates[0]),
        None => format!("TTFT CDF, {} engines, rate x{}", setup.engines, rates[0]),
    };
    if let Err(e) = plot_ttft_cdf(&dir.join("ttft_cdf"), &first_rate, &title) {
        eprintln!("kvroute: warning: plots skipped: {e}");
    } else if rates.len() > 1
        && let Err(e) = plot_sweep(&dir.join("sweep"), reports)
    {
        eprintln!("kvroute: warning: sweep plot skipped: {e}");
    }
    Ok(())
}

/// A write-once result slot shared between replay threads (std only).
mod parking_lot_free {
    use kvroute_sim::report::PolicyReport;
    use std::sync::Mutex;

    /// One run's result.
    #[derive(Default)]
    pub struct Slot(Mutex<Option<Result<PolicyReport, String>>>);

    impl Slot {
        pub fn set(&self, v: Result<PolicyReport, String>) {
            if let Ok(mut g) = self.0.lock() {
                *g = Some(v);
            }
        }
        pub fn take(self) -> Option<Result<PolicyReport, String>> {
            self.0.into_inner().ok().flatten()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_policy_lists_each_known_name_once() {
        // `capped` was listed twice: with the groups and again among the registry's names.
        let e = policies("nosuch").expect_err("unknown").to_string();
        let known = e.split_once("known: ").expect("a list").1;
        let listed: Vec<&str> = known.split(", ").collect();
        let unique: std::collections::HashSet<&str> = listed.iter().copied().collect();
        assert_eq!(listed.len(), unique.len(), "{e}");
        for n in kvroute_core::registry::names() {
            assert!(unique.contains(n), "{n} missing: {e}");
        }
    }
}
