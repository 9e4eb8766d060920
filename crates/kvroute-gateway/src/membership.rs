//! Fleet membership: adding a worker (its URL checked, its models, capacity and role read
//! before it joins), removing one, registrations from etcd, and ejecting a worker that keeps
//! failing. Methods on [`AppState`] so the admin API, the registry watch, reloads and the
//! pipeline share one path.

use crate::app::AppState;
use crate::metrics::WorkerLabel;
use crate::upstream::{parity_probe, worker_chat_tokens};
use kvroute_core::types::Health;
use std::sync::Arc;
use std::time::Duration;

impl AppState {
    /// Adds the configured workers (discovering their models; unreachable ones are added
    /// and left to the health checker).
    pub async fn add_initial_workers(self: &Arc<Self>) {
        for u in self.static_workers.load_full().iter() {
            let _ = self.add_worker(u).await;
        }
        for u in self.cfg.pd.urls() {
            let _ = self.add_worker(u).await;
        }
    }

    /// Forgets `worker` in every router (the main one and, with disaggregation, both
    /// pools').
    pub fn forget_worker(&self, worker: kvroute_core::types::WorkerId) {
        self.routers.worker_removed(worker);
        if let Some(pd) = &self.pd {
            pd.worker_removed(worker);
        }
    }

    /// Adds a worker by URL, or returns the existing one's id.
    ///
    /// # Errors
    /// [`AddWorkerError`]: a refused URL, this router's own listener, a full table.
    pub async fn add_worker(self: &Arc<Self>, url: &str) -> Result<u32, AddWorkerError> {
        self.add_worker_with(url, None).await
    }

    /// [`AppState::add_worker`] once the worker is ready, as SGLang router's `add_worker`:
    /// a URL not yet in the fleet is checked (refused URLs first, without a request), then
    /// its health check (`health.path`) is asked every `worker_startup_check_interval_secs`
    /// until it answers 200, for at most `timeout`; only then is it added. A worker already
    /// in the fleet is not waited for.
    ///
    /// # Errors
    /// [`AddWorkerError::NotReady`] when the health check never passed (the worker is not
    /// added); the others of [`AppState::add_worker`].
    pub async fn add_worker_when_ready(self: &Arc<Self>, url: &str, timeout: Duration) -> Result<u32, AddWorkerError> {
        let checked = self.admissible_url(url).await?;
        if self.fleet.by_url(&checked).is_none() {
            self.wait_ready(&checked, timeout).await?;
        }
        self.add_checked(checked, None).await
    }

    /// `url` normalised, once it passes the checks every new worker does: a well-formed
    /// http(s) URL, allowed by `worker_allow`, not one of this router's own listeners.
    async fn admissible_url(&self, url: &str) -> Result<String, AddWorkerError> {
        let url = crate::model::worker_url::check_worker_url(url)?;
        self.cfg.check_worker_allowed(&url)?;
        self.check_not_own(&url).await?;
        Ok(url)
    }

    /// Asks `url`'s health check until it answers 200 or `timeout` has passed.
    async fn wait_ready(&self, url: &str, timeout: Duration) -> Result<(), AddWorkerError> {
        let h = &self.cfg.health;
        let every = Duration::from_secs_f64(self.cfg.worker_startup_check_interval_secs);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last;
        loop {
            let check = crate::upstream::try_get_text(&self.client, &format!("{url}{}", h.path), h.timeout_secs).await;
            last = match check {
                Ok((200, _)) => return Ok(()),
                Ok((status, _)) => format!("{} answered {status}", h.path),
                Err(e) => e.to_string(),
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break;
            }
            tokio::time::sleep(every.min(deadline - now)).await;
        }
        Err(AddWorkerError::NotReady { url: url.to_string(), waited: timeout, last })
    }

    /// Adds a worker, its facts — configured role and capacity, what the worker reports,
    /// and its registration when it comes from etcd — set before it joins the fleet, so no
    /// request sees it without them.
    async fn add_worker_with(
        self: &Arc<Self>,
        url: &str,
        record: Option<&crate::model::registration::WorkerRecord>,
    ) -> Result<u32, AddWorkerError> {
        let url = self.admissible_url(url).await?;
        self.add_checked(url, record).await
    }

