//! The tenant of a request, its cache salt, and what of a routing decision a client sees.
//!
//! A request's tenant is its API key's (`api_key_file`; a key whose line names no tenant
//! is a tenant of its own), else the value of `tenant_header` set by a trusted proxy (a
//! request without it is the anonymous tenant). With `tenant_isolation` (the default) its
//! routing key is salted per tenant, or per group of `shared_prefix_tenants`
//! ([`kvroute_core::tenant`]), and with `engine_cache_salt` the salt reaches the engine as
//! the body's `cache_salt` (vLLM). Without API keys or `tenant_header` no request has a
//! tenant and nothing is salted.
//!
//! Decision details (`x-kvroute-worker`, `x-kvroute-decision`, `x-kvroute-cascade`) go
//! only to requests carrying the admin token, unless `expose_decision_headers` is set.

use crate::api_keys::{ApiKeys, KeyEntry};
use crate::config::GatewayConfig;
use axum::body::Bytes;
use axum::http::HeaderMap;
use kvroute_core::tenant::{Scopes, TenantSalt};
use kvroute_protocol::openai::RoutingInfo;

/// Longest `tenant_header` value used as a tenant name (bytes); a longer one is cut.
pub const MAX_TENANT_NAME: usize = 256;

/// The response headers that carry decision details.
pub const DECISION_HEADERS: [&str; 3] = ["x-kvroute-worker", "x-kvroute-decision", "x-kvroute-cascade"];

/// The request header an operator sends the admin token in on an inference request (the
/// `Authorization` header carries the API key there).
pub const ADMIN_TOKEN_HEADER: &str = "x-kvroute-admin-token";

/// The tenancy settings, read once at start: who a request's tenant is, its salt, and who
/// sees decision details.
#[derive(Debug)]
pub struct Tenancy {
    /// `tenant_isolation`.
    pub isolation: bool,
    /// Each tenant's cache scope (`shared_prefix_tenants`).
    pub scopes: Scopes,
    /// `tenant_header`, parsed.
    pub header: Option<http::HeaderName>,
    /// `expose_decision_headers`.
    pub expose_decisions: bool,
    /// `admin_token` or `admin_token_file`'s token (read again on reloads).
    pub admin_token: crate::admin_token::AdminToken,
}

/// A tenancy setting the configuration got wrong.
#[derive(Debug, thiserror::Error)]
pub enum TenancyError {
    /// `shared_prefix_tenants` is refused.
    #[error("shared_prefix_tenants: {0}")]
    Groups(String),
    /// `tenant_header` is no header name.
    #[error("tenant_header: {0}")]
    Header(#[from] http::header::InvalidHeaderName),
    /// `admin_token_file` cannot be read or holds no token (the message names the file).
    #[error("{0}")]
    AdminToken(String),
}

impl Tenancy {
    /// The tenancy settings of `cfg`.
    ///
    /// # Errors
    /// [`TenancyError`] naming the key (or the admin token's file).
    pub fn new(cfg: &GatewayConfig) -> Result<Tenancy, TenancyError> {
        let admin_token =
            crate::admin_token::AdminToken::new(cfg.admin_token.as_deref(), cfg.admin_token_file.as_deref())
                .map_err(|e| TenancyError::AdminToken(format!("{e:#}")))?;
        let scopes = Scopes::new(&cfg.shared_prefix_tenants).map_err(|m| TenancyError::Groups(m.to_string()))?;
        let header = cfg.tenant_header.as_ref().map(|h| http::HeaderName::from_bytes(h.as_bytes())).transpose()?;
        Ok(Tenancy {
            isolation: cfg.tenant_isolation,
            scopes,
            header,
            expose_decisions: cfg.expose_decision_headers,
            admin_token,
        })
    }

    /// The cache salt of the request with `headers` (its tenant from `keys` when the router
    /// has API keys, else from `tenant_header`), or `None` when it is not salted (isolation
    /// off, or no tenants configured). For a request whose key is not checked yet (a dry run);
    /// the pipeline has its key already ([`Tenancy::salt_for`]).
    pub fn salt_of(&self, keys: Option<&ApiKeys>, headers: &HeaderMap) -> Option<TenantSalt> {
        match keys {
            // An unknown key never reaches inference (401 first); an anonymous salt all the same.
            Some(keys) => match keys.authenticate(headers) {
                Ok(key) => self.salt_for(Some(&key), headers),
                Err(_) => self.salt_of_name(""),
            },
            None => self.salt_for(None, headers),
        }
    }

