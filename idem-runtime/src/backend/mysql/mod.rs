//! MySQL and MariaDB (InnoDB): the primary key is the claim.
//!
//! The claim is one multi-statement round trip, run as sqlx's own `BEGIN`
//! so that sqlx counts the transaction: set the lock wait, `START
//! TRANSACTION`, `INSERT ... ON DUPLICATE KEY UPDATE` (which records in
//! `LAST_INSERT_ID()` whether it took the key), then restore the lock wait
//! in a `SET` that fails if it did not (another attempt holds or finished
//! the key), since sqlx hands back no results of a `BEGIN`. Values are
//! inlined as hex literals (`X'..'`) or integers we formatted, as on
//! PostgreSQL.
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

use std::sync::Arc;

use sqlx::mysql::{MySqlRow, MySqlTransactionManager};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, Pool, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use self::sql::{claim_sql, delete_statements, hex, matches, store};
use super::claim::Failure;
use super::contract::finished;
use super::{Acquire, Backend, Claim, ClaimOutcome, FinishError, OpenTx, StoreError};
use crate::error::Error;
use crate::response::StoredResponse;

mod admin;
mod lease;
mod outbox;
mod sql;

impl super::contract::sealed::Sealed for MySql {}

const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
const ER_LOCK_DEADLOCK: u16 = 1213;
/// A savepoint that does not exist: the finish's, outside a transaction.
const ER_SP_DOES_NOT_EXIST: u16 = 1305;
/// MariaDB: `max_statement_time` interrupted the statement.
const ER_STATEMENT_TIMEOUT: u16 = 1969;

/// The longest scope the key column takes: the primary key (scope, key)
/// must stay within InnoDB's 3,072-byte index limit.
const MAX_SCOPE_BYTES: usize = crate::MAX_SCOPE_LEN;

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

