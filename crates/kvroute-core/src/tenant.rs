//! Tenant isolation of prefix state: a per-tenant salt on every routing key.
//!
//! Prefix caching is a side channel. Whoever can tell that a prefix is cached — from a
//! match count, the worker a request lands on, or its TTFT — learns something about other
//! clients' prompts (the prompt-caching timing attacks of Gu et al., "Auditing Prompt
//! Caching in Language Model APIs", 2025). So a router shared by several tenants keys its
//! prefix state per tenant: each key is prefixed by the tenant's [`TenantSalt`], so one
//! tenant's prompts neither attract another's requests nor answer another's probes.
//! Tenants that trust each other can share one salt (a group).
//!
//! The salt goes in front of the key the policies already read, so every policy and index
//! (text radix trees, token trees, block hashes, session tables) is isolated the same way
//! without knowing about tenants:
//!
//! ```text
//! text     "\u{1}" + 16 hex digits of the salt + "\u{1}" + text        (18 extra bytes)
//! tokens   [SALT_TOKEN, salt low 32 bits, salt high 32 bits] + tokens   (3 extra ids)
//! blocks   h'[i] = xxh3(h[i] as little-endian bytes, seed = salt)       (same length)
//! session  16 hex digits + ":" + session id
//! ```
//!
//! The requester's own salt is always put first, so a client cannot forge another tenant's
//! key by sending a prompt that starts with that tenant's marker: its key then starts with
//! its own marker. The salt is a public function of the tenant's name (the same on every
//! replica and across restarts, so cluster sync and engine caches keep working); it is not
//! a secret and needs not be. Engines that isolate their own KV caches by a request salt
//! (vLLM's `cache_salt`) receive [`TenantSalt::cache_salt`].

use crate::hash::stable_hash;
use crate::types::BlockHash;

/// First token id of a salted token key: marks the three salt ids (outside every real
/// vocabulary, so an unsalted prompt never starts like a salted one by accident).
pub const SALT_TOKEN: u32 = u32::MAX;

/// Extra bytes a salted text key carries in front of the prompt.
pub const TEXT_MARKER_BYTES: usize = 18;

/// Extra ids a salted token key carries in front of the prompt.
pub const TOKEN_MARKER_IDS: usize = 3;

/// A tenant's (or a group of tenants') salt. Two requests share prefix state exactly when
/// they carry the same salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantSalt(pub u64);

impl TenantSalt {
    /// The salt of the cache scope named `scope` (a tenant name, or a group's name): a stable
    /// 64-bit hash, identical across processes, replicas and versions.
    pub fn of(scope: &str) -> Self {
        let mut bytes = Vec::with_capacity(scope.len() + 15);
        bytes.extend_from_slice(b"kvroute-tenant\0");
        bytes.extend_from_slice(scope.as_bytes());
        TenantSalt(stable_hash(&bytes))
    }

    /// The text marker put in front of a salted text key ([`TEXT_MARKER_BYTES`] bytes).
    pub fn text_marker(self) -> String {
        format!("\u{1}{:016x}\u{1}", self.0)
    }

    /// `text` keyed for this tenant: [`TenantSalt::text_marker`] then `text`. An empty text
    /// stays empty (a request keyed on something else).
    pub fn salt_text(self, text: &str) -> String {
        if text.is_empty() {
            return String::new();
        }
        let mut out = String::with_capacity(TEXT_MARKER_BYTES + text.len());
        out.push_str(&self.text_marker());
        out.push_str(text);
        out
    }

    /// `tokens` keyed for this tenant: `[SALT_TOKEN, low, high]` then `tokens`. Empty stays
    /// empty.
    pub fn salt_tokens(self, tokens: &[u32]) -> Vec<u32> {
        if tokens.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(TOKEN_MARKER_IDS + tokens.len());
        out.extend_from_slice(&[SALT_TOKEN, self.0 as u32, (self.0 >> 32) as u32]);
        out.extend_from_slice(tokens);
        out
    }

    /// Precomputed chained block hashes (a trace's) keyed for this tenant: each hash mixed
    /// with the salt. The chain property holds (two salted chains share `h'[i]` exactly when
    /// the unsalted ones share `h[i]`), and chains of different salts share nothing.
    pub fn salt_blocks(self, blocks: &[BlockHash]) -> Vec<BlockHash> {
        blocks.iter().map(|h| BlockHash(xxhash_rust::xxh3::xxh3_64_with_seed(&h.0.to_le_bytes(), self.0))).collect()
    }

    /// A session id keyed for this tenant (one tenant's session id never binds another's
    /// requests).
    pub fn salt_session(self, session: &str) -> String {
        format!("{:016x}:{session}", self.0)
    }

    /// The value passed to engines that isolate their KV caches by a request salt (vLLM's
    /// `cache_salt` request field): 32 hex digits, the salt hashed again so it cannot be
    /// turned back into the router's key.
    pub fn cache_salt(self) -> String {
        let a = stable_hash(&self.0.to_le_bytes());
        let b = stable_hash(&a.to_le_bytes());
        format!("{a:016x}{b:016x}")
    }
}

/// The salt in front of a salted text key, and the text behind it; `(None, text)` for a
/// text without a marker.
pub fn split_text(text: &str) -> (Option<TenantSalt>, &str) {
    let b = text.as_bytes();
    // Bytes 0 and 17 are ASCII, so 1, 17 and 18 are character boundaries.
    if b.len() >= TEXT_MARKER_BYTES
        && b[0] == 1
        && b[TEXT_MARKER_BYTES - 1] == 1
        && let Ok(salt) = u64::from_str_radix(&text[1..TEXT_MARKER_BYTES - 1], 16)
    {
        return (Some(TenantSalt(salt)), &text[TEXT_MARKER_BYTES..]);
    }
    (None, text)
}

