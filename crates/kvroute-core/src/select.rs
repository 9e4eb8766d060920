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

#[cfg(test)]
mod tests {
    use super::*;

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
