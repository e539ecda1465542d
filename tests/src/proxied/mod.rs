//! The engines with a server as the proxy-based suites drive them
//! (`tests/chaos`, `tests/round_trips`): each suite is written once,
//! generic over [`Proxied`], and instantiated per engine. What differs
//! between engines is here: the protocol's proxy, the URLs, the SQL that
//! reads what the service left behind, the round-trip service's work, and
//! what sqlx's driver sends of its own.

use std::future::Future;
use std::net::SocketAddr;
use std::ops::Deref;
use std::time::Duration;

use sqlx::Pool;
use sqlx::pool::PoolOptions;

use crate::proxy::Proxy;
use crate::round_trip_service::{Charge, RoundTripState};
use crate::service::TestDb;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;

/// Where an engine's test server is, from its URL.
pub struct ServerUrl {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub database: String,
}

/// An engine with a server, behind its protocol's proxy.
pub trait Proxied: TestDb {
    /// The protocol's proxy; what every proxy has, it has through `Deref`.
    type Proxy: Deref<Target = Proxy> + Send + Sync + 'static;
    /// The URL scheme.
    const SCHEME: &'static str;
    /// The URL parameter that keeps TLS off, so the proxy reads the wire.
    const PLAIN_TCP: &'static str;
    /// Round trips of its own that sqlx's driver spends on a queued
    /// `ROLLBACK` (of a dropped transaction, or of the empty one `idem`
    /// leaves for sqlx to count): PostgreSQL's sends it with the pool's
    /// ping, MySQL's waits for its answer first.
    const QUEUED_ROLLBACK_ROUND_TRIPS: u64;
    /// The pool's ping in [`Proxy::recorded`].
    const PING: &'static str;
    /// How [`Proxy::recorded`] shows the read of a finished key that a
    /// claim finds taken (another instance's first replay).
    const TAKEN_KEY_READ: &'static str;
    /// A statement with one bound parameter (`1`, an integer).
    const SELECT_PARAMETER: &'static str;
    /// The round-trip service's effects table, `{table}` in its name.
    const CHARGES_DDL: &'static str;
    /// The effects of `(scope, key)`: `(id, nonce)`, in order (parameters:
    /// scope bytes, key).
    const EFFECTS_OF_KEY: &'static str;
    /// The key row of `(scope, key)`: `(status, body)` (scope bytes, key
    /// bytes).
    const STORED: &'static str;
    /// In a scope: effects without a stored response, stored responses
    /// without an effect, open claims (the scope bytes, three times).
    const ORPHANS: &'static str;
    /// In a scope, effects beyond the first of their key (scope bytes).
    const DUPLICATES: &'static str;

    fn server() -> ServerUrl;
    fn start_proxy(upstream: SocketAddr) -> impl Future<Output = Self::Proxy> + Send;
    /// A pool of `size` on the server itself, with the service's tables.
    fn pool(size: u32) -> impl Future<Output = Pool<Self>> + Send;

