//! The provider scenarios, not run by default
//! (`IDEM_BENCH_SCENARIOS=plain_provider,atomic_provider,two_phase_provider,phased`):
//! a payment that calls something outside the database. Each request
//! inserts a pending payment, charges a fake provider over HTTP on
//! loopback with a key derived from the request's, marks the payment paid
//! and answers 201. Written four ways in `handlers` (`plain_provider`
//! without idempotency, `atomic_provider` with `#[idempotent]` and `Tx`,
//! the transaction held over the call, `two_phase_provider` the
//! hand-written recipe, `phased` with `Phases`), with the statements below
//! (their text per engine in `handlers::Dialect`).
//!
//! The fake provider runs in the server's process (its CPU is the
//! server's): `POST /v1/payments` with an `Idempotency-Key` answers 201
//! `{"id": "pay_<n>"}` at once, with no delay and no memory of keys, so
//! what the scenarios compare is the database's part.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::app::NewCharge;
use crate::handlers::Dialect;

/// The external step's label: what the provider's key is derived for.
pub const STEP: &str = "provider";

/// The provider's client, as a service holds it.
#[derive(Clone)]
pub struct Provider {
    http: reqwest::Client,
    url: String,
}

/// What the provider answered a charge.
#[derive(Serialize, Deserialize)]
pub struct ProviderCharge {
    pub id: String,
}

impl Provider {
    /// Starts the fake provider on loopback in this process; its client.
    pub async fn start() -> Provider {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let fake = axum::Router::new()
            .route("/v1/payments", post(charge))
            .with_state(Arc::new(AtomicU64::new(0)));
        tokio::spawn(async move { axum::serve(listener, fake).await.unwrap() });
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .build()
            .expect("HTTP client");
        Provider {
            http,
            url: format!("http://{addr}/v1/payments"),
        }
    }

    /// Charges `new` with the idempotency key `key`.
    pub async fn charge(&self, key: &str, new: &NewCharge) -> Result<ProviderCharge, PayError> {
        let response = self
            .http
            .post(&self.url)
            .header("idempotency-key", key)
            .json(&serde_json::json!({"amount": new.amount, "currency": new.currency}))
            .send()
            .await
            .map_err(|error| PayError::Provider(error.to_string()))?;
        if response.status() != StatusCode::CREATED {
            return Err(PayError::Provider(format!(
                "answered {}",
                response.status()
            )));
        }
        response
            .json()
            .await
            .map_err(|error| PayError::Provider(error.to_string()))
    }
}

/// The fake provider's one route.
async fn charge(State(charges): State<Arc<AtomicU64>>, headers: HeaderMap) -> Response {
    if !headers.contains_key("idempotency-key") {
        return (StatusCode::BAD_REQUEST, "send an Idempotency-Key header").into_response();
    }
    let n = charges.fetch_add(1, Ordering::Relaxed) + 1;
    (
        StatusCode::CREATED,
        Json(ProviderCharge {
            id: format!("pay_{n}"),
        }),
    )
        .into_response()
}

/// The provider's key for the hand-written handlers: the same derivation
/// as `IdempotencyKey::derive`, which `phased` and `atomic_provider` get
/// from `idem`, so every scenario hashes alike.
pub fn derive(scope: &str, key: &str, label: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"idem-derive-v1");
    for part in [scope.as_bytes(), key.as_bytes(), label.as_bytes()] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

/// A payment, as every scenario answers it.
#[derive(Serialize)]
pub struct Payment {
    pub id: i64,
    pub account: String,
    pub amount: i64,
    pub currency: String,
    pub status: &'static str,
    pub provider_id: String,
}

impl Payment {
    pub fn paid(id: i64, account: &str, new: &NewCharge, charge: ProviderCharge) -> Self {
        Payment {
            id,
            account: account.to_owned(),
            amount: new.amount,
            currency: new.currency.clone(),
            status: "succeeded",
            provider_id: charge.id,
        }
    }
}

/// 201 with the payment.
pub fn created(payment: &Payment) -> Response {
    let location = format!("/payments/{}", payment.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(payment),
    )
        .into_response()
}

/// A pending payment, on the handler's transaction; its id. The same SQL
/// on every engine, in its [`Dialect`].
pub async fn insert_pending<DB>(
    conn: &mut DB::Connection,
    account: &str,
    new: &NewCharge,
) -> Result<i64, sqlx::Error>
where
    DB: Dialect,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q, 'r> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
{
    sqlx::query_scalar(DB::INSERT_PAYMENT)
        .bind(account)
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(&mut *conn)
        .await
}

/// Marks payment `id` paid by the provider's charge `provider_id`.
pub async fn mark_paid<DB>(
    conn: &mut DB::Connection,
    provider_id: &str,
    id: i64,
) -> Result<(), sqlx::Error>
where
    DB: Dialect,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(DB::MARK_PAID)
        .bind(provider_id)
        .bind(id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Why a payment failed: every error is answered 5xx (which `idem` never
/// stores), a phase's as `idem` answers it.
pub enum PayError {
    Database(sqlx::Error),
    /// The provider failed or could not be reached: 502.
    Provider(String),
    Phase(idem::PhaseError),
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
                (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
            }
            Self::Provider(error) => (StatusCode::BAD_GATEWAY, error).into_response(),
            Self::Phase(error) => error.into_response(),
        }
    }
}
