//! PostgreSQL: the claim rides on the transaction's `BEGIN`, the stored
//! response on its `COMMIT`, so a first attempt costs no extra round trip.
//!
//! sqlx has no pipelining, but the simple query protocol runs several
//! statements in one round trip. Those statements cannot take bind
//! parameters, so every value is inlined as hex (`E'\\x..'`) or
//! as an integer we formatted: no client-controlled character reaches SQL.
//! Only statements written for CockroachDB and YugabyteDB too are used
//! (untested there).
//!
//! The statements themselves are SQL-level prepared statements, prepared
//! once per connection and run with `EXECUTE`, so the server does not parse
//! and plan them per request. Where a session cannot keep them (a
//! transaction-mode pooler), the same statements run with inlined
//! arguments, or, behind a declared pooler, as calls of the key table's
//! functions, whose plans each session keeps (`functions.rs`).

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgRow, PgTransactionManager};
use sqlx::{AssertSqlSafe, Pool, Postgres, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use self::sql::{Arg, ClaimRow, fnv1a, inline};
use super::claim::Failure;
use super::rows::finished_row;
use super::{ClaimOutcome, FinishError, OpenTx, StoreError};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::EncodedResponse;

mod admin;
mod advisory;
mod functions;
mod outbox_store;
mod phased;
mod sql;
mod store;

const LOCK_NOT_AVAILABLE: &str = "55P03";
/// `invalid_text_representation`: the advisory claim found the key's lock
/// held (see `sql::CLAIM_TRY`).
const KEY_HELD: &str = "22P02";
const UNIQUE_VIOLATION: &str = "23505";
const DUPLICATE_TABLE: &str = "42P07";
/// A table's row type created by a concurrent `CREATE TABLE IF NOT EXISTS`.
const DUPLICATE_OBJECT: &str = "42710";
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";
/// `invalid_sql_statement_name`: `EXECUTE` of a statement this session has
/// not prepared.
const UNDEFINED_STATEMENT: &str = "26000";
/// `in_failed_sql_transaction`: a statement after another failed.
const IN_FAILED_TRANSACTION: &str = "25P02";
/// `duplicate_prepared_statement`.
const DUPLICATE_STATEMENT: &str = "42P05";

/// How many statements a claim runs, reading again a row that committed
/// after its snapshot, vanished (swept) or was claimed anew, before giving up
/// with a store error.
const SETTLE_ATTEMPTS: usize = 4;

/// A failed finish: `Ended` when the handler's own writes failed it, so a
/// retry would fail alike: its first statement met a failed transaction
/// (a statement of the handler's failed, and the handler went on), whose
/// `COMMIT` PostgreSQL would have answered with a rollback; or the
/// `COMMIT` found a deferred constraint violated (class 23: only the
/// commit checks one here) and rolled back; or the statement exceeded one
/// of PostgreSQL's limits (class 54: a response over 1 GB as hex, with the
/// cap raised past 512 MiB, fails alike on every retry). Anything else (a lost
/// connection, a serialization failure) is the store's.
fn finish_error(error: sqlx::Error) -> FinishError {
    let integrity = matches!(
        &error,
        sqlx::Error::Database(db) if db.code().is_some_and(|code| code.starts_with("23") || code.starts_with("54"))
    );
    if integrity || has_code(&error, &[IN_FAILED_TRANSACTION]) {
        FinishError::Ended(StoreError::Database(error))
    } else {
        FinishError::store(error)
    }
}

/// The finish of a transaction without a stored response (a request
/// without a key): its commit, unless a statement in it failed.
///
/// PostgreSQL answers `COMMIT` in a failed transaction by rolling it back,
/// without an error: a handler that caught a failed statement's error and
/// answered 2xx would have its client told of writes that were undone (as
/// sqlx's own `commit()` would). The `SELECT` ahead of the `COMMIT` fails in
/// a failed transaction, so the request answers 500 instead, in the same
/// round trip. (With a key, the stored response's `EXECUTE` fails so.) As
/// in the keyed finish, the text then opens the empty transaction whose
/// rollback sqlx queues.
const COMMIT_UNLESS_FAILED: &str = "SELECT 1; COMMIT; BEGIN";

/// A claim on PostgreSQL: the row's statements, kept across attempts
/// (they remember whether the server keeps prepared statements).
struct PgClaim<'c> {
    row: ClaimRow<'c>,
    pool: &'c Pool<Postgres>,
}

