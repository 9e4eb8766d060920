//! The last known etcd worker registry on disk (`state_dir`), so a replica that starts
//! while etcd is unreachable routes to the workers etcd last listed instead of to none.
//!
//! [`crate::cluster::etcd`] writes [`FILE_NAME`] in `state_dir` after each list and each
//! change of the registered workers (at most once per [`SAVE_EVERY`]): JSON, written to a
//! temporary file in the same directory, flushed to disk and renamed over the old one, so a
//! crash leaves the old file or the new one, never a mix. It reads the file only when the
//! first session of a replica fails; the workers are then added like registrations, marked
//! stale (`registration_stale` in `GET /workers`, `kvroute_etcd_registry_stale` 1) until etcd
//! answers and its list replaces them. Records are validated again when read (the URL
//! rules and `worker_allow` of the configuration in effect apply), and a file that is too
//! large, unreadable, of another version or of another `etcd_prefix` is ignored with a
//! warning.

use crate::model::registration::WorkerRecord;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The registry's file name in `state_dir`.
pub const FILE_NAME: &str = "etcd-registry.json";
/// Largest file written or read, bytes: a registry that would be larger is not saved (the
/// old file is removed, so a restart never reads a list older than the one in use).
/// Typical records are a few hundred bytes: 16 MiB holds thousands.
pub const MAX_FILE_BYTES: usize = 16 << 20;
/// The file format's version.
pub const VERSION: u32 = 1;
/// Shortest time between two writes: a burst of registrations is saved once.
pub const SAVE_EVERY: Duration = Duration::from_secs(1);

/// The file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Saved {
    /// [`VERSION`].
    pub version: u32,
    /// The `etcd_prefix` the workers were listed under (a file of another prefix is not
    /// used).
    pub etcd_prefix: String,
    /// The etcd revision of the last change included (informative).
    pub revision: i64,
    /// When it was written, seconds since the Unix epoch (informative: logged on use).
    pub saved_unix_secs: u64,
    /// The registered workers: etcd key → record.
    pub workers: BTreeMap<String, serde_json::Value>,
}

/// The registry file's path in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Writes `workers` (etcd key → record) listed under `prefix` at `revision` to `dir`
/// atomically (creating `dir` if missing). Blocking: run it off the async runtime.
///
/// # Errors
/// An I/O error, or a registry over [`MAX_FILE_BYTES`] (the old file is then removed).
pub fn save<'a>(
    dir: &Path,
    prefix: &str,
    revision: i64,
    workers: impl IntoIterator<Item = (&'a String, &'a WorkerRecord)>,
) -> anyhow::Result<()> {
    let workers = workers
        .into_iter()
        .map(|(k, r)| Ok((k.clone(), serde_json::to_value(r)?)))
        .collect::<Result<BTreeMap<_, _>, serde_json::Error>>()?;
    let saved =
        Saved { version: VERSION, etcd_prefix: prefix.to_string(), revision, saved_unix_secs: unix_secs(), workers };
    let bytes = serde_json::to_vec(&saved)?;
    let target = path(dir);
    if bytes.len() > MAX_FILE_BYTES {
        match std::fs::remove_file(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("{}: {e}", target.display()),
        }
        anyhow::bail!("the registry takes {} bytes (at most {MAX_FILE_BYTES}): not saved", bytes.len());
    }
    write_atomic(dir, FILE_NAME, &bytes)
}

/// Writes `bytes` to `dir/name` atomically (creating `dir` if missing): a temporary file in
/// `dir`, flushed to disk and renamed over the old one, so a crash leaves the old file or
/// the new one, never a mix. Blocking: run it off the async runtime.
///
/// # Errors
/// An I/O error.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let target = dir.join(name);
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(&target).map_err(|e| anyhow::anyhow!("{}: {}", target.display(), e.error))?;
    // The rename itself is durable once the directory is synced (best effort: not every
    // platform can open a directory).
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The bytes of the file at `target`, at most `max` of them: `Ok(None)` when there is no
/// file. Blocking.
///
/// # Errors
/// A message naming the file when it cannot be read or is over `max` bytes.
pub fn read_bounded(target: &Path, max: usize) -> Result<Option<Vec<u8>>, String> {
    let file = match std::fs::File::open(target) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", target.display())),
    };
    let mut bytes = Vec::new();
    file.take(max as u64 + 1).read_to_end(&mut bytes).map_err(|e| format!("{}: {e}", target.display()))?;
    if bytes.len() > max {
        return Err(format!("{}: over {max} bytes", target.display()));
    }
    Ok(Some(bytes))
}

/// What [`load`] read: the records that passed validation, and the file's age.
#[derive(Debug)]
pub struct Loaded {
    /// etcd key → record.
    pub workers: BTreeMap<String, WorkerRecord>,
    /// Records refused (invalid now: a URL rule, a size), logged.
    pub refused: usize,
    /// Seconds since it was written (0 when its clock is ahead).
    pub age_secs: u64,
}

