//! MySQL and MariaDB (InnoDB): the primary key is the claim.
//!
//! The claim is one multi-statement round trip, run as sqlx's own `BEGIN`
//! so that sqlx counts the transaction: set the orphan bound, `START
//! TRANSACTION`, `INSERT ... ON DUPLICATE KEY UPDATE` under the claim's
//! lock wait, which fails if it did not take the key (another attempt
//! holds or finished it), since sqlx hands back no results of a `BEGIN`.
//! MariaDB bounds the insert's lock wait with `SET STATEMENT`; MySQL sets
//! it before and restores it after, one statement more ([`is_mariadb`]).
//! Values are inlined as hex literals (`X'..'`) or integers we formatted,
//! as on PostgreSQL.
//!
//! InnoDB facts this relies on (checked on MariaDB 10.11):
//!
//! - An insert whose primary key equals an uncommitted row waits for that
//!   row's lock; `ON DUPLICATE KEY UPDATE` asks for an exclusive record lock
//!   on the primary key (no gap lock), so the duplicate queues behind the
//!   first attempt and, after its commit, takes the committed row over if
//!   it expired or leaves it alone; after its rollback it inserts.
//! - The update clause reads the latest committed row (under its lock),
//!   whatever the transaction's snapshot. A key the claim did not take is
//!   read back with `SELECT ... FOR UPDATE`, which also sees the latest
//!   committed row (a plain `SELECT` under REPEATABLE READ might not), and
//!   the lock is already the claim's, so it never waits.
//! - The lock wait ends with error 1205 when `innodb_lock_wait_timeout`
//!   (whole seconds) runs out; that becomes 409. The claim sets it for its
//!   own insert only and restores the session's value before the handler
//!   runs. A deadlock (1213) rolls the claim back and it is retried; after a
//!   few attempts the client gets 503. Nothing is stored in either case.
//!
//! # Sub-second `wait`
//!
//! `innodb_lock_wait_timeout` counts whole seconds. `wait = 0` sets it to 0,
//! which MariaDB (10.3+) treats as "do not wait"; MySQL raises 0 to its
//! minimum of one second. A fractional `wait` rounds the lock timeout up and,
//! on MariaDB, also bounds the insert with `SET STATEMENT max_statement_time
//! = <wait> FOR` (in a `/*M! ... */` comment, which only MariaDB executes;
//! the interrupted insert, error 1969, is a 409 too). So on MariaDB `wait`
//! is honoured to the millisecond; on MySQL a duplicate may wait up to the
//! next whole second (never less than `wait`).
//!
//! # Limits
//!
//! The primary key (scope, key) must fit InnoDB's 3,072-byte index limit,
//! so a scope may be at most 2,048 bytes (a longer one is refused whole,
//! never truncated into a shared key: `protocol` answers 500 before any
//! statement runs, and the store's own check would be a store error). The stored response travels
//! hex-encoded in the commit's statement, so `max_allowed_packet` must
//! exceed twice `Idem::max_response_bytes` (16 MiB on MariaDB and 64 MiB on
//! MySQL 8 by default, against the 1 MiB default cap).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use sqlx::mysql::{MySqlRow, MySqlTransactionManager};
use sqlx::{AssertSqlSafe, MySql, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use self::sql::{claim_sql, matches};
use super::claim::Failure;
use super::rows::{finished_row, tombstone_columns};
use super::store::finished;
use super::{Claim, ClaimOutcome, OpenTx, StoreError};

mod admin;
mod outbox_store;
mod phased;
mod sql;
mod store;

/// The server's clock, as every statement of this engine reads it.
const NOW: &str = "UTC_TIMESTAMP(6)";

const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
const ER_LOCK_DEADLOCK: u16 = 1213;
/// A savepoint that does not exist: the finish's, outside a transaction.
const ER_SP_DOES_NOT_EXIST: u16 = 1305;
/// A regular expression that does not compile: how [`open_check`] stops
/// the finish outside a transaction (MariaDB).
const ER_REGEXP_ERROR: u16 = 1139;
/// MariaDB: `max_statement_time` interrupted the statement.
const ER_STATEMENT_TIMEOUT: u16 = 1969;

/// The longest scope the key column takes: the primary key (scope, key)
/// must stay within InnoDB's 3,072-byte index limit.
const MAX_SCOPE_BYTES: usize = crate::scope::MAX_SCOPE_LEN;

/// The session variable holding the lock wait the claim replaced.
const SAVED_LOCK_WAIT: &str = "@idem_saved_lock_wait";
/// MariaDB's `idle_transaction_timeout` as the session had it before the
/// claim set its own.
const SAVED_IDLE: &str = "@idem_saved_idle_transaction_timeout";
/// Puts the session's `idle_transaction_timeout` back once the claim's
/// transaction is over, so later transactions on the pooled connection
/// (keyless ones, the application's own) do not inherit it: assignments
/// for a `SET`, the first of them a user variable's, because MySQL skips
/// the executable comment and a `SET` of nothing would be an error.
macro_rules! restore_idle {
    () => {
        "@idem_idle_restored = 1 \
         /*M!100300 , SESSION idle_transaction_timeout = \
         CAST(COALESCE(@idem_saved_idle_transaction_timeout, @@SESSION.idle_transaction_timeout) \
         AS UNSIGNED) */"
    };
}
/// [`restore_idle!`] as the assignments of a larger `SET`.
const RESTORE_IDLE_ASSIGNMENTS: &str = restore_idle!();
/// [`restore_idle!`] as a statement.
const RESTORE_IDLE: &str = concat!("SET ", restore_idle!());
/// BIGINT UNSIGNED out of range: how [`fail_if`] stops a batch, so the
/// claim says the key is another attempt's, and the finish that its
/// `UPDATE` missed. No other statement of those batches does arithmetic
/// that could overflow.
const ER_DATA_OUT_OF_RANGE: u16 = 1690;

/// An expression that fails its statement, with [`ER_DATA_OUT_OF_RANGE`],
/// where `condition` holds: `~0 + 1` overflows, and an overflow is an error
/// whatever the session's `sql_mode`. `condition` must never be `NULL`
/// (`NULL` would pass). A `SET` evaluates all its expressions before it
/// assigns any, so a failing one leaves every variable of its statement as
/// it was. It replaced a `SELECT ... INTO` of two rows, whose derived
/// table cost the server a temporary table per request.
fn fail_if(condition: &str) -> String {
    format!("~0 + ({condition})")
}

/// Whether the server behind `pool` is MariaDB, whose claim and finish
/// are shorter batches than MySQL's: `SET STATEMENT` bounds the claim's
/// lock wait for its insert alone (MySQL sets and restores the session's),
/// and `@@in_transaction` lets the finish's `UPDATE` check that the
/// request's transaction is still open (MySQL needs a savepoint and its
/// release). `None` until [`ask`] has asked it.
fn is_mariadb(server: &str) -> Option<bool> {
    SERVERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(server)
        .copied()
}

/// Asks `server`'s kind (`SELECT VERSION()`) on `conn`, once per database
/// and process: on the first claim's own connection, which then runs its
/// batch (so a claim never needs a second connection).
async fn ask(conn: &mut sqlx::MySqlConnection, server: &str) -> Result<bool, sqlx::Error> {
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(conn)
        .await?;
    let mariadb = version.contains("MariaDB");
    SERVERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(server.to_owned(), mariadb);
    Ok(mariadb)
}

/// What [`ask`] found, by [`server_of`].
static SERVERS: LazyLock<Mutex<HashMap<String, bool>>> = LazyLock::new(Default::default);

/// The server and database `pool` connects to.
fn server_of(pool: &sqlx::Pool<MySql>) -> String {
    let options = pool.connect_options();
    format!(
        "{}:{}:{:?}/{:?}",
        options.get_host(),
        options.get_port(),
        options.get_socket(),
        options.get_database()
    )
}

/// Makes `pool`'s claims and finishes MySQL's, as if its server were
/// MySQL: MySQL's batches run on MariaDB too.
#[cfg(test)]
fn assume_mysql(pool: &sqlx::Pool<MySql>) {
    SERVERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(server_of(pool), false);
}

/// MariaDB: an expression, 0 inside a transaction, that outside one fails
/// its statement (before it reads a row) with [`ER_REGEXP_ERROR`]: an
/// error no other statement of the finish raises, so the finish tells a
/// transaction that ended from an `UPDATE` that missed ([`fail_if`]'s).
fn open_check() -> &'static str {
    "('' REGEXP IF(@@in_transaction = 0, '(', '')) - 1"
}

