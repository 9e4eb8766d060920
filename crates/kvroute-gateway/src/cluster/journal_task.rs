//! The journal's background task ([`super::journal`]): restores the prefix state saved in
//! `state_dir` at start, then keeps the last routed events and writes them every
//! [`SAVE_EVERY`] when they changed, and once more at shutdown.

use super::journal::{self, SAVE_EVERY};
use super::sync::{Recent, RoutedEvent};
use super::sync_task::{Wait, commit};
use crate::app::{AppState, REGISTRY_WAIT};
use std::path::PathBuf;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Runs until `cancel` (nothing without `state_dir`).
pub async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let (Some(dir), Some(j)) = (state.cfg.state_dir.clone(), state.journal.clone()) else { return };
    let Some(mut rx) = j.rx.lock().take() else { return };
    let dir = PathBuf::from(dir);
    let mut recent = Recent::bounded(super::sync::JOURNAL_MAX_BYTES);
    restore(&state, &j, &dir, &mut recent).await;
    let mut tick = tokio::time::interval(SAVE_EVERY);
    let mut dirty = false;
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            e = rx.recv() => match e {
                Some(e) => {
                    recent.push(Arc::new(e));
                    dirty = true;
                }
                None => break,
            },
            _ = tick.tick() => {
                if dirty {
                    save(&dir, &recent).await;
                    dirty = false;
                }
            }
        }
    }
    while let Ok(e) = rx.try_recv() {
        recent.push(Arc::new(e));
        dirty = true;
    }
    if dirty {
        save(&dir, &recent).await;
    }
}

/// Replays the saved events into the routers (prefix index and sessions, no load).
async fn restore(state: &AppState, j: &journal::PrefixJournal, dir: &std::path::Path, recent: &mut Recent) {
    let (d, max_age) = (dir.to_path_buf(), state.cfg.prefix_state_max_age_secs);
    if max_age <= 0.0 {
        return j.restore_done(0, 0);
    }
    let saved = match tokio::task::spawn_blocking(move || journal::load(&d, max_age)).await {
        Ok(Ok(Some(s))) => s,
        Ok(Ok(None)) | Err(_) => return j.restore_done(0, 0),
        Ok(Err(m)) => {
            tracing::warn!(error = %m, "prefix state in state_dir not restored");
            return j.restore_done(0, 0);
        }
    };
    let age = journal::age_secs(&saved);
    // The events name workers by URL: those registered in etcd must be in the fleet first.
    if !state.registry_settled(REGISTRY_WAIT).await {
        tracing::warn!(
            wait_secs = REGISTRY_WAIT.as_secs(),
            "etcd's workers not listed yet: restoring the prefix state for the workers known now"
        );
    }
    let (mut restored, mut skipped) = (0u64, 0u64);
    for r in saved.events {
        let applied = match state.fleet.by_url(&r.worker) {
            Some(w) => commit(state, &r, w.id, Wait::Block).await,
            None => false,
        };
        if applied {
            restored += 1;
            recent.push(Arc::new(r));
        } else {
            skipped += 1;
        }
    }
    j.count("restored", restored);
    j.count("skipped", skipped);
    j.restore_done(restored, age);
    tracing::info!(restored, skipped, age_secs = age, "prefix state restored from state_dir");
}

async fn save(dir: &std::path::Path, recent: &Recent) {
    let events: Vec<RoutedEvent> = recent.events.iter().map(|e| (**e).clone()).collect();
    let d = dir.to_path_buf();
    match tokio::task::spawn_blocking(move || journal::save(&d, events)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "prefix state not saved to state_dir"),
        Err(e) => tracing::warn!(error = %e, "prefix state save task failed"),
    }
}
