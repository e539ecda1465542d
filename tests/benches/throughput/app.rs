//! The service under load, run in a child process so its memory can be
//! measured alone: what its handlers share (the caller, the charge, the
//! handler's SQL in [`work`]), PostgreSQL's tables and pool, and the child
//! process itself. The handlers, written three ways (plain transaction,
//! `#[idempotent]`, the hand-written two-phase recipe) with the same SQL,
//! and the provider scenarios' four, are stamped out per engine in
//! `handlers`.

use std::io::BufRead;
use std::net::SocketAddr;

use axum::Json;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use idem::{Fingerprint, Idem};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

pub(crate) use crate::account::Account;
use crate::handlers::{self, Dialect};
use crate::provider::Provider;

/// The idempotency table of the benchmark (not the default one, which tests
/// and examples share).
pub const KEYS_TABLE: &str = "idem_bench_keys";

/// Client accounts with a balance row each: client `i` is `c{i}`, so the
/// 3-statement handler's `UPDATE` never waits on another client's row.
pub const ACCOUNTS: usize = 256;

/// Environment of the child server.
pub const ROLE: &str = "IDEM_BENCH_ROLE";
const SERVER_THREADS: &str = "IDEM_BENCH_SERVER_THREADS";
const POOL: &str = "IDEM_BENCH_POOL";
/// 0: the server's pool does not ping a connection before handing it out.
const TEST_BEFORE_ACQUIRE: &str = "IDEM_BENCH_TEST_BEFORE_ACQUIRE";
/// The `peer` scenario's Redis.
const REDIS_URL: &str = "IDEM_BENCH_REDIS_URL";

/// What a server process is started with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// `postgres`, `sqlite` or `mysql` (with the feature `mysql`).
    pub engine: &'static str,
    /// A PostgreSQL or MySQL URL, or a SQLite file.
    pub database_url: String,
    pub pool: u32,
    pub threads: usize,
    /// Where the `peer` scenario's store is (PostgreSQL's service only).
    pub redis_url: String,
}

impl ServerConfig {
    pub fn from_env(database_url: String) -> Self {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            engine: "postgres",
            database_url,
            pool: env_number(POOL, 16),
            threads: env_number(SERVER_THREADS, threads),
            redis_url: std::env::var(REDIS_URL)
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
        }
    }

    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (ROLE, "server".to_owned()),
            ("IDEM_BENCH_ENGINE", self.engine.to_owned()),
            ("IDEM_BENCH_DATABASE_URL", self.database_url.clone()),
            (POOL, self.pool.to_string()),
            (SERVER_THREADS, self.threads.to_string()),
            (REDIS_URL, self.redis_url.clone()),
        ]
    }
}

pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
        Err(_) => default,
    }
}

/// `IDEM_BENCH_POOLER=transaction`: statements that keep nothing in the
/// session, as behind PgBouncer.
pub fn pooler() -> idem::Pooler {
    match std::env::var("IDEM_BENCH_POOLER").as_deref() {
        Ok("transaction") => idem::Pooler::Transaction,
        _ => idem::Pooler::Session,
    }
}

