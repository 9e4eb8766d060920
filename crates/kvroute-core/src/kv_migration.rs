//! Router-directed KV migration: the prompt prefixes saved out of engines' KV caches, which
//! one to restore into the slot a request is about to take, and whether that pays.
//!
//! An engine that can write a prompt's KV out and read it back elsewhere — llama.cpp's
//! `llama-server --slot-save-path DIR` with `POST /slots/{id}?action=save|restore` — lets a
//! router *move* a cached prefix instead of only following it: when the policy sends a
//! request away from the worker that holds its prefix (the holder is overloaded, draining
//! or gone), the router restores the prefix into the target's slot before dispatching, if
//! the predicted restore is cheaper than recomputing that prefix there. The policy already
//! chose the target over waiting for the holder, so a restore that beats recomputing beats
//! both.
//!
//! This module is the pure part: [`PrefixFiles`], the registry of saved prefixes (each a
//! chain of block hashes, salted per tenant by the caller so a tenant only ever matches its
//! own files), bounded in count, bytes and age; [`TransferCost`], a cost calibrated online;
//! and [`plan_restore`], the decision. The gateway does the I/O (`kvroute_gateway::kv_move`).

use crate::slots::common_prefix;
use crate::types::{BlockHash, Nanos};

/// One prefix saved out of an engine: a file in the workers' shared slot directory.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedPrefix {
    /// File name inside the slot directory (no path separators).
    pub name: String,
    /// Model the KV belongs to (a file is only restored for the same model).
    pub model: String,
    /// Chained block hashes of the prompt it holds (salted per tenant by the caller);
    /// shared, so a copy of the registry is cheap.
    pub blocks: std::sync::Arc<[BlockHash]>,
    /// Tokens per block of `blocks`.
    pub block_tokens: u32,
    /// Tokens the engine wrote (llama.cpp `n_saved`: the prompt and what it generated).
    pub tokens: u64,
    /// File size, bytes (llama.cpp `n_written`).
    pub bytes: u64,
    /// Last saved or restored (caller's clock).
    pub last_used: Nanos,
}

/// Bounds of a [`PrefixFiles`] registry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FileLimits {
    /// Most files kept.
    pub max_files: usize,
    /// Most bytes kept, all files together.
    pub max_bytes: u64,
    /// A file not used for this long is removed ([`PrefixFiles::expire`]), ns.
    pub ttl: Nanos,
}

/// The best saved prefix for a request ([`PrefixFiles::best`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMatch {
    /// File name.
    pub name: String,
    /// Leading blocks of the request it holds.
    pub blocks: usize,
    /// Tokens it holds in all (what a restore reads).
    pub tokens: u64,
    /// Bytes it holds.
    pub bytes: u64,
}

/// The registry of saved prefixes, least recently used first out. Bounded by
/// [`FileLimits`]; every insertion returns the names of the files it pushed out, for the
/// caller to delete.
#[derive(Debug, Clone)]
pub struct PrefixFiles {
    limits: FileLimits,
    files: Vec<SavedPrefix>,
    bytes: u64,
}

impl PrefixFiles {
    /// An empty registry (`max_files` at least 1).
    pub fn new(limits: FileLimits) -> Self {
        let limits = FileLimits { max_files: limits.max_files.max(1), ..limits };
        PrefixFiles { limits, files: Vec::new(), bytes: 0 }
    }

    /// Files held.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// No file held.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Bytes held, all files together.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The file of `model` holding the longest leading run of `blocks` (at least one
    /// block); on a tie the most recently used. Linear in the files held; each comparison
    /// stops at the first differing block. Pure.
    pub fn best(&self, model: &str, blocks: &[BlockHash]) -> Option<FileMatch> {
        let mut best: Option<(&SavedPrefix, usize)> = None;
        for f in self.files.iter().filter(|f| f.model == model) {
            let n = common_prefix(&f.blocks, blocks);
            if n > 0 && best.is_none_or(|(b, m)| (n, f.last_used) > (m, b.last_used)) {
                best = Some((f, n));
            }
        }
        best.map(|(f, n)| FileMatch { name: f.name.clone(), blocks: n, tokens: f.tokens, bytes: f.bytes })
    }

