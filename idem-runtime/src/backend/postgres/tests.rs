//! PostgreSQL's claim against the test server: the retry policy, bytes
//! through both statement forms, the inlined fallback, statements of an
//! older revision, and rows held outside the atomic contract.

use std::time::Duration;

use http::StatusCode;
use sqlx::postgres::PgPoolOptions;

use super::*;
use crate::backend::store::Store;
use crate::backend::{Acquire, Claim};

/// A pool on the test server, `configure`d; fails loudly without one.
pub(crate) async fn test_pool(
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

/// A key table of this test process named after `name`, migrated empty
/// (a run killed before its cleanup, with the same process id, left one).
pub(crate) async fn table(pool: &Pool<Postgres>, name: &str) -> String {
    let table = format!("idem_{name}_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(pool)
        .await
        .unwrap();
    Postgres::migrate(pool, &table).await.expect("migrate");
    table
}

pub(crate) async fn drop_table(pool: &Pool<Postgres>, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(pool)
        .await
        .unwrap();
}

/// How many of `idem`'s statements the session of one of `pool`'s
/// connections has prepared.
async fn idem_prepared(pool: &Pool<Postgres>) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idem\\_%'")
        .fetch_one(pool)
        .await
        .unwrap()
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
    let response = EncodedResponse {
        status,
        headers: Vec::new(),
        body: body.into(),
        tombstone: None,
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
    /// Whether the policy asked the claim to stop waiting.
    skipped_wait: bool,
}

impl crate::backend::claim::ClaimAttempt<Postgres> for &mut Scripted {
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

    fn skip_wait(&mut self) {
        self.skipped_wait = true;
    }

    fn orphan_bound(&self) -> Duration {
        Duration::from_secs(32)
    }
}

/// The retry policy both server engines share: retryable failures are
/// tried again up to `CLAIM_ATTEMPTS` in all, each on a fresh
/// connection; "in use" is a 409 at once; anything else fails at once.
#[tokio::test]
async fn claims_are_retried_only_when_the_engine_asks() {
    let pool = test_pool(1, |options| options).await;
    let retry = || Failure::Retry(StoreError::Database(sqlx::Error::PoolTimedOut));
    let fatal = || Failure::Fatal(StoreError::Database(sqlx::Error::RowNotFound));
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
            skipped_wait: false,
        };
        let outcome = crate::backend::claim::claim_with_retries(
            &pool,
            crate::backend::Acquire::default(),
            &mut claim,
        )
        .await;
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
            Ok(ClaimOutcome::InUse { running }) => {
                assert!(!running, "the database cannot tell a running holder");
                "in use".to_owned()
            }
            Ok(ClaimOutcome::Finished { .. }) => "finished".to_owned(),
            Err(error) => error.to_string(),
        };
        assert!(got.contains(expected), "{script:?}: {got}");
        assert_eq!(claim.attempts, attempts, "{expected}");
        assert!(claim.script.is_empty(), "{expected}: script not used up");
    }
}

