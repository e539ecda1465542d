//! A small payments API whose `POST /v1/charges` is safe to retry.
//!
//! ```text
//! cargo run --example charges
//! curl -i -X POST localhost:3000/v1/charges -H 'Authorization: Bearer acct_1' \
//!      -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' \
//!      -d '{"amount": 1250, "currency": "eur"}'
//! ```
//!
//! Environment:
//! - `DATABASE_URL`: unset, the API keeps its data in the SQLite file
//!   `charges.db` in the working directory (created on first start, path
//!   printed); `postgres://...`, `mysql://...` (`--features mysql`) or
//!   `sqlite:...` choose the database instead.
//! - `DATABASE_POOLER`: `transaction` when `DATABASE_URL` is a
//!   transaction-mode pooler (PgBouncer's `pool_mode = transaction`):
//!   every statement, `idem`'s and the example's, then keeps nothing in the
//!   session (no statement prepared by name, reads inside a transaction).
//! - `ADDR`: where to listen, default `127.0.0.1:3000`.
//! - `CHARGE_DELAY_MS`: the handler waits this long after its insert, to
//!   watch a concurrent retry get 409.
//! - `PROVIDER_URL`: the payment provider `POST /v1/payments` calls (run
//!   `cargo run --example provider`, then `PROVIDER_URL=http://127.0.0.1:3001`);
//!   unset, a fake provider runs inside this process (`PROVIDER_DELAY_MS` and
//!   `PROVIDER_FAIL_FIRST` set its behaviour, as for the standalone one).
//! - `ADMIN_TOKEN`: set, the operators' routes answer requests with
//!   `Authorization: Bearer <ADMIN_TOKEN>` (401 otherwise):
//!   `GET /admin/idempotency/{scope}` lists the account's recent keys
//!   (`?limit=`, default 50), `GET /admin/idempotency/{scope}/{key}` shows
//!   one (404 if absent) and `DELETE` forgets a finished or expired key
//!   (204; 404 absent, 409 in flight), so that its next request runs
//!   afresh. Unset, those routes do not exist.
//! - `NATS_URL` (`nats://127.0.0.1:4222`; a cluster's servers separated by
//!   commas): set, the outbox relay publishes
//!   each charge's `charge.created` message to NATS JetStream, in the stream
//!   `NATS_STREAM` (default `CHARGES`, created if missing with
//!   `NATS_STREAM_REPLICAS` copies, default 1; subjects
//!   `<NATS_SUBJECT_PREFIX>charge.>`), where `cargo run --example consumer`
//!   reads them. Unset, the relay prints each message instead. A broker that
//!   is down delays the messages, not the API.
//!
//! `POST /v1/payments` (same authorization and body as `/v1/charges`) is a
//! phased handler: a local phase writes a pending payment, the provider is
//! charged with a key derived from the request's, and the last phase marks
//! the payment succeeded and answers 201. Its lease is 5 s and the
//! completer looks every 2 s, so a payment whose server died mid-call is
//! finished within about 10 s of the restart, without the client.
//!
//! The handlers are written once, in `charges_api!`, and stamped out per
//! engine (an `#[idempotent]` handler names its `Tx<DB>`, so it cannot be
//! generic); what differs between engines is the [`Dialect`] below.

use std::future::Future;
use std::time::Duration;

#[path = "shared/admin.rs"]
mod admin;
#[path = "shared/broker.rs"]
mod broker;
#[path = "shared/database.rs"]
mod database;
use database::Database;
#[path = "shared/fake_provider.rs"]
mod fake_provider;
#[path = "shared/openapi.rs"]
mod openapi;

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use idem::Scope;
use serde::{Deserialize, Serialize};

/// The caller, from `Authorization: Bearer <account>`.
struct Account(String);

