//! SQLite's key operations for operators: plain bound statements, times as
//! the key table keeps them (milliseconds since the epoch).

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::now_ms;
use crate::backend::admin::{Admin, AdminStore, Forgotten, KeyReads, KeyRow, Param, Write};
use crate::backend::rows::{key_row, resolution_row};
use crate::resolve::ResolutionRecord;

/// `sql` with `params` bound in order.
fn bound<'q>(
    sql: &str,
    params: &[Param<'q>],
) -> sqlx::query::Query<'q, Sqlite, <Sqlite as sqlx::Database>::Arguments> {
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

impl Admin for Sqlite {}

impl AdminStore for Sqlite {
    const READS: KeyReads = KeyReads {
        columns: "scope, \"key\", fingerprint, status, recovery, request, attempts, \
             CASE WHEN status = 0 THEN body END AS uncertainty, \
             created_at AS created_ms, expires_at AS expires_ms, \
             lease_until AS lease_until_ms, replay_until AS replay_until_ms, \
             CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) AS now_ms",
        key: "\"key\"",
        params: ["?1", "?2"],
    };

    async fn read_keys(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> Result<Vec<KeyRow>, sqlx::Error> {
        let rows = bound(&sql, &params).fetch_all(pool).await?;
        rows.iter().map(key_row).collect()
    }

    fn param(n: usize) -> String {
        format!("?{n}")
    }

    async fn execute(
        conn: &mut sqlx::SqliteConnection,
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
        let sql = format!(
            "DELETE FROM {table} WHERE scope = ?1 AND \"key\" = ?2 \
             AND (status > 0 OR expires_at <= ?3)"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(scope.as_bytes())
            .bind(key.as_bytes())
            .bind(now_ms())
            .execute(pool)
            .await?;
        Ok(if done.rows_affected() == 1 {
            Forgotten::Deleted
        } else {
            Forgotten::Absent
        })
    }
}
