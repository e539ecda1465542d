//! PostgreSQL: the claim rides on the transaction's `BEGIN`, the stored
//! response on its `COMMIT`, so a first attempt costs no extra round trip.
//!
//! sqlx has no pipelining, but the simple query protocol runs several
//! statements in one round trip. Those statements cannot take bind
//! parameters, so every value is inlined as hex (`E'\\x..'`) or
//! as an integer we formatted: no client-controlled character reaches SQL.
//! Only statements PostgreSQL, CockroachDB and YugabyteDB all run are used.
//!
//! The statements themselves are SQL-level prepared statements, prepared
//! once per connection and run with `EXECUTE`, so the server does not parse
//! and plan them per request. Where a session cannot keep them (a
//! transaction-mode pooler), the same statements run with inlined
//! arguments.

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Pool, Postgres, Row};

use self::statements::{ClaimRow, PEEK};
use super::{Backend, Claim, ClaimOutcome, Failure, OpenTx};
use crate::Error;
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

mod statements;

impl super::sealed::Sealed for Postgres {}

const LOCK_NOT_AVAILABLE: &str = "55P03";
const UNIQUE_VIOLATION: &str = "23505";
const DUPLICATE_TABLE: &str = "42P07";
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";
/// `invalid_sql_statement_name`: `EXECUTE` of a statement this session has
/// not prepared.
const UNDEFINED_STATEMENT: &str = "26000";
/// `duplicate_prepared_statement`.
const DUPLICATE_STATEMENT: &str = "42P05";

/// How many statements a claim runs, reading again a row that committed
/// after its snapshot, vanished (swept) or was taken over, before giving up
/// with a store error.
const SETTLE_ATTEMPTS: usize = 4;

impl Backend for Postgres {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        let index = format!(
            "{}_expires_at_idx",
            table.rsplit('.').next().unwrap_or(table)
        );
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
                PRIMARY KEY (scope, key)
            );
            CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);"
        );
        // `CREATE INDEX IF NOT EXISTS` takes a SHARE lock on the table before
        // it looks for the index: on a live table it would wait for every
        // open claim and queue every new claim behind it. The catalog read
        // locks nothing, so a migrated table costs a start-up nothing.
        let qualified_index = match table.rsplit_once('.') {
            Some((schema, _)) => format!("{schema}.{index}"),
            None => index.clone(),
        };
        let migrated: bool = sqlx::query_scalar(
            "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL",
        )
        .bind(table)
        .bind(&qualified_index)
        .fetch_one(pool)
        .await?;
        if migrated {
            return Ok(());
        }
        // Two services migrating at once can both pass `IF NOT EXISTS` and
        // collide in the catalog; the loser's retry then finds the table.
        for attempt in 0.. {
            match sqlx::raw_sql(AssertSqlSafe(ddl.clone()))
                .execute(pool)
                .await
            {
                Ok(_) => return Ok(()),
                Err(error)
                    if attempt < 3 && has_code(&error, &[UNIQUE_VIOLATION, DUPLICATE_TABLE]) =>
                {
                    continue;
                }
                Err(error) => return Err(error.into()),
            }
        }
        unreachable!()
    }

    async fn claim(
        pool: &Pool<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        let row = ClaimRow::new(table, claim);
        super::claim_with_retries(pool, PgClaim { row }).await
    }

    async fn peek(
        pool: &Pool<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome<Self>>, sqlx::Error> {
        // An ordinary sqlx query: prepared and cached by sqlx per
        // connection, as the pool's own configuration says.
        let row = sqlx::query(AssertSqlSafe(PEEK.replace("{table}", table)))
            .bind(claim.scope.as_bytes())
            .bind(claim.key.as_bytes())
            .fetch_optional(pool)
            .await?;
        Ok(match row.as_ref().map(read_row).transpose()? {
            Some(Found::Finished(fingerprint, response)) => Some(ClaimOutcome::Finished {
                fingerprint,
                response,
            }),
            _ => None,
        })
    }

    async fn begin(pool: &Pool<Self>) -> Result<OpenTx<Self>, sqlx::Error> {
        let mut conn = OpenTx::acquire(pool).await?;
        sqlx::raw_sql("BEGIN").execute(&mut **conn).await?;
        Ok(conn)
    }

    async fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&StoredResponse>,
    ) -> Result<(), sqlx::Error> {
        let sql = match (claim, response) {
            (Some(claim), Some(response)) => {
                let mut row = ClaimRow::new(table, claim);
                row.prepared = !conn.inlined;
                row.finish_and_commit(response)
            }
            _ => "COMMIT".to_owned(),
        };
        let result = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut ***conn)
            .await;
        if let Err(error) = &result
            && has_code(error, &[UNDEFINED_STATEMENT])
        {
            // Someone deallocated the finish statement but not the claim's,
            // so the claim did not notice: a new connection prepares all.
            conn.close_on_drop();
        }
        result.map(drop)
    }

    async fn rollback(conn: &mut PoolConnection<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await?;
        Ok(())
    }

    async fn sweep(pool: &Pool<Self>, table: &str, batch: u32) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {table} WHERE (scope, key) IN \
             (SELECT scope, key FROM {table} WHERE expires_at < now() LIMIT {batch})"
        );
        Ok(sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(pool)
            .await?
            .rows_affected())
    }
}

