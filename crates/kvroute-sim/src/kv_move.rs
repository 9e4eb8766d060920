//! The KV mover of a replay ([`crate::types::ReplayConfig::kv_migration`]): the router side
//! of `kvroute serve`'s `[kv_migration]` (`kvroute_gateway::kv_move`) over simulated
//! llama.cpp engines, with the same pure parts ([`kvroute_core::kv_migration`]) and the same
//! rules:
//!
//! - **Save, write-behind.** When a request pinned to a slot ends and its prompt had at
//!   least `min_tokens`, the router saves the slot ([`Engine::save_slot`]) — unless a file
//!   already holds 90 % of the prompt's blocks, `max_concurrent_saves` saves are running, or
//!   the slot is not idle in the router's slot table (a request is already on it). The slot
//!   counts as busy in the table until the save ends ([`SlotTable::hold_if_idle`]); the file
//!   is registered then ([`PrefixFiles::insert`]; the files it pushes out are forgotten).
//! - **Restore, before dispatch.** After the policy chose an engine and the slot table a
//!   slot there, the file holding the longest leading run of the prompt is weighed with
//!   [`plan_restore`] (the slot's hit, the file's, the engine's restore and prefill costs,
//!   `min_tokens`) and, if it pays, the request carries it ([`EngineRequest::restore`]).
//!   Never into a slot something is on.
//! - **The policy's view**: an engine whose chosen slot is idle is credited with the tokens
//!   the restore there would give (the gateway's `restorable_blocks`), so the policy sees
//!   every idle slot as able to hold a saved prefix.
//! - **Costs** per engine, as the gateway keeps them ([`WorkerCosts`]): restores calibrated
//!   from the time the engine model reports for each ([`EngineEvent::SlotRestored`]), an
//!   engine not measured yet using the fleet's estimate, which starts from the gateway's
//!   `[kv_migration]` priors ([`RESTORE_PRIOR`]). Prefill is the profile's per-token
//!   prefill (the gateway learns it from llama.cpp's `timings`; the engine model's prefill
//!   is that constant plus step overheads).
//!
//! Not modelled: failed saves or restores, files deleted behind the router's back, the
//! restore's HTTP call delaying the request beyond what the engine charges, another
//! router sharing the directory.
//!
//! [`Engine::save_slot`]: crate::engine::Engine::save_slot
//! [`EngineRequest::restore`]: crate::engine::EngineRequest::restore
//! [`EngineEvent::SlotRestored`]: crate::engine::EngineEvent::SlotRestored
//! [`SlotTable::hold_if_idle`]: kvroute_core::slots::SlotTable::hold_if_idle

use crate::engine::{Profile, SlotRestore};
use crate::trace::TraceRequest;
use crate::types::{KvMigration, KvMigrationCounts};
use kvroute_core::kv_migration::{
    FileLimits, FileMatch, PrefixFiles, RestoreAsk, SavedPrefix, TransferCost, WorkerCosts, plan_restore,
};
use kvroute_core::slots::SlotChoice;
use kvroute_core::types::{BlockHash, Nanos};
use std::collections::HashMap;
use std::sync::Arc;

/// The model name files are registered under (a replay serves one model; `request_view`
/// calls it `trace`).
const MODEL: &str = "trace";

/// The fleet's restore cost before any restore is measured: `kvroute serve`'s
/// `[kv_migration]` defaults, `restore_overhead_secs` 0.02 and `restore_tokens_per_sec`
/// 100,000.
pub const RESTORE_PRIOR: TransferCost = TransferCost { overhead_secs: 0.02, secs_per_token: 1e-5 };

/// The full blocks of a trace request's prompt: what a llama.cpp slot keeps of it, and what
/// a saved file is matched on.
pub(crate) fn slot_blocks(r: &TraceRequest) -> &[BlockHash] {
    let full = (r.input_tokens / r.block_tokens.max(1)) as usize;
    &r.blocks[..full.min(r.blocks.len())]
}