    /// The cache salt of a request whose API key is `key` (checked already; `None` when the
    /// router has no API keys: then its tenant is `tenant_header`'s value), or `None` when it
    /// is not salted.
    pub fn salt_for(&self, key: Option<&KeyEntry>, headers: &HeaderMap) -> Option<TenantSalt> {
        if !self.isolation {
            return None;
        }
        if let Some(key) = key {
            return Some(self.scopes.salt(&key.cache_tenant));
        }
        let value = self.header_tenant(headers)?;
        Some(self.scopes.salt(&String::from_utf8_lossy(value)))
    }

    /// With `tenant_header`, the tenant `headers` name: the header's value, cut to
    /// [`MAX_TENANT_NAME`] bytes (empty when absent: the anonymous tenant); `None` without it.
    fn header_tenant<'h>(&self, headers: &'h HeaderMap) -> Option<&'h [u8]> {
        let name = self.header.as_ref()?;
        let value = headers.get(name).map(|v| v.as_bytes()).unwrap_or_default();
        Some(&value[..value.len().min(MAX_TENANT_NAME)])
    }

    /// The salt of the tenant named `name` (`None` with isolation off).
    pub fn salt_of_name(&self, name: &str) -> Option<TenantSalt> {
        self.isolation.then(|| self.scopes.salt(name))
    }

    /// The request's tenant share ([`crate::model::shares::Shares`]; of the body budget, of
    /// requests in flight): its API key's tenant's (`key`, checked already), else with
    /// `tenant_header` the share its tenant's name hashes to (the anonymous tenant's when the
    /// header is absent); `None` when the router knows no tenants. Independent of
    /// `tenant_isolation`.
    pub fn share(&self, key: Option<&KeyEntry>, headers: &HeaderMap) -> Option<usize> {
        if let Some(key) = key {
            return Some(key.share);
        }
        let hash = kvroute_core::hash::stable_hash(self.header_tenant(headers)?);
        Some((hash % crate::model::shares::HEADER_TENANT_SHARES as u64) as usize)
    }

    /// Whether the response to the request with `headers` may carry decision details:
    /// `expose_decision_headers`, or the admin token presented in `x-kvroute-admin-token` or
    /// as `Authorization: Bearer` (compared in constant time).
    pub fn may_see_decisions(&self, headers: &HeaderMap) -> bool {
        if self.expose_decisions {
            return true;
        }
        if !self.admin_token.is_set() {
            return false;
        }
        let presented = [
            headers.get(ADMIN_TOKEN_HEADER).and_then(|v| v.to_str().ok()).map(str::trim),
            crate::api_keys::bearer(headers),
        ];
        presented.into_iter().flatten().any(|p| self.admin_token.matches(p))
    }
}

/// `info`'s routing key (text, token ids, session) salted for its tenant, in place.
pub fn salt_routing_key(info: &mut RoutingInfo, salt: TenantSalt) {
    if !info.text.is_empty() {
        info.text = salt.salt_text(&info.text);
    }
    if let Some(t) = &info.token_ids {
        info.token_ids = Some(salt.salt_tokens(t));
    }
    if let Some(sid) = &info.session {
        info.session = Some(salt.salt_session(sid));
    }
}

/// The request body with `"cache_salt": salt` as its last field (a client's own
/// `cache_salt` replaced), for engines that isolate their KV caches by it (vLLM). A body
/// that is not a JSON object is returned as it is.
pub fn with_cache_salt(body: &Bytes, salt: TenantSalt) -> Bytes {
    let value = salt.cache_salt();
    let has_own = body.windows(12).any(|w| w == b"\"cache_salt\"");
    if has_own {
        // Rare: rebuild the object without the client's field.
        let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<serde_json::Value>(body) else {
            return body.clone();
        };
        m.insert("cache_salt".into(), serde_json::Value::String(value));
        return serde_json::to_vec(&m).map(Bytes::from).unwrap_or_else(|_| body.clone());
    }
    // b'\x7b' and b'\x7d' are the braces (spelled so line-based tools count no brace).
    if body.iter().find(|b| !b.is_ascii_whitespace()).is_none_or(|b| *b != b'\x7b') {
        return body.clone();
    }
    let Some(end) = body.iter().rposition(|b| *b == b'\x7d') else { return body.clone() };
    let before = body[..end].iter().rposition(|b| !b.is_ascii_whitespace());
    let empty = before.is_some_and(|i| body[i] == b'\x7b');
    let mut out = Vec::with_capacity(body.len() + 50);
    out.extend_from_slice(&body[..end]);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(b"\"cache_salt\":\"");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\"");
    out.extend_from_slice(&body[end..]);
    Bytes::from(out)
}

/// Removes the decision headers from a response the client may not see them on.
pub fn hide_decisions(headers: &mut HeaderMap) {
    for h in DECISION_HEADERS {
        headers.remove(h);
    }
}