    /// Adds `file` and returns the names of the files removed: those of the same model
    /// whose prompt is a leading part of `file`'s (a conversation's earlier turn: `file`
    /// serves every request they served), then the least recently used to keep the limits
    /// (`file` itself when it alone is over `max_bytes`).
    pub fn insert(&mut self, file: SavedPrefix) -> Vec<String> {
        let mut gone = Vec::new();
        while let Some(i) = self.files.iter().position(|f| {
            f.model == file.model
                && f.blocks.len() <= file.blocks.len()
                && common_prefix(&f.blocks, &file.blocks) == f.blocks.len()
        }) {
            gone.push(self.take(i).name);
        }
        self.bytes = self.bytes.saturating_add(file.bytes);
        self.files.push(file);
        while self.files.len() > self.limits.max_files || self.bytes > self.limits.max_bytes {
            let Some(i) = self.oldest() else { break };
            gone.push(self.take(i).name);
        }
        gone
    }

    /// `name` was restored at `now`: it is the most recently used.
    pub fn touch(&mut self, name: &str, now: Nanos) {
        if let Some(f) = self.files.iter_mut().find(|f| f.name == name) {
            f.last_used = f.last_used.max(now);
        }
    }

    /// Forgets `name` (its file is gone or unreadable); `true` when it was held.
    pub fn remove(&mut self, name: &str) -> bool {
        match self.files.iter().position(|f| f.name == name) {
            Some(i) => {
                self.take(i);
                true
            }
            None => false,
        }
    }

    /// Removes the files not used for [`FileLimits::ttl`] before `now` and returns their
    /// names.
    pub fn expire(&mut self, now: Nanos) -> Vec<String> {
        let cutoff = now.0.saturating_sub(self.limits.ttl.0);
        let mut gone = Vec::new();
        while let Some(i) = self.files.iter().position(|f| f.last_used.0 < cutoff) {
            gone.push(self.take(i).name);
        }
        gone
    }

    fn oldest(&self) -> Option<usize> {
        (0..self.files.len()).min_by_key(|&i| self.files[i].last_used)
    }

    fn take(&mut self, i: usize) -> SavedPrefix {
        let f = self.files.swap_remove(i);
        self.bytes = self.bytes.saturating_sub(f.bytes);
        f
    }
}

/// A cost linear in tokens — `overhead_secs + tokens × secs_per_token` — calibrated online
/// by an exponentially weighted average of what was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferCost {
    /// Fixed part of one operation (the HTTP round trip, opening the file), seconds.
    pub overhead_secs: f64,
    /// Per token, seconds.
    pub secs_per_token: f64,
}

/// Weight of a new measurement in [`TransferCost::observe`].
pub const COST_EWMA_WEIGHT: f64 = 0.2;

impl TransferCost {
    /// Predicted seconds for `tokens`.
    pub fn secs(&self, tokens: u64) -> f64 {
        self.overhead_secs + tokens as f64 * self.secs_per_token
    }

    /// Folds in one measurement: `tokens` took `secs` in all, with `before` measurements
    /// folded in already. The per-token rate moves toward what the measurement implies
    /// once the overhead is taken out, by `max(1 / (before + 1), COST_EWMA_WEIGHT)`: the
    /// first measurement replaces the prior, the first few are averaged, later ones are
    /// weighted [`COST_EWMA_WEIGHT`]. A measurement that is not finite and positive, or of
    /// no tokens, is ignored.
    pub fn observe(&mut self, tokens: u64, secs: f64, before: u32) {
        if tokens == 0 || !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let per = ((secs - self.overhead_secs).max(secs * 0.1)) / tokens as f64;
        let w = (1.0 / (f64::from(before) + 1.0)).max(COST_EWMA_WEIGHT);
        self.secs_per_token += w * (per - self.secs_per_token);
    }
}

/// One worker's costs, calibrated online: restoring a file into a slot, and prefilling
/// what is not cached (what a restore saves).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerCosts {
    /// Restore: the call's overhead and seconds per token read.
    pub restore: TransferCost,
    /// Prefill: seconds per uncached prompt token.
    pub prefill: TransferCost,
    /// Restores measured on this worker (0: `restore` is the fleet's estimate).
    pub restore_samples: u32,
    /// Prefill samples measured on this worker (0: `prefill` is the fleet's estimate).
    pub prefill_samples: u32,
}

