//! PostgreSQL, at `IDEM_TEST_POSTGRES_URL` (default the local server); the
//! hardening tests use it too.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Pool, Postgres};
use tokio::sync::OnceCell;

use crate::phased::{Dialect, PhasedDb, PhasedState};
use crate::service::{self as app, AppState, TestDb};

crate::define_app!(sqlx::Postgres);
crate::phased_app!(sqlx::Postgres);

const URL_VAR: &str = "IDEM_TEST_POSTGRES_URL";
const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The effects table. When it exists nothing runs: `CREATE INDEX` would
/// queue for its lock behind other tests' open transactions.
const EFFECTS_DDL: &str = "DO $$ BEGIN
    IF to_regclass('idem_service_effects_scope_key') IS NULL THEN
        CREATE TABLE IF NOT EXISTS idem_service_effects (
            id bigserial PRIMARY KEY, scope bytea NOT NULL, key text NOT NULL,
            note text NOT NULL, nonce text NOT NULL);
        CREATE INDEX IF NOT EXISTS idem_service_effects_scope_key
            ON idem_service_effects (scope, key);
    END IF;
END $$";

static READY: OnceCell<()> = OnceCell::const_new();

/// The size of a test service's pool: enough for the suite's concurrent
/// requests (duplicates of a key in flight wait holding none), small
/// enough that the conformance tests running at once stay within the
/// server's `max_connections` (see the harness's `TESTS_AT_ONCE`).
pub const SERVER_POOL: u32 = 10;

/// The test server's URL.
pub fn url() -> String {
    app::env_or(URL_VAR, DEFAULT_URL)
}

/// A pool of `size` connections on the real server, with the tables;
/// panics loudly when PostgreSQL is missing.
pub async fn pool(size: u32) -> PgPool {
    let options = PgPoolOptions::new().max_connections(size);
    let pool = app::server_pool(options, "PostgreSQL", URL_VAR, &url()).await;
    app::prepare_once(&READY, &pool, EFFECTS_DDL).await;
    pool
}

/// A pool of one connection whose session the server ends once it has
/// been idle for `idle` (`idle_session_timeout`), with the tables.
pub async fn pool_ending_idle_sessions(idle: std::time::Duration) -> PgPool {
    pool(1).await.close().await;
    let options: sqlx::postgres::PgConnectOptions = url().parse().unwrap();
    let timeout = idle.as_millis().to_string();
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([("idle_session_timeout", timeout.as_str())]))
        .await
        .unwrap()
}

/// A pool of `size` whose transactions are SERIALIZABLE (the session's
/// `default_transaction_isolation`), with the tables.
pub async fn serializable_pool(size: u32) -> PgPool {
    pool(1).await.close().await;
    let options: sqlx::postgres::PgConnectOptions = url().parse().unwrap();
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options.options([("default_transaction_isolation", "serializable")]))
        .await
        .unwrap()
}

impl TestDb for Postgres {
    const ENGINE: &'static str = "postgres";
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_service_effects (scope, key, note, nonce) VALUES ($1, $2, $3, $4) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_service_effects SET note = note WHERE id = $1";

    crate::test_db_queries!("$1");

    async fn claim_waiters(pool: &Pool<Self>, scope: &str, key: &str) -> Option<i64> {
        // A waiting claim shows as a backend waiting on a `Lock`; which
        // claim it is, only its statement says: the store inlines every
        // value as hex (`E'\\x..'`, simple query protocol), and this scope
        // is unique to one test. Were the values ever bound instead, no
        // statement would match: the caller's bounded poll then fails
        // loudly, it never passes by accident.
        let sql = format!(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock' \
             AND strpos(lower(query), '{}') > 0 AND strpos(lower(query), '{}') > 0",
            hex::encode(scope),
            hex::encode(key)
        );
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_one(pool)
            .await
            .unwrap();
        let count: i64 = sqlx::Row::get(&row, 0);
        Some(count)
    }

    async fn lock_waiters(holder: &mut sqlx::PgConnection) -> Option<i64> {
        // `pg_locks` and `pg_blocking_pids` read the lock manager live (unlike
        // `pg_stat_activity`, which a transaction snapshots), so polling
        // inside the holder's transaction sees each new waiter.
        let count = sqlx::query_scalar(
            "SELECT count(DISTINCT pid) FROM pg_locks \
             WHERE NOT granted AND pg_backend_pid() = ANY (pg_blocking_pids(pid))",
        )
        .persistent(app::persistent())
        .fetch_one(holder)
        .await
        .unwrap();
        Some(count)
    }