/// A claim on PostgreSQL: the row's statements, kept across attempts
/// (they remember whether the server keeps prepared statements).
struct PgClaim<'c> {
    row: ClaimRow<'c>,
}

impl super::ClaimAttempt<Postgres> for PgClaim<'_> {
    async fn attempt(
        &mut self,
        mut conn: OpenTx<Postgres>,
        number: usize,
    ) -> Result<ClaimOutcome<Postgres>, Failure> {
        let error = match claim_on(&mut conn, &mut self.row).await {
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
        super::abandon(conn).await;
        Err(if has_code(&error, &[LOCK_NOT_AVAILABLE]) {
            // A timeout this short can also be a brief wait on another lock
            // (extending the table, say) rather than a duplicate: look once
            // more before telling a fresh key it is in use.
            if number == 1 && self.row.wait() < SHORT_WAIT {
                Failure::Retry(error)
            } else {
                Failure::InUse
            }
        } else if has_code(&error, &[SERIALIZATION_FAILURE, DEADLOCK_DETECTED]) {
            // CockroachDB and YugabyteDB ask clients to retry these; the
            // claim has done nothing yet, so retrying it is always safe.
            Failure::Retry(error)
        } else {
            Failure::Fatal(error)
        })
    }
}

/// Below this `wait`, a lock timeout during the claim is retried once.
const SHORT_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Claims on one connection through its prepared statements, preparing
/// them on the connection's first claim. A connection that cannot keep
/// them (a transaction-mode pooler hands each transaction another server
/// session) gets the same statements with their arguments inlined; `row`
/// remembers that for a retry of the claim, and `conn` for the finish.
async fn claim_on(
    conn: &mut OpenTx<Postgres>,
    row: &mut ClaimRow<'_>,
) -> Result<Settled, sqlx::Error> {
    let settled = claim_with_fallback(conn, row).await;
    conn.inlined = !row.prepared;
    settled
}