    /// [`AppState::add_worker_with`] for a URL [`AppState::admissible_url`] passed.
    async fn add_checked(
        self: &Arc<Self>,
        url: String,
        record: Option<&crate::model::registration::WorkerRecord>,
    ) -> Result<u32, AddWorkerError> {
        if let Some(w) = self.fleet.by_url(&url) {
            return Ok(w.id.0);
        }
        let timeout = self.cfg.health.timeout_secs;
        let models = crate::upstream::fetch_models(&self.client, &url, timeout).await;
        let healthy = models.is_some();
        let mut models = models.unwrap_or_default();
        if let Some(r) = record.filter(|r| !r.models.is_empty()) {
            models.clone_from(&r.models);
        }
        let probed =
            if healthy { Some(crate::upstream::probe_capacity(&self.client, &url, timeout).await) } else { None };
        // `llama_slot_routing = "auto"`: a llama.cpp worker's prompt cache is probed before it
        // joins, so it enters routing with its slot routing settled.
        let slotted = probed.as_ref().is_some_and(|(c, _)| c.llama_slots.is_some())
            || self.cfg.capacity_of(&url).is_some_and(|c| c.llama_slots.is_some());
        let host_cache = if healthy && slotted && self.cfg.llama_slot_routing == crate::config::SlotRouting::Auto {
            host_prompt_cache_probe(self, &url, models.first().map_or("", String::as_str)).await
        } else {
            None
        };
        {
            let mut adm = self.admission.write();
            for m in &models {
                adm.ensure_model(m);
            }
        }
        let health = if healthy { Health::Healthy } else { Health::Unhealthy };
        let now = self.now();
        let (w, new) = self.fleet.add_with(&url, models, health, |w| {
            w.models_read_at.store(now.0, std::sync::atomic::Ordering::Relaxed);
            w.set_capacity(crate::fleet::CapacitySource::Config, self.cfg.capacity_of(&url));
            w.set_locality(self.cfg.locality.rank(&self.cfg.place_of(&url, record.map(|r| &r.labels))));
            w.set_host_prompt_cache(host_cache);
            w.set_slot_routing(match self.cfg.llama_slot_routing {
                crate::config::SlotRouting::On => true,
                crate::config::SlotRouting::Off => false,
                crate::config::SlotRouting::Auto => host_cache == Some(false),
            });
            if let Some((capacity, port)) = &probed {
                w.set_capacity(crate::fleet::CapacitySource::Probed, Some(capacity.clone()));
                w.bootstrap_port.set(port.map(u32::from));
            }
            if let Some(r) = record {
                self.apply_record(w, r);
            }
            if let Some((role, port)) = self.cfg.pd.role_of(&url) {
                w.set_role(role);
                if port.is_some() {
                    w.bootstrap_port.set(port.map(u32::from));
                }
            }
        })?;
        if new {
            self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(i64::from(healthy));
            if healthy && self.tokenizer.is_some() {
                // Later recoveries are checked by the health checker.
                tokio::spawn(tokenizer_parity(Arc::clone(self), url));
            }
        }
        Ok(w.id.0)
    }

    /// Refuses a normalised worker URL that points at one of this router's own listeners
    /// ([`AppState::listen_addrs`], [`crate::hops::own_listener`]): a router listed as
    /// its own worker would send each request back to itself.
    ///
    /// # Errors
    /// [`AddWorkerError::OwnListener`] naming the URL and the listener.
    pub async fn check_not_own(&self, url: &str) -> Result<(), AddWorkerError> {
        let bound = self.listen_addrs.read().clone();
        let timeout = Duration::from_secs_f64(self.cfg.health.timeout_secs);
        match crate::hops::own_listener(url, &bound, timeout).await {
            Some(listener) => Err(AddWorkerError::OwnListener { url: url.to_string(), listener }),
            None => Ok(()),
        }
    }

    /// A registration's role, bootstrap port, capacity and record on `w` (the
    /// configuration's `[pd]` lists win over the registered role).
    fn apply_record(&self, w: &crate::fleet::WorkerEntry, record: &crate::model::registration::WorkerRecord) {
        w.set_capacity(crate::fleet::CapacitySource::Registry, Some(record.capacity.clone()));
        if self.cfg.pd.role_of(&w.url).is_none() {
            w.set_role(record.role);
            if record.bootstrap_port.is_some() {
                w.bootstrap_port.set(record.bootstrap_port.map(u32::from));
            }
        }
        w.set_locality(self.cfg.locality.rank(&self.cfg.place_of(&w.url, Some(&record.labels))));
        w.registration.store(Some(Arc::new(record.clone())));
    }