/// Creates the tables (and empties them: every run starts alike).
pub async fn setup(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    // As the server's `Idem`: behind a declared pooler, with what the
    // claims there use.
    Idem::new(pool.clone())
        .table(KEYS_TABLE)?
        .pooler(pooler())
        .migrate()
        .await?;
    // The diagnostic `optimistic`'s keys, in a table just like the wrapper's.
    Idem::new(pool.clone())
        .table(crate::optimistic::TABLE)?
        .migrate()
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_charges (
            id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
            currency text NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS bench_accounts (
            account text PRIMARY KEY, balance bigint NOT NULL DEFAULT 0,
            charges bigint NOT NULL DEFAULT 0);
         CREATE TABLE IF NOT EXISTS bench_ledger (
            id bigserial PRIMARY KEY, charge_id bigint NOT NULL, account text NOT NULL,
            amount bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS bench_two_phase_keys (
            scope text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,
            status smallint, body bytea, expires_at timestamptz NOT NULL,
            PRIMARY KEY (scope, key));
         CREATE TABLE IF NOT EXISTS bench_payments (
            id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
            currency text NOT NULL, status text NOT NULL, provider_id text);
         TRUNCATE bench_charges, bench_accounts, bench_ledger, bench_two_phase_keys, idem_bench_keys,
            bench_optimistic_keys, bench_payments;
         INSERT INTO bench_accounts (account) SELECT 'c' || i FROM generate_series(0, 255) i;",
    )
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE bench_accounts")
        .execute(pool)
        .await?;
    // Diagnostic: room for HOT updates of the stored response.
    let fillfactor: u32 = env_number("IDEM_BENCH_FILLFACTOR", 100);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE idem_bench_keys SET (fillfactor = {fillfactor}); \
         ALTER TABLE bench_optimistic_keys SET (fillfactor = {fillfactor})"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// Creates the tables on `IDEM_BENCH_DATABASE_URL` and exits: PostgreSQL's,
/// or with `IDEM_BENCH_ENGINE=mysql` MariaDB's.
pub fn setup_child() {
    let url = std::env::var("IDEM_BENCH_DATABASE_URL").expect("IDEM_BENCH_DATABASE_URL");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("setup runtime")
        .block_on(async {
            #[cfg(feature = "mysql")]
            if std::env::var("IDEM_BENCH_ENGINE").as_deref() == Ok("mysql") {
                crate::mysql::setup(&url).await.expect("bench tables");
                return;
            }
            let pool = connect(&url, 1, false).await;
            setup(&pool).await.expect("bench tables");
        });
}

/// The child process: serve until the parent closes our stdin or kills us.
pub fn serve_child() {
    let url = std::env::var("IDEM_BENCH_DATABASE_URL").expect("started by the benchmark");
    let config = ServerConfig::from_env(url);
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEM_BENCH_LOG")
                // sqlx's slow-statement warnings would only report SQLite's
                // writers queueing for its one write lock.
                .unwrap_or_else(|_| "warn,sqlx::query=error".into()),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.threads)
        .enable_all()
        .build()
        .expect("server runtime");
    runtime.block_on(async {
        // The provider scenarios' fake provider, in this process.
        let provider = Provider::start().await;
        let app = match std::env::var("IDEM_BENCH_ENGINE").as_deref() {
            Ok("sqlite") => handlers::sqlite::router(
                crate::sqlite::connect(&config.database_url, config.pool).await,
                provider,
            ),
            #[cfg(feature = "mysql")]
            Ok("mysql") => handlers::mysql::router(
                crate::mysql::connect(&config.database_url, config.pool).await,
                provider,
            ),
            _ => {
                let pool = connect(&config.database_url, config.pool, true).await;
                let peer = handlers::connect_peer(&config.redis_url).await;
                handlers::postgres::router(pool.clone(), provider).merge(handlers::peer(pool, peer))
            }
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("LISTENING {}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        // The parent holds our stdin: its end (or death) ends us.
        tokio::task::spawn_blocking(|| for _ in std::io::stdin().lock().lines() {})
            .await
            .ok();
        server.abort();
    });
}

/// A pool; the server's (`server`) is told apart by its `application_name`.
pub async fn connect(url: &str, size: u32, server: bool) -> PgPool {
    let connect: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    let name = if server {
        SERVER_APPLICATION
    } else {
        "idem-bench-admin"
    };
    // sqlx pings a connection as it leaves the pool (unless this is off)
    // and as it comes back (always): two of a replay's three round trips.
    let test_before_acquire = env_number(TEST_BEFORE_ACQUIRE, 1) != 0;
    PgPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .test_before_acquire(test_before_acquire || !server)
        .connect_with(connect.application_name(name))
        .await
        .unwrap_or_else(|error| panic!("PostgreSQL is required at {url}: {error}"))
}

/// The `application_name` of the server's connections: their backends are
/// the PostgreSQL CPU a scenario is charged with.
pub const SERVER_APPLICATION: &str = "idem-bench-server";

/// The backends of the server's pool.
pub async fn server_backends(admin: &PgPool) -> Vec<u32> {
    sqlx::query_scalar::<_, i32>("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
        .bind(SERVER_APPLICATION)
        .fetch_all(admin)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|pid| pid as u32)
        .collect()
}

/// A server listening on loopback in this process, with its fake provider
/// (for counting round trips through the proxy).
pub async fn serve_here(pool: PgPool) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = handlers::postgres::router(pool, Provider::start().await);
    let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, task)
}

#[derive(Deserialize)]
pub(crate) struct NewCharge {
    pub(crate) amount: i64,
    pub(crate) currency: String,
}

#[derive(Serialize)]
pub(crate) struct Charge {
    pub(crate) id: i64,
    pub(crate) account: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
}

pub(crate) struct ApiError(sqlx::Error);

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0.to_string()).into_response()
    }
}

/// The handler's SQL, identical in every variant and on every engine (in
/// its [`Dialect`]): the charge; with 3 statements also the account's
/// balance and a ledger line.
pub(crate) async fn work<DB>(
    conn: &mut DB::Connection,
    account: &str,
    new: &NewCharge,
    statements: u32,
) -> Result<Charge, sqlx::Error>
where
    DB: Dialect,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q, 'r> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
{
    let id: i64 = sqlx::query_scalar(DB::INSERT_CHARGE)
        .bind(account)
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(&mut *conn)
        .await?;
    if statements >= 3 {
        sqlx::query(DB::UPDATE_ACCOUNT)
            .bind(new.amount)
            .bind(account)
            .execute(&mut *conn)
            .await?;
        sqlx::query(DB::INSERT_LEDGER)
            .bind(id)
            .bind(account)
            .bind(new.amount)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Charge {
        id,
        account: account.to_owned(),
        amount: new.amount,
        currency: new.currency.clone(),
    })
}

pub(crate) fn created(charge: Charge) -> Response {
    let location = format!("/charges/{}", charge.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(charge),
    )
        .into_response()
}

/// What the hand-written idempotent handlers (the two-phase recipe, the
/// optimistic sketch) read first: the key, the request's fingerprint and
/// the charge; or the answer to a request that lacks one of them.
pub(crate) fn read_request<'h>(
    method: &Method,
    uri: &Uri,
    headers: &'h HeaderMap,
    body: &[u8],
) -> Result<(&'h str, Fingerprint, NewCharge), (StatusCode, &'static str)> {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
    else {
        return Err((StatusCode::BAD_REQUEST, "Idempotency-Key required"));
    };
    let fingerprint = Fingerprint::of(method, uri.path(), uri.query(), headers, body);
    let Ok(new) = serde_json::from_slice::<NewCharge>(body) else {
        return Err((StatusCode::UNPROCESSABLE_ENTITY, "bad JSON"));
    };
    Ok((key, fingerprint, new))
}
