//! The storage protocol each engine implements, once per file.
//!
//! The shared logic (outcomes, fingerprint, capture, replay) lives in
//! [`crate::protocol`]; a backend only knows how to claim a key inside a new
//! transaction, store a response in the same commit, and end a transaction.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

use crate::Error;
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
pub(crate) mod single_flight;
#[cfg(feature = "sqlite")]
mod sqlite;

/// One claim of `(scope, key)`: what a backend needs to insert the row.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The caller the key belongs to.
    pub scope: &'a str,
    /// The validated key.
    pub key: &'a str,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the stored response is kept.
    pub ttl: Duration,
    /// How long to wait for a concurrent attempt before answering 409.
    pub wait: Duration,
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimOutcome<DB: Database> {
    /// The key is ours: the connection holds an open transaction in which
    /// the claim row is the first write.
    Claimed(OpenTx<DB>),
    /// A previous attempt finished; its transaction is already closed.
    Finished {
        /// The fingerprint that attempt was made with.
        fingerprint: Fingerprint,
        /// Its stored response.
        response: StoredResponse,
    },
    /// Another attempt holds the key and did not finish within `wait`.
    InUse,
}

/// Why [`Backend::finish`] did not commit.
#[derive(Debug)]
pub enum FinishError {
    /// The request's transaction had already failed or ended before the
    /// finish: a statement of the handler's failed (PostgreSQL then refuses
    /// every statement until the rollback; InnoDB and SQLite roll some
    /// failures back whole), and the handler answered as if it had not.
    /// Nothing of the transaction commits.
    Ended(sqlx::Error),
    /// The store failed the finish: a lost connection, a refused commit.
    /// The commit may have landed, in which case a retry replays it.
    Store(sqlx::Error),
}

impl From<sqlx::Error> for FinishError {
    fn from(error: sqlx::Error) -> Self {
        Self::Store(error)
    }
}

impl std::fmt::Display for FinishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ended(error) => write!(f, "the transaction had already failed: {error}"),
            Self::Store(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for FinishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Ended(error) | Self::Store(error) => Some(error),
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

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
/// server, a restart, the network), not that a statement failed.
///
/// An I/O error (the server closed the socket: MariaDB's `wait_timeout`,
/// `KILL CONNECTION`, a restart), sqlx's SQLite worker gone, SQLSTATE class
/// 08; PostgreSQL's `57P01`..`57P03` and `57P05` (a backend terminated, or
/// ended by `idle_session_timeout`, while idle leaves its `FATAL` to be read
/// by the next statement); MySQL's errors 1053 (shutdown), 1927 (connection
/// killed) and 4031 (MySQL 8's `wait_timeout`).
pub(crate) fn is_gone(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            // MySQL's SQLSTATEs are coarse: 70100 is also a statement
            // interrupted by `max_statement_time` (1969) or `KILL QUERY`
            // (1317) on a live session. Its error numbers say more.
            #[cfg(feature = "mysql")]
            if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                // ER_SERVER_SHUTDOWN, ER_CONNECTION_KILLED,
                // ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8.0.24+ wait_timeout).
                return matches!(my.number(), 1053 | 1927 | 4031)
                    || my.code().is_some_and(|code| code.starts_with("08"));
            }
            db.code().is_some_and(|code| {
                code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03" | "57P05")
            })
        }
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
    DB: Database,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let (conn, untested) = OpenTx::checkout(pool, acquire).await?;
    match first(conn).await {
        Err(error) if untested && is_gone(&error) => replaced(&error),
        done => return done,
    }
    first(OpenTx::acquire(pool).await?).await
}

/// Notes an idle connection found gone by its first statement.
fn replaced(error: &sqlx::Error) {
    tracing::debug!(%error, "an idle connection was gone; its first statement runs again on a checked one");
}

/// A database engine `idem` can keep keys in.
///
/// Implemented for the sqlx database types of the enabled features
/// (`sqlx::Postgres` with `postgres`, `sqlx::Sqlite` with `sqlite`,
/// `sqlx::MySql` with `mysql`); sealed, because every engine must keep
/// the atomic contract, which the conformance suite checks.
pub trait Backend: Database + sealed::Sealed {
    /// Creates the key table and its expiry index if they do not exist.
    #[doc(hidden)]
    fn migrate(pool: &Pool<Self>, table: &str) -> impl Future<Output = Result<(), Error>> + Send;