    /// Adds (or updates) a worker from its cluster registration: the record's models, when
    /// it names some, replace discovery; its role, capacity and labels are kept with it.
    ///
    /// # Errors
    /// As [`AppState::add_worker`].
    pub async fn add_registered_worker(
        self: &Arc<Self>,
        record: crate::model::registration::WorkerRecord,
    ) -> Result<(), AddWorkerError> {
        self.add_worker_with(&record.url, Some(&record)).await?;
        let w = self.fleet.by_url(&record.url).ok_or_else(|| AddWorkerError::Removed { url: record.url.clone() })?;
        if !record.models.is_empty() {
            {
                let mut adm = self.admission.write();
                for m in &record.models {
                    adm.ensure_model(m);
                }
            }
            w.set_models(record.models.clone());
        }
        self.apply_record(&w, &record);
        Ok(())
    }

    /// Removes a worker by URL and forgets it in every router's index. Returns whether it
    /// existed.
    pub fn remove_worker(&self, url: &str) -> bool {
        let Some(w) = self.fleet.remove(url) else { return false };
        let url = w.url.to_string();
        self.forget_worker(w.id);
        self.precise.write(|ix| ix.untrack(w.id));
        self.metrics.forget_worker(&url);
        true
    }

    /// Records a failed attempt on `worker`; the `max_worker_retries`-th failure in a row
    /// ejects it (out of routing until an inference probe passes) and drops it from every
    /// router's index — unless `max_ejection_share` of the fleet is out already, then it
    /// stays in routing (and is tried again at its next failure).
    pub fn record_failure(&self, worker: &crate::fleet::WorkerEntry) {
        let now = self.now();
        if !worker.record_failure(self.cfg.max_worker_retries, now) {
            return;
        }
        if self.fleet.try_eject(worker, self.cfg.max_ejection_share, now) {
            tracing::warn!(
                worker = %worker.url,
                "worker failed {} requests in a row: out of routing until an inference probe passes",
                self.cfg.max_worker_retries
            );
            crate::metrics::count_outcome(&self.metrics.ejections, "ejected");
            self.forget_worker(worker.id);
            self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: worker.url.to_string() }).set(0);
        } else {
            tracing::debug!(worker = %worker.url, "not ejected: max_ejection_share of the workers are out already");
            crate::metrics::count_outcome(&self.metrics.ejections, "capped");
        }
    }
}

/// Why a worker was not added.
#[derive(Debug, thiserror::Error)]
pub enum AddWorkerError {
    /// The URL is refused (malformed, credentials, not in `worker_allow`).
    #[error(transparent)]
    Url(#[from] crate::model::worker_url::WorkerUrlError),
    /// The URL points at one of this router's own listeners (it would loop).
    #[error("`{url}` is this router's own listener ({listener}): a router cannot be its own worker")]
    OwnListener {
        /// The normalised URL.
        url: String,
        /// The listener it reaches.
        listener: std::net::SocketAddr,
    },
    /// The worker table is full.
    #[error(transparent)]
    Full(#[from] crate::fleet::FleetFull),
    /// Its health check did not pass within the startup timeout (SGLang router's
    /// `worker_startup_timeout_secs`).
    #[error(
        "`{url}` did not become ready within {waited:?} (last health check: {last}); `wait=false` adds it now and the health checker admits it when it answers"
    )]
    NotReady {
        /// The normalised URL.
        url: String,
        /// How long it was waited for.
        waited: Duration,
        /// What its last health check met.
        last: String,
    },
    /// Removed (by another task) while it was being added.
    #[error("`{url}` was removed meanwhile")]
    Removed {
        /// The URL.
        url: String,
    },
}

/// Tokens a probe prompt must find cached, beyond the first, to count as restored from a
/// host-memory prompt cache (the two prompts share at most their first token).
const PROBE_RESTORED_TOKENS: u64 = 16;

/// `llama_slot_routing = "auto"` for a llama.cpp worker coming back up (it may have been
/// restarted with another `--cache-ram`): probes it again (`host_prompt_cache_probe`)
/// and sets its slot routing from what it finds. A worker joining is probed before it
/// joins ([`AppState::add_worker`]).
pub async fn slot_routing_probe(s: Arc<AppState>, w: Arc<crate::fleet::WorkerEntry>) {
    if s.cfg.llama_slot_routing != crate::config::SlotRouting::Auto || w.capacity().llama_slots.is_none() {
        return;
    }
    let model = w.models().first().cloned().unwrap_or_default();
    let found = host_prompt_cache_probe(&s, &w.url, &model).await;
    w.set_host_prompt_cache(found);
    w.set_slot_routing(found == Some(false));
}

