//! MySQL/MariaDB's claim, sweep and migration against the server.

use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySqlConnection, Pool, Row};

use super::sql::delete_statements;
use super::*;
use crate::backend::admin::AdminStore;
use crate::backend::outbox_store::OutboxStore;
use crate::backend::store::Store;
use crate::backend::test_support::{claim_of, claimed, created, replays};
use crate::backend::{Acquire, FinishError, Forgotten, KeyState};
use crate::response::EncodedResponse;

/// A pool on the test server; fails loudly without one.
pub(crate) async fn test_pool(max_connections: u32) -> Pool<MySql> {
    connect(MySqlPoolOptions::new().max_connections(max_connections)).await
}

/// A pool of `options` on the test server; fails loudly without one.
async fn connect(options: MySqlPoolOptions) -> Pool<MySql> {
    let url = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    options
        .connect(&url)
        .await
        .unwrap_or_else(|error| panic!("MySQL/MariaDB is required at {url}: {error}"))
}

/// `error`, which must carry the server's `code`, as the claim sorts it.
fn sorted(error: sqlx::Error, code: u16) -> Failure {
    assert_eq!(number(&error), Some(code), "{error}");
    failure(error)
}

/// A key table of this test process named after `name`, migrated
/// empty (a run killed before its cleanup, with the same process id,
/// left one).
pub(crate) async fn key_table(pool: &Pool<MySql>, name: &str) -> String {
    let table = format!("idem_{name}_{}", std::process::id());
    run(
        &mut pool.acquire().await.unwrap(),
        &format!("DROP TABLE IF EXISTS {table}"),
    )
    .await
    .unwrap();
    MySql::migrate(pool, &table).await.expect("migrate");
    table
}

/// Drops a test's table, at its end.
pub(crate) async fn drop_table(pool: &Pool<MySql>, table: &str) {
    run(
        &mut pool.acquire().await.unwrap(),
        &format!("DROP TABLE {table}"),
    )
    .await
    .unwrap();
}

async fn run(conn: &mut MySqlConnection, sql: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(conn)
        .await
        .map(drop)
}

/// Longer than the 0.1 s `INNODB_TRX` must go unread before InnoDB
/// refreshes it.
const INNODB_TRX_REFRESH: Duration = Duration::from_millis(150);

/// The server's own errors, met as a claim meets them, sorted as the
/// claim's retry loop needs: a deadlock is tried again, a lock wait that
/// ran out (whole seconds, or MariaDB's statement time) is a 409, and
/// anything else fails the claim.
#[tokio::test]
async fn deadlocks_are_retried_and_lock_waits_are_in_use() {
    let pool = test_pool(3).await;
    let table = format!("idem_failures_{}", std::process::id());
    let [first, second] =
        [1, 2].map(|id| format!("SELECT id FROM {table} WHERE id = {id} FOR UPDATE"));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {table}; \
         CREATE TABLE {table} (id int PRIMARY KEY) ENGINE = InnoDB; \
         INSERT INTO {table} VALUES (1), (2)"
    )))
    .execute(&pool)
    .await
    .unwrap();

    // a holds row 1 and b row 2; a asks for row 2 and waits ...
    let mut a = pool.acquire().await.unwrap();
    let mut b = pool.acquire().await.unwrap();
    run(&mut a, &format!("START TRANSACTION; {first}"))
        .await
        .unwrap();
    run(&mut b, &format!("START TRANSACTION; {second}"))
        .await
        .unwrap();
    let a_thread: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *a)
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        let result = run(&mut a, &second).await;
        (a, result)
    });
    // ... as the server's lock queue shows (no event tells, so it is
    // polled until a is in it). InnoDB refreshes `INNODB_TRX` only once
    // it has gone unread for 0.1 s: polled more often than that, it
    // shows the first read's snapshot for ever (this test failed so
    // when a first read came before a's wait). ...
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waits: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX \
             WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id = ?",
        )
        .bind(a_thread)
        .fetch_one(&pool)
        .await
        .unwrap();
        if waits == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "a never waited for b's row");
        tokio::time::sleep(INNODB_TRX_REFRESH).await;
    }
    // ... and b asks for row 1: a cycle, and InnoDB picks a victim.
    let b_result = run(&mut b, &first).await;
    let (mut a, a_result) = waiting.await.unwrap();
    let mut errors: Vec<_> = [a_result, b_result]
        .into_iter()
        .filter_map(Result::err)
        .collect();
    assert_eq!(errors.len(), 1, "one of the two is the deadlock's victim");
    assert!(matches!(
        sorted(errors.remove(0), ER_LOCK_DEADLOCK),
        Failure::Retry(_)
    ));
    for conn in [&mut a, &mut b] {
        run(conn, "ROLLBACK").await.unwrap();
    }

    // b holds row 1: c's lock waits for it run out.
    run(&mut b, &format!("START TRANSACTION; {first}"))
        .await
        .unwrap();
    let mut c = pool.acquire().await.unwrap();
    let timed_out = run(
        &mut c,
        &format!("SET SESSION innodb_lock_wait_timeout = 0; START TRANSACTION; {first}"),
    )
    .await
    .expect_err("row 1 is b's");
    assert!(matches!(
        sorted(timed_out, ER_LOCK_WAIT_TIMEOUT),
        Failure::InUse
    ));
    run(
        &mut c,
        "ROLLBACK; SET SESSION innodb_lock_wait_timeout = DEFAULT",
    )
    .await
    .unwrap();
    let mariadb: bool = sqlx::query_scalar("SELECT VERSION() LIKE '%MariaDB%'")
        .fetch_one(&mut *c)
        .await
        .unwrap();
    if mariadb {
        let interrupted = run(
            &mut c,
            &format!("START TRANSACTION; SET STATEMENT max_statement_time = 0.05 FOR {first}"),
        )
        .await
        .expect_err("row 1 is b's");
        assert!(matches!(
            sorted(interrupted, ER_STATEMENT_TIMEOUT),
            Failure::InUse
        ));
        run(&mut c, "ROLLBACK").await.unwrap();
    }

    let syntax = run(&mut c, "SELEC 1").await.expect_err("not SQL");
    assert!(matches!(failure(syntax), Failure::Fatal(_)));
    run(&mut b, "ROLLBACK").await.unwrap();
    drop((a, b, c));
    drop_table(&pool, &table).await;
}

