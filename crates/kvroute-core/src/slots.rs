//! What a llama.cpp worker's slots hold, as the router knows it, and which slot a request
//! should take there.
//!
//! A llama.cpp `llama-server` runs `--parallel N` slots. Started with `--cache-ram 0` (no
//! host-RAM prompt cache) it keeps a prompt's KV only in the slot that ran it, until that
//! slot runs another prompt (which keeps the longest common prefix and overwrites the rest).
//! Without a slot in the request, the server picks one itself among the *idle* slots: the
//! one whose prompt shares the largest fraction of the request's prompt, above
//! `--slot-prompt-similarity` (0.1), else the least recently used (llama.cpp
//! `tools/server/server-context.cpp`, `get_available_slot`). So when the slot holding a
//! conversation's document is busy, its next request takes the other slot, computes the
//! document afresh there and overwrites whatever that slot held: two documents sharing a
//! worker then swap slots and miss on every request. A request may name its slot
//! (`"id_slot": N` in the body, passed through by the OpenAI-compatible endpoints); a named
//! slot that is busy makes the request wait for it (the server defers the task and gives it
//! the slot when it is released).
//!
//! [`SlotTable`] is the router's record of one worker: per slot, the block hashes of the
//! last prompt it sent there, how many of its requests are on the slot (running or waiting
//! for it) and when it was last used. [`SlotTable::choose`] picks the slot for a request
//! (pure); [`SlotTable::start`] and [`SlotTable::finish`] commit it. The record is exact as
//! long as this router is the worker's only client; another client's requests make it
//! optimistic until the slot is used again.

use crate::types::{BlockHash, Nanos};

/// Most slots a table tracks (llama.cpp's `--parallel` is typically 1–16).
pub const MAX_SLOTS: usize = 256;

/// Most block hashes remembered per slot (65,536 blocks of 16 tokens: a 1M-token context).
pub const MAX_SLOT_BLOCKS: usize = 65_536;

/// A request waits for a busy slot instead of taking an idle one only when the busy slot
/// holds more than this share of its prompt beyond what the best idle slot holds, times the
/// requests already on the slot: waiting costs the running request's remaining time,
/// missing costs the recomputed prefix *and* the prompt the idle slot held. With 0.5 a
/// request waits behind the running one only, never behind another waiting one.
///
/// Chosen in the replay (docs/lab/2026-11-26-replay-measurements.md, "llama.cpp slots"):
/// never waiting while a slot is idle gave 0.30–0.70 × the knee 2.96–6.27 s mean TTFT against
/// 2.45–5.07 s; 0.25 and 0.75 were no better; counting the queue (rather than waiting behind
/// any number) lowered ×0.3–×0.5's mean and p99. Not waiting for a slot whose running request
/// is still in prefill (its prompt not there yet) was worse — 2.63 / 4.12 / 9.72 s at ×0.3 /
/// ×0.5 / ×0.7 against 2.45 / 3.38 / 5.07 s: the prefix is then computed twice, in two slots.
/// (These numbers predate the engine model's slots keeping their generated tokens; with that
/// model the table's least_ttft/slots row reads 1.97 / 2.86 / 4.00 s.)
pub const WAIT_SHARE: f64 = 0.5;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Slot {
    blocks: Vec<BlockHash>,
    busy: u32,
    last_used: Nanos,
}

/// The slot chosen for a request by [`SlotTable::choose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotChoice {
    /// Slot index, 0-based (llama.cpp `id_slot`).
    pub slot: u32,
    /// Leading blocks of the request the slot holds (its cache hit there, in blocks).
    pub cached_blocks: usize,
    /// The slot is busy: the request waits for it.
    pub waits: bool,
}

/// The router's record of one llama.cpp worker's slots. See the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotTable {
    slots: Vec<Slot>,
}

