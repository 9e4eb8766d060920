//! Trace transforms shared by the replay simulator and the load generator.
//!
//! - [`cap_turns`]: B3's capped transform (`build_capped_trace`, MAX_TURNS 8):
//!   keep each session's first `max_turns` turns, ordered by (turn id, timestamp), then
//!   restore wall-clock order.

use std::collections::HashMap;

/// B3 `cache_aware_proxy.py`'s default cap on turns per session.
pub const MAX_TURNS: usize = 8;

/// The fields [`cap_turns`] needs from a trace record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TurnKey {
    /// Session id (any stable encoding, e.g. a hash of the id string).
    pub session: u64,
    /// Turn number within the session.
    pub turn: u64,
    /// Arrival time (any monotone unit).
    pub timestamp: u64,
}

/// B3 `cache_aware_proxy.py`'s capped-trace transform: groups `records` by session, keeps each session's
/// first `max_turns` by (turn, timestamp), and returns the survivors in timestamp order
/// (stable: equal timestamps keep their input order). O(n log n).
pub fn cap_turns<T>(records: Vec<T>, max_turns: usize, key: impl Fn(&T) -> TurnKey) -> Vec<T> {
    let mut by_session: HashMap<u64, Vec<(TurnKey, usize)>> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        let k = key(r);
        by_session.entry(k.session).or_default().push((k, i));
    }
    let mut keep = vec![false; records.len()];
    for turns in by_session.values_mut() {
        turns.sort_by_key(|(k, i)| (k.turn, k.timestamp, *i));
        for (_, i) in turns.iter().take(max_turns) {
            keep[*i] = true;
        }
    }
    let mut out: Vec<(u64, T)> =
        records.into_iter().enumerate().filter(|(i, _)| keep[*i]).map(|(_, r)| (key(&r).timestamp, r)).collect();
    out.sort_by_key(|(ts, _)| *ts);
    out.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_first_turns_per_session_in_time_order() {
        // (session, turn, ts)
        let recs = vec![(1, 0, 10), (1, 1, 20), (2, 0, 15), (1, 2, 30), (1, 3, 40), (2, 1, 35)];
        let out = cap_turns(recs, 2, |&(s, t, ts)| TurnKey { session: s, turn: t, timestamp: ts });
        assert_eq!(out, vec![(1, 0, 10), (2, 0, 15), (1, 1, 20), (2, 1, 35)]);
    }

    #[test]
    fn turn_order_not_arrival_order_decides() {
        let recs = vec![(1, 5, 1), (1, 0, 2), (1, 1, 3)];
        let out = cap_turns(recs, 2, |&(s, t, ts)| TurnKey { session: s, turn: t, timestamp: ts });
        assert_eq!(out, vec![(1, 0, 2), (1, 1, 3)]);
    }
}
