//! Approximate multi-tenant radix tree (SGLang router cache_aware; Ray Serve
//! PrefixCacheAffinityRouter's prefix tree).
//!
//! One tree per model holds the prefixes the router has sent to each worker ("tenant").
//! Keys are sequences of [`Symbol`]s: UTF-8 bytes of routing text (`u8`), token ids
//! (`u32`) or block hashes (`u64`). Every node records, per tenant, when that tenant last
//! used it. The router never asks the engines: the tree is its own approximate view of
//! their prefix caches.
//!
//! Memory is bounded by a *global* budget in symbols per tree (not per tenant: a
//! per-tenant budget lets memory grow with the worker count, a known failure of SGLang's
//! router). [`RadixTree::evict_to`] removes least-recently-used (tenant, leaf) pairs until
//! the symbols stored fall to the budget.

use crate::types::{Nanos, WorkerId};
use smallvec::SmallVec;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Debug;
use std::hash::Hash;

/// A key element: `u8` (text bytes), `u32` (token ids), `u64` or [`crate::types::BlockHash`]
/// (block hashes).
pub trait Symbol: Copy + Eq + Hash + Ord + Debug + Send + Sync + 'static {}
impl Symbol for u8 {}
impl Symbol for u32 {}
impl Symbol for u64 {}
impl Symbol for crate::types::BlockHash {}

/// A set of worker ids as a bitset (candidates allowed in a match). Two sets are equal when
/// they hold the same ids, however many words each has grown.
#[derive(Debug, Clone, Default)]
pub struct TenantSet {
    bits: SmallVec<[u64; 4]>,
}

impl PartialEq for TenantSet {
    fn eq(&self, other: &Self) -> bool {
        let word = |s: &TenantSet, i: usize| s.bits.get(i).copied().unwrap_or(0);
        (0..self.bits.len().max(other.bits.len())).all(|i| word(self, i) == word(other, i))
    }
}

impl Eq for TenantSet {}

impl TenantSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }
    /// An empty set with room for ids below `n` without growing.
    pub fn with_capacity(n: usize) -> Self {
        Self { bits: SmallVec::with_capacity(n.div_ceil(64)) }
    }
    /// The set of `ids`.
    pub fn from_ids(ids: impl IntoIterator<Item = WorkerId>) -> Self {
        let mut s = Self::new();
        for id in ids {
            s.insert(id);
        }
        s
    }
    /// Adds `id`.
    pub fn insert(&mut self, id: WorkerId) {
        let (w, b) = (id.index() / 64, id.index() % 64);
        if self.bits.len() <= w {
            self.bits.resize(w + 1, 0);
        }
        self.bits[w] |= 1 << b;
    }
    /// Adds the ids `64 × word + b` for every bit `b` set in `bits`.
    pub fn insert_word(&mut self, word: usize, bits: u64) {
        if self.bits.len() <= word {
            self.bits.resize(word + 1, 0);
        }
        self.bits[word] |= bits;
    }
    /// Removes `id` (nothing when it is not in the set).
    pub fn remove(&mut self, id: WorkerId) {
        let (w, b) = (id.index() / 64, id.index() % 64);
        if let Some(x) = self.bits.get_mut(w) {
            *x &= !(1 << b);
        }
    }
    /// Whether `id` is in the set.
    pub fn contains(&self, id: WorkerId) -> bool {
        let (w, b) = (id.index() / 64, id.index() % 64);
        self.bits.get(w).is_some_and(|x| x & (1 << b) != 0)
    }
    /// The ids in `self` and not in `other`, ascending. O(ids / 64 + answers).
    pub fn difference<'a>(&'a self, other: &'a TenantSet) -> impl Iterator<Item = WorkerId> + 'a {
        ids_of_words(self.bits.iter().enumerate().map(move |(w, &x)| (w, x & !other.bits.get(w).copied().unwrap_or(0))))
    }
    /// How many ids are in `self` and not in `other`. O(ids / 64).
    pub fn difference_len(&self, other: &TenantSet) -> usize {
        let word = |w: usize| other.bits.get(w).copied().unwrap_or(0);
        self.bits.iter().enumerate().map(|(w, &x)| (x & !word(w)).count_ones() as usize).sum()
    }
    /// The ids in the set, ascending. O(ids / 64 + answers).
    pub fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        ids_of_words(self.bits.iter().copied().enumerate())
    }
}

