//! MySQL/MariaDB, at `IDEM_TEST_MYSQL_URL` (default the local MariaDB).

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Connection, Executor, MySql, MySqlConnection, Pool};
use tokio::sync::OnceCell;

use super::super::app::{self, AppState, TestDb};

crate::define_app!(sqlx::MySql);

/// The effects table; a scope is at most 2,048 bytes, as in the key store.
const EFFECTS_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_service_effects (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, scope VARBINARY(2048) NOT NULL,
    `key` VARCHAR(255) NOT NULL, note TEXT NOT NULL, nonce VARCHAR(64) NOT NULL,
    KEY idem_service_effects_scope (scope(255))) ENGINE = InnoDB";

static READY: OnceCell<()> = OnceCell::const_new();

const URL_VAR: &str = "IDEM_TEST_MYSQL_URL";

/// The test server's URL.
pub fn url() -> String {
    app::env_or(URL_VAR, "mysql://root@127.0.0.1:3306/test")
}

impl TestDb for MySql {
    const ENGINE: &'static str = "mysql";
    // `RETURNING` on INSERT is MariaDB's (10.5+); the suite runs on MariaDB.
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_service_effects (scope, `key`, note, nonce) VALUES (?, ?, ?, ?) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_service_effects SET note = note WHERE id = ?";

    crate::test_db_queries!("?");

    async fn end_by_error(conn: &mut sqlx::MySqlConnection, id: i64) -> sqlx::Error {
        // InnoDB ends a whole transaction only as a deadlock's victim. Another
        // session takes a row of its own, then waits for this transaction's
        // effect, while this one waits for that row. The other session has
        // written more, so InnoDB picks this transaction to roll back.
        let mut other = MySqlConnection::connect(&url()).await.unwrap();
        other.execute("START TRANSACTION").await.unwrap();
        let mut theirs = 0;
        for _ in 0..20 {
            theirs = sqlx::query_scalar(Self::INSERT_EFFECT)
                .bind(&b"deadlock filler"[..])
                .bind("")
                .bind("")
                .bind("")
                .fetch_one(&mut other)
                .await
                .unwrap();
        }
        let waiter = tokio::spawn(async move {
            let touched = sqlx::query(Self::TOUCH_EFFECT)
                .bind(id)
                .execute(&mut other)
                .await;
            other.execute("ROLLBACK").await.unwrap();
            touched
        });
        let error = sqlx::query(Self::TOUCH_EFFECT)
            .bind(theirs)
            .execute(conn)
            .await
            .expect_err("this transaction is the deadlock's victim");
        let touched = waiter.await.unwrap().expect("the other session goes on");
        assert_eq!(touched.rows_affected(), 0, "the effect was rolled back");
        error
    }

    async fn connect() -> Pool<Self> {
        let options = MySqlPoolOptions::new().max_connections(40);
        let pool = app::server_pool(options, "MySQL/MariaDB", URL_VAR, &url()).await;
        app::prepare_once(&READY, &pool, EFFECTS_DDL).await;
        pool
    }

    fn unreachable_pool() -> Pool<Self> {
        app::unreachable(MySqlPoolOptions::new(), "mysql://root@127.0.0.1:1/test")
    }

    fn router(state: AppState<Self>) -> axum::Router {
        handlers::router(state)
    }
}
