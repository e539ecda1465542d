//! PostgreSQL's atomic mode ([`Store`]): migration, the claim riding on
//! the transaction's `BEGIN`, the replay's read, the finish riding on its
//! `COMMIT`, and the sweep.

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, Pool, Postgres, Row};
use sqlx_core::transaction::TransactionManager;

use super::sql::{Arg, ClaimRow, PEEK, peek_call};
use super::{
    COMMIT_UNLESS_FAILED, PgClaim, UNDEFINED_STATEMENT, advisory, finish_error, functions,
    has_code, index_name, qualified, regclasses_exist, run_ddl, simple,
};
use crate::backend::rows::replayable_row;
use crate::backend::store::Store;
use crate::backend::{Acquire, Backend, Claim, ClaimOutcome, FinishError, OpenTx, StoreError};
use crate::error::Error;
use crate::response::EncodedResponse;
use crate::table::resolutions_table;

impl Backend for Postgres {}

/// A tombstone's `replay_until` once its response is dropped.
const TOMBSTONED: &str = "'epoch'::timestamptz";

impl Store for Postgres {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        // The phased mode's columns and its index of leases came later:
        // a table from before gets them, once. No index names a column the
        // atomic finish writes (`status`, `headers`, `body`), not even in
        // its predicate: the finish's update then stays heap-only.
        let (index, lease_index, replay_index) = (
            index_name(table, "expires_at_idx"),
            index_name(table, "lease_idx"),
            index_name(table, "replay_idx"),
        );
        let resolutions = resolutions_table(table);
        let resolutions_index = index_name(&resolutions, "key_idx");
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                scope bytea NOT NULL,
                key bytea NOT NULL,
                fingerprint bytea NOT NULL,
                status smallint,
                headers bytea,
                body bytea,
                created_at timestamptz NOT NULL DEFAULT now(),
                expires_at timestamptz NOT NULL,
                lease_token bigint,
                lease_until timestamptz,
                recovery bytea,
                request bytea,
                attempts integer,
                replay_until timestamptz,
                location bytea,
                PRIMARY KEY (scope, key)
            );
            ALTER TABLE {table}
                ADD COLUMN IF NOT EXISTS lease_token bigint,
                ADD COLUMN IF NOT EXISTS lease_until timestamptz,
                ADD COLUMN IF NOT EXISTS recovery bytea,
                ADD COLUMN IF NOT EXISTS request bytea,
                ADD COLUMN IF NOT EXISTS attempts integer,
                ADD COLUMN IF NOT EXISTS replay_until timestamptz,
                ADD COLUMN IF NOT EXISTS location bytea;
            CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
            CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_until)
                WHERE lease_until IS NOT NULL;
            CREATE INDEX IF NOT EXISTS {replay_index} ON {table} (replay_until)
                WHERE replay_until IS NOT NULL;
            CREATE TABLE IF NOT EXISTS {resolutions} (
                scope bytea NOT NULL,
                key bytea NOT NULL,
                resolved_ms bigint NOT NULL,
                outcome text NOT NULL,
                status smallint,
                by_name text,
                note text
            );
            CREATE INDEX IF NOT EXISTS {resolutions_index} ON {resolutions} (scope, key);"
        );
        // `CREATE INDEX IF NOT EXISTS` takes a SHARE lock on the table before
        // it looks for the index: on a live table it would wait for every
        // open claim and queue every new claim behind it. The catalog read
        // locks nothing, so a migrated table costs a start-up nothing.
        if regclasses_exist(
            pool,
            &[
                table,
                &qualified(table, &index),
                &qualified(table, &lease_index),
                &qualified(table, &replay_index),
                &resolutions,
                &qualified(&resolutions, &resolutions_index),
            ],
        )
        .await?
        {
            return Ok(());
        }
        run_ddl(pool, &ddl).await
    }

    /// The table's functions (see `functions.rs`), on a server that
    /// offers advisory locks (the claim's function takes one). A server
    /// that cannot make them (no PL/pgSQL, a role without the right) is
    /// warned of, and its claims inline their statements.
    async fn migrate_pooled(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        if !advisory::offered(pool).await {
            return Ok(());
        }
        match functions::create(pool, table).await {
            Err(Error::Database(sqlx::Error::Database(error))) => {
                tracing::warn!(%error, "idem's functions not made; claims behind the pooler inline their statements");
                Ok(())
            }
            done => done,
        }
    }

    async fn claim(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, StoreError> {
        let (flight, mut claim) = crate::backend::claim::wait_in_process(pool, table, claim).await;
        if claim.advisory {
            claim.advisory = advisory::offered(pool).await;
        }
        let mut row = ClaimRow::new(table, &claim);
        if claim.advisory {
            // Where it must be asked, the claim's first attempt asks on
            // its own connection (`claim_on`).
            row.lock_table = advisory::known_lock_table(pool, table);
        }
        if claim.pooled && claim.advisory {
            row.functions = functions::found(pool, table).await;
        }
        let claim = PgClaim { row, pool };
        let outcome = crate::backend::claim::claim_with_retries(pool, acquire, claim).await;
        crate::backend::claim::held(outcome, flight)
    }

    async fn peek(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome<Self>>, StoreError> {
        // Without a pooler, an ordinary sqlx query, prepared and cached
        // by sqlx per connection; behind one, a call of the table's read
        // function where a claim found it, else the read with its values
        // inlined.
        let row = crate::backend::connection::on_connection(pool, acquire, |mut conn| async move {
            let row = if claim.pooled && functions::known(pool, table) == Some(true) {
                let call = peek_call(table, claim.scope.as_bytes(), claim.key.as_bytes());
                sqlx::raw_sql(AssertSqlSafe(call))
                    .fetch_optional(&mut **conn)
                    .await
            } else if claim.pooled {
                let args = [
                    Arg::Bytes(claim.scope.as_bytes()),
                    Arg::Bytes(claim.key.as_bytes()),
                ];
                simple(&PEEK.replace("{table}", table), &args)
                    .fetch_optional(&mut **conn)
                    .await
            } else {
                sqlx::query(AssertSqlSafe(PEEK.replace("{table}", table)))
                    .bind(claim.scope.as_bytes())
                    .bind(claim.key.as_bytes())
                    .fetch_optional(&mut **conn)
                    .await
            };
            conn.release_unless_gone(&row);
            row
        })
        .await
        .map_err(StoreError::Database)?;
        let finished = row.as_ref().map(replayable_row).transpose()?.flatten();
        Ok(
            finished.map(|(fingerprint, response)| ClaimOutcome::Finished {
                fingerprint,
                response,
            }),
        )
    }

    async fn begin(pool: &Pool<Self>, acquire: Acquire) -> Result<OpenTx<Self>, sqlx::Error> {
        crate::backend::connection::on_connection(pool, acquire, |mut conn| async move {
            PgTransactionManager::begin(&mut conn, None).await?;
            Ok(conn)
        })
        .await
    }

    async fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&EncodedResponse>,
    ) -> Result<(), FinishError> {
        let (text, keyed, called) = match (claim, response) {
            (Some(claim), Some(response)) => {
                let mut row = ClaimRow::new(table, claim);
                row.prepared = !conn.inlined;
                row.functions = conn.functions;
                let late = conn.outlived(claim.ttl);
                (
                    row.finish_and_commit(response, late),
                    true,
                    row.finish_calls(response, late),
                )
            }
            _ => (COMMIT_UNLESS_FAILED.to_owned(), false, false),
        };
        let query = sqlx::raw_sql(AssertSqlSafe(text));
        let result = if called {
            // The function's answer is a row (`stored`), not a row count.
            query.fetch_all(&mut ***conn).await.and_then(|rows| {
                let stored = rows.first().map(|row| row.try_get::<i32, _>("stored"));
                Ok(u64::try_from(stored.transpose()?.unwrap_or(0)).unwrap_or(0))
            })
        } else {
            let done = query.execute(&mut ***conn).await;
            done.map(|done| done.rows_affected())
        };
        if let Err(error) = &result
            && has_code(error, &[UNDEFINED_STATEMENT])
        {
            // Someone deallocated the finish statement but not the claim's,
            // so the claim did not notice: a new connection prepares all.
            conn.close_on_drop();
        }
        let done = result.map_err(finish_error)?;
        if keyed && done != 1 {
            // The claim's row was not there to store the response on: the
            // handler ended the transaction itself (a raw `ROLLBACK`), and
            // its later statements committed on their own. The `COMMIT`
            // committed nothing of the claim's; the client must not be told
            // the work is done. The connection's state is unknown: closed.
            conn.close_on_drop();
            return Err(FinishError::Ended(StoreError::ClaimGone));
        }
        // The commit landed, and the text opened an empty transaction in
        // its place: the one sqlx counts. sqlx's rollback of it is queued,
        // and sent with the ping the pool sends anyway when the connection
        // comes back: no round trip of its own.
        PgTransactionManager::start_rollback(conn);
        Ok(())
    }

    async fn stranded(
        conn: &mut PoolConnection<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<bool, sqlx::Error> {
        let sql = simple(
            &format!("SELECT 1 FROM {table} WHERE scope = $1 AND key = $2 AND status IS NULL"),
            &[
                Arg::Bytes(claim.scope.as_bytes()),
                Arg::Bytes(claim.key.as_bytes()),
            ],
        );
        Ok(sql.fetch_optional(&mut **conn).await?.is_some())
    }

    async fn rollback(conn: &mut PoolConnection<Self>) -> Result<(), sqlx::Error> {
        crate::backend::connection::rollback_transaction(conn).await
    }

    /// Also `57P01`..`57P03` and `57P05`: a backend terminated, or ended by
    /// `idle_session_timeout`, while idle leaves its `FATAL` to be read by
    /// the next statement.
    fn session_gone(error: &dyn sqlx::error::DatabaseError) -> bool {
        error.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03" | "57P05")
        })
    }

    async fn sweep(pool: &Pool<Self>, table: &str, batch: u32) -> Result<u64, sqlx::Error> {
        // The expiry is checked again on the row the delete meets, and rows
        // another transaction holds are skipped. With the check only in the
        // subquery, a delete that waited on the lock of a writer making an
        // expired row live again (in place) re-checked nothing but the key
        // once that writer committed, and deleted the live row. Oldest
        // first, so the expiry index bounds every batch: without the order,
        // a table whose expiries do not follow its physical order (mixed
        // TTLs) was swept by sequential scans (docs/benchmarks.md).
        let sql = format!(
            "DELETE FROM {table} WHERE (scope, key) IN \
             (SELECT scope, key FROM {table} WHERE expires_at < now() \
              ORDER BY expires_at LIMIT {batch} FOR UPDATE SKIP LOCKED) \
             AND expires_at < now()"
        );
        let deleted = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(pool)
            .await?
            .rows_affected();
        let Some(left) = (u64::from(batch))
            .checked_sub(deleted)
            .filter(|left| *left > 0)
        else {
            return Ok(deleted);
        };
        // Rows past their replay become tombstones: their response goes,
        // and `replay_until` becomes the epoch, below the range this scan
        // reads, so converted rows are not read again.
        let sql = format!(
            "UPDATE {table} SET headers = NULL, body = NULL, replay_until = {TOMBSTONED} \
             WHERE (scope, key) IN \
             (SELECT scope, key FROM {table} \
              WHERE replay_until > {TOMBSTONED} AND replay_until <= now() \
              ORDER BY replay_until LIMIT {left} FOR UPDATE SKIP LOCKED) \
             AND replay_until > {TOMBSTONED} AND replay_until <= now()"
        );
        let converted = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(pool)
            .await?
            .rows_affected();
        Ok(deleted + converted)
    }
}
