//! The phased-mode service under test, written once: the charges
//! example's `POST /v1/payments` (a local phase "pending", the provider
//! as the external step "provider", the last phase marking the payment
//! succeeded), stamped out per engine by `phased_app!`, with hooks at its
//! boundaries where a test pauses it or kills its process.
//!
//! At each [`Boundary`] the handler prints `BOUNDARY <name>` and, if the
//! service was told to, waits there: for the test to let it go (in this
//! process) or forever (in a child process the test SIGKILLs). Each
//! service keeps its keys and payments in tables of its own, named by its
//! [`ServiceConfig`], so a completer never resumes another test's keys.

pub mod boundary;
pub mod provider;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::{HeaderMap, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idem::Idem;
use serde::{Deserialize, Serialize};
use sqlx::Pool;

use crate::service::TestDb;
pub use boundary::{Attempt, Boundaries, Boundary, Pause};
pub use provider::{ProviderApi, ProviderProcess, ProviderStats};

/// The route of the phased handler, with a lease of [`LEASE`].
pub const PATH: &str = "/v1/payments";
/// The same handler with a lease of [`LONG_LEASE`]: for tests that must
/// see a lease live, whatever the machine's load.
pub const LONG_PATH: &str = "/v1/payments/long";
/// The lease of [`PATH`], as its attribute says.
pub const LEASE: Duration = Duration::from_secs(2);
/// The lease of [`LONG_PATH`], as its attribute says.
pub const LONG_LEASE: Duration = Duration::from_secs(30);
/// The header that makes the local phase fail (after its insert): not part
/// of the fingerprint, so a retry without it is the same request.
pub const FAIL_LOCAL: &str = "x-fail-local";

/// The caller, from `Authorization: Bearer <account>`: the scope.
pub struct Account(pub String);

impl idem::Scope for Account {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

/// The completer resumes a payment without credentials: the account is the
/// scope its key was stored under.
impl idem::FromScope for Account {
    fn from_scope(scope: &str) -> Self {
        Account(scope.to_owned())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .filter(|account| !account.is_empty())
            .map(|account| Account(account.to_owned()))
            .ok_or((
                StatusCode::UNAUTHORIZED,
                "send Authorization: Bearer <account>\n",
            ))
    }
}

/// A payment to make.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewPayment {
    pub amount: i64,
    pub currency: String,
}

/// The 201's body. `attempt` is random per execution of the handler, so a
/// replay repeats it and another execution cannot; the payment's row keeps
/// the one of the attempt whose last phase committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    pub id: i64,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub provider_id: String,
    pub attempt: String,
}

/// A payment's row, as the tests read it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct PaymentRow {
    pub id: i64,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub provider_id: Option<String>,
    pub finished_by: Option<String>,
}

/// A key's row, as the tests read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct KeyRow {
    /// The stored response's status; `None` while unfinished.
    pub status: Option<i64>,
    /// Resumptions made (by the completer or a client's retry after the
    /// lease ended).
    pub attempts: i64,
}

/// The handler's `Err`: never stored (5xx), or the phase's own answer.
pub enum PayError {
    Database(sqlx::Error),
    /// The provider failed or could not be reached: 502.
    Provider(String),
    Phase(idem::PhaseError),
    /// The local phase refused the payment ([`FAIL_LOCAL`]): 500.
    Refused,
}

impl From<sqlx::Error> for PayError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl From<idem::PhaseError> for PayError {
    fn from(error: idem::PhaseError) -> Self {
        Self::Phase(error)
    }
}

impl IntoResponse for PayError {
    fn into_response(self) -> Response {
        match self {
            Self::Database(error) => {
                (StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")).into_response()
            }
            Self::Provider(error) => {
                (StatusCode::BAD_GATEWAY, format!("provider: {error}\n")).into_response()
            }
            Self::Phase(error) => error.into_response(),
            Self::Refused => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the local phase refused\n",
            )
                .into_response(),
        }
    }
}

/// Whether the request asks the local phase to fail.
pub fn refuses_local(headers: &HeaderMap) -> bool {
    headers.contains_key(FAIL_LOCAL)
}

/// The phased handler that calls the provider with
/// `Phases::external_once`, as a downstream that takes no key (its lease
/// as [`PATH`]'s). A path, not a header: the completer's request carries
/// the stored request's path, not its headers.
pub const ONCE_PATH: &str = "/v1/payments/once";

/// The phased handler with `ttl = "2s", tombstone = "6s"` (its lease as
/// [`PATH`]'s).
pub const TOMBSTONE_PATH: &str = "/v1/payments/tombstoned";