/// A claim whose idle connection was found gone may have reached the
/// server first, leaving a session that holds the key: the claim on the
/// checked connection does not wait, and a key it finds held is the
/// connection loss (503 with the orphan's bound), not a 409 promising a
/// running attempt.
#[tokio::test]
async fn a_held_key_after_a_lost_connection_is_not_a_running_attempt() {
    let pool = test_pool(1, |options| options).await;
    // An idle connection, so the first attempt takes it untested.
    drop(pool.acquire().await.unwrap());
    while pool.num_idle() == 0 {
        tokio::task::yield_now().await;
    }
    let gone = || {
        Failure::Fatal(StoreError::Database(sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        ))))
    };
    let in_use = || Failure::InUse;
    let mut claim = Scripted {
        script: [Some(gone as fn() -> Failure), Some(in_use)]
            .into_iter()
            .collect(),
        attempts: Vec::new(),
        skipped_wait: false,
    };
    let outcome = crate::backend::claim::claim_with_retries(
        &pool,
        crate::backend::Acquire::default(),
        &mut claim,
    )
    .await;
    assert!(
        matches!(outcome, Err(StoreError::Orphaned { bound }) if bound == Duration::from_secs(32)),
        "{outcome:?}"
    );
    assert!(
        claim.skipped_wait,
        "the replacement claim waited for the holder"
    );
    // The gone connection's attempt is not counted.
    assert_eq!(claim.attempts, [1, 1]);
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
                tombstone_ms: None,
                wait: Duration::from_millis(100),
                timeout_ms: 30_000,
                advisory: true,
                pooled: false,
            };
            let mut row = ClaimRow::new(&table, &claim);
            row.prepared = prepared;
            let mut conn = OpenTx::new(pool.acquire().await.unwrap());
            let settled = claim_on(&mut conn, &mut row, &pool).await.expect("claim");
            assert!(matches!(settled, Settled::Ours));
            assert_eq!(conn.inlined, !prepared);
            store(conn, &table, &claim, StatusCode::OK, b"\\x00'\\").await;
            let (stored_scope, body): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT scope, body FROM {table} WHERE key = $1"
            )))
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
/// transaction-mode pooler): the same claim, expiry, replay and
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
        tombstone_ms: None,
        wait: Duration::from_millis(100),
        timeout_ms: 30_000,
        advisory: true,
        pooled: false,
    };
    let mut row = ClaimRow::new(&table, &claim);
    row.prepared = false;

    let mut conn = OpenTx::new(pool.acquire().await.unwrap());
    let settled = settle(&mut conn, &row, "").await.expect("claim");
    assert!(matches!(settled, Settled::Ours));
    conn.inlined = true;
    store(conn, &table, &claim, StatusCode::CREATED, b"{\"id\":1}").await;
    let prepared = idem_prepared(&pool).await;
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
    let older = sql::Statements::at_revision("1:", &table);
    // An older claim that would claim nothing: run, it would send this
    // key round the "taken, then vanished" loop until the claim failed.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "PREPARE {} (bytea, bytea, bytea, bigint) AS SELECT WHERE false",
        older.name(&sql::CLAIM)
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);

    let claim = crate::backend::test_support::claim_of("acct", "revision-1", 3, Duration::ZERO);
    let conn = match Postgres::claim(&pool, Acquire::default(), &table, &claim).await {
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
    let current = sql::Statements::new(&table).name(&sql::CLAIM);
    let prepared: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE '%\\_claim' ORDER BY name",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut expected = vec![older.name(&sql::CLAIM), current];
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
    let claim = crate::backend::test_support::claim_of("acct", "held", 0, Duration::ZERO);
    let outcome = Postgres::claim(&pool, Acquire::default(), &table, &claim)
        .await
        .expect("claim");
    assert!(matches!(outcome, ClaimOutcome::InUse { .. }), "{outcome:?}");
    // The one connection came back to the pool, out of any transaction:
    // two statements on it run in two transactions.
    let mut conn = tokio::time::timeout(Duration::from_secs(5), pool.acquire())
        .await
        .expect("the claim's connection came back to the pool")
        .unwrap();
    assert!(
        !sqlx::Connection::is_in_transaction(&*conn),
        "sqlx counts a transaction"
    );
    let mut transactions = Vec::new();
    for _ in 0..2 {
        let id: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        transactions.push(id);
    }
    assert_ne!(
        transactions[0], transactions[1],
        "a transaction is still open"
    );
    let status: Option<i16> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT status FROM {table} WHERE key = 'held'"
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(status, None);
    drop(conn);
    drop_table(&pool, &table).await;
}

