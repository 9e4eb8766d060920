//! Configuration reload on SIGHUP: the TLS certificate ([`crate::tls`]), the API keys
//! (`api_key_file`'s contents, [`reload_api_keys`]), the admin token (`admin_token_file`'s
//! contents, [`reload_admin_token`]) and, when the server was given a
//! [`ConfigSource`], the whole configuration file. With `reload_watch_secs` the same files
//! are also looked at that often, and the parts whose files changed are reloaded without a
//! signal ([`run`]), for containers nobody can signal.
//!
//! A reload reads the configuration again (for `kvroute serve`: the `--config` file, then
//! the environment and flags, exactly as at startup) and compares it with the one in
//! effect. A file that does not parse or holds an invalid value changes nothing: an error
//! naming the key is logged and `kvroute_config_reloads_total{outcome="invalid"}` counts
//! it. A valid one is applied part by part, each part validated before it changes and
//! swapped whole, so requests never wait on a reload:
//!
//! - `policy` and `policy_knobs` through the live policy API ([`crate::routers::Routers`]):
//!   a new policy name switches every model's router (fresh prefix indexes); the same name
//!   with other knobs patches them in place (the index is kept). The file's knobs are set
//!   in full, so a knob removed from the file goes back to its default.
//! - `worker_urls`: URLs new in the list are added, URLs gone from it removed — only workers
//!   that came from the list ([`AppState::static_workers`]); workers added through the
//!   admin API or registered in etcd are never removed by a reload.
//! - `capacity`: each worker's configured capacity facts are replaced.
//! - `cascade`: the chains are swapped whole ([`AppState::cascade`]); a request in a
//!   cascade finishes on the chain it started with.
//!
//! Only what changed in the file since the last load is applied: a policy set through
//! `PUT /policy` or etcd, or a worker removed through `/remove_worker`, stays as it is
//! while the file's policy or list does not change. Every other key needs a restart: a
//! reload that finds one changed logs the keys at warn and leaves them (each reload names
//! them again until the restart).

use crate::GatewayConfig;
use crate::app::AppState;
use crate::metrics::OutcomeLabel;
use crate::model::worker_url::static_set;
use std::collections::HashSet;
use std::sync::Arc;
use tracing::Instrument;

/// Reads the configuration again: called on each SIGHUP, off the async runtime (it may
/// read files). An error (unreadable file, bad TOML, invalid value naming the key) keeps
/// the configuration in effect.
pub type ConfigSource = Arc<dyn Fn() -> anyhow::Result<GatewayConfig> + Send + Sync>;

/// Keys a reload applies live; every other key needs a restart.
pub const LIVE_KEYS: [&str; 5] = ["policy", "policy_knobs", "worker_urls", "cascade", "capacity"];

/// What one reload did (the `outcome` label of `kvroute_config_reloads_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A live part (policy, knobs, workers) changed.
    Applied,
    /// Nothing live changed (keys that need a restart may differ: they are logged).
    Unchanged,
    /// The configuration could not be read or is invalid, or a part failed to apply;
    /// what was in effect stays.
    Invalid,
}

impl Outcome {
    /// The metric label value: `applied`, `unchanged` or `invalid`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Unchanged => "unchanged",
            Outcome::Invalid => "invalid",
        }
    }
}

/// Applies reloaded configurations to a running gateway, remembering the configuration in
/// effect (the startup one, then each reload's live parts).
#[derive(Debug)]
pub struct Reloader {
    state: Arc<AppState>,
    running: GatewayConfig,
}

impl Reloader {
    /// A reloader for `state`, starting from the configuration it was built with.
    pub fn new(state: Arc<AppState>) -> Reloader {
        expose_outcomes(&state);
        let running = state.cfg.clone();
        Reloader { state, running }
    }