/// Taking over an expired key honours `wait` like any claim (the
/// upsert's lock wait is bounded as the insert's is): while another
/// transaction holds the expired row, the claim is told the key is in
/// use, instead of waiting for that transaction to end. Once the row is
/// free, the key is taken over, in place.
#[tokio::test]
async fn taking_over_an_expired_key_waits_no_longer_than_wait() {
    let pool = test_pool(3).await;
    let table = key_table(&pool, "takeover").await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
         VALUES ('acct', 'old', X'00', 201, UTC_TIMESTAMP(6), \
                 UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut holder = pool.acquire().await.unwrap();
    run(
        &mut holder,
        &format!("START TRANSACTION; SELECT 1 FROM {table} WHERE `key` = 'old' FOR UPDATE"),
    )
    .await
    .unwrap();
    let release = async move { run(&mut holder, "ROLLBACK").await.unwrap() };
    crate::backend::test_support::in_use_then_taken_over(&pool, &table, release).await;
    let rows: Vec<(Vec<u8>, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT fingerprint, expires_at > UTC_TIMESTAMP(6) FROM {table} WHERE `key` = 'old'"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows, [(vec![1; 32], true)], "one live row, the new claim's");
    drop_table(&pool, &table).await;
}

/// A table name as long as `Idem::table` takes (63 characters) migrates:
/// its index gets a short name instead of one past MySQL's 64.
#[tokio::test]
async fn the_longest_table_name_migrates() {
    let pool = test_pool(1).await;
    let prefix = format!("idem_long_{}_", std::process::id());
    let table = format!("{prefix}{}", "x".repeat(63 - prefix.len()));
    assert_eq!(table.len(), 63);
    MySql::migrate(&pool, &table).await.expect("migrate");
    MySql::migrate(&pool, &table).await.expect("migrate again");
    drop_table(&pool, &table).await;
}

/// The sweeper skips an expired row a claim is taking over (its handler
/// running) instead of waiting for it: the other expired rows go at
/// once, and the taken-over row stays, live.
#[tokio::test]
async fn sweeps_skip_a_row_a_claim_holds() {
    let pool = test_pool(3).await;
    let table = key_table(&pool, "sweep").await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
         VALUES ('acct', 'k1', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 3 SECOND), \
                ('acct', 'k2', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 2 SECOND), \
                ('acct', 'k3', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let claim = claim_of("acct", "k2", 1, Duration::ZERO);
    let ClaimOutcome::Claimed(held) = MySql::claim(&pool, Acquire::default(), &table, &claim)
        .await
        .unwrap()
    else {
        panic!("the expired key is taken over");
    };
    let started = Instant::now();
    let swept = MySql::sweep(&pool, &table, 1000).await.unwrap();
    assert_eq!(swept, 2, "k1 and k3");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let mut held = held;
    MySql::rollback(&mut held).await.unwrap();
    held.release();
    let left: Vec<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT `key` FROM {table} ORDER BY `key`"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(left, [b"k2".to_vec()], "the held row is left to the claim");
    drop_table(&pool, &table).await;
}

/// Where expired rows are the whole table, the sweep's `DELETE` still
/// reads the primary key (MariaDB scanned the table instead, met a
/// fresh key's uncommitted claim and waited for it, up to 50 s, found
/// by review); and a batch of long scopes is cut into statements of
/// about 1 MiB, every row in one of them.
#[tokio::test]
async fn sweeps_never_wait_for_a_fresh_claim() {
    let pool = test_pool(3).await;
    let table = key_table(&pool, "sweep_all").await;
    run(
        &mut pool.acquire().await.unwrap(),
        &format!(
            "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
             SELECT 'acct', CONCAT('k-', seq), X'00', 201, UTC_TIMESTAMP(6), \
                    UTC_TIMESTAMP(6) - INTERVAL 1 SECOND FROM seq_1_to_1000"
        ),
    )
    .await
    .unwrap();
    let claim = claim_of("acct", "fresh", 1, Duration::ZERO);
    let ClaimOutcome::Claimed(mut held) = MySql::claim(&pool, Acquire::default(), &table, &claim)
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    let started = Instant::now();
    let swept = tokio::time::timeout(Duration::from_secs(5), MySql::sweep(&pool, &table, 1000))
        .await
        .expect("the sweep does not wait for the claim")
        .unwrap();
    assert_eq!(swept, 1000, "after {:?}", started.elapsed());
    MySql::rollback(&mut held).await.unwrap();
    held.release();

    let rows: Vec<(Vec<u8>, Vec<u8>)> = (0..40)
        .map(|i| (vec![b's'; 2048], format!("k-{i}").into_bytes()))
        .collect();
    let statements = delete_statements("t", &rows, 20_000);
    assert!(statements.len() > 1);
    assert!(
        statements
            .iter()
            .all(|statement| statement.len() < 20_000 + 4200)
    );
    let keys: usize = statements
        .iter()
        .map(|statement| statement.matches("X'6b2d").count())
        .sum();
    assert_eq!(keys, 40);
    drop_table(&pool, &table).await;
}

/// A batch of expired rows of the longest scopes takes several `DELETE`
/// statements against the server: every one of them runs, in the
/// batch's one transaction, and commits; a live row among them stays.
#[tokio::test]
async fn sweeps_a_batch_of_long_scopes_in_several_statements() {
    let pool = test_pool(2).await;
    let table = key_table(&pool, "sweep_long").await;
    let scope = crate::scope::MAX_SCOPE_LEN;
    run(
        &mut pool.acquire().await.unwrap(),
        &format!(
            "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
             SELECT REPEAT('s', {scope}), CONCAT('k-', seq), X'00', 201, UTC_TIMESTAMP(6), \
                    UTC_TIMESTAMP(6) - INTERVAL 1 SECOND FROM seq_1_to_1000; \
             INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
             VALUES (REPEAT('s', {scope}), 'live', X'00', 201, UTC_TIMESTAMP(6), \
                     UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)"
        ),
    )
    .await
    .unwrap();
    let rows: Vec<(Vec<u8>, Vec<u8>)> = (1..=1000)
        .map(|i| (vec![b's'; scope], format!("k-{i}").into_bytes()))
        .collect();
    assert!(
        delete_statements(&table, &rows, 1 << 20).len() >= 4,
        "the sweep below needs several statements"
    );

    assert_eq!(MySql::sweep(&pool, &table, 1000).await.unwrap(), 1000);
    // Read from a session of its own: the sweep committed.
    let (left, live): (i64, Option<Vec<u8>>) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT COUNT(*), MAX(`key`) FROM {table}"
    )))
    .fetch_one(&test_pool(1).await)
    .await
    .unwrap();
    assert_eq!((left, live.as_deref()), (1, Some(&b"live"[..])));
    drop_table(&pool, &table).await;
}

