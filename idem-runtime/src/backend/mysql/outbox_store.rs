//! MySQL's outbox and consumed-messages tables, times by the server's
//! clock in UTC (as the key table keeps them). Relays serialise their leases with a named lock (`GET_LOCK`),
//! held by the session across the lease's short transaction and released
//! after its commit; a session that dies releases it with itself.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, MySql, Pool};

use super::MAX_SCOPE_BYTES;
use crate::backend::MAX_MESSAGE_ID_LEN;
use crate::backend::outbox_store::{
    FailingRow, Failure, MESSAGE_COLUMNS, MessageRow, NewMessage, OutboxStore, failing_sql, millis,
    seq_list,
};
use crate::backend::rows::{failing_row, message_row};
use crate::backend::{OpenTx, fnv1a};
use crate::error::Error;

/// How long a relay waits for another's lease before leasing nothing.
const LEASE_LOCK_WAIT_SECONDS: i64 = 5;

/// The named lock relays of `outbox` lease under.
pub(super) fn lease_lock(outbox: &str) -> String {
    format!("idem_outbox_{:016x}", fnv1a(outbox.bytes()))
}

/// `table`'s index `suffix`, within MySQL's 64 characters.
fn index_name(table: &str, suffix: &str) -> String {
    let name = table.rsplit('.').next().unwrap_or(table);
    match format!("{name}_{suffix}") {
        index if index.len() <= 64 => index,
        _ => format!("idem_{suffix}"),
    }
}

