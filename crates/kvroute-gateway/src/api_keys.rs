//! Client API keys with per-key request and token rate limits (`api_key_file`).
//!
//! The file holds one key per line: `KEY [TENANT] [rpm=N] [tpm=N]`; `#` starts a comment and
//! blank lines are skipped. `rpm` (requests per minute) and `tpm` (tokens per minute)
//! override the router-wide `api_key_rpm` / `api_key_tpm` for that key; 0 is unlimited.
//! Each limit is a token bucket holding one minute's worth (the `governor` crate's GCRA):
//! a key may burst its whole minute at once, then refills continuously. Tokens counted per
//! request: its prompt (token ids counted, text at 4 characters per token) plus `max_tokens`
//! when given — the convention of OpenAI's TPM limits.
//!
//! A key may be listed by its SHA-256 instead, `sha256:` and 64 hex digits (`printf %s KEY |
//! sha256sum`), so the file need not hold a usable secret: a request's key is then hashed
//! and looked up by its digest. A key listed so is the same key to clients; to the router
//! it is another line (a key that moves from one form to the other starts with full
//! buckets and, without a tenant, a cache scope of its own).
//!
//! Clients send `Authorization: Bearer KEY` (what the OpenAI SDKs send); a missing or
//! unknown key is a 401, a key over a limit a 429 with `Retry-After` (seconds until the
//! bucket holds enough again). The tenant names the key's owner in
//! `kvroute_tenant_requests_total{tenant, outcome}`; only tenants from the file appear, so
//! the label set is bounded by the file.
//!
//! The file is read again on every SIGHUP ([`KeyFile::reload`]), so a leaked key is revoked
//! and a new tenant added without a restart: requests from then on see the new keys, those
//! already admitted finish. A key whose line is unchanged keeps its buckets (what it has
//! used this minute still counts); a key whose limits changed starts with full ones. A
//! tenant keeps its share of the body budget and of requests in flight
//! ([`KeyEntry::share`]) across reloads. A file that fails to read or parse changes
//! nothing (the keys in effect stay).
//!
//! With the cluster sync (`nats`), a key's limits are the cluster's, not each replica's:
//! what a replica takes from a limited key's buckets is counted ([`ClusterSpend`]) and
//! published with its next batch of routing events (within ~5 ms), and every other replica
//! takes the same amount from its own buckets for that key ([`KeyEntry::take_spent`]). Keys
//! are matched across replicas by [`ClusterSpend::id`], a hash of the key's SHA-256 (so a
//! key listed as itself on one replica and by its digest on another is one key, and no key
//! or digest goes on the wire). A bucket never goes below empty: the cluster may admit
//! more than a key's minute by what the replicas admit for it before they hear of each
//! other (a sync's lag, milliseconds). A starting replica takes from its buckets how far a
//! peer follows them spent ([`crate::cluster::sync::SpendShadow`], in its snapshot).

use axum::http::{HeaderMap, StatusCode, header};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use kvroute_protocol::api_error::ApiError;
use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Most keys a file may hold (bounds memory and the tenant label set).
pub const MAX_KEYS: usize = 100_000;

/// How many tenant shares ([`crate::model::shares::Shares`]) a router with a key file keeps:
/// one per tenant a file may name, so a reload that adds tenants never runs out (a share
/// is one 8-byte count: 800 KB for each bound).
pub const MAX_TENANT_SHARES: usize = MAX_KEYS;

/// A key file refused by [`ApiKeys::parse`], naming the line (1-based).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyFileError {
    /// `rpm=` or `tpm=` with a value that is not a whole number.
    #[error("line {line}: `{name}` must be a whole number of {name}, got `{value}`")]
    Number {
        /// Line.
        line: usize,
        /// `rpm` or `tpm`.
        name: String,
        /// The value given.
        value: String,
    },
    /// A `name=value` other than `rpm` and `tpm`.
    #[error("line {line}: unknown setting `{name}` (rpm and tpm are known)")]
    UnknownSetting {
        /// Line.
        line: usize,
        /// The name given.
        name: String,
    },
    /// More than two plain words.
    #[error("line {line}: expected `KEY [TENANT] [rpm=N] [tpm=N]`")]
    Form {
        /// Line.
        line: usize,
    },
    /// More than [`MAX_KEYS`] keys.
    #[error("line {line}: more than {MAX_KEYS} keys")]
    TooMany {
        /// Line.
        line: usize,
    },
    /// A key listed twice (also: a key and its SHA-256).
    #[error("line {line}: this key is already listed above")]
    Duplicate {
        /// Line.
        line: usize,
    },
    /// `sha256:` followed by anything but 64 hex digits.
    #[error("line {line}: `sha256:` must be followed by the key's SHA-256 as 64 hex digits")]
    Digest {
        /// Line.
        line: usize,
    },
    /// No key at all.
    #[error("the file lists no key (every request would be refused)")]
    NoKey,
}

