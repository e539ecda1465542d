//! SQLite's claim, finish and read against an in-memory database.

use std::time::Duration;

use http::StatusCode;
use sqlx::sqlite::SqlitePoolOptions;

use super::*;

/// A one-connection in-memory database with a migrated key table.
async fn key_table() -> Pool<Sqlite> {
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

fn created() -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: "{\"id\":1}".into(),
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
