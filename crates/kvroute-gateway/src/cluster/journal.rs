//! The prefix state on disk (`state_dir`), so a router that restarts — alone, or with every
//! other replica of its cluster — routes its first requests on what it routed before
//! instead of on an empty index (the engines kept their KV caches; only the router forgot).
//!
//! ```text
//! dispatch::commit ──try_send──► queue (65,536) ──► journal task: the last routed events
//!                                                   (100,000 or 64 MiB,
//!                                                   JOURNAL_MAX_BYTES), written to
//!                                                   state_dir/prefix-state.msgpack every
//!                                                   SAVE_EVERY when changed, and at shutdown
//! start: the file, if younger than prefix_state_max_age_secs, replayed into the routers
//!        (prefix index, sessions; no load: those requests are over) before routing
//! ```
//!
//! The events are the cluster sync's [`RoutedEvent`]s (a text-keyed policy's carry the
//! prompt's first 128 KiB: the file holds prompt text — keep `state_dir` private). The
//! request path only `try_send`s; a full queue drops the event (counted). The file is
//! msgpack, written atomically ([`super::last_known::write_atomic`]); a file that is too
//! large, unreadable, of another version or too old is ignored with a warning. An event for
//! a worker no longer in the fleet, or decided by another policy than the model's router
//! runs now, is skipped.

use super::sync::{Announce, RoutedEvent};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;

/// The file's name in `state_dir`.
pub const FILE_NAME: &str = "prefix-state.msgpack";
/// The file format's version.
pub const VERSION: u32 = 1;
/// Largest file read, bytes (the log it holds is bounded by `JOURNAL_MAX_BYTES`, estimated).
pub const MAX_FILE_BYTES: usize = 80 << 20;
/// How often the log is written when it changed.
pub const SAVE_EVERY: Duration = Duration::from_secs(10);
/// Events waiting for the journal task; beyond this the request path drops them.
pub const QUEUE: usize = 65_536;

/// The file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Saved {
    /// [`VERSION`].
    pub version: u32,
    /// When it was written, seconds since the Unix epoch.
    pub saved_unix_secs: u64,
    /// Routed events, oldest first.
    pub events: Vec<RoutedEvent>,
}

/// The request path's side: a bounded queue to the journal task.
#[derive(Debug)]
pub struct PrefixJournal {
    tx: mpsc::Sender<RoutedEvent>,
    /// Taken once by the journal task.
    pub(crate) rx: parking_lot::Mutex<Option<mpsc::Receiver<RoutedEvent>>>,
    outcomes: prometheus_client::metrics::family::Family<
        crate::metrics::OutcomeLabel,
        prometheus_client::metrics::counter::Counter,
    >,
    /// Whether the start-up restore is over (done, nothing to restore, or refused): the
    /// router is ready only then.
    restored: std::sync::atomic::AtomicBool,
    /// Events restored at start, and the restored file's age then, seconds.
    restored_events: std::sync::atomic::AtomicU64,
    restored_age_secs: std::sync::atomic::AtomicU64,
}

