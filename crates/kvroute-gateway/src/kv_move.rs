//! The KV mover (`[kv_migration]`): a llama.cpp worker's slot saved to a file after it ran
//! a long prompt, and restored into another worker's slot when a request on that prefix is
//! sent there — so the request reads its prefix instead of recomputing it.
//!
//! llama.cpp's `llama-server --slot-save-path DIR` writes a slot's KV to `DIR/NAME` on
//! `POST /slots/{id}?action=save {"filename": NAME}` and reads it into a slot on
//! `?action=restore` (llama.cpp `tools/server`, `handle_slots_save`/`handle_slots_restore`);
//! a task for a busy slot waits until the slot is idle. So:
//!
//! - **Save, write-behind.** When a request pinned to a slot (`llama_slot_routing`) ends
//!   and its prompt had at least `min_tokens`, the router saves the slot — unless a file
//!   of this tenant and model already holds 90 % of the prompt, or `max_concurrent_saves`
//!   saves are running. The slot counts as busy in the router's slot table until the save
//!   returns, so no request is pinned to it meanwhile without waiting for it. The save
//!   never delays a request: its slot is idle, and the next request on that slot waits at
//!   most the save (11 ms for 1,202 tokens here).
//! - **Restore, before dispatch.** After the policy chose a worker and the slot table a slot
//!   there, the file of the request's tenant and model holding the longest leading run of
//!   its prompt is weighed ([`kvroute_core::kv_migration::plan_restore`]): restored when it
//!   adds at least `min_tokens` to the slot's hit and the worker's restore cost is below its
//!   prefill cost for those tokens. Only into a slot nothing is on (never a busy slot). The
//!   policy already preferred this worker to waiting for the holder, so a restore that
//!   beats recomputing beats both; the request is then sent pinned to the slot.
//! - **Costs, calibrated online** per worker: restores from their wall time and the tokens
//!   llama.cpp reports read; prefill from the `timings` of the worker's answers (`prompt_n`
//!   tokens computed in `prompt_ms`). A worker not measured yet uses the fleet's estimate
//!   (every worker's measurements), and the fleet starts from the `[kv_migration]` priors;
//!   the first measurement replaces a prior, later ones are averaged in
//!   ([`kvroute_core::kv_migration::TransferCost::observe`]).
//! - **Files are the router's**, named `kvroute-<replica>-<n>.bin`: bounded in count
//!   (`max_files`), bytes (`max_mib`) and age (`file_ttl_secs`), least recently used out
//!   first; the router deletes them from `slot_save_dir`, and at startup the `kvroute-*`
//!   files not modified for `file_ttl_secs` (a previous run's; a restore sets its file's
//!   modification time, so a file in use by another replica is never that old).
//! - **Tenants never share a file:** a file is found by the block hashes of the prompt that
//!   was saved, and those hashes are salted per tenant as every routing key is
//!   ([`kvroute_core::tenant`]), so a tenant's request matches only its own files; the names
//!   carry nothing of the prompt.
//!
//! The registry is read without a lock (an [`ArcSwap`] snapshot); writers (a save done, a
//! restore, the sweep) copy it under a mutex that no request waits on.

use crate::config::kv_migration::KvMigrationConfig;
use crate::fleet::WorkerEntry;
use crate::metrics::{KvMoveLabels, KvOpLabel, Metrics};
use arc_swap::ArcSwap;
use kvroute_core::kv_migration::{
    FileLimits, FileMatch, PrefixFiles, RestoreAsk, SavedPrefix, TransferCost, WorkerCosts, plan_restore,
};
use kvroute_core::types::{BlockHash, Nanos};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Fewest uncached tokens an answer must have had for its TTFT to calibrate the worker's
/// prefill cost.
const MIN_PREFILL_SAMPLE: u64 = 64;

/// Largest answer read from a slot save or restore call (llama.cpp's is ~200 bytes).
const MAX_SLOT_ANSWER_BYTES: usize = 64 << 10;

/// A restore done before a request was sent ([`KvMover::restore`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Restored {
    /// Prompt tokens it added to the slot's hit.
    pub gained_tokens: u64,
    /// TTFT it was predicted to save, seconds.
    pub predicted_gain_secs: f64,
    /// Its wall time, seconds.
    pub secs: f64,
}

/// The slot a request is about to be sent to ([`KvMover::restore`]).
#[derive(Debug, Clone, Copy)]
pub struct SlotPlace<'a> {
    /// The worker.
    pub worker: &'a WorkerEntry,
    /// Its slot (llama.cpp `id_slot`).
    pub slot: u32,
    /// Leading blocks of the prompt the slot holds.
    pub cached_blocks: usize,
    /// Something is on the slot: nothing is restored into it.
    pub busy: bool,
}

