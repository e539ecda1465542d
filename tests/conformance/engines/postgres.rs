//! PostgreSQL, at `IDEM_TEST_POSTGRES_URL` (default the local server).

use sqlx::{Pool, Postgres};
use tokio::sync::OnceCell;

use super::env_or;
use crate::app::{AppState, TestDb};

pub mod postgres_app {
    crate::define_app!(sqlx::Postgres);
}

static PG_READY: OnceCell<()> = OnceCell::const_new();

impl TestDb for Postgres {
    const ENGINE: &'static str = "postgres";
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_test_effects (scope, key, note, nonce) VALUES ($1, $2, $3, $4) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_test_effects SET note = note WHERE id = $1";

    crate::test_db_queries!("$1");

    async fn connect() -> Pool<Self> {
        let url = env_or(
            "IDEM_TEST_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        );
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(40)
            .connect(&url)
            .await
            .unwrap_or_else(|error| {
                panic!("PostgreSQL is required at {url} (set IDEM_TEST_POSTGRES_URL): {error}")
            });
        PG_READY
            .get_or_init(|| async {
                idem::Idem::new(pool.clone())
                    .migrate()
                    .await
                    .expect("migrate");
                sqlx::raw_sql(
                    "CREATE TABLE IF NOT EXISTS idem_test_effects (
                        id bigserial PRIMARY KEY, scope text NOT NULL, key text NOT NULL,
                        note text NOT NULL, nonce text NOT NULL)",
                )
                .execute(&pool)
                .await
                .or_else(|error| match &error {
                    // Another test binary created it at the same moment.
                    sqlx::Error::Database(db) if db.code().as_deref() == Some("23505") => {
                        Ok(Default::default())
                    }
                    _ => Err(error),
                })
                .expect("create effects table");
            })
            .await;
        pool
    }

    fn unreachable_pool() -> Pool<Self> {
        sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_secs(2))
            .connect_lazy("postgres://postgres@127.0.0.1:1/test")
            .unwrap()
    }

    fn router(state: AppState<Self>) -> axum::Router {
        postgres_app::handlers::router(state)
    }
}
