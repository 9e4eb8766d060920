//! Selection without sorting: the few smallest items of a fleet-sized sequence (a decision's
//! winner and fallbacks). Imports nothing of the core, so every module may use it.

use smallvec::SmallVec;

/// The `k` smallest of `items`, in ascending order, read once without sorting (or holding)
/// the rest: O(n·k) comparisons, which beats a sort of the whole fleet for the handful a
/// decision keeps (its winner and fallbacks). Equal items keep their first-seen order.
pub fn smallest_k<T: Ord>(items: impl IntoIterator<Item = T>, k: usize) -> SmallVec<[T; 16]> {
    let mut best: SmallVec<[T; 16]> = SmallVec::new();
    if k == 0 {
        return best;
    }
    for item in items {
        if best.len() == k {
            if best.last().is_some_and(|last| item >= *last) {
                continue;
            }
            best.pop();
        }
        let at = best.partition_point(|x| *x <= item);
        best.insert(at, item);
    }
    best
}

/// An integer that orders `x` as [`f64::total_cmp`] does (for sort keys and ordered maps of
/// floats); [`from_total_order_key`] inverts it.
#[inline]
pub fn total_order_key(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 { !b } else { b | (1 << 63) }
}

/// The `f64` whose [`total_order_key`] is `k`.
#[inline]
pub fn from_total_order_key(k: u64) -> f64 {
    f64::from_bits(if k >> 63 == 1 { k & !(1 << 63) } else { !k })
}

/// The value of `key` in `items` (sorted by key, keys distinct), for a caller asking for
/// keys mostly in increasing order (a fleet's candidates, usually listed by worker id):
/// `next` is a cursor kept between calls (start at 0). O(1) for a key at or just past the
/// cursor, O(log n) otherwise; right in any order.
#[inline]
pub fn find_sorted<K: Ord + Copy, V: Copy>(items: &[(K, V)], next: &mut usize, key: K) -> Option<V> {
    if let Some(&(k, v)) = items.get(*next)
        && k == key
    {
        *next += 1;
        return Some(v);
    }
    // Every entry before the cursor is below `key`, and the one at it above: not there.
    let after_previous = *next == 0 || items.get(*next - 1).is_some_and(|e| e.0 < key);
    if after_previous && items.get(*next).is_none_or(|e| e.0 > key) {
        return None;
    }
    match items.binary_search_by_key(&key, |e| e.0) {
        Ok(i) => {
            *next = i + 1;
            Some(items[i].1)
        }
        Err(i) => {
            *next = i;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sorted_list_answers_keys_asked_in_any_order() {
        let items = [(1, 'a'), (5, 'b'), (9, 'c')];
        for order in [[0, 1, 5, 6, 9, 10], [10, 9, 6, 5, 1, 0], [5, 1, 9, 0, 10, 6], [9, 1, 5, 5, 0, 6]] {
            let mut next = 0;
            for k in order {
                let want = items.iter().find(|e| e.0 == k).map(|e| e.1);
                assert_eq!(find_sorted(&items, &mut next, k), want, "key {k} in order {order:?}");
            }
        }
        assert_eq!(find_sorted::<u32, char>(&[], &mut 0, 3), None);
    }

    #[test]
    fn the_k_smallest_come_out_sorted_and_ties_keep_their_order() {
        assert_eq!(smallest_k([5, 1, 4, 1, 3, 9, 2], 3).to_vec(), [1, 1, 2]);
        assert_eq!(smallest_k([3, 2, 1], 10).to_vec(), [1, 2, 3]);
        assert!(smallest_k([1, 2], 0).is_empty());
        let pairs = [(1, 'a'), (0, 'b'), (1, 'c')];
        assert_eq!(
            smallest_k(pairs.iter().map(|p| (p.0, 0)).zip(['a', 'b', 'c']), 3).iter().map(|x| x.1).collect::<String>(),
            "bac"
        );
    }
}
