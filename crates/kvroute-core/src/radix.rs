//! Approximate multi-tenant radix tree (SGLang router, seed 003; Ray Serve prefix tree,
//! seed 000).
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
use std::fmt::Debug;
use std::hash::Hash;

/// A key element: `u8` (text bytes), `u32` (token ids) or `u64` (block hashes).
pub trait Symbol: Copy + Eq + Hash + Ord + Debug + Send + Sync + 'static {}
impl Symbol for u8 {}
impl Symbol for u32 {}
impl Symbol for u64 {}

/// A set of worker ids as a bitset (candidates allowed in a match).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantSet {
    bits: SmallVec<[u64; 4]>,
}

impl TenantSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
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
    /// Whether `id` is in the set.
    pub fn contains(&self, id: WorkerId) -> bool {
        let (w, b) = (id.index() / 64, id.index() % 64);
        self.bits.get(w).is_some_and(|x| x & (1 << b) != 0)
    }
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

/// An approximate multi-tenant radix tree over symbols `S`.
#[derive(Debug)]
pub struct RadixTree<S: Symbol> {
    _todo: std::marker::PhantomData<S>,
}

impl<S: Symbol> Default for RadixTree<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Symbol> RadixTree<S> {
    /// An empty tree.
    pub fn new() -> Self {
        RadixTree { _todo: std::marker::PhantomData }
    }

    /// Records that `tenant` holds `key` as of `now` (every node on the path gets `tenant`
    /// with last-use `now`). O(len(key)).
    pub fn insert(&mut self, key: &[S], tenant: WorkerId, now: Nanos) {
        let _ = (key, tenant, now);
        todo!()
    }

    /// The deepest prefix of `key` held by any tenant in `allowed` (all tenants when
    /// `None`), and all allowed tenants holding it. Read-only. O(len(key) + tenants at the
    /// deepest node).
    pub fn prefix_match(&self, key: &[S], allowed: Option<&TenantSet>) -> PrefixMatch {
        let _ = (key, allowed);
        todo!()
    }

    /// Symbols held by `tenant` (the sum of the lengths of the edges it is on).
    pub fn tenant_size(&self, tenant: WorkerId) -> usize {
        let _ = tenant;
        todo!()
    }

    /// Symbols physically stored in the tree (each edge counted once). This is what the
    /// eviction budget bounds.
    pub fn total_size(&self) -> usize {
        todo!()
    }

    /// Nodes in the tree (root excluded).
    pub fn node_count(&self) -> usize {
        todo!()
    }

    /// Evicts least-recently-used (tenant, leaf) pairs until [`RadixTree::total_size`] is
    /// at most `budget_symbols`. A node left with no tenant is deleted, and its parent may
    /// become a leaf in turn. Returns the number of symbols freed.
    pub fn evict_to(&mut self, budget_symbols: usize) -> usize {
        let _ = budget_symbols;
        todo!()
    }

    /// Removes `tenant` from every node, deleting nodes left with no tenant.
    pub fn remove_tenant(&mut self, tenant: WorkerId) {
        let _ = tenant;
        todo!()
    }
}