/// How an engine spells the suite's SQL.
pub struct Dialect {
    /// The first three placeholders.
    pub params: [&'static str; 3],
    /// The key table's `key` column, quoted.
    pub key: &'static str,
    /// The type to `CAST` an integer to for an `i64`.
    pub bigint: &'static str,
    /// The payments table's id column.
    pub payment_id: &'static str,
}

impl Dialect {
    /// Creates payments table `table`.
    pub fn create_payments(&self, table: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {table} ({}, account TEXT NOT NULL, \
             amount BIGINT NOT NULL, currency TEXT NOT NULL, status TEXT NOT NULL, \
             provider_id TEXT, finished_by TEXT)",
            self.payment_id
        )
    }

    /// A pending payment of (account, amount, currency), returning its id
    /// (`RETURNING` on MySQL is MariaDB's, as in the conformance suite).
    pub fn insert_payment(&self, table: &str) -> String {
        let [account, amount, currency] = self.params;
        format!(
            "INSERT INTO {table} (account, amount, currency, status) \
             VALUES ({account}, {amount}, {currency}, 'pending') RETURNING id"
        )
    }

    /// Marks a payment succeeded: (provider id, attempt, payment id).
    pub fn mark_paid(&self, table: &str) -> String {
        let [provider_id, attempt, id] = self.params;
        format!(
            "UPDATE {table} SET status = 'succeeded', provider_id = {provider_id}, \
             finished_by = {attempt} WHERE id = {id}"
        )
    }

    /// The payments of (account), by id.
    pub fn payments(&self, table: &str) -> String {
        format!(
            "SELECT id, amount, currency, status, provider_id, finished_by \
             FROM {table} WHERE account = {} ORDER BY id",
            self.params[0]
        )
    }

    /// The key row of (scope, key) as a [`KeyRow`].
    pub fn key_row(&self, keys: &str) -> String {
        let Self {
            params: [scope, key, _],
            key: key_column,
            bigint,
            ..
        } = self;
        format!(
            "SELECT CAST(status AS {bigint}) AS status, \
                 CAST(COALESCE(attempts, 0) AS {bigint}) AS attempts \
             FROM {keys} WHERE scope = {scope} AND {key_column} = {key}"
        )
    }
}

/// The 201 of a payment.
pub fn created(payment: Payment) -> Response {
    let location = format!("{PATH}/{}", payment.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        axum::Json(payment),
    )
        .into_response()
}

/// What the handlers share.
pub struct PhasedState<DB: idem::Phased> {
    pub idem: Idem<DB>,
    /// The payments table.
    pub payments: Arc<str>,
    pub provider: ProviderApi,
    pub boundaries: Boundaries,
}

impl<DB: idem::Phased> Clone for PhasedState<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            payments: self.payments.clone(),
            provider: self.provider.clone(),
            boundaries: self.boundaries.clone(),
        }
    }
}

impl<DB: idem::Phased> FromRef<PhasedState<DB>> for Idem<DB> {
    fn from_ref(state: &PhasedState<DB>) -> Self {
        state.idem.clone()
    }
}

