//! SQLite's claim, finish and read against an in-memory database.

use std::time::Duration;

use http::StatusCode;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{Pool, Sqlite};

use super::*;
use crate::backend::store::Store;
use crate::backend::{Acquire, ClaimOutcome, FinishError};
use crate::response::EncodedResponse;

/// A one-connection in-memory database with a migrated key table.
pub(crate) async fn key_table() -> Pool<Sqlite> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .expect("in-memory SQLite");
    Sqlite::migrate(&pool, "keys").await.expect("migrate");
    pool
}

fn claim(fingerprint: u8) -> Claim<'static> {
    crate::backend::test_support::claim_of("acct", "k", fingerprint, Duration::ZERO)
}

fn created() -> EncodedResponse {
    EncodedResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: "{\"id\":1}".into(),
        tombstone: None,
    }
}

/// A claimed and finished key is found finished, with its fingerprint and
/// response, by the next claim and by the plain read.
#[tokio::test]
async fn a_finished_key_is_read_back_by_claim_and_peek() {
    let pool = key_table().await;
    let first = claim(1);
    let ClaimOutcome::Claimed(mut conn) = Sqlite::claim(&pool, Acquire::default(), "keys", &first)
        .await
        .expect("claim")
    else {
        panic!("a new key was not claimed");
    };
    Sqlite::finish(&mut conn, "keys", Some(&first), Some(&created()))
        .await
        .expect("finish");
    conn.release();

    for outcome in [
        Sqlite::claim(&pool, Acquire::default(), "keys", &claim(2))
            .await
            .expect("claim"),
        Sqlite::peek(&pool, Acquire::default(), "keys", &claim(2))
            .await
            .expect("peek")
            .expect("a finished row"),
    ] {
        match outcome {
            ClaimOutcome::Finished {
                fingerprint,
                response,
            } => {
                assert_eq!(fingerprint, first.fingerprint);
                assert_eq!(response.status, StatusCode::CREATED);
                assert_eq!(&response.body[..], b"{\"id\":1}");
            }
            other => panic!("the finished key was not read back: {other:?}"),
        }
    }
}

/// An expired row, finished or not, is taken over by the next claim, which
/// stores its own response on it.
#[tokio::test]
async fn an_expired_key_is_taken_over() {
    let pool = key_table().await;
    sqlx::query(
        "INSERT INTO keys (scope, \"key\", fingerprint, status, created_at, expires_at) \
         VALUES (?1, ?2, ?3, 201, 0, 1)",
    )
    .bind(&b"acct"[..])
    .bind(&b"k"[..])
    .bind(&[9_u8; 32][..])
    .execute(&pool)
    .await
    .unwrap();
    let ClaimOutcome::Claimed(mut conn) =
        Sqlite::claim(&pool, Acquire::default(), "keys", &claim(1))
            .await
            .expect("claim")
    else {
        panic!("the expired key was not taken over");
    };
    Sqlite::finish(&mut conn, "keys", Some(&claim(1)), Some(&created()))
        .await
        .expect("finish");
    conn.release();
    let stored: Vec<Vec<u8>> = sqlx::query_scalar("SELECT fingerprint FROM keys")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(stored, [[1_u8; 32]], "one row, the new claim's");
}

/// The phased mode's storage contract (`test_support::lease_contract`).
#[tokio::test]
async fn the_lease_contract_holds() {
    let pool = key_table().await;
    crate::backend::test_support::lease_contract(&pool, "keys").await;
}

/// A key table from before the phased mode gets its columns on migrate,
/// and keeps its rows.
#[tokio::test]
async fn a_table_from_before_phases_is_migrated() {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE old_keys (scope BLOB NOT NULL, \"key\" BLOB NOT NULL, \
         fingerprint BLOB NOT NULL, status INTEGER, headers BLOB, body BLOB, \
         created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, PRIMARY KEY (scope, \"key\")); \
         INSERT INTO old_keys VALUES (x'61', x'6b', x'00', 201, NULL, NULL, 0, 9e15)",
    )
    .execute(&pool)
    .await
    .unwrap();
    Sqlite::migrate(&pool, "old_keys").await.expect("migrate");
    Sqlite::migrate(&pool, "old_keys")
        .await
        .expect("migrate again");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM old_keys WHERE lease_token IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    crate::backend::test_support::lease_contract(&pool, "old_keys").await;
}

/// The operators' key operations (`test_support::admin_contract`).
#[tokio::test]
async fn the_admin_contract_holds() {
    let pool = key_table().await;
    crate::backend::test_support::admin_contract(&pool, "keys").await;
}