/// `e` as a client sees it: a server error's worker addresses replaced by [`A_WORKER`]
/// ([`without_addresses`]) unless the client `may_see_decisions`; the whole message goes
/// to the log when anything was replaced. Both front ends answer through it (`serve`'s
/// handler, the endpoint picker's immediate responses).
pub fn shown_to_client(e: &mut kvroute_protocol::api_error::ApiError, may_see_decisions: bool) {
    if may_see_decisions || !e.status.is_server_error() {
        return;
    }
    let shown = without_addresses(&e.message);
    if shown != e.message {
        tracing::info!(status = e.status.as_u16(), error = %e.message, "request failed");
        e.message = shown;
    }
}

/// What stands for a worker's address in an error a client may not see decision details on
/// ([`without_addresses`]).
pub const A_WORKER: &str = "a worker";

/// `message` with every URL in it — the workers' addresses that dispatch errors name (`http://10.0.0.7:8000:
/// upstream answered 500`, reqwest's `… for url (http://…/v1/chat/completions)`) — replaced
/// by [`A_WORKER`]: the error a client gets unless it may see decision details
/// ([`Tenancy::may_see_decisions`]). A URL runs from `http://` or `https://` to the first
/// whitespace, `)`, `,`, `;` or `"`, or to a `:` that ends the text or is followed by a
/// space (a message's own colon, not the port's).
pub fn without_addresses(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = ["http://", "https://"].iter().filter_map(|p| rest.find(p)).min() {
        out.push_str(&rest[..at]);
        let url = &rest[at..];
        let bytes = url.as_bytes();
        let end = (0..bytes.len())
            .find(|&i| {
                let b = bytes[i];
                b.is_ascii_whitespace()
                    // b'\x22' is the double quote (spelled so line-based tools see no string).
                    || matches!(b, b')' | b',' | b';' | b'\x22')
                    || (b == b':' && bytes.get(i + 1).is_none_or(|n| n.is_ascii_whitespace()))
            })
            .unwrap_or(bytes.len());
        out.push_str(A_WORKER);
        rest = &url[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form a dispatch error names a worker in loses the address, and the rest of the
    /// message stays.
    #[test]
    fn errors_a_client_sees_name_no_worker_address() {
        for (message, want) in [
            (
                "every attempt failed (6 made, 6 at most); last error: http://127.0.0.1:18104: upstream answered 500 Internal Server Error",
                "every attempt failed (6 made, 6 at most); last error: a worker: upstream answered 500 Internal Server Error",
            ),
            ("http://127.0.0.1:18105 did not answer within 2 s", "a worker did not answer within 2 s"),
            (
                "error sending request for url (http://gpu-3.internal:8000/v1/chat/completions)",
                "error sending request for url (a worker)",
            ),
            ("https://[fd00::7]:8443/v1/completions: reset", "a worker: reset"),
            ("the prefill worker http://p:1, then http://d:2", "the prefill worker a worker, then a worker"),
            ("ends with http://10.0.0.1:8000:", "ends with a worker:"),
            ("no address here: 500", "no address here: 500"),
        ] {
            assert_eq!(without_addresses(message), want, "{message}");
        }
    }

    #[test]
    fn cache_salt_is_the_last_field_and_replaces_the_clients() {
        let salt = TenantSalt::of("tenant:a");
        let out = with_cache_salt(&Bytes::from_static(b"{\"model\":\"m\",\"prompt\":\"x\"}\n"), salt);
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["cache_salt"], salt.cache_salt());
        assert_eq!(v["prompt"], "x");
        let out = with_cache_salt(&Bytes::from_static(b"{\"cache_salt\":\"mine\",\"prompt\":\"x\"}"), salt);
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["cache_salt"], salt.cache_salt());
        assert_eq!(out.windows(12).filter(|w| w == b"\"cache_salt\"").count(), 1);
        let out = with_cache_salt(&Bytes::from_static(b" { } "), salt);
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["cache_salt"], salt.cache_salt());
        assert_eq!(with_cache_salt(&Bytes::from_static(b"[1]"), salt), Bytes::from_static(b"[1]"));
    }

    #[test]
    fn a_salted_routing_key_keeps_its_lengths_apart_from_the_marker() {
        let mut info = RoutingInfo {
            model: "m".into(),
            text: "hello".into(),
            token_ids: Some(vec![1, 2]),
            session: Some("s".into()),
            stream: false,
            max_tokens: None,
        };
        let salt = TenantSalt::of("tenant:a");
        salt_routing_key(&mut info, salt);
        assert_eq!(kvroute_core::tenant::unsalted_text(&info.text), "hello");
        assert_eq!(kvroute_core::tenant::unsalted_tokens(info.token_ids.as_deref().expect("ids")), &[1, 2]);
        assert_ne!(info.session.as_deref(), Some("s"));
    }
}
