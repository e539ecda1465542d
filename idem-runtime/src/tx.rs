//! [`Tx`]: the request's transaction, as the handler sees it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::Database;
use tokio::sync::oneshot;

use crate::backend::OpenTx;
use crate::key::IdempotencyKey;

/// The transaction an `#[idempotent]` handler runs in.
///
/// The claim of the idempotency key is its first write and the stored
/// response its last, so the handler's writes and the response commit
/// together or not at all. `&mut *tx` is an executor:
///
/// ```no_run
/// # use idem_runtime as idem;
/// # async fn demo(mut tx: idem::Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
///     .bind(100_i64)
///     .execute(&mut *tx)
///     .await?;
/// # Ok(()) }
/// ```
///
/// There is no `commit()` or `rollback()`: the wrapper commits when the
/// handler answers `Ok` (or a plain response) with a storable status (below
/// 500, not 408/429), and rolls back otherwise: on any `Err`, whatever its
/// status (as a plain sqlx handler's `?` drops its transaction), and on
/// panic. A nested `sqlx::Connection::begin(&mut *tx)` is a savepoint.
pub struct Tx<DB: Database> {
    conn: Option<OpenTx<DB>>,
    key: Option<IdempotencyKey>,
    home: Option<oneshot::Sender<Returned<DB>>>,
    /// The outbox table.
    outbox: Arc<str>,
    /// Whether [`outbox`](Self::outbox) wrote a message: the commit then
    /// wakes this process's relays.
    wrote_outbox: bool,
}

/// What a [`Tx`] hands back when dropped: its connection, and whether a
/// message was written to the outbox in its transaction.
pub(crate) type Returned<DB> = (OpenTx<DB>, bool);

impl<DB: Database> Tx<DB> {
    /// Hands a connection with an open transaction to a handler; the
    /// connection comes back through `home` when the `Tx` is dropped.
    pub(crate) fn new(
        conn: OpenTx<DB>,
        key: Option<IdempotencyKey>,
        outbox: Arc<str>,
    ) -> (Self, oneshot::Receiver<Returned<DB>>) {
        let (home, back) = oneshot::channel();
        let tx = Self {
            conn: Some(conn),
            key,
            home: Some(home),
            outbox,
            wrote_outbox: false,
        };
        (tx, back)
    }

    /// The request's idempotency key, `None` only for a request without one
    /// on a handler with `key = "optional"`.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// Notes that a message was written in the transaction.
    pub(crate) fn wrote_outbox(&mut self) {
        self.wrote_outbox = true;
    }

    /// The transaction's connection, the outbox table and the scope.
    pub(crate) fn outbox_parts(&mut self) -> (&mut DB::Connection, &str, &str) {
        let scope = self.key.as_ref().map_or("", |key| key.scope());
        (live::<DB>(&mut self.conn), &self.outbox, scope)
    }
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        let conn: &sqlx::pool::PoolConnection<DB> = self.conn.as_ref().expect("Tx used after drop");
        conn
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    /// # Panics
    ///
    /// When sqlx no longer counts the request's transaction: something in
    /// the handler ended it. sqlx 0.9 does so on PostgreSQL when a nested
    /// `begin()` fails (its `SAVEPOINT` in a transaction a caught error had
    /// failed, say) or is cancelled: it rolls back the whole transaction,
    /// the claim with it. Every statement the handler sent after that would
    /// commit on its own, outside the idempotency key's protection, so the
    /// handler is stopped instead (500, nothing committed, nothing stored).
    fn deref_mut(&mut self) -> &mut Self::Target {
        live::<DB>(&mut self.conn)
    }
}

/// The request's connection, while sqlx still counts its transaction (see
/// [`Tx::deref_mut`]).
fn live<DB: Database>(conn: &mut Option<OpenTx<DB>>) -> &mut DB::Connection {
    let conn: &mut sqlx::pool::PoolConnection<DB> = conn.as_mut().expect("Tx used after drop");
    assert!(
        crate::backend::transaction_depth::<DB>(conn) > 0,
        "idem: the request's transaction has ended inside the handler (sqlx rolls it back \
         whole when a nested begin() fails or is cancelled); refusing to run statements \
         outside it"
    );
    conn
}

impl<DB: Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        // Hand the transaction back to the wrapper to commit or roll back.
        // If nobody waits for it (the request was cancelled, or the Tx
        // outlived its handler), `OpenTx` closes the connection when
        // dropped, so the server rolls the transaction back.
        if let (Some(conn), Some(home)) = (self.conn.take(), self.home.take()) {
            let _ = home.send((conn, self.wrote_outbox));
        }
    }
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}