impl Backend for MySql {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        // MySQL names an index within its table, in at most 64 characters:
        // a long table name gets a short index name rather than an error.
        let name = table.rsplit('.').next().unwrap_or(table);
        let index_name = |suffix: &str| match format!("{name}_{suffix}") {
            index if index.len() <= 64 => index,
            _ => format!("idem_{suffix}"),
        };
        let (index, lease_index) = (index_name("expires_at_idx"), index_name("lease_idx"));
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                scope VARBINARY({MAX_SCOPE_BYTES}) NOT NULL,
                `key` VARBINARY(255) NOT NULL,
                fingerprint BINARY(32) NOT NULL,
                status SMALLINT NULL,
                headers MEDIUMBLOB NULL,
                body LONGBLOB NULL,
                created_at DATETIME(6) NOT NULL,
                expires_at DATETIME(6) NOT NULL,
                lease_token BIGINT NULL,
                lease_until DATETIME(6) NULL,
                recovery LONGBLOB NULL,
                request LONGBLOB NULL,
                attempts INT NULL,
                PRIMARY KEY (scope, `key`),
                KEY {index} (expires_at),
                KEY {lease_index} (lease_until)
            ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC"
        );
        // DDL takes a metadata lock: concurrent migrations queue, no race.
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
        // The phased mode's columns came later: a table from before gets
        // them (MySQL has no `ADD COLUMN IF NOT EXISTS`; MariaDB has).
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (format!("'{schema}'"), name),
            None => ("DATABASE()".to_owned(), table),
        };
        let present: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM information_schema.columns \
             WHERE table_schema = {schema} AND table_name = '{name}' AND column_name = 'lease_token'"
        )))
        .fetch_one(pool)
        .await?;
        if present == 0 {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {table} ADD COLUMN lease_token BIGINT NULL, \
                 ADD COLUMN lease_until DATETIME(6) NULL, ADD COLUMN recovery LONGBLOB NULL, \
                 ADD COLUMN request LONGBLOB NULL, ADD COLUMN attempts INT NULL, \
                 ADD KEY {lease_index} (lease_until)"
            )))
            .execute(pool)
            .await?;
        }
        Ok(())
    }

    async fn claim(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, StoreError> {
        if claim.scope.len() > MAX_SCOPE_BYTES {
            return Err(StoreError::ScopeTooLong {
                len: claim.scope.len(),
                max: MAX_SCOPE_BYTES,
            });
        }
        let (flight, claim) = super::claim::wait_in_process(pool, table, claim).await;
        let batch = Arc::new(claim_sql(table, &claim));
        let outcome = super::claim::claim_with_retries(
            pool,
            acquire,
            MySqlClaim {
                batch,
                table,
                claim: &claim,
            },
        )
        .await;
        super::claim::held(outcome, flight)
    }

    async fn peek(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome<Self>>, StoreError> {
        // A plain (non-locking) read, its own fresh snapshot, then `COMMIT`
        // in the same round trip: in autocommit it does nothing, and on a
        // session with `autocommit` off it ends the transaction the read
        // opened, which would otherwise go back to the pool, holding a
        // stale snapshot for the connection's next reads.
        let sql = format!(
            "SELECT status, fingerprint, headers, body FROM {table} \
             WHERE {} AND status IS NOT NULL AND expires_at > UTC_TIMESTAMP(6); COMMIT",
            matches(claim)
        );
        let row = super::connection::on_connection(pool, acquire, |mut conn| {
            let sql = sql.clone();
            async move {
                let row = sqlx::raw_sql(AssertSqlSafe(sql))
                    .fetch_optional(&mut **conn)
                    .await;
                // A read that failed part-way may leave the `COMMIT` unsent
                // on a session with `autocommit` off: closed, not returned.
                if row.is_ok() {
                    conn.release();
                }
                row
            }
        })
        .await
        .map_err(StoreError::Database)?;
        Ok(row.as_ref().map(read_row).transpose()?.flatten())
    }

    async fn begin(pool: &Pool<Self>, acquire: Acquire) -> Result<OpenTx<Self>, sqlx::Error> {
        super::connection::on_connection(pool, acquire, |mut conn| async move {
            MySqlTransactionManager::begin(&mut conn, None).await?;
            Ok(conn)
        })
        .await
    }

    async fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&StoredResponse>,
    ) -> Result<(), FinishError> {
        // InnoDB rolls a whole transaction back on a deadlock, and the
        // session then runs in autocommit: a handler that caught that error
        // and answered 2xx would have its client told of writes that were
        // undone (as sqlx's own `commit()` would), and the `UPDATE` could
        // write onto a row a concurrent retry has claimed since. So the
        // finish first checks, in the same round trip, that a transaction
        // is still open: outside one, a savepoint ends with its own
        // statement and releasing it fails, which stops the batch there.
        let mut sql = String::from("SAVEPOINT idem_open; RELEASE SAVEPOINT idem_open; ");
        let store = claim
            .zip(response)
            .map(|(claim, response)| store(table, claim, response, conn.outlived(claim.ttl)));
        if let Some(store) = &store {
            // The `UPDATE` must match the claim's row (sqlx sets
            // `CLIENT_FOUND_ROWS`: rows matched, not changed). It cannot
            // miss it in the request's own transaction; it does in one a
            // session with `autocommit` off opened after a deadlock's
            // rollback, where the check above passes: then [`fail_if`], as
            // in the claim, fails the batch before its `COMMIT`, which would
            // carry what the handler wrote after the error.
            sql.push_str(store);
            sql.push_str(&format!(
                "; SET @idem_stored = {}, ",
                fail_if("ROW_COUNT() <> 1")
            ));
        } else {
            sql.push_str("SET ");
        }
        // The session's idle timeout is put back before the `COMMIT`, in
        // the check's own statement: between the statements of one batch
        // no session idles. If the check fails, nothing in its statement is
        // assigned, and the caller's rollback restores the timeout.
        sql.push_str(RESTORE_IDLE_ASSIGNMENTS);
        sql.push_str("; COMMIT; START TRANSACTION");
        let error = match sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut ***conn)
            .await
        {
            Ok(_) => {
                MySqlTransactionManager::start_rollback(conn);
                return Ok(());
            }
            Err(error) if number(&error) == Some(ER_SP_DOES_NOT_EXIST) => error,
            // The `UPDATE` missed the claim's row: the transaction open now
            // is not the request's. Rolled back by the caller.
            Err(error) if number(&error) == Some(ER_DATA_OUT_OF_RANGE) => {
                return Err(FinishError::Ended(StoreError::Database(error)));
            }
            Err(error) => return Err(FinishError::store(error)),
        };
        // No transaction was open. A statement that commits implicitly
        // (DDL, `LOCK TABLES`) ended it by committing: the claim's row is
        // then committed, unfinished, with the effects, and storing the
        // response on it (in autocommit, as the handler's later writes
        // ran) lets retries replay it, instead of claiming the row as
        // theirs and running the handler again. Otherwise the server rolled
        // the transaction back, and there is nothing to store. (The batch
        // stopped before it restored the idle timeout; the `SET` after the
        // `UPDATE` does, and counts no rows.)
        if let (Some(store), Some(claim)) = (&store, claim) {
            let stored = sqlx::raw_sql(AssertSqlSafe(format!(
                "{store} AND fingerprint = X'{}'; {RESTORE_IDLE}",
                hex(claim.fingerprint.as_bytes()),
            )))
            .execute(&mut ***conn)
            .await
            .map_err(FinishError::store)?;
            if stored.rows_affected() == 1 {
                tracing::warn!(
                    "a statement of the idempotent handler committed its transaction \
                     implicitly (DDL?); its response was stored after it, not with it"
                );
                MySqlTransactionManager::start_rollback(conn);
                return Ok(());
            }
        }
        Err(FinishError::Ended(StoreError::Database(error)))
    }

    async fn stranded(
        conn: &mut PoolConnection<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<bool, sqlx::Error> {
        // Ends with a `COMMIT`, as the replay's read does: on a session with
        // `autocommit` off the read would otherwise open a transaction the
        // pooled connection keeps.
        let sql = format!(
            "SELECT 1 FROM {table} WHERE {} AND status IS NULL; COMMIT",
            matches(claim)
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut **conn)
            .await?;
        Ok(!rows.is_empty())
    }

    async fn rollback(conn: &mut PoolConnection<Self>) -> Result<(), sqlx::Error> {
        super::connection::rollback_transaction(conn).await?;
        sqlx::raw_sql(RESTORE_IDLE).execute(&mut **conn).await?;
        Ok(())
    }

    /// By error number: MySQL's SQLSTATEs are coarse (70100 is also a
    /// statement interrupted by `max_statement_time`, 1969, or `KILL QUERY`,
    /// 1317, on a live session). ER_SERVER_SHUTDOWN, ER_CONNECTION_KILLED,
    /// ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8.0.24+ `wait_timeout`).
    fn session_gone(error: &dyn sqlx::error::DatabaseError) -> bool {
        match error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
            Some(my) => {
                matches!(my.number(), 1053 | 1927 | 4031)
                    || my.code().is_some_and(|code| code.starts_with("08"))
            }
            None => error.code().is_some_and(|code| code.starts_with("08")),
        }
    }

    async fn sweep(pool: &Pool<Self>, table: &str, batch: u32) -> Result<u64, sqlx::Error> {
        // The batch's expired rows are locked first, skipping any a claim
        // holds (a takeover whose handler is running): a plain `DELETE`
        // waited for that handler, up to the lock wait (50 s by default),
        // holding the rows it had deleted meanwhile, whose retries got 409
        // all that time. READ COMMITTED: no gap locks, so claims inserting
        // new keys never wait for the sweeper. An explicit transaction, so
        // a session with `autocommit` off commits the batch too, instead of
        // going back to the pool holding its rows' locks.
        let select = format!(
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; \
             SELECT scope, `key` FROM {table} WHERE expires_at <= UTC_TIMESTAMP(6) \
             LIMIT {batch} FOR UPDATE SKIP LOCKED"
        );
        let mut conn = pool.acquire().await?;
        let swept = async {
            let rows = sqlx::raw_sql(AssertSqlSafe(select))
                .fetch_all(&mut *conn)
                .await?
                .iter()
                .map(|row| Ok((row.try_get::<Vec<u8>, _>(0)?, row.try_get::<Vec<u8>, _>(1)?)))
                .collect::<Result<Vec<_>, sqlx::Error>>()?;
            if rows.is_empty() {
                sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
                return Ok(0);
            }
            // The rows are ours since the locking read; the expiry is
            // checked again all the same. The primary key is forced: where
            // expired rows are most of the table, MariaDB scans it instead,
            // and waits on any claim's uncommitted row it meets. In
            // statements of at most 1 MiB (a batch of long scopes would
            // pass `max_allowed_packet`), all in the one transaction.
            let mut statements = delete_statements(table, &rows, 1 << 20);
            if let Some(last) = statements.last_mut() {
                last.push_str("; COMMIT");
            }
            let mut swept = 0;
            for statement in statements {
                let done = sqlx::raw_sql(AssertSqlSafe(statement))
                    .execute(&mut *conn)
                    .await?;
                swept += done.rows_affected();
            }
            Ok(swept)
        };
        match swept.await {
            Ok(swept) => Ok(swept),
            Err(error) => {
                // The batch stopped inside its transaction: closing the
                // connection rolls it back.
                conn.close_on_drop();
                Err(error)
            }
        }
    }
}

