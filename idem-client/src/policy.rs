//! How long to keep trying and how long to wait between attempts.

use std::time::Duration;

use rand::{Rng, RngExt};

/// How a sender retries one [`Intent`](crate::Intent): exponential backoff
/// with full jitter, inside a total budget.
///
/// After attempt `n` (counting from 0) fails in a retryable way, the sender
/// waits a random time in `[0, min(max_backoff, initial_backoff ×
/// multiplier^n)]` ("full jitter": retries of many clients spread out
/// instead of arriving together), unless the answer carried `Retry-After`,
/// which then sets the wait. A wait that would end past the budget is not
/// taken: the sender gives up with
/// [`Error::BudgetExhausted`](crate::Error::BudgetExhausted) at once.
///
/// | setting | default |
/// |---|---|
/// | [`initial_backoff`](Self::initial_backoff) | 200 ms |
/// | [`multiplier`](Self::multiplier) | 2 |
/// | [`max_backoff`](Self::max_backoff) | 10 s |
/// | [`budget`](Self::budget) | 60 s |
/// | [`max_attempts`](Self::max_attempts) | 10 |
/// | [`attempt_timeout`](Self::attempt_timeout) | none (the `reqwest::Client`'s) |
///
/// The budget is counted from the start of the first attempt and includes
/// the attempts themselves. Keep it well inside the lifetime of a key on the
/// server (`idem` keeps keys 24 hours by default): a retry after the key
/// expired is a new operation. 60 seconds covers a deploy or a failover and
/// stays far from any key lifetime.
///
/// ```
/// use std::time::Duration;
/// use idem_client::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .initial_backoff(Duration::from_millis(100))
///     .max_backoff(Duration::from_secs(5))
///     .budget(Duration::from_secs(30))
///     .attempt_timeout(Duration::from_secs(10));
/// assert_eq!(policy.backoff_bound(0), Duration::from_millis(100));
/// assert_eq!(policy.backoff_bound(3), Duration::from_millis(800));
/// assert_eq!(policy.backoff_bound(10), Duration::from_secs(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    initial_backoff: Duration,
    multiplier: u32,
    max_backoff: Duration,
    budget: Duration,
    max_attempts: u32,
    attempt_timeout: Option<Duration>,
}

impl RetryPolicy {
    /// The defaults in the table above.
    pub const fn new() -> Self {
        Self {
            initial_backoff: Duration::from_millis(200),
            multiplier: 2,
            max_backoff: Duration::from_secs(10),
            budget: Duration::from_secs(60),
            max_attempts: 10,
            attempt_timeout: None,
        }
    }

    /// The ceiling of the first wait.
    pub const fn initial_backoff(mut self, initial: Duration) -> Self {
        self.initial_backoff = initial;
        self
    }

    /// How much the ceiling grows per retry; at least 1.
    pub const fn multiplier(mut self, multiplier: u32) -> Self {
        self.multiplier = if multiplier == 0 { 1 } else { multiplier };
        self
    }

    /// The largest ceiling of a backoff wait. A `Retry-After` may ask for
    /// longer and is honoured within the budget.
    pub const fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max;
        self
    }

    /// The total time from the start of the first attempt after which no
    /// wait ends and no attempt starts.
    pub const fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// The most attempts, the first included; at least 1.
    pub const fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = if attempts == 0 { 1 } else { attempts };
        self
    }

    /// A timeout for each attempt (reqwest's request timeout, covering the
    /// response body), shortened to what is left of the budget. Without it,
    /// an attempt takes as long as the `reqwest::Client` lets it.
    pub const fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The ceiling of the wait before retry `retry` (0 after the first
    /// attempt): `min(max_backoff, initial_backoff × multiplier^retry)`.
    pub fn backoff_bound(&self, retry: u32) -> Duration {
        let growth = self.multiplier.saturating_pow(retry);
        self.initial_backoff
            .saturating_mul(growth)
            .min(self.max_backoff)
    }

    /// A full-jitter wait before retry `retry`: uniform in
    /// `[0, backoff_bound(retry)]`, drawn from `rng`.
    ///
    /// ```
    /// use rand::{SeedableRng, rngs::StdRng};
    /// use idem_client::RetryPolicy;
    ///
    /// let policy = RetryPolicy::default();
    /// let mut rng = StdRng::seed_from_u64(7);
    /// for retry in 0..8 {
    ///     assert!(policy.backoff(retry, &mut rng) <= policy.backoff_bound(retry));
    /// }
    /// ```
    pub fn backoff<R: Rng + ?Sized>(&self, retry: u32, rng: &mut R) -> Duration {
        self.backoff_with(retry, |max| rng.random_range(0..=max))
    }

    pub(crate) fn backoff_with(&self, retry: u32, draw: impl FnOnce(u64) -> u64) -> Duration {
        let bound = self.backoff_bound(retry);
        let nanos = u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(draw(nanos).min(nanos))
    }

    pub(crate) fn get_budget(&self) -> Duration {
        self.budget
    }

    pub(crate) fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }

    pub(crate) fn get_attempt_timeout(&self) -> Option<Duration> {
        self.attempt_timeout
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn bounds_grow_by_the_multiplier_up_to_the_cap() {
        let policy = RetryPolicy::new()
            .initial_backoff(Duration::from_millis(100))
            .multiplier(3)
            .max_backoff(Duration::from_secs(2));
        let bounds: Vec<_> = (0..5).map(|n| policy.backoff_bound(n)).collect();
        let ms = Duration::from_millis;
        assert_eq!(bounds, [ms(100), ms(300), ms(900), ms(2000), ms(2000)]);
        assert_eq!(policy.backoff_bound(u32::MAX), ms(2000));
    }

    #[test]
    fn full_jitter_spans_zero_to_the_bound() {
        let policy = RetryPolicy::new();
        let mut rng = StdRng::seed_from_u64(42);
        for retry in 0..10 {
            let bound = policy.backoff_bound(retry);
            let draws: Vec<_> = (0..2000).map(|_| policy.backoff(retry, &mut rng)).collect();
            assert!(draws.iter().all(|d| *d <= bound));
            // Full jitter, not "equal jitter" (bound/2 + random): both ends
            // of the range are reached.
            assert!(draws.iter().any(|d| *d < bound / 20), "retry {retry}");
            assert!(draws.iter().any(|d| *d > bound * 19 / 20), "retry {retry}");
        }
    }

    #[test]
    fn zero_attempts_and_multiplier_are_raised_to_one() {
        let policy = RetryPolicy::new().max_attempts(0).multiplier(0);
        assert_eq!(policy.get_max_attempts(), 1);
        assert_eq!(policy.backoff_bound(5), policy.backoff_bound(0));
    }
}