/// What a request pinned to a slot needs to have its slot saved when it ends.
#[derive(Debug, Clone)]
pub struct SaveTicket {
    mover: Arc<KvMover>,
    model: String,
    blocks: Arc<[BlockHash]>,
    block_tokens: u32,
}

/// Why a slot save or restore call failed.
#[derive(Debug, thiserror::Error)]
enum SlotCallError {
    /// No answer: connection, timeout, or the body cut off.
    #[error("no answer: {0}")]
    Transport(String),
    /// The worker answered with an error, or with something that is not a slot answer.
    #[error("refused: {0}")]
    Refused(String),
}

/// The KV mover. See the module docs.
#[derive(Debug)]
pub struct KvMover {
    cfg: KvMigrationConfig,
    dir: PathBuf,
    files: ArcSwap<PrefixFiles>,
    write: parking_lot::Mutex<()>,
    saves: AtomicUsize,
    name_prefix: String,
    seq: AtomicU64,
    start: Instant,
    client: reqwest::Client,
    metrics: MoverMetrics,
    /// The fleet's costs: every worker's measurements, from the priors. A worker's own
    /// start from it and replace it once measured. Read and replaced without a lock: two
    /// measurements at the same instant may keep only one (an average loses a sample).
    fleet: ArcSwap<WorkerCosts>,
}

#[derive(Debug, Clone)]
struct MoverMetrics {
    ops: prometheus_client::metrics::family::Family<KvMoveLabels, prometheus_client::metrics::counter::Counter>,
    bytes: prometheus_client::metrics::family::Family<KvOpLabel, prometheus_client::metrics::counter::Counter>,
    seconds: prometheus_client::metrics::family::Family<
        KvOpLabel,
        prometheus_client::metrics::histogram::Histogram,
        fn() -> prometheus_client::metrics::histogram::Histogram,
    >,
    gain: prometheus_client::metrics::histogram::Histogram,
    files: prometheus_client::metrics::gauge::Gauge,
    file_bytes: prometheus_client::metrics::gauge::Gauge,
}

impl MoverMetrics {
    fn op(&self, op: &str, outcome: &str) {
        self.ops.get_or_create(&KvMoveLabels { op: op.into(), outcome: outcome.into() }).inc();
    }

    fn done(&self, op: &str, bytes: u64, secs: f64) {
        let l = KvOpLabel { op: op.into() };
        self.bytes.get_or_create(&l).inc_by(bytes);
        self.seconds.get_or_create(&l).observe(secs);
    }
}

/// What llama.cpp answers a slot save or restore (`n_saved`/`n_written`,
/// `n_restored`/`n_read`).
#[derive(Debug, serde::Deserialize)]
struct SlotFileAnswer {
    #[serde(alias = "n_restored")]
    n_saved: Option<u64>,
    #[serde(alias = "n_read")]
    n_written: Option<u64>,
}

impl KvMover {
    /// The mover of `cfg`, `None` when it is off. `replica` names this router's files
    /// apart from another replica's in a shared directory.
    pub fn new(cfg: &KvMigrationConfig, replica: &str, client: reqwest::Client, m: &Metrics) -> Option<Arc<KvMover>> {
        if !cfg.enabled {
            return None;
        }
        let dir = cfg.slot_save_dir.clone()?;
        let limits = FileLimits {
            max_files: cfg.max_files,
            max_bytes: cfg.max_mib.saturating_mul(1 << 20),
            ttl: Nanos(cfg.file_ttl_secs.saturating_mul(1_000_000_000)),
        };
        let tag = kvroute_core::hash::stable_hash(replica.as_bytes()) as u32;
        Some(Arc::new(KvMover {
            cfg: cfg.clone(),
            dir,
            files: ArcSwap::from_pointee(PrefixFiles::new(limits)),
            write: parking_lot::Mutex::new(()),
            saves: AtomicUsize::new(0),
            name_prefix: format!("kvroute-{tag:08x}-"),
            seq: AtomicU64::new(0),
            start: Instant::now(),
            fleet: ArcSwap::from_pointee(priors(cfg)),
            client,
            metrics: MoverMetrics {
                ops: m.kv_migrations.clone(),
                bytes: m.kv_migration_bytes.clone(),
                seconds: m.kv_migration_seconds.clone(),
                gain: m.kv_migration_predicted_gain_seconds.clone(),
                files: m.kv_migration_files.clone(),
                file_bytes: m.kv_migration_file_bytes.clone(),
            },
        }))
    }

