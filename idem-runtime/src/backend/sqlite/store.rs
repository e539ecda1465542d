//! SQLite's atomic mode ([`Store`]): migration, the claim in a `BEGIN
//! IMMEDIATE` transaction, the replay's read, the finish and the sweep.
//! How waiting works is told in the engine's module documentation.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use sqlx::sqlite::{SqliteConnectOptions, SqliteRow, SqliteTransactionManager};
use sqlx::{AssertSqlSafe, Pool, Row, SqlSafeStr, Sqlite};
use sqlx_core::transaction::TransactionManager;
use tokio::time::Instant;

use super::sql::Sql;
use super::{is_busy, now_ms, ttl_ms};
use crate::backend::connection::abandon;
use crate::backend::rows::finished_row;
use crate::backend::single_flight;
use crate::backend::store::{Store, finished};
use crate::backend::{Acquire, Backend, Claim, ClaimOutcome, FinishError, OpenTx, StoreError};
use crate::error::Error;
use crate::response::EncodedResponse;
use crate::table::resolutions_table;

impl Backend for Sqlite {}

impl Store for Sqlite {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (format!("{schema}."), name),
            None => (String::new(), table),
        };
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                scope BLOB NOT NULL,
                \"key\" BLOB NOT NULL,
                fingerprint BLOB NOT NULL,
                status INTEGER,
                headers BLOB,
                body BLOB,
                created_at INTEGER NOT NULL,
                expires_at INTEGER NOT NULL,
                lease_token INTEGER,
                lease_until INTEGER,
                recovery BLOB,
                request BLOB,
                attempts INTEGER,
                replay_until INTEGER,
                location BLOB,
                PRIMARY KEY (scope, \"key\")
            );
            CREATE INDEX IF NOT EXISTS {schema}{name}_expires_at_idx ON {name} (expires_at);
            CREATE TABLE IF NOT EXISTS {resolutions} (
                scope BLOB NOT NULL,
                \"key\" BLOB NOT NULL,
                resolved_ms INTEGER NOT NULL,
                outcome TEXT NOT NULL,
                status INTEGER,
                by_name TEXT,
                note TEXT
            );
            CREATE INDEX IF NOT EXISTS {resolutions}_key_idx ON {resolutions_name} (scope, \"key\");",
            resolutions = resolutions_table(table),
            resolutions_name = resolutions_table(name),
        );
        // Every statement runs under the write lock, so concurrent
        // migrations simply queue; no catalog race to retry.
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
        // The phased mode's columns came later: a table from before gets
        // them (SQLite has no `ADD COLUMN IF NOT EXISTS`).
        let columns: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT name FROM {schema}pragma_table_info('{name}')"
        )))
        .fetch_all(pool)
        .await?;
        let mut alter = String::new();
        for (column, ty) in [
            ("lease_token", "INTEGER"),
            ("lease_until", "INTEGER"),
            ("recovery", "BLOB"),
            ("request", "BLOB"),
            ("attempts", "INTEGER"),
            ("replay_until", "INTEGER"),
            ("location", "BLOB"),
        ] {
            if !columns.iter().any(|present| present == column) {
                alter.push_str(&format!("ALTER TABLE {table} ADD COLUMN {column} {ty}; "));
            }
        }
        alter.push_str(&format!(
            "CREATE INDEX IF NOT EXISTS {schema}{name}_lease_idx ON {name} (lease_until) \
             WHERE lease_until IS NOT NULL; \
             CREATE INDEX IF NOT EXISTS {schema}{name}_replay_idx ON {name} (replay_until) \
             WHERE replay_until IS NOT NULL"
        ));
        sqlx::raw_sql(AssertSqlSafe(alter)).execute(pool).await?;
        let mode: String =
            sqlx::query_scalar(AssertSqlSafe(format!("PRAGMA {schema}journal_mode")))
                .fetch_one(pool)
                .await?;
        if !matches!(mode.to_ascii_lowercase().as_str(), "wal" | "memory") {
            tracing::warn!(
                journal_mode = %mode,
                "the SQLite database keeping idempotency keys is not in WAL mode: \
                 readers and the writer's commit will wait for each other \
                 (use SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal))"
            );
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
        let (slot, options) =
            crate::backend::single_flight::flight_slot(pool, table, claim.scope, claim.key);
        let deadline = Instant::now() + claim.wait;
        let sql = Sql::new(table);
        let flight = loop {
            if let Some(busy) = single_flight::in_flight(&slot) {
                if !busy.ended_by(deadline).await {
                    return Ok(ClaimOutcome::InUse { running: true });
                }
                continue;
            }
            if let Some(found) = replay(pool, acquire, &sql, claim).await? {
                return Ok(found);
            }
            match single_flight::enter(&slot) {
                Ok(flight) => break flight.keep(options),
                Err(busy) => {
                    if !busy.ended_by(deadline).await {
                        return Ok(ClaimOutcome::InUse { running: true });
                    }
                }
            }
        };

        let mut conn = begin_immediate(pool, acquire)
            .await
            .map_err(StoreError::Database)?;
        let now = now_ms();
        let row = sqlx::query(AssertSqlSafe(sql.claim))
            .bind(claim.scope.as_bytes())
            .bind(claim.key.as_bytes())
            .bind(&claim.fingerprint.as_bytes()[..])
            .bind(now)
            .bind(now.saturating_add(ttl_ms(claim)))
            .fetch_optional(&mut **conn)
            .await;
        let outcome = match row {
            Ok(Some(row)) => read_claimed(&row),
            Ok(None) => Err(StoreError::Vanished),
            Err(error) => Err(StoreError::Database(error)),
        };
        match outcome {
            Ok(Found::Ours) => Ok(ClaimOutcome::Claimed(conn.hold(flight))),
            Ok(Found::Stranded) => {
                abandon(conn).await;
                Ok(ClaimOutcome::InUse { running: false })
            }
            Ok(Found::Finished(finished)) => {
                abandon(conn).await;
                Ok(finished)
            }
            Err(error) => {
                abandon(conn).await;
                Err(error)
            }
        }
    }

    async fn peek(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome<Self>>, StoreError> {
        // The claim starts with this same read; hinted or not, a finished
        // key never takes the write lock.
        replay(pool, acquire, &Sql::new(table), claim).await
    }

    async fn begin(pool: &Pool<Self>, acquire: Acquire) -> Result<OpenTx<Self>, sqlx::Error> {
        begin_immediate(pool, acquire).await
    }

    async fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&EncodedResponse>,
    ) -> Result<(), FinishError> {
        if let (Some(claim), Some(response)) = (claim, response) {
            // A slow request's expiry counts from its response (see
            // `OpenTx::outlived`).
            // (A tombstone's times always count from its response.)
            let expires_at = (response.tombstone.is_none() && conn.outlived(claim.ttl))
                .then(|| now_ms().saturating_add(ttl_ms(claim)));
            let statement = Sql::finish(table, expires_at.is_some(), response);
            let mut query = sqlx::query(AssertSqlSafe(statement))
                .bind(i64::from(response.status.as_u16()))
                .bind(&response.headers[..])
                .bind(&response.body[..])
                .bind(claim.scope.as_bytes())
                .bind(claim.key.as_bytes());
            if let Some(expires_at) = expires_at {
                query = query.bind(expires_at);
            }
            let stored = query
                .execute(&mut ***conn)
                .await
                .map_err(FinishError::store)?;
            // Some errors (`INSERT OR ROLLBACK`, a full disk) make SQLite
            // roll the whole transaction back, and the connection then runs
            // in autocommit: a handler that caught one and answered 2xx
            // would have its client told of writes that were undone. The
            // claim's unfinished row is then gone, and the `UPDATE` (which
            // spares a finished row, another attempt's since) matches
            // nothing: the request answers 500 instead.
            if stored.rows_affected() != 1 {
                return Err(FinishError::Ended(StoreError::ClaimGone));
            }
        }
        // In process: a second statement costs no round trip, and sqlx's
        // own commit keeps its transaction depth right. Without a key, a
        // transaction SQLite rolled back is told by the commit itself; a
        // deferred foreign key the handler's writes broke fails it too (and
        // a retry would fail alike): both are the handler's, not the store's.
        let error = match SqliteTransactionManager::commit(conn).await {
            Ok(()) => return Ok(()),
            Err(error) => error,
        };
        let no_transaction = matches!(
            &error,
            sqlx::Error::Database(db) if db.message().contains("no transaction is active")
        );
        if no_transaction && claim.is_some() {
            // The `UPDATE` found the claim's unfinished row, yet no
            // transaction was open: the handler ended the request's itself
            // (a raw `COMMIT` through its `Tx`), so the claim and effects
            // were committed then, and the `UPDATE` stored the response in
            // autocommit. That is done; only sqlx's count is left wrong, so
            // the connection is closed rather than pooled.
            tracing::warn!(
                "the idempotent handler committed its transaction itself; \
                 its response was stored after it, not with it"
            );
            conn.close_on_drop();
            return Ok(());
        }
        Err(match &error {
            sqlx::Error::Database(db)
                if no_transaction || db.kind() != sqlx::error::ErrorKind::Other =>
            {
                FinishError::Ended(StoreError::Database(error))
            }
            _ => FinishError::store(error),
        })
    }

    fn stranded(
        conn: &mut sqlx::pool::PoolConnection<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send {
        let sql =
            format!("SELECT 1 FROM {table} WHERE scope = ?1 AND \"key\" = ?2 AND status IS NULL");
        crate::backend::connection::row_exists(conn, sql, claim)
    }

    async fn rollback(conn: &mut sqlx::pool::PoolConnection<Self>) -> Result<(), sqlx::Error> {
        crate::backend::connection::rollback_transaction(conn).await
    }

    /// Attempts on one database file wait for each other in process,
    /// whatever their pool (the file has one write lock); a private
    /// in-memory database (`SqliteConnectOptions::new()`, named `:memory:`
    /// whatever the pool) is its pool's alone.
    fn flight_database(options: &Arc<SqliteConnectOptions>, out: &mut Vec<u8>) {
        let filename = options.get_filename();
        if filename.as_os_str().is_empty() || filename == Path::new(":memory:") {
            out.extend_from_slice(b"memory:");
            out.extend_from_slice(&(Arc::as_ptr(options) as usize).to_le_bytes());
        } else {
            out.extend_from_slice(filename.as_os_str().as_encoded_bytes());
        }
    }

    async fn sweep(pool: &Pool<Self>, table: &str, batch: u32) -> Result<u64, sqlx::Error> {
        let now = now_ms();
        let sql = format!(
            "DELETE FROM {table} WHERE rowid IN \
             (SELECT rowid FROM {table} WHERE expires_at <= ?1 LIMIT {batch})"
        );
        let deleted = sqlx::query(AssertSqlSafe(sql))
            .bind(now)
            .execute(pool)
            .await?
            .rows_affected();
        let left = u64::from(batch).saturating_sub(deleted);
        if left == 0 {
            return Ok(deleted);
        }
        // Rows past their replay become tombstones: their response goes,
        // and `replay_until` becomes 0 (the epoch), below the range this
        // scan reads, so converted rows are not read again.
        let sql = format!(
            "UPDATE {table} SET headers = NULL, body = NULL, replay_until = 0 WHERE rowid IN \
             (SELECT rowid FROM {table} WHERE replay_until > 0 AND replay_until <= ?1 \
              ORDER BY replay_until LIMIT {left})"
        );
        let converted = sqlx::query(AssertSqlSafe(sql))
            .bind(now)
            .execute(pool)
            .await?
            .rows_affected();
        Ok(deleted + converted)
    }
}