    /// Opens a transaction and claims the key as its first write.
    #[doc(hidden)]
    fn claim(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome<Self>, sqlx::Error>> + Send;

    /// Reads the key's stored response, if it is finished and unexpired,
    /// with one indexed read outside any transaction: the fast path for a
    /// retry of a key this process saw finish. `None`, or a database error
    /// (the server refused the read), sends the request through
    /// [`Backend::claim`], the authority.
    #[doc(hidden)]
    fn peek(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Option<ClaimOutcome<Self>>, sqlx::Error>> + Send;

    /// Opens a plain transaction (a request without a key, `key = "optional"`).
    #[doc(hidden)]
    fn begin(
        pool: &Pool<Self>,
        acquire: Acquire,
    ) -> impl Future<Output = Result<OpenTx<Self>, sqlx::Error>> + Send;

    /// Stores the response on the claimed row and commits, in as few round
    /// trips as the engine allows. `None` commits without storing. Neither
    /// commits a transaction that has already failed or ended.
    #[doc(hidden)]
    fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&StoredResponse>,
    ) -> impl Future<Output = Result<(), FinishError>> + Send;

    /// Rolls the open transaction back.
    #[doc(hidden)]
    fn rollback(
        conn: &mut PoolConnection<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Deletes up to `batch` expired rows; returns how many went.
    #[doc(hidden)]
    fn sweep(
        pool: &Pool<Self>,
        table: &str,
        batch: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Writes the name of `pool`'s database for the in-process single
    /// flight ([`single_flight`]): attempts of one key on one name wait for
    /// each other in this process. By default the pool's own: the address
    /// of its connect options, which a flight keeps alive, so no other pool
    /// can take the address while the flight lives. (After
    /// `Pool::set_connect_options` the pool has a new name; duplicates of
    /// attempts begun before then wait in the database instead.)
    #[doc(hidden)]
    fn flight_database(options: &Arc<ConnectOptions<Self>>, out: &mut Vec<u8>) {
        out.extend_from_slice(&(Arc::as_ptr(options) as usize).to_le_bytes());
    }
}

/// A pool's connect options.
pub(crate) type ConnectOptions<DB> = <<DB as Database>::Connection as sqlx::Connection>::Options;

/// The single-flight slot of `(scope, key)` in `table` of `pool`'s
/// database, and the connect options it is named after, for its flight to
/// keep (see [`Backend::flight_database`]).
pub(crate) fn flight_slot<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    scope: &str,
    key: &str,
) -> (single_flight::Slot, Arc<ConnectOptions<DB>>) {
    let options = pool.connect_options();
    let database = |out: &mut Vec<u8>| DB::flight_database(&options, out);
    (
        single_flight::Slot::new(database, table, scope, key),
        options,
    )
}

/// Waits, holding no connection, while another attempt of `claim`'s key in
/// this process is in flight, up to the claim's `wait`: the duplicates a
/// first attempt keeps waiting then hold no pool connections (each held
/// one while its claim waited on the row lock, so a few retries of one
/// slow request could starve every other caller). The database still
/// decides: the claim that follows has what is left of the wait, and the
/// attempt that found no flight holds one (returned) until its
/// transaction ends.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn wait_in_process<'c, DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    claim: &Claim<'c>,
) -> (Option<single_flight::Flight>, Claim<'c>) {
    let (slot, options) = flight_slot(pool, table, claim.scope, claim.key);
    let deadline = tokio::time::Instant::now() + claim.wait;
    // A duplicate woken by the flight's end takes the slot in turn: if the
    // attempt rolled back, one of them claims and the rest wait for it here
    // too, not in the database holding connections (and a retry arriving
    // later finds the new claimer's flight). After a commit each replays in
    // one short round trip.
    let flight = loop {
        match single_flight::enter(&slot) {
            Ok(flight) => break Some(flight.keep(options)),
            // Boxed: the timer would otherwise sit in every claim's future.
            Err(busy) => {
                if !Box::pin(busy.ended_by(deadline)).await {
                    break None;
                }
            }
        }
    };
    let left = Claim {
        wait: deadline.saturating_duration_since(tokio::time::Instant::now()),
        ..*claim
    };
    (flight, left)
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
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) inlined: bool,
}

impl<DB: Database> OpenTx<DB> {
    /// Guards a connection about to begin a transaction.
    pub fn new(conn: PoolConnection<DB>) -> Self {
        Self {
            conn: Some(conn),
            guard: None,
            opened: std::time::Instant::now(),
            inlined: false,
        }
    }