/// The claim bounds its own transaction's idle time (MariaDB's
/// `idle_transaction_timeout`, for a session whose client vanished) and
/// puts the session's value back when the transaction ends, committed or
/// rolled back: later transactions on the pooled connection (keyless ones,
/// the application's own) keep the server's setting.
#[tokio::test]
async fn the_claims_idle_bound_ends_with_its_transaction() {
    let pool = test_pool(1).await;
    let table = key_table(&pool, "idle_bound").await;
    let idle = || async {
        sqlx::query_scalar::<_, u64>("SELECT @@SESSION.idle_transaction_timeout")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = idle().await;
    let claim = claim_of("acct", "idle", 1, Duration::ZERO);
    let ClaimOutcome::Claimed(mut conn) = MySql::claim(&pool, Acquire::default(), &table, &claim)
        .await
        .unwrap()
    else {
        panic!("a new key was not claimed");
    };
    let inside: u64 = sqlx::query_scalar("SELECT @@SESSION.idle_transaction_timeout")
        .fetch_one(&mut **conn)
        .await
        .unwrap();
    assert_eq!(inside, 32, "the deadline (30 s) and the margin");
    let response = EncodedResponse {
        status: http::StatusCode::CREATED,
        headers: Vec::new(),
        body: "{}".into(),
        tombstone: None,
    };
    MySql::finish(&mut conn, &table, Some(&claim), Some(&response))
        .await
        .unwrap();
    conn.release();
    assert_eq!(idle().await, before, "after a commit");

    let again = claim_of("acct", "idle-2", 1, Duration::ZERO);
    let ClaimOutcome::Claimed(mut conn) = MySql::claim(&pool, Acquire::default(), &table, &again)
        .await
        .unwrap()
    else {
        panic!("a new key was not claimed");
    };
    MySql::rollback(&mut conn).await.unwrap();
    conn.release();
    assert_eq!(idle().await, before, "after a rollback");
    drop_table(&pool, &table).await;
}

/// The phased mode's storage contract (`test_support::lease_contract`),
/// on a new table and on one from before the phased mode that `migrate`
/// completed.
#[tokio::test]
async fn the_lease_contract_holds() {
    let pool = test_pool(4).await;
    let table = key_table(&pool, "lease").await;
    crate::backend::test_support::lease_contract(&pool, &table).await;
    drop_table(&pool, &table).await;

    let old = format!("idem_lease_old_{}", std::process::id());
    run(
        &mut pool.acquire().await.unwrap(),
        &format!(
            "DROP TABLE IF EXISTS {old}; \
             CREATE TABLE {old} (scope VARBINARY(2048) NOT NULL, `key` VARBINARY(255) NOT NULL, \
                 fingerprint BINARY(32) NOT NULL, status SMALLINT NULL, headers MEDIUMBLOB NULL, \
                 body LONGBLOB NULL, created_at DATETIME(6) NOT NULL, expires_at DATETIME(6) NOT NULL, \
                 PRIMARY KEY (scope, `key`), KEY {old}_expires_at_idx (expires_at)) ENGINE = InnoDB"
        ),
    )
    .await
    .unwrap();
    MySql::migrate(&pool, &old).await.expect("migrate");
    MySql::migrate(&pool, &old).await.expect("migrate again");
    crate::backend::test_support::lease_contract(&pool, &old).await;
    drop_table(&pool, &old).await;
}

/// The operators' key operations (`test_support::admin_contract`).
#[tokio::test]
async fn the_admin_contract_holds() {
    let pool = test_pool(4).await;
    let table = key_table(&pool, "admin").await;
    crate::backend::test_support::admin_contract(&pool, &table).await;
    drop_table(&pool, &table).await;
}

/// A claim in progress in another session (its row uncommitted, so no
/// flight of this process knows it) makes the forget's delete wait on
/// the row's lock: refused as in flight after a second, the row intact.
#[tokio::test]
async fn a_claim_in_another_session_is_not_forgotten() {
    let pool = test_pool(2).await;
    let table = key_table(&pool, "admin_other").await;
    let mut other = pool.acquire().await.unwrap();
    run(
        &mut other,
        &format!(
            "START TRANSACTION; INSERT INTO {table} (scope, `key`, fingerprint, created_at, \
             expires_at) VALUES ('admin', 'other', REPEAT('x', 32), UTC_TIMESTAMP(6), \
             UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)"
        ),
    )
    .await
    .unwrap();
    let started = Instant::now();
    assert_eq!(
        MySql::forget(&pool, &table, "admin", "other")
            .await
            .unwrap(),
        Forgotten::InFlight
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    run(&mut other, "COMMIT").await.unwrap();
    drop(other);
    let row = MySql::lookup(&pool, &table, "admin", "other")
        .await
        .unwrap();
    assert_eq!(row.expect("kept").into_info().state, KeyState::InFlight);
    // Each session's own lock wait is back (both of the pool's).
    let mut sessions = [pool.acquire().await.unwrap(), pool.acquire().await.unwrap()];
    for session in &mut sessions {
        let wait: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&mut **session)
            .await
            .unwrap();
        assert!(wait > 1, "{wait}");
    }
    drop(sessions);
    drop_table(&pool, &table).await;
}

/// The outbox's and consumers' storage contract
/// (`test_support::outbox_contract`).
#[tokio::test]
async fn the_outbox_contract_holds() {
    let pool = test_pool(4).await;
    let (outbox, consumed) = outbox_tables(&pool, "").await;
    crate::backend::test_support::outbox_contract(&pool, &outbox, &consumed).await;
    drop_tables(&pool, &[&outbox, &consumed]).await;
}

/// Outbox and consumed tables' names of this test process, after `name`,
/// neither there (a run killed before its cleanup, with the same process
/// id, left them).
async fn outbox_tables(pool: &Pool<MySql>, name: &str) -> (String, String) {
    let (outbox, consumed) = (
        format!("idem_{name}outbox_{}", std::process::id()),
        format!("idem_{name}consumed_{}", std::process::id()),
    );
    drop_tables(pool, &[&outbox, &consumed]).await;
    (outbox, consumed)
}

async fn drop_tables(pool: &Pool<MySql>, tables: &[&str]) {
    let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
    run(&mut pool.acquire().await.unwrap(), &sql).await.unwrap();
}

/// A lease whose future is dropped while it waits for the relays' named
/// lock closes its session instead of pooling it: the lock it is then
/// granted ends with the session, and the next relay leases.
#[tokio::test]
async fn a_lease_cut_half_way_leaves_no_lock_behind() {
    let pool = test_pool(2).await;
    let (outbox, consumed) = outbox_tables(&pool, "cut_").await;
    MySql::migrate_outbox(&pool, &outbox, &consumed)
        .await
        .unwrap();
    let lock = super::outbox_store::lease_lock(&outbox);
    let holder_pool = test_pool(1).await;
    let mut holder = holder_pool.acquire().await.unwrap();
    let held: i64 = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
        .bind(&lock)
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    assert_eq!(held, 1);
    let lease = tokio::spawn({
        let (pool, outbox) = (pool.clone(), outbox.clone());
        async move { MySql::lease_messages(&pool, &outbox, 1, Duration::from_secs(10), 5).await }
    });
    // Cut once the lease waits for the lock.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST              WHERE STATE = 'User lock' AND INFO LIKE 'SELECT GET_LOCK(%'",
        )
        .fetch_one(&mut *holder)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the lease never waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    lease.abort();
    assert!(lease.await.unwrap_err().is_cancelled());
    // The lock goes to the cut lease's session, which must then end.
    sqlx::query("DO RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut *holder)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let user: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?)")
            .bind(&lock)
            .fetch_one(&mut *holder)
            .await
            .unwrap();
        if user.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "session {user:?} still holds the relays' lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let leased = tokio::time::timeout(
        Duration::from_secs(2),
        MySql::lease_messages(&pool, &outbox, 2, Duration::from_secs(10), 5),
    )
    .await
    .expect("the next lease does not wait for the lock")
    .unwrap();
    assert!(leased.is_empty());
    drop(holder);
    drop_tables(&pool, &[&outbox, &consumed]).await;
}