/// A connection in a new `BEGIN IMMEDIATE` transaction, begun through
/// sqlx's transaction manager so that sqlx counts it: a handler's nested
/// `begin()` is then a savepoint, not a second `BEGIN` (which SQLite
/// refuses).
async fn begin_immediate(
    pool: &Pool<Sqlite>,
    acquire: Acquire,
) -> Result<OpenTx<Sqlite>, sqlx::Error> {
    crate::backend::connection::on_connection(pool, acquire, |mut conn| async move {
        let begun =
            SqliteTransactionManager::begin(&mut conn, Some("BEGIN IMMEDIATE".into_sql_str()))
                .await;
        match begun {
            Ok(()) => Ok(conn),
            Err(error) => {
                // A busy BEGIN IMMEDIATE starts no transaction (the lock is
                // taken before autocommit is switched off): the connection
                // is clean. After any other failure, `OpenTx` closes it.
                if is_busy(&error) {
                    conn.release();
                }
                Err(error)
            }
        }
    })
    .await
}

/// A finished, unexpired row read without the write lock: the fast path of
/// every replay. Rows only change once expired (takeover, sweep), so what
/// this read sees is final.
async fn replay(
    pool: &Pool<Sqlite>,
    acquire: Acquire,
    sql: &Sql,
    claim: &Claim<'_>,
) -> Result<Option<ClaimOutcome<Sqlite>>, StoreError> {
    let row = crate::backend::connection::on_connection(pool, acquire, |mut conn| async move {
        let row = sqlx::query(AssertSqlSafe(sql.replay.clone()))
            .bind(claim.scope.as_bytes())
            .bind(claim.key.as_bytes())
            .bind(now_ms())
            .fetch_optional(&mut **conn)
            .await;
        conn.release_unless_gone(&row);
        row
    })
    .await
    .map_err(StoreError::Database)?;
    match row.as_ref().map(read_row).transpose()? {
        Some(Found::Finished(found)) => Ok(Some(found)),
        _ => Ok(None),
    }
}

enum Found {
    Ours,
    /// Unfinished, yet committed: an earlier attempt committed its
    /// transaction itself (a raw `COMMIT`) and then failed, so its effects
    /// are in and no response is. Running the handler again could do them
    /// twice: the key is in use until it expires, as on every engine.
    Stranded,
    Finished(ClaimOutcome<Sqlite>),
}

/// The claim's row, read back after its upsert: unfinished, it is ours only
/// if the upsert wrote it.
fn read_claimed(row: &SqliteRow) -> Result<Found, StoreError> {
    match read_row(row)? {
        Found::Ours
            if row
                .try_get::<i64, _>("claimed")
                .map_err(StoreError::Database)?
                == 0 =>
        {
            Ok(Found::Stranded)
        }
        found => Ok(found),
    }
}

fn read_row(row: &SqliteRow) -> Result<Found, StoreError> {
    Ok(finished_row(row)?.map_or(Found::Ours, |found| Found::Finished(finished(found))))
}
