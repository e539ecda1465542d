//! MySQL/MariaDB-only checks, at the storage layer: the claim's short lock
//! wait must not leak into the handler's statements or the pool.

use std::time::Duration;

use idem::__private::{Acquire, ClaimOutcome, FinishError};
use idem::Backend;
use idem_tests::store::{claim, claimed, created};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Executor, MySql};

use crate::app::TestDb;
use crate::harness::{unique, until_idle};

/// The lock wait the pool's sessions are configured with.
const SESSION_LOCK_WAIT: u64 = 7;

async fn lock_wait(conn: &mut sqlx::MySqlConnection) -> u64 {
    sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A two-connection pool on the test server whose every session first
/// runs `set`: a session setting the claim and finish must hold under.
async fn session_pool(set: String) -> sqlx::MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(move |conn, _| {
            let set = set.clone();
            Box::pin(async move {
                conn.execute(sqlx::AssertSqlSafe(set)).await?;
                Ok(())
            })
        })
        .connect(&crate::engines::mysql::url())
        .await
        .unwrap()
}

/// The handler runs with the session's own `innodb_lock_wait_timeout`, and
/// the connection goes back to the pool with it, whatever the claim set
/// for its insert and whether the claim won (`Claimed`), lost (`InUse`) or
/// found the key finished (its batch stopped before the restore).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_restores_the_sessions_lock_wait() {
    let _slot = crate::harness::slot::<MySql>().await;
    MySql::connect().await; // the server is there and the table migrated
    let pool = session_pool(format!(
        "SET SESSION innodb_lock_wait_timeout = {SESSION_LOCK_WAIT}"
    ))
    .await;
    let scope = unique("lockwait");
    let claim = claim(&scope, 7, Duration::from_millis(250));

    let mut held = claimed(&pool, &claim, "the claim").await;
    assert_eq!(
        lock_wait(&mut held).await,
        SESSION_LOCK_WAIT,
        "inside the handler"
    );

    // The duplicate's insert times out on the held row: its connection is
    // reset before it goes back to the pool.
    let duplicate = MySql::claim(&pool, Acquire::default(), "idem_keys", &claim)
        .await
        .unwrap();
    assert!(
        matches!(duplicate, ClaimOutcome::InUse { .. }),
        "{duplicate:?}"
    );
    let mut other = pool.acquire().await.unwrap();
    assert_eq!(
        lock_wait(&mut other).await,
        SESSION_LOCK_WAIT,
        "after a lost claim"
    );
    let in_transaction: u64 = sqlx::query_scalar("SELECT @@in_transaction")
        .fetch_one(&mut *other)
        .await
        .unwrap();
    assert_eq!(in_transaction, 0, "the lost claim's transaction ended");
    drop(other);

    let response = created("{\"id\":7}");
    MySql::finish(&mut held, "idem_keys", Some(&claim), Some(&response))
        .await
        .unwrap();
    held.release();
    let replay = MySql::claim(&pool, Acquire::default(), "idem_keys", &claim)
        .await
        .unwrap();
    assert!(
        matches!(replay, ClaimOutcome::Finished { .. }),
        "{replay:?}"
    );
    // The pool's two connections, whichever the replay's claim used.
    let (mut first, mut second) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    for conn in [&mut first, &mut second] {
        assert_eq!(
            lock_wait(conn).await,
            SESSION_LOCK_WAIT,
            "after a claim that found the key finished"
        );
    }
}

/// Log lines written while a test runs, for it to read.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// The lines at `level` so far.
    fn lines_at(&self, level: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|line| line.contains(level))
            .map(str::to_owned)
            .collect()
    }
}

/// A statement of the handler's that commits implicitly (DDL) ends the
/// request's transaction by committing it, claim row and all: the finish
/// then stores the response on that committed row, so the key replays
/// instead of answering 409 until it expires; and it logs a warning, the
/// operator's only sign that a response was stored after its effects.
/// (On this test's thread, where the runtime runs everything, so the
/// thread's own subscriber sees the finish's events.)
#[tokio::test(flavor = "current_thread")]
async fn an_implicit_commit_still_stores_the_response() {
    let _slot = crate::harness::slot::<MySql>().await;
    let log = Captured::default();
    let writer = log.clone();
    let _logging = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish(),
    );
    let pool = MySql::connect().await;
    let scope = unique("implicit");
    let claim = claim(&scope, 9, Duration::ZERO);
    let mut held = claimed(&pool, &claim, "the claim").await;
    held.execute("CREATE TABLE IF NOT EXISTS idem_implicit_commit (id INT) ENGINE = InnoDB")
        .await
        .unwrap();
    let in_transaction: u64 = sqlx::query_scalar("SELECT @@in_transaction")
        .fetch_one(&mut **held)
        .await
        .unwrap();
    assert_eq!(in_transaction, 0, "the DDL committed the transaction");
    let response = created("{\"id\":1}");
    assert_eq!(log.lines_at("WARN"), Vec::<String>::new());
    MySql::finish(&mut held, "idem_keys", Some(&claim), Some(&response))
        .await
        .expect("the response is stored on the committed claim");
    held.release();
    let warnings = log.lines_at("WARN");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("committed its transaction implicitly"),
        "{warnings:?}"
    );

    match MySql::claim(&pool, Acquire::default(), "idem_keys", &claim)
        .await
        .unwrap()
    {
        ClaimOutcome::Finished {
            fingerprint,
            response: stored,
        } => {
            assert_eq!(fingerprint, claim.fingerprint);
            assert_eq!(stored, response);
        }
        other => panic!("the key must replay: {other:?}"),
    }
}