    /// A request of at least `min_tokens` prompt tokens: what its slot needs to be saved
    /// when it ends; `None` for a shorter one.
    pub fn ticket(
        self: &Arc<Self>,
        model: &str,
        blocks: &[BlockHash],
        block_tokens: u32,
        input_tokens: u32,
    ) -> Option<SaveTicket> {
        (input_tokens >= self.cfg.min_tokens && !blocks.is_empty()).then(|| SaveTicket {
            mover: Arc::clone(self),
            model: model.to_string(),
            blocks: blocks.into(),
            block_tokens,
        })
    }

    fn now(&self) -> Nanos {
        Nanos(self.start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64)
    }

    /// `w`'s costs: what was measured on it, else the fleet's estimate (every worker's
    /// measurements, starting from the `[kv_migration]` priors).
    pub fn costs(&self, w: &WorkerEntry) -> WorkerCosts {
        let fleet = **self.fleet.load();
        match *w.kv_costs.lock() {
            Some(c) => WorkerCosts {
                restore: if c.restore_samples > 0 { c.restore } else { fleet.restore },
                prefill: if c.prefill_samples > 0 { c.prefill } else { fleet.prefill },
                ..c
            },
            None => fleet,
        }
    }

    /// Folds a measurement into `w`'s costs and the fleet's: `f` applies it to one
    /// [`WorkerCosts`] (the worker's starts from the fleet's estimate).
    fn measured(&self, w: &WorkerEntry, f: impl Fn(&mut WorkerCosts)) {
        let mut fleet = **self.fleet.load();
        f(&mut fleet);
        self.fleet.store(Arc::new(fleet));
        f(w.kv_costs.lock().get_or_insert(WorkerCosts { restore_samples: 0, prefill_samples: 0, ..fleet }));
    }

    /// `w` reported computing `uncached` prompt tokens in `secs` (llama.cpp
    /// `timings.prompt_n`, `prompt_ms`): a prefill-cost sample (ignored under
    /// `MIN_PREFILL_SAMPLE` tokens).
    pub fn observe_prefill(&self, w: &WorkerEntry, uncached: u64, secs: f64) {
        if uncached >= MIN_PREFILL_SAMPLE {
            self.measured(w, |c| {
                c.prefill.observe(uncached, secs, c.prefill_samples);
                c.prefill_samples = c.prefill_samples.saturating_add(1);
            });
        }
    }

    /// The saved file of `model` holding the longest leading run of a prompt (`blocks`,
    /// tenant-salted), if any. Lock-free (a registry snapshot).
    pub fn best_file(&self, model: &str, blocks: &[BlockHash]) -> Option<FileMatch> {
        self.files.load().best(model, blocks)
    }

    /// Leading blocks of a prompt that an empty idle slot of `w` would hold after the
    /// restore of `file` the mover would do there: the file's match when [`plan_restore`]
    /// says it pays (`block_tokens` per block), else 0. For the decision and the slot
    /// choice ([`kvroute_core::slots::SlotTable::choose_with_restore`]); reads only the
    /// worker's costs.
    pub fn restorable_blocks(&self, w: &WorkerEntry, file: &FileMatch, block_tokens: u32) -> usize {
        plan_restore(&self.ask(w, file, block_tokens, 0)).map_or(0, |_| file.blocks)
    }

    fn ask(&self, w: &WorkerEntry, file: &FileMatch, block_tokens: u32, slot_tokens: u64) -> RestoreAsk {
        RestoreAsk::for_file(file, block_tokens, slot_tokens, &self.costs(w), self.cfg.min_tokens)
    }