async fn claim_with_fallback(
    conn: &mut PoolConnection<Postgres>,
    row: &mut ClaimRow<'_>,
) -> Result<Settled, sqlx::Error> {
    match settle(conn, row, "").await {
        Err(error) if has_code(&error, &[UNDEFINED_STATEMENT]) => {}
        settled => return settled,
    }
    // The failed `EXECUTE` aborted the transaction; end it, and ask which
    // of this table's statements the session lacks in the same round trip.
    let names = row.statements.names();
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
            let prepare = row.statements.prepare_missing(&present);
            match settle(conn, row, &prepare).await {
                Err(error) if has_code(&error, &[UNDEFINED_STATEMENT, DUPLICATE_STATEMENT]) => {
                    error
                }
                settled => return settled,
            }
        }
        // A server without the view: the lookup's error is no claim's.
        Err(sqlx::Error::Database(error)) => sqlx::Error::Database(error),
        Err(error) => return Err(error),
    };
    tracing::debug!(%error, "prepared statements not kept; inlining idem's arguments");
    sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await?;
    row.prepared = false;
    settle(conn, row, "").await
}

/// Runs the claim statements until the row is ours or finished by another
/// attempt. `prelude` runs first, before the transaction begins (the
/// `PREPARE`s a new connection needs).
///
/// The claim is a plain `INSERT .. ON CONFLICT DO NOTHING`, answered by its
/// row count alone: one row, and the key is ours, in one round trip. (A
/// data-modifying CTE that also read the taken row back cost the server
/// more per first attempt than it saved the rare retry.) No row, and
/// another attempt committed the key, perhaps after this one waited for
/// it: a second statement reads it (its own snapshot, so the row committed
/// after the claim's is seen) and ends the transaction in the same round
/// trip. An expired row is taken over with an `UPDATE` that re-checks
/// expiry under the row lock, so of two concurrent takeovers one wins and
/// the other reads the winner's committed row. A row that vanished (swept)
/// in between is claimed again.
async fn settle(
    conn: &mut PoolConnection<Postgres>,
    row: &ClaimRow<'_>,
    prelude: &str,
) -> Result<Settled, sqlx::Error> {
    let mut claim = Some(row.begin_and_insert(prelude));
    for _ in 0..SETTLE_ATTEMPTS {
        if let Some(sql) = claim.take() {
            let inserted = sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut **conn)
                .await?;
            if inserted.rows_affected() == 1 {
                return Ok(Settled::Ours);
            }
        }
        let rows = sqlx::raw_sql(AssertSqlSafe(row.select_and_end()))
            .fetch_all(&mut **conn)
            .await?;
        match rows.first().map(read_row).transpose()? {
            None => claim = Some(row.begin_and_insert("")),
            Some(Found::Expired) => {
                let taken = sqlx::raw_sql(AssertSqlSafe(row.begin_and_take_over()))
                    .execute(&mut **conn)
                    .await?;
                if taken.rows_affected() == 1 {
                    return Ok(Settled::Ours);
                }
                // Another takeover won: read its row, as after a claim.
            }
            Some(Found::Unfinished) => return Ok(Settled::Held),
            Some(Found::Finished(fingerprint, response)) => {
                return Ok(Settled::Finished(fingerprint, response));
            }
        }
    }
    Err(sqlx::Error::Protocol(
        "idempotency row changed repeatedly during its claim".into(),
    ))
}

/// What a read of a taken key saw.
enum Found {
    Expired,
    /// Committed without a response: held by an attempt outside the atomic
    /// contract (a row written by hand, or a later mode).
    Unfinished,
    Finished(Fingerprint, StoredResponse),
}

/// Where a claim ended: expired rows have been taken over by then. Unless
/// it is `Ours`, the transaction has already ended.
enum Settled {
    Ours,
    Held,
    Finished(Fingerprint, StoredResponse),
}

fn read_row(row: &PgRow) -> Result<Found, sqlx::Error> {
    if row.try_get::<bool, _>("expired")? {
        return Ok(Found::Expired);
    }
    let Some(status) = row.try_get::<Option<i16>, _>("status")? else {
        return Ok(Found::Unfinished);
    };
    let corrupt = || sqlx::Error::Decode("corrupt stored idempotent response".into());
    let fingerprint =
        Fingerprint::from_bytes(&row.try_get::<Vec<u8>, _>("fingerprint")?).ok_or_else(corrupt)?;
    let headers: Vec<u8> = row
        .try_get::<Option<Vec<u8>>, _>("headers")?
        .unwrap_or_default();
    let body: Vec<u8> = row
        .try_get::<Option<Vec<u8>>, _>("body")?
        .unwrap_or_default();
    let response = StoredResponse::decode(status.into(), &headers, body).ok_or_else(corrupt)?;
    Ok(Found::Finished(fingerprint, response))
}

