//! The service that `round_trips.rs` counts: the same handler with and
//! without `#[idempotent]`, on a pool that may go through the counting
//! proxy, and the setup around it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::{Idem, Tx, idempotent};
use serde::Deserialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};

use crate::account::Account;
use crate::pg_proxy::PgProxy;

pub fn database_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

pub use crate::unique::unique;

/// A direct pool, for setup and checks, and the server's address.
pub async fn direct() -> (PgPool, SocketAddr) {
    let url = database_url();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap_or_else(|error| {
            panic!("PostgreSQL is required at {url} (set IDEM_TEST_POSTGRES_URL): {error}")
        });
    let host: String = sqlx::query_scalar("SELECT host(inet_server_addr())")
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|_| "127.0.0.1".to_owned());
    let port: i32 = sqlx::query_scalar("SELECT current_setting('port')::int")
        .fetch_one(&pool)
        .await
        .expect("server port");
    let addr = format!("{host}:{port}").parse().expect("server address");
    (pool, addr)
}

/// A one-connection pool through `proxy`, so every round trip is seen.
pub async fn through(proxy: &PgProxy) -> PgPool {
    let url = database_url();
    let mut options: sqlx::postgres::PgConnectOptions = url.parse().expect("database URL");
    options = options
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(sqlx::postgres::PgSslMode::Disable);
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("connect through the proxy")
}

/// Waits until every connection is back in the pool: sqlx returns a
/// connection (with a ping) after the response has gone out.
pub async fn settle(pool: &PgPool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.num_idle() < pool.size() as usize {
        assert!(Instant::now() < deadline, "a connection never came back");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// One table of effects per test.
pub async fn create_table(pool: &PgPool, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL)"
    )))
    .execute(pool)
    .await
    .expect("create table");
}

pub async fn drop_table(pool: &PgPool, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(pool)
        .await
        .expect("drop table");
}

// ---------------------------------------------------------------- the service

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<Postgres>,
    pool: PgPool,
    table: Table,
}

#[derive(Clone)]
struct Table(String);

#[derive(Deserialize)]
struct Charge {
    amount: i64,
    statements: usize,
}

/// The handler's work, the same for both routes: `statements` inserts.
async fn work(
    conn: &mut PgConnection,
    table: &str,
    account: &str,
    charge: &Charge,
) -> Result<i64, sqlx::Error> {
    let sql = format!("INSERT INTO {table} (account, amount) VALUES ($1, $2) RETURNING id");
    let mut id = 0;
    for _ in 0..charge.statements {
        id = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .bind(account)
            .bind(charge.amount)
            .fetch_one(&mut *conn)
            .await?;
    }
    Ok(id)
}

/// What `lock_timeout` the handler's own statements run under.
#[idempotent(scope = "account", wait = "0ms")]
async fn lock_timeout(account: Account, mut tx: Tx<Postgres>) -> Response {
    let _ = account;
    match sqlx::query_scalar::<_, String>("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
    {
        Ok(value) => (StatusCode::OK, value).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

fn created(id: Result<i64, sqlx::Error>) -> Response {
    match id {
        Ok(id) => (StatusCode::CREATED, Json(serde_json::json!({ "id": id }))).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// Without the attribute: a plain sqlx transaction.
async fn baseline(
    account: Account,
    State(pool): State<PgPool>,
    State(Table(table)): State<Table>,
    Json(charge): Json<Charge>,
) -> Response {
    let result = async {
        let mut tx = pool.begin().await?;
        let id = work(&mut tx, &table, &account.0, &charge).await?;
        tx.commit().await?;
        Ok(id)
    }
    .await;
    created(result)
}

/// The same handler, idempotent.
#[idempotent(scope = "account")]
async fn idempotent(
    account: Account,
    State(Table(table)): State<Table>,
    mut tx: Tx<Postgres>,
    Json(charge): Json<Charge>,
) -> Response {
    created(work(&mut tx, &table, &account.0, &charge).await)
}

pub struct Service {
    pub addr: SocketAddr,
    http: reqwest::Client,
    pub account: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Service {
    pub async fn start(pool: PgPool, keys: &str, table: &str) -> Service {
        Service::start_configured(pool, keys, table, |idem| idem).await
    }

    /// As [`Service::start`], the store configured further by `configure`.
    pub async fn start_configured(
        pool: PgPool,
        keys: &str,
        table: &str,
        configure: impl FnOnce(Idem<Postgres>) -> Idem<Postgres>,
    ) -> Service {
        let idem = configure(Idem::new(pool.clone()).table(keys).expect("table name"));
        idem.migrate().await.expect("migrate");
        let state = AppState {
            idem,
            pool,
            table: Table(table.to_owned()),
        };
        let app = axum::Router::new()
            .route("/baseline", post(baseline))
            .route("/idempotent", post(idempotent))
            .route("/lock_timeout", post(lock_timeout))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Service {
            addr,
            http: reqwest::Client::new(),
            account: unique("acct"),
            task,
        }
    }

    pub async fn post(&self, route: &str, key: &str, statements: usize) -> reqwest::Response {
        self.http
            .post(format!("http://{}{route}", self.addr))
            .header("x-account", &self.account)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(format!(r#"{{"amount": 1250, "statements": {statements}}}"#))
            .send()
            .await
            .expect("HTTP request")
    }
}

/// A service on a one-connection pool through a counting proxy, with its
/// own effects and key tables.
pub struct Proxied {
    pub admin: PgPool,
    pub table: String,
    pub keys: String,
    pub proxy: PgProxy,
    pub pool: PgPool,
    pub service: Service,
}

impl Proxied {
    pub async fn start(prefix: &str) -> Proxied {
        Proxied::start_configured(prefix, |idem| idem).await
    }

    /// As [`Proxied::start`], the store configured further by `configure`.
    pub async fn start_configured(
        prefix: &str,
        configure: impl FnOnce(Idem<Postgres>) -> Idem<Postgres>,
    ) -> Proxied {
        let (admin, upstream) = direct().await;
        let table = unique(&format!("{prefix}_effects"));
        let keys = unique(&format!("{prefix}_keys"));
        create_table(&admin, &table).await;
        let proxy = PgProxy::start(upstream).await;
        let pool = through(&proxy).await;
        let service = Service::start_configured(pool.clone(), &keys, &table, configure).await;
        Proxied {
            admin,
            table,
            keys,
            proxy,
            pool,
            service,
        }
    }

    pub async fn stop(self) {
        drop(self.service);
        self.pool.close().await;
        drop_table(&self.admin, &self.table).await;
        drop_table(&self.admin, &self.keys).await;
    }
}

/// Round trips of one request, the pool's return ping included.
pub async fn count(
    proxy: &PgProxy,
    pool: &PgPool,
    service: &Service,
    route: &str,
    key: &str,
    statements: usize,
) -> (u64, reqwest::Response) {
    settle(pool).await;
    proxy.reset();
    let response = service.post(route, key, statements).await;
    settle(pool).await;
    assert_eq!(proxy.connections(), 0, "{route} reconnected");
    (proxy.round_trips(), response)
}
