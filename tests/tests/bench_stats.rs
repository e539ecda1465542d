//! The benchmark's aggregation of rounds (`idem_tests::stats`):
//! the benchmark itself is not run by CI, its arithmetic is.

use idem_tests::stats;

use stats::{median, paired_ratio, ratio_by_round};

#[test]
fn the_median_of_odd_and_even_counts_and_of_nothing() {
    assert_eq!(median(vec![0.59, 0.83, 0.67]), 0.67);
    assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    assert_eq!(median(vec![7.0]), 7.0);
    assert!(median(Vec::new()).is_nan());
}

/// Each round's ratio pairs scenarios run seconds apart; the best round of
/// one over the best round of the other would pair a fast minute with a
/// slow one.
#[test]
fn ratios_pair_scenarios_within_a_round() {
    // Scenario 0 (baseline), 1 (idempotent); the machine slows by half
    // from round to round, the ratio stays 0.5 in each.
    let rounds = vec![vec![1000.0, 500.0], vec![500.0, 250.0], vec![250.0, 125.0]];
    assert_eq!(ratio_by_round(&rounds, 1, 0), [0.5, 0.5, 0.5]);
    assert_eq!(paired_ratio(&rounds, 1, 0), 0.5);
    // A burst of other work in one round moves the median little.
    let rounds = vec![
        vec![1000.0, 600.0],
        vec![1000.0, 200.0],
        vec![1000.0, 650.0],
    ];
    assert_eq!(paired_ratio(&rounds, 1, 0), 0.6);
}

/// A scenario not selected has 0 req/s: its rounds drop out, and a ratio
/// with no round left is NaN, never 0 or infinite.
#[test]
fn rounds_without_both_scenarios_are_left_out() {
    let rounds = vec![vec![1000.0, 0.0, 700.0], vec![900.0, 0.0, 720.0]];
    assert!(ratio_by_round(&rounds, 1, 0).is_empty());
    assert!(ratio_by_round(&rounds, 0, 1).is_empty());
    assert!(paired_ratio(&rounds, 1, 0).is_nan());
    assert_eq!(paired_ratio(&rounds, 2, 0), (0.7 + 0.8) / 2.0);
}