    /// Applies `next` (the result of reading the configuration again), logs what changed
    /// and counts the outcome. Never fails: an invalid configuration is logged and changes
    /// nothing.
    pub async fn apply(&mut self, next: anyhow::Result<GatewayConfig>) -> Outcome {
        let outcome = match next.and_then(|c| c.validate().map(|()| c).map_err(anyhow::Error::from)) {
            Ok(next) => match self.own_worker(&next).await {
                // A router listed as its own worker loops: the file is refused whole.
                Some(e) => {
                    tracing::error!(error = e, "configuration not reloaded; the one in effect stays");
                    Outcome::Invalid
                }
                None => self.apply_valid(next).await,
            },
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), "configuration not reloaded; the one in effect stays");
                Outcome::Invalid
            }
        };
        crate::metrics::count_outcome(&self.state.metrics.config_reloads, outcome.as_str());
        outcome
    }

    /// The first of `next`'s `worker_urls` that points at this router's own listener
    /// ([`AppState::check_not_own`]), as an error naming the key.
    async fn own_worker(&self, next: &GatewayConfig) -> Option<String> {
        for u in &static_set(&next.worker_urls) {
            if let Err(m) = self.state.check_not_own(u).await {
                return Some(format!("invalid configuration: `worker_urls`: {m}"));
            }
        }
        None
    }

    async fn apply_valid(&mut self, next: GatewayConfig) -> Outcome {
        let mut changed = false;
        let mut failed = false;
        if next.policy != self.running.policy
            || next.policy_knobs != self.running.policy_knobs
            || pd_policies(&next) != pd_policies(&self.running)
        {
            match self.apply_policy(&next) {
                Ok(()) => {
                    self.running.policy.clone_from(&next.policy);
                    self.running.policy_knobs.clone_from(&next.policy_knobs);
                    set_pd_policies(&mut self.running, &next);
                    changed = true;
                }
                Err(e) => {
                    tracing::error!(error = format!("{e:#}"), "policy not applied; the policy in effect stays");
                    failed = true;
                }
            }
        }
        if next.worker_urls != self.running.worker_urls {
            changed |= self.apply_workers(&next.worker_urls).await;
            self.running.worker_urls.clone_from(&next.worker_urls);
        }
        if next.cascade != self.running.cascade {
            self.state.cascade.store(Arc::new(next.cascade.clone()));
            tracing::info!(chains = next.cascade.chain.len(), "cascade chains applied");
            self.running.cascade.clone_from(&next.cascade);
            changed = true;
        }
        if next.capacity != self.running.capacity {
            for w in self.state.fleet.load().iter() {
                w.set_capacity(crate::fleet::CapacitySource::Config, next.capacity_of(&w.url));
            }
            tracing::info!(workers = next.capacity.len(), "capacity table applied");
            self.running.capacity.clone_from(&next.capacity);
            changed = true;
        }
        let restart = restart_keys(&self.running, &next);
        if !restart.is_empty() {
            tracing::warn!(keys = restart.join(", "), "changed in the file but need a restart; left as they are");
        }
        match (failed, changed) {
            (true, _) => Outcome::Invalid,
            (false, true) => {
                tracing::info!("configuration reloaded");
                Outcome::Applied
            }
            (false, false) => {
                tracing::info!("configuration reloaded, no live change");
                Outcome::Unchanged
            }
        }
    }

    /// Sets the file's policy with its knobs in full (defaults for the knobs it does not
    /// name) — a switch when the name differs from the running policy, else a knob patch —
    /// and, with disaggregation, the prefill and decode pools' policies the same way, all
    /// through [`crate::policy_control::apply`].
    fn apply_policy(&self, next: &GatewayConfig) -> anyhow::Result<()> {
        let full = kvroute_core::registry::build(&next.policy, &next.knobs_json())?.knobs();
        let mut setting = serde_json::json!({"policy": next.policy, "knobs": full});
        if self.state.pd.is_some() {
            for (field, policy, knobs) in [
                ("prefill", &next.pd.prefill_policy, &next.pd.prefill_policy_knobs),
                ("decode", &next.pd.decode_policy, &next.pd.decode_policy_knobs),
            ] {
                let full = kvroute_core::registry::build(policy, &crate::config::pd::json(knobs))?.knobs();
                setting[field] = serde_json::json!({"policy": policy, "knobs": full});
            }
        }
        let before = self.state.routers.policy_name();
        let knobs = crate::policy_control::apply(&self.state, &setting, crate::policy_control::Form::Plain)
            .map_err(|(field, e)| anyhow::anyhow!("{field}: {e}"))?;
        if before == next.policy {
            tracing::info!(policy = next.policy, %knobs, "policy knobs applied");
        } else {
            tracing::info!(policy = next.policy, previous = before, %knobs, "policy switched");
        }
        Ok(())
    }

    /// Adds the listed workers not yet in the static set and removes the static workers
    /// no longer listed. Returns whether the static set changed.
    async fn apply_workers(&self, urls: &[String]) -> bool {
        let next = static_set(urls);
        let old = self.state.static_workers.load_full();
        let (old_set, next_set): (HashSet<&String>, HashSet<&String>) = (old.iter().collect(), next.iter().collect());
        let added: Vec<String> = next.iter().filter(|u| !old_set.contains(u)).cloned().collect();
        let removed: Vec<String> = old.iter().filter(|u| !next_set.contains(u)).cloned().collect();
        if added.is_empty() && removed.is_empty() {
            return false;
        }
        // The new set first, so etcd (which never removes a static worker) sees it.
        self.state.static_workers.store(Arc::new(next));
        for u in &added {
            match self.state.add_worker(u).await {
                Ok(_) => tracing::info!(worker = u, "worker added"),
                Err(e) => tracing::warn!(worker = u, error = %e, "worker not added"),
            }
        }
        for u in &removed {
            match self.state.fleet.by_url(u) {
                Some(w) if w.registration.load().is_some() => {
                    tracing::info!(worker = u, "worker left the list but stays: it is registered in etcd");
                }
                Some(_) => {
                    self.state.remove_worker(u);
                    tracing::info!(worker = u, "worker removed");
                }
                None => {}
            }
        }
        true
    }
}