impl Scope for Account {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

/// The completer resumes a payment without the caller's credentials: the
/// account is the scope the payment's key was stored under.
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
            .get(axum::http::header::AUTHORIZATION)
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

#[derive(Deserialize, Serialize)]
struct NewCharge {
    #[serde(deserialize_with = "positive_amount")]
    amount: i64,
    #[serde(deserialize_with = "currency_code")]
    currency: String,
}

/// A currency is an ISO 4217 code, three ASCII letters (`eur`): any other
/// string is answered 422, where a database would refuse it (a NUL in
/// PostgreSQL, more than the column holds in MySQL) with a 500.
fn currency_code<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let code = String::deserialize(deserializer)?;
    if code.len() == 3 && code.bytes().all(|b| b.is_ascii_alphabetic()) {
        Ok(code)
    } else {
        Err(serde::de::Error::custom(
            "expected a currency code of three letters, such as \"eur\"",
        ))
    }
}

/// An amount is a whole number above zero (`1250`, or `1250.0`, the same
/// number in JSON): anything else is the client's mistake, answered 422
/// before any work, rather than the provider's refusal answered 502.
fn positive_amount<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    let number = serde_json::Number::deserialize(deserializer)?;
    let amount = number.as_i64().or_else(|| {
        // Below 2^63, where an integral double is exactly an i64.
        let float = number.as_f64()?;
        (float.fract() == 0.0 && float.abs() < 9.2e18).then_some(float as i64)
    });
    match amount {
        Some(amount) if amount > 0 => Ok(amount),
        _ => Err(serde::de::Error::custom(format!(
            "expected a whole number above 0, found {number}"
        ))),
    }
}

#[derive(Serialize)]
struct Charge {
    id: i64,
    amount: i64,
    currency: String,
}

#[derive(Serialize)]
struct Payment {
    id: i64,
    amount: i64,
    currency: String,
    status: String,
    provider_id: Option<String>,
}

/// What the provider answered a charge.
#[derive(Serialize, Deserialize)]
struct ProviderCharge {
    id: String,
}

/// Every error is answered 5xx, which `idem` never stores: the transaction
/// (or phase) rolls back and a retry runs again.
enum ApiError {
    Database(sqlx::Error),
    /// The provider failed or could not be reached: 502.
    Provider(String),
    Phase(idem::PhaseError),
    /// The outbox message could not be written: the charge rolls back too.
    Outbox(idem::Error),
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl From<idem::Error> for ApiError {
    fn from(error: idem::Error) -> Self {
        Self::Outbox(error)
    }
}

impl From<idem::PhaseError> for ApiError {
    fn from(error: idem::PhaseError) -> Self {
        Self::Phase(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Database(error) => {
                tracing::error!(%error, "database error");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response()
            }
            Self::Provider(error) => {
                tracing::warn!(%error, "payment provider failed");
                (StatusCode::BAD_GATEWAY, "payment provider unavailable\n").into_response()
            }
            Self::Phase(error) => error.into_response(),
            Self::Outbox(error) => {
                tracing::error!(%error, "outbox error");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response()
            }
        }
    }
}

/// The payment provider: charges with the idempotency key it is given.
#[derive(Clone)]
struct Provider {
    http: reqwest::Client,
    url: String,
}

impl Provider {
    async fn charge(&self, key: &str, new: &NewCharge) -> Result<ProviderCharge, ApiError> {
        let response = self
            .http
            .post(format!("{}/v1/payments", self.url))
            .header("Idempotency-Key", key)
            .json(&serde_json::json!({"amount": new.amount, "currency": new.currency}))
            .send()
            .await
            .map_err(|error| ApiError::Provider(error.to_string()))?;
        if !response.status().is_success() {
            return Err(ApiError::Provider(format!(
                "answered {}",
                response.status()
            )));
        }
        response
            .json()
            .await
            .map_err(|error| ApiError::Provider(error.to_string()))
    }
}

/// What the API's SQL looks like on one engine.
trait Dialect: idem::Backend {
    /// Creates the `charges` table if it is missing.
    const CREATE_CHARGES: &'static str;
    /// One charge by `(id, account)`.
    const SELECT_CHARGE: &'static str;

    /// Inserts a charge and returns its id, on the request's transaction.
    fn insert_charge(
        conn: &mut Self::Connection,
        account: &str,
        charge: &NewCharge,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
}

#[cfg(feature = "postgres")]
impl Dialect for sqlx::Postgres {
    const CREATE_CHARGES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
        currency text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())";
    const SELECT_CHARGE: &'static str =
        "SELECT id, amount, currency FROM charges WHERE id = $1 AND account = $2";

