//! SQLite-only checks: the write lock under load on a database file of its
//! own, and a shared-cache in-memory database.

use futures::future::join_all;
use reqwest::StatusCode;
use sqlx::sqlite::SqliteConnectOptions;

use crate::engines::sqlite::{file_options, open};
use crate::harness::{Answer, send, start_with, unique};

const BODY: &str = r#"{"note":"charge 1250 eur"}"#;

/// A database file of one test, removed (with its WAL) when dropped.
struct TempDatabase(std::path::PathBuf);

impl TempDatabase {
    fn new(name: &str) -> Self {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
        Self(dir.join(format!("{}.sqlite3", unique(name))))
    }
}

impl Drop for TempDatabase {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

fn assert_no_server_error(answers: &[Answer]) {
    for answer in answers {
        assert!(
            !answer.status.is_server_error(),
            "no request may fail on the write lock: {answer:?}"
        );
        assert!(
            !String::from_utf8_lossy(&answer.body).contains("locked"),
            "{answer:?}"
        );
    }
}

/// 32 concurrent duplicates of one key, racing 32 requests with keys of
/// their own, on a fresh file with sqlx's default busy timeout: one effect
/// for the duplicated key, one per other key, and no "database is locked".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_database_32_duplicates_make_one_effect_and_no_5xx() {
    let file = TempDatabase::new("duplicates");
    let server = start_with(open(file_options(&file.0)).await).await;
    let (caller, others) = (unique("dup"), unique("others"));
    let client = server.client(&caller);
    let other_client = server.client(&others);
    let duplicates = join_all((0..32).map(|_| send(client.post("/effects", "same", BODY))));
    let distinct =
        join_all((0..32).map(|i| send(other_client.post("/effects", &format!("k{i}"), BODY))));
    let (duplicates, distinct) = tokio::join!(duplicates, distinct);

    assert_no_server_error(&duplicates);
    assert_no_server_error(&distinct);
    let originals = duplicates
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
        .count();
    assert_eq!(originals, 1, "exactly one duplicate runs the handler");
    for answer in &duplicates {
        match answer.status {
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert_eq!(answer.problem_code(), "idempotency_key_in_use"),
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert!(
        distinct
            .iter()
            .all(|a| a.status == StatusCode::CREATED && !a.replayed()),
        "other keys wait for the write lock, they are never refused: {distinct:?}"
    );
    assert_eq!(server.effects(&caller).await, 1);
    assert_eq!(server.effects(&others).await, 32);

    let retries = join_all((0..32).map(|_| send(client.post("/effects", "same", BODY)))).await;
    let original = duplicates
        .iter()
        .find(|a| a.status == StatusCode::CREATED && !a.replayed());
    for retry in &retries {
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, original.unwrap().body);
    }
    assert_eq!(server.effects(&caller).await, 1);
}

/// A shared-cache in-memory database keeps the same contract: replay, 409
/// for a duplicate in flight, one effect under 32 concurrent duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_memory_database_keeps_the_contract() {
    let name = unique("idem-memory");
    let url = format!("sqlite:file:{name}?mode=memory&cache=shared");
    let options: SqliteConnectOptions = url.parse().unwrap();
    let server = start_with(open(options).await).await;
    let caller = unique("memory");
    let client = server.client(&caller);

    let first = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(client.post("/effects", "k", BODY)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);

    let (hold, held) = server
        .send_held(client.post("/effects", "held", BODY), &caller)
        .await;
    let duplicate = send(client.post("/effects", "held", BODY)).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(duplicate.problem_code(), "idempotency_key_in_use");
    hold.release.notify_one();
    assert_eq!(held.await.unwrap().status, StatusCode::CREATED);

    let answers = join_all((0..32).map(|_| send(client.post("/effects", "race", BODY)))).await;
    assert_no_server_error(&answers);
    let originals = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
        .count();
    assert_eq!(originals, 1);
    assert_eq!(
        server.effects(&caller).await,
        3,
        "k, held and race once each"
    );
    assert_eq!(server.keys(&caller).await, 3);
}

/// A claim that cannot get SQLite's write lock within the pool's
/// `busy_timeout` answers 503 with `Retry-After`, never 409 (it cannot tell
/// whose key holds the lock), and leaves nothing behind: once the lock is
/// free, the same key runs as a first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_write_lock_is_503_never_409() {
    use sqlx::Connection;

    let file = TempDatabase::new("busy");
    let options = file_options(&file.0).busy_timeout(std::time::Duration::from_millis(200));
    let server = start_with(open(options.clone()).await).await;
    let caller = unique("busy");
    let client = server.client(&caller);

    // Another process's writer, as far as this pool can tell.
    let mut writer = sqlx::SqliteConnection::connect_with(&options)
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut writer)
        .await
        .unwrap();
    let busy = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert_eq!(busy.problem_code(), "idempotency_store_unavailable");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut writer)
        .await
        .unwrap();

    assert_eq!(server.effects(&caller).await, 0);
    assert_eq!(server.keys(&caller).await, 0);
    let first = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(server.effects(&caller).await, 1);
}

