//! The same service on SQLite (a WAL file), the embedded engine: its pool
//! and its tables. Its handlers are PostgreSQL's, with the same SQL, stamped
//! out for it in `handlers`; writers are serialized by SQLite, so there
//! every write transaction starts with `BEGIN IMMEDIATE`, as the runtime's
//! claim does (a deferred `BEGIN` would fail with `SQLITE_BUSY` under load).

use idem::Idem;
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

use crate::app::KEYS_TABLE;

pub async fn connect(path: &str, size: u32) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .connect_with(options)
        .await
        .unwrap_or_else(|error| panic!("cannot open the SQLite database {path}: {error}"))
}

/// A new database file with the tables.
pub async fn setup(path: &str) -> Result<(), Box<dyn std::error::Error>> {
    // In a fresh checkout the directory (next to the JSON) is not there yet.
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{path}{suffix}"));
    }
    let pool = connect(path, 1).await;
    Idem::new(pool.clone()).table(KEYS_TABLE)?.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE bench_charges (
            id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL,
            amount INTEGER NOT NULL, currency TEXT NOT NULL);
         CREATE TABLE bench_accounts (
            account TEXT PRIMARY KEY, balance INTEGER NOT NULL DEFAULT 0,
            charges INTEGER NOT NULL DEFAULT 0);
         CREATE TABLE bench_ledger (
            id INTEGER PRIMARY KEY AUTOINCREMENT, charge_id INTEGER NOT NULL,
            account TEXT NOT NULL, amount INTEGER NOT NULL);
         CREATE TABLE bench_two_phase_keys (
            scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
            status INTEGER, body BLOB, expires_at INTEGER NOT NULL,
            PRIMARY KEY (scope, key));
         CREATE TABLE bench_payments (
            id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL,
            amount INTEGER NOT NULL, currency TEXT NOT NULL, status TEXT NOT NULL,
            provider_id TEXT);
         WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n < 255)
         INSERT INTO bench_accounts (account) SELECT 'c' || n FROM i;",
    )
    .execute(&pool)
    .await?;
    pool.close().await;
    Ok(())
}
