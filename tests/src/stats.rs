//! How the benchmark turns rounds into ratios; also tested by
//! `tests/bench_stats.rs`, so CI checks it.

/// `rounds[r][a] / rounds[r][b]` for every round `r` where both ran (a
/// scenario not run in a round has 0 req/s there, and its ratios are left
/// out rather than 0, infinite or NaN; so are those of a round whose
/// requests all failed, which the benchmark reports as errors).
pub fn ratio_by_round(rounds: &[Vec<f64>], a: usize, b: usize) -> Vec<f64> {
    rounds
        .iter()
        .map(|round| round[a] / round[b])
        .filter(|ratio| ratio.is_finite() && *ratio > 0.0)
        .collect()
}

/// The median of `a / b` over the rounds (NaN without a round that ran
/// both). A shared machine's speed drifts by a fifth or more within
/// minutes; the scenarios of one round run seconds apart, so each round's
/// ratio compares like with like, and the median drops a round that a
/// burst of other work hit. A ratio of the best rounds would pair
/// measurements taken minutes apart.
pub fn paired_ratio(rounds: &[Vec<f64>], a: usize, b: usize) -> f64 {
    median(ratio_by_round(rounds, a, b))
}

/// The median of `values` (NaN when empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}
