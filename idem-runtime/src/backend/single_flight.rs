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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;
use tokio::time::Instant;

use sqlx::Pool;

use super::{Backend, ConnectOptions};

/// One key in one table of one database: the four, each length-prefixed,
/// in one shared buffer (every first attempt builds one; a clone is a
/// reference).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Slot(Arc<[u8]>);

impl Slot {
    /// `database` writes the database's name (see `Store::flight_database`).
    pub(crate) fn new(
        database: impl FnOnce(&mut Vec<u8>),
        table: &str,
        scope: &str,
        key: &str,
    ) -> Self {
        /// Appends what `write` writes, after its length.
        fn part(bytes: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) {
            let at = bytes.len();
            bytes.extend_from_slice(&[0; 8]);
            write(bytes);
            let len = (bytes.len() - at - 8) as u64;
            bytes[at..at + 8].copy_from_slice(&len.to_le_bytes());
        }
        let mut bytes = Vec::with_capacity(64 + table.len() + scope.len() + key.len());
        part(&mut bytes, database);
        for text in [table, scope, key] {
            part(&mut bytes, |bytes| bytes.extend_from_slice(text.as_bytes()));
        }
        Self(bytes.into())
    }
}

/// A flight in progress, as duplicates find it.
#[derive(Debug, Clone)]
struct Held {
    /// Its [`Flight`]'s.
    id: u64,
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
    slot: Slot,
    id: u64,
    /// Closes when dropped, which wakes the waiters.
    _done: watch::Sender<()>,
    /// What the slot's database name is the address of (see `keep`).
    _kept: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Flight {
    /// Keeps `named` alive as long as the flight: a slot named by an
    /// address (a pool's connect options) cannot then be named by another
    /// allocation while the flight lives.
    pub(crate) fn keep(mut self, named: Arc<impl std::any::Any + Send + Sync>) -> Self {
        self._kept = Some(named);
        self
    }
}

/// Tells flights apart (a slot is taken again once its flight is gone).
static FLIGHT_IDS: AtomicU64 = AtomicU64::new(0);

impl Drop for Flight {
    fn drop(&mut self) {
        let mut flights = flights();
        let ours = flights
            .get(&self.slot)
            .is_some_and(|held| held.id == self.id);
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
    let id = FLIGHT_IDS.fetch_add(1, Ordering::Relaxed);
    let held = Held {
        id,
        done: receiver,
        waiters: Arc::new(()),
    };
    flights.insert(slot.clone(), held);
    Ok(Flight {
        slot: slot.clone(),
        id,
        _done: done,
        _kept: None,
    })
}

/// The single-flight slot of `(scope, key)` in `table` of `pool`'s
/// database, and the connect options it is named after, for its flight to
/// keep (see [`Store::flight_database`](super::store::Store::flight_database)).
pub(crate) fn flight_slot<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    scope: &str,
    key: &str,
) -> (Slot, Arc<ConnectOptions<DB>>) {
    let options = pool.connect_options();
    let database = |out: &mut Vec<u8>| DB::flight_database(&options, out);
    (Slot::new(database, table, scope, key), options)
}

/// How many duplicates of `(scope, key)` wait in this process for its
/// attempt in flight.
pub(crate) fn waiting_duplicates<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    scope: &str,
    key: &str,
) -> usize {
    waiting(&flight_slot(pool, table, scope, key).0)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn slot(key: &str) -> Slot {
        Slot::new(|out| out.extend_from_slice(b"db"), "t", "scope", key)
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
