//! PostgreSQL, at `IDEM_TEST_POSTGRES_URL` (default the local server). The
//! hardening tests include this file too.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Pool, Postgres};
use tokio::sync::OnceCell;

use super::super::app::{self, AppState, TestDb};

crate::define_app!(sqlx::Postgres);

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

impl TestDb for Postgres {
    const ENGINE: &'static str = "postgres";
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_service_effects (scope, key, note, nonce) VALUES ($1, $2, $3, $4) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_service_effects SET note = note WHERE id = $1";

    crate::test_db_queries!("$1");

    async fn end_by_error(conn: &mut sqlx::PgConnection, id: i64) -> sqlx::Error {
        // A unique violation (the effect again, under its own id) fails the
        // transaction: PostgreSQL then answers `COMMIT` with a rollback.
        sqlx::query(
            "INSERT INTO idem_service_effects (id, scope, key, note, nonce) \
             SELECT id, scope, key, note, nonce FROM idem_service_effects WHERE id = $1",
        )
        .bind(id)
        .execute(conn)
        .await
        .expect_err("the effect's id is taken")
    }

    async fn connect() -> Pool<Self> {
        pool(40).await
    }

    fn unreachable_pool() -> Pool<Self> {
        app::unreachable(PgPoolOptions::new(), "postgres://postgres@127.0.0.1:1/test")
    }

    fn router(state: AppState<Self>) -> axum::Router {
        handlers::router(state)
    }
}