/// The lock wait the session pools' sessions are configured with.
const SESSION_LOCK_WAIT: u64 = 7;

async fn lock_wait(conn: &mut MySqlConnection) -> u64 {
    sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Whether `conn`'s session is inside a transaction.
async fn in_transaction(conn: &mut MySqlConnection) -> u64 {
    sqlx::query_scalar("SELECT @@in_transaction")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A two-connection pool on the test server whose every session first
/// runs `set`: a session setting the claim and finish must hold under.
async fn session_pool(set: String) -> Pool<MySql> {
    connect(
        MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(move |conn, _| {
                let set = set.clone();
                Box::pin(async move {
                    sqlx::Executor::execute(conn, AssertSqlSafe(set)).await?;
                    Ok(())
                })
            }),
    )
    .await
}

/// Waits until every connection of `pool` is back in it.
async fn until_idle(pool: &Pool<MySql>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.num_idle() < pool.size() as usize {
        assert!(Instant::now() < deadline, "a connection never came back");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The handler runs with the session's own `innodb_lock_wait_timeout`, and
/// the connection goes back to the pool with it, whatever the claim set
/// for its insert and whether the claim won (`Claimed`), lost (`InUse`) or
/// found the key finished (its batch stopped before the restore).
#[tokio::test]
async fn the_claim_restores_the_sessions_lock_wait() {
    let table = key_table(&test_pool(1).await, "lockwait").await;
    let pool = session_pool(format!(
        "SET SESSION innodb_lock_wait_timeout = {SESSION_LOCK_WAIT}"
    ))
    .await;
    let claim = claim_of("acct", "k", 7, Duration::from_millis(250));

    let mut held = claimed(&pool, &table, &claim, "the claim").await;
    assert_eq!(
        lock_wait(&mut held).await,
        SESSION_LOCK_WAIT,
        "inside the handler"
    );

    // The duplicate's insert times out on the held row: its connection is
    // reset before it goes back to the pool.
    let duplicate = MySql::claim(&pool, Acquire::default(), &table, &claim)
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
    assert_eq!(
        in_transaction(&mut other).await,
        0,
        "the lost claim's transaction ended"
    );
    drop(other);

    let response = created("{\"id\":7}");
    MySql::finish(&mut held, &table, Some(&claim), Some(&response))
        .await
        .unwrap();
    held.release();
    let replay = MySql::claim(&pool, Acquire::default(), &table, &claim)
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
    drop((first, second));
    drop_table(&pool, &table).await;
}

/// The warnings logged on the test's thread while it runs, for it to read.
#[derive(Clone, Default)]
struct Warnings(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Warnings {
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// A subscriber that keeps the fields of each `WARN` event as one line.
impl tracing::Subscriber for Warnings {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() != tracing::Level::WARN {
            return;
        }
        let mut line = String::new();
        event.record(
            &mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                line.push_str(&format!("{}={value:?} ", field.name()));
            },
        );
        self.0.lock().unwrap().push(line);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// Ends `held`'s transaction as a handler's DDL would, by committing it
/// implicitly (creating `table`).
async fn commit_implicitly(held: &mut OpenTx<MySql>, table: &str) {
    run(
        held,
        &format!("CREATE TABLE IF NOT EXISTS {table} (id INT) ENGINE = InnoDB"),
    )
    .await
    .unwrap();
    assert_eq!(
        in_transaction(held).await,
        0,
        "the DDL committed the transaction"
    );
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
    let log = Warnings::default();
    let _logging = tracing::subscriber::set_default(log.clone());
    let pool = test_pool(2).await;
    let table = key_table(&pool, "implicit").await;
    let claim = claim_of("acct", "k", 9, Duration::ZERO);
    let mut held = claimed(&pool, &table, &claim, "the claim").await;
    commit_implicitly(&mut held, "idem_implicit_commit").await;
    let response = created("{\"id\":1}");
    assert_eq!(log.lines(), Vec::<String>::new());
    MySql::finish(&mut held, &table, Some(&claim), Some(&response))
        .await
        .expect("the response is stored on the committed claim");
    held.release();
    let warnings = log.lines();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("committed its transaction implicitly"),
        "{warnings:?}"
    );

    replays(&pool, &table, &claim, &response).await;
    drop_table(&pool, &table).await;
}

/// In a session with `autocommit` off, the statement after a deadlock's
/// rollback opens a new transaction, so the finish's open-transaction
/// check passes: its `UPDATE` then misses the claim's row (rolled back),
/// and the finish reports the transaction ended instead of a success,
/// before its `COMMIT`: what the handler wrote after the error is rolled
/// back too. (A `ROLLBACK` leaves the session as InnoDB's deadlock rollback
/// does.)
#[tokio::test]
async fn without_autocommit_a_rolled_back_claim_is_not_a_success() {
    let table = key_table(&test_pool(1).await, "noautocommit").await;
    let effects = format!("idem_noautocommit_effects_{}", std::process::id());
    let pool = session_pool("SET SESSION autocommit = 0".to_owned()).await;
    run(
        &mut pool.acquire().await.unwrap(),
        &format!(
            "DROP TABLE IF EXISTS {effects}; \
             CREATE TABLE {effects} (note TEXT NOT NULL) ENGINE = InnoDB; COMMIT"
        ),
    )
    .await
    .unwrap();
    let claim = claim_of("acct", "k", 5, Duration::ZERO);
    let mut held = claimed(&pool, &table, &claim, "the claim").await;
    run(&mut held, "ROLLBACK").await.unwrap();
    // The handler goes on writing, in the transaction the session opened.
    run(
        &mut held,
        &format!("INSERT INTO {effects} VALUES ('after the error')"),
    )
    .await
    .unwrap();
    let response = created("{}");
    let finished = MySql::finish(&mut held, &table, Some(&claim), Some(&response)).await;
    assert!(
        matches!(finished, Err(FinishError::Ended(_))),
        "{finished:?}"
    );
    MySql::rollback(&mut held).await.unwrap();
    held.release();
    let other = test_pool(1).await;
    let count = async |table: &str| -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&other)
            .await
            .unwrap()
    };
    assert_eq!(count(&table).await, 0, "nothing was stored");
    assert_eq!(
        count(&effects).await,
        0,
        "the write after the error was committed"
    );
    drop_table(&other, &effects).await;
    drop_table(&other, &table).await;
}

/// A session's settings cannot defeat the claim's check: with a
/// `sql_select_limit` of 1 or 0 (the read of a finished key's row has its
/// own `LIMIT`), or an `sql_mode` without strictness (where many errors
/// are warnings; the check's overflow stays an error),
/// a fresh key is still claimed and a finished one still replayed, never
/// claimed again.
#[tokio::test]
async fn a_sessions_settings_cannot_defeat_the_claim() {
    let table = key_table(&test_pool(1).await, "sessionsettings").await;
    for (fill, setting) in [
        "sql_select_limit = 1",
        "sql_select_limit = 0",
        "sql_mode = 'NO_UNSIGNED_SUBTRACTION'",
    ]
    .into_iter()
    .enumerate()
    {
        let pool = session_pool(format!("SET SESSION {setting}")).await;
        let key = format!("k{fill}");
        let claim = claim_of("acct", &key, 6, Duration::ZERO);
        let mut held = claimed(&pool, &table, &claim, setting).await;
        let response = created("{\"id\":1}");
        MySql::finish(&mut held, &table, Some(&claim), Some(&response))
            .await
            .unwrap_or_else(|error| panic!("{setting}: {error}"));
        held.release();
        match MySql::claim(&pool, Acquire::default(), &table, &claim)
            .await
            .unwrap()
        {
            ClaimOutcome::Finished {
                response: stored, ..
            } => assert_eq!(stored, response, "{setting}"),
            other => panic!("{setting}: a finished key must replay: {other:?}"),
        }
    }
    drop_table(&test_pool(1).await, &table).await;
}

/// With `autocommit` off, neither the sweeper nor a replay's read leaves a
/// transaction open on the connection it hands back to the pool: the
/// sweep's deletes are committed (another session sees them, and their
/// locks are gone), and the read's snapshot ends with it.
#[tokio::test]
async fn without_autocommit_sweeps_and_reads_leave_no_transaction_open() {
    let other = test_pool(1).await;
    let table = key_table(&other, "noautocommit_sweep").await;
    let pool = session_pool("SET SESSION autocommit = 0".to_owned()).await;
    let live = claim_of("acct", "k", 9, Duration::ZERO);
    run(
        &mut pool.acquire().await.unwrap(),
        &format!(
            "INSERT INTO {table} (scope, `key`, fingerprint, status, created_at, expires_at) \
             VALUES \
             ('acct', 'old', X'00', 201, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 1 SECOND), \
             ('acct', 'k', X'{fingerprint}', 201, UTC_TIMESTAMP(6), \
              UTC_TIMESTAMP(6) + INTERVAL 1 HOUR); COMMIT",
            fingerprint = "09".repeat(32),
        ),
    )
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

    let left: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT CAST(`key` AS CHAR) FROM {table} ORDER BY `key`"
    )))
    .fetch_all(&other)
    .await
    .unwrap();
    assert_eq!(left, ["k"], "the sweep's delete was not committed");
    let (mut a, mut b) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    for conn in [&mut a, &mut b] {
        assert_eq!(
            in_transaction(conn).await,
            0,
            "a pooled connection came back inside a transaction"
        );
    }
    drop((a, b));
    drop_table(&other, &table).await;
}

