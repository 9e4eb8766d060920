//! The admin API's bearer token: `admin_token` (fixed for the process's life), or
//! `admin_token_file`, a file holding the token that is read at start and again on every
//! reload (SIGHUP, or a change seen by `reload_watch_secs`), so a token kept in a Kubernetes
//! Secret rotates without a restart.
//!
//! The file holds the token and nothing else; surrounding whitespace (the newline `echo`
//! leaves) is dropped. A file that cannot be read, is empty, or is larger than
//! [`MAX_TOKEN_FILE_BYTES`] stops the start; on a reload it keeps the token in effect.
//! Requests read the token through an `ArcSwap`, with no lock; a token is compared in
//! constant time ([`crate::api_keys::same_secret`], as API keys are).

use arc_swap::ArcSwapOption;
use std::sync::Arc;

/// Largest admin token file read (4 KiB); a larger one is refused rather than read.
pub const MAX_TOKEN_FILE_BYTES: u64 = 4 << 10;

/// The admin API's token in effect ([`AdminToken::current`]) and where it comes from.
#[derive(Debug, Default)]
pub struct AdminToken {
    /// `admin_token_file`, when the token comes from one.
    file: Option<String>,
    token: ArcSwapOption<String>,
}

/// What a [`AdminToken::reload`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenReload {
    /// The file holds another token, now in effect.
    Changed,
    /// The file holds the token in effect.
    Unchanged,
    /// The token does not come from a file: nothing to read.
    NoFile,
}

/// The token in the file at `path`, trimmed.
///
/// # Errors
/// The file cannot be read, is larger than [`MAX_TOKEN_FILE_BYTES`], is not UTF-8, or holds
/// only whitespace (the message names the file).
fn read_token(path: &str) -> anyhow::Result<String> {
    let text = crate::api_keys::read_bounded_text(path, MAX_TOKEN_FILE_BYTES, "admin_token_file")?;
    let token = text.trim();
    if token.is_empty() {
        anyhow::bail!("admin_token_file {path}: holds no token");
    }
    Ok(token.to_string())
}

impl AdminToken {
    /// The token of `admin_token`, or read from `admin_token_file` (the configuration
    /// refuses both at once); none when neither is set.
    ///
    /// # Errors
    /// As [`AdminToken::reload`]'s read: the file cannot be read or holds no token.
    pub fn new(token: Option<&str>, file: Option<&str>) -> anyhow::Result<AdminToken> {
        let from_file = file.map(read_token).transpose()?;
        let token = from_file.or_else(|| token.map(str::to_string));
        Ok(AdminToken { file: file.map(str::to_string), token: ArcSwapOption::from(token.map(Arc::new)) })
    }

    /// Whether there is a token (then the admin API is served to clients presenting it).
    pub fn is_set(&self) -> bool {
        self.token.load().is_some()
    }

    /// Whether `presented` is the token in effect, compared in constant time; `false`
    /// without a token.
    pub fn matches(&self, presented: &str) -> bool {
        self.token.load().as_deref().is_some_and(|t| crate::api_keys::same_secret(presented, t))
    }

    /// The token in effect (one atomic load).
    pub fn current(&self) -> Option<Arc<String>> {
        self.token.load_full()
    }

    /// Reads `admin_token_file` again and puts its token in effect for the requests that
    /// arrive from then on. Blocking file I/O: call it off the async runtime.
    ///
    /// # Errors
    /// The file cannot be read, is too large or holds no token (naming the file); the token
    /// in effect stays.
    pub fn reload(&self) -> anyhow::Result<TokenReload> {
        let Some(path) = &self.file else { return Ok(TokenReload::NoFile) };
        let next = read_token(path)?;
        if self.token.load().as_deref().is_some_and(|t| **t == next) {
            return Ok(TokenReload::Unchanged);
        }
        self.token.store(Some(Arc::new(next)));
        Ok(TokenReload::Changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_s_token_is_trimmed_and_replaced_on_reload_and_a_bad_file_keeps_it() {
        let dir = tempfile::Builder::new().prefix("kvroute-admin-token-").tempdir().expect("temp dir");
        let path = dir.path().join("token");
        let p = path.to_str().expect("utf-8");
        std::fs::write(&path, "first-token\n").expect("write");
        let t = AdminToken::new(None, Some(p)).expect("read");
        assert!(t.matches("first-token") && !t.matches("first-token\n") && !t.matches("other"));
        assert_eq!(t.reload().expect("same"), TokenReload::Unchanged);
        std::fs::write(&path, "  second-token \n").expect("write");
        assert_eq!(t.reload().expect("new"), TokenReload::Changed);
        assert!(t.matches("second-token") && !t.matches("first-token"));
        for bad in [&b"\n \n"[..], &vec![b'x'; MAX_TOKEN_FILE_BYTES as usize + 1]] {
            std::fs::write(&path, bad).expect("write");
            assert!(t.reload().is_err());
            assert!(t.matches("second-token"), "a bad file keeps the token in effect");
        }
        std::fs::remove_file(&path).expect("rm");
        let e = t.reload().expect_err("missing").to_string();
        assert!(e.contains("admin_token_file") && e.contains(p), "{e}");
        assert!(AdminToken::new(None, Some(p)).is_err(), "a missing file stops the start");
        let fixed = AdminToken::new(Some("fixed"), None).expect("fixed");
        assert_eq!(fixed.reload().expect("nothing"), TokenReload::NoFile);
        assert!(fixed.matches("fixed"));
        let none = AdminToken::new(None, None).expect("none");
        assert!(!none.is_set() && !none.matches(""));
    }
}