/// The salt in front of a salted token key, and the ids behind it.
pub fn split_tokens(tokens: &[u32]) -> (Option<TenantSalt>, &[u32]) {
    match tokens {
        [SALT_TOKEN, lo, hi, rest @ ..] => (Some(TenantSalt(u64::from(*lo) | (u64::from(*hi) << 32))), rest),
        t => (None, t),
    }
}

/// `text` without a salt marker in front, when it has one (for what is recorded or
/// estimated from a salted key).
pub fn unsalted_text(text: &str) -> &str {
    split_text(text).1
}

/// `tokens` without the salt ids in front, when they have them.
pub fn unsalted_tokens(tokens: &[u32]) -> &[u32] {
    split_tokens(tokens).1
}

/// The cache scope of each tenant: its own, or its group's when the operator put it in a
/// group of tenants that trust each other (`shared_prefix_tenants`).
#[derive(Debug, Clone, Default)]
pub struct Scopes {
    group_of: std::collections::HashMap<String, String>,
}

impl Scopes {
    /// Scopes from groups of tenant names. A group's scope is named after its members
    /// (sorted), so the same groups give the same salts on every replica.
    ///
    /// # Errors
    /// A message naming the tenant listed in two groups, or an empty group.
    pub fn new(groups: &[Vec<String>]) -> Result<Self, String> {
        let mut group_of = std::collections::HashMap::new();
        for (i, g) in groups.iter().enumerate() {
            if g.is_empty() {
                return Err(format!("group {} is empty", i + 1));
            }
            let mut names: Vec<&str> = g.iter().map(String::as_str).collect();
            names.sort_unstable();
            names.dedup();
            let scope = format!("group:{}", names.join("\u{0}"));
            for t in g {
                if group_of.insert(t.clone(), scope.clone()).is_some_and(|prev| prev != scope) {
                    return Err(format!("tenant `{t}` is listed in two groups"));
                }
            }
        }
        Ok(Scopes { group_of })
    }

    /// The salt of `tenant`'s requests.
    pub fn salt(&self, tenant: &str) -> TenantSalt {
        match self.group_of.get(tenant) {
            Some(scope) => TenantSalt::of(scope),
            None => TenantSalt::of(&format!("tenant:{tenant}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salted_keys_of_two_tenants_share_no_prefix_and_strip_back() {
        let (a, b) = (TenantSalt::of("tenant:a"), TenantSalt::of("tenant:b"));
        assert_ne!(a, b);
        let (ta, tb) = (a.salt_text("system prompt"), b.salt_text("system prompt"));
        assert_eq!(ta.len(), "system prompt".len() + TEXT_MARKER_BYTES);
        assert_ne!(ta.as_bytes()[..TEXT_MARKER_BYTES], tb.as_bytes()[..TEXT_MARKER_BYTES]);
        assert_eq!(unsalted_text(&ta), "system prompt");
        assert_eq!(unsalted_text("plain"), "plain");
        assert_eq!(a.salt_text(""), "");
        let toks = a.salt_tokens(&[5, 6, 7]);
        assert_eq!(toks.len(), 6);
        assert_ne!(toks[..3], b.salt_tokens(&[5, 6, 7])[..3]);
        assert_eq!(unsalted_tokens(&toks), &[5, 6, 7]);
        assert_eq!(unsalted_tokens(&[5, 6]), &[5, 6]);
        assert_eq!(split_text(&ta).0, Some(a));
        assert_eq!(split_tokens(&toks).0, Some(a));
        assert_ne!(a.salt_session("s"), b.salt_session("s"));
        assert_eq!(a.cache_salt().len(), 32);
        assert_ne!(a.cache_salt(), b.cache_salt());
    }

    #[test]
    fn salted_block_chains_keep_shared_prefixes_within_a_tenant_only() {
        let x = [BlockHash(1), BlockHash(2), BlockHash(3)];
        let y = [BlockHash(1), BlockHash(2), BlockHash(9)];
        let a = TenantSalt::of("tenant:a");
        let (ax, ay) = (a.salt_blocks(&x), a.salt_blocks(&y));
        assert_eq!(ax[..2], ay[..2]);
        assert_ne!(ax[2], ay[2]);
        let bx = TenantSalt::of("tenant:b").salt_blocks(&x);
        assert!(ax.iter().all(|h| !bx.contains(h)));
    }

    #[test]
    fn a_forged_marker_stays_behind_the_requesters_own() {
        let (a, b) = (TenantSalt::of("tenant:a"), TenantSalt::of("tenant:b"));
        let forged = b.salt_text(&format!("{}secret", a.text_marker()));
        assert!(!forged.starts_with(&a.text_marker()));
        assert!(forged.starts_with(&b.text_marker()));
    }

    #[test]
    fn groups_share_one_salt_and_a_tenant_in_two_groups_is_refused() {
        let s = Scopes::new(&[vec!["a".into(), "b".into()]]).expect("groups");
        assert_eq!(s.salt("a"), s.salt("b"));
        assert_ne!(s.salt("a"), s.salt("c"));
        // Order of the members does not matter (the same on every replica).
        let t = Scopes::new(&[vec!["b".into(), "a".into()]]).expect("groups");
        assert_eq!(s.salt("a"), t.salt("b"));
        let e = Scopes::new(&[vec!["a".into()], vec!["a".into(), "c".into()]]).expect_err("twice");
        assert!(e.contains("`a`"), "{e}");
        assert!(Scopes::new(&[vec![]]).is_err());
    }
}