/// A claim on MySQL/MariaDB: its one multi-statement batch (shared by its
/// attempts, not copied), and what the read of a taken key's row needs.
struct MySqlClaim<'c> {
    batch: Arc<String>,
    table: &'c str,
    claim: &'c Claim<'c>,
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
        let begun = MySqlTransactionManager::begin(
            &mut conn,
            Some(AssertSqlSafe(Arc::clone(&self.batch)).into_sql_str()),
        )
        .await;
        let error = match begun {
            Ok(()) => return Ok(ClaimOutcome::Claimed(conn)),
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
            "SELECT status, fingerprint, headers, body FROM {} \
             WHERE {} AND expires_at > UTC_TIMESTAMP(6) LIMIT 1 FOR UPDATE; {}",
            self.table,
            matches(self.claim),
            end_claim(),
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(read))
            .fetch_all(&mut **conn)
            .await;
        let found = match rows {
            Ok(rows) => rows.first().map(read_row).transpose(),
            Err(error) => Err(StoreError::Database(error)),
        };
        match found {
            Ok(Some(Some(finished))) => {
                conn.release();
                Ok(finished)
            }
            // Unfinished, under our lock and not ours: stranded by an
            // attempt that committed and then failed (see [`claim_sql`]).
            Ok(Some(None)) => {
                conn.release();
                Err(Failure::InUse)
            }
            // Gone (swept) meanwhile: the claim starts over.
            Ok(None) => {
                conn.release();
                Err(Failure::Retry(StoreError::Vanished))
            }
            Err(error) => Err(Failure::Fatal(error)),
        }
    }

    fn skip_wait(&mut self) {
        let now = Claim {
            wait: std::time::Duration::ZERO,
            ..*self.claim
        };
        self.batch = Arc::new(claim_sql(self.table, &now));
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
    let Some(status) = row
        .try_get::<Option<i16>, _>("status")
        .map_err(StoreError::Database)?
    else {
        return Ok(None);
    };
    finished(
        status.into(),
        &row.try_get::<Vec<u8>, _>("fingerprint")
            .map_err(StoreError::Database)?,
        row.try_get("headers").map_err(StoreError::Database)?,
        row.try_get("body").map_err(StoreError::Database)?,
    )
    .map(Some)
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
mod tests;