/// What [`plan_restore`] weighs for one request on the slot it is about to take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestoreAsk {
    /// Prompt tokens the target slot already holds.
    pub slot_cached_tokens: u64,
    /// Prompt tokens the best saved file holds (its leading run of the request).
    pub file_cached_tokens: u64,
    /// Tokens in the file (a restore reads all of them).
    pub file_tokens: u64,
    /// The target's restore cost.
    pub restore: TransferCost,
    /// The target's prefill cost (what recomputing the prefix costs there).
    pub prefill: TransferCost,
    /// A restore that gains fewer prompt tokens than this is not tried.
    pub min_tokens: u64,
}

impl RestoreAsk {
    /// The ask for restoring `file` (its match counted in blocks of `block_tokens`) into a
    /// slot holding `slot_tokens` of the prompt, on a worker with `costs`.
    pub fn for_file(
        file: &FileMatch,
        block_tokens: u32,
        slot_tokens: u64,
        costs: &WorkerCosts,
        min_tokens: u32,
    ) -> Self {
        RestoreAsk {
            slot_cached_tokens: slot_tokens,
            file_cached_tokens: file.blocks as u64 * u64::from(block_tokens),
            file_tokens: file.tokens,
            restore: costs.restore,
            prefill: costs.prefill,
            min_tokens: u64::from(min_tokens),
        }
    }
}

/// A restore worth doing ([`plan_restore`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestorePlan {
    /// Prompt tokens the restore adds to the slot's hit.
    pub gained_tokens: u64,
    /// Predicted restore time, seconds.
    pub restore_secs: f64,
    /// Predicted time to recompute those tokens instead, seconds.
    pub recompute_secs: f64,
}

impl RestorePlan {
    /// Predicted TTFT saved, seconds (positive).
    pub fn gain_secs(&self) -> f64 {
        self.recompute_secs - self.restore_secs
    }
}

