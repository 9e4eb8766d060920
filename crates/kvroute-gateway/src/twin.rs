//! State kept in two copies so that readers never wait for a writer (the left-right
//! scheme): a writer (one at a time) updates the copy readers are not reading, makes it
//! the current one, then updates the other; a reader read-locks the current copy, or the
//! other one while a writer holds the current one. A writer the OS deschedules while it
//! holds one copy delays other writers only. The price: the state is held twice and each
//! write is made twice, so a write must be deterministic (the same call on equal copies
//! leaves them equal).
//!
//! Used for each model's policy ([`crate::routers`]) and for the engine-reported prefix
//! index of KV-event workers ([`crate::app::AppState::precise`]). The `left-right` crate
//! implements the same scheme, but it needs an owned log of every write (a commit borrows
//! its request) and a read handle per thread, which a task moving between Tokio's threads
//! cannot keep; here a writer applies the same borrowed write to both copies within one
//! call, and readers only take a shared lock.

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A state in one or two copies (see the module docs).
#[derive(Debug)]
pub struct Twin<T> {
    /// One or two copies with the same state.
    copies: Vec<RwLock<T>>,
    /// The copy readers try first: the one every finished write has reached.
    current: AtomicUsize,
    /// Serialises writers.
    writer: Mutex<()>,
}

impl<T> Twin<T> {
    /// `first`, and `second` when given: a copy equal to it (two copies; one without).
    pub fn new(first: T, second: Option<T>) -> Self {
        let mut copies = vec![RwLock::new(first)];
        copies.extend(second.map(RwLock::new));
        Twin { copies, current: AtomicUsize::new(0), writer: Mutex::new(()) }
    }

    /// How many copies are kept (1 or 2).
    pub fn copies(&self) -> usize {
        self.copies.len()
    }

    /// A copy to read: the current one, or the other while a writer holds the current one.
    /// With two copies a writer holds at most one at a time, so this waits for no writer;
    /// it retries only when a writer moved from one copy to the other between its two
    /// attempts. With one copy it waits for a writer holding it.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        if self.copies.len() == 1 {
            return self.copies[0].read();
        }
        let mut attempts = 0u32;
        loop {
            let c = self.current.load(Ordering::Acquire);
            if let Some(g) = self.copies[c].try_read() {
                return g;
            }
            if let Some(g) = self.copies[1 - c].try_read() {
                return g;
            }
            attempts += 1;
            if attempts < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Applies `f` to every copy, one at a time, the copy not being read first; returns
    /// what it returned on that first copy. `f` must be deterministic, so the copies stay
    /// equal.
    pub fn write<R>(&self, mut f: impl FnMut(&mut T) -> R) -> R {
        let _w = self.writer.lock();
        self.write_locked(&mut f)
    }

    /// [`Twin::write`] if no other writer is at work now; `None` (nothing changed) else.
    pub fn try_write<R>(&self, mut f: impl FnMut(&mut T) -> R) -> Option<R> {
        let _w = self.writer.try_lock()?;
        Some(self.write_locked(&mut f))
    }

    fn write_locked<R>(&self, f: &mut impl FnMut(&mut T) -> R) -> R {
        if self.copies.len() == 1 {
            return f(&mut self.copies[0].write());
        }
        let c = self.current.load(Ordering::Relaxed);
        let first = f(&mut self.copies[1 - c].write());
        self.current.store(1 - c, Ordering::Release);
        f(&mut self.copies[c].write());
        first
    }

    /// Test access: the write lock of copy `i`, as a writer the OS descheduled holds it,
    /// and the writers' lock.
    #[cfg(test)]
    pub(crate) fn hold(&self, i: usize) -> (parking_lot::MutexGuard<'_, ()>, parking_lot::RwLockWriteGuard<'_, T>) {
        (self.writer.lock(), self.copies[i].write())
    }
}

impl<T: Clone> Twin<T> {
    /// `state` in `copies` copies (2: a clone of it beside it; anything else: one).
    pub fn of(state: T, copies: usize) -> Self {
        let second = (copies >= 2).then(|| state.clone());
        Twin::new(state, second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_reads_the_other_copy_while_a_writer_holds_one_and_writes_reach_both() {
        let t = Twin::of(vec![1u32], 2);
        assert_eq!(
            t.write(|v| {
                v.push(2);
                v.len()
            }),
            2
        );
        for held in 0..2 {
            let _w = t.hold(held);
            // With one copy this would wait for ever (the same thread holds it).
            assert_eq!(*t.read(), [1, 2], "copy {held} held: the other has the write too");
            assert_eq!(t.try_write(|v| v.push(3)), None, "another writer at work: nothing written");
        }
        let one = Twin::of(vec![1u32], 1);
        assert_eq!(one.copies(), 1);
        one.write(|v| v.push(2));
        assert_eq!(*one.read(), [1, 2]);
    }
}