/// The sweeper never deletes a row that is live when it is deleted, even
/// when the sweep started while the row was still expired and a writer
/// (any transaction making it live again in place, as a takeover does on
/// other engines) held it: the row outlives the sweep.
#[tokio::test]
async fn the_sweeper_spares_a_row_made_live_while_it_runs() {
    let pool = test_pool(3, |options| options).await;
    let table = table(&pool, "sweep").await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, key, fingerprint, status, expires_at) VALUES \
         ('acct', 'old', '\\x00', 201, now() - interval '1 second'), \
         ('acct', 'gone', '\\x00', 201, now() - interval '1 second'), \
         ('acct', 'live', '\\x00', 201, now() + interval '1 hour')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut writer = pool.begin().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "UPDATE {table} SET body = '\\x7b7d', expires_at = now() + interval '1 hour' \
         WHERE key = 'old'"
    )))
    .execute(&mut *writer)
    .await
    .unwrap();

    let sweeper = tokio::spawn({
        let (pool, table) = (pool.clone(), table.clone());
        async move { Postgres::sweep(&pool, &table, 100).await }
    });
    // Commit the writer only once the sweep has run, or is waiting for the
    // writer's row lock (as it did before it skipped locked rows).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !sweeper.is_finished() {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM idem_sweep_%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the sweep never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    writer.commit().await.unwrap();
    let swept = sweeper.await.unwrap().expect("sweep");

    let keys: Vec<(String, Option<Vec<u8>>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT convert_from(key, 'UTF8'), body FROM {table} ORDER BY key"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        keys,
        [
            ("live".to_owned(), None),
            ("old".to_owned(), Some(b"{}".to_vec()))
        ],
        "the sweep deleted {swept} rows"
    );
    assert_eq!(swept, 1, "only the expired, unheld row goes");
    drop_table(&pool, &table).await;
}

/// A deferred constraint the handler's writes broke fails the `COMMIT`:
/// the handler's doing, so the finish says `Ended` (500, a retry fails
/// alike), not a store failure (503 and `Retry-After`); nothing commits.
#[tokio::test]
async fn a_deferred_constraint_broken_at_commit_ends_the_transaction() {
    let pool = test_pool(2, |options| options).await;
    let table = table(&pool, "deferred").await;
    let parents = format!("{table}_parents");
    let children = format!("{table}_children");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {children}, {parents};
         CREATE TABLE {parents} (id int PRIMARY KEY);
         CREATE TABLE {children} (parent int REFERENCES {parents}
             DEFERRABLE INITIALLY DEFERRED)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let claim = crate::backend::test_support::claim_of("s", "k", 3, Duration::ZERO);
    let response = EncodedResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: "{}".into(),
        tombstone: None,
    };
    let ClaimOutcome::Claimed(mut conn) =
        Postgres::claim(&pool, Acquire::default(), &table, &claim)
            .await
            .unwrap()
    else {
        panic!("a fresh key is claimed")
    };
    sqlx::raw_sql(AssertSqlSafe(format!("INSERT INTO {children} VALUES (7)")))
        .execute(&mut **conn)
        .await
        .expect("a deferred check waits for the commit");
    let finished = Postgres::finish(&mut conn, &table, Some(&claim), Some(&response)).await;
    assert!(
        matches!(finished, Err(FinishError::Ended(_))),
        "{finished:?}"
    );
    Postgres::rollback(&mut conn).await.unwrap();
    conn.release();
    let counts: (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {table}), (SELECT count(*) FROM {children})"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(counts, (0, 0), "nothing committed");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {children}, {parents}")))
        .execute(&pool)
        .await
        .unwrap();
    drop_table(&pool, &table).await;
}

/// Taking over an expired key honours `wait` like any claim: while another
/// transaction holds the expired row (a takeover on its way, or a sweep
/// that has locked it), the claim is told the key is in use after its lock
/// timeout, instead of waiting for that transaction to end. Once the row
/// is free, the key is taken over.
#[tokio::test]
async fn taking_over_an_expired_key_waits_no_longer_than_wait() {
    let pool = test_pool(3, |options| options).await;
    let table = table(&pool, "takeover").await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, key, fingerprint, status, expires_at) \
         VALUES ('acct', 'old', '\\x00', 201, now() - interval '1 second')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // A lock on the row that does not delete it: the claim's insert meets
    // a live row (no wait there), reads it expired, and its delete is what
    // meets the lock.
    let mut holder = pool.begin().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE key = 'old' FOR UPDATE"
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    let release = async move { holder.rollback().await.unwrap() };
    crate::backend::test_support::in_use_then_taken_over(&pool, &table, release).await;
    let rows: Vec<(Vec<u8>, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT fingerprint, expires_at > now() FROM {table} WHERE key = 'old'"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows, [(vec![1; 32], true)], "one live row, the new claim's");
    drop_table(&pool, &table).await;
}

