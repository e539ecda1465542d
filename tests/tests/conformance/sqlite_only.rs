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
