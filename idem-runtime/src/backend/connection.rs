//! Connections: how a request's first statement gets one, how a lost one
//! is told apart from a failed statement, and how a transaction ends.

use std::future::Future;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

use super::{Backend, Claim};

/// How a request's first statement gets its connection from the pool
/// (see [`Idem::checked_acquire`](crate::Idem::checked_acquire)).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Acquire {
    /// An idle connection is taken as it is (`Pool::try_acquire`), without
    /// the pool's ping: the statement itself tests it, and one found gone
    /// is replaced by a checked connection and the statement run again.
    /// Without an idle connection, as `Checked`.
    #[default]
    Idle,
    /// Every connection through `Pool::acquire`: the pool's
    /// `test_before_acquire` ping and `before_acquire` hook.
    Checked,
}

/// Whether `error` says the connection itself was gone (closed by the
/// server, a restart, the network), not that a statement failed: an I/O
/// error (the server closed the socket), sqlx's SQLite worker gone, or a
/// database error the engine reads as a lost session
/// ([`Store::session_gone`](super::store::Store::session_gone)).
pub(crate) fn is_gone<DB: Backend>(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => DB::session_gone(db.as_ref()),
        _ => false,
    }
}

/// Runs `first`, a connection's first round trip, on a connection taken
/// as `acquire` says; if an idle connection taken untested was gone, once
/// more on a checked one. `first` owns the connection (it releases it, or
/// drops it to close it) and must leave nothing behind when it fails:
/// nothing it does may commit.
pub(crate) async fn on_connection<DB, T, Fut>(
    pool: &Pool<DB>,
    acquire: Acquire,
    mut first: impl FnMut(OpenTx<DB>) -> Fut,
) -> Result<T, sqlx::Error>
where
    DB: Backend,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let (conn, untested) = OpenTx::checkout(pool, acquire).await?;
    match first(conn).await {
        Err(error) if untested && is_gone::<DB>(&error) => replaced(&error),
        done => return done,
    }
    first(OpenTx::acquire(pool).await?).await
}

/// Runs `statement`, which owns the connection it is given, in autocommit
/// (see [`on_connection`]), and returns the connection to the pool unless
/// the statement found it gone.
pub(crate) async fn in_autocommit<DB, T, Fut>(
    pool: &Pool<DB>,
    acquire: Acquire,
    mut statement: impl FnMut(OpenTx<DB>) -> Fut,
) -> Result<T, sqlx::Error>
where
    DB: Backend,
    Fut: Future<Output = (OpenTx<DB>, Result<T, sqlx::Error>)>,
{
    on_connection(pool, acquire, |conn| {
        let done = statement(conn);
        async move {
            let (conn, done) = done.await;
            conn.release_unless_gone(&done);
            done
        }
    })
    .await
}

/// Notes an idle connection found gone by its first statement.
pub(crate) fn replaced(error: &dyn std::fmt::Display) {
    tracing::debug!(%error, "an idle connection was gone; its first statement runs again on a checked one");
}

/// A pooled connection that may be inside a transaction.
///
/// Dropped anywhere but through [`OpenTx::release`] (a cancelled request, a
/// panic, a failed rollback), it closes the connection instead of returning
/// it to the pool, so the server rolls the transaction back and no later
/// checkout can ever run inside it. sqlx only pings a returned connection,
/// which would not notice an open transaction.
pub struct OpenTx<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    guard: Option<Box<dyn Send + Sync>>,
    /// When the connection was handed over for the claim.
    opened: std::time::Instant,
    /// The engine ran this transaction's statements with inlined arguments
    /// rather than as prepared statements (PostgreSQL behind a pooler that
    /// does not keep them); the finish must do the same.
    pub(crate) inlined: bool,
    /// The server is MariaDB, whose finish is a shorter batch than
    /// MySQL's (see the MySQL engine's `is_mariadb`).
    pub(crate) mariadb: bool,
    /// The claim called the key table's server-side functions (PostgreSQL
    /// behind a declared pooler); the finish calls them too.
    pub(crate) functions: bool,
}

impl<DB: Database> OpenTx<DB> {
    /// Guards a connection about to begin a transaction.
    pub fn new(conn: PoolConnection<DB>) -> Self {
        Self {
            conn: Some(conn),
            guard: None,
            opened: std::time::Instant::now(),
            inlined: false,
            mariadb: false,
            functions: false,
        }
    }

    /// Whether the transaction has run long against a key's `ttl` (a tenth
    /// of it or more). A claim's row expires `ttl` after the claim; the
    /// finish of such a slow request counts the expiry from the response
    /// instead, so its response is kept about as long as the others' (and
    /// never commits already expired). Only then: the finish of a fast one
    /// leaves `expires_at`, which is indexed, alone, so PostgreSQL's update
    /// of the row stays a heap-only one.
    pub(crate) fn outlived(&self, ttl: std::time::Duration) -> bool {
        self.opened.elapsed() >= ttl / 10
    }