/// A deferred foreign key the handler's writes broke fails SQLite's
/// `COMMIT`: the handler's doing (a retry fails alike), so the finish says
/// the transaction ended (500) rather than blaming the store, and nothing
/// commits, neither the claim nor the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_foreign_key_broken_at_commit_ends_the_transaction() {
    use idem::__private::FinishError;
    use idem::Backend;
    use sqlx::Sqlite;

    let file = TempDatabase::new("deferred");
    let pool = open(file_options(&file.0)).await;
    sqlx::raw_sql(
        "CREATE TABLE parents (id INTEGER PRIMARY KEY);
         CREATE TABLE children (parent INTEGER REFERENCES parents (id)
             DEFERRABLE INITIALLY DEFERRED);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let claim = idem_tests::store::claim("s", 4, std::time::Duration::ZERO);
    let mut conn = idem_tests::store::claimed(&pool, &claim, "the claim").await;
    sqlx::raw_sql("INSERT INTO children VALUES (7)")
        .execute(&mut **conn)
        .await
        .expect("a deferred check waits for the commit");
    let response = idem_tests::store::created("{}");
    let finished = Sqlite::finish(&mut conn, "idem_keys", Some(&claim), Some(&response)).await;
    assert!(
        matches!(finished, Err(FinishError::Ended(_))),
        "{finished:?}"
    );
    Sqlite::rollback(&mut conn).await.unwrap();
    conn.release();
    let counts: (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM idem_keys), (SELECT count(*) FROM children)")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(counts, (0, 0), "nothing committed");
}

/// A handler that ends the request's transaction itself (a raw `COMMIT`
/// through its `Tx`, a misuse) has committed the claim and its effects:
/// the finish stores the response on that row in autocommit and reports
/// success, so the key replays; the connection, whose sqlx count is now
/// wrong, is closed rather than pooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_own_commit_still_stores_the_response() {
    use idem::__private::{Acquire, ClaimOutcome, StoredResponse};
    use idem::Backend;
    use sqlx::Sqlite;

    let file = TempDatabase::new("owncommit");
    let pool = open(file_options(&file.0)).await;
    let claim = idem_tests::store::claim("s", 8, std::time::Duration::ZERO);
    let mut conn = idem_tests::store::claimed(&pool, &claim, "the claim").await;
    sqlx::raw_sql("COMMIT").execute(&mut **conn).await.unwrap();
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: "{\"id\":1}".into(),
    };
    Sqlite::finish(&mut conn, "idem_keys", Some(&claim), Some(&response))
        .await
        .expect("the response is stored on the committed claim");
    conn.release();
    // Whatever the pool holds now, none of it is counted inside a
    // transaction (the finished connection, so counted, was not pooled).
    let mut held = Vec::new();
    for _ in 0..pool.size() {
        let pooled = pool.acquire().await.unwrap();
        assert!(
            !sqlx::Connection::is_in_transaction(&*pooled),
            "a connection came back counted inside a transaction"
        );
        held.push(pooled);
    }
    drop(held);
    match Sqlite::claim(&pool, Acquire::default(), "idem_keys", &claim)
        .await
        .unwrap()
    {
        ClaimOutcome::Finished {
            response: stored, ..
        } => assert_eq!(stored, response),
        other => panic!("the key must replay: {other:?}"),
    }
}

/// Two private in-memory databases (`SqliteConnectOptions::new()`, both
/// named `:memory:`) are two databases: a claim held on one does not make
/// the same scope and key in use on the other (found by review: they
/// shared their in-process slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_memory_databases_do_not_share_keys() {
    use idem::__private::{Acquire, ClaimOutcome};
    use idem::Backend;
    use sqlx::sqlite::SqlitePoolOptions;

    let mut pools = Vec::new();
    for _ in 0..2 {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(SqliteConnectOptions::new())
            .await
            .expect("an in-memory database");
        idem::Idem::new(pool.clone())
            .migrate()
            .await
            .expect("migrate");
        pools.push(pool);
    }
    let claim = idem_tests::store::claim("acct", 7, std::time::Duration::ZERO);
    let table = idem::DEFAULT_TABLE;
    let ClaimOutcome::Claimed(_held) =
        sqlx::Sqlite::claim(&pools[0], Acquire::default(), table, &claim)
            .await
            .unwrap()
    else {
        panic!("the first database's claim");
    };
    let other = sqlx::Sqlite::claim(&pools[1], Acquire::default(), table, &claim)
        .await
        .unwrap();
    assert!(
        matches!(other, ClaimOutcome::Claimed(_)),
        "the other database's key is free: {other:?}"
    );
}
