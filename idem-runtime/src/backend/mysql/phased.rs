//! MySQL and MariaDB's phased mode. Without `UPDATE ... RETURNING` or a
//! conditional `ON DUPLICATE KEY UPDATE`, the claim is a short transaction:
//! an upsert that changes nothing but locks the key's row (or inserts it,
//! with token 0, which no claim ever hands out), a read of the locked row,
//! and the takeover decided here. Times are the server's
//! (`UTC_TIMESTAMP(6)`), as for the atomic mode's expiry. sqlx sets
//! `CLIENT_FOUND_ROWS`, so a guarded `UPDATE` counts the rows it matched.

use std::time::Duration;

use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Pool, Row};

use super::MAX_SCOPE_BYTES;
use super::sql::tombstone_set;
use crate::backend::phased::{
    Abandoned, Holder, LeaseClaim, LeaseOutcome, Phased, PhasedStore, Release, abandoned_sql,
    count_uncertain_sql,
};
use crate::backend::rows::{abandoned, tombstone_columns, unclaimed};
use crate::backend::store::{Store, UNCERTAIN, ms};
use crate::backend::{Acquire, FinishError, StoreError, abandon};
use crate::response::EncodedResponse;

/// `UTC_TIMESTAMP(6)` plus a bound number of milliseconds.
const AFTER: &str = "UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND";

/// The key's row, as `WHERE` names it (scope and key bound in that order).
const ROW: &str = "scope = ? AND `key` = ?";

impl Phased for MySql {}

impl PhasedStore for MySql {
    async fn lease(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        lease: &LeaseClaim<'_>,
    ) -> Result<LeaseOutcome, StoreError> {
        let claim = &lease.claim;
        if claim.scope.len() > MAX_SCOPE_BYTES {
            return Err(StoreError::ScopeTooLong {
                len: claim.scope.len(),
                max: MAX_SCOPE_BYTES,
            });
        }
        let mut conn = Self::begin(pool, acquire)
            .await
            .map_err(StoreError::Database)?;
        let found = take(&mut conn, table, lease).await;
        match found {
            Ok(found) => match Self::finish(&mut conn, table, None, None).await {
                Ok(()) => {
                    conn.release();
                    Ok(found)
                }
                Err(FinishError::Ended(error) | FinishError::Store(error)) => {
                    abandon(conn).await;
                    Err(error)
                }
            },
            Err(error) => {
                abandon(conn).await;
                Err(error)
            }
        }
    }

    async fn record(
        conn: &mut MySqlConnection,
        table: &str,
        holder: &Holder,
        recovery: &[u8],
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {table} SET recovery = ?, lease_until = {AFTER} \
             WHERE {ROW} AND lease_token = ? AND status IS NULL"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(recovery)
            .bind(ms(lease))
            .bind(holder.scope.as_bytes())
            .bind(holder.key.as_bytes())
            .bind(holder.token)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn store(
        conn: &mut MySqlConnection,
        table: &str,
        holder: &Holder,
        response: &EncodedResponse,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {table} SET status = ?, headers = ?, body = ?, \
                 recovery = NULL, request = NULL, lease_until = NULL{} \
             WHERE {ROW} AND lease_token = ? AND status IS NULL",
            tombstone_set(response)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(response.status.as_u16())
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
        conn: &mut MySqlConnection,
        table: &str,
        holder: &Holder,
        how: Release<'_>,
    ) -> Result<bool, sqlx::Error> {
        let guard = format!("{ROW} AND lease_token = ? AND status IS NULL");
        let done =
            match how {
                Release::Uncertain(record) => sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {table} SET status = {UNCERTAIN}, body = ?, lease_until = created_at \
                     WHERE {guard}"
                )))
                .bind(record)
                .bind(holder.scope.as_bytes())
                .bind(holder.key.as_bytes())
                .bind(holder.token)
                .execute(conn)
                .await?,
                Release::Delete => {
                    sqlx::query(AssertSqlSafe(format!("DELETE FROM {table} WHERE {guard}")))
                        .bind(holder.scope.as_bytes())
                        .bind(holder.key.as_bytes())
                        .bind(holder.token)
                        .execute(conn)
                        .await?
                }
                Release::Keep(after) => {
                    sqlx::query(AssertSqlSafe(format!(
                        "UPDATE {table} SET lease_until = {AFTER} WHERE {guard}"
                    )))
                    .bind(ms(after))
                    .bind(holder.scope.as_bytes())
                    .bind(holder.key.as_bytes())
                    .bind(holder.token)
                    .execute(conn)
                    .await?
                }
            };
        Ok(done.rows_affected() == 1)
    }

    async fn abandoned(
        pool: &Pool<Self>,
        table: &str,
        limit: u32,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let sql = abandoned_sql(table, "`key`", "UTC_TIMESTAMP(6)", limit);
        let rows = sqlx::query(AssertSqlSafe(sql)).fetch_all(pool).await?;
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
        // The token it matched, plus one: no `RETURNING` needed.
        let sql = format!(
            "UPDATE {table} SET lease_token = lease_token + 1, lease_until = {AFTER}, \
                 attempts = COALESCE(attempts, 0) + 1 \
             WHERE {ROW} AND lease_token = ? AND status IS NULL \
                 AND lease_until <= UTC_TIMESTAMP(6)"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(ms(lease))
            .bind(holder.scope.as_bytes())
            .bind(holder.key.as_bytes())
            .bind(holder.token)
            .execute(pool)
            .await?;
        Ok((done.rows_affected() == 1).then_some(holder.token + 1))
    }
}