/// A claim that waits less than a second for another process's attempt
/// (MariaDB's `max_statement_time`: error 1969, SQLSTATE 70100, on a live
/// session) answers 409 and hands its connection back to the pool, reset,
/// in either way of acquiring: it is not taken for a connection that was
/// gone and closed.
#[tokio::test]
async fn a_claim_that_waited_keeps_its_connection() {
    let mut holder = test_pool(1).await.acquire().await.unwrap();
    let table = key_table(&test_pool(1).await, "waited").await;
    let pool = connect(
        MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    let set = format!("SET SESSION innodb_lock_wait_timeout = {SESSION_LOCK_WAIT}");
                    sqlx::Executor::execute(conn, AssertSqlSafe(set)).await?;
                    Ok(())
                })
            }),
    )
    .await;
    // Another process's attempt in flight: its uncommitted claim row.
    run(
        &mut holder,
        &format!(
            "START TRANSACTION; INSERT INTO {table} (scope, `key`, fingerprint, created_at, \
             expires_at) VALUES ('acct', 'k', X'{}', UTC_TIMESTAMP(6), \
             UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
            "07".repeat(32),
        ),
    )
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
        let claim = claim_of("acct", "k", 7, Duration::from_millis(100));
        let outcome = MySql::claim(&pool, acquire, &table, &claim).await.unwrap();
        assert!(matches!(outcome, ClaimOutcome::InUse { .. }), "{outcome:?}");
        let (after, lock_wait) = session().await;
        assert_eq!(
            after, before,
            "{acquire:?}: the claim's connection was closed"
        );
        assert_eq!(lock_wait, SESSION_LOCK_WAIT, "{acquire:?}: not reset");
    }
    run(&mut holder, "ROLLBACK").await.unwrap();
    drop(holder);
    drop_table(&pool, &table).await;
}

