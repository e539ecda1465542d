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

    async fn lock_effect(pool: &Pool<Self>, id: i64) -> sqlx::Transaction<'static, Self> {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(Self::TOUCH_EFFECT)
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
    }

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

    async fn count_effects(pool: &Pool<Self>, scope: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_test_effects WHERE scope = $1")
            .bind(scope)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn count_keys(pool: &Pool<Self>, scope: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE scope = $1")
            .bind(scope.as_bytes())
            .fetch_one(pool)
            .await
            .unwrap()
    }
}