    async fn in_transaction(conn: &mut sqlx::PgConnection) -> bool {
        // Two statements share a transaction id exactly when one transaction
        // holds both; outside one, each runs (and commits) in its own. A
        // `BEGIN` would not tell: inside a transaction it only warns.
        let mut ids = Vec::new();
        for _ in 0..2 {
            match sqlx::query_scalar::<_, String>("SELECT pg_current_xact_id()::text")
                .persistent(app::persistent())
                .fetch_one(&mut *conn)
                .await
            {
                Ok(id) => ids.push(id),
                // A failed transaction is still open: it refuses statements.
                Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("25P02") => {
                    return true;
                }
                Err(error) => panic!("pg_current_xact_id: {error}"),
            }
        }
        ids[0] == ids[1]
    }

    async fn end_by_error(conn: &mut sqlx::PgConnection, id: i64) -> sqlx::Error {
        // A unique violation (the effect again, under its own id) fails the
        // transaction: PostgreSQL then answers `COMMIT` with a rollback.
        sqlx::query(
            "INSERT INTO idem_service_effects (id, scope, key, note, nonce) \
             SELECT id, scope, key, note, nonce FROM idem_service_effects WHERE id = $1",
        )
        .bind(id)
        .persistent(app::persistent())
        .execute(conn)
        .await
        .expect_err("the effect's id is taken")
    }

    async fn session_id(conn: &mut sqlx::PgConnection) -> Option<i64> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .persistent(app::persistent())
            .fetch_one(conn)
            .await
            .unwrap();
        Some(pid.into())
    }

    async fn end_session(admin: &Pool<Self>, id: i64) {
        // The backend sends its client `FATAL` (57P01) and exits; the
        // timeout makes the call wait for the exit.
        let sql = format!("SELECT pg_terminate_backend({id}, 10000)");
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_one(admin)
            .await
            .unwrap();
        let ended: bool = sqlx::Row::get(&row, 0);
        assert!(ended, "backend {id} did not end");
    }

    async fn session_open(admin: &Pool<Self>, id: i64) -> bool {
        let sql = format!("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = {id})");
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_one(admin)
            .await
            .unwrap();
        sqlx::Row::get(&row, 0)
    }

    async fn connect() -> Pool<Self> {
        pool(SERVER_POOL).await
    }

    fn unreachable_pool() -> Pool<Self> {
        app::unreachable(PgPoolOptions::new(), "postgres://postgres@127.0.0.1:1/test")
    }

    fn router(state: AppState<Self>) -> axum::Router {
        handlers::router(state)
    }
}

impl PhasedDb for Postgres {
    const DIALECT: Dialect = Dialect {
        params: ["$1", "$2", "$3"],
        key: "key",
        bigint: "BIGINT",
        payment_id: "id BIGSERIAL PRIMARY KEY",
    };

    fn fresh_database() -> String {
        // One server for every test, each in tables of its own.
        url()
    }

    async fn open(database: &str, size: u32) -> PgPool {
        let options = PgPoolOptions::new().max_connections(size);
        app::server_pool(options, "PostgreSQL", URL_VAR, database).await
    }

    fn phased_router(state: PhasedState<Self>) -> axum::Router {
        phased_handlers::router(state)
    }

    crate::phased_queries!();
}

/// Drops the functions a pooled `Idem::migrate` made for the key table
/// `table` (named `<table>_idem_*`), which dropping the table leaves.
pub async fn drop_functions(pool: &PgPool, table: &str) {
    let pattern = format!("{}\\_idem\\_%", table.replace('_', "\\_"));
    let drops: Vec<String> = sqlx::query_scalar(
        "SELECT format('DROP FUNCTION IF EXISTS %s', oid::regprocedure) \
         FROM pg_proc WHERE proname LIKE $1",
    )
    .bind(pattern)
    .fetch_all(pool)
    .await
    .expect("list the key table's functions");
    for drop in drops {
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(pool)
            .await
            .expect("drop a key table's function");
    }
}