/// One key's owner and limits.
#[derive(Debug)]
pub struct KeyEntry {
    /// Its tenant (the metric label), `-` when the line names none.
    pub tenant: String,
    /// Its cache scope's tenant name ([`crate::tenant`]): the tenant when the line names
    /// one, else a name of the key's own (`key:` and a hash of the key), so keys without a
    /// tenant never share prefix state.
    pub cache_tenant: String,
    /// Its tenant's share ([`crate::model::shares::Shares`]: of the body budget, of requests
    /// in flight): one number per distinct `cache_tenant`, below [`MAX_TENANT_SHARES`] —
    /// in the file's order at startup; on a reload a tenant keeps its number and a new one
    /// takes the lowest number no tenant of the new file holds.
    pub share: usize,
    /// Its requests and tokens per minute (0: unlimited), as the file or the defaults set
    /// them: a reload keeps the key's buckets only when these did not change.
    limits: (u32, u32),
    /// Requests per minute, when limited.
    requests: Option<DefaultDirectRateLimiter>,
    /// Tokens per minute, when limited, and that limit.
    tokens: Option<(DefaultDirectRateLimiter, u32)>,
    /// What this replica took from the buckets and has not told its cluster yet; `None`
    /// for a key without limits (nothing to share).
    pub spend: Option<Arc<ClusterSpend>>,
}

/// What one replica took from a limited key's buckets since it last told the other
/// replicas of its cluster (the cluster sync publishes it, [`ClusterSpend::take`]). The
/// request path adds to it with two atomic additions and queues it for publication only
/// when it is not queued already ([`ClusterSpend::add`]): one entry per key in the
/// publisher's queue, whatever the key's rate.
#[derive(Debug)]
pub struct ClusterSpend {
    /// The key's name across the cluster: the first 8 bytes of SHA-256 over a fixed label
    /// and the key's SHA-256, the same whether a replica lists the key as itself or by its
    /// digest; neither the key nor its digest can be read from it.
    pub id: u64,
    /// The key's requests and tokens per minute (0: unlimited), as its buckets hold them.
    pub limits: (u32, u32),
    requests: AtomicU64,
    tokens: AtomicU64,
    queued: AtomicBool,
}

impl ClusterSpend {
    fn new(digest: &[u8; 32], limits: (u32, u32)) -> ClusterSpend {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(b"kvroute cluster key spend v1\0");
        ctx.update(digest);
        let d = ctx.finish();
        let mut id = [0u8; 8];
        id.copy_from_slice(&d.as_ref()[..8]);
        ClusterSpend {
            id: u64::from_le_bytes(id),
            limits,
            requests: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            queued: AtomicBool::new(false),
        }
    }

    /// Counts `requests` and `tokens` taken from the key's buckets here; `true` when the
    /// caller must queue this spend for publication (it was not queued), after which it
    /// is queued until [`ClusterSpend::take`] (or [`ClusterSpend::unqueue`] when the
    /// queue refused it).
    pub fn add(&self, requests: u64, tokens: u64) -> bool {
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        !self.queued.swap(true, Ordering::AcqRel)
    }

    /// The queue refused it: the next [`ClusterSpend::add`] queues it again, with what was
    /// counted so far.
    pub fn unqueue(&self) {
        self.queued.store(false, Ordering::Release);
    }

    /// What was counted since the last take, `(requests, tokens)`, counted from zero again.
    /// Marked unqueued first, so what a request adds meanwhile is either in this take or
    /// queued again by that request: nothing counted is left unqueued.
    pub fn take(&self) -> (u64, u64) {
        // A swap, not a store: it reads the flag a request set after its additions
        // (acquire after their release), so those additions are in the counts taken below.
        self.queued.swap(false, Ordering::AcqRel);
        (self.requests.swap(0, Ordering::AcqRel), self.tokens.swap(0, Ordering::AcqRel))
    }
}

/// What starts a key listed by its SHA-256.
pub const DIGEST_PREFIX: &str = "sha256:";

/// The keys of `api_key_file`.
#[derive(Debug, Default)]
pub struct ApiKeys {
    /// Every key by the form the file lists it in: the key itself, or [`DIGEST_PREFIX`] and
    /// its SHA-256 in lowercase hex.
    keys: HashMap<String, Arc<KeyEntry>>,
    /// The keys listed by digest, by their SHA-256.
    digests: HashMap<[u8; 32], Arc<KeyEntry>>,
    /// Each distinct tenant (`cache_tenant`) over the keys, with its share's number.
    shares: HashMap<String, usize>,
    /// The limited keys by [`ClusterSpend::id`] (another replica's spend is applied here).
    by_spend: HashMap<u64, Arc<KeyEntry>>,
}

/// One line of a key file, parsed ([`ApiKeys::parse_after`]).
struct Line<'t> {
    number: usize,
    /// The key as listed (a digest's hex in lowercase).
    key: String,
    /// The SHA-256 when the line lists the key by it.
    digest: Option<[u8; 32]>,
    tenant: Option<&'t str>,
    rpm: u32,
    tpm: u32,
}

