//! MySQL/MariaDB, at `IDEM_TEST_MYSQL_URL` (default the local MariaDB).

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, Pool};
use tokio::sync::OnceCell;

use super::env_or;
use crate::app::{AppState, TestDb};

pub mod mysql_app {
    crate::define_app!(sqlx::MySql);
}

static MYSQL_READY: OnceCell<()> = OnceCell::const_new();

impl TestDb for MySql {
    const ENGINE: &'static str = "mysql";
    // `RETURNING` on INSERT is MariaDB's (10.5+); the suite runs on MariaDB.
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_test_effects (scope, `key`, note, nonce) VALUES (?, ?, ?, ?) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_test_effects SET note = note WHERE id = ?";

    crate::test_db_queries!("?");

    async fn connect() -> Pool<Self> {
        let url = env_or("IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
        let pool = MySqlPoolOptions::new()
            .max_connections(40)
            .connect(&url)
            .await
            .unwrap_or_else(|error| {
                panic!("MySQL/MariaDB is required at {url} (set IDEM_TEST_MYSQL_URL): {error}")
            });
        MYSQL_READY
            .get_or_init(|| async {
                idem::Idem::new(pool.clone())
                    .migrate()
                    .await
                    .expect("migrate");
                sqlx::raw_sql(
                    "CREATE TABLE IF NOT EXISTS idem_test_effects (
                        id BIGINT AUTO_INCREMENT PRIMARY KEY, scope VARCHAR(255) NOT NULL,
                        `key` VARCHAR(255) NOT NULL, note TEXT NOT NULL, nonce VARCHAR(64) NOT NULL,
                        KEY idem_test_effects_scope (scope)) ENGINE = InnoDB",
                )
                .execute(&pool)
                .await
                .expect("create effects table");
            })
            .await;
        pool
    }

    fn unreachable_pool() -> Pool<Self> {
        MySqlPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_secs(2))
            .connect_lazy("mysql://root@127.0.0.1:1/test")
            .unwrap()
    }

    fn router(state: AppState<Self>) -> axum::Router {
        mysql_app::handlers::router(state)
    }
}
