//! PostgreSQL's key operations for operators: statements with their values
//! inlined (`super::simple`), the times read as milliseconds by the
//! server's clock.

use sqlx::{Pool, Postgres, Row};

use super::simple;
use super::sql::{Arg, lock_id};

use crate::backend::admin::{Admin, AdminStore, Forgotten, KeyReads, KeyRow, Param, Write};
use crate::backend::rows::{key_row, resolution_row};
use crate::resolve::ResolutionRecord;

/// A parameter as the statements inline it.
fn arg(param: Param<'_>) -> Arg<'_> {
    match param {
        Param::Bytes(bytes) => Arg::Bytes(bytes),
        Param::Int(int) => Arg::Signed(int),
        Param::Text(Some(text)) => Arg::Text(text),
        Param::Text(None) => Arg::Null,
    }
}

impl Admin for Postgres {}

impl AdminStore for Postgres {
    const READS: KeyReads = KeyReads {
        columns: "scope, key, fingerprint, status, recovery, request, attempts, \
             CASE WHEN status = 0 THEN body END AS uncertainty, \
             (extract(epoch FROM created_at) * 1000)::bigint AS created_ms, \
             (extract(epoch FROM expires_at) * 1000)::bigint AS expires_ms, \
             (extract(epoch FROM lease_until) * 1000)::bigint AS lease_until_ms, \
             (extract(epoch FROM replay_until) * 1000)::bigint AS replay_until_ms, \
             (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms",
        key: "key",
        params: ["$1", "$2"],
    };

    async fn read_keys(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> Result<Vec<KeyRow>, sqlx::Error> {
        let rows = simple(&sql, &params.map(arg)).fetch_all(pool).await?;
        rows.iter().map(key_row).collect()
    }

    fn param(n: usize) -> String {
        format!("${n}")
    }

    const SEES_CLAIMS: bool = true;

    async fn claim_in_flight(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        // A bigint advisory lock shows in `pg_locks` as its high and low
        // 32 bits, `objsubid` 1, in the database it was taken in.
        let lock_table = super::advisory::lock_table(pool, pool, table).await?;
        let id = lock_id(&lock_table, scope, key) as u64;
        let sql = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 1) AS held";
        let args = [
            Arg::Signed((id >> 32) as i64),
            Arg::Signed((id & 0xffff_ffff) as i64),
        ];
        simple(sql, &args).fetch_one(pool).await?.try_get("held")
    }

    async fn execute(conn: &mut sqlx::PgConnection, write: &Write<'_>) -> Result<u64, sqlx::Error> {
        let args: Vec<Arg<'_>> = write.params.iter().copied().map(arg).collect();
        Ok(simple(&write.sql, &args)
            .execute(conn)
            .await?
            .rows_affected())
    }

    async fn read_resolutions(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> Result<Vec<ResolutionRecord>, sqlx::Error> {
        let rows = simple(&sql, &params.map(arg)).fetch_all(pool).await?;
        rows.iter().map(resolution_row).collect()
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
             AND (status > 0 OR expires_at <= clock_timestamp())"
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