/// The statements a new key costs the server on `pool` (one connection,
/// not pinged), counted by the session's `Questions`.
async fn new_key_statements(pool: &Pool<MySql>, table: &str) -> u64 {
    async fn questions(pool: &Pool<MySql>) -> u64 {
        // A text-protocol statement: one question, no statement prepared.
        let row = sqlx::raw_sql("SHOW SESSION STATUS LIKE 'Questions'")
            .fetch_one(pool)
            .await
            .unwrap();
        row.get::<String, _>(1).parse().unwrap()
    }
    // The server's kind is asked once per process, outside the count.
    let server = server_of(pool);
    if is_mariadb(&server).is_none() {
        ask(&mut pool.acquire().await.unwrap(), &server)
            .await
            .unwrap();
    }
    let claim = claim_of("acct", "k", 8, Duration::ZERO);
    let before = questions(pool).await;
    let mut held = claimed(pool, table, &claim, "the claim").await;
    MySql::finish(&mut held, table, Some(&claim), Some(&created("{}")))
        .await
        .unwrap();
    held.release();
    // The second `SHOW` counts itself.
    questions(pool).await - before - 1
}

/// A pool of one connection, not pinged.
async fn unpinged(options: MySqlConnectOptions) -> Pool<MySql> {
    MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap()
}