    async fn insert_charge(
        conn: &mut sqlx::PgConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO charges (account, amount, currency) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(account)
        .bind(charge.amount)
        .bind(&charge.currency)
        .persistent(crate::database::persistent())
        .fetch_one(conn)
        .await
    }
}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::Sqlite {
    const CREATE_CHARGES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)";
    const SELECT_CHARGE: &'static str =
        "SELECT id, amount, currency FROM charges WHERE id = ? AND account = ?";

    async fn insert_charge(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO charges (account, amount, currency) VALUES (?, ?, ?) RETURNING id",
        )
        .bind(account)
        .bind(charge.amount)
        .bind(&charge.currency)
        .persistent(crate::database::persistent())
        .fetch_one(conn)
        .await
    }
}

#[cfg(feature = "mysql")]
impl Dialect for sqlx::MySql {
    const CREATE_CHARGES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
        amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL,
        created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB";
    const SELECT_CHARGE: &'static str =
        "SELECT id, amount, currency FROM charges WHERE id = ? AND account = ?";

    async fn insert_charge(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        // MySQL has no `INSERT ... RETURNING`; the id comes with the result.
        let done = sqlx::query("INSERT INTO charges (account, amount, currency) VALUES (?, ?, ?)")
            .bind(account)
            .bind(charge.amount)
            .bind(&charge.currency)
            .persistent(crate::database::persistent())
            .execute(conn)
            .await?;
        i64::try_from(done.last_insert_id()).map_err(|error| sqlx::Error::Decode(error.into()))
    }
}

/// The SQL of payments.
trait Payments: Dialect + idem::Phased {
    const CREATE_PAYMENTS: &'static str;
    /// Marks payment `$2` succeeded with the provider's id `$1`.
    const MARK_PAID: &'static str;
    /// One payment by `(id, account)`.
    const SELECT_PAYMENT: &'static str;

    /// Inserts a pending payment and returns its id.
    fn insert_payment(
        conn: &mut Self::Connection,
        account: &str,
        payment: &NewCharge,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
}

#[cfg(feature = "postgres")]
impl Payments for sqlx::Postgres {
    const CREATE_PAYMENTS: &'static str = "CREATE TABLE IF NOT EXISTS payments (
        id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
        currency text NOT NULL, status text NOT NULL, provider_id text,
        created_at timestamptz NOT NULL DEFAULT now())";
    const MARK_PAID: &'static str =
        "UPDATE payments SET status = 'succeeded', provider_id = $1 WHERE id = $2";
    const SELECT_PAYMENT: &'static str = "SELECT id, amount, currency, status, provider_id \
         FROM payments WHERE id = $1 AND account = $2";

    async fn insert_payment(
        conn: &mut sqlx::PgConnection,
        account: &str,
        payment: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO payments (account, amount, currency, status) \
             VALUES ($1, $2, $3, 'pending') RETURNING id",
        )
        .bind(account)
        .bind(payment.amount)
        .bind(&payment.currency)
        .persistent(crate::database::persistent())
        .fetch_one(conn)
        .await
    }
}

#[cfg(feature = "sqlite")]
impl Payments for sqlx::Sqlite {
    const CREATE_PAYMENTS: &'static str = "CREATE TABLE IF NOT EXISTS payments (
        id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, status TEXT NOT NULL, provider_id TEXT,
        created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)";
    const MARK_PAID: &'static str =
        "UPDATE payments SET status = 'succeeded', provider_id = ? WHERE id = ?";
    const SELECT_PAYMENT: &'static str = "SELECT id, amount, currency, status, provider_id \
         FROM payments WHERE id = ? AND account = ?";

    async fn insert_payment(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        payment: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO payments (account, amount, currency, status) \
             VALUES (?, ?, ?, 'pending') RETURNING id",
        )
        .bind(account)
        .bind(payment.amount)
        .bind(&payment.currency)
        .persistent(crate::database::persistent())
        .fetch_one(conn)
        .await
    }
}