/// The replay's KV mover. See the module docs.
#[derive(Debug)]
pub(crate) struct Mover {
    cfg: KvMigration,
    files: PrefixFiles,
    /// Each registered file's blocks, by name (what a restore puts into the slot).
    blocks: HashMap<String, Arc<[BlockHash]>>,
    fleet: WorkerCosts,
    engines: Vec<Option<WorkerCosts>>,
    /// Saves under way: request index → (engine, slot).
    saving: HashMap<usize, (usize, u32)>,
    seq: u64,
    bytes_per_token: u64,
    counts: KvMigrationCounts,
}

impl Mover {
    /// The mover of `cfg` for `engines` engines of `profile`.
    pub(crate) fn new(cfg: KvMigration, profile: &Profile, engines: usize) -> Mover {
        let limits = FileLimits { max_files: cfg.max_files, max_bytes: cfg.max_bytes, ttl: cfg.ttl };
        Mover {
            cfg,
            files: PrefixFiles::new(limits),
            blocks: HashMap::new(),
            fleet: WorkerCosts {
                restore: RESTORE_PRIOR,
                prefill: TransferCost { overhead_secs: 0.0, secs_per_token: profile.prefill_per_token_s },
                restore_samples: 0,
                prefill_samples: 0,
            },
            engines: vec![None; engines],
            saving: HashMap::new(),
            seq: 0,
            bytes_per_token: profile.kv_file_bytes_per_token,
            counts: KvMigrationCounts::default(),
        }
    }

    /// Engine `w`'s costs: what was measured on it, else the fleet's estimate.
    fn costs(&self, w: usize) -> WorkerCosts {
        match self.engines.get(w).copied().flatten() {
            Some(c) if c.restore_samples > 0 => c,
            _ => self.fleet,
        }
    }

    /// The file holding the longest leading run of `r`'s prompt, if any.
    pub(crate) fn best(&self, r: &TraceRequest) -> Option<FileMatch> {
        self.files.best(MODEL, slot_blocks(r))
    }

    fn ask(&self, w: usize, file: &FileMatch, block_tokens: u32, slot_tokens: u64) -> RestoreAsk {
        RestoreAsk::for_file(file, block_tokens, slot_tokens, &self.costs(w), self.cfg.min_tokens)
    }

    /// Leading blocks of a prompt that an empty idle slot of engine `w` would hold after the
    /// restore of `file` the mover would do there: the file's match when [`plan_restore`]
    /// says it pays, else 0 (the gateway's `restorable_blocks`), for
    /// [`kvroute_core::slots::SlotTable::choose_with_restore`].
    pub(crate) fn restorable_blocks(&self, w: usize, file: &FileMatch, block_tokens: u32) -> usize {
        plan_restore(&self.ask(w, file, block_tokens, 0)).map_or(0, |_| file.blocks)
    }

    /// Before `r` is sent to the slot `choice` of engine `w` at `now`: `m` (the best file
    /// for `r`, [`KvMover::best`]) to restore into the slot first, when that pays (never
    /// into a busy slot).
    pub(crate) fn restore(
        &mut self,
        w: usize,
        choice: SlotChoice,
        r: &TraceRequest,
        m: &FileMatch,
        now: Nanos,
    ) -> Option<SlotRestore> {
        if choice.waits {
            return None;
        }
        let ask = self.ask(w, m, r.block_tokens, choice.cached_blocks as u64 * u64::from(r.block_tokens));
        let Some(plan) = plan_restore(&ask) else {
            if ask.file_cached_tokens.saturating_sub(ask.slot_cached_tokens) >= ask.min_tokens {
                self.counts.kv_restores_not_worth += 1;
            }
            return None;
        };
        let blocks = self.blocks.get(&m.name)?.to_vec();
        self.files.touch(&m.name, now);
        self.counts.kv_restore_gained_tokens += plan.gained_tokens;
        Some(SlotRestore { blocks, tokens: u32::try_from(m.tokens).unwrap_or(u32::MAX) })
    }