/// The credential of `Authorization: Bearer <value>` in `headers`, if there is one (what the
/// OpenAI SDKs send; the admin token and API keys both come this way). The scheme is
/// matched without regard to case and may be followed by several spaces (RFC 9110 §11.1,
/// §11.4: `bearer KEY` is the same credential).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, credential) = v.split_once(' ')?;
    let credential = credential.trim_start_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !credential.is_empty()).then_some(credential)
}

/// Whether `given` is `secret`, compared in constant time (no timing hint of how much of a
/// guess was right).
pub fn same_secret(given: &str, secret: &str) -> bool {
    bool::from(subtle::ConstantTimeEq::ct_eq(given.as_bytes(), secret.as_bytes()))
}

fn limiter(per_minute: u32) -> Option<DefaultDirectRateLimiter> {
    NonZeroU32::new(per_minute).map(|n| RateLimiter::direct(Quota::per_minute(n)))
}

/// Seconds until `not_until` allows, rounded up, at least 1 (the `Retry-After` value).
fn retry_after(not_until: &governor::NotUntil<<DefaultClock as Clock>::Instant>) -> u32 {
    let wait = not_until.wait_time_from(DefaultClock::default().now());
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.clamp(1, u64::from(u32::MAX)) as u32
}

/// The lines of a key file that list a key, in order, each with its limits.
///
/// # Errors
/// As [`ApiKeys::parse`], but for duplicate keys (found when the keys are gathered).
fn lines(text: &str, default_rpm: u32, default_tpm: u32) -> Result<Vec<Line<'_>>, KeyFileError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let written = words.next().unwrap_or_default();
        let digest = match written.strip_prefix(DIGEST_PREFIX) {
            Some(hex) => Some(digest_of_hex(hex).ok_or(KeyFileError::Digest { line: number })?),
            None => None,
        };
        let key = match digest {
            Some(_) => written.to_ascii_lowercase(),
            None => written.to_string(),
        };
        let mut l = Line { number, key, digest, tenant: None, rpm: default_rpm, tpm: default_tpm };
        for w in words {
            match w.split_once('=') {
                Some((name @ ("rpm" | "tpm"), v)) => {
                    let n: u32 = v.parse().map_err(|_| KeyFileError::Number {
                        line: number,
                        name: name.to_string(),
                        value: v.to_string(),
                    })?;
                    if name == "rpm" {
                        l.rpm = n;
                    } else {
                        l.tpm = n;
                    }
                }
                Some((name, _)) => return Err(KeyFileError::UnknownSetting { line: number, name: name.to_string() }),
                None if l.tenant.is_none() => l.tenant = Some(w),
                None => return Err(KeyFileError::Form { line: number }),
            }
        }
        if out.len() == MAX_KEYS {
            return Err(KeyFileError::TooMany { line: number });
        }
        out.push(l);
    }
    if out.is_empty() {
        return Err(KeyFileError::NoKey);
    }
    Ok(out)
}

/// Largest key file read (64 MiB: [`MAX_KEYS`] lines of over 600 bytes each); a larger
/// one is refused rather than read into memory, at startup and on every reload.
pub const MAX_KEY_FILE_BYTES: u64 = 64 << 20;

/// The text of the key file at `path`, at most [`MAX_KEY_FILE_BYTES`].
///
/// # Errors
/// As [`read_bounded_text`].
fn read_key_file(path: &str) -> anyhow::Result<String> {
    read_bounded_text(path, MAX_KEY_FILE_BYTES, "api_key_file")
}

/// The text of the file at `path`, the value of configuration key `key`, read up to just
/// past `max` bytes: a larger file is refused rather than read into memory.
///
/// # Errors
/// The file cannot be read, is larger than `max`, or is not UTF-8 (naming `key` and the
/// file).
pub(crate) fn read_bounded_text(path: &str, max: u64, key: &str) -> anyhow::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max + 1).read_to_string(&mut text))
        .map_err(|e| anyhow::anyhow!("{key} {path}: {e}"))?;
    if text.len() as u64 > max {
        anyhow::bail!("{key} {path}: larger than {max} bytes");
    }
    Ok(text)
}