impl super::claim::ClaimAttempt<Postgres> for PgClaim<'_> {
    async fn attempt(
        &mut self,
        mut conn: OpenTx<Postgres>,
        number: usize,
    ) -> Result<ClaimOutcome<Postgres>, Failure> {
        let error = match claim_on(&mut conn, &mut self.row, self.pool).await {
            Ok(Settled::Ours) => return Ok(ClaimOutcome::Claimed(conn)),
            Ok(Settled::Finished(fingerprint, response)) => {
                // The read that found it already ended the transaction.
                conn.release();
                return Ok(ClaimOutcome::Finished {
                    fingerprint,
                    response,
                });
            }
            Ok(Settled::Held) => {
                conn.release();
                return Err(Failure::InUse);
            }
            Err(error) => error,
        };
        // A connection that was gone is closed (dropped), not rolled back.
        if !error.is_gone::<Postgres>() {
            super::connection::abandon(conn).await;
        }
        Err(
            if self.row.calls() && store_has_code(&error, &functions::UNCALLABLE) {
                // The table's functions cannot be called as they were found
                // (dropped, replaced, `EXECUTE` revoked): this claim runs the
                // statements, and the next asks again.
                functions::forget(self.pool, self.row.table());
                self.row.functions = false;
                Failure::Retry(error)
            } else if self.row.tries_lock() && store_has_code(&error, &[KEY_HELD]) {
                // The key's advisory lock is held: by an attempt in flight (or,
                // rarely, one whose key's hash is the same).
                Failure::InUse
            } else if store_has_code(&error, &[LOCK_NOT_AVAILABLE]) {
                // A timeout this short can also be a brief wait on another lock
                // (extending the table, say) rather than a duplicate: look once
                // more before telling a fresh key it is in use.
                if number == 1 && self.row.wait() < SHORT_WAIT {
                    Failure::Retry(error)
                } else {
                    Failure::InUse
                }
            } else if store_has_code(&error, &[SERIALIZATION_FAILURE, DEADLOCK_DETECTED]) {
                // CockroachDB and YugabyteDB ask clients to retry these; the
                // claim has done nothing yet, so retrying it is always safe.
                Failure::Retry(error)
            } else {
                Failure::Fatal(error)
            },
        )
    }

    fn skip_wait(&mut self) {
        self.row.skip_wait();
    }

    fn orphan_bound(&self) -> std::time::Duration {
        self.row.orphan_bound()
    }
}

/// Below this `wait`, a lock timeout during the claim is retried once.
const SHORT_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Claims on one connection through its prepared statements, preparing
/// them on the connection's first claim. A connection that cannot keep
/// them (a transaction-mode pooler hands each transaction another server
/// session) gets the same statements with their arguments inlined (or
/// calls of the table's functions, where `row` says a declared pooler's
/// claim found them); `row` remembers that for a retry of the claim, and
/// `conn` for the finish.
async fn claim_on(
    conn: &mut OpenTx<Postgres>,
    row: &mut ClaimRow<'_>,
    pool: &Pool<Postgres>,
) -> Result<Settled, StoreError> {
    if row.lock_table.is_none() && row.takes_lock() {
        // Asked once per table, on the claim's own session (the pool's
        // search path); boxed, it would otherwise sit in every claim's
        // future.
        let asked = Box::pin(advisory::lock_table(&mut ***conn, pool, row.table())).await;
        row.lock_table = Some(asked.map_err(StoreError::Database)?);
    }
    let settled = claim_with_fallback(conn, row).await;
    conn.inlined = !row.prepared;
    conn.functions = row.calls();
    settled
}