#[cfg(feature = "mysql")]
impl Payments for sqlx::MySql {
    const CREATE_PAYMENTS: &'static str = "CREATE TABLE IF NOT EXISTS payments (
        id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
        amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL, status VARCHAR(16) NOT NULL,
        provider_id VARCHAR(64) NULL,
        created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB";
    const MARK_PAID: &'static str =
        "UPDATE payments SET status = 'succeeded', provider_id = ? WHERE id = ?";
    const SELECT_PAYMENT: &'static str = "SELECT id, amount, currency, status, provider_id \
         FROM payments WHERE id = ? AND account = ?";

    async fn insert_payment(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        payment: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        let done = sqlx::query(
            "INSERT INTO payments (account, amount, currency, status) VALUES (?, ?, ?, 'pending')",
        )
        .bind(account)
        .bind(payment.amount)
        .bind(&payment.currency)
        .persistent(crate::database::persistent())
        .execute(conn)
        .await?;
        i64::try_from(done.last_insert_id()).map_err(|error| sqlx::Error::Decode(error.into()))
    }
}

/// `POST /v1/payments` and `GET /v1/payments/{id}` on one engine with the
/// phased mode.
macro_rules! payments_api {
    ($module:ident, $db:ty) => {
        mod $module {
            use axum::extract::{FromRef, Path, State};
            use axum::http::{StatusCode, header};
            use axum::response::{IntoResponse, Response};
            use axum::routing::{get, post};
            use axum::{Json, Router};
            use idem::{Idem, Phases, idempotent};
            use sqlx::Pool;

            use crate::{
                Account, ApiError, NewCharge, Payment, Payments, Provider, ProviderCharge,
            };

            #[derive(Clone, FromRef)]
            struct PaymentsState {
                idem: Idem<$db>,
                pool: Pool<$db>,
                provider: Provider,
            }

            #[idempotent(scope = "account", lease = "5s")]
            pub(crate) async fn create_payment(
                account: Account,
                State(provider): State<Provider>,
                mut phases: Phases<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<impl IntoResponse, ApiError> {
                // Phase 1, committed with its recovery point: the payment
                // exists, pending, whatever happens next.
                let id: i64 = phases
                    .local("pending", async |tx| -> Result<_, ApiError> {
                        Ok(<$db as Payments>::insert_payment(tx, &account.0, &new).await?)
                    })
                    .await?;
                // The provider, with a key derived from the request's: a
                // retry (ours, or the completer's) charges no second time.
                let charge: ProviderCharge = phases
                    .external("provider", async |key| provider.charge(&key, &new).await)
                    .await?;
                // The last phase commits with the stored response.
                let tx = phases.last_phase().await?;
                sqlx::query(<$db as Payments>::MARK_PAID)
                    .bind(&charge.id)
                    .bind(id)
                    .persistent(crate::database::persistent())
                    .execute(tx)
                    .await?;
                let payment = Payment {
                    id,
                    amount: new.amount,
                    currency: new.currency,
                    status: "succeeded".into(),
                    provider_id: Some(charge.id),
                };
                Ok((
                    StatusCode::CREATED,
                    [(header::LOCATION, format!("/v1/payments/{id}"))],
                    Json(payment),
                ))
            }

            async fn get_payment(
                account: Account,
                State(pool): State<Pool<$db>>,
                Path(id): Path<i64>,
            ) -> Result<Response, ApiError> {
                // In a transaction: behind a transaction-mode pooler, a
                // bound statement outside one may be parsed on one server
                // session and run on another.
                let mut tx = pool.begin().await?;
                let payment: Option<(i64, i64, String, String, Option<String>)> =
                    sqlx::query_as(<$db as Payments>::SELECT_PAYMENT)
                        .bind(id)
                        .bind(&account.0)
                        .persistent(crate::database::persistent())
                        .fetch_optional(&mut *tx)
                        .await?;
                tx.commit().await?;
                Ok(match payment {
                    Some((id, amount, currency, status, provider_id)) => Json(Payment {
                        id,
                        amount,
                        currency,
                        status,
                        provider_id,
                    })
                    .into_response(),
                    None => (StatusCode::NOT_FOUND, "no such payment\n").into_response(),
                })
            }

            /// The payment routes, their table created.
            pub async fn router(
                idem: Idem<$db>,
                pool: Pool<$db>,
                provider: Provider,
            ) -> Result<Router, sqlx::Error> {
                sqlx::raw_sql(<$db as Payments>::CREATE_PAYMENTS)
                    .execute(&pool)
                    .await?;
                Ok(Router::new()
                    .route("/v1/payments", post(create_payment))
                    .route("/v1/payments/{id}", get(get_payment))
                    .with_state(PaymentsState {
                        idem,
                        pool,
                        provider,
                    }))
            }
        }
    };
}

#[cfg(feature = "postgres")]
payments_api!(postgres_payments, sqlx::Postgres);
#[cfg(feature = "sqlite")]
payments_api!(sqlite_payments, sqlx::Sqlite);
#[cfg(feature = "mysql")]
payments_api!(mysql_payments, sqlx::MySql);

/// The API on one engine: its state, its two handlers and its server.
macro_rules! charges_api {
    ($engine:ident, $db:ty, payments = $payments:ident) => {
        mod $engine {
            use std::time::Duration;

            use axum::extract::{FromRef, Path, State};
            use axum::http::{StatusCode, header};
            use axum::response::{IntoResponse, Response};
            use axum::routing::{get, post};
            use axum::{Json, Router};
            use idem::{Idem, Tx, idempotent};
            use sqlx::Pool;

            use crate::{Account, ApiError, Charge, Dialect, NewCharge, Provider};

            #[derive(Clone, FromRef)]
            struct AppState {
                idem: Idem<$db>,
                pool: Pool<$db>,
                delay: Duration,
            }

            #[idempotent(scope = "account", ttl = "24h")]
            async fn create_charge(
                account: Account,
                State(delay): State<Duration>,
                mut tx: Tx<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<impl IntoResponse, ApiError> {
                let id = <$db as Dialect>::insert_charge(&mut tx, &account.0, &new).await?;
                // Committed with the charge, or not at all; a replay adds none.
                let event = serde_json::json!({
                    "charge_id": id,
                    "account": account.0,
                    "amount": new.amount,
                    "currency": new.currency,
                });
                tx.outbox("charge.created", &event).await?;
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let charge = Charge {
                    id,
                    amount: new.amount,
                    currency: new.currency,
                };
                let location = format!("/v1/charges/{id}");
                Ok((
                    StatusCode::CREATED,
                    [(header::LOCATION, location)],
                    Json(charge),
                ))
            }

            async fn get_charge(
                account: Account,
                State(pool): State<Pool<$db>>,
                Path(id): Path<i64>,
            ) -> Result<Response, ApiError> {
                // In a transaction, as `get_payment` reads.
                let mut tx = pool.begin().await?;
                let charge: Option<(i64, i64, String)> =
                    sqlx::query_as(<$db as Dialect>::SELECT_CHARGE)
                        .bind(id)
                        .bind(&account.0)
                        .persistent(crate::database::persistent())
                        .fetch_optional(&mut *tx)
                        .await?;
                tx.commit().await?;
                Ok(match charge {
                    Some((id, amount, currency)) => Json(Charge {
                        id,
                        amount,
                        currency,
                    })
                    .into_response(),
                    None => (StatusCode::NOT_FOUND, "no such charge\n").into_response(),
                })
            }

            /// Migrates and serves until the process ends.
            pub async fn serve(
                pool: Pool<$db>,
                listener: tokio::net::TcpListener,
                delay: Duration,
                provider: Provider,
            ) -> Result<(), Box<dyn std::error::Error>> {
                let idem = crate::database::idem(&pool);
                idem.migrate().await?;
                sqlx::raw_sql(<$db as Dialect>::CREATE_CHARGES)
                    .execute(&pool)
                    .await?;
                idem.spawn_sweeper(Duration::from_secs(60));
                idem.migrate_outbox().await?;
                crate::spawn_relay(&idem).await?;

                let app = Router::new()
                    .route("/v1/charges", post(create_charge))
                    .route("/v1/charges/{id}", get(get_charge))
                    .with_state(AppState {
                        idem: idem.clone(),
                        pool: pool.clone(),
                        delay,
                    });
                let app = app.merge(crate::$payments::router(idem.clone(), pool, provider).await?);
                // Resumes payments whose attempt stopped (a crash, a kill)
                // within about two seconds of their lease's end.
                idem.completer(app.clone())
                    .every(Duration::from_secs(2))
                    .spawn();
                let app = app.merge(crate::openapi::router(
                    &idem,
                    create_charge,
                    crate::$payments::create_payment,
                ));
                // The operators' routes exist only with a token to guard them.
                let app = match std::env::var("ADMIN_TOKEN") {
                    Ok(token) if !token.is_empty() => app.merge(crate::admin::router(idem, &token)),
                    _ => app,
                };
                tracing::info!("charges API listening on http://{}", listener.local_addr()?);
                axum::serve(listener, app).await?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "postgres")]
charges_api!(postgres, sqlx::Postgres, payments = postgres_payments);
#[cfg(feature = "sqlite")]
charges_api!(sqlite, sqlx::Sqlite, payments = sqlite_payments);
#[cfg(feature = "mysql")]
charges_api!(mysql, sqlx::MySql, payments = mysql_payments);

/// With no `DATABASE_URL`: a SQLite file next to where the example runs.
const DEFAULT_DATABASE: &str = "charges.db";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let delay = Duration::from_millis(
        std::env::var("CHARGE_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let provider = provider().await?;
    match database::connect(DEFAULT_DATABASE, "charges").await? {
        #[cfg(feature = "sqlite")]
        Database::Sqlite(pool) => sqlite::serve(pool, listener, delay, provider).await,
        #[cfg(feature = "postgres")]
        Database::Postgres(pool) => postgres::serve(pool, listener, delay, provider).await,
        #[cfg(feature = "mysql")]
        Database::MySql(pool) => mysql::serve(pool, listener, delay, provider).await,
    }
}

/// Spawns the outbox relay: to NATS JetStream at `NATS_URL`, or, unset, to
/// a sink printing one line per message.
async fn spawn_relay<DB: idem::Backend>(
    idem: &idem::Idem<DB>,
) -> Result<(), Box<dyn std::error::Error>> {
    // Short waits, for a demo: a lease twice the delivery timeout (its
    // minimum) plus margin, so a killed server's messages go out again
    // within 10 s of its restart; a message failing to go is retried
    // after 0.5 s, 1 s, 2 s, ... at most 5 s apart.
    fn tuned<DB: idem::Backend, S: idem::Sink>(relay: idem::Relay<DB, S>) -> idem::Relay<DB, S> {
        relay
            .every(Duration::from_millis(200))
            .delivery_timeout(Duration::from_secs(3))
            .lease(Duration::from_secs(10))
            .backoff(Duration::from_millis(500))
            .max_backoff(Duration::from_secs(5))
    }
    match std::env::var("NATS_URL") {
        Ok(url) if !url.is_empty() => {
            let broker = broker::Broker::from_env(url);
            let jetstream = broker.connect().await?;
            let sink = idem::nats::JetStream::new(jetstream.clone()).subject_prefix(&broker.prefix);
            tracing::info!(
                "outbox relay publishing to NATS stream {} (subjects {})",
                broker.stream,
                broker.subject("charge.>")
            );
            // Until the stream exists, publishes fail and are retried.
            tokio::spawn(async move { broker.stream(&jetstream).await });
            tuned(idem.relay(sink)).spawn();
        }
        _ => {
            tracing::info!("NATS_URL is not set: the outbox relay prints each message");
            let print = idem::sink_fn(async |message: idem::Message| {
                let payload = String::from_utf8_lossy(&message.payload);
                println!("outbox {} {} {payload}", message.topic, message.id);
                Ok(())
            });
            tuned(idem.relay(print)).spawn();
        }
    }
    Ok(())
}

/// The provider at `PROVIDER_URL`, or a fake one in this process.
async fn provider() -> Result<Provider, Box<dyn std::error::Error>> {
    let url = match std::env::var("PROVIDER_URL") {
        Ok(url) => url.trim_end_matches('/').to_owned(),
        Err(_) => {
            let addr = fake_provider::spawn(fake_provider::Settings::from_env()?).await?;
            tracing::info!(
                "PROVIDER_URL is not set: a fake provider runs in-process on http://{addr}"
            );
            format!("http://{addr}")
        }
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    Ok(Provider { http, url })
}
