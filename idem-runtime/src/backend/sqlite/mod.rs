//! SQLite: the embedded default. One writer at a time, so the claim is the
//! first write of a `BEGIN IMMEDIATE` transaction.
//!
//! # How waiting works on SQLite
//!
//! SQLite has one write lock per database, and a claim must hold it from its
//! insert to its commit. So while one handler runs, *every* other claim
//! waits for the lock, whatever its key, and an uncommitted claim row is
//! invisible to every other connection: a duplicate cannot be recognised by
//! the database before it gets the lock. Hence two waits:
//!
//! - **The write lock**: `BEGIN IMMEDIATE` waits up to the connection's busy
//!   timeout (`SqliteConnectOptions::busy_timeout`, sqlx's default 5 s) for
//!   any other writer. A deferred `BEGIN` would not do: its upgrade to a
//!   writer fails with `SQLITE_BUSY` at once, without waiting. A claim that
//!   does not get the lock in time gets 503 + `Retry-After` ("store busy"),
//!   never 409: it does not know whose key is in the way.
//! - **A duplicate of a key in flight in this process** waits `wait` (the
//!   handler's attribute) for that attempt to end, without touching the
//!   database, then 409 (see `single_flight`). Attempts of one key in
//!   different processes sharing a file meet at the write lock instead:
//!   the later one waits for the lock, then replays (or gets 503 if the
//!   first holds the lock beyond the busy timeout).
//!
//! `SQLITE_BUSY` therefore means "store busy" at claim time (503, nothing
//! written). After `BEGIN IMMEDIATE` the transaction owns the lock, so in
//! WAL mode neither the handler's writes nor the `COMMIT` can be busy; in a
//! rollback-journal database the `COMMIT` can be (it waits for readers), and
//! then the whole transaction rolls back and the client gets 503: never an
//! effect without its stored response, and never a stored 5xx.
//!
//! A replay never takes the write lock: a finished, unexpired row is read
//! outside any transaction (WAL readers do not wait for the writer).
//!
//! Use WAL (`SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal)`);
//! [`migrate`](crate::backend::store::Store::migrate) warns when a file database is not in WAL.
//! A shared-cache in-memory database (`sqlite:file:name?mode=memory&cache=shared`)
//! works too. Shared-cache locks are per table and sqlx waits for them on
//! SQLite's unlock notification, not the busy timeout: there the write-lock
//! wait is unbounded, and even a replay's read of the key table waits for
//! the writer's commit (a duplicate of a key in flight still gets its 409
//! from the in-process wait, without touching the database).
//!
//! Values are bound, not inlined: a "round trip" to SQLite is a hop to the
//! connection's worker thread, not a network exchange.

use std::time::{SystemTime, UNIX_EPOCH};

use super::Claim;

mod admin;
mod outbox_store;
mod phased;
mod sql;
mod store;
#[cfg(test)]
pub(crate) mod tests;

/// Primary result codes (the low byte of the extended code sqlx reports).
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;

fn is_busy(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else {
        return false;
    };
    db.code()
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, SQLITE_BUSY | SQLITE_LOCKED))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}

fn ttl_ms(claim: &Claim<'_>) -> i64 {
    i64::try_from(claim.ttl.as_millis()).unwrap_or(i64::MAX)
}