/// In a session with `autocommit` off, the statement after a deadlock's
/// rollback opens a new transaction, so the finish's open-transaction
/// check passes: its `UPDATE` then misses the claim's row (rolled back),
/// and the finish reports the transaction ended instead of a success,
/// before its `COMMIT`: what the handler wrote after the error is rolled
/// back too. (A `ROLLBACK` leaves the session as InnoDB's deadlock rollback
/// does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_autocommit_a_rolled_back_claim_is_not_a_success() {
    let _slot = crate::harness::slot::<MySql>().await;
    MySql::connect().await;
    let pool = session_pool("SET SESSION autocommit = 0".to_owned()).await;
    let scope = unique("noautocommit");
    let claim = claim(&scope, 5, Duration::ZERO);
    let mut held = claimed(&pool, &claim, "the claim").await;
    held.execute("ROLLBACK").await.unwrap();
    // The handler goes on writing, in the transaction the session opened.
    sqlx::query(<MySql as TestDb>::INSERT_EFFECT)
        .bind(scope.as_bytes())
        .bind("k")
        .bind("after the error")
        .bind("")
        .fetch_one(&mut **held)
        .await
        .unwrap();
    let response = created("{}");
    let finished = MySql::finish(&mut held, "idem_keys", Some(&claim), Some(&response)).await;
    assert!(
        matches!(finished, Err(FinishError::Ended(_))),
        "{finished:?}"
    );
    MySql::rollback(&mut held).await.unwrap();
    held.release();
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE scope = ?")
        .bind(scope.as_bytes())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(keys, 0, "nothing was stored");
    assert_eq!(
        MySql::count_effects(&pool, &scope).await,
        0,
        "the write after the error was committed"
    );
}

/// A session's settings cannot defeat the claim's check: with a
/// `sql_select_limit` of 1 or 0 (the read of a finished key's row has its
/// own `LIMIT`), or an `sql_mode` without strictness (where many errors
/// are warnings; the check's overflow stays an error),
/// a fresh key is still claimed and a finished one still replayed, never
/// claimed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_settings_cannot_defeat_the_claim() {
    let _slot = crate::harness::slot::<MySql>().await;
    MySql::connect().await;
    for setting in [
        "sql_select_limit = 1",
        "sql_select_limit = 0",
        "sql_mode = 'NO_UNSIGNED_SUBTRACTION'",
    ] {
        let pool = session_pool(format!("SET SESSION {setting}")).await;
        let scope = unique("sessionsettings");
        let claim = claim(&scope, 6, Duration::ZERO);
        let mut held = claimed(&pool, &claim, setting).await;
        let response = created("{\"id\":1}");
        MySql::finish(&mut held, "idem_keys", Some(&claim), Some(&response))
            .await
            .unwrap_or_else(|error| panic!("{setting}: {error}"));
        held.release();
        match MySql::claim(&pool, Acquire::default(), "idem_keys", &claim)
            .await
            .unwrap()
        {
            ClaimOutcome::Finished {
                response: stored, ..
            } => assert_eq!(stored, response, "{setting}"),
            other => panic!("{setting}: a finished key must replay: {other:?}"),
        }
    }
}