/// The 32 bytes of 64 hex digits (either case), `None` for anything else.
fn digest_of_hex(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

/// SHA-256 of `key` (how a key listed by digest is found).
fn sha256(key: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// A key's cache scope tenant ([`KeyEntry::cache_tenant`]).
fn cache_tenant(key: &str, tenant: Option<&str>) -> String {
    tenant.map_or_else(|| format!("key:{:016x}", kvroute_core::hash::stable_hash(key.as_bytes())), str::to_string)
}

/// A share number for each distinct tenant of `tenants` (at most [`MAX_KEYS`] of them, so
/// every number is below [`MAX_TENANT_SHARES`]): its number in `before` when it had one,
/// else the lowest number not kept, in the order the tenants first appear.
fn number_shares(tenants: &[String], before: Option<&HashMap<String, usize>>) -> HashMap<String, usize> {
    let mut shares: HashMap<String, usize> = HashMap::new();
    let mut taken: HashSet<usize> = HashSet::new();
    if let Some(before) = before {
        for t in tenants {
            if let Some(&i) = before.get(t) {
                shares.insert(t.clone(), i);
                taken.insert(i);
            }
        }
    }
    let mut next = 0;
    for t in tenants {
        if !shares.contains_key(t) {
            while taken.contains(&next) {
                next += 1;
            }
            shares.insert(t.clone(), next);
            taken.insert(next);
        }
    }
    shares
}

impl ApiKeys {
    /// Parses a key file's text; `default_rpm` / `default_tpm` apply to lines that set none
    /// (0 = unlimited). Tenants' shares are numbered in the file's order.
    ///
    /// # Errors
    /// [`KeyFileError`] naming the line: a duplicate key, an unknown or malformed
    /// `name=value`, more than two plain words, more than [`MAX_KEYS`] keys, or no key at all.
    pub fn parse(text: &str, default_rpm: u32, default_tpm: u32) -> Result<Self, KeyFileError> {
        Self::parse_after(text, default_rpm, default_tpm, None)
    }

    /// [`ApiKeys::parse`] of a file read again while `before` is in effect: a key whose
    /// tenant and limits are unchanged keeps its entry (its buckets: what it used this
    /// minute still counts), a tenant kept keeps its share, and a new tenant takes the
    /// lowest share no tenant of this file keeps.
    ///
    /// # Errors
    /// As [`ApiKeys::parse`].
    pub fn parse_after(
        text: &str,
        default_rpm: u32,
        default_tpm: u32,
        before: Option<&ApiKeys>,
    ) -> Result<Self, KeyFileError> {
        let lines = lines(text, default_rpm, default_tpm)?;
        let cache_tenants: Vec<String> = lines.iter().map(|l| cache_tenant(&l.key, l.tenant)).collect();
        let shares = number_shares(&cache_tenants, before.map(|b| &b.shares));
        let mut keys = HashMap::with_capacity(lines.len());
        let mut digests = HashMap::new();
        let mut by_spend = HashMap::new();
        for (l, cache_tenant) in lines.iter().zip(cache_tenants) {
            let tenant = l.tenant.unwrap_or("-");
            let share = shares[&cache_tenant];
            let kept = before.and_then(|b| b.keys.get(&l.key)).filter(|e| {
                e.tenant == tenant && e.cache_tenant == cache_tenant && e.share == share && e.limits == (l.rpm, l.tpm)
            });
            let entry = kept.cloned().unwrap_or_else(|| {
                let limited = l.rpm > 0 || l.tpm > 0;
                Arc::new(KeyEntry {
                    share,
                    cache_tenant,
                    tenant: tenant.to_string(),
                    limits: (l.rpm, l.tpm),
                    requests: limiter(l.rpm),
                    tokens: limiter(l.tpm).map(|t| (t, l.tpm)),
                    spend: limited.then(|| {
                        Arc::new(ClusterSpend::new(&l.digest.unwrap_or_else(|| sha256(&l.key)), (l.rpm, l.tpm)))
                    }),
                })
            });
            if let Some(d) = l.digest {
                digests.insert(d, Arc::clone(&entry));
            }
            if let Some(spend) = &entry.spend {
                by_spend.insert(spend.id, Arc::clone(&entry));
            }
            if keys.insert(l.key.clone(), entry).is_some() {
                return Err(KeyFileError::Duplicate { line: l.number });
            }
        }
        // A key listed both as itself and by its digest: the later of the two lines.
        if !digests.is_empty() {
            let digest_lines: HashMap<[u8; 32], usize> =
                lines.iter().filter_map(|l| Some((l.digest?, l.number))).collect();
            let twin = lines
                .iter()
                .filter(|l| l.digest.is_none())
                .find_map(|l| Some(l.number.max(*digest_lines.get(&sha256(&l.key))?)));
            if let Some(line) = twin {
                return Err(KeyFileError::Duplicate { line });
            }
        }
        Ok(ApiKeys { keys, digests, shares, by_spend })
    }

    /// The limited key another replica names by `id` ([`ClusterSpend::id`]), if this
    /// replica's file lists it.
    pub fn by_spend_id(&self, id: u64) -> Option<&Arc<KeyEntry>> {
        self.by_spend.get(&id)
    }

    /// How many keys the file lists.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the file lists no key (never true of a parsed file).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenant names (`kvroute_tenant_requests_total`'s `tenant` label: `-` for keys
    /// naming none) of the keys.
    pub fn tenant_labels(&self) -> HashSet<&str> {
        self.keys.values().map(|e| e.tenant.as_str()).collect()
    }

    /// How many distinct tenants the keys name (a key naming none counts as one of its own).
    pub fn tenants(&self) -> usize {
        self.shares.len()
    }

    /// Reads and parses `path`.
    ///
    /// # Errors
    /// The file cannot be read, or [`ApiKeys::parse`] fails (the message names the file and
    /// line).
    pub fn load(path: &str, default_rpm: u32, default_tpm: u32) -> anyhow::Result<Self> {
        let text = read_key_file(path)?;
        Self::parse(&text, default_rpm, default_tpm).map_err(|e| anyhow::anyhow!("api_key_file {path}: {e}"))
    }

    /// The key of `headers` (`Authorization: Bearer KEY`).
    ///
    /// # Errors
    /// 401 when the header is missing or the key unknown.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<KeyEntry>, ApiError> {
        let presented = bearer(headers).map(str::trim);
        let Some(key) = presented else {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, "missing API key: send `Authorization: Bearer KEY`"));
        };
        // A key presented as `sha256:…` is never taken for a digest the file lists: it is a
        // key like any other, found only by its own digest.
        let listed = if key.starts_with(DIGEST_PREFIX) { None } else { self.keys.get(key) };
        let listed = listed.or_else(|| (!self.digests.is_empty()).then(|| self.digests.get(&sha256(key))).flatten());
        listed.cloned().ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key"))
    }
}

