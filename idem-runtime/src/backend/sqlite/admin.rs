//! SQLite's key operations for operators: plain bound statements, times as
//! the key table keeps them (milliseconds since the epoch).

use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Pool, Row, Sqlite};

use super::now_ms;
use crate::backend::admin::{Admin, Forgotten, KeyRow};

/// The columns every read selects.
const COLUMNS: &str = "scope, \"key\", fingerprint, status, recovery, request, \
     created_at, expires_at, lease_until";

fn key_row(row: &SqliteRow, now_ms: i64) -> Result<KeyRow, sqlx::Error> {
    Ok(KeyRow {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        fingerprint: row.try_get("fingerprint")?,
        status: row.try_get("status")?,
        created_ms: row.try_get("created_at")?,
        expires_ms: row.try_get("expires_at")?,
        lease_until_ms: row.try_get("lease_until")?,
        now_ms,
        recovery: row.try_get("recovery")?,
        request: row.try_get("request")?,
    })
}

impl Admin for Sqlite {
    async fn lookup(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<Option<KeyRow>, sqlx::Error> {
        let sql = format!("SELECT {COLUMNS} FROM {table} WHERE scope = ?1 AND \"key\" = ?2");
        let row = sqlx::query(AssertSqlSafe(sql))
            .bind(scope.as_bytes())
            .bind(key.as_bytes())
            .fetch_optional(pool)
            .await?;
        let now = now_ms();
        row.as_ref().map(|row| key_row(row, now)).transpose()
    }

    async fn recent(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        limit: u32,
    ) -> Result<Vec<KeyRow>, sqlx::Error> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {table} WHERE scope = ?1 \
             ORDER BY created_at DESC, \"key\" DESC LIMIT ?2"
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(scope.as_bytes())
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?;
        let now = now_ms();
        rows.iter().map(|row| key_row(row, now)).collect()
    }

    async fn forget(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<Forgotten, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {table} WHERE scope = ?1 AND \"key\" = ?2 \
             AND (status IS NOT NULL OR expires_at <= ?3)"
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