    /// Engine `w` reported a restore of `tokens` that took `took`: a restore-cost sample
    /// for it and for the fleet.
    pub(crate) fn restored(&mut self, w: usize, tokens: u32, took: Nanos) {
        let secs = took.as_secs_f64();
        let measure = |c: &mut WorkerCosts| {
            c.restore.observe(u64::from(tokens), secs, c.restore_samples);
            c.restore_samples = c.restore_samples.saturating_add(1);
        };
        measure(&mut self.fleet);
        let fleet = self.fleet;
        if let Some(c) = self.engines.get_mut(w) {
            measure(c.get_or_insert(WorkerCosts { restore_samples: 0, prefill_samples: 0, ..fleet }));
        }
        self.counts.kv_restores += 1;
        self.counts.kv_restored_tokens += u64::from(tokens);
        self.counts.kv_restore_secs += secs;
    }

    /// Request `i` (`r`) ended on its slot and the slot is idle in the router's record:
    /// whether to save it (a long prompt no file holds 90 % of, with a save free). `true`
    /// counts the save as under way; the caller then holds the slot and asks the engine.
    pub(crate) fn wants_save(&mut self, r: &TraceRequest) -> bool {
        let blocks = slot_blocks(r);
        if r.input_tokens < self.cfg.min_tokens || blocks.is_empty() {
            return false;
        }
        if self.files.best(MODEL, blocks).is_some_and(|m| m.blocks * 10 >= blocks.len() * 9) {
            return false;
        }
        if self.saving.len() >= self.cfg.max_concurrent_saves {
            self.counts.kv_saves_skipped += 1;
            return false;
        }
        true
    }

    /// The save of request `i`'s slot (`slot` of engine `w`) is under way.
    pub(crate) fn saving(&mut self, i: usize, w: usize, slot: u32) {
        self.saving.insert(i, (w, slot));
    }

    /// The save of request `i`'s slot could not start (the engine refused it).
    pub(crate) fn not_saved(&mut self, i: usize) {
        self.saving.remove(&i);
    }

    /// The save of request `i` (`r`) ended at `at`, `tokens` written in `took`: the file is
    /// registered. Returns the (engine, slot) it held.
    pub(crate) fn saved(
        &mut self,
        i: usize,
        r: &TraceRequest,
        tokens: u32,
        took: Nanos,
        at: Nanos,
    ) -> Option<(usize, u32)> {
        let place = self.saving.remove(&i)?;
        let blocks: Arc<[BlockHash]> = slot_blocks(r).into();
        let name = format!("kvroute-sim-{}.bin", self.seq);
        self.seq += 1;
        let bytes = u64::from(tokens).saturating_mul(self.bytes_per_token);
        self.blocks.insert(name.clone(), Arc::clone(&blocks));
        let file = SavedPrefix {
            name,
            model: MODEL.into(),
            blocks,
            block_tokens: r.block_tokens,
            tokens: u64::from(tokens),
            bytes,
            last_used: at,
        };
        let gone = self.files.insert(file);
        self.forget(gone);
        self.counts.kv_saves += 1;
        self.counts.kv_saved_tokens += u64::from(tokens);
        self.counts.kv_saved_bytes += bytes;
        self.counts.kv_save_secs += took.as_secs_f64();
        Some(place)
    }

    /// Removes the files gone cold by `now` (the gateway sweeps every minute; the replay at
    /// every arrival).
    pub(crate) fn expire(&mut self, now: Nanos) {
        let gone = self.files.expire(now);
        self.forget(gone);
    }

    fn forget(&mut self, gone: Vec<String>) {
        for n in gone {
            self.blocks.remove(&n);
            self.counts.kv_files_removed += 1;
        }
    }

    /// What it did.
    pub(crate) fn counts(&self) -> KvMigrationCounts {
        KvMigrationCounts { kv_files_held: self.files.len() as u64, ..self.counts }
    }
}
