//! MySQL and MariaDB (InnoDB): the primary key is the claim.
//!
//! The claim is one multi-statement round trip, run as sqlx's own `BEGIN`
//! so that sqlx counts the transaction: set the lock wait, `START
//! TRANSACTION`, `INSERT ... ON DUPLICATE KEY UPDATE`, restore the lock
//! wait, read the row's status back with `SELECT ... FOR UPDATE`, and fail
//! if it is set (another attempt finished the key), since sqlx hands back
//! no results of a `BEGIN`. Values are inlined as hex literals (`X'..'`) or
//! integers we formatted, as on PostgreSQL.
//!
//! InnoDB facts this relies on (checked on MariaDB 10.11):
//!
//! - An insert whose primary key equals an uncommitted row waits for that
//!   row's lock; `ON DUPLICATE KEY UPDATE` asks for an exclusive record lock
//!   on the primary key (no gap lock), so the duplicate queues behind the
//!   first attempt and, after its commit, takes the committed row over if
//!   it expired or leaves it alone; after its rollback it inserts.
//! - Under REPEATABLE READ a plain `SELECT` would read the snapshot of the
//!   transaction's first read, which may predate the commit it waited for;
//!   the read back is a locking read (`FOR UPDATE`), which always sees the
//!   latest committed row, and the lock is already ours, so it never waits.
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
//! so a scope may be at most 2,048 bytes (a longer one is a store error,
//! 503, never a truncated and shared key). The stored response travels
//! hex-encoded in the commit's statement, so `max_allowed_packet` must
//! exceed twice `Idem::max_response_bytes` (16 MiB on MariaDB and 64 MiB on
//! MySQL 8 by default, against the 1 MiB default cap).

use std::sync::Arc;

use sqlx::mysql::{MySqlRow, MySqlTransactionManager};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, Pool, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use super::{Acquire, Backend, Claim, ClaimOutcome, Failure, FinishError, OpenTx, finished, hex};
use crate::Error;
use crate::response::StoredResponse;

impl super::sealed::Sealed for MySql {}

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
/// The claimed row's status, as the claim's locking read found it.
const STATUS: &str = "@idem_claimed_status";
/// Whether that row carries this claim's token (see [`claim_sql`]).
const OURS: &str = "@idem_claimed_ours";
/// `SELECT ... INTO` found more than one row: how the claim says the key
/// is another attempt's, and the finish that its `UPDATE` missed.
const ER_TOO_MANY_ROWS: u16 = 1172;
/// Two rows, of which a condition keeps one (`o = 1`) or both: selected
/// `INTO` a variable, both fail the statement, and the batch stops there.
/// The `LIMIT`s are explicit, so a session's `sql_select_limit` cannot cut
/// them (a limit of 1 would pass every check, one of 0 read no status).
const TWO_ROWS: &str = "(SELECT 1 AS o UNION ALL SELECT 2) AS two_rows";