impl PrefixJournal {
    /// A journal counting into `metrics` (`kvroute_prefix_state_events_total`).
    pub fn new(metrics: &crate::metrics::Metrics) -> PrefixJournal {
        let (tx, rx) = mpsc::channel(QUEUE);
        for o in ["recorded", "dropped", "restored", "skipped"] {
            drop(metrics.prefix_state_events.get_or_create(&crate::metrics::OutcomeLabel { outcome: o.into() }));
        }
        PrefixJournal {
            tx,
            rx: parking_lot::Mutex::new(Some(rx)),
            outcomes: metrics.prefix_state_events.clone(),
            restored: std::sync::atomic::AtomicBool::new(false),
            restored_events: std::sync::atomic::AtomicU64::new(0),
            restored_age_secs: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether the start-up restore is over.
    pub fn is_restored(&self) -> bool {
        self.restored.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The start-up restore ended: `events` restored from a file `age_secs` old.
    pub(crate) fn restore_done(&self, events: u64, age_secs: u64) {
        use std::sync::atomic::Ordering::{Relaxed, Release};
        self.restored_events.store(events, Relaxed);
        self.restored_age_secs.store(age_secs, Relaxed);
        self.restored.store(true, Release);
    }

    /// What `GET /workers` shows of it: `{"restored": bool, "restored_events": n,
    /// "restored_age_secs": s}`.
    pub fn status(&self) -> serde_json::Value {
        use std::sync::atomic::Ordering::Relaxed;
        serde_json::json!({
            "restored": self.is_restored(),
            "restored_events": self.restored_events.load(Relaxed),
            "restored_age_secs": self.restored_age_secs.load(Relaxed),
        })
    }

    /// Records a dispatch (never blocks: a full queue drops it).
    pub fn record(&self, a: &Announce<'_>) {
        let outcome = if self.tx.try_send(RoutedEvent::of(a, 0)).is_ok() { "recorded" } else { "dropped" };
        self.count(outcome, 1);
    }

    pub(crate) fn count(&self, outcome: &str, n: u64) {
        self.outcomes.get_or_create(&crate::metrics::OutcomeLabel { outcome: outcome.into() }).inc_by(n);
    }
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// How long ago `saved` was written, seconds (0 when its clock is ahead).
pub fn age_secs(saved: &Saved) -> u64 {
    unix_secs().saturating_sub(saved.saved_unix_secs)
}

/// Writes `events` to `dir` atomically. Blocking: run it off the async runtime.
///
/// # Errors
/// An I/O or encoding error.
pub fn save(dir: &Path, events: Vec<RoutedEvent>) -> anyhow::Result<()> {
    let saved = Saved { version: VERSION, saved_unix_secs: unix_secs(), events };
    let bytes = rmp_serde::to_vec_named(&saved)?;
    super::last_known::write_atomic(dir, FILE_NAME, &bytes)
}

/// Reads the events saved in `dir` when the file is at most `max_age_secs` old:
/// `Ok(None)` when there is no file. Blocking: run it off the async runtime.
///
/// # Errors
/// A message for a file that cannot be read, is over [`MAX_FILE_BYTES`], is not this
/// format, or is older than `max_age_secs` (its age named).
pub fn load(dir: &Path, max_age_secs: f64) -> Result<Option<Saved>, String> {
    let target = dir.join(FILE_NAME);
    let Some(bytes) = super::last_known::read_bounded(&target, MAX_FILE_BYTES)? else { return Ok(None) };
    let saved: Saved = rmp_serde::from_slice(&bytes).map_err(|e| format!("{}: {e}", target.display()))?;
    if saved.version != VERSION {
        return Err(format!("{}: version {} (this router reads {VERSION})", target.display(), saved.version));
    }
    let age = unix_secs().saturating_sub(saved.saved_unix_secs);
    if age as f64 > max_age_secs {
        return Err(format!(
            "{}: saved {age} s ago, older than prefix_state_max_age_secs ({max_age_secs} s): not restored",
            target.display()
        ));
    }
    Ok(Some(saved))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::sync::WirePrefix;

    fn event(worker: &str) -> RoutedEvent {
        RoutedEvent {
            id: 0,
            model: "m".into(),
            worker: worker.into(),
            policy: "cache_aware".into(),
            prefix: WirePrefix::Text("a document".into()),
            blocks: vec![1, 2, 3],
            block_tokens: 16,
            session: Some("s".into()),
            input_tokens: 48,
            output_tokens: Some(8),
            uncached: 48,
            decode: 8,
            pool: 0,
            repeat: false,
        }
    }

    #[test]
    fn saved_events_load_back_and_a_stale_or_foreign_file_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        assert_eq!(load(dir.path(), 600.0), Ok(None));
        save(dir.path(), vec![event("http://w1:8000"), event("http://w2:8000")]).expect("save");
        let back = load(dir.path(), 600.0).expect("read").expect("a file");
        assert_eq!(back.events, vec![event("http://w1:8000"), event("http://w2:8000")]);
        // Too old for a zero age limit only if a second has passed: use a negative limit.
        assert!(load(dir.path(), -1.0).expect_err("stale").contains("prefix_state_max_age_secs"));
        std::fs::write(dir.path().join(FILE_NAME), b"not msgpack").expect("write");
        assert!(load(dir.path(), 600.0).is_err());
    }
}
