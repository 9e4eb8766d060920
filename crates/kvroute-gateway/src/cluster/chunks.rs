//! Prompt text the cluster has already seen, in chained chunks, so a replica announces a
//! prompt as "the text of chunk chain `base`, then these bytes" instead of sending again the
//! system prompt or document every replica already holds.
//!
//! A text is cut into chunks of [`CHUNK_BYTES`] (less at a character boundary; the last,
//! shorter part is never a chunk). Each chunk is named by a 64-bit hash of its bytes seeded
//! with its parent's name (XXH3), like the chained block hashes of vLLM's and SGLang's prefix
//! caches: equal names mean equal text from the start. Every replica learns the chunks of
//! every prompt it announces or applies, in a store bounded to [`STORE_CHUNKS`] chunks and
//! evicted least recently used first.
//!
//! - [`ChunkStore::encode_at`]: the longest prefix of a text whose chunks the store holds
//!   (each compared byte for byte, so a hash collision cannot pass) and whose text went over
//!   the wire within [`REFRESH_SECS`], then the rest; learns the text. A chunk is referred
//!   to only that long after the cluster last saw its text, so a replica that missed it (one
//!   started without a snapshot, a batch lost while NATS reconnected) is taught a hot prefix
//!   again within that time, where before it never was.
//! - [`ChunkStore::resolve_at`]: rebuilds the text a peer encoded; `None` when a chunk of the
//!   chain is not here (evicted, or its announcement lost or not yet arrived), and the
//!   receiver then applies the event without its prompt (counted by the caller).
//!
//! Pure data: imports nothing of the gateway.

use lru::LruCache;

/// Target bytes per chunk (a chunk ends at the character boundary at or before it).
pub const CHUNK_BYTES: usize = 256;
/// Most chunks held (about 330 bytes each with their index: 5.2 MiB at most).
pub const STORE_CHUNKS: usize = 16_384;
/// Longest chain resolved (128 KiB of text at [`CHUNK_BYTES`], the sync's longest prompt).
pub const MAX_CHAIN: u32 = 512;
/// Seconds a chunk stays referable after its text last went over the wire (sent or
/// received by this replica): a hot prefix is sent in full again about this often.
pub const REFRESH_SECS: u64 = 30;

/// A text as announced: the first `chunks` chunks of chain `base`, then `rest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The name of the last shared chunk (0 when none is shared).
    pub base: u64,
    /// How many chunks the shared prefix has (0 when none).
    pub chunks: u32,
    /// The text after them.
    pub rest: String,
}

#[derive(Debug)]
struct Chunk {
    parent: u64,
    text: Box<str>,
    /// When its text last went over the wire, seconds on the caller's clock.
    announced: u64,
}

/// The chunks learned, by name (see the module docs).
#[derive(Debug)]
pub struct ChunkStore {
    chunks: LruCache<u64, Chunk, foldhash::fast::FixedState>,
    cap: usize,
}

impl Default for ChunkStore {
    fn default() -> Self {
        Self::with_capacity(STORE_CHUNKS)
    }
}

/// The chunks of `text` as (start, end) byte ranges: full chunks only.
fn spans(text: &str) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        let end = text.floor_char_boundary(start + CHUNK_BYTES);
        if start + CHUNK_BYTES > text.len() || end == start {
            return None;
        }
        let s = (start, end);
        start = end;
        Some(s)
    })
}

fn name(parent: u64, chunk: &str) -> u64 {
    // 0 names "no chunk": a chunk whose hash is 0 is renamed, consistently everywhere.
    xxhash_rust::xxh3::xxh3_64_with_seed(chunk.as_bytes(), parent).max(1)
}

