//! SQLite's outbox and consumed-messages tables. Times are milliseconds
//! since the epoch, as the key table keeps them. A lease is one `UPDATE ..
//! RETURNING`: SQLite runs one writer at a time, so relays' leases are
//! serialised by the database's write lock.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::now_ms;
use crate::backend::outbox_store::{
    FailingRow, Failure, MESSAGE_COLUMNS, MessageRow, NewMessage, OutboxStore, failing_sql, millis,
    seq_list,
};
use crate::backend::rows::{failing_row, message_row};
use crate::error::Error;

/// `table`'s schema prefix (`schema.`, or empty) and its own name: SQLite
/// names an index in the schema, on a table named without it.
fn split(table: &str) -> (String, &str) {
    match table.split_once('.') {
        Some((schema, name)) => (format!("{schema}."), name),
        None => (String::new(), table),
    }
}

impl OutboxStore for Sqlite {
    async fn migrate_outbox(pool: &Pool<Self>, outbox: &str, consumed: &str) -> Result<(), Error> {
        let ((schema, name), (consumed_schema, consumed_name)) = (split(outbox), split(consumed));
        // AUTOINCREMENT: a swept newest message's number is never reused,
        // so `seq` keeps the order messages were written in.
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {outbox} (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                id TEXT NOT NULL UNIQUE,
                scope BLOB NOT NULL,
                topic TEXT NOT NULL,
                payload BLOB NOT NULL,
                created_at INTEGER NOT NULL,
                available_at INTEGER NOT NULL,
                attempts INTEGER NOT NULL DEFAULT 0,
                lease_token INTEGER,
                lease_until INTEGER,
                delivered_at INTEGER,
                last_error TEXT
            );
            CREATE INDEX IF NOT EXISTS {schema}{name}_pending_idx ON {name} (seq)
                WHERE delivered_at IS NULL;
            CREATE INDEX IF NOT EXISTS {schema}{name}_scope_idx ON {name} (scope, seq)
                WHERE delivered_at IS NULL;
            CREATE INDEX IF NOT EXISTS {schema}{name}_delivered_idx ON {name} (delivered_at)
                WHERE delivered_at IS NOT NULL;
            CREATE TABLE IF NOT EXISTS {consumed} (
                scope BLOB NOT NULL,
                id BLOB NOT NULL,
                consumed_at INTEGER NOT NULL,
                expires_at INTEGER NOT NULL,
                PRIMARY KEY (scope, id)
            );
            CREATE INDEX IF NOT EXISTS {consumed_schema}{consumed_name}_expires_at_idx
                ON {consumed_name} (expires_at);"
        );
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
        // `last_error` came later: a table from before gets it (SQLite has
        // no `ADD COLUMN IF NOT EXISTS`). A migration at once may add it
        // between the read and the `ALTER`, which then fails: it is there.
        if !has_last_error(pool, &schema, name).await? {
            let added = sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {outbox} ADD COLUMN last_error TEXT"
            )))
            .execute(pool)
            .await;
            if let Err(error) = added
                && !has_last_error(pool, &schema, name).await?
            {
                return Err(error.into());
            }
        }
        Ok(())
    }

    async fn enqueue(
        conn: &mut Self::Connection,
        outbox: &str,
        message: &NewMessage<'_>,
    ) -> Result<(), sqlx::Error> {
        let sql = format!(
            "INSERT INTO {outbox} (id, scope, topic, payload, created_at, available_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?5)"
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(message.id)
            .bind(message.scope.as_bytes())
            .bind(message.topic)
            .bind(message.payload)
            .bind(now_ms())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn lease_messages(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        lease: Duration,
        batch: u32,
    ) -> Result<Vec<MessageRow>, sqlx::Error> {
        // See the PostgreSQL lease: a scope's share is a prefix of its
        // undelivered messages, none of them blocked.
        let sql = format!(
            "UPDATE {outbox} SET lease_token = ?1, lease_until = ?2 \
             WHERE seq IN (SELECT c.seq FROM {outbox} c \
                 WHERE c.delivered_at IS NULL AND c.available_at <= ?3 \
                 AND (c.lease_until IS NULL OR c.lease_until <= ?3) \
                 AND NOT EXISTS (SELECT 1 FROM {outbox} e \
                     WHERE e.scope = c.scope AND e.seq < c.seq AND e.delivered_at IS NULL \
                     AND (e.available_at > ?3 OR e.lease_until > ?3)) \
                 ORDER BY c.seq LIMIT ?4) \
             RETURNING {MESSAGE_COLUMNS}"
        );
        let now = now_ms();
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(token)
            .bind(now.saturating_add(millis(lease)))
            .bind(now)
            .bind(i64::from(batch))
            .fetch_all(pool)
            .await?;
        let mut messages = rows
            .iter()
            .map(message_row)
            .collect::<Result<Vec<_>, _>>()?;
        messages.sort_unstable_by_key(|message| message.seq);
        Ok(messages)
    }

    async fn mark_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        seqs: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE {outbox} SET delivered_at = ?2, lease_token = NULL, lease_until = NULL \
             WHERE lease_token = ?1 AND delivered_at IS NULL AND seq IN ({})",
            seq_list(seqs)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(token)
            .bind(now_ms())
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn unlease(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        seqs: &[i64],
        failure: Option<Failure<'_>>,
    ) -> Result<u64, sqlx::Error> {
        let failed = match failure {
            Some(_) => ", attempts = attempts + 1, available_at = ?2, last_error = ?3",
            None => "",
        };
        let sql = format!(
            "UPDATE {outbox} SET lease_token = NULL, lease_until = NULL{failed} \
             WHERE lease_token = ?1 AND seq IN ({})",
            seq_list(seqs)
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(token);
        if let Some(failure) = failure {
            query = query
                .bind(now_ms().saturating_add(millis(failure.retry_after)))
                .bind(failure.error);
        }
        Ok(query.execute(pool).await?.rows_affected())
    }

    async fn sweep_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        retention: Duration,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {outbox} WHERE seq IN (SELECT seq FROM {outbox} \
             WHERE delivered_at <= ?1 LIMIT ?2)"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(now_ms().saturating_sub(millis(retention)))
            .bind(i64::from(batch))
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn pending_messages(pool: &Pool<Self>, outbox: &str) -> Result<u64, sqlx::Error> {
        let sql = format!("SELECT count(*) FROM {outbox} WHERE delivered_at IS NULL");
        let count: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(pool)
            .await?;
        Ok(count.unsigned_abs())
    }

    async fn failing_scopes(
        pool: &Pool<Self>,
        outbox: &str,
        limit: u32,
    ) -> Result<Vec<FailingRow>, sqlx::Error> {
        let rows = sqlx::query(AssertSqlSafe(failing_sql(outbox, "h.available_at", limit)))
            .fetch_all(pool)
            .await?;
        rows.iter().map(failing_row).collect()
    }

    async fn record_consumed(
        conn: &mut Self::Connection,
        consumed: &str,
        scope: &str,
        id: &str,
        retention: Duration,
    ) -> Result<bool, sqlx::Error> {
        // A record past its retention counts as absent: it is taken over.
        let sql = format!(
            "INSERT INTO {consumed} (scope, id, consumed_at, expires_at) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (scope, id) DO UPDATE \
                 SET consumed_at = excluded.consumed_at, expires_at = excluded.expires_at \
                 WHERE expires_at <= ?3"
        );
        let now = now_ms();
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(scope.as_bytes())
            .bind(id.as_bytes())
            .bind(now)
            .bind(now.saturating_add(millis(retention)))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep_consumed(
        pool: &Pool<Self>,
        consumed: &str,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {consumed} WHERE rowid IN (SELECT rowid FROM {consumed} \
             WHERE expires_at <= ?1 LIMIT ?2)"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(now_ms())
            .bind(i64::from(batch))
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }
}

/// Whether the outbox `name` in `schema` (`schema.` or empty) has the
/// `last_error` column.
async fn has_last_error(
    pool: &Pool<Sqlite>,
    schema: &str,
    name: &str,
) -> Result<bool, sqlx::Error> {
    let columns: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT name FROM {schema}pragma_table_info('{name}')"
    )))
    .fetch_all(pool)
    .await?;
    Ok(columns.iter().any(|column| column == "last_error"))
}