/// A claim on MySQL/MariaDB: its one multi-statement batch (shared by its
/// attempts, not copied), and what the read of a taken key's row needs.
struct MySqlClaim<'c> {
    batch: Arc<String>,
    table: &'c str,
    claim: &'c Claim<'c>,
    /// The claim's wait (zero once [`skip_wait`](super::claim::ClaimAttempt::skip_wait)).
    wait: std::time::Duration,
    /// [`server_of`] the pool.
    server: String,
    /// [`is_mariadb`]; the batch is MySQL's until it is known.
    mariadb: Option<bool>,
}

impl<'c> MySqlClaim<'c> {
    fn new(pool: &sqlx::Pool<MySql>, table: &'c str, claim: &'c Claim<'c>) -> Self {
        let server = server_of(pool);
        let mariadb = is_mariadb(&server);
        Self {
            batch: Arc::new(claim_sql(table, claim, mariadb == Some(true))),
            table,
            claim,
            wait: claim.wait,
            server,
            mariadb,
        }
    }

    fn rebuild(&mut self) {
        let claim = Claim {
            wait: self.wait,
            ..*self.claim
        };
        self.batch = Arc::new(claim_sql(self.table, &claim, self.mariadb == Some(true)));
    }
}

impl super::claim::ClaimAttempt<MySql> for MySqlClaim<'_> {
    /// The batch runs as sqlx's own `BEGIN` (its transaction manager's,
    /// with the batch as the statement), so sqlx counts the transaction: a
    /// handler's nested `begin()` on its `Tx` is then a savepoint, where on
    /// MySQL a second `BEGIN` would commit the request's transaction
    /// half-way. sqlx hands back no results of that statement, so the
    /// batch answers by succeeding (the key is ours) or failing: on a key
    /// the upsert did not take, with [`ER_DATA_OUT_OF_RANGE`] (see
    /// [`claim_sql`]); the row is then read, still locked (a
    /// locking read sees the latest commit whatever the snapshot), and the
    /// transaction rolled back, in one more round trip.
    async fn attempt(
        &mut self,
        mut conn: OpenTx<MySql>,
        _: usize,
    ) -> Result<ClaimOutcome<MySql>, Failure> {
        if self.mariadb.is_none() {
            let asked = ask(&mut conn, &self.server).await;
            match asked {
                Ok(mariadb) => {
                    self.mariadb = Some(mariadb);
                    self.rebuild();
                }
                // Not in a transaction: a connection that answered goes back.
                Err(_) => {
                    conn.release_unless_gone(&asked);
                    return Err(failure(asked.expect_err("matched")));
                }
            }
        }
        let begun = MySqlTransactionManager::begin(
            &mut conn,
            Some(AssertSqlSafe(Arc::clone(&self.batch)).into_sql_str()),
        )
        .await;
        let error = match begun {
            Ok(()) => {
                conn.mariadb = self.mariadb == Some(true);
                return Ok(ClaimOutcome::Claimed(conn));
            }
            Err(error) => error,
        };
        if number(&error) != Some(ER_DATA_OUT_OF_RANGE) {
            // A connection that was gone is closed (dropped), not reset.
            if !super::connection::is_gone::<MySql>(&error) {
                reset(conn).await;
            }
            return Err(failure(error));
        }
        // The batch stopped at its last statement, in the transaction it
        // opened (sqlx did not count it), the lock wait still the claim's
        // (the read cannot wait: the row's lock is ours).
        let read = format!(
            "SELECT status, fingerprint, headers, body, {} FROM {} \
             WHERE {} AND expires_at > UTC_TIMESTAMP(6) LIMIT 1 FOR UPDATE; {}",
            tombstone_columns(NOW),
            self.table,
            matches(self.claim),
            end_claim(),
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(read))
            .fetch_all(&mut **conn)
            .await;
        let rows = match rows {
            // The read's batch ended the transaction: whatever the row
            // says (an uncertain key, a tombstone), the connection is done.
            Ok(rows) => {
                conn.release();
                rows
            }
            Err(error) => return Err(Failure::Fatal(StoreError::Database(error))),
        };
        match rows.first().map(read_row).transpose() {
            Ok(Some(Some(finished))) => Ok(finished),
            // Unfinished, under our lock and not ours: stranded by an
            // attempt that committed and then failed (see [`claim_sql`]).
            Ok(Some(None)) => Err(Failure::InUse),
            // Gone (swept) meanwhile: the claim starts over.
            Ok(None) => Err(Failure::Retry(StoreError::Vanished)),
            Err(error) => Err(Failure::Fatal(error)),
        }
    }

    fn skip_wait(&mut self) {
        self.wait = std::time::Duration::ZERO;
        self.rebuild();
    }

    fn orphan_bound(&self) -> std::time::Duration {
        self.claim.orphan_bound()
    }
}

