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
//! - `IDEM_ENCRYPTION_KEYS`: set, `idem` encrypts what it stores (stored
//!   responses, and a payment's kept request and recovery points) with
//!   AES-256-GCM: comma-separated `id:base64-of-32-bytes` keys, newest last
//!   (`openssl rand -base64 32` makes one). New values are sealed with the
//!   newest key, stored ones opened with the key whose id they carry: to
//!   rotate, append a key; remove the old one once the keys it sealed have
//!   expired (24 h here). Unset (or empty), nothing is encrypted. A value
//!   that does not parse stops the start with the reason.
//! - `ADDR`: where to listen, default `127.0.0.1:3000`.
//! - `CHARGE_DELAY_MS`: the handler waits this long after its insert, to
//!   watch a concurrent retry get 409.
//! - `PROVIDER_URL`: the payment provider `POST /v1/payments` calls (run
//!   `cargo run --example provider`, then `PROVIDER_URL=http://127.0.0.1:3001`);
//!   unset, a fake provider runs inside this process (`PROVIDER_DELAY_MS`,
//!   `PROVIDER_FAIL_FIRST` and `PROVIDER_LOSE_ANSWERS` set its behaviour, as
//!   for the standalone one).
//! - `COMPLETER_ATTEMPTS`: how many times a payment whose attempt stopped
//!   after the provider may have been called is tried (the completer's
//!   resumptions and clients' retries together) before its outcome becomes
//!   uncertain (default 5, at least 1): every request with its key is then
//!   answered 409 `idempotency_outcome_uncertain`, for a person to resolve.
//! - `COMPLETER_EVERY_MS`: how often the completer looks for stopped
//!   payments, in milliseconds (default 2000, at least 1); its wait before
//!   trying one again backs off from the same period, doubling.
//! - `ADMIN_TOKEN`: set, `idem::admin` serves the operators' page at
//!   <http://127.0.0.1:3000/admin> (sign in with the token) and its JSON
//!   routes, which answer `Authorization: Bearer <ADMIN_TOKEN>` (401
//!   otherwise): `GET /admin/idempotency/{scope}` lists the account's
//!   recent keys (`?limit=`, default 50), `GET /admin/idempotency/{scope}/{key}`
//!   shows one (404 if absent), `DELETE` forgets a finished or expired key
//!   (204; 404 absent, 409 in flight or uncertain), so that its next
//!   request runs afresh, and `POST .../resolve` resolves an uncertain one.
//!   Unset, neither the page nor those routes exist.
//! - `NATS_URL` (`nats://127.0.0.1:4222`; a cluster's servers separated by
//!   commas): set, the outbox relay publishes
//!   each charge's `charge.created` message to NATS JetStream, in the stream
//!   `NATS_STREAM` (default `CHARGES`, created if missing with
//!   `NATS_STREAM_REPLICAS` copies, default 1; subjects
//!   `<NATS_SUBJECT_PREFIX>charge.>`), where `cargo run --example consumer`
//!   reads them. Unset, the relay prints each message instead. A broker that
//!   is down delays the messages, not the API.
//! - `BROKER`: `nats` (the default: `NATS_URL` above) or `rabbitmq`: the
//!   relay publishes to RabbitMQ at `AMQP_URL` (default
//!   `amqp://guest:guest@127.0.0.1:5672/%2f`), into the durable quorum
//!   queue `AMQP_QUEUE` (default `charges`, declared if missing), with
//!   publisher confirms; `BROKER=rabbitmq cargo run --example consumer`
//!   reads it.
//!
//! `POST /v1/payments` (same authorization and body as `/v1/charges`) is a
//! phased handler: a local phase writes a pending payment, the provider is
//! charged with a key derived from the request's, and the last phase marks
//! the payment succeeded and answers 201. Its lease is 5 s and the
//! completer looks every 2 s (`COMPLETER_EVERY_MS`), so a payment whose
//! server died mid-call is finished within about 10 s of the restart,
//! without the client. One whose provider never answers (try
//! `PROVIDER_LOSE_ANSWERS=1`) becomes uncertain after `COMPLETER_ATTEMPTS`
//! tries: charged or not, nobody can tell, and no try charges twice (the
//! provider gets the same derived key each time).
//!
//! The handlers are written once, generic over the engine; what differs
//! between engines is their SQL (`shared/sql.rs`). An `#[idempotent]`
//! handler names its `Tx<DB>` (or `Phases<DB>`), so it cannot be generic:
//! `idempotent_handlers!` gives each engine its two, which only extract the
//! request and call the generic ones, and `main` picks the engine.

use std::error::Error;
use std::time::Duration;

#[path = "shared/broker.rs"]
mod broker;
#[path = "shared/database.rs"]
mod database;
#[path = "shared/fake_provider.rs"]
mod fake_provider;
#[path = "shared/openapi.rs"]
mod openapi;
#[path = "shared/relay.rs"]
mod relay;
#[path = "shared/sql.rs"]
mod sql;
#[path = "shared/validate.rs"]
mod validate;