/// A table name of 63 bytes, the longest `Idem::table` takes, still gets
/// its expiry index (its `<table>_expires_at_idx` would be cut to the
/// table's own name, and skipped), and migrating again finds it.
#[tokio::test]
async fn the_longest_table_name_gets_its_expiry_index() {
    let pool = test_pool(1, |options| options).await;
    let prefix = format!("idem_long_{}_", std::process::id());
    let table = format!("{prefix}{}", "x".repeat(63 - prefix.len()));
    assert_eq!(table.len(), 63);
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(&pool)
        .await
        .unwrap();
    for _ in 0..2 {
        Postgres::migrate(&pool, &table).await.expect("migrate");
    }
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE tablename = $1 AND indexdef LIKE '%(expires_at)'",
    )
    .bind(&table)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(indexes.len(), 1, "{indexes:?}");
    drop_table(&pool, &table).await;
}

/// The phased mode's storage contract (`test_support::lease_contract`),
/// on a table from before the phased mode that `migrate` completed.
#[tokio::test]
async fn the_lease_contract_holds_on_a_migrated_table() {
    let pool = test_pool(4, |options| options).await;
    let table = format!("idem_lease_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {table}; \
         CREATE TABLE {table} (scope bytea NOT NULL, key bytea NOT NULL, \
             fingerprint bytea NOT NULL, status smallint, headers bytea, body bytea, \
             created_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL, \
             PRIMARY KEY (scope, key)); \
         CREATE INDEX {table}_expires_at_idx ON {table} (expires_at);"
    )))
    .execute(&pool)
    .await
    .unwrap();
    Postgres::migrate(&pool, &table).await.expect("migrate");
    Postgres::migrate(&pool, &table)
        .await
        .expect("migrate again");
    crate::backend::test_support::lease_contract(&pool, &table).await;
    drop_table(&pool, &table).await;
}

/// The atomic finish writes `status`, `headers` and `body`: an index that
/// named one of them, in its columns or its predicate, would make every
/// finish's update a full one instead of heap-only (new index entries,
/// more WAL) on every request.
#[tokio::test]
async fn no_index_names_what_the_finish_writes() {
    let pool = test_pool(1, |options| options).await;
    let table = table(&pool, "hot").await;
    let definitions: Vec<String> =
        sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE tablename = $1")
            .bind(&table)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(definitions.len(), 4, "{definitions:?}");
    for definition in &definitions {
        let columns = definition
            .split_once(" USING ")
            .map_or("", |(_, rest)| rest);
        for written in ["status", "headers", "body"] {
            assert!(!columns.contains(written), "{definition}");
        }
    }
    drop_table(&pool, &table).await;
}

/// The operators' key operations (`test_support::admin_contract`).
#[tokio::test]
async fn the_admin_contract_holds() {
    let pool = test_pool(4, |options| options).await;
    let table = table(&pool, "admin").await;
    crate::backend::test_support::admin_contract(&pool, &table).await;
    drop_table(&pool, &table).await;
}

/// The outbox's and consumers' storage contract
/// (`test_support::outbox_contract`).
#[tokio::test]
async fn the_outbox_contract_holds() {
    let pool = test_pool(4, |options| options).await;
    let (outbox, consumed) = (
        format!("idem_outbox_{}", std::process::id()),
        format!("idem_consumed_{}", std::process::id()),
    );
    let drop = format!("DROP TABLE IF EXISTS {outbox}, {consumed}");
    sqlx::raw_sql(AssertSqlSafe(drop.clone()))
        .execute(&pool)
        .await
        .unwrap();
    crate::backend::test_support::outbox_contract(&pool, &outbox, &consumed).await;
    sqlx::raw_sql(AssertSqlSafe(drop))
        .execute(&pool)
        .await
        .unwrap();
}

