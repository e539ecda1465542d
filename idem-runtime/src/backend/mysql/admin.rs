//! MySQL/MariaDB's key operations for operators: plain bound statements,
//! the times (kept in UTC) read as milliseconds since the epoch.

use sqlx::{AssertSqlSafe, Executor};
use sqlx::{MySql, Pool};

use super::{ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, number};
use crate::backend::admin::{Admin, AdminStore, Forgotten, KeyReads, KeyRow, Param, Write};
use crate::backend::rows::{key_row, resolution_row};
use crate::resolve::ResolutionRecord;

/// `sql` with `params` bound in order.
fn bound<'q>(
    sql: &str,
    params: &[Param<'q>],
) -> sqlx::query::Query<'q, MySql, <MySql as sqlx::Database>::Arguments> {
    let mut query = sqlx::query(AssertSqlSafe(sql.to_owned()));
    for param in params {
        query = match *param {
            Param::Bytes(bytes) => query.bind(bytes),
            Param::Int(int) => query.bind(int),
            Param::Text(text) => query.bind(text),
        };
    }
    query
}

/// What a `NOWAIT` read answers when a row is locked: `ER_LOCK_WAIT_TIMEOUT`
/// (MariaDB) or `ER_LOCK_NOWAIT` (MySQL 8).
const LOCK_NOT_GRANTED: [u16; 2] = [ER_LOCK_WAIT_TIMEOUT, 3572];

/// The session's lock wait, kept while the forget's delete waits at most
/// a second for a claim in progress.
const SAVED_LOCK_WAIT: &str = "@idem_admin_saved_lock_wait";

impl Admin for MySql {}

impl AdminStore for MySql {
    const READS: KeyReads = KeyReads {
        columns: "scope, `key`, fingerprint, status, recovery, request, attempts, \
             CASE WHEN status = 0 THEN body END AS uncertainty, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01', created_at) DIV 1000 AS created_ms, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at) DIV 1000 AS expires_ms, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01', lease_until) DIV 1000 AS lease_until_ms, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01', replay_until) DIV 1000 AS replay_until_ms, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) DIV 1000 AS now_ms",
        key: "`key`",
        params: ["?", "?"],
    };

    async fn read_keys(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> Result<Vec<KeyRow>, sqlx::Error> {
        let rows = bound(&sql, &params).fetch_all(pool).await?;
        rows.iter().map(key_row).collect()
    }

    fn param(_n: usize) -> String {
        "?".to_owned()
    }

    const SEES_CLAIMS: bool = true;

    async fn claim_in_flight(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        // A locking read meets the uncommitted row of a claim in progress
        // and, told not to wait, fails at once; a committed or absent row
        // it reads (or does not) without waiting.
        let sql = format!(
            "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? LOCK IN SHARE MODE NOWAIT"
        );
        let read = sqlx::query(AssertSqlSafe(sql))
            .bind(scope.as_bytes())
            .bind(key.as_bytes())
            .fetch_optional(pool)
            .await;
        match read {
            Ok(_) => Ok(false),
            Err(error) if number(&error).is_some_and(|n| LOCK_NOT_GRANTED.contains(&n)) => Ok(true),
            Err(error) => Err(error),
        }
    }

    async fn execute(
        conn: &mut sqlx::MySqlConnection,
        write: &Write<'_>,
    ) -> Result<u64, sqlx::Error> {
        let done = bound(&write.sql, &write.params).execute(conn).await?;
        Ok(done.rows_affected())
    }

    async fn read_resolutions(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> Result<Vec<ResolutionRecord>, sqlx::Error> {
        let rows = bound(&sql, &params).fetch_all(pool).await?;
        rows.iter().map(resolution_row).collect()
    }

    async fn forget(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<Forgotten, sqlx::Error> {
        // The delete reads the row's latest version under its lock, so a
        // claim in progress (its uncommitted row) makes it wait: a second
        // at most, then it is refused as in flight.
        let mut conn = pool.acquire().await?;
        conn.execute(AssertSqlSafe(format!(
            "SET {SAVED_LOCK_WAIT} = @@SESSION.innodb_lock_wait_timeout, \
             SESSION innodb_lock_wait_timeout = 1"
        )))
        .await?;
        let sql = format!(
            "DELETE FROM {table} WHERE scope = ? AND `key` = ? \
             AND (status > 0 OR expires_at <= UTC_TIMESTAMP(6))"
        );
        let deleted = sqlx::query(AssertSqlSafe(sql))
            .bind(scope.as_bytes())
            .bind(key.as_bytes())
            .execute(&mut *conn)
            .await;
        let restored = conn
            .execute(AssertSqlSafe(format!(
                "SET SESSION innodb_lock_wait_timeout = {SAVED_LOCK_WAIT}"
            )))
            .await;
        if restored.is_err() {
            // A connection left with a one-second lock wait is not reused.
            conn.close().await.ok();
        }
        match deleted {
            Ok(done) if done.rows_affected() == 1 => Ok(Forgotten::Deleted),
            Ok(_) => Ok(Forgotten::Absent),
            Err(error)
                if matches!(
                    number(&error),
                    Some(ER_LOCK_WAIT_TIMEOUT | ER_LOCK_DEADLOCK)
                ) =>
            {
                Ok(Forgotten::InFlight)
            }
            Err(error) => Err(error),
        }
    }
}