/// What an engine with the phased mode supplies.
pub trait PhasedDb: TestDb + idem::Phased + idem::Admin {
    /// How it spells the suite's SQL.
    const DIALECT: Dialect;
    /// A database of a test's own: the server's URL (tests keep to their
    /// tables), or a new file.
    fn fresh_database() -> String;
    /// A pool of `size` on `database`.
    fn open(database: &str, size: u32) -> impl Future<Output = Pool<Self>> + Send;
    /// Removes what [`fresh_database`](Self::fresh_database) made, once
    /// its pools are closed: nothing on a server, the file on SQLite.
    fn remove_database(database: &str) {
        let _ = database;
    }
    /// The phased service on this engine.
    fn phased_router(state: PhasedState<Self>) -> axum::Router;
    /// Creates the payments table `table`.
    fn create_payments(pool: &Pool<Self>, table: &str) -> impl Future<Output = ()> + Send;
    /// The payments of `account`, by id.
    fn payments(
        pool: &Pool<Self>,
        table: &str,
        account: &str,
    ) -> impl Future<Output = Vec<PaymentRow>> + Send;
    /// The row of `(scope, key)` in key table `keys`.
    fn key_row(
        pool: &Pool<Self>,
        keys: &str,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Option<KeyRow>> + Send;
}

/// The `PhasedDb` queries every engine runs alike, in its [`Dialect`].
#[macro_export]
macro_rules! phased_queries {
    () => {
        async fn create_payments(pool: &Pool<Self>, table: &str) {
            let ddl = <Self as $crate::phased::PhasedDb>::DIALECT.create_payments(table);
            sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
                .execute(pool)
                .await
                .unwrap_or_else(|error| panic!("create {table}: {error}"));
        }

        async fn payments(
            pool: &Pool<Self>,
            table: &str,
            account: &str,
        ) -> Vec<$crate::phased::PaymentRow> {
            let sql = <Self as $crate::phased::PhasedDb>::DIALECT.payments(table);
            let mut tx = pool.begin().await.unwrap();
            let rows = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(account)
                .persistent($crate::service::persistent())
                .fetch_all(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            rows
        }

        async fn key_row(
            pool: &Pool<Self>,
            keys: &str,
            scope: &str,
            key: &str,
        ) -> Option<$crate::phased::KeyRow> {
            let sql = <Self as $crate::phased::PhasedDb>::DIALECT.key_row(keys);
            let mut tx = pool.begin().await.unwrap();
            let row = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(scope.as_bytes())
                .bind(key.as_bytes())
                .persistent($crate::service::persistent())
                .fetch_optional(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            row
        }
    };
}

/// One annotated handler of `phased_app!`: the attribute's arguments
/// vary, the body is `pay`'s (`once`: its provider call is
/// `external_once`).
#[macro_export]
macro_rules! phased_handler {
    ($db:ty, $name:ident, $once:literal, $($arg:tt)*) => {
        #[idempotent($($arg)*)]
        pub async fn $name(
            account: Account,
            headers: HeaderMap,
            State(state): State<PhasedState<$db>>,
            phases: Phases<$db>,
            Json(new): Json<NewPayment>,
        ) -> Result<Response, PayError> {
            pay(account, headers, state, phases, new, $once).await
        }
    };
}

/// Stamps out, as `phased_handlers`, the phased handler (at [`PATH`] and
/// [`LONG_PATH`], their leases apart) and router for one engine.
#[macro_export]
macro_rules! phased_app {
    ($db:ty) => {
        pub mod phased_handlers {
            use axum::Json;
            use axum::extract::State;
            use axum::http::HeaderMap;
            use axum::response::Response;
            use idem::{Phases, idempotent};

            use $crate::phased::{
                self as phased, Account, Boundary, NewPayment, PayError, Payment, PhasedState,
            };

            async fn pay(
                account: Account,
                headers: HeaderMap,
                state: PhasedState<$db>,
                mut phases: Phases<$db>,
                new: NewPayment,
                once: bool,
            ) -> Result<Response, PayError> {
                let attempt = $crate::service::nonce();
                let marks = state.boundaries.attempt();
                marks.reach(Boundary::Claimed).await;
                let sql = &<$db as phased::PhasedDb>::DIALECT;
                let insert = sql.insert_payment(&state.payments);
                let refuse = phased::refuses_local(&headers);
                let id: i64 = phases
                    .local("pending", async |tx| -> Result<i64, PayError> {
                        let id = sqlx::query_scalar(sqlx::AssertSqlSafe(insert))
                            .bind(&account.0)
                            .bind(new.amount)
                            .bind(&new.currency)
                            .persistent($crate::service::persistent())
                            .fetch_one(tx)
                            .await?;
                        if refuse {
                            return Err(PayError::Refused);
                        }
                        Ok(id)
                    })
                    .await?;
                marks.reach(Boundary::Local).await;
                let step = async |key: String| {
                    marks.reach(Boundary::Calling).await;
                    state.provider.charge(&key, &new).await
                };
                let charge: phased::provider::Charge = if once {
                    phases.external_once("provider", step).await?
                } else {
                    phases.external("provider", step).await?
                };
                marks.reach(Boundary::Called).await;
                let tx = phases.last_phase().await?;
                sqlx::query(sqlx::AssertSqlSafe(sql.mark_paid(&state.payments)))
                    .bind(&charge.id)
                    .bind(&attempt)
                    .bind(id)
                    .persistent($crate::service::persistent())
                    .execute(tx)
                    .await?;
                marks.reach(Boundary::Final).await;
                Ok(phased::created(Payment {
                    id,
                    amount: new.amount,
                    currency: new.currency,
                    status: "succeeded".into(),
                    provider_id: charge.id,
                    attempt,
                }))
            }

            $crate::phased_handler!($db, create, false, scope = "account", lease = "2s");
            $crate::phased_handler!($db, create_once, true, scope = "account", lease = "2s");
            $crate::phased_handler!(
                $db,
                create_tombstoned,
                false,
                scope = "account",
                lease = "2s",
                ttl = "2s",
                tombstone = "6s"
            );
            $crate::phased_handler!($db, create_long, false, scope = "account", lease = "30s");

            pub fn router(state: PhasedState<$db>) -> axum::Router {
                use axum::routing::post;
                axum::Router::new()
                    .route(phased::PATH, post(create))
                    .route(phased::LONG_PATH, post(create_long))
                    .route(phased::ONCE_PATH, post(create_once))
                    .route(phased::TOMBSTONE_PATH, post(create_tombstoned))
                    .with_state(state)
            }
        }
    };
}

/// Where a phased service keeps its data and whom it pays.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// [`PhasedDb::fresh_database`]'s answer.
    pub database: String,
    /// The key table.
    pub keys: String,
    /// The payments table.
    pub payments: String,
    /// The provider's base URL.
    pub provider: String,
}

/// Env vars of the child process's server: the engine (and that it is
/// one), its [`ServiceConfig`], where it stops, whether it completes.
pub const CHILD_ENGINE: &str = "IDEM_PHASED_CHILD_ENGINE";
const CHILD_DATABASE: &str = "IDEM_PHASED_CHILD_DATABASE";
const CHILD_KEYS: &str = "IDEM_PHASED_CHILD_KEYS";
const CHILD_PAYMENTS: &str = "IDEM_PHASED_CHILD_PAYMENTS";
const CHILD_PROVIDER: &str = "IDEM_PHASED_CHILD_PROVIDER";
const CHILD_STOP_AT: &str = "IDEM_PHASED_CHILD_STOP_AT";
const CHILD_COMPLETE_EVERY_MS: &str = "IDEM_PHASED_CHILD_COMPLETE_EVERY_MS";

/// How a child process's server runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChildOptions {
    /// The first request to reach it stops there for good.
    pub stop_at: Option<Boundary>,
    /// Runs a completer that looks this often.
    pub complete_every: Option<Duration>,
}

impl ServiceConfig {
    /// The environment of a child process serving this config on `DB`.
    pub fn child_env<DB: PhasedDb>(&self, options: ChildOptions) -> Vec<(&'static str, String)> {
        let mut env = vec![
            (CHILD_ENGINE, DB::ENGINE.to_owned()),
            (CHILD_DATABASE, self.database.clone()),
            (CHILD_KEYS, self.keys.clone()),
            (CHILD_PAYMENTS, self.payments.clone()),
            (CHILD_PROVIDER, self.provider.clone()),
        ];
        if let Some(at) = options.stop_at {
            env.push((CHILD_STOP_AT, at.name().to_owned()));
        }
        if let Some(every) = options.complete_every {
            env.push((CHILD_COMPLETE_EVERY_MS, every.as_millis().to_string()));
        }
        env
    }