impl Backend for MySql {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        // MySQL names an index within its table, in at most 64 characters:
        // a long table name gets a short index name rather than an error.
        let name = table.rsplit('.').next().unwrap_or(table);
        let index = match format!("{name}_expires_at_idx") {
            index if index.len() <= 64 => index,
            _ => "idem_expires_at_idx".to_owned(),
        };
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
                PRIMARY KEY (scope, `key`),
                KEY {index} (expires_at)
            ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC"
        );
        // DDL takes a metadata lock: concurrent migrations queue, no race.
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
        Ok(())
    }

    async fn claim(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        if claim.scope.len() > MAX_SCOPE_BYTES {
            return Err(sqlx::Error::InvalidArgument(format!(
                "idempotency scope is {} bytes; the MySQL key store takes at most {MAX_SCOPE_BYTES}",
                claim.scope.len()
            )));
        }
        let (flight, claim) = super::wait_in_process(pool, table, claim).await;
        let batch = Arc::new(claim_sql(table, &claim));
        let outcome = super::claim_with_retries(
            pool,
            acquire,
            MySqlClaim {
                batch,
                table,
                claim: &claim,
            },
        )
        .await;
        Ok(super::held(outcome?, flight))
    }

    async fn peek(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome<Self>>, sqlx::Error> {
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
        let row = super::on_connection(pool, acquire, |mut conn| {
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
        .await?;
        Ok(row.as_ref().map(read_row).transpose()?.flatten())
    }

    async fn begin(pool: &Pool<Self>, acquire: Acquire) -> Result<OpenTx<Self>, sqlx::Error> {
        super::on_connection(pool, acquire, |mut conn| async move {
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
            // rollback, where the check above passes: then the same two-row
            // `SELECT ... INTO` as the claim's fails the batch before its
            // `COMMIT`, which would carry what the handler wrote after the
            // error.
            sql.push_str(store);
            // (`ROW_COUNT()` is read first: inside the `SELECT` it would be
            // its derived table's.)
            // (The check writes into another variable than it reads: a
            // server evaluating the condition row by row after the first
            // row's assignment would otherwise pass a miss.)
            sql.push_str(&format!(
                "; SET @idem_stored = ROW_COUNT(); \
                 SELECT 1 INTO @idem_checked FROM {TWO_ROWS} WHERE o = 1 OR @idem_stored <> 1 \
                 LIMIT 2; "
            ));
        }
        // The empty transaction after the commit stands for the one sqlx
        // counts; sqlx's rollback of it is queued. Its MySQL driver sends
        // that `ROLLBACK` and waits for it before the pool's return ping
        // (PostgreSQL's sends both at once): the one round trip the wrapper
        // adds here (`tests/mysql_round_trips.rs`), the least that keeps
        // sqlx's count right, since every way to lower it is a statement.
        sql.push_str("COMMIT; START TRANSACTION");
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
            Err(error) if number(&error) == Some(ER_TOO_MANY_ROWS) => {
                return Err(FinishError::Ended(error));
            }
            Err(error) => return Err(FinishError::Store(error)),
        };
        // No transaction was open. A statement that commits implicitly
        // (DDL, `LOCK TABLES`) ended it by committing: the claim's row is
        // then committed, unfinished, with the effects, and storing the
        // response on it (in autocommit, as the handler's later writes
        // ran) lets retries replay it, instead of claiming the row as
        // theirs and running the handler again. Otherwise the server rolled
        // the transaction back, and there is nothing to store.
        if let (Some(store), Some(claim)) = (&store, claim) {
            let stored = sqlx::raw_sql(AssertSqlSafe(format!(
                "{store} AND fingerprint = X'{}'",
                hex(claim.fingerprint.as_bytes()),
            )))
            .execute(&mut ***conn)
            .await?;
            if stored.rows_affected() == 1 {
                tracing::warn!(
                    "a statement of the idempotent handler committed its transaction \
                     implicitly (DDL?); its response was stored after it, not with it"
                );
                MySqlTransactionManager::start_rollback(conn);
                return Ok(());
            }
        }
        Err(FinishError::Ended(error))
    }

    async fn rollback(conn: &mut PoolConnection<Self>) -> Result<(), sqlx::Error> {
        super::rollback_transaction(conn).await
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

/// The sweep's `DELETE`s of the locked `rows`, each at most about `limit`
/// bytes of text.
fn delete_statements(table: &str, rows: &[(Vec<u8>, Vec<u8>)], limit: usize) -> Vec<String> {
    let head =
        format!("DELETE t FROM {table} AS t FORCE INDEX (PRIMARY) WHERE (t.scope, t.`key`) IN (");
    let tail = ") AND t.expires_at <= UTC_TIMESTAMP(6)";
    let mut statements = Vec::new();
    let mut statement = String::new();
    for (scope, key) in rows {
        if statement.is_empty() {
            statement.push_str(&head);
        } else {
            statement.push_str(", ");
        }
        statement.push_str("(X'");
        super::push_hex(&mut statement, scope);
        statement.push_str("', X'");
        super::push_hex(&mut statement, key);
        statement.push_str("')");
        if statement.len() >= limit {
            statement.push_str(tail);
            statements.push(std::mem::take(&mut statement));
        }
    }
    if !statement.is_empty() {
        statement.push_str(tail);
        statements.push(statement);
    }
    statements
}

/// A claim on MySQL/MariaDB: its one multi-statement batch (shared by its
/// attempts, not copied), and what the read of a taken key's row needs.
struct MySqlClaim<'c> {
    batch: Arc<String>,
    table: &'c str,
    claim: &'c Claim<'c>,
}

impl super::ClaimAttempt<MySql> for MySqlClaim<'_> {
    /// The batch runs as sqlx's own `BEGIN` (its transaction manager's,
    /// with the batch as the statement), so sqlx counts the transaction: a
    /// handler's nested `begin()` on its `Tx` is then a savepoint, where on
    /// MySQL a second `BEGIN` would commit the request's transaction
    /// half-way. sqlx hands back no results of that statement, so the
    /// batch answers by succeeding (the key is ours) or failing: on a key
    /// another attempt finished, with "result consisted of more than one
    /// row" (see [`claim_sql`]); the row is then read, still locked (a
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
        if number(&error) != Some(ER_TOO_MANY_ROWS) {
            // A connection that was gone is closed (dropped), not reset.
            if !super::is_gone(&error) {
                reset(conn).await;
            }
            return Err(failure(error));
        }
        // The batch stopped at its last statement, in the transaction it
        // opened (sqlx did not count it), the lock wait already restored.
        let read = format!(
            "SELECT status, fingerprint, headers, body FROM {} \
             WHERE {} AND expires_at > UTC_TIMESTAMP(6) LIMIT 1 FOR UPDATE; ROLLBACK",
            self.table,
            matches(self.claim)
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(read))
            .fetch_all(&mut **conn)
            .await;
        let found = match rows {
            Ok(rows) => rows.first().map(read_row).transpose(),
            Err(error) => Err(error),
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
                Err(Failure::Retry(sqlx::Error::RowNotFound))
            }
            Err(error) => Err(Failure::Fatal(error)),
        }
    }
}

