//! MySQL and MariaDB's atomic mode ([`Store`]): migration, the claim's
//! one round trip, the replay's read, the finish and the sweep.

use sqlx::mysql::MySqlTransactionManager;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, Pool, Row};
use sqlx_core::transaction::TransactionManager;

use super::sql::{delete_statements, hex, matches, store};
use super::{
    ER_DATA_OUT_OF_RANGE, ER_REGEXP_ERROR, ER_SP_DOES_NOT_EXIST, MAX_SCOPE_BYTES, MySqlClaim,
    RESTORE_IDLE, RESTORE_IDLE_ASSIGNMENTS, fail_if, number, open_check, read_row,
};
use crate::backend::store::Store;
use crate::backend::{Acquire, Backend, Claim, ClaimOutcome, FinishError, OpenTx, StoreError};
use crate::error::Error;
use crate::response::EncodedResponse;
use crate::table::resolutions_table;

impl Backend for MySql {}

impl Store for MySql {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        // MySQL names an index within its table, in at most 64 characters:
        // a long table name gets a short index name rather than an error.
        let name = table.rsplit('.').next().unwrap_or(table);
        let index_name = |suffix: &str| match format!("{name}_{suffix}") {
            index if index.len() <= 64 => index,
            _ => format!("idem_{suffix}"),
        };
        let (index, lease_index, replay_index) = (
            index_name("expires_at_idx"),
            index_name("lease_idx"),
            index_name("replay_idx"),
        );
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
                replay_until DATETIME(6) NULL,
                location BLOB NULL,
                PRIMARY KEY (scope, `key`),
                KEY {index} (expires_at),
                KEY {lease_index} (lease_until),
                KEY {replay_index} (replay_until)
            ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC"
        );
        // DDL takes a metadata lock: concurrent migrations queue, no race.
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
        let resolutions = resolutions_table(table);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {resolutions} (
                scope VARBINARY({MAX_SCOPE_BYTES}) NOT NULL,
                `key` VARBINARY(255) NOT NULL,
                resolved_ms BIGINT NOT NULL,
                outcome VARCHAR(16) NOT NULL,
                status SMALLINT NULL,
                by_name TEXT NULL,
                note TEXT NULL,
                KEY {key_index} (scope, `key`)
            ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC",
            key_index = index_name("resolutions_idx"),
        )))
        .execute(pool)
        .await?;
        // The phased mode's columns came later: a table from before gets
        // them (MySQL has no `ADD COLUMN IF NOT EXISTS`; MariaDB has).
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (format!("'{schema}'"), name),
            None => ("DATABASE()".to_owned(), table),
        };
        let present = |column: &'static str| {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM information_schema.columns \
                 WHERE table_schema = {schema} AND table_name = '{name}' \
                 AND column_name = '{column}'"
            )))
            .fetch_one(pool)
        };
        if present("lease_token").await? == 0 {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {table} ADD COLUMN lease_token BIGINT NULL, \
                 ADD COLUMN lease_until DATETIME(6) NULL, ADD COLUMN recovery LONGBLOB NULL, \
                 ADD COLUMN request LONGBLOB NULL, ADD COLUMN attempts INT NULL, \
                 ADD KEY {lease_index} (lease_until)"
            )))
            .execute(pool)
            .await?;
        }
        // So did the tombstones'.
        if present("replay_until").await? == 0 {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {table} ADD COLUMN replay_until DATETIME(6) NULL, \
                 ADD COLUMN location BLOB NULL, ADD KEY {replay_index} (replay_until)"
            )))
            .execute(pool)
            .await?;
        }
        Ok(())
    }

    /// Nothing: every statement is the same behind a pooler.
    async fn migrate_pooled(_pool: &Pool<Self>, _table: &str) -> Result<(), Error> {
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
        let (flight, claim) = crate::backend::claim::wait_in_process(pool, table, claim).await;
        let outcome = crate::backend::claim::claim_with_retries(
            pool,
            acquire,
            MySqlClaim::new(pool, table, &claim),
        )
        .await;
        crate::backend::claim::held(outcome, flight)
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
            "SELECT status, fingerprint, headers, body, {} FROM {table} \
             WHERE {} AND status IS NOT NULL AND expires_at > UTC_TIMESTAMP(6); COMMIT",
            crate::backend::rows::tombstone_columns(super::NOW),
            matches(claim)
        );
        let row = crate::backend::connection::on_connection(pool, acquire, |mut conn| {
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
        crate::backend::connection::on_connection(pool, acquire, |mut conn| async move {
            MySqlTransactionManager::begin(&mut conn, None).await?;
            Ok(conn)
        })
        .await
    }

    async fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&EncodedResponse>,
    ) -> Result<(), FinishError> {
        // InnoDB rolls a whole transaction back on a deadlock, and the
        // session then runs in autocommit: a handler that caught that error
        // and answered 2xx would have its client told of writes that were
        // undone (as sqlx's own `commit()` would), and the `UPDATE` could
        // write onto a row a concurrent retry has claimed since. So the
        // finish checks, in the same round trip, that a transaction is
        // still open. MySQL: outside one, a savepoint ends with its own
        // statement and releasing it fails (`ER_SP_DOES_NOT_EXIST`), which
        // stops the batch there. MariaDB: the `UPDATE` (or the `SET`
        // without one) evaluates [`open_check`], which fails on
        // `@@in_transaction = 0` with a regular expression's error, two
        // statements fewer.
        let mariadb = conn.mariadb;
        let mut sql = String::new();
        if !mariadb {
            sql.push_str("SAVEPOINT idem_open; RELEASE SAVEPOINT idem_open; ");
        }
        let store = claim.zip(response).map(|(claim, response)| {
            let check = if mariadb { open_check() } else { "" };
            store(table, claim, response, conn.outlived(claim.ttl), check)
        });
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
        } else if mariadb {
            sql.push_str(&format!("SET @idem_open = {}, ", open_check()));
        } else {
            sql.push_str("SET ");
        }
        // The session's idle timeout is put back before the `COMMIT`, in
        // the check's own statement: between the statements of one batch
        // no session idles. If the check fails, nothing in its statement is
        // assigned, and the caller's rollback restores the timeout.
        sql.push_str(RESTORE_IDLE_ASSIGNMENTS);
        // `AND CHAIN` opens the empty transaction sqlx still counts in the
        // commit's own statement (sqlx's rollback of it rides on the pool).
        sql.push_str("; COMMIT AND CHAIN");
        let error = match sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut ***conn)
            .await
        {
            Ok(_) => {
                MySqlTransactionManager::start_rollback(conn);
                return Ok(());
            }
            Err(error)
                if matches!(number(&error), Some(ER_SP_DOES_NOT_EXIST | ER_REGEXP_ERROR)) =>
            {
                error
            }
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
        if let (Some(claim), Some(response)) = (claim, response) {
            // Without the check, which fails here.
            let store = super::sql::store(table, claim, response, conn.outlived(claim.ttl), "");
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
        crate::backend::connection::rollback_transaction(conn).await?;
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
        let deleted = match swept.await {
            Ok(deleted) => deleted,
            Err(error) => {
                // The batch stopped inside its transaction: closing the
                // connection rolls it back.
                conn.close_on_drop();
                return Err(error);
            }
        };
        let left = u64::from(batch).saturating_sub(deleted);
        if left == 0 {
            return Ok(deleted);
        }
        // Rows past their replay become tombstones: their response goes,
        // and `replay_until` becomes the epoch, below the range this scan
        // reads, so converted rows are not read again. READ COMMITTED, as
        // above: no gap locks.
        let convert = format!(
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; \
             UPDATE {table} SET headers = NULL, body = NULL, replay_until = {TOMBSTONED} \
             WHERE replay_until > {TOMBSTONED} AND replay_until <= UTC_TIMESTAMP(6) \
             ORDER BY replay_until LIMIT {left}; COMMIT"
        );
        match sqlx::raw_sql(AssertSqlSafe(convert))
            .execute(&mut *conn)
            .await
        {
            Ok(done) => Ok(deleted + done.rows_affected()),
            Err(error) => {
                conn.close_on_drop();
                Err(error)
            }
        }
    }
}

/// A tombstone's `replay_until` once its response is dropped.
const TOMBSTONED: &str = "'1970-01-01 00:00:00'";