    /// Whether the transaction has run long against a key's `ttl` (a tenth
    /// of it or more). A claim's row expires `ttl` after the claim; the
    /// finish of such a slow request counts the expiry from the response
    /// instead, so its response is kept about as long as the others' (and
    /// never commits already expired). Only then: the finish of a fast one
    /// leaves `expires_at`, which is indexed, alone, so PostgreSQL's update
    /// of the row stays a heap-only one.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn outlived(&self, ttl: std::time::Duration) -> bool {
        self.opened.elapsed() >= ttl / 10
    }

    /// A connection from `pool`, not yet in a transaction.
    ///
    /// sqlx's `acquire` future is several KiB (it holds the whole connect
    /// path); boxed here, it is moved once, instead of inflating every
    /// future that awaits a claim, which the handler's own future then
    /// copies at each `.await` (most of the wrapper's CPU, before this).
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
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn release_unless_gone<T>(self, result: &Result<T, sqlx::Error>) {
        if !matches!(result, Err(error) if is_gone(error)) {
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

/// How many times a claim is attempted while the engine asks for a retry.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const CLAIM_ATTEMPTS: usize = 3;

/// Why one claim attempt did not settle. Its transaction has been ended by
/// then (rolled back, or its connection closed).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) enum Failure {
    /// Another attempt holds the key and did not finish within `wait`: 409.
    InUse,
    /// Nothing was claimed and trying again may succeed (a deadlock, a
    /// serialization failure): retried until [`CLAIM_ATTEMPTS`], then the
    /// error.
    Retry(sqlx::Error),
    /// The claim fails with this error.
    Fatal(sqlx::Error),
}

/// One engine's claim, attempted until it settles.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) trait ClaimAttempt<DB: Database>: Send {
    /// Tries once on `conn`, a fresh connection; `number` counts from 1.
    fn attempt(
        &mut self,
        conn: OpenTx<DB>,
        number: usize,
    ) -> impl Future<Output = Result<ClaimOutcome<DB>, Failure>> + Send;
}

/// How many duplicates of `(scope, key)` wait in this process for its
/// attempt in flight.
pub(crate) fn waiting_duplicates<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    scope: &str,
    key: &str,
) -> usize {
    single_flight::waiting(&flight_slot(pool, table, scope, key).0)
}

/// A claimed key's connection holds this process's flight for the key, if
/// the claim took one, until its transaction ends.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn held<DB: Database>(
    outcome: ClaimOutcome<DB>,
    flight: Option<single_flight::Flight>,
) -> ClaimOutcome<DB> {
    match (outcome, flight) {
        (ClaimOutcome::Claimed(conn), Some(flight)) => ClaimOutcome::Claimed(conn.hold(flight)),
        (outcome, _) => outcome,
    }
}

/// Runs a claim: each attempt gets a fresh connection from `pool` (taken as
/// `acquire` says) and either settles or says how it failed. The retry
/// policy PostgreSQL and MySQL share (SQLite serializes claims in the
/// process and never retries).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn claim_with_retries<DB: Database>(
    pool: &Pool<DB>,
    mut acquire: Acquire,
    mut claim: impl ClaimAttempt<DB>,
) -> Result<ClaimOutcome<DB>, sqlx::Error> {
    let mut number = 1;
    loop {
        let (conn, untested) = OpenTx::checkout(pool, acquire).await?;
        match claim.attempt(conn, number).await {
            Ok(outcome) => return Ok(outcome),
            Err(Failure::InUse) => return Ok(ClaimOutcome::InUse),
            // Nothing a claim attempt does commits: on another connection
            // it starts afresh. Not counted as an attempt.
            Err(Failure::Retry(error) | Failure::Fatal(error)) if untested && is_gone(&error) => {
                replaced(&error);
                acquire = Acquire::Checked;
            }
            Err(Failure::Retry(_)) if number < CLAIM_ATTEMPTS => number += 1,
            Err(Failure::Retry(error) | Failure::Fatal(error)) => return Err(error),
        }
    }
}

/// Rolls back the connection's transaction: through sqlx's transaction
/// manager when sqlx counts it (so its depth goes back to zero), or with a
/// plain `ROLLBACK` when sqlx never counted it (a claim that failed inside
/// the statement that opened it). Every engine's [`Backend::rollback`].
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
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