/// Restore the file into the slot? Yes when it adds at least `min_tokens` to the slot's
/// hit and reading the whole file is predicted faster than prefilling what it adds. Pure.
pub fn plan_restore(a: &RestoreAsk) -> Option<RestorePlan> {
    let gained = a.file_cached_tokens.saturating_sub(a.slot_cached_tokens);
    if gained == 0 || gained < a.min_tokens {
        return None;
    }
    let restore_secs = a.restore.secs(a.file_tokens);
    let recompute_secs = gained as f64 * a.prefill.secs_per_token;
    (restore_secs < recompute_secs).then_some(RestorePlan { gained_tokens: gained, restore_secs, recompute_secs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    fn file(name: &str, blocks: &[u64], bytes: u64, at: u64) -> SavedPrefix {
        SavedPrefix {
            name: name.into(),
            model: "m".into(),
            blocks: h(blocks).into(),
            block_tokens: 16,
            tokens: blocks.len() as u64 * 16,
            bytes,
            last_used: Nanos(at),
        }
    }

    fn limits(max_files: usize, max_bytes: u64) -> FileLimits {
        FileLimits { max_files, max_bytes, ttl: Nanos(100) }
    }

    #[test]
    fn the_longest_leading_run_of_the_same_model_wins() {
        let mut r = PrefixFiles::new(limits(8, 1 << 30));
        assert!(r.insert(file("a", &[1, 2, 3], 10, 1)).is_empty());
        assert!(r.insert(file("b", &[1, 2, 9, 9, 9], 10, 2)).is_empty());
        let mut other = file("c", &[1, 2, 3, 4], 10, 3);
        other.model = "other".into();
        r.insert(other);
        let m = r.best("m", &h(&[1, 2, 3, 4])).expect("a match");
        assert_eq!((m.name.as_str(), m.blocks, m.tokens), ("a", 3, 48));
        // A tie goes to the most recently used.
        assert_eq!(r.best("m", &h(&[1, 2])).expect("a match").name, "b");
        // Nothing in common: no match (another tenant's salted chain differs at block 0).
        assert_eq!(r.best("m", &h(&[7, 2, 3])), None);
    }

    #[test]
    fn limits_push_out_the_least_recently_used() {
        let mut r = PrefixFiles::new(limits(2, 25));
        r.insert(file("a", &[1], 10, 1));
        r.insert(file("b", &[2], 10, 2));
        r.touch("a", Nanos(5));
        assert_eq!(r.insert(file("c", &[3], 10, 3)), vec!["b".to_string()]);
        assert_eq!(r.len(), 2);
        // Over the byte budget: the oldest goes, then the new one itself if it alone is over.
        assert_eq!(r.insert(file("d", &[4], 20, 6)), vec!["c".to_string(), "a".to_string()]);
        assert_eq!(r.bytes(), 20);
        assert_eq!(r.insert(file("e", &[5], 30, 7)), vec!["d".to_string(), "e".to_string()]);
        assert!(r.is_empty());
        assert_eq!(r.bytes(), 0);
    }

    #[test]
    fn a_file_replaces_those_whose_prompt_it_extends() {
        let mut r = PrefixFiles::new(limits(8, 1 << 30));
        r.insert(file("turn1", &[1, 2, 3], 10, 1));
        r.insert(file("other", &[1, 2, 9], 10, 2));
        // Turn 2 extends turn 1's prompt: turn 1's file goes, the sibling stays.
        assert_eq!(r.insert(file("turn2", &[1, 2, 3, 4, 5], 20, 3)), vec!["turn1".to_string()]);
        assert_eq!(r.len(), 2);
        assert_eq!(r.bytes(), 30);
        assert_eq!(r.best("m", &h(&[1, 2, 3, 7])).expect("a match").name, "turn2");
    }

    #[test]
    fn cold_files_expire_and_removed_ones_are_forgotten() {
        let mut r = PrefixFiles::new(limits(8, 1 << 30));
        r.insert(file("a", &[1], 10, 10));
        r.insert(file("b", &[2], 10, 150));
        let mut gone = r.expire(Nanos(200));
        gone.sort();
        assert_eq!(gone, vec!["a".to_string()]);
        assert!(r.remove("b"));
        assert!(!r.remove("b"));
        assert_eq!(r.bytes(), 0);
    }

    fn ask(slot: u64, file: u64) -> RestoreAsk {
        RestoreAsk {
            slot_cached_tokens: slot,
            file_cached_tokens: file,
            file_tokens: file + 10,
            restore: TransferCost { overhead_secs: 0.01, secs_per_token: 5e-6 },
            prefill: TransferCost { overhead_secs: 0.0, secs_per_token: 1e-3 },
            min_tokens: 256,
        }
    }

    #[test]
    fn a_restore_is_planned_only_when_it_adds_enough_and_beats_recomputing() {
        let p = plan_restore(&ask(0, 3_000)).expect("3,000 tokens: 3 s to recompute, ~25 ms to restore");
        assert_eq!(p.gained_tokens, 3_000);
        assert!(p.gain_secs() > 2.9 && p.gain_secs() < 3.0, "{p:?}");
        // The slot holds most of it already: too little gained.
        assert_eq!(plan_restore(&ask(2_900, 3_000)), None);
        // Recomputing is cheaper than reading the file (a fast GPU, a slow disk).
        let mut fast = ask(0, 3_000);
        fast.prefill.secs_per_token = 2e-6;
        assert_eq!(plan_restore(&fast), None);
    }

    #[test]
    fn the_cost_learns_from_measurements_and_ignores_nonsense() {
        let mut c = TransferCost { overhead_secs: 0.01, secs_per_token: 1e-4 };
        // The first measurement replaces the prior.
        c.observe(1_000, 0.01 + 1_000.0 * 5e-6, 0);
        assert!((c.secs_per_token - 5e-6).abs() < 1e-12, "{c:?}");
        // Later ones move it a fifth of the way.
        c.observe(1_000, 0.01 + 1_000.0 * 15e-6, 10);
        assert!((c.secs_per_token - 7e-6).abs() < 1e-12, "{c:?}");
        let before = c;
        c.observe(0, 1.0, 0);
        c.observe(10, f64::NAN, 0);
        c.observe(10, -1.0, 0);
        assert_eq!(c, before);
    }
}