/// Reads the registry saved in `dir` for `prefix`: `Ok(None)` when there is no file.
/// Blocking: run it off the async runtime.
///
/// # Errors
/// A message for a file that cannot be read, is over [`MAX_FILE_BYTES`], is not this
/// format, or was saved for another prefix.
pub fn load(dir: &Path, prefix: &str) -> Result<Option<Loaded>, String> {
    let target = path(dir);
    let Some(bytes) = read_bounded(&target, MAX_FILE_BYTES)? else { return Ok(None) };
    let saved: Saved = serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", target.display()))?;
    if saved.version != VERSION {
        return Err(format!("{}: version {} (this replica reads {VERSION})", target.display(), saved.version));
    }
    if saved.etcd_prefix != prefix {
        return Err(format!(
            "{}: saved for the prefix `{}`, not `{prefix}` (etcd_prefix changed)",
            target.display(),
            saved.etcd_prefix
        ));
    }
    let mut workers = BTreeMap::new();
    let mut refused = 0;
    for (key, value) in saved.workers.into_iter().take(crate::model::worker_url::MAX_WORKERS) {
        let parsed = serde_json::to_vec(&value)
            .map_err(|e| crate::model::registration::RecordError::NotARecord { reason: e.to_string() })
            .and_then(|v| WorkerRecord::parse(&v));
        match parsed {
            Ok(r) => {
                workers.insert(key, r);
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "state_dir: ignoring a saved worker record");
                refused += 1;
            }
        }
    }
    Ok(Some(Loaded { workers, refused, age_secs: unix_secs().saturating_sub(saved.saved_unix_secs) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().expect("temp dir")
    }

    fn record(url: &str) -> WorkerRecord {
        WorkerRecord::parse(
            serde_json::json!({"url": url, "role": "decode", "capacity": {"tp_size": 2}, "labels": {"zone": "a"}})
                .to_string()
                .as_bytes(),
        )
        .expect("record")
    }

    #[test]
    fn a_saved_registry_reads_back_with_its_records() {
        let dir = tempdir();
        let sub = dir.path().join("not-yet-there");
        assert!(load(&sub, "/kvroute").expect("no dir").is_none(), "no file: nothing");
        let workers: BTreeMap<String, WorkerRecord> = [
            ("/kvroute/workers/a".to_string(), record("http://10.0.0.1:8000")),
            ("/kvroute/workers/b".to_string(), record("http://10.0.0.2:8000")),
        ]
        .into();
        save(&sub, "/kvroute", 42, &workers).expect("save");
        let loaded = load(&sub, "/kvroute").expect("read").expect("a file");
        assert_eq!(loaded.workers, workers);
        assert_eq!(loaded.refused, 0);
        // Saved again with one worker fewer: the file is replaced, no temporary file stays.
        save(&sub, "/kvroute", 43, workers.iter().take(1)).expect("save");
        assert_eq!(load(&sub, "/kvroute").expect("read").expect("a file").workers.len(), 1);
        let names: Vec<String> = std::fs::read_dir(&sub)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
            .collect();
        assert_eq!(names, vec![FILE_NAME.to_string()]);
    }

    #[test]
    fn a_file_of_another_prefix_version_or_shape_is_refused_and_bad_records_are_skipped() {
        let dir = tempdir();
        let workers: BTreeMap<String, WorkerRecord> =
            [("/a/workers/x".to_string(), record("http://10.0.0.1:8000"))].into();
        save(dir.path(), "/a", 1, &workers).expect("save");
        assert!(load(dir.path(), "/b").expect_err("other prefix").contains("prefix"));
        let write = |v: serde_json::Value| std::fs::write(path(dir.path()), v.to_string()).expect("write");
        write(
            serde_json::json!({"version": 2, "etcd_prefix": "/a", "revision": 1, "saved_unix_secs": 0, "workers": {}}),
        );
        assert!(load(dir.path(), "/a").expect_err("other version").contains("version 2"));
        std::fs::write(path(dir.path()), "{not json").expect("write");
        assert!(load(dir.path(), "/a").is_err());
        write(serde_json::json!({"version": 1, "etcd_prefix": "/a", "revision": 1, "saved_unix_secs": 0,
            "workers": {"/a/workers/ok": {"url": "http://10.0.0.1:8000"}, "/a/workers/bad": {"url": "ftp://x"}}}));
        let loaded = load(dir.path(), "/a").expect("read").expect("a file");
        assert_eq!((loaded.workers.len(), loaded.refused), (1, 1));
        assert!(loaded.age_secs > 1_000_000, "saved at the epoch: {}", loaded.age_secs);
    }

    #[test]
    fn a_registry_over_the_bound_is_not_saved_and_removes_the_old_file() {
        let dir = tempdir();
        let small: BTreeMap<String, WorkerRecord> =
            [("/k/workers/a".to_string(), record("http://10.0.0.1:8000"))].into();
        save(dir.path(), "/k", 1, &small).expect("save");
        // 2,000 records of the largest labels allowed: ~26 MB of JSON.
        let mut r = record("http://10.0.0.1:8000");
        for j in 0..crate::model::registration::MAX_LABELS {
            r.labels.insert(format!("{j:03}{}", "k".repeat(125)), "v".repeat(256));
        }
        let big: BTreeMap<String, WorkerRecord> = (0..2000).map(|i| (format!("/k/workers/{i}"), r.clone())).collect();
        let e = save(dir.path(), "/k", 2, &big).expect_err("too big");
        assert!(e.to_string().contains("not saved"), "{e}");
        assert!(load(dir.path(), "/k").expect("read").is_none(), "the older list is gone");
        std::fs::write(path(dir.path()), vec![b' '; MAX_FILE_BYTES + 1]).expect("write");
        assert!(load(dir.path(), "/k").expect_err("too big").contains("over"));
    }
}