/// Exposes the three outcomes of `kvroute_config_reloads_total` at 0 (a series born at 1
/// shows no `increase()` in Prometheus, so a first reload would not show).
fn expose_outcomes(state: &AppState) {
    for o in [Outcome::Applied, Outcome::Unchanged, Outcome::Invalid] {
        drop(state.metrics.config_reloads.get_or_create(&OutcomeLabel { outcome: o.as_str().into() }));
        if state.api_keys.is_some() {
            drop(state.metrics.api_key_reloads.get_or_create(&OutcomeLabel { outcome: o.as_str().into() }));
        }
        if state.cfg.admin_token_file.is_some() {
            drop(state.metrics.admin_token_reloads.get_or_create(&OutcomeLabel { outcome: o.as_str().into() }));
        }
    }
}

/// Reads `admin_token_file` again ([`crate::admin_token::AdminToken::reload`], off the
/// runtime): logs the outcome (never the token) and counts it in
/// `kvroute_admin_token_reloads_total`. Nothing without the file.
pub async fn reload_admin_token(state: &Arc<AppState>) -> Option<Outcome> {
    state.cfg.admin_token_file.as_ref()?;
    let s = Arc::clone(state);
    let read = tokio::task::spawn_blocking(move || s.tenancy.admin_token.reload())
        .await
        .unwrap_or_else(|e| Err(anyhow::anyhow!("reading admin_token_file panicked: {e}")));
    let outcome = match read {
        Ok(crate::admin_token::TokenReload::Changed) => {
            tracing::info!("admin token replaced from admin_token_file");
            Outcome::Applied
        }
        Ok(_) => Outcome::Unchanged,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "admin_token_file not reloaded; the token in effect stays");
            Outcome::Invalid
        }
    };
    crate::metrics::count_outcome(&state.metrics.admin_token_reloads, outcome.as_str());
    Some(outcome)
}