async fn pool_of(options: MySqlConnectOptions) -> Pool<MySql> {
    MySqlPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap()
}

fn test_options() -> MySqlConnectOptions {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
        .parse()
        .unwrap()
}

/// The statements a new key costs the server, as docs/engines.md counts
/// them. On MariaDB 7: the claim's batch 3 (set the session's idle bound,
/// `START TRANSACTION`, the upsert under `SET STATEMENT`'s lock wait), the
/// finish's 3 (the response's `UPDATE`, which checks the transaction is
/// open, its row count's check, which restores the idle bound, and `COMMIT
/// AND CHAIN`, which opens the empty transaction sqlx counts) and sqlx's
/// `ROLLBACK` of that transaction. On MySQL 10: the claim also restores its
/// lock wait, and the finish checks the transaction with a savepoint and
/// its release.
#[tokio::test]
async fn a_new_key_costs_seven_statements_on_mariadb() {
    let table = key_table(&test_pool(1).await, "statements").await;
    let pool = unpinged(test_options()).await;
    let statements = new_key_statements(&pool, &table).await;
    let mariadb = is_mariadb(&server_of(&pool)).unwrap();
    assert_eq!(
        statements,
        if mariadb { 7 } else { 10 },
        "statements of a claim, its finish and sqlx's rollback"
    );
    drop_table(&pool, &table).await;
}

