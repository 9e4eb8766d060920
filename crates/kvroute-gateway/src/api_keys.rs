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
//! Clients send `Authorization: Bearer KEY` (what the OpenAI SDKs send); a missing or
//! unknown key is a 401, a key over a limit a 429 with `Retry-After` (seconds until the
//! bucket holds enough again). The tenant names the key's owner in
//! `kvroute_tenant_requests_total{tenant, outcome}`; only tenants from the file appear, so
//! the label set is bounded by the file.

use axum::http::{HeaderMap, StatusCode, header};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use kvroute_protocol::api_error::ApiError;
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

/// Most keys a file may hold (bounds memory and the tenant label set).
pub const MAX_KEYS: usize = 100_000;

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
    /// A key listed twice.
    #[error("line {line}: this key is already listed above")]
    Duplicate {
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
    /// in flight): one number per distinct `cache_tenant`, in the file's order, below
    /// [`ApiKeys::tenants`].
    pub share: usize,
    /// Requests per minute, when limited.
    requests: Option<DefaultDirectRateLimiter>,
    /// Tokens per minute, when limited, and that limit.
    tokens: Option<(DefaultDirectRateLimiter, u32)>,
}

/// The keys of `api_key_file`.
#[derive(Debug, Default)]
pub struct ApiKeys {
    keys: HashMap<String, Arc<KeyEntry>>,
    /// Distinct tenants (`cache_tenant`s) over the keys.
    tenants: usize,
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

impl ApiKeys {
    /// Parses a key file's text; `default_rpm` / `default_tpm` apply to lines that set none
    /// (0 = unlimited).
    ///
    /// # Errors
    /// [`KeyFileError`] naming the line: a duplicate key, an unknown or malformed
    /// `name=value`, more than two plain words, more than [`MAX_KEYS`] keys, or no key at all.
    pub fn parse(text: &str, default_rpm: u32, default_tpm: u32) -> Result<Self, KeyFileError> {
        let mut keys = HashMap::new();
        let mut shares: HashMap<String, usize> = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line_no = i + 1;
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let key = words.next().unwrap_or_default();
            let (mut tenant, mut rpm, mut tpm) = (None, default_rpm, default_tpm);
            for w in words {
                match w.split_once('=') {
                    Some((name @ ("rpm" | "tpm"), v)) => {
                        let n: u32 = v.parse().map_err(|_| KeyFileError::Number {
                            line: line_no,
                            name: name.to_string(),
                            value: v.to_string(),
                        })?;
                        if name == "rpm" {
                            rpm = n;
                        } else {
                            tpm = n;
                        }
                    }
                    Some((name, _)) => {
                        return Err(KeyFileError::UnknownSetting { line: line_no, name: name.to_string() });
                    }
                    None if tenant.is_none() => tenant = Some(w.to_string()),
                    None => return Err(KeyFileError::Form { line: line_no }),
                }
            }
            if keys.len() == MAX_KEYS {
                return Err(KeyFileError::TooMany { line: line_no });
            }
            let cache_tenant = tenant
                .clone()
                .unwrap_or_else(|| format!("key:{:016x}", kvroute_core::hash::stable_hash(key.as_bytes())));
            let next = shares.len();
            let share = *shares.entry(cache_tenant.clone()).or_insert(next);
            let entry = KeyEntry {
                share,
                cache_tenant,
                tenant: tenant.unwrap_or_else(|| "-".into()),
                requests: limiter(rpm),
                tokens: limiter(tpm).map(|l| (l, tpm)),
            };
            if keys.insert(key.to_string(), Arc::new(entry)).is_some() {
                return Err(KeyFileError::Duplicate { line: line_no });
            }
        }
        if keys.is_empty() {
            return Err(KeyFileError::NoKey);
        }
        Ok(ApiKeys { keys, tenants: shares.len() })
    }

    /// How many distinct tenants the keys name (a key naming none counts as one of its own).
    pub fn tenants(&self) -> usize {
        self.tenants
    }

    /// Reads and parses `path`.
    ///
    /// # Errors
    /// The file cannot be read, or [`ApiKeys::parse`] fails (the message names the file and
    /// line).
    pub fn load(path: &str, default_rpm: u32, default_tpm: u32) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("api_key_file {path}: {e}"))?;
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
        self.keys.get(key).cloned().ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key"))
    }
}

impl KeyEntry {
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
}