/// A finished row as the engines without a shared row type read it:
/// `status`, `fingerprint`, `headers`, `body`.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn finished<DB: Database>(
    status: i64,
    fingerprint: &[u8],
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
) -> Result<ClaimOutcome<DB>, sqlx::Error> {
    let corrupt = || sqlx::Error::Decode("corrupt stored idempotent response".into());
    let fingerprint = Fingerprint::from_bytes(fingerprint).ok_or_else(corrupt)?;
    let response = StoredResponse::decode(
        status,
        &headers.unwrap_or_default(),
        body.unwrap_or_default(),
    )
    .ok_or_else(corrupt)?;
    Ok(ClaimOutcome::Finished {
        fingerprint,
        response,
    })
}

/// The hex form used to inline binary values into simple-protocol SQL:
/// only `[0-9a-f]` reaches the statement, so nothing can inject.
#[cfg(feature = "mysql")]
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// FNV-1a: a stable 64-bit name for any text (a statement's, an index's),
/// not a secret.
#[cfg(feature = "postgres")]
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Appends the hex form of `bytes` to `out`, two digits a byte: encoded a
/// chunk at a time on the stack from a table of digit pairs, then appended
/// whole (pushing digit by digit was a tenth of the wrapper's own CPU).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const CHUNK: usize = 512;
    const PAIRS: [[u8; 2]; 256] = {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut pairs = [[0; 2]; 256];
        let mut byte = 0;
        while byte < 256 {
            pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0xf]];
            byte += 1;
        }
        pairs
    };
    let mut digits = [0_u8; 2 * CHUNK];
    out.reserve(bytes.len() * 2);
    for chunk in bytes.chunks(CHUNK) {
        let digits = &mut digits[..2 * chunk.len()];
        for (pair, &byte) in digits.chunks_exact_mut(2).zip(chunk) {
            pair.copy_from_slice(&PAIRS[usize::from(byte)]);
        }
        out.push_str(std::str::from_utf8(digits).expect("hex digits are ASCII"));
    }
}

#[cfg(all(test, any(feature = "postgres", feature = "mysql")))]
mod tests {
    /// Every length, across the chunk boundaries, gives the plain hex form.
    #[test]
    fn push_hex_appends_lowercase_digits_across_chunks() {
        let bytes: Vec<u8> = (0..=255).cycle().take(1500).collect();
        for len in [0, 1, 255, 511, 512, 513, 1024, 1500] {
            let mut out = String::from("x");
            super::push_hex(&mut out, &bytes[..len]);
            assert_eq!(
                out,
                format!("x{}", hex::encode(&bytes[..len])),
                "{len} bytes"
            );
        }
    }
}

/// What the PostgreSQL and MySQL tests of an expired key's takeover share;
/// each engine's test writes the expired row and the lock on it.
#[cfg(all(test, any(feature = "postgres", feature = "mysql")))]
pub(crate) mod takeover_test {
    use std::future::Future;
    use std::time::Duration;

    use sqlx::Pool;

    use super::{Acquire, Backend, Claim, ClaimOutcome};
    use crate::fingerprint::Fingerprint;
    use crate::response::StoredResponse;

    /// The key the tests' expired row has: `old` in `acct`, claimed anew
    /// with the fingerprint `[1; 32]`, without a wait.
    pub(crate) fn claim() -> Claim<'static> {
        Claim {
            scope: "acct",
            key: "old",
            fingerprint: Fingerprint::from_bytes(&[1; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            wait: Duration::ZERO,
        }
    }

    /// While another transaction holds the expired row, the claim is told
    /// the key is in use (within a bound far above `wait`, so a claim that
    /// waits for the holder fails the test); once `release` has ended that
    /// transaction, the claim takes the key over and stores a 201.
    pub(crate) async fn in_use_then_taken_over<DB: Backend>(
        pool: &Pool<DB>,
        table: &str,
        release: impl Future<Output = ()>,
    ) {
        let claim = claim();
        let outcome = tokio::time::timeout(
            Duration::from_secs(5),
            DB::claim(pool, Acquire::default(), table, &claim),
        )
        .await
        .expect("the claim waited for the row's holder, not `wait`")
        .expect("claim");
        assert!(matches!(outcome, ClaimOutcome::InUse), "{outcome:?}");
        release.await;
        match DB::claim(pool, Acquire::default(), table, &claim)
            .await
            .expect("claim")
        {
            ClaimOutcome::Claimed(mut conn) => {
                let response = StoredResponse {
                    status: http::StatusCode::CREATED,
                    headers: Vec::new(),
                    body: "{}".into(),
                };
                DB::finish(&mut conn, table, Some(&claim), Some(&response))
                    .await
                    .expect("finish");
                conn.release();
            }
            other => panic!("the expired key was not taken over: {other:?}"),
        }
    }
}