    /// A connection from `pool`, not yet in a transaction.
    ///
    /// sqlx's `acquire` future is several KiB (it holds the whole connect
    /// path); boxed here, it is moved once, instead of inflating every
    /// future that awaits a claim, which the handler's own future then
    /// copies at each `.await`.
    pub(crate) async fn acquire(pool: &Pool<DB>) -> Result<Self, sqlx::Error> {
        Ok(Self::new(Box::pin(pool.acquire()).await?))
    }

    /// A connection for a statement that tests it itself: with
    /// [`Acquire::Idle`], an idle one taken as it is (no ping, one round
    /// trip fewer), and then `true`, so that a failure saying it was gone
    /// ([`is_gone`]) can be retried on a checked one. Otherwise, or with no
    /// idle connection, one through `Pool::acquire`.
    pub(crate) async fn checkout(
        pool: &Pool<DB>,
        acquire: Acquire,
    ) -> Result<(Self, bool), sqlx::Error> {
        if acquire == Acquire::Idle
            && let Some(conn) = pool.try_acquire()
        {
            return Ok((Self::new(conn), true));
        }
        Ok((Self::acquire(pool).await?, false))
    }

    /// Keeps `guard` alive exactly as long as the transaction: it is dropped
    /// after the connection is released or closed. An engine's in-process
    /// bookkeeping of a claim (SQLite's in-flight keys) rides here.
    pub(crate) fn hold(mut self, guard: impl Send + Sync + 'static) -> Self {
        self.guard = Some(Box::new(guard));
        self
    }

    /// Returns the connection to the pool: call only once its transaction
    /// has ended (committed or rolled back).
    pub fn release(mut self) {
        drop(self.conn.take());
    }

    /// After a statement outside any transaction: returns the connection
    /// to the pool, unless the statement found it gone ([`is_gone`]), in
    /// which case it is closed.
    pub(crate) fn release_unless_gone<T>(self, result: &Result<T, sqlx::Error>)
    where
        DB: Backend,
    {
        if !matches!(result, Err(error) if is_gone::<DB>(error)) {
            self.release();
        }
    }
}

impl<DB: Database> std::ops::Deref for OpenTx<DB> {
    type Target = PoolConnection<DB>;

    fn deref(&self) -> &Self::Target {
        self.conn.as_ref().expect("OpenTx used after release")
    }
}

impl<DB: Database> std::ops::DerefMut for OpenTx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn.as_mut().expect("OpenTx used after release")
    }
}

impl<DB: Database> Drop for OpenTx<DB> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close_on_drop();
        }
    }
}

impl<DB: Database> std::fmt::Debug for OpenTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenTx").finish_non_exhaustive()
    }
}

/// Rolls back the connection's transaction: through sqlx's transaction
/// manager when sqlx counts it (so its depth goes back to zero), or with a
/// plain `ROLLBACK` when sqlx never counted it (a claim that failed inside
/// the statement that opened it). Every engine's [`Store::rollback`](super::store::Store::rollback).
pub(crate) async fn rollback_transaction<DB: Database>(
    conn: &mut PoolConnection<DB>,
) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    use sqlx::Connection as _;
    use sqlx_core::transaction::TransactionManager as _;

    if conn.is_in_transaction() {
        DB::TransactionManager::rollback(conn).await
    } else {
        sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await?;
        Ok(())
    }
}

/// Whether `sql`, given the claim's scope and key as its two parameters,
/// finds a row on `conn`. Every engine's [`Store::stranded`](super::store::Store::stranded).
pub(crate) async fn row_exists<DB>(
    conn: &mut PoolConnection<DB>,
    sql: String,
    claim: &Claim<'_>,
) -> Result<bool, sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(claim.scope.as_bytes())
        .bind(claim.key.as_bytes())
        .fetch_optional(&mut **conn)
        .await?;
    Ok(row.is_some())
}

/// The transactions sqlx counts on `conn` (1 while a request's is open).
pub(crate) fn transaction_depth<DB: Database>(conn: &DB::Connection) -> usize {
    use sqlx_core::transaction::TransactionManager as _;
    DB::TransactionManager::get_transaction_depth(conn)
}

/// Ends a transaction that will not commit. A connection whose rollback
/// fails is closed instead of going back to the pool.
pub(crate) async fn abandon<DB: Backend>(mut conn: OpenTx<DB>) {
    match DB::rollback(&mut conn).await {
        Ok(()) => conn.release(),
        Err(error) => tracing::warn!(%error, "rollback failed; closing the connection"),
    }
}