/// The ids of the bits set in `(word index, word)` pairs, in their order.
fn ids_of_words(words: impl Iterator<Item = (usize, u64)>) -> impl Iterator<Item = WorkerId> {
    words.flat_map(|(w, mut left)| {
        std::iter::from_fn(move || {
            (left != 0).then(|| {
                let b = left.trailing_zeros() as usize;
                left &= left - 1;
                WorkerId((w * 64 + b).min(u32::MAX as usize) as u32)
            })
        })
    })
}

/// Result of [`RadixTree::prefix_match`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Length of the deepest match, in symbols (0 when nothing matched). Never exceeds the
    /// key length.
    pub matched: usize,
    /// *All* allowed tenants holding the deepest match, sorted by id (empty when
    /// `matched == 0`).
    pub tenants: SmallVec<[WorkerId; 8]>,
}

impl PrefixMatch {
    /// Whether `id` holds the deepest match. O(log tenants): a prefix every worker holds
    /// (a system prompt) lists the whole fleet, and a linear search per candidate would make
    /// a decision quadratic in the fleet.
    pub fn holds(&self, id: WorkerId) -> bool {
        self.tenants.binary_search(&id).is_ok()
    }
}

/// Children of a node, keyed by the first symbol of the child's edge: a small inline list
/// (linear scan, cache friendly) that turns into a hash map past [`CHILDREN_MAP_AT`].
#[derive(Debug, Clone)]
enum Children<S: Symbol> {
    Small(SmallVec<[(S, u32); 4]>),
    Map(HashMap<S, u32, foldhash::fast::FixedState>),
}

/// Number of children at which a node switches from a list to a hash map.
const CHILDREN_MAP_AT: usize = 16;

impl<S: Symbol> Children<S> {
    fn get(&self, s: S) -> Option<u32> {
        match self {
            Children::Small(v) => v.iter().find(|(k, _)| *k == s).map(|(_, c)| *c),
            Children::Map(m) => m.get(&s).copied(),
        }
    }
    fn set(&mut self, s: S, child: u32) {
        match self {
            Children::Small(v) => {
                if let Some(e) = v.iter_mut().find(|(k, _)| *k == s) {
                    e.1 = child;
                } else if v.len() + 1 >= CHILDREN_MAP_AT {
                    let mut m: HashMap<S, u32, _> = v.drain(..).collect();
                    m.insert(s, child);
                    *self = Children::Map(m);
                } else {
                    v.push((s, child));
                }
            }
            Children::Map(m) => {
                m.insert(s, child);
            }
        }
    }
    fn remove(&mut self, s: S) {
        match self {
            Children::Small(v) => v.retain(|(k, _)| *k != s),
            Children::Map(m) => {
                m.remove(&s);
            }
        }
    }
    fn len(&self) -> usize {
        match self {
            Children::Small(v) => v.len(),
            Children::Map(m) => m.len(),
        }
    }
    fn ids(&self) -> SmallVec<[u32; 8]> {
        match self {
            Children::Small(v) => v.iter().map(|(_, c)| *c).collect(),
            Children::Map(m) => m.values().copied().collect(),
        }
    }
}

/// One node: the edge from its parent, its children, and the tenants holding it with
/// their last-use time (sorted by tenant id).
#[derive(Debug, Clone)]
struct Node<S: Symbol> {
    edge: Vec<S>,
    parent: u32,
    children: Children<S>,
    tenants: SmallVec<[(WorkerId, Nanos); 4]>,
    live: bool,
}