fn has_code(error: &sqlx::Error, codes: &[&str]) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|code| codes.contains(&&*code)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::StatusCode;
    use sqlx::postgres::PgPoolOptions;

    use super::*;

    /// A pool on the test server, `configure`d; fails loudly without one.
    async fn test_pool(
        max_connections: u32,
        configure: impl FnOnce(sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions,
    ) -> Pool<Postgres> {
        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(configure(url.parse().expect("database URL")))
            .await
            .unwrap_or_else(|error| panic!("PostgreSQL is required at {url}: {error}"))
    }

    /// A key table of this test process named after `name`, migrated.
    async fn table(pool: &Pool<Postgres>, name: &str) -> String {
        let table = format!("idem_{name}_{}", std::process::id());
        Postgres::migrate(pool, &table).await.expect("migrate");
        table
    }

    async fn drop_table(pool: &Pool<Postgres>, table: &str) {
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(pool)
            .await
            .unwrap();
    }

    /// Stores a `status` with `body` as the claimed key's response, commits
    /// and hands the connection back.
    async fn store(
        mut conn: OpenTx<Postgres>,
        table: &str,
        claim: &Claim<'_>,
        status: StatusCode,
        body: &'static [u8],
    ) {
        let response = StoredResponse {
            status,
            headers: Vec::new(),
            body: body.into(),
        };
        Postgres::finish(&mut conn, table, Some(claim), Some(&response))
            .await
            .expect("finish");
        conn.release();
    }

    /// One scripted attempt: `None` settles, `Some` fails so.
    type Step = Option<fn() -> Failure>;

    /// A claim that goes as scripted, recording the number of each attempt.
    struct Scripted {
        script: std::collections::VecDeque<Step>,
        attempts: Vec<usize>,
    }

    impl crate::backend::ClaimAttempt<Postgres> for &mut Scripted {
        async fn attempt(
            &mut self,
            conn: OpenTx<Postgres>,
            number: usize,
        ) -> Result<ClaimOutcome<Postgres>, Failure> {
            self.attempts.push(number);
            match self.script.pop_front().expect("an attempt past the script") {
                None => Ok(ClaimOutcome::Claimed(conn)),
                Some(failure) => {
                    conn.release();
                    Err(failure())
                }
            }
        }
    }

    /// The retry policy both server engines share: retryable failures are
    /// tried again up to `CLAIM_ATTEMPTS` in all, each on a fresh
    /// connection; "in use" is a 409 at once; anything else fails at once.
    #[tokio::test]
    async fn claims_are_retried_only_when_the_engine_asks() {
        let pool = test_pool(1, |options| options).await;
        let retry = || Failure::Retry(sqlx::Error::PoolTimedOut);
        let fatal = || Failure::Fatal(sqlx::Error::RowNotFound);
        let in_use = || Failure::InUse;
        let cases: [(&[Step], &str, &[usize]); 5] = [
            (&[Some(retry), Some(retry), None], "claimed", &[1, 2, 3]),
            (
                &[Some(retry), Some(retry), Some(retry)],
                "timed out",
                &[1, 2, 3],
            ),
            (&[Some(retry), Some(in_use)], "in use", &[1, 2]),
            (&[Some(in_use)], "in use", &[1]),
            (&[Some(fatal)], "no rows", &[1]),
        ];
        for (script, expected, attempts) in cases {
            let mut claim = Scripted {
                script: script.iter().copied().collect(),
                attempts: Vec::new(),
            };
            let outcome = crate::backend::claim_with_retries(&pool, &mut claim).await;
            let got = match outcome {
                Ok(ClaimOutcome::Claimed(mut conn)) => {
                    // A live connection, handed over by the last attempt.
                    sqlx::raw_sql("SELECT 1")
                        .execute(&mut **conn)
                        .await
                        .unwrap();
                    conn.release();
                    "claimed".to_owned()
                }
                Ok(ClaimOutcome::InUse) => "in use".to_owned(),
                Ok(ClaimOutcome::Finished { .. }) => "finished".to_owned(),
                Err(error) => error.to_string(),
            };
            assert!(got.contains(expected), "{script:?}: {got}");
            assert_eq!(claim.attempts, attempts, "{expected}");
            assert!(claim.script.is_empty(), "{expected}: script not used up");
        }
    }

    /// Values reach the row byte for byte, prepared or inlined, even on a
    /// server still configured with `standard_conforming_strings = off`.
    #[tokio::test]
    async fn bytes_arrive_intact_whatever_standard_conforming_strings_says() {
        let scope = "a'b\\c\\x41\0\u{e9}";
        for setting in ["on", "off"] {
            let pool = test_pool(1, |options| {
                options.options([("standard_conforming_strings", setting)])
            })
            .await;
            let table = table(&pool, "scs").await;
            for prepared in [true, false] {
                let key = format!("k-{setting}-{prepared}");
                let claim = Claim {
                    scope,
                    key: &key,
                    fingerprint: Fingerprint::from_bytes(&[0x5c; 32]).unwrap(),
                    ttl: Duration::from_secs(60),
                    wait: Duration::from_millis(100),
                };
                let mut row = ClaimRow::new(&table, &claim);
                row.prepared = prepared;
                let mut conn = OpenTx::new(pool.acquire().await.unwrap());
                let settled = claim_on(&mut conn, &mut row).await.expect("claim");
                assert!(matches!(settled, Settled::Ours));
                assert_eq!(conn.inlined, !prepared);
                store(conn, &table, &claim, StatusCode::OK, b"\\x00'\\").await;
                let (stored_scope, body): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(
                    format!("SELECT scope, body FROM {table} WHERE key = $1"),
                ))
                .bind(key.as_bytes())
                .fetch_one(&pool)
                .await
                .unwrap();
                assert_eq!(
                    stored_scope,
                    scope.as_bytes(),
                    "{setting}, prepared {prepared}"
                );
                assert_eq!(body, b"\\x00'\\", "{setting}, prepared {prepared}");
            }
            drop_table(&pool, &table).await;
        }
    }

    /// The fallback for sessions that cannot keep prepared statements (a
    /// transaction-mode pooler): the same claim, takeover, replay and
    /// finish with inlined arguments, on the real server.
    #[tokio::test]
    async fn inlined_statements_claim_finish_replay_and_take_over() {
        let pool = test_pool(2, |options| options).await;
        let table = table(&pool, "inline").await;
        let fingerprint = Fingerprint::from_bytes(&[7; 32]).unwrap();
        let claim = Claim {
            scope: "acct",
            key: "inline-1",
            fingerprint,
            ttl: Duration::from_secs(60),
            wait: Duration::from_millis(100),
        };
        let mut row = ClaimRow::new(&table, &claim);
        row.prepared = false;

        let mut conn = OpenTx::new(pool.acquire().await.unwrap());
        let settled = settle(&mut conn, &row, "").await.expect("claim");
        assert!(matches!(settled, Settled::Ours));
        conn.inlined = true;
        store(conn, &table, &claim, StatusCode::CREATED, b"{\"id\":1}").await;
        let prepared: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idem\\_%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(prepared, 0, "inlined mode prepares nothing");

        let mut conn = OpenTx::new(pool.acquire().await.unwrap());
        match settle(&mut conn, &row, "").await.expect("replay") {
            Settled::Finished(stored, replayed) => {
                assert_eq!(stored, fingerprint);
                assert_eq!(replayed.status, StatusCode::CREATED);
                assert_eq!(&replayed.body[..], b"{\"id\":1}");
            }
            Settled::Ours | Settled::Held => panic!("a finished key was not replayed"),
        }
        // The read ended the transaction: each statement is its own now.
        let idle: bool = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(&mut **conn)
            .await
            .and_then(|row| row.try_get(0))
            .unwrap();
        assert!(idle, "the replay left its transaction open");
        conn.release();

        // Expired: taken over, with the new fingerprint and no response.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {table} SET expires_at = now() - interval '1 second'"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut conn = OpenTx::new(pool.acquire().await.unwrap());
        let settled = settle(&mut conn, &row, "").await.expect("take over");
        assert!(matches!(settled, Settled::Ours));
        Postgres::finish(&mut conn, &table, None, None)
            .await
            .unwrap();
        conn.release();
        let (status, live): (Option<i16>, bool) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, expires_at > now() FROM {table}"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((status, live), (None, true));

        drop_table(&pool, &table).await;
    }

    /// A session kept across a deploy (a session-mode pooler) may still hold
    /// an older revision's statements under that revision's names: the claim
    /// prepares and runs today's, never the older text.
    #[tokio::test]
    async fn an_older_revisions_statements_are_never_run() {
        let pool = test_pool(1, |options| options).await;
        let table = table(&pool, "revision").await;
        let older = statements::Statements::at_revision("1:", &table);
        // An older claim that would claim nothing: run, it would send this
        // key round the "taken, then vanished" loop until the claim failed.
        let mut conn = pool.acquire().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "PREPARE {} (bytea, bytea, bytea, bigint) AS SELECT WHERE false",
            older.name(&statements::CLAIM)
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        drop(conn);

        let claim = Claim {
            scope: "acct",
            key: "revision-1",
            fingerprint: Fingerprint::from_bytes(&[3; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            wait: Duration::ZERO,
        };
        let conn = match Postgres::claim(&pool, &table, &claim).await {
            Ok(ClaimOutcome::Claimed(conn)) => conn,
            other => panic!("the key was not claimed: {other:?}"),
        };
        store(conn, &table, &claim, StatusCode::CREATED, b"{}").await;
        let status: Option<i16> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT status FROM {table} WHERE key = 'revision-1'"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(status, Some(201));
        // Both revisions' statements sit side by side in the one session.
        let current = statements::Statements::new(&table).name(&statements::CLAIM);
        let prepared: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE '%\\_claim' ORDER BY name",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let mut expected = vec![older.name(&statements::CLAIM), current];
        expected.sort();
        assert_eq!(prepared, expected);
        drop_table(&pool, &table).await;
    }

    /// A row committed without a response (written by hand, or by a mode
    /// outside the atomic contract) is held by someone: 409, never claimed
    /// over, and nothing is left open.
    #[tokio::test]
    async fn a_committed_row_without_a_response_is_in_use() {
        let pool = test_pool(1, |options| options).await;
        let table = table(&pool, "held").await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {table} (scope, key, fingerprint, expires_at) \
             VALUES ('acct', 'held', '\\x00', now() + interval '1 hour')"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let claim = Claim {
            scope: "acct",
            key: "held",
            fingerprint: Fingerprint::from_bytes(&[0; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            wait: Duration::ZERO,
        };
        let outcome = Postgres::claim(&pool, &table, &claim).await.expect("claim");
        assert!(matches!(outcome, ClaimOutcome::InUse), "{outcome:?}");
        // The one connection came back to the pool, out of any transaction.
        let status: Option<i16> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT status FROM {table} WHERE key = 'held'"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(status, None);
        drop_table(&pool, &table).await;
    }
}