/// The running key set of `api_key_file`: read at startup, read again by
/// [`KeyFile::reload`] (on SIGHUP), and read by requests without a lock.
#[derive(Debug)]
pub struct KeyFile {
    path: String,
    default_rpm: u32,
    default_tpm: u32,
    keys: arc_swap::ArcSwap<ApiKeys>,
}

/// What a [`KeyFile::reload`] changed, counted in keys (a key whose tenant or limits
/// changed is `changed`, one left as it was `kept`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyChanges {
    /// Keys new in the file.
    pub added: usize,
    /// Keys gone from the file (refused with a 401 from now on).
    pub removed: usize,
    /// Keys listed before and now with another tenant or other limits (new buckets).
    pub changed: usize,
    /// Keys whose line is unchanged (their buckets kept).
    pub kept: usize,
    /// Tenant labels no key names any more (their `kvroute_tenant_requests_total` series
    /// can go).
    pub tenants_gone: Vec<String>,
}

impl KeyChanges {
    /// Whether the reload changed any key.
    pub fn any(&self) -> bool {
        self.added + self.removed + self.changed > 0
    }
}

impl KeyFile {
    /// Reads and parses `path` ([`ApiKeys::load`]).
    ///
    /// # Errors
    /// As [`ApiKeys::load`].
    pub fn load(path: &str, default_rpm: u32, default_tpm: u32) -> anyhow::Result<KeyFile> {
        let keys = ApiKeys::load(path, default_rpm, default_tpm)?;
        Ok(KeyFile { path: path.to_string(), default_rpm, default_tpm, keys: arc_swap::ArcSwap::from_pointee(keys) })
    }

    /// The keys in effect (one atomic load; no lock).
    pub fn keys(&self) -> arc_swap::Guard<Arc<ApiKeys>> {
        self.keys.load()
    }

    /// Reads the file again ([`ApiKeys::parse_after`] the keys in effect) and puts its keys
    /// in effect for the requests that arrive from then on. Blocking file I/O: call it off
    /// the async runtime.
    ///
    /// # Errors
    /// The file cannot be read or does not parse (the message names the file and line); the
    /// keys in effect stay.
    pub fn reload(&self) -> anyhow::Result<KeyChanges> {
        let path = &self.path;
        let text = read_key_file(path)?;
        let before = self.keys.load_full();
        let next = ApiKeys::parse_after(&text, self.default_rpm, self.default_tpm, Some(&before))
            .map_err(|e| anyhow::anyhow!("api_key_file {path}: {e}"))?;
        let mut c = KeyChanges::default();
        for (key, entry) in &next.keys {
            match before.keys.get(key) {
                None => c.added += 1,
                Some(old) if Arc::ptr_eq(old, entry) => c.kept += 1,
                Some(_) => c.changed += 1,
            }
        }
        c.removed = before.keys.keys().filter(|k| !next.keys.contains_key(*k)).count();
        let now = next.tenant_labels();
        c.tenants_gone = before.tenant_labels().into_iter().filter(|t| !now.contains(t)).map(str::to_string).collect();
        c.tenants_gone.sort();
        self.keys.store(Arc::new(next));
        Ok(c)
    }
}

/// Takes up to `n` cells from `l`, a bucket of `burst` cells: as many as it holds when it
/// holds fewer (it never goes below empty). At most ~2 × log2(`burst`) tries.
fn drain(l: &DefaultDirectRateLimiter, n: u64, burst: u32) {
    let mut left = n.min(u64::from(burst)) as u32;
    let mut step = left;
    while left > 0 && step > 0 {
        match l.check_n(NonZeroU32::new(step).unwrap_or(NonZeroU32::MIN)) {
            Ok(Ok(())) => {
                left -= step;
                step = step.min(left);
            }
            _ => step /= 2,
        }
    }
}

