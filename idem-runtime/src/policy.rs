//! What an `#[idempotent]` handler promises its clients, readable at run
//! time: for documentation (`idem::openapi`) and for a service's own tests.

use std::time::Duration;

use crate::protocol::{Config, KeyMode};

/// Implemented by every `#[idempotent]` handler: its idempotency policy,
/// as the attribute's arguments set it.
///
/// The attribute turns the function into a unit struct of the same name,
/// so the policy is reached through that value, with [`Policy::of`]:
///
/// ```
/// use idem_runtime::{IdempotentHandler, Policy};
/// # #[derive(Clone, Copy)]
/// # #[allow(non_camel_case_types)]
/// # struct create_charge;
/// # impl IdempotentHandler for create_charge {
/// #     const POLICY: Policy = Policy::new(true, std::time::Duration::from_secs(86_400));
/// # }
/// // #[idempotent(scope = "account", ttl = "24h")]
/// // async fn create_charge(...) -> ... { ... }
/// let policy = Policy::of(create_charge);
/// assert!(policy.key_required());
/// assert_eq!(policy.ttl().as_secs(), 24 * 60 * 60);
/// ```
pub trait IdempotentHandler {
    /// The handler's policy.
    const POLICY: Policy;
}

/// The idempotency policy of one handler: whether it needs a key, how long
/// its responses are kept, what its fingerprint leaves out and, for a
/// phased handler, its lease.
#[derive(Debug, Clone, Copy)]
pub struct Policy(Config);

impl Policy {
    /// A policy for a handler that `#[idempotent]` does not generate (one
    /// documented by hand): `key_required` as `key = "required"`, and
    /// `ttl`; the other arguments at the attribute's defaults.
    pub const fn new(key_required: bool, ttl: Duration) -> Self {
        let key = if key_required {
            KeyMode::Required
        } else {
            KeyMode::Optional
        };
        let ttl = ttl.as_millis();
        let ttl = if ttl > u64::MAX as u128 {
            u64::MAX
        } else {
            ttl as u64
        };
        Self(Config::new(ttl, 0, 30_000, key))
    }

    /// The policy of an `#[idempotent]` handler, named by its value.
    pub fn of<H: IdempotentHandler>(_handler: H) -> Self {
        H::POLICY
    }

    /// Whether a request without an `Idempotency-Key` is refused (400), as
    /// under `key = "required"`, rather than run without one.
    pub const fn key_required(&self) -> bool {
        matches!(self.0.key, KeyMode::Required)
    }

    /// How long a response is kept and replayed (`ttl`).
    pub const fn ttl(&self) -> Duration {
        self.0.ttl
    }

    /// How long after its response a key is kept as a tombstone, which
    /// refuses a late retry with `idempotency_key_expired` (`tombstone`);
    /// `None`: after `ttl` a retry runs as a new request.
    pub const fn tombstone(&self) -> Option<Duration> {
        self.0.tombstone
    }

    /// How long a concurrent duplicate waits for the first attempt before
    /// it is answered 409 (`wait`); zero for a phased handler.
    pub const fn wait(&self) -> Duration {
        self.0.wait
    }

    /// The handler's deadline (`timeout`).
    pub const fn timeout(&self) -> Duration {
        self.0.timeout
    }

    /// A phased handler's lease: how long an attempt holds its key before
    /// another may take over and resume. `None` for a handler with a `Tx`.
    pub const fn lease(&self) -> Option<Duration> {
        self.0.lease
    }

    /// The RFC 6901 JSON Pointers of the members of a JSON body that do not
    /// take part in the fingerprint (`fingerprint(exclude = [..])`).
    pub const fn excluded(&self) -> &'static [&'static str] {
        self.0.exclude
    }
}

impl Config {
    /// These arguments as a handler's public [`Policy`].
    pub const fn policy(self) -> Policy {
        Policy(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_reads_the_arguments() {
        let atomic = Config::new(86_400_000, 2_000, 30_000, KeyMode::Optional)
            .excluding(&["/client_ts"])
            .policy();
        assert!(!atomic.key_required());
        assert_eq!(atomic.ttl(), Duration::from_secs(86_400));
        assert_eq!(atomic.wait(), Duration::from_secs(2));
        assert_eq!(atomic.timeout(), Duration::from_secs(30));
        assert_eq!(atomic.lease(), None);
        assert_eq!(atomic.tombstone(), None);
        assert_eq!(atomic.excluded(), ["/client_ts"]);
        let phased = Config::new(1_000, 0, 30_000, KeyMode::Required)
            .phased(5_000)
            .tombstone(2_000)
            .policy();
        assert_eq!(phased.tombstone(), Some(Duration::from_secs(2)));
        assert!(phased.key_required());
        assert_eq!(phased.lease(), Some(Duration::from_secs(5)));
        assert!(phased.excluded().is_empty());
        let by_hand = Policy::new(true, Duration::from_secs(60));
        assert!(by_hand.key_required());
        assert_eq!(by_hand.ttl(), Duration::from_secs(60));
        assert_eq!(by_hand.lease(), None);
    }
}
