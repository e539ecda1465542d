//! SQLite's phased mode: the lease claim is one upsert in autocommit, the
//! recovery points and the response are `UPDATE`s under the token. Times
//! are milliseconds since the epoch, as the key table keeps them.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Pool, Row, Sqlite, SqliteConnection};

use super::{now_ms, ttl_ms};
use crate::backend::phased::{
    Abandoned, Holder, LeaseClaim, LeaseOutcome, Phased, PhasedStore, Release, abandoned_sql,
    count_uncertain_sql,
};
use crate::backend::rows::{abandoned, tombstone_columns, unclaimed};
use crate::backend::store::{UNCERTAIN, ms};
use crate::backend::{Acquire, StoreError, in_autocommit};
use crate::response::EncodedResponse;

impl Phased for Sqlite {}

impl PhasedStore for Sqlite {
    async fn lease(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        lease: &LeaseClaim<'_>,
    ) -> Result<LeaseOutcome, StoreError> {
        let claim = &lease.claim;
        let now = now_ms();
        // An expired row is taken over afresh; an unfinished one of the
        // same request whose lease ended (or that the completer reserved
        // for this request) is taken over with its recovery point. Every
        // claim gets a larger token than the row had.
        let upsert = format!(
            "INSERT INTO {table} (scope, \"key\", fingerprint, created_at, expires_at, \
                 lease_token, lease_until, request, attempts) \
             VALUES (?1, ?2, ?3, ?4, ?5, 1, ?6, ?7, 0) \
             ON CONFLICT (scope, \"key\") DO UPDATE SET \
                 lease_token = COALESCE(lease_token, 0) + 1, \
                 lease_until = excluded.lease_until, \
                 request = excluded.request, \
                 recovery = CASE WHEN expires_at <= ?4 THEN NULL ELSE recovery END, \
                 attempts = CASE WHEN expires_at <= ?4 THEN 0 \
                     WHEN lease_token = ?8 THEN attempts \
                     ELSE COALESCE(attempts, 0) + 1 END, \
                 created_at = CASE WHEN expires_at <= ?4 THEN excluded.created_at ELSE created_at END, \
                 expires_at = CASE WHEN expires_at <= ?4 THEN excluded.expires_at ELSE expires_at END, \
                 status = NULL, headers = NULL, body = NULL, location = NULL, \
                 replay_until = NULL, fingerprint = excluded.fingerprint \
             WHERE expires_at <= ?4 \
                OR (status IS NULL AND lease_token IS NOT NULL \
                    AND fingerprint = excluded.fingerprint \
                    AND ((lease_until <= ?4 AND COALESCE(attempts, 0) < ?9) \
                        OR lease_token = ?8)) \
             RETURNING lease_token, recovery"
        );
        let upsert = &upsert;
        let owned = in_autocommit(pool, acquire, |mut conn| async move {
            let row = sqlx::query(AssertSqlSafe(upsert.clone()))
                .bind(claim.scope.as_bytes())
                .bind(claim.key.as_bytes())
                .bind(&claim.fingerprint.as_bytes()[..])
                .bind(now)
                .bind(now.saturating_add(ttl_ms(claim)))
                .bind(now.saturating_add(ms(lease.lease)))
                .bind(lease.request)
                .bind(lease.reserved.unwrap_or(0))
                .bind(i64::from(lease.max_attempts))
                .fetch_optional(&mut **conn)
                .await;
            (conn, row)
        })
        .await
        .map_err(StoreError::Database)?;
        if let Some(row) = owned {
            return Ok(LeaseOutcome::Owned {
                token: row.try_get("lease_token").map_err(StoreError::Database)?,
                recovery: row.try_get("recovery").map_err(StoreError::Database)?,
            });
        }
        let select = format!(
            "SELECT status, fingerprint, headers, body, lease_token, attempts, recovery, \
                 lease_until - ?3 AS remaining_ms, {} \
             FROM {table} WHERE scope = ?1 AND \"key\" = ?2",
            tombstone_columns("?3")
        );
        let select = &select;
        let row = in_autocommit(pool, acquire, |mut conn| async move {
            let row = sqlx::query(AssertSqlSafe(select.clone()))
                .bind(claim.scope.as_bytes())
                .bind(claim.key.as_bytes())
                .bind(now_ms())
                .fetch_optional(&mut **conn)
                .await;
            (conn, row)
        })
        .await
        .map_err(StoreError::Database)?
        .ok_or(StoreError::Vanished)?;
        unclaimed(&row)
            .map_err(StoreError::Database)?
            .outcome(&claim.fingerprint, lease.max_attempts)
    }