impl OutboxStore for MySql {
    async fn migrate_outbox(pool: &Pool<Self>, outbox: &str, consumed: &str) -> Result<(), Error> {
        let (scopes, delivered, expires) = (
            index_name(outbox, "scope_idx"),
            index_name(outbox, "delivered_idx"),
            index_name(consumed, "expires_at_idx"),
        );
        // DDL takes a metadata lock: concurrent migrations queue, no race.
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {outbox} (
                seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                id VARCHAR({MAX_MESSAGE_ID_LEN}) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                scope VARBINARY({MAX_SCOPE_BYTES}) NOT NULL,
                topic VARCHAR(255) NOT NULL,
                payload LONGBLOB NOT NULL,
                created_at DATETIME(6) NOT NULL,
                available_at DATETIME(6) NOT NULL,
                attempts INT NOT NULL DEFAULT 0,
                lease_token BIGINT NULL,
                lease_until DATETIME(6) NULL,
                delivered_at DATETIME(6) NULL,
                last_error TEXT CHARACTER SET utf8mb4 NULL,
                UNIQUE KEY {id} (id),
                KEY {scopes} (scope, delivered_at, seq),
                KEY {delivered} (delivered_at)
            ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
            CREATE TABLE IF NOT EXISTS {consumed} (
                scope VARBINARY({MAX_SCOPE_BYTES}) NOT NULL,
                id VARBINARY({MAX_MESSAGE_ID_LEN}) NOT NULL,
                consumed_at DATETIME(6) NOT NULL,
                expires_at DATETIME(6) NOT NULL,
                PRIMARY KEY (scope, id),
                KEY {expires} (expires_at)
            ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC",
            id = index_name(outbox, "id_idx"),
        );
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
        // `last_error` came later: a table from before gets it (MySQL has
        // no `ADD COLUMN IF NOT EXISTS`; MariaDB has). A migration at once
        // may add it between the read and the `ALTER`, which then fails: it
        // is there.
        if !has_last_error(pool, outbox).await? {
            let added = sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {outbox} ADD COLUMN last_error TEXT CHARACTER SET utf8mb4 NULL"
            )))
            .execute(pool)
            .await;
            if let Err(error) = added
                && !has_last_error(pool, outbox).await?
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
             VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(message.id)
            .bind(message.scope.as_bytes())
            .bind(message.topic)
            .bind(message.payload)
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
        let lock = lease_lock(outbox);
        // Closed unless released: a lease cut half-way (its future dropped)
        // must not pool a session that may hold the lock, an open
        // transaction, or a reply not yet read.
        let mut conn = OpenTx::acquire(pool).await?;
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(&lock)
            .bind(LEASE_LOCK_WAIT_SECONDS)
            .fetch_one(&mut **conn)
            .await?;
        if locked != Some(1) {
            // Another relay is leasing, for longer than a lease takes.
            conn.release();
            return Ok(Vec::new());
        }
        // See the PostgreSQL lease: under the lock a scope's share is a
        // prefix of its undelivered messages, none of them blocked. The
        // subquery's rows are read without locks (only the outer query's
        // are locked).
        let candidates = format!(
            "SELECT c.seq FROM {outbox} c \
             WHERE c.delivered_at IS NULL AND c.available_at <= UTC_TIMESTAMP(6) \
             AND (c.lease_until IS NULL OR c.lease_until <= UTC_TIMESTAMP(6)) \
             AND NOT EXISTS (SELECT 1 FROM {outbox} e \
                 WHERE e.scope = c.scope AND e.seq < c.seq AND e.delivered_at IS NULL \
                 AND (e.available_at > UTC_TIMESTAMP(6) OR e.lease_until > UTC_TIMESTAMP(6))) \
             ORDER BY c.seq LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let leased = async {
            let mut tx = conn.begin().await?;
            let seqs: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(candidates))
                .bind(i64::from(batch))
                .fetch_all(&mut *tx)
                .await?;
            if seqs.is_empty() {
                tx.commit().await?;
                return Ok(Vec::new());
            }
            let list = seq_list(&seqs);
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {outbox} SET lease_token = ?, \
                     lease_until = UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND \
                 WHERE seq IN ({list})"
            )))
            .bind(token)
            .bind(millis(lease))
            .execute(&mut *tx)
            .await?;
            let rows = sqlx::query(AssertSqlSafe(format!(
                "SELECT {MESSAGE_COLUMNS} FROM {outbox} WHERE seq IN ({list}) ORDER BY seq"
            )))
            .fetch_all(&mut *tx)
            .await?;
            tx.commit().await?;
            rows.iter().map(message_row).collect::<Result<Vec<_>, _>>()
        }
        .await;
        // After an error the session may still hold the lock: dropped, it
        // is closed, and the lock ends with it.
        let messages = leased?;
        sqlx::query("DO RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut **conn)
            .await?;
        conn.release();
        Ok(messages)
    }

    async fn mark_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        seqs: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE {outbox} SET delivered_at = UTC_TIMESTAMP(6), lease_token = NULL, lease_until = NULL \
             WHERE lease_token = ? AND delivered_at IS NULL AND seq IN ({})",
            seq_list(seqs)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(token)
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
        // MySQL assigns left to right: `available_at` before the lease is
        // cleared changes nothing here, but keep the token test last.
        let failed = match failure {
            Some(_) => {
                "attempts = attempts + 1, \
                 available_at = UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND, \
                 last_error = ?, "
            }
            None => "",
        };
        let sql = format!(
            "UPDATE {outbox} SET {failed}lease_token = NULL, lease_until = NULL \
             WHERE lease_token = ? AND seq IN ({})",
            seq_list(seqs)
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        if let Some(failure) = failure {
            query = query.bind(millis(failure.retry_after)).bind(failure.error);
        }
        Ok(query.bind(token).execute(pool).await?.rows_affected())
    }

    async fn sweep_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        retention: Duration,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {outbox} \
             WHERE delivered_at <= UTC_TIMESTAMP(6) - INTERVAL ? * 1000 MICROSECOND \
             ORDER BY delivered_at LIMIT ?"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(millis(retention))
            .bind(i64::from(batch))
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn pending_messages(pool: &Pool<Self>, outbox: &str) -> Result<u64, sqlx::Error> {
        let sql = format!("SELECT COUNT(*) FROM {outbox} WHERE delivered_at IS NULL");
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
        let next_ms = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', h.available_at) DIV 1000";
        let rows = sqlx::query(AssertSqlSafe(failing_sql(outbox, next_ms, limit)))
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
        // The insert comes first: a `DELETE` of a row not there yet would
        // take a gap lock, and two deliveries of one message each holding
        // one would deadlock on their inserts. (An upsert cannot tell an
        // insert from a duplicate here: sqlx connects with
        // `CLIENT_FOUND_ROWS`, which counts both as one row.) The lengths
        // were checked before: `IGNORE` only skips a duplicate.
        let insert = format!(
            "INSERT IGNORE INTO {consumed} (scope, id, consumed_at, expires_at) \
             VALUES (?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND)"
        );
        let inserted = sqlx::query(AssertSqlSafe(insert.clone()))
            .bind(scope.as_bytes())
            .bind(id.as_bytes())
            .bind(millis(retention))
            .execute(&mut *conn)
            .await?;
        if inserted.rows_affected() == 1 {
            return Ok(true);
        }
        // A record past its retention counts as absent: it is taken over.
        // The usual duplicate is told by a plain read, which takes no lock
        // (deliveries at once each holding the row's shared lock would
        // deadlock on a locking `DELETE`).
        let expired: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(expires_at <= UTC_TIMESTAMP(6) AS SIGNED) FROM {consumed} \
             WHERE scope = ? AND id = ?"
        )))
        .bind(scope.as_bytes())
        .bind(id.as_bytes())
        .fetch_optional(&mut *conn)
        .await?;
        if expired != Some(1) {
            return Ok(false);
        }
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {consumed} WHERE scope = ? AND id = ? AND expires_at <= UTC_TIMESTAMP(6)"
        )))
        .bind(scope.as_bytes())
        .bind(id.as_bytes())
        .execute(&mut *conn)
        .await?;
        let taken = sqlx::query(AssertSqlSafe(insert))
            .bind(scope.as_bytes())
            .bind(id.as_bytes())
            .bind(millis(retention))
            .execute(conn)
            .await?;
        Ok(taken.rows_affected() == 1)
    }

    async fn sweep_consumed(
        pool: &Pool<Self>,
        consumed: &str,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {consumed} WHERE expires_at <= UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT ?"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(i64::from(batch))
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }
}

/// Whether `outbox` has the `last_error` column.
async fn has_last_error(pool: &Pool<MySql>, outbox: &str) -> Result<bool, sqlx::Error> {
    let (schema, name) = match outbox.split_once('.') {
        Some((schema, name)) => (format!("'{schema}'"), name),
        None => ("DATABASE()".to_owned(), outbox),
    };
    let present: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM information_schema.columns \
         WHERE table_schema = {schema} AND table_name = '{name}' AND column_name = 'last_error'"
    )))
    .fetch_one(pool)
    .await?;
    Ok(present > 0)
}