    /// Before a request is sent to the slot `at`: restores `m`, the best saved prefix for
    /// its prompt ([`KvMover::best_file`], matched in blocks of `block_tokens`), into the
    /// slot if that pays. `None` when nothing was restored (not worth it, a busy slot, or
    /// the restore failed — the request then recomputes).
    pub async fn restore(&self, at: SlotPlace<'_>, m: &FileMatch, block_tokens: u32) -> Option<Restored> {
        let SlotPlace { worker: w, slot, cached_blocks: slot_cached_blocks, busy } = at;
        if busy {
            return None;
        }
        let ask = self.ask(w, m, block_tokens, slot_cached_blocks as u64 * u64::from(block_tokens));
        let Some(plan) = plan_restore(&ask) else {
            if ask.file_cached_tokens.saturating_sub(ask.slot_cached_tokens) >= ask.min_tokens {
                self.metrics.op("restore", "not_worth");
            }
            return None;
        };
        let t = Instant::now();
        match self.slot_call(w, slot, "restore", &m.name).await {
            Ok(a) => {
                let secs = t.elapsed().as_secs_f64();
                let tokens = a.n_saved.unwrap_or(m.tokens);
                self.measured(w, |c| {
                    c.restore.observe(tokens, secs, c.restore_samples);
                    c.restore_samples = c.restore_samples.saturating_add(1);
                });
                self.metrics.op("restore", "restored");
                self.metrics.done("restore", a.n_written.unwrap_or(m.bytes), secs);
                self.metrics.gain.observe(plan.gain_secs());
                self.edit(|f| f.touch(&m.name, self.now()));
                self.touch_file(&m.name);
                Some(Restored { gained_tokens: plan.gained_tokens, predicted_gain_secs: plan.gain_secs(), secs })
            }
            Err(e) => {
                tracing::warn!(worker = %w.url, slot, file = %m.name, error = %e, "kv_migration: restore failed; the request recomputes its prefix");
                self.metrics.op("restore", "failed");
                // A file the worker refused (gone, unreadable) is not offered again; after a
                // transport failure the file may still be good.
                if matches!(e, SlotCallError::Refused(_)) {
                    self.edit(|f| {
                        f.remove(&m.name);
                    });
                }
                None
            }
        }
    }

    /// A request pinned to `slot` of `w` ended with its prompt prefilled (`t`): saves the
    /// slot in the background if it is worth it and the slot is idle. Called with the
    /// worker's slot table locked (`slots`), after the request's own hold was released.
    pub fn after_request(t: SaveTicket, w: &Arc<WorkerEntry>, slot: u32, slots: &mut kvroute_core::slots::SlotTable) {
        let me = &t.mover;
        let covered = me.files.load().best(&t.model, &t.blocks).is_some_and(|m| m.blocks * 10 >= t.blocks.len() * 9);
        if covered {
            return;
        }
        if me.saves.fetch_add(1, Ordering::AcqRel) >= me.cfg.max_concurrent_saves {
            me.saves.fetch_sub(1, Ordering::AcqRel);
            me.metrics.op("save", "skipped");
            return;
        }
        if !slots.hold_if_idle(slot, Nanos(0)) {
            me.saves.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            slots.finish(slot, Nanos(0));
            me.saves.fetch_sub(1, Ordering::AcqRel);
            return;
        };
        let w = Arc::clone(w);
        rt.spawn(async move {
            let me = Arc::clone(&t.mover);
            me.save(&w, slot, t).await;
            if let Some(table) = w.slots.lock().as_mut() {
                table.finish(slot, Nanos(0));
            }
            me.saves.fetch_sub(1, Ordering::AcqRel);
        });
    }

    async fn save(&self, w: &WorkerEntry, slot: u32, t: SaveTicket) {
        let name = format!("{}{}.bin", self.name_prefix, self.seq.fetch_add(1, Ordering::Relaxed));
        let started = Instant::now();
        match self.slot_call(w, slot, "save", &name).await {
            Ok(a) => {
                let bytes = a.n_written.unwrap_or(0);
                self.metrics.op("save", "saved");
                self.metrics.done("save", bytes, started.elapsed().as_secs_f64());
                let file = SavedPrefix {
                    name,
                    model: t.model,
                    blocks: t.blocks,
                    block_tokens: t.block_tokens,
                    tokens: a.n_saved.unwrap_or(0),
                    bytes,
                    last_used: self.now(),
                };
                let gone = self.edit(|f| f.insert(file));
                self.delete(gone, "evicted").await;
            }
            Err(e) => {
                tracing::warn!(worker = %w.url, slot, error = %e, "kv_migration: save failed");
                self.metrics.op("save", "failed");
            }
        }
    }