/// A claim with advisory locks (where the server offers them) and one
/// without, on PostgreSQL: a duplicate without `wait` is in use at once,
/// one with `wait` waits for the first attempt and replays it. Two pools,
/// so the duplicates meet in the database, not in this process.
async fn duplicates_wait_or_are_in_use(advisory: bool) {
    let first_pool = test_pool(2, |options| options).await;
    let name = format!("idem-duplicate-{advisory}-{}", std::process::id());
    let second_pool = test_pool(2, |options| options.application_name(&name)).await;
    let table = table(&first_pool, &format!("duplicates_{advisory}")).await;
    let claim = move |wait| Claim {
        advisory,
        ..crate::backend::test_support::claim_of("acct", "dup", 1, wait)
    };
    let ClaimOutcome::Claimed(first) = Postgres::claim(
        &first_pool,
        Acquire::default(),
        &table,
        &claim(Duration::ZERO),
    )
    .await
    .unwrap() else {
        panic!("a fresh key was not claimed");
    };
    let at_once = tokio::time::timeout(
        Duration::from_secs(2),
        Postgres::claim(
            &second_pool,
            Acquire::default(),
            &table,
            &claim(Duration::ZERO),
        ),
    )
    .await
    .expect("a duplicate without wait waited")
    .unwrap();
    assert!(matches!(at_once, ClaimOutcome::InUse { .. }), "{at_once:?}");
    let waiting = {
        let (pool, table) = (second_pool.clone(), table.clone());
        tokio::spawn(async move {
            let claim = claim(Duration::from_secs(20));
            match Postgres::claim(&pool, Acquire::default(), &table, &claim).await {
                Ok(ClaimOutcome::Finished { response, .. }) => response.status,
                other => panic!("the waiting duplicate got {other:?}"),
            }
        })
    };
    // The duplicate is waiting in the database once its session waits on
    // a lock.
    let waits = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND application_name = '{name}'"
    );
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(AssertSqlSafe(waits.clone()))
                .fetch_one(&first_pool)
                .await
                .unwrap();
            if waiting > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the duplicate never waited on a lock");
    store(
        first,
        &table,
        &claim(Duration::ZERO),
        StatusCode::CREATED,
        b"{}",
    )
    .await;
    assert_eq!(waiting.await.unwrap(), StatusCode::CREATED);
    drop_table(&first_pool, &table).await;
}

#[tokio::test]
async fn advisory_claims_answer_in_use_at_once_and_wait_when_told() {
    duplicates_wait_or_are_in_use(true).await;
}

#[tokio::test]
async fn portable_claims_answer_in_use_at_once_and_wait_when_told() {
    duplicates_wait_or_are_in_use(false).await;
}

/// The unique index is the authority: a key whose advisory lock another
/// transaction holds (a hash collision, or any other user of the lock) is
/// only in use, never a second row; a claim without advisory locks is not
/// held up by it at all, and an advisory claim replays its answer once
/// the lock is free.
#[tokio::test]
async fn a_held_advisory_lock_costs_a_409_never_an_effect() {
    let pool = test_pool(3, |options| options).await;
    assert!(
        advisory::probe(&pool).await,
        "PostgreSQL offers advisory locks"
    );
    assert_eq!(advisory::known(&pool), Some(true));
    let table = table(&pool, "collision").await;
    let claim = |advisory| Claim {
        advisory,
        ..crate::backend::test_support::claim_of("acct", "taken", 1, Duration::ZERO)
    };
    let mut other = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(sql::lock_id(
            &advisory::lock_table(&pool, &pool, &table).await.unwrap(),
            "acct",
            "taken",
        ))
        .execute(&mut *other)
        .await
        .unwrap();
    let held = Postgres::claim(&pool, Acquire::default(), &table, &claim(true))
        .await
        .unwrap();
    assert!(matches!(held, ClaimOutcome::InUse { .. }), "{held:?}");
    let ClaimOutcome::Claimed(conn) =
        Postgres::claim(&pool, Acquire::default(), &table, &claim(false))
            .await
            .unwrap()
    else {
        panic!("the portable claim was held up by an advisory lock");
    };
    store(conn, &table, &claim(false), StatusCode::CREATED, b"{}").await;
    other.rollback().await.unwrap();
    let replay = Postgres::claim(&pool, Acquire::default(), &table, &claim(true))
        .await
        .unwrap();
    assert!(
        matches!(replay, ClaimOutcome::Finished { .. }),
        "{replay:?}"
    );
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    drop_table(&pool, &table).await;
}

