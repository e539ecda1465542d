//! MySQL/MariaDB, at `IDEM_TEST_MYSQL_URL` (default the local MariaDB).

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Connection, Executor, MySql, MySqlConnection, Pool};
use tokio::sync::OnceCell;

use crate::phased::{Dialect, PhasedDb, PhasedState};
use crate::service::{self as app, AppState, TestDb};

crate::define_app!(sqlx::MySql);
crate::phased_app!(sqlx::MySql);

/// The effects table; a scope is at most 2,048 bytes, as in the key store.
const EFFECTS_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_service_effects (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, scope VARBINARY(2048) NOT NULL,
    `key` VARCHAR(255) NOT NULL, note TEXT NOT NULL, nonce VARCHAR(64) NOT NULL,
    KEY idem_service_effects_scope (scope(255))) ENGINE = InnoDB";

static READY: OnceCell<()> = OnceCell::const_new();

const URL_VAR: &str = "IDEM_TEST_MYSQL_URL";

/// The size of a test service's pool: enough for the suite's concurrent
/// requests (duplicates of a key in flight wait holding none), small
/// enough that the conformance tests running at once stay within the
/// server's `max_connections` (see the harness's `TESTS_AT_ONCE`).
pub const SERVER_POOL: u32 = 10;

/// The test server's URL.
pub fn url() -> String {
    app::env_or(URL_VAR, "mysql://root@127.0.0.1:3306/test")
}

/// A pool of `size` on the test server, its tables migrated.
pub async fn pool(size: u32) -> Pool<MySql> {
    let options = MySqlPoolOptions::new().max_connections(size);
    let pool = app::server_pool(options, "MySQL/MariaDB", URL_VAR, &url()).await;
    app::prepare_once(&READY, &pool, EFFECTS_DDL).await;
    pool
}

impl TestDb for MySql {
    const ENGINE: &'static str = "mysql";
    // `RETURNING` on INSERT is MariaDB's (10.5+); the suite runs on MariaDB.
    const INSERT_EFFECT: &'static str = "INSERT INTO idem_service_effects (scope, `key`, note, nonce) VALUES (?, ?, ?, ?) RETURNING id";
    const TOUCH_EFFECT: &'static str = "UPDATE idem_service_effects SET note = note WHERE id = ?";

    crate::test_db_queries!("?");

    async fn claim_waiters(pool: &Pool<Self>, scope: &str, key: &str) -> Option<i64> {
        // InnoDB names the record each waiter asks for: a claim of this
        // (scope, key) waits for the key table's primary-key record
        // (scope, key), which InnoDB writes as `0x<scope>, 0x<key>`. The
        // scope is unique to one test. (MariaDB's tables; MySQL 8 moved
        // them to `performance_schema.data_lock_waits`.) These tables are
        // a cache that a read refreshes only 100 ms after the last read by
        // anyone: see `TestDb::claim_waiters`.
        let count = sqlx::query_scalar(
            "SELECT count(DISTINCT w.requesting_trx_id) \
             FROM information_schema.innodb_lock_waits w \
             JOIN information_schema.innodb_locks l ON l.lock_id = w.requested_lock_id \
             WHERE l.lock_table = CONCAT('`', DATABASE(), '`.`idem_keys`') \
             AND l.lock_index = 'PRIMARY' \
             AND l.lock_data = CONCAT('0x', HEX(?), ', 0x', HEX(?))",
        )
        .bind(scope.as_bytes())
        .bind(key.as_bytes())
        .fetch_one(pool)
        .await
        .unwrap();
        Some(count)
    }

    async fn lock_waiters(holder: &mut MySqlConnection) -> Option<i64> {
        // The transactions InnoDB lists as blocked by the one of this
        // session (the information schema ignores the holder's snapshot; it
        // has a cache of its own, as in `claim_waiters`).
        let count = sqlx::query_scalar(
            "SELECT count(DISTINCT w.requesting_trx_id) \
             FROM information_schema.innodb_lock_waits w \
             JOIN information_schema.innodb_trx b ON b.trx_id = w.blocking_trx_id \
             WHERE b.trx_mysql_thread_id = CONNECTION_ID()",
        )
        .fetch_one(holder)
        .await
        .unwrap();
        Some(count)
    }

    async fn in_transaction(conn: &mut MySqlConnection) -> bool {
        // A `BEGIN` would not tell: inside a transaction it commits it.
        // With autocommit off, every statement opens a transaction: as bad
        // for the connection's next user.
        let open: i64 =
            sqlx::query_scalar("SELECT CAST(@@in_transaction OR NOT @@autocommit AS SIGNED)")
                .fetch_one(conn)
                .await
                .unwrap();
        open != 0
    }

    async fn session_id(conn: &mut MySqlConnection) -> Option<i64> {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(conn)
            .await
            .unwrap();
        Some(i64::try_from(id).unwrap())
    }

    async fn end_session(admin: &Pool<Self>, id: i64) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(admin)
            .await
            .unwrap();
        // KILL only marks the thread; it is gone once the process list no
        // longer shows it.
        app::until_session_ends::<Self>(admin, id).await;
    }

    async fn session_open(admin: &Pool<Self>, id: i64) -> bool {
        let open: i64 =
            sqlx::query_scalar("SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(id)
                .fetch_one(admin)
                .await
                .unwrap();
        open > 0
    }

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
        pool(SERVER_POOL).await
    }

    fn unreachable_pool() -> Pool<Self> {
        app::unreachable(MySqlPoolOptions::new(), "mysql://root@127.0.0.1:1/test")
    }

    fn router(state: AppState<Self>) -> axum::Router {
        handlers::router(state)
    }
}

impl PhasedDb for MySql {
    const DIALECT: Dialect = Dialect {
        params: ["?", "?", "?"],
        key: "`key`",
        bigint: "SIGNED",
        payment_id: "id BIGINT AUTO_INCREMENT PRIMARY KEY",
    };

    fn fresh_database() -> String {
        // One server for every test, each in tables of its own.
        url()
    }

    async fn open(database: &str, size: u32) -> Pool<Self> {
        let options = MySqlPoolOptions::new().max_connections(size);
        app::server_pool(options, "MySQL/MariaDB", URL_VAR, database).await
    }

    fn phased_router(state: PhasedState<Self>) -> axum::Router {
        phased_handlers::router(state)
    }

    crate::phased_queries!();
}