/// Length of the common leading run of two chains of block hashes (a slot's prompt and a
/// request's, in blocks).
pub fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SlotTable {
    /// A worker with `n` empty, idle slots (`n` clamped to 1..=[`MAX_SLOTS`]).
    pub fn new(n: u32) -> Self {
        let n = (n as usize).clamp(1, MAX_SLOTS);
        SlotTable { slots: vec![Slot::default(); n] }
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Always false: a table has at least one slot.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Slots with at least one of this router's requests on them.
    pub fn busy(&self) -> usize {
        self.slots.iter().filter(|s| s.busy > 0).count()
    }

    /// The slot for a request whose prompt has the chained block hashes `blocks` (of
    /// `block_tokens` tokens each; `input_tokens` in all). Pure.
    ///
    /// - Among idle slots, the one holding the longest leading run of `blocks`; on a tie
    ///   (no match anywhere included) the least recently used, as llama.cpp picks.
    /// - A busy slot holding more is taken instead (the request will wait) when the extra
    ///   run is more than [`WAIT_SHARE`] of the prompt per request already on that slot.
    /// - With every slot busy: the one holding the longest run, else the one with the
    ///   fewest requests on it, then the least recently used.
    pub fn choose(&self, blocks: &[BlockHash], block_tokens: u32, input_tokens: u32) -> SlotChoice {
        self.choose_with_restore(blocks, block_tokens, input_tokens, 0)
    }

    /// [`SlotTable::choose`] when any idle slot can be given the request's first
    /// `restorable` blocks before it runs (a saved prefix the router would restore,
    /// `kvroute_core::kv_migration`): each idle slot counts as holding at least that many,
    /// so a busy slot is waited for only when it holds more than a restore would give.
    /// Among slots equally good that way, the one that holds more now is taken (a
    /// conversation's next turn stays in its own slot rather than being restored into the
    /// least recently used one, overwriting that slot's prompt).
    /// [`SlotChoice::cached_blocks`] stays what the slot holds now. Pure.
    pub fn choose_with_restore(
        &self,
        blocks: &[BlockHash],
        block_tokens: u32,
        input_tokens: u32,
        restorable: usize,
    ) -> SlotChoice {
        let held: Vec<usize> = self.slots.iter().map(|s| common_prefix(&s.blocks, blocks)).collect();
        let lcp: Vec<usize> =
            held.iter().zip(&self.slots).map(|(&n, s)| if s.busy == 0 { n.max(restorable) } else { n }).collect();
        // Between slots equally good with the restore counted, the one that really holds
        // more: it needs no restore, and the restore would overwrite another slot's prompt.
        let better = |a: usize, b: usize| {
            let (sa, sb) = (&self.slots[a], &self.slots[b]);
            (lcp[a], held[a], std::cmp::Reverse(sa.busy), std::cmp::Reverse(sa.last_used))
                > (lcp[b], held[b], std::cmp::Reverse(sb.busy), std::cmp::Reverse(sb.last_used))
        };
        let mut best = 0;
        let mut best_idle: Option<usize> = None;
        for i in 0..self.slots.len() {
            if better(i, best) {
                best = i;
            }
            if self.slots[i].busy == 0 && best_idle.is_none_or(|b| better(i, b)) {
                best_idle = Some(i);
            }
        }
        let pick = match best_idle {
            Some(idle) => {
                let extra = (lcp[best] - lcp[idle]) as f64 * f64::from(block_tokens);
                // Each request already on the busy slot is one more to wait for.
                let busy = f64::from(self.slots[best].busy);
                if busy > 0.0 && extra > WAIT_SHARE * busy * f64::from(input_tokens.max(1)) { best } else { idle }
            }
            None => best,
        };
        SlotChoice { slot: pick as u32, cached_blocks: held[pick], waits: self.slots[pick].busy > 0 }
    }

    /// Commits a request with `blocks` to `slot` at `now`: the slot now holds that prompt
    /// (its old content past the common prefix is gone) and has one more request on it.
    /// An out-of-range `slot` changes nothing.
    pub fn start(&mut self, slot: u32, blocks: &[BlockHash], now: Nanos) {
        let Some(s) = self.slots.get_mut(slot as usize) else { return };
        s.blocks.clear();
        s.blocks.extend_from_slice(&blocks[..blocks.len().min(MAX_SLOT_BLOCKS)]);
        s.busy = s.busy.saturating_add(1);
        s.last_used = s.last_used.max(now);
    }

    /// One request on `slot` ended at `now` (answered, failed or cancelled).
    pub fn finish(&mut self, slot: u32, now: Nanos) {
        let Some(s) = self.slots.get_mut(slot as usize) else { return };
        s.busy = s.busy.saturating_sub(1);
        s.last_used = s.last_used.max(now);
    }

    /// Takes `slot` for the router's own use (saving its KV to a file) if nothing is on it:
    /// it counts as busy until [`SlotTable::finish`], so no request is pinned to it
    /// meanwhile without waiting. `false` (nothing changed) when it is busy or out of range.
    pub fn hold_if_idle(&mut self, slot: u32, now: Nanos) -> bool {
        match self.slots.get_mut(slot as usize) {
            Some(s) if s.busy == 0 => {
                s.busy = 1;
                s.last_used = s.last_used.max(now);
                true
            }
            _ => false,
        }
    }

    /// Forgets what `slot` holds (the worker restarted, or reported a miss the record did
    /// not expect).
    pub fn clear(&mut self, slot: u32) {
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.blocks.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn an_idle_slot_holding_the_prefix_is_taken() {
        let mut t = SlotTable::new(2);
        t.start(0, &h(&[1, 2, 3]), Nanos(1));
        t.finish(0, Nanos(2));
        t.start(1, &h(&[7, 8]), Nanos(3));
        t.finish(1, Nanos(4));
        let c = t.choose(&h(&[1, 2, 3, 4]), 16, 64);
        assert_eq!(c, SlotChoice { slot: 0, cached_blocks: 3, waits: false });
        let c = t.choose(&h(&[7, 8, 9]), 16, 48);
        assert_eq!(c, SlotChoice { slot: 1, cached_blocks: 2, waits: false });
    }

    #[test]
    fn a_new_prompt_takes_the_least_recently_used_idle_slot() {
        let mut t = SlotTable::new(3);
        for (slot, at) in [(0, 5), (1, 2), (2, 9)] {
            t.start(slot, &h(&[100 + u64::from(slot)]), Nanos(at));
            t.finish(slot, Nanos(at));
        }
        assert_eq!(t.choose(&h(&[42]), 16, 16).slot, 1);
    }

    #[test]
    fn a_request_waits_for_its_busy_slot_only_when_it_holds_most_of_the_prompt() {
        let mut t = SlotTable::new(2);
        // Slot 0 holds a 16-block document and is running; slot 1 is idle with another.
        t.start(0, &h(&(1..=16).collect::<Vec<_>>()), Nanos(1));
        t.start(1, &h(&[50, 51]), Nanos(1));
        t.finish(1, Nanos(2));
        // The document is 16 of 20 blocks: wait for slot 0.
        let doc: Vec<u64> = (1..=20).collect();
        assert_eq!(t.choose(&h(&doc), 16, 320), SlotChoice { slot: 0, cached_blocks: 16, waits: true });
        // Sharing only the first 2 of 20 blocks is not worth the wait: idle slot 1.
        let other: Vec<u64> = [1, 2].into_iter().chain(200..218).collect();
        assert_eq!(t.choose(&h(&other), 16, 320), SlotChoice { slot: 1, cached_blocks: 0, waits: false });
    }

    #[test]
    fn a_request_does_not_queue_behind_another_waiting_one() {
        let mut t = SlotTable::new(2);
        let doc: Vec<u64> = (1..=20).collect();
        t.start(0, &h(&doc), Nanos(1));
        // One request runs on slot 0: the next one on the document waits for it.
        assert_eq!(t.choose(&h(&doc), 16, 320), SlotChoice { slot: 0, cached_blocks: 20, waits: true });
        t.start(0, &h(&doc), Nanos(2));
        // With one waiting already, the third takes the idle slot.
        assert_eq!(t.choose(&h(&doc), 16, 320), SlotChoice { slot: 1, cached_blocks: 0, waits: false });
    }

    #[test]
    fn a_restorable_prefix_takes_an_idle_slot_instead_of_waiting() {
        let mut t = SlotTable::new(2);
        let doc: Vec<u64> = (1..=20).collect();
        t.start(0, &h(&doc), Nanos(1));
        t.start(1, &h(&[50, 51]), Nanos(1));
        t.finish(1, Nanos(2));
        // Without a restore the request waits for slot 0, which holds the whole document.
        assert_eq!(t.choose(&h(&doc), 16, 320), SlotChoice { slot: 0, cached_blocks: 20, waits: true });
        // With 18 of its 20 blocks restorable into an idle slot, it takes slot 1 (holding
        // nothing of it yet) and does not wait.
        assert_eq!(
            t.choose_with_restore(&h(&doc), 16, 320, 18),
            SlotChoice { slot: 1, cached_blocks: 0, waits: false }
        );
    }

    #[test]
    fn a_slot_that_holds_what_a_restore_would_give_is_taken_without_one() {
        let mut t = SlotTable::new(2);
        let turn1: Vec<u64> = (1..=20).collect();
        t.start(0, &h(&[70, 71]), Nanos(1));
        t.finish(0, Nanos(2));
        t.start(1, &h(&turn1), Nanos(3));
        t.finish(1, Nanos(4));
        // The next turn: slot 1 holds its first 20 blocks, and so does the saved file. Both
        // idle slots count 20 with the restore; slot 0 is the least recently used, but slot 1
        // needs no restore (and slot 0's prompt is kept).
        let turn2: Vec<u64> = (1..=24).collect();
        assert_eq!(
            t.choose_with_restore(&h(&turn2), 16, 384, 20),
            SlotChoice { slot: 1, cached_blocks: 20, waits: false }
        );
        // A file holding more than the slot: slot 1 still, where a restore (if the mover
        // finds it pays) replaces the conversation's own prompt rather than slot 0's.
        assert_eq!(
            t.choose_with_restore(&h(&turn2), 16, 384, 22),
            SlotChoice { slot: 1, cached_blocks: 20, waits: false }
        );
    }

    #[test]
    fn with_every_slot_busy_the_least_loaded_is_queued_on() {
        let mut t = SlotTable::new(2);
        t.start(0, &h(&[1]), Nanos(1));
        t.start(0, &h(&[2]), Nanos(2));
        t.start(1, &h(&[3]), Nanos(3));
        assert_eq!(t.choose(&h(&[9]), 16, 16), SlotChoice { slot: 1, cached_blocks: 0, waits: true });
        assert_eq!(t.choose(&h(&[2, 5]), 16, 32), SlotChoice { slot: 0, cached_blocks: 1, waits: true });
        assert_eq!(t.busy(), 2);
        t.finish(0, Nanos(4));
        t.finish(0, Nanos(5));
        assert_eq!(t.busy(), 1);
    }

    #[test]
    fn bad_slot_numbers_and_huge_prompts_are_bounded() {
        let mut t = SlotTable::new(0);
        assert_eq!(t.len(), 1);
        t.start(7, &h(&[1]), Nanos(1));
        t.finish(7, Nanos(1));
        assert_eq!(t.busy(), 0);
        let long: Vec<BlockHash> = (0..MAX_SLOT_BLOCKS as u64 + 10).map(BlockHash).collect();
        t.start(0, &long, Nanos(2));
        assert_eq!(t.choose(&long, 16, u32::MAX).cached_blocks, MAX_SLOT_BLOCKS);
        t.clear(0);
        assert_eq!(t.choose(&long, 16, u32::MAX).cached_blocks, 0);
        // The router's own hold (a save) only on an idle slot, and it counts as busy.
        assert!(!t.hold_if_idle(0, Nanos(3)));
        t.finish(0, Nanos(3));
        assert!(t.hold_if_idle(0, Nanos(4)));
        assert_eq!(t.busy(), 1);
        assert!(!t.hold_if_idle(9, Nanos(4)));
        assert_eq!(SlotTable::new(10_000).len(), MAX_SLOTS);
    }
}
