//! In-process single flight per key: for engines whose locks cannot tell a
//! duplicate from any other writer (SQLite has one write lock per
//! database), and so that duplicates waiting for a first attempt hold no
//! pool connection (every engine).
//!
//! The first attempt of `(database, table, scope, key)` in this process
//! holds a [`Flight`] until its transaction ends; a duplicate sees it and
//! waits for its release, at most until its deadline. The flight only
//! decides *how long to wait and what to answer*; the database still decides
//! who owns the key, so a lost or stale flight can never cost an effect.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;
use tokio::time::Instant;

/// One key in one table of one database.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Slot {
    database: String,
    table: String,
    scope: String,
    key: String,
}

impl Slot {
    pub(crate) fn new(database: &str, table: &str, scope: &str, key: &str) -> Self {
        Self {
            database: database.to_owned(),
            table: table.to_owned(),
            scope: scope.to_owned(),
            key: key.to_owned(),
        }
    }
}

/// A flight in progress, as duplicates find it.
#[derive(Debug, Clone)]
struct Held {
    /// Wakes (with an error) when its [`Flight`] is dropped; no value is
    /// ever sent.
    done: watch::Receiver<()>,
    /// One more reference for each duplicate waiting ([`Busy`]).
    waiters: Arc<()>,
}

/// The flights in progress.
static FLIGHTS: LazyLock<Mutex<HashMap<Slot, Held>>> = LazyLock::new(Default::default);

fn flights() -> MutexGuard<'static, HashMap<Slot, Held>> {
    // The map stays consistent under a panic: every operation is one call.
    FLIGHTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's attempt at a key; releases waiting duplicates when dropped.
#[derive(Debug)]
pub(crate) struct Flight {
    /// Boxed: a flight is held across the claim's round trips, so it sits
    /// in every claim's future.
    slot: Box<Slot>,
    done: watch::Sender<()>,
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut flights = flights();
        let ours = flights
            .get(&self.slot)
            .is_some_and(|held| held.done.same_channel(&self.done.subscribe()));
        if ours {
            flights.remove(&self.slot);
        }
    }
}

/// Another attempt of the key is in flight in this process.
#[derive(Debug)]
pub(crate) struct Busy(Held);

impl Busy {
    /// Waits for the attempt in flight to end; `false` if it is still
    /// running at `deadline`.
    pub(crate) async fn ended_by(mut self, deadline: Instant) -> bool {
        // `changed` fails once the sender is gone, which is the only way
        // a flight ends.
        tokio::time::timeout_at(deadline, self.0.done.changed())
            .await
            .is_ok()
    }
}

/// How many duplicates wait in this process for the attempt in flight for
/// `slot` (a test's way to see one wait).
pub(crate) fn waiting(slot: &Slot) -> usize {
    flights()
        .get(slot)
        .map_or(0, |held| Arc::strong_count(&held.waiters) - 1)
}

/// The attempt in flight for `slot`, if any.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) fn in_flight(slot: &Slot) -> Option<Busy> {
    flights().get(slot).cloned().map(Busy)
}

/// Takes `slot` for this attempt, or reports the attempt that holds it.
pub(crate) fn enter(slot: &Slot) -> Result<Flight, Busy> {
    let mut flights = flights();
    if let Some(held) = flights.get(slot) {
        return Err(Busy(held.clone()));
    }
    let (done, receiver) = watch::channel(());
    let held = Held {
        done: receiver,
        waiters: Arc::new(()),
    };
    flights.insert(slot.clone(), held);
    Ok(Flight {
        slot: Box::new(slot.clone()),
        done,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn slot(key: &str) -> Slot {
        Slot::new("db", "t", "scope", key)
    }

    #[tokio::test]
    async fn one_flight_per_slot_until_dropped() {
        let first = enter(&slot("sf-a")).unwrap();
        assert!(enter(&slot("sf-a")).is_err());
        let other = enter(&slot("sf-b")).unwrap();
        let busy = in_flight(&slot("sf-a")).unwrap();
        let soon = Instant::now() + Duration::from_millis(10);
        assert!(!in_flight(&slot("sf-a")).unwrap().ended_by(soon).await);
        let waiter = tokio::spawn(busy.ended_by(Instant::now() + Duration::from_secs(30)));
        drop(first);
        assert!(
            waiter.await.unwrap(),
            "dropping the flight wakes its waiters"
        );
        assert!(in_flight(&slot("sf-a")).is_none());
        let again = enter(&slot("sf-a")).unwrap();
        drop((again, other));
        assert!(in_flight(&slot("sf-b")).is_none());
    }
}