    fn from_child_env() -> (Self, ChildOptions) {
        let var = |name: &str| {
            std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run as a child only"))
        };
        let config = Self {
            database: var(CHILD_DATABASE),
            keys: var(CHILD_KEYS),
            payments: var(CHILD_PAYMENTS),
            provider: var(CHILD_PROVIDER),
        };
        let options = ChildOptions {
            stop_at: std::env::var(CHILD_STOP_AT)
                .ok()
                .map(|name| Boundary::parse(&name).expect("a boundary's name")),
            complete_every: std::env::var(CHILD_COMPLETE_EVERY_MS)
                .ok()
                .map(|ms| Duration::from_millis(ms.parse().expect("milliseconds"))),
        };
        (config, options)
    }
}

/// Connections of a service's pool: the handler holds one at a time, the
/// completer one more; a few dozen services at once stay far within
/// PostgreSQL's `max_connections`.
const SERVICE_POOL: u32 = 3;

/// The service's state on `config`, its tables created.
pub async fn state<DB: PhasedDb>(
    config: &ServiceConfig,
    boundaries: Boundaries,
) -> PhasedState<DB> {
    let pool = DB::open(&config.database, SERVICE_POOL).await;
    let idem = Idem::new(pool.clone())
        .table(&config.keys)
        .expect("a plain table name")
        .pooler(crate::service::pooler());
    idem.migrate().await.expect("migrate");
    DB::create_payments(&pool, &config.payments).await;
    PhasedState {
        idem,
        payments: config.payments.as_str().into(),
        provider: ProviderApi::new(&config.provider),
        boundaries,
    }
}

/// Serves `state`'s router on 127.0.0.1 until the task is aborted.
pub async fn serve<DB: PhasedDb>(
    state: PhasedState<DB>,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = DB::phased_router(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, task)
}

/// The server of a child process, configured by its environment: prints
/// `LISTENING <addr>`, then serves until it is killed.
pub async fn serve_as_child<DB: PhasedDb>() {
    let (config, options) = ServiceConfig::from_child_env();
    let boundaries = options
        .stop_at
        .map_or_else(Boundaries::none, Boundaries::stop_at);
    let state = state::<DB>(&config, boundaries).await;
    let idem = state.idem.clone();
    let router = DB::phased_router(state);
    if let Some(every) = options.complete_every {
        idem.completer(router.clone())
            .every(every)
            .backoff(Duration::from_millis(200))
            .spawn();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("LISTENING {}", listener.local_addr().unwrap());
    let _ = std::io::stdout().flush();
    axum::serve(listener, router).await.unwrap();
}