async fn claim_with_fallback(
    conn: &mut PoolConnection<Postgres>,
    row: &mut ClaimRow<'_>,
) -> Result<Settled, StoreError> {
    match settle(conn, row, "").await {
        Err(error) if store_has_code(&error, &[UNDEFINED_STATEMENT]) => {}
        settled => return settled,
    }
    // The failed `EXECUTE` aborted the transaction; end it, and ask which
    // of this table's statements the session lacks in the same round trip.
    let names = row.names();
    let listed = sqlx::raw_sql(AssertSqlSafe(format!(
        "ROLLBACK; SELECT name FROM pg_catalog.pg_prepared_statements WHERE name IN ('{}')",
        names.join("', '")
    )))
    .fetch_all(&mut **conn)
    .await;
    let present = listed.and_then(|rows| {
        rows.iter()
            .map(|row| row.try_get::<String, _>("name"))
            .collect::<Result<Vec<_>, _>>()
    });
    let error = match present {
        Ok(present) => {
            let prepare = row.prepare_missing(&present);
            match settle(conn, row, &prepare).await {
                Err(error)
                    if store_has_code(&error, &[UNDEFINED_STATEMENT, DUPLICATE_STATEMENT]) =>
                {
                    error
                }
                settled => return settled,
            }
        }
        // A server without the view: the lookup's error is no claim's.
        Err(sqlx::Error::Database(error)) => StoreError::Database(sqlx::Error::Database(error)),
        Err(error) => return Err(StoreError::Database(error)),
    };
    tracing::debug!(%error, "prepared statements not kept; inlining idem's arguments");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut **conn)
        .await
        .map_err(StoreError::Database)?;
    row.prepared = false;
    settle(conn, row, "").await
}

/// Runs the claim statements until the row is ours or finished by another
/// attempt. `prelude` runs first, before the transaction begins (the
/// `PREPARE`s a new connection needs).
///
/// The claim's round trip is sqlx's own `BEGIN` (its transaction manager's,
/// with the claim as the statement), so sqlx counts the transaction: a
/// handler's nested `begin()` on its `Tx` is then a savepoint, not a second
/// `BEGIN` whose commit or rollback would end the request's transaction
/// under the wrapper. sqlx hands back no results of that statement, so the
/// claim answers by succeeding (the key is ours) or failing: a plain
/// `INSERT`, whose unique violation says another attempt committed the key,
/// perhaps after this one waited for it. A second statement then reads it
/// (its own snapshot, so the row committed after the claim's is seen),
/// after ending the failed transaction, in one round trip. An expired row
/// is deleted by the next claim, in its transaction and under its lock
/// timeout: of two attempts doing so at once one claims the key, and the
/// other reads the winner's row, or, if the winner is still running after
/// `wait`, is told the key is in use. A row that vanished (swept) in
/// between is claimed again.
async fn settle(
    conn: &mut PoolConnection<Postgres>,
    row: &ClaimRow<'_>,
    prelude: &str,
) -> Result<Settled, StoreError> {
    let mut claim = row.begin_and_insert(prelude);
    for _ in 0..SETTLE_ATTEMPTS {
        let begun =
            PgTransactionManager::begin(conn, Some(AssertSqlSafe(claim).into_sql_str())).await;
        match begun {
            Ok(()) => return Ok(Settled::Ours),
            Err(error) if has_code(&error, &[UNIQUE_VIOLATION]) => {}
            Err(error) => return Err(StoreError::Database(error)),
        }
        let rows = sqlx::raw_sql(AssertSqlSafe(row.end_and_select()))
            .fetch_all(&mut **conn)
            .await
            .map_err(StoreError::Database)?;
        claim = match rows.first().map(read_row).transpose()? {
            None => row.begin_and_insert(""),
            Some(Found::Expired) => row.expire_and_insert(),
            Some(Found::Unfinished) => return Ok(Settled::Held),
            Some(Found::Finished(fingerprint, response)) => {
                return Ok(Settled::Finished(fingerprint, response));
            }
        };
    }
    Err(StoreError::Unsettled)
}

/// What a read of a taken key saw.
enum Found {
    Expired,
    /// Committed without a response: held by an attempt outside the atomic
    /// contract (a row written by hand, or a later mode).
    Unfinished,
    Finished(Fingerprint, EncodedResponse),
}