use axum::extract::{FromRef, FromRequestParts, Path, State};
use axum::handler::Handler;
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::{Idem, IdempotentHandler, Phases, Scope, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Pool;
use tokio::net::TcpListener;

use database::Database;
use sql::Sql;

/// The caller, from `Authorization: Bearer <account>`: the scope of its
/// idempotency keys, and the owner of its charges and payments.
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

/// A charge or payment to make: the body of both `POST`s.
#[derive(Deserialize, Serialize)]
struct NewCharge {
    #[serde(deserialize_with = "validate::positive_amount")]
    amount: i64,
    #[serde(deserialize_with = "validate::currency_code")]
    currency: String,
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

/// What the handlers share, on one engine.
struct AppState<DB: Sql> {
    idem: Idem<DB>,
    pool: Pool<DB>,
    /// `CHARGE_DELAY_MS`.
    delay: Duration,
    provider: Provider,
}

// Written out: `derive(Clone)` would ask the engine type itself to be
// `Clone`, and `derive(FromRef)` takes no generics.
impl<DB: Sql> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            pool: self.pool.clone(),
            delay: self.delay,
            provider: self.provider.clone(),
        }
    }
}

/// Where the `#[idempotent]` handlers find their store.
impl<DB: Sql> FromRef<AppState<DB>> for Idem<DB> {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.idem.clone()
    }
}

/// `POST /v1/charges`: inserts the charge and its `charge.created` message
/// in the request's transaction, which `idem` commits with the stored
/// response (`create_charge`, below, is the handler).
async fn charge<DB: Sql>(
    account: Account,
    mut tx: Tx<DB>,
    new: NewCharge,
    delay: Duration,
) -> Result<impl IntoResponse, ApiError> {
    let id = DB::insert_charge(&mut tx, &account.0, &new).await?;
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
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/v1/charges/{id}"))],
        Json(charge),
    ))
}

/// `GET /v1/charges/{id}`: one of the caller's charges.
async fn get_charge<DB: Sql>(
    account: Account,
    State(app): State<AppState<DB>>,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    // In a transaction: behind a transaction-mode pooler, a bound statement
    // outside one may be parsed on one server session and run on another.
    let mut tx = app.pool.begin().await?;
    let charge = DB::select_charge(&mut tx, &account.0, id).await?;
    tx.commit().await?;
    Ok(match charge {
        Some(charge) => Json(charge).into_response(),
        None => (StatusCode::NOT_FOUND, "no such charge\n").into_response(),
    })
}