/// With `autocommit` off, neither the sweeper nor a replay's read leaves a
/// transaction open on the connection it hands back to the pool: the
/// sweep's deletes are committed (another session sees them, and their
/// locks are gone), and the read's snapshot ends with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_autocommit_sweeps_and_reads_leave_no_transaction_open() {
    let _slot = crate::harness::slot::<MySql>().await;
    MySql::connect().await;
    let pool = session_pool("SET SESSION autocommit = 0".to_owned()).await;
    let table = format!("idem_noautocommit_{}", std::process::id());
    let scope = unique("noautocommit_sweep");
    let live = claim(&scope, 9, Duration::ZERO);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(&pool)
        .await
        .unwrap();
    MySql::migrate(&pool, &table).await.expect("migrate");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) VALUES \
         (X'{scope}', 'old', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 1 SECOND), \
         (X'{scope}', 'k', X'{fingerprint}', 201, UTC_TIMESTAMP(6), \
          UTC_TIMESTAMP(6) + INTERVAL 1 HOUR); COMMIT",
        scope = hex::encode(&scope),
        fingerprint = "09".repeat(32),
    )))
    .execute(&pool)
    .await
    .unwrap();

    assert_eq!(MySql::sweep(&pool, &table, 100).await.unwrap(), 1);
    let found = MySql::peek(&pool, Acquire::default(), &table, &live)
        .await
        .unwrap();
    assert!(
        matches!(found, Some(ClaimOutcome::Finished { .. })),
        "{found:?}"
    );

    let other = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&crate::engines::mysql::url())
        .await
        .unwrap();
    let left: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(`key` AS CHAR) FROM {table} ORDER BY `key`"
    )))
    .fetch_all(&other)
    .await
    .unwrap();
    assert_eq!(left, ["k"], "the sweep's delete was not committed");
    let (mut a, mut b) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    for conn in [&mut a, &mut b] {
        let open: u64 = sqlx::query_scalar("SELECT @@in_transaction")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(
            open, 0,
            "a pooled connection came back inside a transaction"
        );
    }
    drop((a, b));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&other)
        .await
        .unwrap();
}

/// A claim that waits less than a second for another process's attempt
/// (MariaDB's `max_statement_time`: error 1969, SQLSTATE 70100, on a live
/// session) answers 409 and hands its connection back to the pool, reset,
/// in either way of acquiring: it is not taken for a connection that was
/// gone and closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_keeps_its_connection() {
    let _slot = crate::harness::slot::<MySql>().await;
    MySql::connect().await;
    let pool = session_pool(format!(
        "SET SESSION innodb_lock_wait_timeout = {SESSION_LOCK_WAIT}"
    ))
    .await;
    let scope = unique("waited");
    // Another process's attempt in flight: its uncommitted claim row.
    let mut holder = crate::engines::mysql::pool(1)
        .await
        .acquire()
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "START TRANSACTION; INSERT INTO idem_keys (scope, `key`, fingerprint, created_at, \
         expires_at) VALUES (X'{}', 'k', X'{}', UTC_TIMESTAMP(6), \
         UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
        hex::encode(&scope),
        "07".repeat(32),
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    let session = async || {
        // The pool's one connection, once it is back.
        until_idle(&pool).await;
        let mut conn = pool.try_acquire().expect("an idle connection");
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        (id, lock_wait(&mut conn).await)
    };
    // One connection in the pool: the claim takes it.
    drop(pool.acquire().await.unwrap());
    for acquire in [Acquire::Idle, Acquire::Checked] {
        let (before, _) = session().await;
        let claim = claim(&scope, 7, Duration::from_millis(100));
        let outcome = MySql::claim(&pool, acquire, "idem_keys", &claim)
            .await
            .unwrap();
        assert!(matches!(outcome, ClaimOutcome::InUse { .. }), "{outcome:?}");
        let (after, lock_wait) = session().await;
        assert_eq!(
            after, before,
            "{acquire:?}: the claim's connection was closed"
        );
        assert_eq!(lock_wait, SESSION_LOCK_WAIT, "{acquire:?}: not reset");
    }
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
}

/// The statements a new key costs the server, as docs/engines.md counts
/// them: the claim's batch 4 (set the session's timeouts, `START
/// TRANSACTION`, the upsert, the check that restores them), the finish's 6
/// (a savepoint and its release, the response's `UPDATE`, its check,
/// `COMMIT`, the empty transaction sqlx counts) and sqlx's `ROLLBACK` of
/// that transaction. Counted by the session's `Questions`, on a pool of one
/// connection that is not pinged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_costs_eleven_statements() {
    let _slot = crate::harness::slot::<MySql>().await;
    MySql::connect().await;
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect(&crate::engines::mysql::url())
        .await
        .unwrap();
    async fn questions(pool: &sqlx::MySqlPool) -> u64 {
        use sqlx::Row as _;
        // A text-protocol statement: one question, no statement prepared.
        let row = sqlx::raw_sql("SHOW SESSION STATUS LIKE 'Questions'")
            .fetch_one(pool)
            .await
            .unwrap();
        row.get::<String, _>(1).parse().unwrap()
    }
    let scope = unique("statements");
    let claim = claim(&scope, 8, Duration::ZERO);
    let before = questions(&pool).await;
    let mut held = claimed(&pool, &claim, "the claim").await;
    MySql::finish(&mut held, "idem_keys", Some(&claim), Some(&created("{}")))
        .await
        .unwrap();
    held.release();
    // The second `SHOW` counts itself.
    let statements = questions(&pool).await - before - 1;
    assert_eq!(
        statements, 11,
        "statements of a claim, its finish and sqlx's rollback"
    );
}