/// What a failed claim batch means: a lock wait that ran out is a 409, a
/// deadlock (which rolled the claim back) is tried again, and anything else
/// fails the claim.
fn failure(error: sqlx::Error) -> Failure {
    match number(&error) {
        Some(ER_LOCK_WAIT_TIMEOUT | ER_STATEMENT_TIMEOUT) => Failure::InUse,
        Some(ER_LOCK_DEADLOCK) => Failure::Retry(StoreError::Database(error)),
        _ => Failure::Fatal(StoreError::Database(error)),
    }
}

/// Ends a claim whose statements failed part-way: the batch stopped at the
/// error, so the session's lock wait may still be the claim's. A connection
/// that cannot be reset is closed (`OpenTx` drop).
async fn reset(mut conn: OpenTx<MySql>) {
    match sqlx::raw_sql(AssertSqlSafe(end_claim()))
        .execute(&mut **conn)
        .await
    {
        Ok(_) => conn.release(),
        Err(error) => {
            tracing::warn!(%error, "resetting a failed claim failed; closing the connection")
        }
    }
}

/// Ends a claim's transaction that the claim batch left open, and puts
/// back the session's lock wait and idle timeout, which a failed batch may
/// have left as the claim's.
fn end_claim() -> String {
    format!(
        "ROLLBACK; SET SESSION innodb_lock_wait_timeout = {SAVED_LOCK_WAIT}, {RESTORE_IDLE_ASSIGNMENTS}"
    )
}

/// `None`: the row is ours (just inserted or taken over, status unset).
fn read_row(row: &MySqlRow) -> Result<Option<ClaimOutcome<MySql>>, StoreError> {
    Ok(finished_row(row)?.map(finished))
}

fn number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|db| db.number()),
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests;
