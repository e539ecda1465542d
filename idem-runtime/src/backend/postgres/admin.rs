//! PostgreSQL's key operations for operators: statements with their values
//! inlined (`super::simple`), the times read as milliseconds by the
//! server's clock.

use sqlx::postgres::PgRow;
use sqlx::{Pool, Postgres, Row};

use super::simple;
use super::sql::Arg;

use crate::backend::admin::{Admin, Forgotten, KeyRow};

/// The columns every read selects, times as epoch milliseconds.
const COLUMNS: &str = "scope, key, fingerprint, status, recovery, request, \
     (extract(epoch FROM created_at) * 1000)::bigint AS created_ms, \
     (extract(epoch FROM expires_at) * 1000)::bigint AS expires_ms, \
     (extract(epoch FROM lease_until) * 1000)::bigint AS lease_until_ms, \
     (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms";

fn key_row(row: &PgRow) -> Result<KeyRow, sqlx::Error> {
    Ok(KeyRow {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        fingerprint: row.try_get("fingerprint")?,
        status: row.try_get::<Option<i16>, _>("status")?.map(i64::from),
        created_ms: row.try_get("created_ms")?,
        expires_ms: row.try_get("expires_ms")?,
        lease_until_ms: row.try_get("lease_until_ms")?,
        now_ms: row.try_get("now_ms")?,
        recovery: row.try_get("recovery")?,
        request: row.try_get("request")?,
    })
}

impl Admin for Postgres {
    async fn lookup(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<Option<KeyRow>, sqlx::Error> {
        let sql = format!("SELECT {COLUMNS} FROM {table} WHERE scope = $1 AND key = $2");
        simple(
            &sql,
            &[Arg::Bytes(scope.as_bytes()), Arg::Bytes(key.as_bytes())],
        )
        .fetch_optional(pool)
        .await?
        .as_ref()
        .map(key_row)
        .transpose()
    }

    async fn recent(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        limit: u32,
    ) -> Result<Vec<KeyRow>, sqlx::Error> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {table} WHERE scope = $1 \
             ORDER BY created_at DESC, key DESC LIMIT $2"
        );
        simple(
            &sql,
            &[Arg::Bytes(scope.as_bytes()), Arg::Int(limit.into())],
        )
        .fetch_all(pool)
        .await?
        .iter()
        .map(key_row)
        .collect()
    }

    async fn forget(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<Forgotten, sqlx::Error> {
        // A row another transaction updates (a takeover) is re-checked
        // after that transaction commits: the delete then sees its result.
        let sql = format!(
            "DELETE FROM {table} WHERE scope = $1 AND key = $2 \
             AND (status IS NOT NULL OR expires_at <= clock_timestamp())"
        );
        let done = simple(
            &sql,
            &[Arg::Bytes(scope.as_bytes()), Arg::Bytes(key.as_bytes())],
        )
        .execute(pool)
        .await?;
        Ok(if done.rows_affected() == 1 {
            Forgotten::Deleted
        } else {
            Forgotten::Absent
        })
    }
}
