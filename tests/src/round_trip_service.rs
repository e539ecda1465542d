//! The service that `tests/round_trips` counts, on every engine with a
//! server: the same handler with and without `#[idempotent]` (stamped out
//! per engine by `round_trip_app!`, the work being the engine's
//! [`Proxied::charge`]), on a pool that may go through the engine's
//! counting proxy, and the setup around it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem::Idem;
use serde::Deserialize;
use sqlx::Pool;

use crate::proxied::{self, Proxied};

pub use crate::unique::unique;

/// What the round-trip handlers share.
pub struct RoundTripState<DB: idem::Backend> {
    pub idem: Idem<DB>,
    pub pool: Pool<DB>,
    pub table: Table,
}

impl<DB: idem::Backend> Clone for RoundTripState<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            pool: self.pool.clone(),
            table: self.table.clone(),
        }
    }
}

impl<DB: idem::Backend> FromRef<RoundTripState<DB>> for Idem<DB> {
    fn from_ref(state: &RoundTripState<DB>) -> Self {
        state.idem.clone()
    }
}

impl<DB: idem::Backend> FromRef<RoundTripState<DB>> for Pool<DB> {
    fn from_ref(state: &RoundTripState<DB>) -> Self {
        state.pool.clone()
    }
}

impl<DB: idem::Backend> FromRef<RoundTripState<DB>> for Table {
    fn from_ref(state: &RoundTripState<DB>) -> Self {
        state.table.clone()
    }
}

/// The table the handlers write their effects to.
#[derive(Clone)]
pub struct Table(pub String);

/// A request: `statements` inserts of `amount`.
#[derive(Deserialize)]
pub struct Charge {
    pub amount: i64,
    pub statements: usize,
}