impl<S: Symbol> Node<S> {
    fn new(edge: Vec<S>, parent: u32) -> Self {
        Node { edge, parent, children: Children::Small(SmallVec::new()), tenants: SmallVec::new(), live: true }
    }
    fn tenant_pos(&self, t: WorkerId) -> Result<usize, usize> {
        self.tenants.binary_search_by_key(&t, |(id, _)| *id)
    }
    fn has_tenant(&self, t: WorkerId) -> bool {
        self.tenant_pos(t).is_ok()
    }
}

const ROOT: u32 = 0;

/// Length of the longest common prefix of `a` and `b`. Compares 32-symbol chunks with
/// slice equality (a `memcmp` for integer symbols) before finishing symbol by symbol, so
/// long shared prompts are compared at memory speed.
#[inline]
fn common_prefix<S: Symbol>(a: &[S], b: &[S]) -> usize {
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// An approximate multi-tenant radix tree over symbols `S`.
///
/// Nodes live in an arena (`Vec`, `u32` indices, free list), so eviction never chases
/// pointers and the tree needs no `unsafe`. Invariants (checked by
/// [`RadixTree::check_invariants`] in tests):
/// - every non-root node has at least one tenant (no empty nodes);
/// - a child's tenants are a subset of its parent's (insert touches the whole path), and a
///   tenant's last use on a node is at least its last use on any descendant;
/// - `total_size` is the sum of all edge lengths; `tenant_size(t)` is the sum of the edge
///   lengths of the nodes `t` holds.
#[derive(Debug, Clone)]
pub struct RadixTree<S: Symbol> {
    nodes: Vec<Node<S>>,
    free: Vec<u32>,
    total: usize,
    node_count: usize,
    tenant_sizes: Vec<usize>,
    /// The eviction order of a pass in progress: (last use, node, tenant) of (tenant, leaf)
    /// pairs, oldest first, kept between [`RadixTree::evict_toward`] slices so a pass scans
    /// the tree once, not once per slice. Entries are re-checked when popped (still a leaf
    /// for that tenant, last use unchanged); emptied when the tree is within budget.
    evict_queue: BinaryHeap<Reverse<(Nanos, u32, WorkerId)>>,
}

impl<S: Symbol> Default for RadixTree<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Symbol> RadixTree<S> {
    /// An empty tree.
    pub fn new() -> Self {
        RadixTree {
            nodes: vec![Node::new(Vec::new(), ROOT)],
            free: Vec::new(),
            total: 0,
            node_count: 0,
            tenant_sizes: Vec::new(),
            evict_queue: BinaryHeap::new(),
        }
    }

    fn alloc(&mut self, node: Node<S>) -> u32 {
        self.node_count += 1;
        if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn add_tenant_size(&mut self, t: WorkerId, delta: usize) {
        if self.tenant_sizes.len() <= t.index() {
            self.tenant_sizes.resize(t.index() + 1, 0);
        }
        self.tenant_sizes[t.index()] += delta;
    }

    fn sub_tenant_size(&mut self, t: WorkerId, delta: usize) {
        if let Some(s) = self.tenant_sizes.get_mut(t.index()) {
            *s = s.saturating_sub(delta);
        }
    }

    /// Adds or refreshes `t` on node `n`.
    fn touch(&mut self, n: u32, t: WorkerId, now: Nanos) {
        let node = &mut self.nodes[n as usize];
        match node.tenant_pos(t) {
            Ok(p) => node.tenants[p].1 = now.max(node.tenants[p].1),
            Err(p) => {
                node.tenants.insert(p, (t, now));
                let len = node.edge.len();
                self.add_tenant_size(t, len);
            }
        }
    }

    /// Records that `tenant` holds `key` as of `now` (every node on the path gets `tenant`
    /// with last-use `now`). O(len(key)).
    pub fn insert(&mut self, key: &[S], tenant: WorkerId, now: Nanos) {
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let s = key[pos];
            let Some(c) = self.nodes[node as usize].children.get(s) else {
                let leaf = self.alloc(Node::new(key[pos..].to_vec(), node));
                self.nodes[node as usize].children.set(s, leaf);
                self.total += key.len() - pos;
                self.touch(leaf, tenant, now);
                return;
            };
            let common = common_prefix(&self.nodes[c as usize].edge, &key[pos..]);
            let c = if common < self.nodes[c as usize].edge.len() { self.split(c, common) } else { c };
            self.touch(c, tenant, now);
            node = c;
            pos += common;
        }
    }

    /// Splits node `c` after `at` symbols of its edge: a new node takes the first `at`
    /// symbols and `c`'s tenants, and becomes `c`'s parent. Sizes are unchanged. Returns
    /// the new node.
    fn split(&mut self, c: u32, at: usize) -> u32 {
        let (parent, head, tail_first, tenants) = {
            let cn = &mut self.nodes[c as usize];
            let tail = cn.edge.split_off(at);
            let head = std::mem::replace(&mut cn.edge, tail);
            (cn.parent, head, cn.edge[0], cn.tenants.clone())
        };
        let first = head[0];
        let mut mid = Node::new(head, parent);
        mid.tenants = tenants;
        mid.children.set(tail_first, c);
        let m = self.alloc(mid);
        self.nodes[c as usize].parent = m;
        self.nodes[parent as usize].children.set(first, m);
        m
    }

    /// The deepest prefix of `key` held by any tenant in `allowed` (all tenants when
    /// `None`), and all allowed tenants holding it. Read-only. O(len(key) + tenants at the
    /// deepest node).
    pub fn prefix_match(&self, key: &[S], allowed: Option<&TenantSet>) -> PrefixMatch {
        let ok = |t: WorkerId| allowed.is_none_or(|a| a.contains(t));
        let mut node = ROOT;
        let mut pos = 0;
        let mut best: Option<(u32, usize)> = None;
        while pos < key.len() {
            let Some(c) = self.nodes[node as usize].children.get(key[pos]) else { break };
            let cn = &self.nodes[c as usize];
            // Descendants hold a subset of this node's tenants: none allowed here means
            // none allowed deeper.
            if !cn.tenants.iter().any(|(t, _)| ok(*t)) {
                break;
            }
            let common = common_prefix(&cn.edge, &key[pos..]);
            best = Some((c, pos + common));
            if common < cn.edge.len() {
                break;
            }
            pos += common;
            node = c;
        }
        match best {
            None => PrefixMatch::default(),
            Some((n, matched)) => PrefixMatch {
                matched,
                tenants: self.nodes[n as usize].tenants.iter().map(|(t, _)| *t).filter(|t| ok(*t)).collect(),
            },
        }
    }

    /// Symbols held by `tenant` (the sum of the lengths of the edges it is on). O(1).
    pub fn tenant_size(&self, tenant: WorkerId) -> usize {
        self.tenant_sizes.get(tenant.index()).copied().unwrap_or(0)
    }

    /// Symbols physically stored in the tree (each edge counted once). This is what the
    /// eviction budget bounds. O(1).
    pub fn total_size(&self) -> usize {
        self.total
    }

    /// Nodes in the tree (root excluded). O(1).
    pub fn node_count(&self) -> usize {
        self.node_count
    }

    /// Whether `t` holds node `n` with no child holding it.
    fn is_leaf_for(&self, n: u32, t: WorkerId) -> bool {
        let node = &self.nodes[n as usize];
        node.live
            && n != ROOT
            && node.has_tenant(t)
            && node.children.ids().iter().all(|&c| !self.nodes[c as usize].has_tenant(t))
    }

    /// Removes `t` from node `n` (which must be a leaf for `t`), deleting the node when no
    /// tenant is left. Returns the symbols physically freed.
    fn drop_tenant_at(&mut self, n: u32, t: WorkerId) -> usize {
        let len = self.nodes[n as usize].edge.len();
        if let Ok(p) = self.nodes[n as usize].tenant_pos(t) {
            self.nodes[n as usize].tenants.remove(p);
            self.sub_tenant_size(t, len);
        }
        if self.nodes[n as usize].tenants.is_empty() && self.nodes[n as usize].children.len() == 0 {
            self.delete(n);
            len
        } else {
            0
        }
    }

    /// Unlinks and frees an empty node with no children.
    fn delete(&mut self, n: u32) {
        let (parent, first) = {
            let node = &self.nodes[n as usize];
            (node.parent, node.edge[0])
        };
        self.nodes[parent as usize].children.remove(first);
        self.total -= self.nodes[n as usize].edge.len();
        self.node_count -= 1;
        self.nodes[n as usize] = Node { live: false, ..Node::new(Vec::new(), ROOT) };
        self.free.push(n);
    }

    /// Evicts least-recently-used (tenant, leaf) pairs until [`RadixTree::total_size`] is
    /// at most `budget_symbols`. A node left with no tenant is deleted, and its parent may
    /// become a leaf in turn. Returns the number of symbols freed.
    ///
    /// O(n + e·log n) for n nodes and e evicted pairs: one scan collects every
    /// (tenant, leaf) pair into a min-heap by last use; a pair whose eviction exposes the
    /// parent as the tenant's new leaf pushes that parent.
    pub fn evict_to(&mut self, budget_symbols: usize) -> usize {
        self.evict_toward(budget_symbols, usize::MAX)
    }

    /// [`RadixTree::evict_to`] in a bounded slice: evicts at most `max_pairs` (tenant, leaf)
    /// pairs, so a caller holding a lock can release it between slices. Returns the symbols
    /// freed; the tree may still be over budget afterwards. The pass's eviction order is
    /// kept between slices (one O(n) scan per pass, not per slice); a pair used or split
    /// since is skipped, and the order is rebuilt once when it runs out.
    pub fn evict_toward(&mut self, budget_symbols: usize, max_pairs: usize) -> usize {
        self.evict_toward_noting(budget_symbols, max_pairs, |_| {})
    }

    /// [`RadixTree::evict_toward`], calling `shrunk(t)` for every tenant `t` a pair is
    /// evicted from (once per pair, so a tenant may come more than once), for a caller that
    /// keeps something derived from [`RadixTree::tenant_size`].
    pub fn evict_toward_noting(
        &mut self,
        budget_symbols: usize,
        max_pairs: usize,
        mut shrunk: impl FnMut(WorkerId),
    ) -> usize {
        if self.total <= budget_symbols {
            return 0;
        }
        if max_pairs == 0 {
            return 0;
        }
        let mut heap = std::mem::take(&mut self.evict_queue);
        let mut rescanned = false;
        let mut freed = 0;
        let mut evicted = 0;
        while self.total > budget_symbols && evicted < max_pairs {
            let Some(Reverse((at, n, t))) = heap.pop() else {
                if rescanned {
                    break;
                }
                // A new pass, or the previous slices' order ran out (pairs touched or
                // split since): one scan collects every (tenant, leaf) pair.
                self.collect_leaves(&mut heap);
                rescanned = true;
                continue;
            };
            // Stale: already evicted, no longer a leaf for `t` (split, or a child added),
            // or used since the order was taken (then it is newer than everything left).
            let current = self
                .nodes
                .get(n as usize)
                .filter(|x| x.live)
                .and_then(|x| x.tenant_pos(t).ok().map(|p| x.tenants[p].1));
            if current != Some(at) || !self.is_leaf_for(n, t) {
                continue;
            }
            evicted += 1;
            let parent = self.nodes[n as usize].parent;
            freed += self.drop_tenant_at(n, t);
            shrunk(t);
            if parent != ROOT
                && self.is_leaf_for(parent, t)
                && let Ok(p) = self.nodes[parent as usize].tenant_pos(t)
            {
                heap.push(Reverse((self.nodes[parent as usize].tenants[p].1, parent, t)));
            }
        }
        // Kept even when the budget is met: a tree held at its budget by evictions on
        // insert then pops a few pairs per insert instead of scanning every leaf each time.
        self.evict_queue = heap;
        freed
    }

    /// Pushes every live (tenant, leaf) pair with its last use. O(n log n).
    fn collect_leaves(&self, heap: &mut BinaryHeap<Reverse<(Nanos, u32, WorkerId)>>) {
        heap.clear();
        for n in 1..self.nodes.len() as u32 {
            if !self.nodes[n as usize].live {
                continue;
            }
            for &(t, at) in &self.nodes[n as usize].tenants {
                if self.is_leaf_for(n, t) {
                    heap.push(Reverse((at, n, t)));
                }
            }
        }
    }

    /// Removes `tenant` from every node, deleting nodes left with no tenant. O(n).
    pub fn remove_tenant(&mut self, tenant: WorkerId) {
        // Children hold a subset of their parent's tenants, so visiting nodes deepest
        // first lets each emptied node be deleted once its children are gone.
        let mut order: Vec<u32> = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            order.push(n);
            for c in self.nodes[n as usize].children.ids() {
                if self.nodes[c as usize].has_tenant(tenant) {
                    stack.push(c);
                }
            }
        }
        for &n in order.iter().rev() {
            if n != ROOT {
                self.drop_tenant_at(n, tenant);
            }
        }
        if let Some(s) = self.tenant_sizes.get_mut(tenant.index()) {
            *s = 0;
        }
    }

    /// Verifies the structural invariants; for tests. O(n).
    ///
    /// # Errors
    /// A description of the first violated invariant.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut total = 0;
        let mut count = 0;
        let mut sizes: Vec<usize> = vec![0; self.tenant_sizes.len()];
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            let node = &self.nodes[n as usize];
            if !node.live {
                return Err(format!("node {n} is reachable but freed"));
            }
            if n != ROOT {
                count += 1;
                total += node.edge.len();
                if node.edge.is_empty() {
                    return Err(format!("node {n} has an empty edge"));
                }
                if node.tenants.is_empty() {
                    return Err(format!("node {n} has no tenant"));
                }
                if !node.tenants.windows(2).all(|w| w[0].0 < w[1].0) {
                    return Err(format!("node {n} tenants unsorted"));
                }
                for &(t, _) in &node.tenants {
                    if sizes.len() <= t.index() {
                        return Err(format!("tenant {t} has no size slot"));
                    }
                    sizes[t.index()] += node.edge.len();
                }
            }
            for c in node.children.ids() {
                let cn = &self.nodes[c as usize];
                if cn.parent != n {
                    return Err(format!("node {c} parent link is {} not {n}", cn.parent));
                }
                if node.children.get(cn.edge[0]) != Some(c) {
                    return Err(format!("node {c} is not keyed by its first symbol"));
                }
                if n != ROOT {
                    for &(t, at) in &cn.tenants {
                        match node.tenant_pos(t) {
                            Ok(p) if node.tenants[p].1 >= at => {}
                            Ok(_) => return Err(format!("tenant {t} newer on child {c} than on parent {n}")),
                            Err(_) => return Err(format!("tenant {t} on child {c} but not on parent {n}")),
                        }
                    }
                }
                stack.push(c);
            }
        }
        if total != self.total {
            return Err(format!("total {} != recount {total}", self.total));
        }
        if count != self.node_count {
            return Err(format!("node_count {} != recount {count}", self.node_count));
        }
        if sizes != self.tenant_sizes {
            return Err(format!("tenant sizes {:?} != recount {sizes:?}", self.tenant_sizes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerId = WorkerId(0);
    const B: WorkerId = WorkerId(1);
    const C: WorkerId = WorkerId(2);

    fn t(s: u64) -> Nanos {
        Nanos::from_secs(s)
    }

    #[test]
    fn split_and_deepest_match_returns_all_holders() {
        let mut tree = RadixTree::<u8>::new();
        tree.insert(b"hello world", A, t(1));
        tree.insert(b"hello there", B, t(2));
        tree.insert(b"hello world, again", C, t(3));
        tree.check_invariants().unwrap();
        assert_eq!(tree.total_size(), "hello world, again".len() + "there".len());
        let m = tree.prefix_match(b"hello world!", None);
        assert_eq!(m.matched, 11);
        assert_eq!(m.tenants.as_slice(), &[A, C]);
        let m = tree.prefix_match(b"hello", None);
        assert_eq!((m.matched, m.tenants.as_slice()), (5, &[A, B, C][..]));
        let m = tree.prefix_match(b"help", None);
        assert_eq!((m.matched, m.tenants.as_slice()), (3, &[A, B, C][..]));
        assert_eq!(tree.prefix_match(b"xyz", None), PrefixMatch::default());
        assert_eq!(tree.tenant_size(A), 11);
        assert_eq!(tree.tenant_size(B), 11);
        assert_eq!(tree.tenant_size(C), 18);
    }

    /// 40 distinct keys over three tenants, last use = insertion order.
    fn forty_keys() -> RadixTree<u8> {
        let mut tree = RadixTree::<u8>::new();
        for i in 0..40u64 {
            let key = format!("prefix-{}-{i:03}-tail", i % 4);
            tree.insert(key.as_bytes(), [A, B, C][(i % 3) as usize], t(i + 1));
        }
        tree
    }

    #[test]
    fn sliced_eviction_evicts_what_one_pass_evicts() {
        let mut whole = forty_keys();
        let budget = whole.total_size() / 3;
        whole.evict_to(budget);
        let mut sliced = forty_keys();
        let mut slices = 0;
        while sliced.total_size() > budget {
            sliced.evict_toward(budget, 2);
            sliced.check_invariants().unwrap();
            slices += 1;
            assert!(slices < 100, "sliced eviction made no progress");
        }
        assert!(slices > 1);
        assert_eq!(sliced.total_size(), whole.total_size());
        for i in 0..40u64 {
            let key = format!("prefix-{}-{i:03}-tail", i % 4);
            assert_eq!(sliced.prefix_match(key.as_bytes(), None), whole.prefix_match(key.as_bytes(), None), "{key}");
        }
        // The order is kept once within budget: a tree held there by evictions on insert
        // pops the next oldest pairs, and a key inserted since (newer than all of them)
        // stays.
        assert!(!sliced.evict_queue.is_empty(), "the pass's order was dropped");
        sliced.insert(b"fresh-key", A, t(200));
        while sliced.total_size() > budget {
            sliced.evict_toward(budget, 1);
            sliced.check_invariants().unwrap();
        }
        assert_eq!(sliced.prefix_match(b"fresh-key", None).matched, "fresh-key".len());
        whole.insert(b"fresh-key", A, t(200));
        whole.evict_to(budget);
        for i in 0..40u64 {
            let key = format!("prefix-{}-{i:03}-tail", i % 4);
            assert_eq!(sliced.prefix_match(key.as_bytes(), None), whole.prefix_match(key.as_bytes(), None), "{key}");
        }
    }

    #[test]
    fn a_key_used_between_slices_outlives_the_older_ones() {
        let mut tree = forty_keys();
        let budget = tree.total_size() / 2;
        tree.evict_toward(budget, 1); // evicts key 000, keeps the pass's order
        tree.insert(b"prefix-1-001-tail", B, t(100)); // the next oldest, used again
        while tree.total_size() > budget {
            tree.evict_toward(budget, 1);
            tree.check_invariants().unwrap();
        }
        assert_eq!(tree.prefix_match(b"prefix-1-001-tail", None).matched, "prefix-1-001-tail".len());
        assert!(tree.prefix_match(b"prefix-2-002-tail", None).matched < "prefix-2-002-tail".len());
    }

    #[test]
    fn tenant_sets_list_their_ids_in_order_across_words() {
        let ids = [0, 3, 63, 64, 130, 1000].map(WorkerId);
        let mut set = TenantSet::new();
        for &id in ids.iter().rev() {
            set.insert(id);
        }
        set.insert_word(2, 1 << 5); // 133
        assert_eq!(set.iter().map(|w| w.0).collect::<Vec<_>>(), [0, 3, 63, 64, 130, 133, 1000]);
        set.remove(WorkerId(64));
        set.remove(WorkerId(5000)); // not in it: nothing happens
        let other = TenantSet::from_ids([WorkerId(3), WorkerId(1000), WorkerId(2000)]);
        assert_eq!(set.difference(&other).map(|w| w.0).collect::<Vec<_>>(), [0, 63, 130, 133]);
        assert_eq!(set.difference_len(&other), 4);
        assert_eq!(other.difference_len(&set), 1);
        assert_eq!(other.difference(&set).map(|w| w.0).collect::<Vec<_>>(), [2000]);
    }

    #[test]
    fn allowed_set_filters_tenants_and_depth() {
        let mut tree = RadixTree::<u8>::new();
        tree.insert(b"abcdef", A, t(1));
        tree.insert(b"abc", B, t(1));
        let only_b = TenantSet::from_ids([B]);
        let m = tree.prefix_match(b"abcdef", Some(&only_b));
        assert_eq!((m.matched, m.tenants.as_slice()), (3, &[B][..]));
        let none = TenantSet::from_ids([C]);
        assert_eq!(tree.prefix_match(b"abcdef", Some(&none)).matched, 0);
    }

    #[test]
    fn eviction_is_lru_by_tenant_leaf_and_respects_budget() {
        let mut tree = RadixTree::<u8>::new();
        tree.insert(b"aaaa1111", A, t(1)); // oldest
        tree.insert(b"aaaa2222", B, t(2));
        tree.insert(b"bbbb", C, t(3));
        assert_eq!(tree.total_size(), 4 + 4 + 4 + 4);
        // Budget 12: evicting A's leaf "1111" (oldest) frees 4 symbols.
        let freed = tree.evict_to(12);
        tree.check_invariants().unwrap();
        assert_eq!(freed, 4);
        // A still holds the shared "aaaa": the deepest match of A's old prompt is there.
        let m = tree.prefix_match(b"aaaa1111", None);
        assert_eq!((m.matched, m.tenants.as_slice()), (4, &[A, B][..]));
        // Next oldest pair is A on "aaaa": removing it frees nothing (B still holds the
        // node), so B's leaf "2222" goes next and frees 4.
        let freed = tree.evict_to(8);
        tree.check_invariants().unwrap();
        assert_eq!(freed, 4);
        assert_eq!(tree.total_size(), 8);
        let m = tree.prefix_match(b"aaaa2222", None);
        assert_eq!((m.matched, m.tenants.as_slice()), (4, &[B][..]));
        assert_eq!(tree.prefix_match(b"bbbb", None).tenants.as_slice(), &[C]);
        tree.evict_to(0);
        tree.check_invariants().unwrap();
        assert_eq!((tree.total_size(), tree.node_count()), (0, 0));
    }

    #[test]
    fn remove_tenant_leaves_no_trace() {
        let mut tree = RadixTree::<u32>::new();
        tree.insert(&[1, 2, 3, 4], A, t(1));
        tree.insert(&[1, 2, 9], B, t(1));
        tree.remove_tenant(A);
        tree.check_invariants().unwrap();
        assert_eq!(tree.tenant_size(A), 0);
        assert_eq!(tree.total_size(), 3);
        let m = tree.prefix_match(&[1, 2, 3, 4], None);
        assert_eq!((m.matched, m.tenants.as_slice()), (2, &[B][..]));
    }

    #[test]
    fn many_children_switch_to_a_map() {
        let mut tree = RadixTree::<u64>::new();
        for i in 0..100u64 {
            tree.insert(&[7, i, i + 1], WorkerId((i % 3) as u32), t(i));
        }
        tree.check_invariants().unwrap();
        for i in 0..100u64 {
            assert_eq!(tree.prefix_match(&[7, i, i + 1, 5], None).matched, 3);
        }
    }

    #[test]
    fn long_keys_compare_in_chunks() {
        let a: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let mut b = a.clone();
        b[777] ^= 1;
        let mut tree = RadixTree::<u8>::new();
        tree.insert(&a, A, t(1));
        assert_eq!(tree.prefix_match(&b, None).matched, 777);
        assert_eq!(tree.prefix_match(&a[..500], None).matched, 500);
    }
}