/// Behind a declared pooler the claim, the finish and the replay's read
/// call the key table's functions, which instances migrating at once all
/// make without failing each other: the claim's function bounds an
/// orphaned session for its transaction alone, a held key fails a second
/// claim by its advisory lock, a finished one is read back. With the
/// functions gone, a claim runs the inlined statements instead and asks
/// again; made again, they are called once the answer that they are
/// missing is a minute old.
#[tokio::test]
async fn pooled_claims_call_the_tables_functions() {
    use crate::backend::test_support::{claim_of, claimed, replays, response};

    let pool = test_pool(4, |options| options).await;
    let table = table(&pool, "functions").await;
    let names = sql::FunctionNames::of(&table);
    let drop_functions = format!(
        "DROP FUNCTION IF EXISTS {}, {}, {}",
        names.claim, names.finish, names.peek
    );
    let run = |sql: String| sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool);
    run(drop_functions.clone()).await.unwrap();
    // `functions::create` itself, which passes every error on (the
    // migration turns a database's refusal into a warning).
    let migrations = (0..4).map(|_| functions::create(&pool, &table));
    for migrated in futures_util::future::join_all(migrations).await {
        migrated.expect("migrations at once");
    }
    assert_eq!(functions::known(&pool, &table), Some(true));

    let claim = Claim {
        pooled: true,
        ..claim_of("acct", "f-1", 1, Duration::ZERO)
    };
    let mut conn = claimed(&pool, &table, &claim, "the claim").await;
    assert!(conn.functions && conn.inlined);
    // The function bounds an orphaned session for the claim's transaction
    // alone, as `SET LOCAL` does.
    let bound = claim.orphan_bound().as_millis().to_string();
    assert_eq!(orphan_setting(&mut conn).await, bound);
    // Another session's claim of the held key fails on its lock, in the
    // function, before its insert could wait.
    let mut row = ClaimRow::new(&table, &claim);
    row.functions = true;
    let mut other = OpenTx::new(pool.acquire().await.unwrap());
    match settle(&mut other, &row, "").await {
        Err(error) => assert!(store_has_code(&error, &[KEY_HELD]), "{error:?}"),
        Ok(_) => panic!("a held key was claimed again"),
    }
    drop(other);
    let response = response(StatusCode::CREATED, "{\"id\":1}");
    Postgres::finish(&mut conn, &table, Some(&claim), Some(&response))
        .await
        .expect("finish");
    // The transaction after the commit (the one sqlx counts) has the
    // session's own setting again.
    assert_ne!(orphan_setting(&mut conn).await, bound);
    conn.release();

    let peeks = |claim: &Claim<'_>, outcome| match outcome {
        Ok(Some(ClaimOutcome::Finished {
            fingerprint,
            response: stored,
        })) => assert_eq!((fingerprint, &stored), (claim.fingerprint, &response)),
        other => panic!("read back, not {other:?}"),
    };
    replays(&pool, &table, &claim, &response).await;
    peeks(
        &claim,
        Postgres::peek(&pool, Acquire::default(), &table, &claim).await,
    );

    // The functions dropped under a running process: the next claim meets
    // their absence, claims with the statements, and asks again.
    run(drop_functions.clone()).await.unwrap();
    let claim = Claim {
        key: "f-2",
        ..claim
    };
    let conn = claimed(&pool, &table, &claim, "the claim without the functions").await;
    assert!(!conn.functions && conn.inlined);
    assert_eq!(functions::known(&pool, &table), None, "forgotten");
    store(conn, &table, &claim, StatusCode::CREATED, b"{\"id\":1}").await;
    peeks(
        &claim,
        Postgres::peek(&pool, Acquire::default(), &table, &claim).await,
    );
    let claim = Claim {
        key: "f-3",
        ..claim
    };
    let conn = claimed(&pool, &table, &claim, "the claim that asks again").await;
    assert!(!conn.functions);
    drop(conn);
    assert_eq!(functions::known(&pool, &table), Some(false), "asked again");

    // Made again by another instance's migration: a claim asks again once
    // the answer that they are missing is a minute old, and calls them.
    run(sql::functions_ddl(&table, &names)).await.unwrap();
    assert_eq!(functions::known(&pool, &table), Some(false));
    functions::age(&pool, &table);
    assert_eq!(functions::known(&pool, &table), None);
    let claim = Claim {
        key: "f-4",
        ..claim
    };
    let conn = claimed(&pool, &table, &claim, "the claim that finds them").await;
    assert!(conn.functions);
    drop(conn);
    assert_eq!(functions::known(&pool, &table), Some(true));
    run(drop_functions).await.unwrap();

    drop_table(&pool, &table).await;
}