/// The outbox's and consumers' storage contract
/// (`test_support::outbox_contract`).
#[tokio::test]
async fn the_outbox_contract_holds() {
    // A file, not memory: two deliveries at once need two connections.
    let path = std::env::temp_dir().join(format!("idem_outbox_{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal),
        )
        .await
        .expect("SQLite file");
    crate::backend::test_support::outbox_contract(&pool, "outbox", "consumed").await;
    pool.close().await;
    let _ = std::fs::remove_file(&path);
}

/// A database file of one test, with its own pool of `size` connections
/// (WAL): removed, with its WAL, when dropped.
struct FileDatabase {
    path: std::path::PathBuf,
    pool: Pool<Sqlite>,
}

impl FileDatabase {
    /// A fresh file named after `name` and this process, its key table
    /// `idem_keys` migrated.
    async fn new(name: &str, size: u32) -> Self {
        let path = std::env::temp_dir().join(format!("idem_{name}_{}.db", std::process::id()));
        let database = Self {
            pool: SqlitePoolOptions::new()
                .max_connections(size)
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(&path)
                        .create_if_missing(true)
                        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal),
                )
                .await
                .expect("SQLite file"),
            path,
        };
        Sqlite::migrate(&database.pool, "idem_keys")
            .await
            .expect("migrate");
        database
    }
}

impl Drop for FileDatabase {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.path.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A deferred foreign key the handler's writes broke fails SQLite's
/// `COMMIT`: the handler's doing (a retry fails alike), so the finish says
/// the transaction ended (500) rather than blaming the store, and nothing
/// commits, neither the claim nor the write.
#[tokio::test]
async fn a_deferred_foreign_key_broken_at_commit_ends_the_transaction() {
    use crate::backend::test_support::{claim_of, claimed, created};

    let file = FileDatabase::new("deferred", 4).await;
    let pool = &file.pool;
    sqlx::raw_sql(
        "CREATE TABLE parents (id INTEGER PRIMARY KEY);
         CREATE TABLE children (parent INTEGER REFERENCES parents (id)
             DEFERRABLE INITIALLY DEFERRED);",
    )
    .execute(pool)
    .await
    .unwrap();
    let claim = claim_of("s", "k", 4, Duration::ZERO);
    let mut conn = claimed(pool, "idem_keys", &claim, "the claim").await;
    sqlx::raw_sql("INSERT INTO children VALUES (7)")
        .execute(&mut **conn)
        .await
        .expect("a deferred check waits for the commit");
    let response = created("{}");
    let finished = Sqlite::finish(&mut conn, "idem_keys", Some(&claim), Some(&response)).await;
    assert!(
        matches!(finished, Err(FinishError::Ended(_))),
        "{finished:?}"
    );
    Sqlite::rollback(&mut conn).await.unwrap();
    conn.release();
    let counts: (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM idem_keys), (SELECT count(*) FROM children)")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(counts, (0, 0), "nothing committed");
}

/// A handler that ends the request's transaction itself (a raw `COMMIT`
/// through its `Tx`, a misuse) has committed the claim and its effects:
/// the finish stores the response on that row in autocommit and reports
/// success, so the key replays; the connection, whose sqlx count is now
/// wrong, is closed rather than pooled.
#[tokio::test]
async fn a_handlers_own_commit_still_stores_the_response() {
    use crate::backend::test_support::{claim_of, claimed, created};

    let file = FileDatabase::new("owncommit", 4).await;
    let pool = &file.pool;
    let claim = claim_of("s", "k", 8, Duration::ZERO);
    let mut conn = claimed(pool, "idem_keys", &claim, "the claim").await;
    sqlx::raw_sql("COMMIT").execute(&mut **conn).await.unwrap();
    let response = created("{\"id\":1}");
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
    crate::backend::test_support::replays(pool, "idem_keys", &claim, &response).await;
}

/// Two private in-memory databases (`SqliteConnectOptions::new()`, both
/// named `:memory:`) are two databases: a claim held on one does not make
/// the same scope and key in use on the other (found by review: they
/// shared their in-process slot).
#[tokio::test]
async fn private_memory_databases_do_not_share_keys() {
    let mut pools = Vec::new();
    for _ in 0..2 {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(SqliteConnectOptions::new())
            .await
            .expect("an in-memory database");
        Sqlite::migrate(&pool, "keys").await.expect("migrate");
        pools.push(pool);
    }
    let claim = crate::backend::test_support::claim_of("acct", "k", 7, Duration::ZERO);
    let ClaimOutcome::Claimed(_held) = Sqlite::claim(&pools[0], Acquire::default(), "keys", &claim)
        .await
        .unwrap()
    else {
        panic!("the first database's claim");
    };
    let other = Sqlite::claim(&pools[1], Acquire::default(), "keys", &claim)
        .await
        .unwrap();
    assert!(
        matches!(other, ClaimOutcome::Claimed(_)),
        "the other database's key is free: {other:?}"
    );
}