/// MySQL's batches, run on this server (MariaDB runs them too) through a
/// database of their own, taken for MySQL: ten statements a new key, a
/// held key in use and then taken over, and a finish after an implicit
/// commit found by its savepoint.
#[tokio::test]
async fn mysqls_batches_hold_as_well() {
    let database = "idem_mysql_batches";
    run(
        &mut pool_of(test_options()).await.acquire().await.unwrap(),
        &format!("CREATE DATABASE IF NOT EXISTS {database}"),
    )
    .await
    .unwrap();
    let options = test_options().database(database);
    let pool = pool_of(options.clone()).await;
    assume_mysql(&pool);
    let table = key_table(&pool, "mysql_batches").await;

    let counted = unpinged(options).await;
    assume_mysql(&counted);
    assert_eq!(new_key_statements(&counted, &table).await, 10);
    counted.close().await;

    let claim = claim_of("acct", "held", 3, Duration::ZERO);
    let held = claimed(&pool, &table, &claim, "the first claim").await;
    match MySql::claim(&pool, Acquire::default(), &table, &claim)
        .await
        .unwrap()
    {
        ClaimOutcome::InUse { .. } => {}
        other => panic!("a held key is in use: {other:?}"),
    }
    crate::backend::abandon(held).await;
    let mut held = claimed(&pool, &table, &claim, "the claim after a rollback").await;
    commit_implicitly(&mut held, "idem_mysql_batches_commit").await;
    let response = created("{\"id\":2}");
    MySql::finish(&mut held, &table, Some(&claim), Some(&response))
        .await
        .expect("the response is stored on the committed claim");
    held.release();
    replays(&pool, &table, &claim, &response).await;
    drop_table(&pool, &table).await;
}