/// The session's `idle_in_transaction_session_timeout`, in milliseconds.
async fn orphan_setting(conn: &mut OpenTx<Postgres>) -> String {
    sqlx::raw_sql(
        "SELECT setting FROM pg_catalog.pg_settings \
         WHERE name = 'idle_in_transaction_session_timeout'",
    )
    .fetch_one(&mut ***conn)
    .await
    .and_then(|row| row.try_get("setting"))
    .unwrap()
}

/// Advisory locks are one space per database: key tables of one name in
/// two schemas (a pool's search path picking each) take different locks
/// for one key, so each claims it while the other holds it, and the
/// admin's look at a key in flight takes the lock the claim took.
#[tokio::test]
async fn key_tables_of_one_name_in_two_schemas_lock_apart() {
    let admin = test_pool(1, |options| options).await;
    let schemas = ["a", "b"].map(|tag| format!("idem_lock_{tag}_{}", std::process::id()));
    for schema in &schemas {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
    let table = "idem_keys_apart";
    let mut pools = Vec::new();
    for schema in &schemas {
        let pool = test_pool(2, |options| {
            options.options([("search_path", schema.as_str())])
        })
        .await;
        Postgres::migrate(&pool, table).await.expect("migrate");
        pools.push(pool);
    }
    // A `schema.table` is hashed as written, `public`'s included (as
    // earlier releases hash it).
    for qualified in [format!("{}.{table}", schemas[0]), "public.keys".to_owned()] {
        assert_eq!(
            &*advisory::lock_table(&admin, &admin, &qualified)
                .await
                .unwrap(),
            qualified
        );
    }

    let claim = Claim {
        advisory: true,
        ..crate::backend::test_support::claim_of("acct", "same", 1, Duration::ZERO)
    };
    let mut held = Vec::new();
    for pool in &pools {
        match Postgres::claim(pool, Acquire::default(), table, &claim)
            .await
            .unwrap()
        {
            ClaimOutcome::Claimed(conn) => held.push(conn),
            other => panic!("the other schema's claim held this one: {other:?}"),
        }
    }
    // Each claim asked its own session for the table's schema.
    for (pool, schema) in pools.iter().zip(&schemas) {
        assert_eq!(
            advisory::known_lock_table(pool, table).as_deref(),
            Some(format!("{schema}.{table}").as_str())
        );
    }
    // The admin's look at a key in flight takes the claims' name: with one
    // schema's attempt finished, only the other's is in flight.
    let mut held = held.into_iter();
    store(
        held.next().unwrap(),
        table,
        &claim,
        StatusCode::CREATED,
        b"{}",
    )
    .await;
    for (pool, in_flight) in pools.iter().zip([false, true]) {
        assert_eq!(
            <Postgres as crate::backend::admin::AdminStore>::claim_in_flight(
                pool, table, "acct", "same"
            )
            .await
            .unwrap(),
            in_flight
        );
    }
    store(
        held.next().unwrap(),
        table,
        &claim,
        StatusCode::CREATED,
        b"{}",
    )
    .await;
    for pool in &pools {
        let replay = Postgres::claim(pool, Acquire::default(), table, &claim)
            .await
            .unwrap();
        assert!(
            matches!(replay, ClaimOutcome::Finished { .. }),
            "{replay:?}"
        );
    }
    for schema in &schemas {
        sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin)
            .await
            .unwrap();
    }
}