    /// Runs `sql` (statements as text); the error is the server's.
    fn run(pool: &Pool<Self>, sql: String) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// [`run`](Self::run) on one connection.
    fn run_on(
        conn: &mut Self::Connection,
        sql: String,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Rows in `table`.
    fn count_rows(pool: &Pool<Self>, table: &str) -> impl Future<Output = i64> + Send;
    /// Runs [`SELECT_PARAMETER`](Self::SELECT_PARAMETER), prepared.
    fn select_parameter(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;
    fn effects(
        pool: &Pool<Self>,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Vec<(i64, String)>> + Send;
    /// `(status, body)`, `status` `None` while a claim is open.
    fn stored(
        pool: &Pool<Self>,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Option<(Option<i16>, Vec<u8>)>> + Send;
    fn orphans(pool: &Pool<Self>, scope: &str) -> impl Future<Output = (i64, i64, i64)> + Send;
    fn duplicates(pool: &Pool<Self>, scope: &str) -> impl Future<Output = i64> + Send;

    /// The round-trip service's work: `charge.statements` inserts into
    /// `table`, the last one's id.
    fn charge(
        conn: &mut Self::Connection,
        table: &str,
        account: &str,
        charge: &Charge,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    /// The round-trip service on this engine.
    fn round_trip_router(state: RoundTripState<Self>) -> axum::Router;
}

/// Where the server listens, for a proxy to forward to.
pub async fn upstream<DB: Proxied>() -> SocketAddr {
    let ServerUrl { host, port, .. } = DB::server();
    tokio::net::lookup_host((host.as_str(), port))
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .unwrap_or_else(|| panic!("cannot resolve the {} host {host}:{port}", DB::ENGINE))
}

/// The test database's URL through a proxy at `proxy`, over plain TCP.
pub fn url_via<DB: Proxied>(proxy: SocketAddr) -> String {
    let ServerUrl { user, database, .. } = DB::server();
    format!(
        "{}://{user}@{proxy}/{database}?{}",
        DB::SCHEME,
        DB::PLAIN_TCP
    )
}

/// A proxy in front of the server.
pub async fn start_proxy<DB: Proxied>() -> DB::Proxy {
    DB::start_proxy(upstream::<DB>().await).await
}

/// A pool of `size` through `proxy`.
pub async fn through<DB: Proxied>(proxy: &Proxy, size: u32) -> Pool<DB> {
    PoolOptions::<DB>::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url_via::<DB>(proxy.addr()))
        .await
        .expect("connect through the proxy")
}

/// The `Proxied` methods every engine writes alike: from its module in
/// `engines` (its URL, parsed as `$options`, and its pool), its proxy, and
/// its SQL.
#[macro_export]
macro_rules! proxied_common {
    ($engine:ident, $options:ty, $proxy:ty) => {
        fn server() -> $crate::proxied::ServerUrl {
            let options: $options = $engine::url().parse().expect("the test server's URL");
            $crate::proxied::ServerUrl {
                host: options.get_host().to_owned(),
                port: options.get_port(),
                user: options.get_username().to_owned(),
                database: options.get_database().unwrap_or("test").to_owned(),
            }
        }

        async fn start_proxy(upstream: std::net::SocketAddr) -> $proxy {
            <$proxy>::start(upstream).await
        }

        async fn pool(size: u32) -> sqlx::Pool<Self> {
            $engine::pool(size).await
        }

        async fn run(pool: &sqlx::Pool<Self>, sql: String) -> Result<(), sqlx::Error> {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(pool)
                .await
                .map(drop)
        }

        async fn run_on(conn: &mut Self::Connection, sql: String) -> Result<(), sqlx::Error> {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(conn)
                .await
                .map(drop)
        }

        async fn count_rows(pool: &sqlx::Pool<Self>, table: &str) -> i64 {
            let sql = format!("SELECT COUNT(*) FROM {table}");
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(pool)
                .await
                .expect("count rows")
        }

        async fn select_parameter(pool: &sqlx::Pool<Self>) {
            sqlx::query(Self::SELECT_PARAMETER)
                .bind(1_i32)
                .execute(pool)
                .await
                .unwrap();
        }

        async fn effects(pool: &sqlx::Pool<Self>, scope: &str, key: &str) -> Vec<(i64, String)> {
            sqlx::query_as(Self::EFFECTS_OF_KEY)
                .bind(scope.as_bytes())
                .bind(key)
                .fetch_all(pool)
                .await
                .unwrap()
        }

        async fn stored(
            pool: &sqlx::Pool<Self>,
            scope: &str,
            key: &str,
        ) -> Option<(Option<i16>, Vec<u8>)> {
            let row: Option<(Option<i16>, Option<Vec<u8>>)> = sqlx::query_as(Self::STORED)
                .bind(scope.as_bytes())
                .bind(key.as_bytes())
                .fetch_optional(pool)
                .await
                .unwrap();
            row.map(|(status, body)| (status, body.unwrap_or_default()))
        }

        async fn orphans(pool: &sqlx::Pool<Self>, scope: &str) -> (i64, i64, i64) {
            sqlx::query_as(Self::ORPHANS)
                .bind(scope.as_bytes())
                .bind(scope.as_bytes())
                .bind(scope.as_bytes())
                .fetch_one(pool)
                .await
                .unwrap()
        }

        async fn duplicates(pool: &sqlx::Pool<Self>, scope: &str) -> i64 {
            sqlx::query_scalar(Self::DUPLICATES)
                .bind(scope.as_bytes())
                .fetch_one(pool)
                .await
                .unwrap()
        }
    };
}