/// Reads `api_key_file` again ([`crate::api_keys::KeyFile::reload`], off the runtime):
/// logs what changed, counts the outcome in `kvroute_api_key_reloads_total` and removes the
/// `kvroute_tenant_requests_total` series of tenants no key names any more. Nothing
/// without a key file.
pub async fn reload_api_keys(state: &Arc<AppState>) -> Option<Outcome> {
    state.api_keys.as_ref()?;
    let s = Arc::clone(state);
    let read = tokio::task::spawn_blocking(move || s.api_keys.as_ref().map(crate::api_keys::KeyFile::reload))
        .await
        .unwrap_or_else(|e| Some(Err(anyhow::anyhow!("reading api_key_file panicked: {e}"))))?;
    let outcome = match read {
        Ok(c) => {
            for tenant in &c.tenants_gone {
                for outcome in crate::metrics::TENANT_OUTCOMES {
                    let labels = crate::metrics::TenantLabels { tenant: tenant.clone(), outcome: outcome.into() };
                    state.metrics.tenant_requests.remove(&labels);
                }
            }
            tracing::info!(
                added = c.added,
                removed = c.removed,
                changed = c.changed,
                kept = c.kept,
                tenants_gone = c.tenants_gone.join(", "),
                "api_key_file reloaded"
            );
            if c.any() { Outcome::Applied } else { Outcome::Unchanged }
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "api_key_file not reloaded; the keys in effect stay");
            Outcome::Invalid
        }
    };
    crate::metrics::count_outcome(&state.metrics.api_key_reloads, outcome.as_str());
    Some(outcome)
}

/// The `[pd]` keys applied live (the pools' policies and knobs).
pub const LIVE_PD_KEYS: [&str; 4] = ["prefill_policy", "prefill_policy_knobs", "decode_policy", "decode_policy_knobs"];

/// The pools' policies and knobs of `c` (compared to see whether a reload changes them).
fn pd_policies(c: &GatewayConfig) -> (&str, &toml::Table, &str, &toml::Table) {
    (&c.pd.prefill_policy, &c.pd.prefill_policy_knobs, &c.pd.decode_policy, &c.pd.decode_policy_knobs)
}

/// Copies the pools' policies and knobs of `next` into `running`.
fn set_pd_policies(running: &mut GatewayConfig, next: &GatewayConfig) {
    running.pd.prefill_policy.clone_from(&next.pd.prefill_policy);
    running.pd.prefill_policy_knobs.clone_from(&next.pd.prefill_policy_knobs);
    running.pd.decode_policy.clone_from(&next.pd.decode_policy);
    running.pd.decode_policy_knobs.clone_from(&next.pd.decode_policy_knobs);
}

/// The keys, other than [`LIVE_KEYS`] and [`LIVE_PD_KEYS`], whose values differ between `a` and `b`; a table
/// (`health`) is compared key by key (`health.interval_secs`).
pub fn restart_keys(a: &GatewayConfig, b: &GatewayConfig) -> Vec<String> {
    use serde_json::Value;
    let (Ok(Value::Object(a)), Ok(Value::Object(b))) = (serde_json::to_value(a), serde_json::to_value(b)) else {
        return vec!["(configuration)".into()];
    };
    let mut keys = Vec::new();
    for (k, va) in a.iter().filter(|(k, _)| !LIVE_KEYS.contains(&k.as_str())) {
        match (va, b.get(k)) {
            (va, Some(vb)) if va == vb => {}
            (Value::Object(ta), Some(Value::Object(tb))) => {
                let live = |s: &str| k == "pd" && LIVE_PD_KEYS.contains(&s);
                keys.extend(
                    ta.iter().filter(|(s, v)| !live(s) && tb.get(*s) != Some(*v)).map(|(s, _)| format!("{k}.{s}")),
                );
            }
            _ => keys.push(k.clone()),
        }
    }
    keys
}

/// The SIGHUP handler, installed before the server accepts its first connection so a
/// SIGHUP reloads rather than ending the process (the default action). Without Unix
/// signals it never fires.
#[derive(Debug)]
pub struct Hangup {
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Hangup {
    /// Installs the handler (SIGHUPs from now on are queued for [`run`]).
    ///
    /// # Errors
    /// The handler cannot be installed.
    pub fn install() -> anyhow::Result<Hangup> {
        #[cfg(unix)]
        {
            let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .map_err(|e| anyhow::anyhow!("cannot install the SIGHUP handler: {e}"))?;
            Ok(Hangup { signal })
        }
        #[cfg(not(unix))]
        Ok(Hangup {})
    }

    /// The next SIGHUP (several received meanwhile count as one); `false` once no more
    /// can come.
    async fn recv(&mut self) -> bool {
        #[cfg(unix)]
        {
            self.signal.recv().await.is_some()
        }
        #[cfg(not(unix))]
        {
            std::future::pending::<bool>().await
        }
    }
}

/// What set a reload off (the `trigger` of its log lines' `reload` span).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    /// A SIGHUP: every part is read again.
    Signal,
    /// `reload_watch_secs`: only the parts whose files changed.
    FileChange,
}