/// Where a claim ended: expired rows have been deleted by then. Unless
/// it is `Ours`, the transaction has already ended.
enum Settled {
    Ours,
    Held,
    Finished(Fingerprint, EncodedResponse),
}

fn read_row(row: &PgRow) -> Result<Found, StoreError> {
    if row
        .try_get::<bool, _>("expired")
        .map_err(StoreError::Database)?
    {
        return Ok(Found::Expired);
    }
    Ok(match finished_row(row)? {
        Some((fingerprint, response)) => Found::Finished(fingerprint, response),
        None => Found::Unfinished,
    })
}

/// Runs migration DDL. Two services migrating at once can both pass
/// `IF NOT EXISTS` and collide in the catalog; the loser's retry then finds
/// what the winner made.
async fn run_ddl(pool: &Pool<Postgres>, ddl: &str) -> Result<(), Error> {
    for attempt in 0.. {
        match sqlx::raw_sql(AssertSqlSafe(ddl.to_owned()))
            .execute(pool)
            .await
        {
            Ok(_) => return Ok(()),
            Err(error)
                if attempt < 3
                    && has_code(
                        &error,
                        &[UNIQUE_VIOLATION, DUPLICATE_TABLE, DUPLICATE_OBJECT],
                    ) =>
            {
                continue;
            }
            Err(error) => return Err(error.into()),
        }
    }
    unreachable!()
}

/// `text` with its `$n` replaced by `args`, for the simple query protocol:
/// one message, no statement named in the session, so a transaction-mode
/// pooler may run it on any server connection, in or out of a transaction
/// (sqlx's bound statements are two exchanges, parse then execute, which
/// such a pooler may send to two different servers outside a
/// transaction). Every statement of this engine outside the claim and
/// finish runs so.
fn simple(text: &str, args: &[Arg<'_>]) -> sqlx::RawSql {
    sqlx::raw_sql(AssertSqlSafe(inline(text, args)))
}

/// Whether every relation named in `names` exists (`to_regclass`).
async fn regclasses_exist(pool: &Pool<Postgres>, names: &[&str]) -> Result<bool, sqlx::Error> {
    all_hold(pool, "to_regclass($) IS NOT NULL", names).await
}

/// Whether the catalog `check` holds for every one of `names`, each in
/// place of the `$` in it, in one read.
async fn all_hold(pool: &Pool<Postgres>, check: &str, names: &[&str]) -> Result<bool, sqlx::Error> {
    let checks: Vec<String> = (1..=names.len())
        .map(|n| check.replace('$', &format!("${n}")))
        .collect();
    let args: Vec<Arg<'_>> = names.iter().map(|name| Arg::Text(name)).collect();
    let row = simple(&format!("SELECT {} AS found", checks.join(" AND ")), &args)
        .fetch_one(pool)
        .await?;
    row.try_get("found")
}

/// The name of `table`'s index `suffix`, within PostgreSQL's 63 bytes: a
/// longer one would be cut to the table's own name, `IF NOT EXISTS` would
/// then skip it, and the sweeper would scan the whole table. A long table
/// name gets a hashed one.
fn index_name(table: &str, suffix: &str) -> String {
    match format!("{}_{suffix}", table.rsplit('.').next().unwrap_or(table)) {
        index if index.len() <= 63 => index,
        _ => format!("idem_{:016x}_{suffix}", fnv1a(table.bytes())),
    }
}

/// `index` in `table`'s schema, for `to_regclass`.
fn qualified(table: &str, index: &str) -> String {
    match table.rsplit_once('.') {
        Some((schema, _)) => format!("{schema}.{index}"),
        None => index.to_owned(),
    }
}

fn has_code(error: &sqlx::Error, codes: &[&str]) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|code| codes.contains(&&*code)))
}

fn store_has_code(error: &StoreError, codes: &[&str]) -> bool {
    matches!(error, StoreError::Database(error) if has_code(error, codes))
}

#[cfg(test)]
pub(crate) mod tests;