/// Does the llama.cpp worker at `url` keep prompts outside its slots? Three one-token
/// completions of `model` on its slot 0 (`id_slot`): prompt P, then Q (a different first
/// word, so P leaves the slot), then P again. llama.cpp saves a slot's prompt to its
/// host-memory prompt cache (`--cache-ram`, on by default) when a request that keeps less
/// than half of it takes the slot, and restores the best match from there
/// (`server_prompt_cache::load` in llama.cpp's `tools/server/server-task.cpp`): P then
/// finds most of itself cached. With `--cache-ram 0` it finds at most its first token.
/// `Some(true)`: a host prompt cache; `Some(false)`: none (slot routing pays); `None`: the
/// probe failed or the answer reports no cached tokens. The prompts carry a random nonce,
/// so they share nothing with anyone's. Logged either way.
async fn host_prompt_cache_probe(s: &AppState, url: &str, model: &str) -> Option<bool> {
    let nonce = crate::model::random::os_random_u64();
    let prompt = |word: &str| {
        format!("{word} {nonce:016x}: ")
            + &"kvroute checks whether this worker keeps prompts outside its slots. ".repeat(6)
    };
    let (p, q) = (prompt("Alpha"), prompt("Bravo"));
    let timeout = Duration::from_secs_f64(s.cfg.request_timeout_secs.min(300.0));
    let mut found = None;
    for (i, text) in [&p, &q, &p].into_iter().enumerate() {
        let body = serde_json::json!({"model": model, "prompt": text, "max_tokens": 1, "temperature": 0,
            "id_slot": 0, "cache_prompt": true});
        let sent = s.client.post(format!("{url}/v1/completions")).json(&body).timeout(timeout).send().await;
        let answer = match sent {
            Ok(r) if r.status().is_success() => r.bytes().await.ok(),
            _ => None,
        };
        let Some(answer) = answer else {
            tracing::warn!(worker = %url, step = i, "llama_slot_routing auto: the prompt-cache probe failed; slot routing stays off");
            return None;
        };
        if i == 2 {
            found = kvroute_protocol::openai::answer_usage(&answer).cached_tokens.map(|n| n > PROBE_RESTORED_TOKENS);
        }
    }
    tracing::info!(
        worker = %url,
        host_prompt_cache = ?found,
        "llama_slot_routing auto: slot routing {} (a prompt evicted from its slot {})",
        if found == Some(false) { "on" } else { "off" },
        match found {
            Some(true) => "came back from the host prompt cache",
            Some(false) => "was gone: the worker keeps prompts only in its slots",
            None => "could not be checked: the answer reports no cached tokens",
        }
    );
    found
}

/// Startup tokenizer parity of one worker (run when it first becomes healthy): the local
/// tokenizer's ids of a probe chat must equal the worker's own. Sets
/// `kvroute_tokenizer_parity{worker}` to 1 (equal), 0 (different: logged as an error with
/// the first differing position; the routing keys of this fleet are then approximate) or
/// −1 (the worker exposes no tokenize endpoint, or the local tokenizer cannot render it).
pub async fn tokenizer_parity(s: Arc<AppState>, url: String) {
    let Some(tk) = s.tokenizer.clone() else { return };
    let mut probe = parity_probe();
    let model = s.fleet.by_url(&url).and_then(|w| w.models().first().cloned());
    probe["model"] = serde_json::Value::String(model.unwrap_or_default());
    let local = tk.request_tokens(kvroute_protocol::openai::Api::Chat, &probe);
    let remote =
        worker_chat_tokens(&s.client, &url, &probe, Duration::from_secs_f64(s.cfg.health.timeout_secs.max(5.0))).await;
    let v = match (local, remote) {
        (Ok(l), Some(r)) if l == r => {
            tracing::info!(worker = %url, tokens = l.len(), "local tokenizer matches the worker's");
            1
        }
        (Ok(l), Some(r)) => {
            let at = l.iter().zip(&r).position(|(a, b)| a != b).unwrap_or(l.len().min(r.len()));
            tracing::error!(
                worker = %url, local = l.len(), worker_tokens = r.len(), first_difference = at,
                "the local tokenizer ({}) does not give the worker's tokens: check --tokenizer", tk.source()
            );
            0
        }
        (local, remote) => {
            tracing::warn!(worker = %url, local_ok = local.is_ok(), worker_ok = remote.is_some(), "tokenizer parity inconclusive");
            -1
        }
    };
    s.metrics.tokenizer_parity.get_or_create(&WorkerLabel { worker: url }).set(v);
}