impl Trigger {
    /// `SIGHUP` or `file_change`.
    fn as_str(self) -> &'static str {
        match self {
            Trigger::Signal => "SIGHUP",
            Trigger::FileChange => "file_change",
        }
    }
}

/// The files a reload reads, as last seen ([`Watch::look`]): a hash of each file's bytes
/// (`None` when unreadable), and the configuration the source last gave.
#[derive(Debug, Default)]
struct Watch {
    tls: Option<u64>,
    keys: Option<u64>,
    admin: Option<u64>,
    /// The configuration last read (`Ok`), or the error it gave (`Err`, its message).
    config: Option<Result<GatewayConfig, String>>,
}

/// What changed since the last look ([`Watch::look`]).
#[derive(Debug, Default)]
struct Changed {
    tls: bool,
    keys: bool,
    admin: bool,
    /// The configuration read, when it differs from the last one.
    config: Option<anyhow::Result<GatewayConfig>>,
}

/// A hash of the bytes of the files at `paths` (`None` when one cannot be read), each read
/// up to just past [`crate::api_keys::MAX_KEY_FILE_BYTES`] (a larger file is refused when
/// loaded, whatever its tail holds).
fn files_hash(paths: &[&str]) -> Option<u64> {
    use std::io::Read;
    let mut all = Vec::new();
    for p in paths {
        std::fs::File::open(p).ok()?.take(crate::api_keys::MAX_KEY_FILE_BYTES + 1).read_to_end(&mut all).ok()?;
        all.push(0);
    }
    Some(kvroute_core::hash::stable_hash(&all))
}

impl Watch {
    /// Reads every watched file (blocking I/O) and the configuration from `source`, and
    /// records them; returns what differs from the last look (everything on the first).
    fn look(&mut self, cfg: &GatewayConfig, source: Option<&ConfigSource>) -> Changed {
        let tls: Vec<&str> = cfg.tls_cert.iter().chain(&cfg.tls_key).map(String::as_str).collect();
        let tls = (!tls.is_empty()).then(|| files_hash(&tls)).flatten();
        let keys = cfg.api_key_file.as_deref().and_then(|p| files_hash(&[p]));
        let admin = cfg.admin_token_file.as_deref().and_then(|p| files_hash(&[p]));
        let mut changed =
            Changed { tls: tls != self.tls, keys: keys != self.keys, admin: admin != self.admin, config: None };
        (self.tls, self.keys, self.admin) = (tls, keys, admin);
        if let Some(source) = source {
            let next = source().map_err(|e| format!("{e:#}"));
            if self.config.as_ref() != Some(&next) {
                changed.config = Some(next.clone().map_err(anyhow::Error::msg));
                self.config = Some(next);
            }
        }
        changed
    }
}