/// 201 with the id, or 500 with the error.
pub fn created(id: Result<i64, sqlx::Error>) -> Response {
    match id {
        Ok(id) => (StatusCode::CREATED, Json(serde_json::json!({ "id": id }))).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// Stamps out, as `round_trip_handlers`, the round-trip service's handlers
/// and router for one engine: `/baseline` (a plain sqlx transaction) and
/// `/idempotent` (the same work under `#[idempotent]`), and any further
/// `"/path" => handler` of the calling module.
#[macro_export]
macro_rules! round_trip_app {
    ($db:ty $(, $path:literal => $handler:ident)* $(,)?) => {
        pub mod round_trip_handlers {
            use axum::Json;
            use axum::extract::State;
            use axum::response::Response;
            use idem::{Tx, idempotent};

            use $crate::account::Account;
            use $crate::proxied::Proxied;
            use $crate::round_trip_service::{Charge, RoundTripState, Table, created};

            /// Without the attribute: a plain sqlx transaction.
            async fn baseline(
                account: Account,
                State(pool): State<sqlx::Pool<$db>>,
                State(Table(table)): State<Table>,
                Json(charge): Json<Charge>,
            ) -> Response {
                let result = async {
                    let mut tx = pool.begin().await?;
                    let id = <$db as Proxied>::charge(&mut tx, &table, &account.0, &charge).await?;
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
                mut tx: Tx<$db>,
                Json(charge): Json<Charge>,
            ) -> Response {
                created(<$db as Proxied>::charge(&mut tx, &table, &account.0, &charge).await)
            }

            pub fn router(state: RoundTripState<$db>) -> axum::Router {
                use axum::routing::post;
                axum::Router::new()
                    .route("/baseline", post(baseline))
                    .route("/idempotent", post(idempotent))
                    $(.route($path, post(super::$handler)))*
                    .with_state(state)
            }
        }
    };
}

/// Waits until every connection is back in the pool: sqlx returns a
/// connection (with a ping) after the response has gone out.
pub async fn settle<DB: sqlx::Database>(pool: &Pool<DB>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.num_idle() < pool.size() as usize {
        assert!(Instant::now() < deadline, "a connection never came back");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// One table of effects per test.
pub async fn create_table<DB: Proxied>(pool: &Pool<DB>, table: &str) {
    let ddl = DB::CHARGES_DDL.replace("{table}", table);
    DB::run(pool, ddl).await.expect("create table");
}

pub async fn drop_table<DB: Proxied>(pool: &Pool<DB>, table: &str) {
    DB::run(pool, format!("DROP TABLE IF EXISTS {table}"))
        .await
        .expect("drop table");
}

/// The service on 127.0.0.1, stopped when dropped.
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
    pub async fn start<DB: Proxied>(pool: Pool<DB>, keys: &str, table: &str) -> Service {
        Service::start_configured(pool, keys, table, |idem| idem).await
    }

    /// A service (its own `Idem`, so its own memory of finished keys) on
    /// `pool`, keeping keys in `keys` and effects in `table`, the store
    /// configured further by `configure`.
    pub async fn start_configured<DB: Proxied>(
        pool: Pool<DB>,
        keys: &str,
        table: &str,
        configure: impl FnOnce(Idem<DB>) -> Idem<DB>,
    ) -> Service {
        // The portable claim, whose statements these tests pin (the claim
        // CockroachDB gets); the advisory claim's text is pinned by the
        // runtime's own tests. Its once-per-server probe would also open a
        // connection of its own through the counting proxy.
        let idem = configure(
            Idem::new(pool.clone())
                .table(keys)
                .expect("table name")
                .advisory_locks(false),
        );
        idem.migrate().await.expect("migrate");
        let state = RoundTripState {
            idem,
            pool,
            table: Table(table.to_owned()),
        };
        let app = DB::round_trip_router(state);
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
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("HTTP request")
    }
}

/// A service on a one-connection pool through the engine's counting proxy,
/// with its own effects and key tables (dropped by `stop`).
pub struct Wired<DB: Proxied> {
    pub admin: Pool<DB>,
    pub table: String,
    pub keys: String,
    pub proxy: DB::Proxy,
    pub pool: Pool<DB>,
    pub service: Service,
}

impl<DB: Proxied> Wired<DB> {
    pub async fn start(prefix: &str) -> Self {
        Self::start_configured(prefix, |idem| idem).await
    }

    /// As [`start`](Self::start), the store configured further by
    /// `configure`.
    pub async fn start_configured(
        prefix: &str,
        configure: impl FnOnce(Idem<DB>) -> Idem<DB>,
    ) -> Self {
        let admin = DB::pool(2).await;
        let table = unique(&format!("{prefix}_fx"));
        let keys = unique(&format!("{prefix}_keys"));
        create_table(&admin, &table).await;
        let proxy = proxied::start_proxy::<DB>().await;
        let pool = proxied::through::<DB>(&proxy, 1).await;
        let service = Service::start_configured(pool.clone(), &keys, &table, configure).await;
        Self {
            admin,
            table,
            keys,
            proxy,
            pool,
            service,
        }
    }

    /// Round trips of one request, the pool's pings included, and what they
    /// were; fails if the pool reconnected.
    pub async fn count(
        &self,
        service: &Service,
        route: &str,
        key: &str,
        statements: usize,
    ) -> (u64, Vec<Vec<String>>, reqwest::Response) {
        settle(&self.pool).await;
        self.proxy.reset();
        self.proxy.record();
        let response = service.post(route, key, statements).await;
        settle(&self.pool).await;
        assert_eq!(self.proxy.accepted(), 0, "{route} reconnected");
        (self.proxy.round_trips(), self.proxy.recorded(), response)
    }

    /// Rows in the effects table.
    pub async fn rows(&self) -> i64 {
        DB::count_rows(&self.admin, &self.table).await
    }

    pub async fn stop(self) {
        drop(self.service);
        self.pool.close().await;
        drop_table(&self.admin, &self.table).await;
        drop_table(&self.admin, &self.keys).await;
    }
}