    async fn record(
        conn: &mut SqliteConnection,
        table: &str,
        holder: &Holder,
        recovery: &[u8],
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {table} SET recovery = ?1, lease_until = ?2 \
             WHERE scope = ?3 AND \"key\" = ?4 AND lease_token = ?5 AND status IS NULL"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(recovery)
            .bind(now_ms().saturating_add(ms(lease)))
            .bind(holder.scope.as_bytes())
            .bind(holder.key.as_bytes())
            .bind(holder.token)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn store(
        conn: &mut SqliteConnection,
        table: &str,
        holder: &Holder,
        response: &EncodedResponse,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {table} SET status = ?1, headers = ?2, body = ?3, \
                 recovery = NULL, request = NULL, lease_until = NULL{} \
             WHERE scope = ?4 AND \"key\" = ?5 AND lease_token = ?6 AND status IS NULL",
            super::sql::tombstone_set(response)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(i64::from(response.status.as_u16()))
            .bind(&response.headers[..])
            .bind(&response.body[..])
            .bind(holder.scope.as_bytes())
            .bind(holder.key.as_bytes())
            .bind(holder.token)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(
        conn: &mut SqliteConnection,
        table: &str,
        holder: &Holder,
        how: Release<'_>,
    ) -> Result<bool, sqlx::Error> {
        let row = "scope = ?1 AND \"key\" = ?2 AND lease_token = ?3 AND status IS NULL";
        let query = match how {
            Release::Delete => {
                sqlx::query(AssertSqlSafe(format!("DELETE FROM {table} WHERE {row}")))
            }
            Release::Keep(_) => sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table} SET lease_until = ?4 WHERE {row}"
            ))),
            Release::Uncertain(_) => sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table} SET status = {UNCERTAIN}, body = ?4, lease_until = created_at \
                 WHERE {row}"
            ))),
        };
        let mut query = query
            .bind(holder.scope.as_bytes())
            .bind(holder.key.as_bytes())
            .bind(holder.token);
        match how {
            Release::Keep(after) => query = query.bind(now_ms().saturating_add(ms(after))),
            Release::Uncertain(record) => query = query.bind(record),
            Release::Delete => {}
        }
        Ok(query.execute(conn).await?.rows_affected() == 1)
    }

    async fn abandoned(
        pool: &Pool<Self>,
        table: &str,
        limit: u32,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let sql = abandoned_sql(table, "\"key\"", "?1", limit);
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(now_ms())
            .fetch_all(pool)
            .await?;
        rows.iter().map(abandoned).collect()
    }

    async fn count_uncertain(pool: &Pool<Self>, table: &str) -> Result<u64, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(count_uncertain_sql(table)))
            .fetch_one(pool)
            .await?;
        let count: i64 = row.try_get("uncertain")?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn reserve(
        pool: &Pool<Self>,
        table: &str,
        holder: &Holder,
        lease: Duration,
    ) -> Result<Option<i64>, sqlx::Error> {
        let now = now_ms();
        let sql = format!(
            "UPDATE {table} SET lease_token = lease_token + 1, lease_until = ?1, \
                 attempts = COALESCE(attempts, 0) + 1 \
             WHERE scope = ?2 AND \"key\" = ?3 AND lease_token = ?4 AND status IS NULL \
                 AND lease_until <= ?5 \
             RETURNING lease_token"
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(now.saturating_add(ms(lease)))
            .bind(holder.scope.as_bytes())
            .bind(holder.key.as_bytes())
            .bind(holder.token)
            .bind(now)
            .fetch_optional(pool)
            .await
    }
}