/// What a failed claim batch means: a lock wait that ran out is a 409, a
/// deadlock (which rolled the claim back) is tried again, and anything else
/// fails the claim.
fn failure(error: sqlx::Error) -> Failure {
    match number(&error) {
        Some(ER_LOCK_WAIT_TIMEOUT | ER_STATEMENT_TIMEOUT) => Failure::InUse,
        Some(ER_LOCK_DEADLOCK) => Failure::Retry(error),
        _ => Failure::Fatal(error),
    }
}

/// Ends a claim whose statements failed part-way: the batch stopped at the
/// error, so the session's lock wait may still be the claim's. A connection
/// that cannot be reset is closed (`OpenTx` drop).
async fn reset(mut conn: OpenTx<MySql>) {
    let sql = format!("ROLLBACK; SET SESSION innodb_lock_wait_timeout = {SAVED_LOCK_WAIT}");
    match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut **conn).await {
        Ok(_) => conn.release(),
        Err(error) => {
            tracing::warn!(%error, "resetting a failed claim failed; closing the connection")
        }
    }
}

/// The claim's round trip. An expired row is taken over inside the upsert:
/// MySQL applies the assignments left to right, so `expires_at` goes last
/// and every condition before it still sees the old expiry.
///
/// The row the upsert writes carries a token of this claim's in `headers`
/// until the finish stores the real ones: an unfinished row without it was
/// left alone by the upsert, because an earlier attempt committed it (its
/// handler's own `COMMIT`, or a statement that commits implicitly) and
/// then failed, with its effects in and no response. That key is in use
/// until it expires, as on every engine: running the handler again could
/// do its effects twice. (The row count cannot tell: sqlx's connections
/// count a row found unchanged as one, like a row inserted.)
fn claim_sql(table: &str, claim: &Claim<'_>) -> String {
    let token = hex(&rand::random::<[u8; 16]>());
    let now = "UTC_TIMESTAMP(6)";
    let expires = format!("{now} + INTERVAL {} MICROSECOND", claim.ttl.as_micros());
    let expired = format!("expires_at <= {now}");
    let fingerprint = hex(claim.fingerprint.as_bytes());
    let wait = claim.wait;
    let lock_wait_secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let bounded = if wait.subsec_nanos() > 0 {
        format!(
            "/*M!100300 SET STATEMENT max_statement_time = {}.{:06} FOR */ ",
            wait.as_secs(),
            wait.subsec_micros()
        )
    } else {
        String::new()
    };
    format!(
        "SET {SAVED_LOCK_WAIT} = @@SESSION.innodb_lock_wait_timeout, {STATUS} = NULL, \
             {OURS} = FALSE, SESSION innodb_lock_wait_timeout = {lock_wait_secs}; \
         START TRANSACTION; \
         {bounded}INSERT INTO {table} (scope, `key`, fingerprint, headers, created_at, expires_at) \
             VALUES (X'{scope}', X'{key}', X'{fingerprint}', X'{token}', {now}, {expires}) \
             ON DUPLICATE KEY UPDATE \
             fingerprint = IF({expired}, X'{fingerprint}', fingerprint), \
             status = IF({expired}, NULL, status), \
             headers = IF({expired}, X'{token}', headers), \
             body = IF({expired}, NULL, body), \
             created_at = IF({expired}, {now}, created_at), \
             expires_at = IF({expired}, {expires}, expires_at); \
         SET SESSION innodb_lock_wait_timeout = {SAVED_LOCK_WAIT}; \
         SELECT status, headers <=> X'{token}' INTO {STATUS}, {OURS} FROM {table} \
             WHERE {matches} LIMIT 1 FOR UPDATE; \
         SELECT 1 INTO @idem_taken FROM {TWO_ROWS} \
             WHERE o = 1 OR {STATUS} IS NOT NULL OR NOT {OURS} LIMIT 2",
        scope = hex(claim.scope.as_bytes()),
        key = hex(claim.key.as_bytes()),
        matches = matches(claim),
    )
}