impl ChunkStore {
    /// A store holding at most `cap` chunks (at least 1).
    pub fn with_capacity(cap: usize) -> Self {
        ChunkStore { chunks: LruCache::unbounded_with_hasher(foldhash::fast::FixedState::default()), cap: cap.max(1) }
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether no chunk is held.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// [`ChunkStore::encode_at`] at time 0 (tests).
    #[cfg(test)]
    pub fn encode(&mut self, text: &str) -> Encoded {
        self.encode_at(text, 0)
    }

    /// `text` as the longest prefix of chunks this store holds, each announced within
    /// [`REFRESH_SECS`] of `now` (seconds, the caller's clock), and the rest; learns every
    /// chunk of `text`, those of the rest as announced `now`.
    pub fn encode_at(&mut self, text: &str, now: u64) -> Encoded {
        let (mut parent, mut chunks, mut cut) = (0u64, 0u32, 0usize);
        let mut names = Vec::with_capacity(text.len() / CHUNK_BYTES);
        for (s, e) in spans(text) {
            let piece = &text[s..e];
            let h = name(parent, piece);
            let known = names.len() == chunks as usize
                && self.chunks.get(&h).is_some_and(|c| {
                    c.parent == parent && *c.text == *piece && now.saturating_sub(c.announced) < REFRESH_SECS
                });
            if known {
                chunks += 1;
                cut = e;
            } else {
                self.insert(h, parent, piece, now);
            }
            names.push(h);
            parent = h;
        }
        self.promote(&names);
        let base = if chunks == 0 { 0 } else { names[chunks as usize - 1] };
        Encoded { base, chunks, rest: text[cut..].to_string() }
    }

    /// [`ChunkStore::resolve_at`] at time 0 (tests).
    #[cfg(test)]
    pub fn resolve(&mut self, e: &Encoded) -> Option<String> {
        self.resolve_at(e, 0)
    }

    /// The text a peer encoded as `e`, if every chunk of its chain is here; learns it, the
    /// chunks of its rest (sent as text) as announced `now`.
    pub fn resolve_at(&mut self, e: &Encoded, now: u64) -> Option<String> {
        if e.chunks > MAX_CHAIN {
            return None;
        }
        let mut chain: Vec<(u64, &str)> = Vec::with_capacity(e.chunks as usize);
        let mut at = e.base;
        for _ in 0..e.chunks {
            let c = self.chunks.peek(&at)?;
            chain.push((at, &c.text));
            at = c.parent;
        }
        if at != 0 {
            // The chain is longer than announced: not the same prefix.
            return None;
        }
        let mut text = String::with_capacity(chain.iter().map(|(_, p)| p.len()).sum::<usize>() + e.rest.len());
        let mut names: Vec<u64> = Vec::with_capacity(chain.len() + e.rest.len() / CHUNK_BYTES);
        for &(h, p) in chain.iter().rev() {
            text.push_str(p);
            names.push(h);
        }
        let cut = text.len();
        text.push_str(&e.rest);
        // The chain first, so that learning the rest cannot evict it.
        self.promote(&names);
        self.learn_after(e.base, &text[cut..], &mut names, now);
        self.promote(&names);
        Some(text)
    }

    /// [`ChunkStore::learn_at`] at time 0 (tests).
    #[cfg(test)]
    pub fn learn(&mut self, text: &str) {
        self.learn_at(text, 0)
    }

    /// Learns every chunk of `text`, received whole, as announced `now`.
    pub fn learn_at(&mut self, text: &str, now: u64) {
        let mut names = Vec::with_capacity(text.len() / CHUNK_BYTES);
        self.learn_after(0, text, &mut names, now);
        self.promote(&names);
    }

    /// Learns the chunks of `text` as the continuation of chunk `parent` (0: from the start),
    /// announced `now`, appending their names to `names`.
    fn learn_after(&mut self, mut parent: u64, text: &str, names: &mut Vec<u64>, now: u64) {
        for (s, e) in spans(text) {
            let piece = &text[s..e];
            let h = name(parent, piece);
            match self.chunks.get_mut(&h) {
                Some(c) => c.announced = c.announced.max(now),
                None => self.insert(h, parent, piece, now),
            }
            names.push(h);
            parent = h;
        }
    }

    /// Makes a text's chunks (`names`, in text order) the most recently used, its first
    /// chunk last: a chunk is of no use without its parents, so parents outlive children.
    fn promote(&mut self, names: &[u64]) {
        for h in names.iter().rev() {
            self.chunks.promote(h);
        }
    }

    fn insert(&mut self, h: u64, parent: u64, piece: &str, announced: u64) {
        self.chunks.put(h, Chunk { parent, text: piece.into(), announced });
        while self.chunks.len() > self.cap {
            self.chunks.pop_lru();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(seed: usize, bytes: usize) -> String {
        let mut s = String::new();
        let mut i = seed;
        while s.len() < bytes {
            s.push_str(&format!("word{} ", i % 97));
            i = i.wrapping_mul(31).wrapping_add(7);
        }
        s
    }

    #[test]
    fn a_text_sent_again_goes_as_its_chain_and_the_new_tail() {
        let (mut a, mut b) = (ChunkStore::default(), ChunkStore::default());
        let system = doc(1, 4000);
        let first = format!("{system}question one?");
        let e1 = a.encode(&first);
        assert_eq!((e1.chunks, e1.base), (0, 0), "nothing is known yet: the whole text");
        assert_eq!(b.resolve(&e1).as_deref(), Some(first.as_str()));
        let second = format!("{system}question two, a little longer?");
        let e2 = a.encode(&second);
        assert!(e2.chunks >= 15, "the system prompt's chunks are shared: {}", e2.chunks);
        assert!(e2.rest.len() < CHUNK_BYTES + 40, "{}", e2.rest.len());
        assert_eq!(b.resolve(&e2).as_deref(), Some(second.as_str()));
    }

    #[test]
    fn multibyte_text_is_cut_at_character_boundaries() {
        let (mut a, mut b) = (ChunkStore::default(), ChunkStore::default());
        let t = "é漢🦀".repeat(400);
        let e = a.encode(&t);
        assert_eq!(b.resolve(&e).as_deref(), Some(t.as_str()));
        let longer = format!("{t}and more");
        let e = a.encode(&longer);
        assert!(e.chunks > 0);
        assert_eq!(b.resolve(&e).as_deref(), Some(longer.as_str()));
    }

    #[test]
    fn a_chain_the_receiver_lacks_does_not_resolve() {
        let (mut a, mut b) = (ChunkStore::default(), ChunkStore::default());
        let t = doc(2, 3000);
        a.encode(&t);
        let e = a.encode(&format!("{t} again"));
        assert!(e.chunks > 0);
        assert_eq!(b.resolve(&e), None, "b never saw the first text");
        // A forged count (longer or shorter than the chain) does not resolve to another text.
        b.learn(&t);
        assert_eq!(b.resolve(&Encoded { chunks: e.chunks + 1, ..e.clone() }), None);
        assert_eq!(b.resolve(&Encoded { chunks: e.chunks - 1, ..e.clone() }), None);
        assert!(b.resolve(&e).is_some());
    }

    proptest::proptest! {
        /// Replicas' stores (small, so that eviction happens) fed the same prompts in the
        /// same order — documents shared in random pieces, multibyte text, some
        /// announcements lost on the way: whatever a receiver rebuilds is exactly what was
        /// sent.
        #[test]
        fn what_a_receiver_rebuilds_is_what_was_sent(
            cap in 4usize..64,
            prompts in proptest::collection::vec(
                (0usize..4, 0usize..3000, "[a-zé漢 ]{0,300}", proptest::bool::weighted(0.9)), 1..40),
        ) {
            let docs: Vec<String> = (0..4).map(|d| format!("{d}é{}", doc(d, 3000))).collect();
            let (mut a, mut b, mut b_all) =
                (ChunkStore::with_capacity(cap), ChunkStore::with_capacity(cap), ChunkStore::with_capacity(cap));
            for (d, cut, tail, delivered) in prompts {
                let base = &docs[d][..docs[d].floor_char_boundary(cut)];
                let text = format!("{base}{tail}");
                let e = a.encode(&text);
                proptest::prop_assert!(e.rest.len() <= text.len() && text.ends_with(&e.rest));
                // b_all missed nothing, but its store may evict in another order than a's
                // (a sender touches chunks as it reads them, a receiver after): it may
                // fail to rebuild, never rebuild another text.
                if let Some(got) = b_all.resolve(&e) {
                    proptest::prop_assert_eq!(&got, &text);
                }
                if delivered && let Some(got) = b.resolve(&e) {
                    proptest::prop_assert_eq!(got, text);
                }
            }
        }
    }

    #[test]
    fn with_room_for_every_chunk_a_receiver_that_missed_nothing_rebuilds_every_prompt() {
        let (mut a, mut b) = (ChunkStore::default(), ChunkStore::default());
        for i in 0..200 {
            let text = format!("{}{}", doc(i % 5, 2000 + i * 7), doc(1000 + i, 100 + i));
            let e = a.encode(&text);
            assert_eq!(b.resolve(&e).as_deref(), Some(text.as_str()), "prompt {i}");
        }
    }

    #[test]
    fn the_store_keeps_its_bound_and_evicts_the_least_recently_used() {
        let mut s = ChunkStore::with_capacity(64);
        let hot = doc(3, 8 * CHUNK_BYTES);
        for i in 0..200 {
            s.encode(&hot);
            s.encode(&doc(1000 + i, 4 * CHUNK_BYTES));
            assert!(s.len() <= 64);
        }
        let e = s.encode(&format!("{hot}tail"));
        assert!(e.chunks >= 7, "the hot text stays: {}", e.chunks);
    }
}

#[cfg(test)]
mod refresh_tests {
    use super::*;

    /// A replica that missed a prompt's text (started without a snapshot, a lost batch) is
    /// taught it again: past [`REFRESH_SECS`] the sender names no chunk it has not sent
    /// since, and the receiver rebuilds the prompt from the text.
    #[test]
    fn a_chunk_not_announced_for_refresh_secs_is_sent_as_text_again() {
        let text = "a shared system prompt about routing. ".repeat(40);
        let (mut a, mut late) = (ChunkStore::default(), ChunkStore::default());
        a.encode_at(&text, 100);
        let again = format!("{text} next question");
        let e = a.encode_at(&again, 100 + REFRESH_SECS - 1);
        assert!(e.chunks > 0, "within the refresh, a reference");
        assert_eq!(late.resolve_at(&e, 100 + REFRESH_SECS - 1), None, "the late replica lacks the chain");
        let e = a.encode_at(&again, 100 + REFRESH_SECS);
        assert_eq!(e.chunks, 0, "past the refresh, the text");
        assert_eq!(late.resolve_at(&e, 100 + REFRESH_SECS).as_deref(), Some(again.as_str()));
        // Sent again, the chunks are fresh: the next prompt refers to them, and the late
        // replica now resolves it.
        let third = format!("{text} a third question");
        let e = a.encode_at(&third, 100 + REFRESH_SECS + 1);
        assert!(e.chunks > 0);
        assert_eq!(late.resolve_at(&e, 100 + REFRESH_SECS + 1).as_deref(), Some(third.as_str()));
    }
}
