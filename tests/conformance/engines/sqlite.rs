//! SQLite: a real database file in WAL mode, shared by every test of a run
//! and by the kill test's child process (`IDEM_TEST_SQLITE_FILE`, default
//! under cargo's per-target temp dir). Tests that need a database of their
//! own open one with [`open`].

use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Pool, Sqlite};
use tokio::sync::OnceCell;

use super::env_or;
use crate::app::{AppState, TestDb};

pub mod sqlite_app {
    crate::define_app!(sqlx::Sqlite);
}

static SQLITE_READY: OnceCell<()> = OnceCell::const_new();

/// How long a claim waits for the write lock in the shared test database:
/// every test of the run writes to it, on two cores, next to two other
/// engines' tests. (The SQLite-specific tests use sqlx's default, 5 s.)
const SHARED_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

fn shared_file() -> String {
    let default =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("idem-conformance.sqlite3");
    env_or("IDEM_TEST_SQLITE_FILE", &default.to_string_lossy())
}

/// A pool on a database of one test, with the key and effects tables.
pub async fn open(options: SqliteConnectOptions) -> Pool<Sqlite> {
    let pool = pool(options).await;
    prepare(&pool).await;
    pool
}

async fn pool(options: SqliteConnectOptions) -> Pool<Sqlite> {
    let name = options.get_filename().display().to_string();
    SqlitePoolOptions::new()
        .max_connections(16)
        // An in-memory database lives as long as one connection to it.
        .min_connections(1)
        .connect_with(options.create_if_missing(true))
        .await
        .unwrap_or_else(|error| panic!("cannot open the SQLite test database {name}: {error}"))
}

/// WAL mode, as the crate's documentation recommends.
pub fn file_options(path: impl AsRef<std::path::Path>) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .journal_mode(SqliteJournalMode::Wal)
}

async fn prepare(pool: &Pool<Sqlite>) {
    idem::Idem::new(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS idem_test_effects (
            id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, \"key\" TEXT NOT NULL,
            note TEXT NOT NULL, nonce TEXT NOT NULL);
         CREATE INDEX IF NOT EXISTS idem_test_effects_scope ON idem_test_effects (scope);",
    )
    .execute(pool)
    .await
    .expect("create effects table");
}

impl TestDb for Sqlite {
    const ENGINE: &'static str = "sqlite";
    const SERIAL_WRITES: bool = true;
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_test_effects (scope, \"key\", note, nonce) VALUES ($1, $2, $3, $4) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_test_effects SET note = note WHERE id = $1";

    crate::test_db_queries!("$1");

    async fn connect() -> Pool<Self> {
        let pool = pool(file_options(shared_file()).busy_timeout(SHARED_BUSY_TIMEOUT)).await;
        SQLITE_READY.get_or_init(|| prepare(&pool)).await;
        pool
    }

    fn unreachable_pool() -> Pool<Self> {
        // A file in a directory that does not exist cannot be opened.
        let options = SqliteConnectOptions::new().filename("/nonexistent-idem-dir/keys.sqlite3");
        SqlitePoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(options)
    }

    fn router(state: AppState<Self>) -> axum::Router {
        sqlite_app::handlers::router(state)
    }
}
