//! Worker URLs: the one check every URL passes (config, admin API, registry, P/D pools)
//! before the gateway stores or calls it, and the bound on how many workers it keeps.

/// Most workers the gateway accepts (bounded table).
pub const MAX_WORKERS: usize = 4096;

/// Why a worker URL (or a `worker_allow` entry) is refused. The messages name the URL,
/// with any `user:password@` redacted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerUrlError {
    /// Not parsable as a URL.
    #[error("`{url}` is not a URL: {reason}")]
    NotAUrl {
        /// The URL as given.
        url: String,
        /// The parser's message.
        reason: String,
    },
    /// Not `http` or `https`.
    #[error("`{url}`: only http and https worker URLs are accepted")]
    Scheme {
        /// The URL as given.
        url: String,
    },
    /// No host (`http:///x`).
    #[error("`{url}`: no host")]
    NoHost {
        /// The URL as given.
        url: String,
    },
    /// `user:password@` in the URL.
    #[error(
        "`{url}`: credentials in a worker URL are refused (they would show in metrics, logs and \
         `/workers`); workers receive the client's `Authorization` header (`forward_headers`)"
    )]
    Credentials {
        /// The URL, credentials redacted.
        url: String,
    },
    /// A query or a fragment.
    #[error("`{url}`: a worker URL has no query or fragment")]
    QueryOrFragment {
        /// The URL as given.
        url: String,
    },
    /// A `worker_allow` entry that is no host, address or network.
    #[error("`{entry}`: expected a host name, an IP address or a CIDR")]
    BadAllowEntry {
        /// The entry.
        entry: String,
    },
    /// The host is not in `worker_allow`.
    #[error("`{url}`: host `{host}` is not in `worker_allow`")]
    NotAllowed {
        /// The normalised URL.
        url: String,
        /// Its host.
        host: String,
    },
}

/// `worker_urls` normalised ([`check_worker_url`]), without duplicates, in
/// order: the static set of `AppState::static_workers`.
pub fn static_set(urls: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    urls.iter().filter_map(|u| check_worker_url(u).ok()).filter(|u| seen.insert(u.clone())).collect()
}

/// Accepts only absolute http(s) URLs with a host and no query or fragment; returns the
/// URL without a trailing slash.
///
/// # Errors
/// [`WorkerUrlError`] saying what is wrong.
pub fn check_worker_url(u: &str) -> Result<String, WorkerUrlError> {
    let u = u.trim();
    let url = || u.to_string();
    let parsed = url::Url::parse(u).map_err(|e| WorkerUrlError::NotAUrl { url: url(), reason: e.to_string() })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(WorkerUrlError::Scheme { url: url() });
    }
    // The URL standard reads `http:///x` as host `x`; a worker URL must name its host.
    let authority = u.split_once("://").map_or("", |(_, rest)| rest);
    if parsed.host_str().is_none_or(str::is_empty) || authority.starts_with('/') || authority.is_empty() {
        return Err(WorkerUrlError::NoHost { url: url() });
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(WorkerUrlError::Credentials { url: redact_userinfo(u) });
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(WorkerUrlError::QueryOrFragment { url: url() });
    }
    // Lower-case scheme and host, default port dropped (the parser does both), no trailing '/'.
    Ok(parsed.as_str().trim_end_matches('/').to_string())
}

/// `u` with any `user:password@` replaced by `***@`, for error messages.
fn redact_userinfo(u: &str) -> String {
    match u.split_once("://") {
        Some((scheme, rest)) => {
            let end = rest.find('/').unwrap_or(rest.len());
            match rest[..end].rfind('@') {
                Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
                None => u.to_string(),
            }
        }
        None => u.to_string(),
    }
}
