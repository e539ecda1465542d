//! Keys this process has seen finish: which retries to answer with a plain
//! read.
//!
//! A retry usually comes back to the process that answered the first
//! attempt. For a key this process stored or replayed, `idem` reads the
//! stored response with one indexed read outside any transaction, instead
//! of opening the claim's transaction only to roll it back: one round trip
//! instead of two, and no claim statements for the database to run.
//!
//! Only a hint: the database stays the authority. A hinted key whose row
//! is gone, expired or not finished goes through the claim like any other;
//! a key finished by another process is claimed, found finished, and
//! hinted from then on. The memory is fixed: one 64-bit hash of
//! (scope, key) per slot, keyed per process, overwritten freely, no locks.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots of one key table's hints: 256 KiB of memory per `Idem`.
const SLOTS: usize = 1 << 15;

/// Hashes of (scope, key) pairs this process has seen finish.
pub(crate) struct FinishedKeys {
    slots: Box<[AtomicU64]>,
    hasher: std::collections::hash_map::RandomState,
}

impl FinishedKeys {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: Default::default(),
        }
    }

    /// The pair's hash (never 0, which marks an empty slot) and its slot.
    fn locate(&self, scope: &str, key: &str) -> (u64, &AtomicU64) {
        let hash = self.hasher.hash_one((scope, key)).max(1);
        // The low bits pick the slot; all 64 are compared.
        (hash, &self.slots[hash as usize & (SLOTS - 1)])
    }

    /// Records that the key's response is stored.
    pub(crate) fn remember(&self, scope: &str, key: &str) {
        let (hash, slot) = self.locate(scope, key);
        slot.store(hash, Ordering::Relaxed);
    }

    /// Whether this process saw the key finish (and has not forgotten it).
    pub(crate) fn seen(&self, scope: &str, key: &str) -> bool {
        let (hash, slot) = self.locate(scope, key);
        slot.load(Ordering::Relaxed) == hash
    }

    /// Drops the hint: the read found no finished response.
    pub(crate) fn forget(&self, scope: &str, key: &str) {
        let (hash, slot) = self.locate(scope, key);
        let _ = slot.compare_exchange(hash, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::FinishedKeys;

    #[test]
    fn hints_are_per_scope_and_key_and_can_be_dropped() {
        let keys = FinishedKeys::new();
        keys.remember("alice", "k1");
        assert!(keys.seen("alice", "k1"));
        // The same key in another scope, and the pair's bytes split
        // differently, are other keys.
        assert!(!keys.seen("bob", "k1"));
        assert!(!keys.seen("alicek", "1"));
        assert!(!keys.seen("alice", "k2"));
        keys.forget("bob", "k1");
        assert!(keys.seen("alice", "k1"), "forgetting another key");
        keys.forget("alice", "k1");
        assert!(!keys.seen("alice", "k1"));
    }

    #[test]
    fn each_process_hashes_differently() {
        let (a, b) = (FinishedKeys::new(), FinishedKeys::new());
        a.remember("s", "k");
        assert!(!b.seen("s", "k"));
        let first = (0..64).map(|n| a.locate("s", &n.to_string()).0);
        let second = (0..64).map(|n| b.locate("s", &n.to_string()).0);
        assert!(first.zip(second).any(|(x, y)| x != y));
    }
}