/// `POST /v1/payments`, in phases (`create_payment`, below, is the
/// handler): a payment the provider charges cannot be in one transaction
/// with our writes.
async fn pay<DB: Sql>(
    account: Account,
    mut phases: Phases<DB>,
    new: NewCharge,
    provider: Provider,
) -> Result<impl IntoResponse, ApiError> {
    // Phase 1, committed with its recovery point: the payment exists,
    // pending, whatever happens next.
    let id: i64 = phases
        .local("pending", async |tx| -> Result<_, ApiError> {
            Ok(DB::insert_payment(tx, &account.0, &new).await?)
        })
        .await?;
    // The provider, with a key derived from the request's: a retry (ours,
    // or the completer's) charges no second time.
    let charge: ProviderCharge = phases
        .external("provider", async |key| provider.charge(&key, &new).await)
        .await?;
    // The last phase commits with the stored response.
    DB::mark_paid(phases.last_phase().await?, id, &charge.id).await?;
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

/// `GET /v1/payments/{id}`: one of the caller's payments.
async fn get_payment<DB: Sql>(
    account: Account,
    State(app): State<AppState<DB>>,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    // In a transaction, as `get_charge` reads.
    let mut tx = app.pool.begin().await?;
    let payment = DB::select_payment(&mut tx, &account.0, id).await?;
    tx.commit().await?;
    Ok(match payment {
        Some(payment) => Json(payment).into_response(),
        None => (StatusCode::NOT_FOUND, "no such payment\n").into_response(),
    })
}

/// The engine's two `#[idempotent]` handlers, `$engine::create_charge`
/// and `$engine::create_payment`: an `#[idempotent]` handler names its
/// `Tx<DB>` or `Phases<DB>`, so it cannot be generic. Each extracts the
/// request and calls its generic body above; the attribute's arguments
/// are the routes' idempotency policy.
macro_rules! idempotent_handlers {
    ($engine:ident, $db:ty) => {
        mod $engine {
            use super::*;

            // A retry that comes back after a day is refused, not charged
            // again, for 30 days.
            #[idempotent(scope = "account", ttl = "24h", tombstone = "30d")]
            pub async fn create_charge(
                account: Account,
                State(app): State<AppState<$db>>,
                tx: Tx<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<impl IntoResponse, ApiError> {
                charge(account, tx, new, app.delay).await
            }

            // A short lease, for a demo: the completer takes over a payment
            // whose server died mid-call within seconds.
            #[idempotent(scope = "account", lease = "5s")]
            pub async fn create_payment(
                account: Account,
                State(app): State<AppState<$db>>,
                phases: Phases<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<impl IntoResponse, ApiError> {
                pay(account, phases, new, app.provider).await
            }
        }
    };
}

#[cfg(feature = "postgres")]
idempotent_handlers!(postgres, sqlx::Postgres);
#[cfg(feature = "sqlite")]
idempotent_handlers!(sqlite, sqlx::Sqlite);
#[cfg(feature = "mysql")]
idempotent_handlers!(mysql, sqlx::MySql);

/// With no `DATABASE_URL`: a SQLite file next to where the example runs.
const DEFAULT_DATABASE: &str = "charges.db";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
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
    let completer = CompleterSettings::from_env()?;
    let listener = TcpListener::bind(&addr).await?;
    let provider = provider().await?;
    // The one place that names an engine: `DATABASE_URL`'s.
    match database::connect(DEFAULT_DATABASE, "charges").await? {
        #[cfg(feature = "sqlite")]
        Database::Sqlite(pool) => {
            let handlers = (sqlite::create_charge, sqlite::create_payment);
            serve(pool, handlers, listener, delay, provider, completer).await
        }
        #[cfg(feature = "postgres")]
        Database::Postgres(pool) => {
            let handlers = (postgres::create_charge, postgres::create_payment);
            serve(pool, handlers, listener, delay, provider, completer).await
        }
        #[cfg(feature = "mysql")]
        Database::MySql(pool) => {
            let handlers = (mysql::create_charge, mysql::create_payment);
            serve(pool, handlers, listener, delay, provider, completer).await
        }
    }
}

/// Migrates, then serves the API until the process ends: `create_charge`
/// and `create_payment` are the engine's `#[idempotent]` handlers.
async fn serve<DB, C, CArgs, P, PArgs>(
    pool: Pool<DB>,
    (create_charge, create_payment): (C, P),
    listener: TcpListener,
    delay: Duration,
    provider: Provider,
    completer: CompleterSettings,
) -> Result<(), Box<dyn Error>>
where
    DB: Sql,
    // `CArgs` and `PArgs` are axum's markers of the handlers' extractors.
    C: Handler<CArgs, AppState<DB>> + IdempotentHandler,
    P: Handler<PArgs, AppState<DB>> + IdempotentHandler,
    CArgs: 'static,
    PArgs: 'static,
{
    // The limit is the store's: clients' retries count toward it as the
    // completer's resumptions do.
    let idem = database::idem(&pool).max_attempts(completer.attempts);
    idem.migrate().await?;
    DB::create_tables(&mut *pool.acquire().await?).await?;
    idem.migrate_outbox().await?;
    idem.spawn_sweeper(Duration::from_secs(60));
    relay::spawn(&idem).await?;

    let app = Router::new()
        .route("/v1/charges", post(create_charge.clone()))
        .route("/v1/charges/{id}", get(get_charge::<DB>))
        .route("/v1/payments", post(create_payment.clone()))
        .route("/v1/payments/{id}", get(get_payment::<DB>))
        .with_state(AppState {
            idem: idem.clone(),
            pool,
            delay,
            provider,
        });
    // Resumes payments whose attempt stopped (a crash, a kill) within about
    // a period (two seconds by default) of their lease's end.
    idem.completer(app.clone())
        .every(completer.every)
        .backoff(completer.every)
        .spawn();
    let app = app.merge(openapi::router(&idem, create_charge, create_payment));
    // The operators' routes exist only with a token to guard them.
    let app = match std::env::var("ADMIN_TOKEN") {
        Ok(token) if !token.is_empty() => app.merge(idem::admin::router(idem, &token)),
        _ => app,
    };
    tracing::info!("charges API listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// How the completer finishes stopped payments: `COMPLETER_ATTEMPTS` and
/// `COMPLETER_EVERY_MS`.
#[derive(Clone, Copy)]
struct CompleterSettings {
    /// Tries of a payment before it becomes uncertain.
    attempts: u32,
    /// How often it looks, and its first wait before a try again.
    every: Duration,
}

impl CompleterSettings {
    /// Reads the two variables; a set but malformed (or zero) value is an
    /// error naming it, rather than a silent default.
    fn from_env() -> Result<Self, String> {
        let attempts = positive("COMPLETER_ATTEMPTS", 5)?;
        Ok(Self {
            attempts: u32::try_from(attempts)
                .map_err(|_| format!("COMPLETER_ATTEMPTS={attempts} is too large"))?,
            every: Duration::from_millis(positive("COMPLETER_EVERY_MS", 2000)?),
        })
    }
}

/// The environment variable `name` as an integer of at least 1, `default`
/// when unset.
fn positive(name: &str, default: u64) -> Result<u64, String> {
    let Ok(value) = std::env::var(name) else {
        return Ok(default);
    };
    match value.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{name}={value:?} is not an integer of at least 1")),
    }
}

/// The payment provider: charges with the idempotency key it is given.
#[derive(Clone)]
struct Provider {
    http: reqwest::Client,
    url: String,
}

/// What the provider answered a charge.
#[derive(Serialize, Deserialize)]
struct ProviderCharge {
    id: String,
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

/// The provider at `PROVIDER_URL`, or a fake one in this process.
async fn provider() -> Result<Provider, Box<dyn Error>> {
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
