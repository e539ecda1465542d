//! PostgreSQL's outbox and consumed-messages tables: statements with
//! their values inlined (`super::simple`), times by the server's clock. Relays serialise their leases
//! with a transaction-scoped advisory lock on the outbox's name.

use std::time::Duration;

use sqlx::{Pool, Postgres, Row};

use super::sql::{Arg, fnv1a};
use super::{index_name, qualified, regclasses_exist, run_ddl, simple};
use crate::backend::outbox_store::{
    FailingRow, Failure, MESSAGE_COLUMNS, MessageRow, NewMessage, OutboxStore, failing_sql, millis,
    seq_list,
};
use crate::backend::rows::{failing_row, message_row};
use crate::error::Error;

impl OutboxStore for Postgres {
    async fn migrate_outbox(pool: &Pool<Self>, outbox: &str, consumed: &str) -> Result<(), Error> {
        let (pending, heads, touched, delivered, expires) = (
            index_name(outbox, "pending_idx"),
            index_name(outbox, "scope_idx"),
            index_name(outbox, "touched_idx"),
            index_name(outbox, "delivered_idx"),
            index_name(consumed, "expires_at_idx"),
        );
        // As for keys: a catalog read locks nothing, `CREATE INDEX IF NOT
        // EXISTS` would wait for every open transaction writing a message
        // (and `ADD COLUMN IF NOT EXISTS` take the table's exclusive lock).
        let migrated = regclasses_exist(
            pool,
            &[
                outbox,
                &qualified(outbox, &delivered),
                &qualified(outbox, &touched),
                consumed,
                &qualified(consumed, &expires),
            ],
        )
        .await?
            && has_last_error(pool, outbox).await?;
        if migrated {
            return Ok(());
        }
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {outbox} (
                seq bigserial PRIMARY KEY,
                id text NOT NULL UNIQUE,
                scope bytea NOT NULL,
                topic text NOT NULL,
                payload bytea NOT NULL,
                created_at timestamptz NOT NULL DEFAULT now(),
                available_at timestamptz NOT NULL DEFAULT now(),
                attempts integer NOT NULL DEFAULT 0,
                lease_token bigint,
                lease_until timestamptz,
                delivered_at timestamptz,
                last_error text
            );
            ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS last_error text;
            CREATE INDEX IF NOT EXISTS {pending} ON {outbox} (seq) WHERE delivered_at IS NULL;
            CREATE INDEX IF NOT EXISTS {heads} ON {outbox} (scope, seq) WHERE delivered_at IS NULL;
            CREATE INDEX IF NOT EXISTS {touched} ON {outbox} (scope, seq)
                WHERE delivered_at IS NULL AND (lease_until IS NOT NULL OR attempts > 0);
            CREATE INDEX IF NOT EXISTS {delivered} ON {outbox} (delivered_at)
                WHERE delivered_at IS NOT NULL;
            CREATE TABLE IF NOT EXISTS {consumed} (
                scope bytea NOT NULL,
                id bytea NOT NULL,
                consumed_at timestamptz NOT NULL DEFAULT now(),
                expires_at timestamptz NOT NULL,
                PRIMARY KEY (scope, id)
            );
            CREATE INDEX IF NOT EXISTS {expires} ON {consumed} (expires_at);"
        );
        run_ddl(pool, &ddl).await
    }

    async fn enqueue(
        conn: &mut Self::Connection,
        outbox: &str,
        message: &NewMessage<'_>,
    ) -> Result<(), sqlx::Error> {
        let sql =
            format!("INSERT INTO {outbox} (id, scope, topic, payload) VALUES ($1, $2, $3, $4)");
        let args = [
            Arg::Text(message.id),
            Arg::Bytes(message.scope.as_bytes()),
            Arg::Text(message.topic),
            Arg::Bytes(message.payload),
        ];
        simple(&sql, &args).execute(conn).await?;
        Ok(())
    }

    async fn lease_messages(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        lease: Duration,
        batch: u32,
    ) -> Result<Vec<MessageRow>, sqlx::Error> {
        // Under the lock no other relay leases, so the scan sees every live
        // lease: a message whose scope has an older one blocked (waiting
        // for a retry, or leased) is not taken, and the older ones that are
        // free come first in `seq` order, so a scope's share is a prefix.
        // The blocked heads are found once per pass, not once per candidate:
        // only a message leased or failed before can be blocked (a new one
        // is available from its commit on), a small set its own index
        // keeps, and a backlog that grew since the last ANALYZE cannot turn
        // the check into a scan of every pending message per candidate.
        let sql = format!(
            "WITH blocked AS MATERIALIZED (SELECT e.scope, min(e.seq) AS seq FROM {outbox} e \
                 WHERE e.delivered_at IS NULL AND (e.lease_until IS NOT NULL OR e.attempts > 0) \
                 AND (e.available_at > statement_timestamp() \
                      OR e.lease_until > statement_timestamp()) \
                 GROUP BY e.scope) \
             UPDATE {outbox} SET lease_token = $1, \
                 lease_until = statement_timestamp() + $2 * interval '1 millisecond' \
             WHERE seq IN (SELECT c.seq FROM {outbox} c \
                 WHERE c.delivered_at IS NULL AND c.available_at <= statement_timestamp() \
                 AND (c.lease_until IS NULL OR c.lease_until <= statement_timestamp()) \
                 AND NOT EXISTS (SELECT 1 FROM blocked b WHERE b.scope = c.scope AND b.seq < c.seq) \
                 ORDER BY c.seq LIMIT $3 FOR UPDATE OF c SKIP LOCKED) \
             RETURNING {MESSAGE_COLUMNS}"
        );
        let mut tx = pool.begin().await?;
        let lock = fnv1a(outbox.bytes()).cast_signed();
        simple("SELECT pg_advisory_xact_lock($1)", &[Arg::Signed(lock)])
            .execute(&mut *tx)
            .await?;
        let args = [
            Arg::Signed(token),
            Arg::Signed(millis(lease)),
            Arg::Int(batch.into()),
        ];
        let rows = simple(&sql, &args).fetch_all(&mut *tx).await?;
        tx.commit().await?;
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
            "UPDATE {outbox} SET delivered_at = now(), lease_token = NULL, lease_until = NULL \
             WHERE lease_token = $1 AND delivered_at IS NULL AND seq IN ({})",
            seq_list(seqs)
        );
        let done = simple(&sql, &[Arg::Signed(token)]).execute(pool).await?;
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
            Some(_) => {
                ", attempts = attempts + 1, \
                 available_at = now() + $2 * interval '1 millisecond', last_error = $3"
            }
            None => "",
        };
        let sql = format!(
            "UPDATE {outbox} SET lease_token = NULL, lease_until = NULL{failed} \
             WHERE lease_token = $1 AND seq IN ({})",
            seq_list(seqs)
        );
        let args = [
            Arg::Signed(token),
            Arg::Signed(failure.map_or(0, |failure| millis(failure.retry_after))),
            Arg::Text(failure.map_or("", |failure| failure.error)),
        ];
        Ok(simple(&sql, &args).execute(pool).await?.rows_affected())
    }

    async fn sweep_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        retention: Duration,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {outbox} WHERE seq IN (SELECT seq FROM {outbox} \
             WHERE delivered_at <= now() - $1 * interval '1 millisecond' LIMIT $2)"
        );
        let args = [Arg::Signed(millis(retention)), Arg::Int(batch.into())];
        let done = simple(&sql, &args).execute(pool).await?;
        Ok(done.rows_affected())
    }

    async fn pending_messages(pool: &Pool<Self>, outbox: &str) -> Result<u64, sqlx::Error> {
        let sql = format!("SELECT count(*) FROM {outbox} WHERE delivered_at IS NULL");
        let count: i64 = simple(&sql, &[]).fetch_one(pool).await?.try_get(0)?;
        Ok(count.unsigned_abs())
    }

    async fn failing_scopes(
        pool: &Pool<Self>,
        outbox: &str,
        limit: u32,
    ) -> Result<Vec<FailingRow>, sqlx::Error> {
        let next_ms = "(extract(epoch FROM h.available_at) * 1000)::bigint";
        let rows = simple(&failing_sql(outbox, next_ms, limit), &[])
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
        // A record past its retention counts as absent, as an expired key:
        // it is taken over.
        let sql = format!(
            "INSERT INTO {consumed} AS c (scope, id, expires_at) \
             VALUES ($1, $2, now() + $3 * interval '1 millisecond') \
             ON CONFLICT (scope, id) DO UPDATE \
                 SET consumed_at = now(), expires_at = excluded.expires_at \
                 WHERE c.expires_at <= now()"
        );
        let args = [
            Arg::Bytes(scope.as_bytes()),
            Arg::Bytes(id.as_bytes()),
            Arg::Signed(millis(retention)),
        ];
        let done = simple(&sql, &args).execute(conn).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep_consumed(
        pool: &Pool<Self>,
        consumed: &str,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {consumed} WHERE (scope, id) IN (SELECT scope, id FROM {consumed} \
             WHERE expires_at <= now() LIMIT $1)"
        );
        let done = simple(&sql, &[Arg::Int(batch.into())])
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }
}

/// Whether `outbox` has the `last_error` column (added after the table
/// first shipped), read from the catalog without a lock.
async fn has_last_error(pool: &Pool<Postgres>, outbox: &str) -> Result<bool, sqlx::Error> {
    let sql = "SELECT EXISTS (SELECT 1 FROM pg_attribute \
         WHERE attrelid = to_regclass($1) AND attname = 'last_error' AND NOT attisdropped)";
    simple(sql, &[Arg::Text(outbox)])
        .fetch_one(pool)
        .await?
        .try_get(0)
}
