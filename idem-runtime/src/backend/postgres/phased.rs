//! PostgreSQL's phased mode: the lease claim is one upsert in autocommit,
//! the recovery points and the response are `UPDATE`s under the token.
//! Times are the server's (`clock_timestamp()`, not the transaction's
//! start), so a lease means the same to every instance of the service.
//! Only statements written for CockroachDB and YugabyteDB too (untested
//! there).

use std::time::Duration;

use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, PgConnection, Pool, Postgres, Row};

use super::simple;
use super::sql::{Arg, bytea, tombstone_set};
use sqlx_core::transaction::TransactionManager;

use crate::backend::phased::{
    Abandoned, Holder, LeaseClaim, LeaseOutcome, Phased, PhasedStore, Release, abandoned_sql,
    count_uncertain_sql,
};
use crate::backend::rows::{abandoned, tombstone_columns, unclaimed};
use crate::backend::store::{UNCERTAIN, ms};
use crate::backend::{Acquire, FinishError, OpenTx, StoreError, in_autocommit};
use crate::response::EncodedResponse;

/// `clock_timestamp()` plus `$n` milliseconds.
fn after(n: u8) -> String {
    format!("clock_timestamp() + ${n} * interval '1 millisecond'")
}

impl Phased for Postgres {}

impl PhasedStore for Postgres {
    async fn lease(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        lease: &LeaseClaim<'_>,
    ) -> Result<LeaseOutcome, StoreError> {
        let claim = &lease.claim;
        // An expired row is taken over afresh; an unfinished one of the
        // same request whose lease ended (or that the completer reserved
        // for this request) is taken over with its recovery point. Every
        // claim gets a larger token than the row had.
        let (expires, until) = (after(4), after(5));
        let upsert = format!(
            "INSERT INTO {table} AS k (scope, key, fingerprint, expires_at, \
                 lease_token, lease_until, request, attempts) \
             VALUES ($1, $2, $3, {expires}, 1, {until}, $6, 0) \
             ON CONFLICT (scope, key) DO UPDATE SET \
                 lease_token = COALESCE(k.lease_token, 0) + 1, \
                 lease_until = EXCLUDED.lease_until, \
                 request = EXCLUDED.request, \
                 recovery = CASE WHEN k.expires_at <= clock_timestamp() THEN NULL ELSE k.recovery END, \
                 attempts = CASE WHEN k.expires_at <= clock_timestamp() THEN 0 \
                     WHEN k.lease_token = $7 THEN k.attempts \
                     ELSE COALESCE(k.attempts, 0) + 1 END, \
                 created_at = CASE WHEN k.expires_at <= clock_timestamp() THEN now() ELSE k.created_at END, \
                 expires_at = CASE WHEN k.expires_at <= clock_timestamp() THEN EXCLUDED.expires_at ELSE k.expires_at END, \
                 status = NULL, headers = NULL, body = NULL, location = NULL, \
                 replay_until = NULL, fingerprint = EXCLUDED.fingerprint \
             WHERE k.expires_at <= clock_timestamp() \
                OR (k.status IS NULL AND k.lease_token IS NOT NULL \
                    AND k.fingerprint = EXCLUDED.fingerprint \
                    AND ((k.lease_until <= clock_timestamp() AND COALESCE(k.attempts, 0) < $8) \
                        OR k.lease_token = $7)) \
             RETURNING lease_token, recovery"
        );
        let upsert = &upsert;
        let owned = in_autocommit(pool, acquire, |mut conn| async move {
            let args = [
                Arg::Bytes(claim.scope.as_bytes()),
                Arg::Bytes(claim.key.as_bytes()),
                Arg::Bytes(claim.fingerprint.as_bytes()),
                Arg::Signed(ms(claim.ttl)),
                Arg::Signed(ms(lease.lease)),
                Arg::Bytes(lease.request),
                Arg::Signed(lease.reserved.unwrap_or(0)),
                Arg::Signed(lease.max_attempts.into()),
            ];
            let row = simple(upsert, &args).fetch_optional(&mut **conn).await;
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
                 CAST(EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000 AS bigint) \
                     AS remaining_ms, {} \
             FROM {table} WHERE scope = $1 AND key = $2",
            tombstone_columns("clock_timestamp()")
        );
        let select = &select;
        let row = in_autocommit(pool, acquire, |mut conn| async move {
            let args = [
                Arg::Bytes(claim.scope.as_bytes()),
                Arg::Bytes(claim.key.as_bytes()),
            ];
            let row = simple(select, &args).fetch_optional(&mut **conn).await;
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
        conn: &mut PgConnection,
        table: &str,
        holder: &Holder,
        recovery: &[u8],
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let until = after(2);
        let sql = format!(
            "UPDATE {table} SET recovery = $1, lease_until = {until} \
             WHERE scope = $3 AND key = $4 AND lease_token = $5 AND status IS NULL"
        );
        let args = [
            Arg::Bytes(recovery),
            Arg::Signed(ms(lease)),
            Arg::Bytes(holder.scope.as_bytes()),
            Arg::Bytes(holder.key.as_bytes()),
            Arg::Signed(holder.token),
        ];
        let done = simple(&sql, &args).execute(conn).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_and_commit(
        conn: &mut OpenTx<Self>,
        table: &str,
        holder: &Holder,
        recovery: &[u8],
        lease: Duration,
    ) -> Result<bool, FinishError> {
        let set = format!(
            "recovery = {}, lease_until = clock_timestamp() + {} * interval '1 millisecond'",
            bytea(recovery),
            ms(lease)
        );
        guarded_commit(conn, &guarded_write(table, holder, &set)).await
    }

    async fn store_and_commit(
        conn: &mut OpenTx<Self>,
        table: &str,
        holder: &Holder,
        response: &EncodedResponse,
    ) -> Result<bool, FinishError> {
        let set = format!(
            "status = {}, headers = {}, body = {}, recovery = NULL, request = NULL, \
             lease_until = NULL{}",
            response.status.as_u16(),
            bytea(&response.headers),
            bytea(&response.body),
            tombstone_set(response)
        );
        guarded_commit(conn, &guarded_write(table, holder, &set)).await
    }

    async fn store(
        conn: &mut PgConnection,
        table: &str,
        holder: &Holder,
        response: &EncodedResponse,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {table} SET status = $1, headers = $2, body = $3, \
                 recovery = NULL, request = NULL, lease_until = NULL{} \
             WHERE scope = $4 AND key = $5 AND lease_token = $6 AND status IS NULL",
            tombstone_set(response)
        );
        let headers = &response.headers;
        let args = [
            Arg::Int(response.status.as_u16().into()),
            Arg::Bytes(headers),
            Arg::Bytes(&response.body),
            Arg::Bytes(holder.scope.as_bytes()),
            Arg::Bytes(holder.key.as_bytes()),
            Arg::Signed(holder.token),
        ];
        let done = simple(&sql, &args).execute(conn).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(
        conn: &mut PgConnection,
        table: &str,
        holder: &Holder,
        how: Release<'_>,
    ) -> Result<bool, sqlx::Error> {
        let row = "scope = $1 AND key = $2 AND lease_token = $3 AND status IS NULL";
        let (sql, value) = match how {
            Release::Delete => (format!("DELETE FROM {table} WHERE {row}"), Arg::Signed(0)),
            Release::Keep(kept) => (
                format!("UPDATE {table} SET lease_until = {} WHERE {row}", after(4)),
                Arg::Signed(ms(kept)),
            ),
            Release::Uncertain(record) => (
                format!(
                    "UPDATE {table} SET status = {UNCERTAIN}, body = $4, lease_until = created_at \
                     WHERE {row}"
                ),
                Arg::Bytes(record),
            ),
        };
        let args = [
            Arg::Bytes(holder.scope.as_bytes()),
            Arg::Bytes(holder.key.as_bytes()),
            Arg::Signed(holder.token),
            value,
        ];
        Ok(simple(&sql, &args).execute(conn).await?.rows_affected() == 1)
    }

    async fn abandoned(
        pool: &Pool<Self>,
        table: &str,
        limit: u32,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let sql = abandoned_sql(table, "key", "clock_timestamp()", limit);
        let rows = simple(&sql, &[]).fetch_all(pool).await?;
        rows.iter().map(abandoned).collect()
    }

    async fn count_uncertain(pool: &Pool<Self>, table: &str) -> Result<u64, sqlx::Error> {
        let row = simple(&count_uncertain_sql(table), &[])
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
        let sql = format!(
            "UPDATE {table} SET lease_token = lease_token + 1, lease_until = {}, \
                 attempts = COALESCE(attempts, 0) + 1 \
             WHERE scope = $2 AND key = $3 AND lease_token = $4 AND status IS NULL \
                 AND lease_until <= clock_timestamp() \
             RETURNING lease_token",
            after(1)
        );
        let args = [
            Arg::Signed(ms(lease)),
            Arg::Bytes(holder.scope.as_bytes()),
            Arg::Bytes(holder.key.as_bytes()),
            Arg::Signed(holder.token),
        ];
        simple(&sql, &args)
            .fetch_optional(pool)
            .await?
            .map(|row| row.try_get("lease_token"))
            .transpose()
    }
}

/// `SQLSTATE` `division_by_zero`: how a guarded write that matched no row
/// stops its round trip before the `COMMIT`.
const FENCED: &str = "22012";

/// A write of `set` on the holder's row, then its transaction's commit, in
/// one round trip of the simple query protocol (values inlined as hex and
/// integers we formatted: nothing a client sent reaches the text as such).
/// The write counts the rows it matched and divides by that count: when
/// another attempt holds the key, the division fails, which stops the text
/// before its `COMMIT`, and the caller rolls the transaction back. As in
/// the atomic finish, the text ends by opening the empty transaction whose
/// rollback sqlx queues (see `Postgres::finish`).
fn guarded_write(table: &str, holder: &Holder, set: &str) -> String {
    format!(
        "WITH written AS (UPDATE {table} SET {set} \
             WHERE scope = {} AND key = {} AND lease_token = {} AND status IS NULL RETURNING 1) \
         SELECT 1 / count(*) FROM written; COMMIT; BEGIN",
        bytea(holder.scope.as_bytes()),
        bytea(holder.key.as_bytes()),
        holder.token
    )
}

async fn guarded_commit(conn: &mut OpenTx<Postgres>, text: &str) -> Result<bool, FinishError> {
    match sqlx::raw_sql(AssertSqlSafe(text.to_owned()))
        .execute(&mut ***conn)
        .await
    {
        Ok(_) => {
            PgTransactionManager::start_rollback(conn);
            Ok(true)
        }
        Err(error) if super::has_code(&error, &[FENCED]) => Ok(false),
        Err(error) => Err(super::finish_error(error)),
    }
}