/// Handles each SIGHUP and, with `reload_watch_secs`, each look at the files: reads the TLS
/// certificate and key again (a reload that fails is logged and keeps the certificate in
/// use), the API keys ([`reload_api_keys`]), the admin token ([`reload_admin_token`]) and,
/// with a `source`, the configuration
/// ([`Reloader`]) — on a SIGHUP all of them, on a look only those whose files changed
/// (the configuration: when what the source reads differs from its last read). With
/// nothing to reload a SIGHUP is logged.
pub async fn run(
    mut hup: Hangup,
    tls: Option<Arc<crate::tls::ServerTls>>,
    source: Option<ConfigSource>,
    state: Arc<AppState>,
) {
    expose_outcomes(&state);
    let mut reloader = source.as_ref().map(|_| Reloader::new(Arc::clone(&state)));
    let period = state.cfg.reload_watch_secs;
    let mut tick = (period > 0.0).then(|| {
        let every = std::time::Duration::from_secs_f64(period);
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        // A slow look (a large key file on a slow disk) is not followed by a burst of them.
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    // With the watch on, the files as they are at start: a look reloads only what changed
    // since. (Without it, a SIGHUP reloads everything and needs no earlier look.)
    let mut watch = Watch::default();
    if tick.is_some() {
        let _ = look(&mut watch, &state, source.as_ref()).await;
    }
    loop {
        let trigger = tokio::select! {
            alive = hup.recv() => if alive { Trigger::Signal } else { break },
            _ = async { match tick.as_mut() { Some(t) => t.tick().await, None => std::future::pending().await } } => Trigger::FileChange,
        };
        let span = tracing::info_span!("reload", trigger = trigger.as_str());
        let changed = look(&mut watch, &state, source.as_ref()).await;
        let every = trigger == Trigger::Signal;
        async {
            if every || changed.keys {
                reload_api_keys(&state).await;
            }
            if every || changed.admin {
                reload_admin_token(&state).await;
            }
            if let Some(t) = tls.as_ref().filter(|_| every || changed.tls) {
                match t.reload() {
                    Ok(()) => tracing::info!("TLS certificate reloaded"),
                    Err(e) => {
                        tracing::error!(error = format!("{e:#}"), "TLS reload failed; keeping the certificate in use")
                    }
                }
            }
            if every
                && tls.is_none()
                && source.is_none()
                && state.api_keys.is_none()
                && state.cfg.admin_token_file.is_none()
            {
                tracing::info!("nothing to reload (no tls_cert, no api_key_file, no admin_token_file, no config file)");
            }
            // A SIGHUP applies the configuration just read even when it reads as before
            // (the restart-only keys are named again, the outcome counted).
            let last = || watch.config.clone().map(|r| r.map_err(anyhow::Error::msg));
            let next = if every { last() } else { changed.config };
            if let (Some(next), Some(reloader)) = (next, reloader.as_mut()) {
                reloader.apply(next).await;
            }
        }
        .instrument(span)
        .await;
    }
}

/// [`Watch::look`] off the async runtime (it reads files); `watch` holds its default only
/// while the look runs.
async fn look(watch: &mut Watch, state: &Arc<AppState>, source: Option<&ConfigSource>) -> Changed {
    let (mut w, s, source) = (std::mem::take(watch), Arc::clone(state), source.cloned());
    let (w, changed) = tokio::task::spawn_blocking(move || {
        let changed = w.look(&s.cfg, source.as_ref());
        (w, changed)
    })
    .await
    .unwrap_or_else(|e| {
        (
            Watch::default(),
            Changed { config: Some(Err(anyhow::anyhow!("reading the files panicked: {e}"))), ..Changed::default() },
        )
    });
    *watch = w;
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_keys_name_changed_keys_and_table_entries_but_not_live_ones() {
        let a = GatewayConfig::default();
        let mut b = GatewayConfig {
            policy: "round_robin".into(),
            worker_urls: vec!["http://w1:8000".into()],
            port: 1,
            nats: Some("nats://n:4222".into()),
            ..GatewayConfig::default()
        };
        b.health.interval_secs = 1.0;
        assert_eq!(restart_keys(&a, &a), Vec::<String>::new());
        let mut keys = restart_keys(&a, &b);
        keys.sort();
        assert_eq!(keys, ["health.interval_secs", "nats", "port"]);
    }

    #[test]
    fn the_pools_policies_are_live_and_other_pd_keys_need_a_restart() {
        let a = GatewayConfig::default();
        let mut b = a.clone();
        b.pd.prefill_policy = "round_robin".into();
        b.pd.decode_policy_knobs.insert("x".into(), toml::Value::Integer(1));
        assert_eq!(restart_keys(&a, &b), Vec::<String>::new());
        assert_ne!(pd_policies(&a), pd_policies(&b));
        b.pd.colocate_below_tokens = 1;
        assert_eq!(restart_keys(&a, &b), ["pd.colocate_below_tokens"]);
    }

    #[test]
    fn the_static_set_is_normalised_and_deduplicated_in_order() {
        let urls = ["http://B:80/".to_string(), "http://a:1".into(), "http://b".into(), "ftp://x".into()];
        assert_eq!(static_set(&urls), ["http://b", "http://a:1"]);
    }
}