    /// `POST {w}/slots/{slot}?action={action}` with the file `name`. A request that fails
    /// before any answer (not a timeout or a refused connection: llama-server closed the
    /// pooled keep-alive connection under it) is sent once more on a fresh connection, as
    /// requests are (`pipeline::dispatch::attempt`).
    async fn slot_call(
        &self,
        w: &WorkerEntry,
        slot: u32,
        action: &str,
        name: &str,
    ) -> Result<SlotFileAnswer, SlotCallError> {
        let url = format!("{}/slots/{slot}?action={action}", w.url);
        let rb = self
            .client
            .post(&url)
            .timeout(Duration::from_secs_f64(self.cfg.timeout_secs))
            .json(&serde_json::json!({ "filename": name }));
        let again = rb.try_clone();
        let sent = match (rb.send().await, again) {
            (Err(e), Some(again)) if !e.is_timeout() && !e.is_connect() => again.send().await,
            (r, _) => r,
        };
        let resp = sent.map_err(|e| SlotCallError::Transport(crate::upstream::causes(&e)))?;
        let status = resp.status();
        let body = crate::upstream::read_capped(resp, MAX_SLOT_ANSWER_BYTES)
            .await
            .map_err(|e| SlotCallError::Transport(crate::upstream::causes(&e)))?
            .ok_or_else(|| SlotCallError::Refused(format!("{status}: an answer over {MAX_SLOT_ANSWER_BYTES} bytes")))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
            return Err(SlotCallError::Refused(format!("{status}: {text}")));
        }
        serde_json::from_slice(&body).map_err(|e| SlotCallError::Refused(format!("unreadable answer: {e}")))
    }

    /// Applies `f` to a copy of the registry and publishes it; the gauges follow.
    fn edit<R>(&self, f: impl FnOnce(&mut PrefixFiles) -> R) -> R {
        let _w = self.write.lock();
        let mut next = PrefixFiles::clone(&self.files.load());
        let r = f(&mut next);
        self.metrics.files.set(next.len() as i64);
        self.metrics.file_bytes.set(next.bytes().min(i64::MAX as u64) as i64);
        self.files.store(Arc::new(next));
        r
    }

    /// Sets the file's modification time to now (in the background, errors ignored): a
    /// file in use is not taken for a previous run's by another replica starting on the
    /// same directory ([`KvMover::clean_stale`] goes by modification time).
    fn touch_file(&self, name: &str) {
        let path = self.dir.join(name);
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn_blocking(move || {
            let _ = std::fs::File::options()
                .append(true)
                .open(&path)
                .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        });
    }

    /// Deletes the files `names` from `slot_save_dir`, counted as `why`.
    async fn delete(&self, names: Vec<String>, why: &str) {
        for n in names {
            match tokio::fs::remove_file(self.dir.join(&n)).await {
                Ok(()) => self.metrics.op("remove", why),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.metrics.op("remove", why),
                Err(e) => {
                    tracing::warn!(file = %n, dir = %self.dir.display(), error = %e, "kv_migration: could not remove a slot file");
                    self.metrics.op("remove", "failed");
                }
            }
        }
    }

    /// Removes the files not used for `file_ttl_secs` (run every minute by `serve`).
    pub async fn sweep(&self) {
        let now = self.now();
        let gone = self.edit(|f| f.expire(now));
        self.delete(gone, "expired").await;
    }

    /// At startup: deletes the `kvroute-*.bin` files in `slot_save_dir` not modified for
    /// `file_ttl_secs` (a previous run's; this one's registry starts empty). Returns how
    /// many.
    ///
    /// # Errors
    /// The directory cannot be read.
    pub fn clean_stale(&self) -> std::io::Result<usize> {
        let ttl = Duration::from_secs(self.cfg.file_ttl_secs);
        let mut n = 0;
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            let old = e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().is_ok_and(|a| a > ttl));
            if name.starts_with("kvroute-") && name.ends_with(".bin") && old && std::fs::remove_file(e.path()).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Files held and their bytes (for `/workers`-style reports and tests).
    pub fn held(&self) -> (usize, u64) {
        let f = self.files.load();
        (f.len(), f.bytes())
    }
}

/// The `[kv_migration]` priors: a worker's costs before anything is measured.
fn priors(cfg: &KvMigrationConfig) -> WorkerCosts {
    WorkerCosts {
        restore: TransferCost {
            overhead_secs: cfg.restore_overhead_secs,
            secs_per_token: 1.0 / cfg.restore_tokens_per_sec,
        },
        prefill: TransferCost { overhead_secs: 0.0, secs_per_token: 1.0 / cfg.prefill_tokens_per_sec },
        restore_samples: 0,
        prefill_samples: 0,
    }
}

/// How often [`run_sweeper`] removes cold files.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The KV mover's housekeeping until `cancel` (returns at once without a mover): first the
/// files a previous run left in `slot_save_dir` ([`KvMover::clean_stale`]), then every
/// [`SWEEP_EVERY`] the files gone cold ([`KvMover::sweep`]).
pub async fn run_sweeper(mover: Option<Arc<KvMover>>, cancel: tokio_util::sync::CancellationToken) {
    let Some(m) = mover else { return };
    match m.clean_stale() {
        Ok(n) => tracing::info!(dir = %m.dir.display(), removed = n, "kv_migration: on; stale slot files removed"),
        Err(e) => {
            tracing::warn!(dir = %m.dir.display(), error = %e, "kv_migration: slot_save_dir cannot be read: files will not be removed")
        }
    }
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.tick().await;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = every.tick() => m.sweep().await,
        }
    }
}