impl KeyEntry {
    /// Takes from the key's buckets what another replica of the cluster admitted for it:
    /// `requests` from the request bucket and `tokens` from the token bucket, each as far as
    /// the bucket holds (an empty bucket stays empty; it never owes).
    pub fn take_spent(&self, requests: u64, tokens: u64) {
        if let Some(l) = &self.requests {
            drain(l, requests, self.limits.0);
        }
        if let Some((l, tpm)) = &self.tokens {
            drain(l, tokens, *tpm);
        }
    }

    /// Takes one request from the key's request bucket.
    ///
    /// # Errors
    /// 429 with `Retry-After` when the key is over its requests per minute.
    pub fn admit_request(&self) -> Result<(), ApiError> {
        let Some(l) = &self.requests else { return Ok(()) };
        l.check().map_err(|nu| {
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, "this API key is over its requests per minute")
                .retry_after(retry_after(&nu))
        })
    }

    /// Takes `tokens` from the key's token bucket.
    ///
    /// # Errors
    /// 429 with `Retry-After` when the key is over its tokens per minute; 429 without it
    /// when one request needs more tokens than the key may use in a minute.
    pub fn admit_tokens(&self, tokens: u64) -> Result<(), ApiError> {
        let Some((l, tpm)) = &self.tokens else { return Ok(()) };
        let Some(n) = NonZeroU32::new(tokens.min(u64::from(u32::MAX)) as u32) else { return Ok(()) };
        match l.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(nu)) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("this API key is over its {tpm} tokens per minute"),
            )
            .retry_after(retry_after(&nu))),
            Err(_) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("this request needs {tokens} tokens, more than this API key's {tpm} per minute"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, format!("Bearer {key}").parse().expect("header"));
        h
    }

    #[test]
    fn parses_keys_tenants_and_limits_and_names_bad_lines() {
        let keys = ApiKeys::parse("# keys\nsk-a team-a rpm=2\n\nsk-b  # no tenant\nsk-c team-c tpm=100\n", 0, 0)
            .expect("parses");
        assert_eq!(keys.authenticate(&bearer("sk-a")).expect("a").tenant, "team-a");
        assert_eq!(keys.authenticate(&bearer("sk-b")).expect("b").tenant, "-");
        assert_eq!(keys.authenticate(&bearer("nope")).expect_err("unknown").status, StatusCode::UNAUTHORIZED);
        assert_eq!(keys.authenticate(&HeaderMap::new()).expect_err("none").status, StatusCode::UNAUTHORIZED);
        for (text, line) in [
            ("sk-a\nsk-a\n", "line 2"),
            ("sk-a rpm=x\n", "line 1"),
            ("sk-a burst=3\n", "line 1"),
            ("\nsk-a t1 t2\n", "line 2"),
        ] {
            let e = ApiKeys::parse(text, 0, 0).expect_err(text).to_string();
            assert!(e.starts_with(line), "{text:?}: {e}");
        }
        assert!(ApiKeys::parse("# none\n", 0, 0).is_err());
    }

    /// The scheme is case-insensitive (RFC 9110 §11.1): `bearer`, `BEARER` and extra spaces
    /// carry the same key; another scheme, or none, carries none.
    #[test]
    fn the_bearer_scheme_is_matched_without_regard_to_case() {
        let keys = ApiKeys::parse("sk-a team-a\n", 0, 0).expect("parses");
        for v in ["Bearer sk-a", "bearer sk-a", "BEARER sk-a", "Bearer   sk-a"] {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().expect("header"));
            assert_eq!(super::bearer(&h), Some("sk-a"), "{v:?}");
            assert_eq!(keys.authenticate(&h).expect(v).tenant, "team-a");
        }
        for v in ["Basic sk-a", "Bearersk-a", "sk-a", "Bearer ", "Bearer"] {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().expect("header"));
            assert_eq!(super::bearer(&h), None, "{v:?}");
        }
    }

    #[test]
    fn another_replica_s_spend_drains_the_buckets_as_far_as_they_go() {
        // Limits whose buckets refill no cell within a second.
        let keys = ApiKeys::parse("sk-a t rpm=3 tpm=60\nsk-b\nsk-c rpm=10\n", 0, 0).expect("parses");
        let a = keys.authenticate(&bearer("sk-a")).expect("a");
        a.take_spent(2, 30);
        a.admit_request().expect("the third of the minute");
        assert_eq!(a.admit_request().expect_err("a fourth").status, StatusCode::TOO_MANY_REQUESTS);
        a.admit_tokens(30).expect("the last 30 tokens");
        assert_eq!(a.admit_tokens(1).expect_err("one more").status, StatusCode::TOO_MANY_REQUESTS);
        // More than a bucket holds empties it, and an empty one stays empty (nothing owed).
        let c = keys.authenticate(&bearer("sk-c")).expect("c");
        c.take_spent(9, 0);
        c.admit_request().expect("the last of 10");
        c.take_spent(u64::MAX, u64::MAX);
        assert!(c.admit_request().is_err());
        // A key without limits shares nothing.
        assert!(keys.authenticate(&bearer("sk-b")).expect("b").spend.is_none());
    }

    #[test]
    fn a_key_has_one_cluster_name_whether_listed_as_itself_or_by_its_digest() {
        let digest = sha256("sk-a").iter().map(|b| format!("{b:02x}")).collect::<String>();
        let plain = ApiKeys::parse("sk-a t rpm=3\nsk-b t rpm=3\n", 0, 0).expect("parses");
        let hashed = ApiKeys::parse(&format!("sha256:{digest} t rpm=3\n"), 0, 0).expect("parses");
        let id = |k: &ApiKeys, key: &str| k.authenticate(&bearer(key)).expect(key).spend.as_ref().expect("limited").id;
        assert_eq!(id(&plain, "sk-a"), id(&hashed, "sk-a"));
        assert_ne!(id(&plain, "sk-a"), id(&plain, "sk-b"));
        let found = hashed.by_spend_id(id(&plain, "sk-a")).expect("found by the other replica's name");
        assert!(Arc::ptr_eq(found, &hashed.authenticate(&bearer("sk-a")).expect("a")));
        // The name is neither the key's digest nor a prefix of it.
        assert_ne!(id(&plain, "sk-a").to_le_bytes(), sha256("sk-a")[..8]);
        // Counts are taken once, and a key is queued once until they are taken.
        let spend = plain.authenticate(&bearer("sk-a")).expect("a").spend.clone().expect("limited");
        assert!(spend.add(1, 0), "queued by its first spend");
        assert!(!spend.add(1, 250), "not queued twice");
        assert_eq!(spend.take(), (2, 250));
        assert_eq!(spend.take(), (0, 0));
        assert!(spend.add(1, 0), "queued again after the take");
    }

    #[test]
    fn a_key_over_its_limits_gets_429_with_retry_after() {
        let keys = ApiKeys::parse("sk-a t rpm=2 tpm=100\nsk-b\n", 0, 0).expect("parses");
        let a = keys.authenticate(&bearer("sk-a")).expect("a");
        a.admit_request().expect("1st");
        a.admit_request().expect("2nd");
        let e = a.admit_request().expect_err("3rd in the same minute");
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(e.retry_after.is_some_and(|s| (1..=60).contains(&s)), "{:?}", e.retry_after);
        a.admit_tokens(60).expect("60 of 100");
        let e = a.admit_tokens(60).expect_err("120 of 100");
        assert!(e.retry_after.is_some());
        let e = a.admit_tokens(1_000).expect_err("more than a minute's worth");
        assert!(e.retry_after.is_none() && e.message.contains("1000 tokens"), "{}", e.message);
        // Another key has its own buckets (and none here: unlimited).
        let b = keys.authenticate(&bearer("sk-b")).expect("b");
        for _ in 0..100 {
            b.admit_request().expect("unlimited");
        }
    }

    /// A file read again: an unchanged line keeps its entry (its buckets), a changed limit or
    /// tenant gets a new one, a kept tenant keeps its share and a new tenant takes the lowest
    /// share no kept tenant holds.
    #[test]
    fn a_reparse_keeps_unchanged_keys_and_every_kept_tenant_s_share() {
        let before = ApiKeys::parse("sk-a ta rpm=1\nsk-b tb\nsk-c tc\nsk-d tb\n", 0, 0).expect("parses");
        let share = |k: &ApiKeys, key: &str| k.authenticate(&bearer(key)).expect(key).share;
        assert_eq!([share(&before, "sk-a"), share(&before, "sk-b"), share(&before, "sk-c")], [0, 1, 2]);
        before.authenticate(&bearer("sk-a")).expect("a").admit_request().expect("a's one request this minute");
        // ta leaves (its share 0 is free), tc stays, te and tf are new; sk-d's limit changes.
        let after = ApiKeys::parse_after("sk-c tc\nsk-e te\nsk-a tc\nsk-f tf\nsk-d tb rpm=5\n", 0, 0, Some(&before))
            .expect("parses");
        assert_eq!(share(&after, "sk-c"), 2, "a kept tenant keeps its share");
        assert_eq!(share(&after, "sk-d"), 1, "tb is kept through sk-d");
        assert_eq!(share(&after, "sk-e"), 0, "a new tenant takes the lowest free share");
        assert_eq!(share(&after, "sk-f"), 3);
        assert_eq!(share(&after, "sk-a"), 2, "sk-a moved to tc's share");
        let (c0, c1) =
            (before.authenticate(&bearer("sk-c")).expect("c"), after.authenticate(&bearer("sk-c")).expect("c"));
        assert!(Arc::ptr_eq(&c0, &c1), "an unchanged line keeps its entry");
        assert!(!Arc::ptr_eq(&before.keys["sk-d"], &after.keys["sk-d"]), "a changed limit gets new buckets");
        // sk-a changed tenant: new buckets, so its next request is admitted.
        after.authenticate(&bearer("sk-a")).expect("a").admit_request().expect("new buckets");
        assert_eq!(after.tenants(), 4);
        // An unchanged rate-limited key keeps what it used.
        let again = ApiKeys::parse_after("sk-a ta rpm=1\n", 0, 0, Some(&before)).expect("parses");
        assert!(again.authenticate(&bearer("sk-a")).expect("a").admit_request().is_err(), "bucket kept");
    }

    /// [`KeyFile::reload`] counts what changed and names the tenants gone; a file that does
    /// not parse, or is gone, keeps the keys in effect.
    #[test]
    fn a_key_file_reload_counts_its_changes_and_a_bad_file_changes_nothing() {
        let tmp =
            tempfile::Builder::new().prefix("kvroute-keyfile-unit-").suffix(".txt").tempfile().expect("temp file");
        let path = tmp.path().to_path_buf();
        std::fs::write(&path, "sk-a ta\nsk-b tb\nsk-c\n").expect("write");
        let file = KeyFile::load(path.to_str().expect("utf8"), 0, 0).expect("loads");
        std::fs::write(&path, "sk-a ta\nsk-b tb rpm=3\nsk-d td\n").expect("write");
        let c = file.reload().expect("reloads");
        assert_eq!((c.added, c.removed, c.changed, c.kept), (1, 1, 1, 1));
        assert_eq!(c.tenants_gone, vec!["-".to_string()]);
        assert!(
            file.keys().authenticate(&bearer("sk-c")).is_err() && file.keys().authenticate(&bearer("sk-d")).is_ok()
        );
        std::fs::write(&path, "sk-a ta\nsk-e rpm=x\n").expect("write");
        let e = file.reload().expect_err("does not parse").to_string();
        assert!(e.contains("line 2") && e.contains("rpm"), "{e}");
        // A file past the bound (sparse: nothing written) is refused unread past it.
        std::fs::File::create(&path).and_then(|f| f.set_len(MAX_KEY_FILE_BYTES + 1)).expect("sparse file");
        let e = file.reload().expect_err("too large").to_string();
        assert!(e.contains("larger than"), "{e}");
        std::fs::remove_file(&path).expect("remove");
        assert!(file.reload().is_err(), "a missing file is an error");
        assert!(file.keys().authenticate(&bearer("sk-d")).is_ok(), "the keys in effect stay");
    }

    /// A key listed by its SHA-256 is found by the key, never by the digest presented as a
    /// key; a malformed digest, or a key listed both ways, is refused naming the line.
    #[test]
    fn a_key_listed_by_its_sha256_is_found_by_the_key_and_never_by_the_digest() {
        let hex = |key: &str| -> String { sha256(key).iter().map(|b| format!("{b:02x}")).collect() };
        // FIPS 180-2's test vector: what `printf %s abc | sha256sum` prints.
        assert_eq!(hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let real = hex("sk-hashed");
        let text = format!("sk-plain team-a\nsha256:{} team-b rpm=1\n", real.to_uppercase());
        let keys = ApiKeys::parse(&text, 0, 0).expect("parses");
        let b = keys.authenticate(&bearer("sk-hashed")).expect("found by its digest");
        assert_eq!(b.tenant, "team-b");
        assert_eq!(keys.authenticate(&bearer("sk-plain")).expect("plain").tenant, "team-a");
        for presented in [format!("sha256:{real}"), real.clone(), format!("sha256:{}", real.to_uppercase())] {
            assert!(keys.authenticate(&bearer(&presented)).is_err(), "{presented} let in");
        }
        assert_eq!(keys.len(), 2);
        // The digest's limits apply to the key.
        b.admit_request().expect("its one request");
        assert!(keys.authenticate(&bearer("sk-hashed")).expect("b").admit_request().is_err());
        // A reload keeps the digest's buckets (hex in either case is the same line).
        let again = ApiKeys::parse_after(&format!("sha256:{real} team-b rpm=1\n"), 0, 0, Some(&keys)).expect("parses");
        assert!(again.authenticate(&bearer("sk-hashed")).expect("b").admit_request().is_err(), "buckets kept");
        for (text, line) in [
            (format!("sk-a\nsha256:{}\n", &real[..63]), "line 2"),
            ("sha256:zz\n".to_string(), "line 1"),
            (format!("sha256:{real}\nsk-hashed\n"), "line 2"),
            (format!("sk-hashed t\n\nsha256:{real} u\n"), "line 3"),
        ] {
            let e = ApiKeys::parse(&text, 0, 0).expect_err(&text).to_string();
            assert!(e.starts_with(line), "{text:?}: {e}");
        }
    }
}