/// The finish's `UPDATE` of the claim's row, which spares a finished row
/// (a concurrent retry's, claimed after this transaction was rolled back).
/// `late`: the expiry counts from now (see `OpenTx::outlived`).
fn store(table: &str, claim: &Claim<'_>, response: &StoredResponse, late: bool) -> String {
    let expiry = if late {
        format!(
            ", expires_at = UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND",
            claim.ttl.as_micros()
        )
    } else {
        String::new()
    };
    format!(
        "UPDATE {table} SET status = {}, headers = X'{}', body = X'{}'{expiry} \
         WHERE {} AND status IS NULL",
        response.status.as_u16(),
        hex(&response.encode_headers()),
        hex(&response.body),
        matches(claim),
    )
}

fn matches(claim: &Claim<'_>) -> String {
    format!(
        "scope = X'{}' AND `key` = X'{}'",
        hex(claim.scope.as_bytes()),
        hex(claim.key.as_bytes())
    )
}

/// `None`: the row is ours (just inserted or taken over, status unset).
fn read_row(row: &MySqlRow) -> Result<Option<ClaimOutcome<MySql>>, sqlx::Error> {
    let Some(status) = row.try_get::<Option<i16>, _>("status")? else {
        return Ok(None);
    };
    finished(
        status.into(),
        &row.try_get::<Vec<u8>, _>("fingerprint")?,
        row.try_get("headers")?,
        row.try_get("body")?,
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
mod tests {
    use std::time::{Duration, Instant};

    use sqlx::MySqlConnection;
    use sqlx::mysql::MySqlPoolOptions;

    use super::*;

    /// A pool on the test server; fails loudly without one.
    async fn test_pool(max_connections: u32) -> Pool<MySql> {
        let url = std::env::var("IDEM_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        MySqlPoolOptions::new()
            .max_connections(max_connections)
            .connect(&url)
            .await
            .unwrap_or_else(|error| panic!("MySQL/MariaDB is required at {url}: {error}"))
    }

    /// `error`, which must carry the server's `code`, as the claim sorts it.
    fn sorted(error: sqlx::Error, code: u16) -> Failure {
        assert_eq!(number(&error), Some(code), "{error}");
        failure(error)
    }

    /// A key table of this test process named after `name`, migrated
    /// empty (a run killed before its cleanup, with the same process id,
    /// left one).
    async fn key_table(pool: &Pool<MySql>, name: &str) -> String {
        let table = format!("idem_{name}_{}", std::process::id());
        run(
            &mut pool.acquire().await.unwrap(),
            &format!("DROP TABLE IF EXISTS {table}"),
        )
        .await
        .unwrap();
        MySql::migrate(pool, &table).await.expect("migrate");
        table
    }

    /// Drops a test's table, at its end.
    async fn drop_table(pool: &Pool<MySql>, table: &str) {
        run(
            &mut pool.acquire().await.unwrap(),
            &format!("DROP TABLE {table}"),
        )
        .await
        .unwrap();
    }

    async fn run(conn: &mut MySqlConnection, sql: &str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(conn)
            .await
            .map(drop)
    }

    /// Longer than the 0.1 s `INNODB_TRX` must go unread before InnoDB
    /// refreshes it.
    const INNODB_TRX_REFRESH: Duration = Duration::from_millis(150);

    /// The server's own errors, met as a claim meets them, sorted as the
    /// claim's retry loop needs: a deadlock is tried again, a lock wait that
    /// ran out (whole seconds, or MariaDB's statement time) is a 409, and
    /// anything else fails the claim.
    #[tokio::test]
    async fn deadlocks_are_retried_and_lock_waits_are_in_use() {
        let pool = test_pool(3).await;
        let table = format!("idem_failures_{}", std::process::id());
        let [first, second] =
            [1, 2].map(|id| format!("SELECT id FROM {table} WHERE id = {id} FOR UPDATE"));
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {table}; \
             CREATE TABLE {table} (id int PRIMARY KEY) ENGINE = InnoDB; \
             INSERT INTO {table} VALUES (1), (2)"
        )))
        .execute(&pool)
        .await
        .unwrap();

        // a holds row 1 and b row 2; a asks for row 2 and waits ...
        let mut a = pool.acquire().await.unwrap();
        let mut b = pool.acquire().await.unwrap();
        run(&mut a, &format!("START TRANSACTION; {first}"))
            .await
            .unwrap();
        run(&mut b, &format!("START TRANSACTION; {second}"))
            .await
            .unwrap();
        let a_thread: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *a)
            .await
            .unwrap();
        let waiting = tokio::spawn(async move {
            let result = run(&mut a, &second).await;
            (a, result)
        });
        // ... as the server's lock queue shows (no event tells, so it is
        // polled until a is in it). InnoDB refreshes `INNODB_TRX` only once
        // it has gone unread for 0.1 s: polled more often than that, it
        // shows the first read's snapshot for ever (this test failed so
        // when a first read came before a's wait). ...
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waits: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.INNODB_TRX \
                 WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id = ?",
            )
            .bind(a_thread)
            .fetch_one(&pool)
            .await
            .unwrap();
            if waits == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "a never waited for b's row");
            tokio::time::sleep(INNODB_TRX_REFRESH).await;
        }
        // ... and b asks for row 1: a cycle, and InnoDB picks a victim.
        let b_result = run(&mut b, &first).await;
        let (mut a, a_result) = waiting.await.unwrap();
        let mut errors: Vec<_> = [a_result, b_result]
            .into_iter()
            .filter_map(Result::err)
            .collect();
        assert_eq!(errors.len(), 1, "one of the two is the deadlock's victim");
        assert!(matches!(
            sorted(errors.remove(0), ER_LOCK_DEADLOCK),
            Failure::Retry(_)
        ));
        for conn in [&mut a, &mut b] {
            run(conn, "ROLLBACK").await.unwrap();
        }

        // b holds row 1: c's lock waits for it run out.
        run(&mut b, &format!("START TRANSACTION; {first}"))
            .await
            .unwrap();
        let mut c = pool.acquire().await.unwrap();
        let timed_out = run(
            &mut c,
            &format!("SET SESSION innodb_lock_wait_timeout = 0; START TRANSACTION; {first}"),
        )
        .await
        .expect_err("row 1 is b's");
        assert!(matches!(
            sorted(timed_out, ER_LOCK_WAIT_TIMEOUT),
            Failure::InUse
        ));
        run(
            &mut c,
            "ROLLBACK; SET SESSION innodb_lock_wait_timeout = DEFAULT",
        )
        .await
        .unwrap();
        let mariadb: bool = sqlx::query_scalar("SELECT VERSION() LIKE '%MariaDB%'")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        if mariadb {
            let interrupted = run(
                &mut c,
                &format!("START TRANSACTION; SET STATEMENT max_statement_time = 0.05 FOR {first}"),
            )
            .await
            .expect_err("row 1 is b's");
            assert!(matches!(
                sorted(interrupted, ER_STATEMENT_TIMEOUT),
                Failure::InUse
            ));
            run(&mut c, "ROLLBACK").await.unwrap();
        }

        let syntax = run(&mut c, "SELEC 1").await.expect_err("not SQL");
        assert!(matches!(failure(syntax), Failure::Fatal(_)));
        run(&mut b, "ROLLBACK").await.unwrap();
        drop((a, b, c));
        drop_table(&pool, &table).await;
    }

    /// Taking over an expired key honours `wait` like any claim (the
    /// upsert's lock wait is bounded as the insert's is): while another
    /// transaction holds the expired row, the claim is told the key is in
    /// use, instead of waiting for that transaction to end. Once the row is
    /// free, the key is taken over, in place.
    #[tokio::test]
    async fn taking_over_an_expired_key_waits_no_longer_than_wait() {
        let pool = test_pool(3).await;
        let table = key_table(&pool, "takeover").await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
             VALUES ('acct', 'old', X'00', 201, UTC_TIMESTAMP(6), \
                     UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut holder = pool.acquire().await.unwrap();
        run(
            &mut holder,
            &format!("START TRANSACTION; SELECT 1 FROM {table} WHERE `key` = 'old' FOR UPDATE"),
        )
        .await
        .unwrap();
        let release = async move { run(&mut holder, "ROLLBACK").await.unwrap() };
        crate::backend::takeover_test::in_use_then_taken_over(&pool, &table, release).await;
        let rows: Vec<(Vec<u8>, bool)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT fingerprint, expires_at > UTC_TIMESTAMP(6) FROM {table} WHERE `key` = 'old'"
        )))
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(rows, [(vec![1; 32], true)], "one live row, the new claim's");
        drop_table(&pool, &table).await;
    }

    /// A table name as long as `Idem::table` takes (63 characters) migrates:
    /// its index gets a short name instead of one past MySQL's 64.
    #[tokio::test]
    async fn the_longest_table_name_migrates() {
        let pool = test_pool(1).await;
        let prefix = format!("idem_long_{}_", std::process::id());
        let table = format!("{prefix}{}", "x".repeat(63 - prefix.len()));
        assert_eq!(table.len(), 63);
        MySql::migrate(&pool, &table).await.expect("migrate");
        MySql::migrate(&pool, &table).await.expect("migrate again");
        drop_table(&pool, &table).await;
    }

    /// The sweeper skips an expired row a claim is taking over (its handler
    /// running) instead of waiting for it: the other expired rows go at
    /// once, and the taken-over row stays, live.
    #[tokio::test]
    async fn sweeps_skip_a_row_a_claim_holds() {
        let pool = test_pool(3).await;
        let table = key_table(&pool, "sweep").await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
             VALUES ('acct', 'k1', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 3 SECOND), \
                    ('acct', 'k2', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 2 SECOND), \
                    ('acct', 'k3', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let claim = Claim {
            scope: "acct",
            key: "k2",
            fingerprint: crate::Fingerprint::from_bytes(&[1; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            wait: Duration::ZERO,
        };
        let ClaimOutcome::Claimed(held) = MySql::claim(&pool, Acquire::default(), &table, &claim)
            .await
            .unwrap()
        else {
            panic!("the expired key is taken over");
        };
        let started = Instant::now();
        let swept = MySql::sweep(&pool, &table, 1000).await.unwrap();
        assert_eq!(swept, 2, "k1 and k3");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        let mut held = held;
        MySql::rollback(&mut held).await.unwrap();
        held.release();
        let left: Vec<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT `key` FROM {table} ORDER BY `key`"
        )))
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(left, [b"k2".to_vec()], "the held row is left to the claim");
        drop_table(&pool, &table).await;
    }

    /// Where expired rows are the whole table, the sweep's `DELETE` still
    /// reads the primary key (MariaDB scanned the table instead, met a
    /// fresh key's uncommitted claim and waited for it, up to 50 s, found
    /// by review); and a batch of long scopes is cut into statements of
    /// about 1 MiB, every row in one of them.
    #[tokio::test]
    async fn sweeps_never_wait_for_a_fresh_claim() {
        let pool = test_pool(3).await;
        let table = key_table(&pool, "sweep_all").await;
        run(
            &mut pool.acquire().await.unwrap(),
            &format!(
                "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
                 SELECT 'acct', CONCAT('k-', seq), X'00', 201, UTC_TIMESTAMP(6), \
                        UTC_TIMESTAMP(6) - INTERVAL 1 SECOND FROM seq_1_to_1000"
            ),
        )
        .await
        .unwrap();
        let claim = Claim {
            scope: "acct",
            key: "fresh",
            fingerprint: crate::Fingerprint::from_bytes(&[1; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            wait: Duration::ZERO,
        };
        let ClaimOutcome::Claimed(mut held) =
            MySql::claim(&pool, Acquire::default(), &table, &claim)
                .await
                .unwrap()
        else {
            panic!("a fresh key is claimed");
        };
        let started = Instant::now();
        let swept = tokio::time::timeout(Duration::from_secs(5), MySql::sweep(&pool, &table, 1000))
            .await
            .expect("the sweep does not wait for the claim")
            .unwrap();
        assert_eq!(swept, 1000, "after {:?}", started.elapsed());
        MySql::rollback(&mut held).await.unwrap();
        held.release();

        let rows: Vec<(Vec<u8>, Vec<u8>)> = (0..40)
            .map(|i| (vec![b's'; 2048], format!("k-{i}").into_bytes()))
            .collect();
        let statements = delete_statements("t", &rows, 20_000);
        assert!(statements.len() > 1);
        assert!(
            statements
                .iter()
                .all(|statement| statement.len() < 20_000 + 4200)
        );
        let keys: usize = statements
            .iter()
            .map(|statement| statement.matches("X'6b2d").count())
            .sum();
        assert_eq!(keys, 40);
        drop_table(&pool, &table).await;
    }

    /// A batch of expired rows of the longest scopes takes several `DELETE`
    /// statements against the server: every one of them runs, in the
    /// batch's one transaction, and commits; a live row among them stays.
    #[tokio::test]
    async fn sweeps_a_batch_of_long_scopes_in_several_statements() {
        let pool = test_pool(2).await;
        let table = key_table(&pool, "sweep_long").await;
        let scope = crate::MAX_SCOPE_LEN;
        run(
            &mut pool.acquire().await.unwrap(),
            &format!(
                "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
                 SELECT REPEAT('s', {scope}), CONCAT('k-', seq), X'00', 201, UTC_TIMESTAMP(6), \
                        UTC_TIMESTAMP(6) - INTERVAL 1 SECOND FROM seq_1_to_1000; \
                 INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
                 VALUES (REPEAT('s', {scope}), 'live', X'00', 201, UTC_TIMESTAMP(6), \
                         UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)"
            ),
        )
        .await
        .unwrap();
        let rows: Vec<(Vec<u8>, Vec<u8>)> = (1..=1000)
            .map(|i| (vec![b's'; scope], format!("k-{i}").into_bytes()))
            .collect();
        assert!(
            delete_statements(&table, &rows, 1 << 20).len() >= 4,
            "the sweep below needs several statements"
        );

        assert_eq!(MySql::sweep(&pool, &table, 1000).await.unwrap(), 1000);
        // Read from a session of its own: the sweep committed.
        let (left, live): (i64, Option<Vec<u8>>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT COUNT(*), MAX(`key`) FROM {table}"
        )))
        .fetch_one(&test_pool(1).await)
        .await
        .unwrap();
        assert_eq!((left, live.as_deref()), (1, Some(&b"live"[..])));
        drop_table(&pool, &table).await;
    }
}