/// The claim's statements inside its transaction: lock (or insert) the
/// row, read it, and take it over where the rules allow.
async fn take(
    conn: &mut MySqlConnection,
    table: &str,
    lease: &LeaseClaim<'_>,
) -> Result<LeaseOutcome, StoreError> {
    let claim = &lease.claim;
    let insert = format!(
        "INSERT INTO {table} (scope, `key`, fingerprint, created_at, expires_at, \
             lease_token, lease_until, request, attempts) \
         VALUES (?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND, \
             0, {AFTER}, ?, 0) \
         ON DUPLICATE KEY UPDATE lease_token = lease_token"
    );
    sqlx::query(AssertSqlSafe(insert))
        .bind(claim.scope.as_bytes())
        .bind(claim.key.as_bytes())
        .bind(&claim.fingerprint.as_bytes()[..])
        .bind(ms(claim.ttl))
        .bind(ms(lease.lease))
        .bind(lease.request)
        .execute(&mut *conn)
        .await
        .map_err(StoreError::Database)?;
    let select = format!(
        "SELECT status, fingerprint, headers, body, lease_token, recovery, attempts, \
             expires_at <= UTC_TIMESTAMP(6) AS expired, \
             COALESCE(lease_until <= UTC_TIMESTAMP(6), TRUE) AS ended, \
             COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until) DIV 1000, 0) \
                 AS remaining_ms, {} \
         FROM {table} WHERE {ROW} FOR UPDATE",
        tombstone_columns(super::NOW)
    );
    let row = sqlx::query(AssertSqlSafe(select))
        .bind(claim.scope.as_bytes())
        .bind(claim.key.as_bytes())
        .fetch_one(&mut *conn)
        .await
        .map_err(StoreError::Database)?;
    let found = unclaimed(&row).map_err(StoreError::Database)?;
    let token = found.token;
    let expired = row
        .try_get::<i64, _>("expired")
        .map_err(StoreError::Database)?
        != 0;
    let ended = row
        .try_get::<i64, _>("ended")
        .map_err(StoreError::Database)?
        != 0;
    let same = found.fingerprint[..] == claim.fingerprint.as_bytes()[..];
    let reserved = token.is_some() && token == lease.reserved;
    let spent = found.attempts >= i64::from(lease.max_attempts);
    let resumable = found.status.is_none()
        && same
        && token.is_some_and(|token| token > 0 && ((ended && !spent) || reserved));
    let (set, recovery) = match token {
        // Inserted just now by this claim.
        Some(0) => ("lease_token = 1", None),
        _ if expired => (
            "lease_token = COALESCE(lease_token, 0) + 1, recovery = NULL, attempts = 0, \
             created_at = UTC_TIMESTAMP(6), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND, \
             status = NULL, headers = NULL, body = NULL, location = NULL, replay_until = NULL, \
             fingerprint = ?",
            None,
        ),
        _ if resumable && reserved => (
            "lease_token = lease_token + 1",
            row.try_get::<Option<Vec<u8>>, _>("recovery")
                .map_err(StoreError::Database)?,
        ),
        _ if resumable => (
            "lease_token = lease_token + 1, attempts = COALESCE(attempts, 0) + 1",
            row.try_get::<Option<Vec<u8>>, _>("recovery")
                .map_err(StoreError::Database)?,
        ),
        _ => return found.outcome(&claim.fingerprint, lease.max_attempts),
    };
    let update =
        format!("UPDATE {table} SET {set}, lease_until = {AFTER}, request = ? WHERE {ROW}");
    let mut query = sqlx::query(AssertSqlSafe(update));
    if expired && token != Some(0) {
        query = query
            .bind(ms(claim.ttl))
            .bind(&claim.fingerprint.as_bytes()[..]);
    }
    query
        .bind(ms(lease.lease))
        .bind(lease.request)
        .bind(claim.scope.as_bytes())
        .bind(claim.key.as_bytes())
        .execute(&mut *conn)
        .await
        .map_err(StoreError::Database)?;
    Ok(LeaseOutcome::Owned {
        token: token.map_or(1, |token| token + 1),
        recovery,
    })
}
