//! SQLite: a real database file in WAL mode, shared by every test of a run
//! and by the kill test's child process (`IDEM_TEST_SQLITE_FILE`, default
//! under cargo's per-target temp dir). Tests that need a database of their
//! own open one with [`open`]; each phased test has a file of its own
//! (`PhasedDb::fresh_database`), which its child processes share.

use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Pool, Sqlite};
use tokio::sync::OnceCell;

use crate::phased::{Dialect, PhasedDb, PhasedState};
use crate::service::{self as app, AppState, TestDb};

crate::define_app!(sqlx::Sqlite);
crate::phased_app!(sqlx::Sqlite);

/// The effects table.
const EFFECTS_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_service_effects (
        id INTEGER PRIMARY KEY AUTOINCREMENT, scope BLOB NOT NULL, \"key\" TEXT NOT NULL,
        note TEXT NOT NULL, nonce TEXT NOT NULL);
    CREATE INDEX IF NOT EXISTS idem_service_effects_scope ON idem_service_effects (scope);";

static READY: OnceCell<()> = OnceCell::const_new();

/// How long a claim waits for the write lock in the shared test database:
/// every test of the run writes to it, on two cores, next to two other
/// engines' tests. (The SQLite-specific tests use sqlx's default, 5 s.)
const SHARED_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

fn shared_file() -> String {
    let default = target_tmp().join("idem-conformance.sqlite3");
    app::env_or("IDEM_TEST_SQLITE_FILE", &default.to_string_lossy())
}

/// Cargo's scratch directory for tests, `<target>/tmp`, found from the
/// test executable (`<target>/<profile>/deps/<test>`): `CARGO_TARGET_TMPDIR`
/// is set for integration tests only, not for this library.
pub fn target_tmp() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the test executable lies in <target>/<profile>/deps");
    let tmp = target.join("tmp");
    std::fs::create_dir_all(&tmp).expect("create <target>/tmp");
    tmp
}

/// A pool on a database of one test, with the key and effects tables.
pub async fn open(options: SqliteConnectOptions) -> Pool<Sqlite> {
    let pool = pool(options).await;
    app::prepare(&pool, EFFECTS_DDL).await;
    pool
}

async fn pool(options: SqliteConnectOptions) -> Pool<Sqlite> {
    pool_of(options, 16).await
}

/// A pool of `size` connections (at least one kept open); panics loudly
/// when the database cannot be opened.
pub async fn pool_of(options: SqliteConnectOptions, size: u32) -> Pool<Sqlite> {
    let name = options.get_filename().display().to_string();
    SqlitePoolOptions::new()
        .max_connections(size)
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

impl TestDb for Sqlite {
    const ENGINE: &'static str = "sqlite";
    const SERIAL_WRITES: bool = true;
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_service_effects (scope, \"key\", note, nonce) VALUES ($1, $2, $3, $4) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_service_effects SET note = note WHERE id = $1";

    crate::test_db_queries!("$1");

    async fn claim_waiters(_: &Pool<Self>, _: &str, _: &str) -> Option<i64> {
        // A duplicate of a key in flight waits in-process (the store's single
        // flight), without touching the database: nothing to see there.
        None
    }

    async fn lock_waiters(_: &mut sqlx::SqliteConnection) -> Option<i64> {
        // The one write lock is waited for in each connection's busy
        // handler; no connection can see another's wait.
        None
    }

    async fn in_transaction(conn: &mut sqlx::SqliteConnection) -> bool {
        // SQLite refuses a `BEGIN` inside a transaction; outside one, the
        // (deferred, lock-free) transaction it opens is rolled back at once.
        match sqlx::raw_sql("BEGIN").execute(&mut *conn).await {
            Ok(_) => {
                sqlx::raw_sql("ROLLBACK").execute(conn).await.unwrap();
                false
            }
            Err(sqlx::Error::Database(error))
                if error.message().contains("within a transaction") =>
            {
                true
            }
            Err(error) => panic!("BEGIN: {error}"),
        }
    }

    async fn end_by_error(conn: &mut sqlx::SqliteConnection, id: i64) -> sqlx::Error {
        // The conflict algorithm `ROLLBACK` ends the whole transaction.
        sqlx::query(
            "INSERT OR ROLLBACK INTO idem_service_effects (id, scope, \"key\", note, nonce) \
             SELECT id, scope, \"key\", note, nonce FROM idem_service_effects WHERE id = $1",
        )
        .bind(id)
        .execute(conn)
        .await
        .expect_err("the effect's id is taken")
    }

    async fn connect() -> Pool<Self> {
        let pool = pool(file_options(shared_file()).busy_timeout(SHARED_BUSY_TIMEOUT)).await;
        app::prepare_once(&READY, &pool, EFFECTS_DDL).await;
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
        handlers::router(state)
    }

    async fn commit_losing_pool() -> Pool<Self> {
        // A database of its own in rollback-journal mode, where a commit
        // waits for every reader to finish (WAL's cannot be made to fail).
        let path = target_tmp().join(format!("{}.sqlite3", app::unique("lost-commit")));
        let options = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Delete)
            .busy_timeout(Duration::from_millis(200));
        open(options).await
    }

    async fn lose_commit(pool: &Pool<Self>, _: Option<i64>) -> Box<dyn std::any::Any + Send> {
        // No session to end: a reader's lock, taken while the handler holds
        // the write lock, keeps its `COMMIT` from the exclusive lock it
        // needs, until the busy timeout ends the wait with SQLITE_BUSY.
        use sqlx::Connection;
        let mut reader = sqlx::SqliteConnection::connect_with(&pool.connect_options())
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN; SELECT count(*) FROM idem_keys")
            .execute(&mut reader)
            .await
            .unwrap();
        Box::new(reader)
    }
}

impl PhasedDb for Sqlite {
    const DIALECT: Dialect = Dialect {
        params: ["$1", "$2", "$3"],
        key: "\"key\"",
        bigint: "INTEGER",
        payment_id: "id INTEGER PRIMARY KEY AUTOINCREMENT",
    };

    fn fresh_database() -> String {
        let file = format!("{}.sqlite3", app::unique("phased"));
        target_tmp().join(file).display().to_string()
    }

    async fn open(database: &str, size: u32) -> Pool<Self> {
        pool_of(file_options(database), size).await
    }

    fn remove_database(database: &str) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{database}{suffix}"));
        }
    }

    fn phased_router(state: PhasedState<Self>) -> axum::Router {
        phased_handlers::router(state)
    }

    crate::phased_queries!();
}
