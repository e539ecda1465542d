//! A fake payment provider: the downstream API an idempotent handler calls.
//!
//! Shared by the examples through
//! `#[path = "shared/fake_provider.rs"] mod fake_provider;` (no `main` here).
//! It behaves like a real provider that honours `Idempotency-Key`, with two
//! knobs to make failures reproducible:
//!
//! - [`Settings::fail_first`]: the first N `POST`s (over all keys, in arrival
//!   order) answer `503` with `Retry-After: 1`, charging nothing.
//! - [`Settings::delay`]: every `POST` sleeps this long *after* its outcome is
//!   decided (and a charge recorded), so a caller killed during the delay
//!   leaves a charge behind, as when a provider processed a request but the
//!   response was lost.
//!
//! Routes:
//! - `POST /v1/payments`, header `Idempotency-Key`, JSON body with at least
//!   `amount` (integer > 0) and `currency` (string): `201` with
//!   `{"id": "pay_<n>", "amount", "currency", "status": "succeeded"}`; a
//!   repeated key replays the first answer with `Idempotent-Replayed: true`,
//!   or answers `422` if the body differs; a missing key or invalid body is a
//!   `400`. Every error body is JSON `{"error": "<message>"}`.
//! - `GET /v1/stats`: `{"calls": <POSTs so far>, "charges": <keys charged>}`.

// Each including example uses part of this API (`provider` serves, `charges`
// spawns), so the rest would be dead code in that build.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// How the fake provider misbehaves.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// Slept on every `POST` after its outcome is decided, before answering.
    pub delay: Duration,
    /// How many `POST`s, counted from the first, answer `503`.
    pub fail_first: u64,
}

impl Settings {
    /// Reads `PROVIDER_DELAY_MS` (milliseconds) and `PROVIDER_FAIL_FIRST`,
    /// both unsigned integers defaulting to 0 when unset.
    ///
    /// A set but malformed value (including an empty one) is an error naming
    /// the variable and its value, rather than a silent default.
    pub fn from_env() -> Result<Self, String> {
        Ok(Self {
            delay: Duration::from_millis(env_u64("PROVIDER_DELAY_MS")?),
            fail_first: env_u64("PROVIDER_FAIL_FIRST")?,
        })
    }
}

fn env_u64(name: &str) -> Result<u64, String> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(0),
        Err(std::env::VarError::NotUnicode(value)) => {
            Err(format!("{name}={value:?} is not an unsigned integer"))
        }
        Ok(value) => value
            .parse()
            .map_err(|_| format!("{name}={value:?} is not an unsigned integer")),
    }
}

/// The provider's `Router`, with fresh state (no calls, no charges).
pub fn router(settings: Settings) -> Router {
    let provider = Arc::new(Provider {
        settings,
        ledger: Mutex::new(Ledger::default()),
    });
    Router::new()
        .route("/v1/payments", post(create_payment))
        .route("/v1/stats", get(stats))
        .with_state(provider)
}

/// Serves [`router`] on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, settings: Settings) -> std::io::Result<()> {
    axum::serve(listener, router(settings)).await
}

/// Binds `127.0.0.1:0`, serves there in a tokio task and returns the address.
///
/// For in-process use: the task lives as long as the runtime; a serving
/// error is logged, as nobody awaits the task.
pub async fn spawn(settings: Settings) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(error) = serve(listener, settings).await {
            tracing::error!(%error, "fake provider stopped");
        }
    });
    Ok(addr)
}

struct Provider {
    settings: Settings,
    /// One lock for the call counter and the keys, so the fail-first order,
    /// the "seen this key?" check and the charge are one atomic step: two
    /// concurrent first calls of a key charge once. Never held across an
    /// `.await`.
    ledger: Mutex<Ledger>,
}

#[derive(Default)]
struct Ledger {
    /// Every `POST` so far, whatever its outcome.
    calls: u64,
    /// Only charged keys: a `503`, `400` or `422` records nothing. Its length
    /// is the number of charges, hence the next `pay_<n>`.
    payments: HashMap<String, Payment>,
}

/// A charged key: its request, to detect reuse with another body, and the
/// first answer, to replay.
struct Payment {
    request: Value,
    status: StatusCode,
    body: Value,
}

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

async fn create_payment(
    State(provider): State<Arc<Provider>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // A non-UTF-8 key counts as missing: it could not be echoed in a log.
    let key = headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let response = provider.decide(&key, &body);
    // After the decision (and the charge): a caller that gives up now has
    // still been charged.
    tokio::time::sleep(provider.settings.delay).await;
    response
}

impl Provider {
    /// Counts the call and decides its answer, charging if it is a new key.
    fn decide(&self, key: &str, body: &[u8]) -> Response {
        // A panic cannot leave the ledger half-updated (each step is one
        // insert or increment), so a poisoned lock is still consistent.
        let mut ledger = self.ledger.lock().unwrap_or_else(PoisonError::into_inner);
        ledger.calls += 1;
        let call = ledger.calls;

        if call <= self.settings.fail_first {
            tracing::info!(
                call,
                key,
                status = 503,
                outcome = "unavailable",
                "payment call"
            );
            let mut response = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "provider temporarily unavailable, retry later",
            );
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            return response;
        }
        if key.is_empty() {
            tracing::info!(
                call,
                key,
                status = 400,
                outcome = "missing key",
                "payment call"
            );
            return error(StatusCode::BAD_REQUEST, "send an Idempotency-Key header");
        }
        let (request, amount, currency) = match parse(body) {
            Ok(parsed) => parsed,
            Err(message) => {
                tracing::info!(
                    call,
                    key,
                    status = 400,
                    outcome = "invalid body",
                    "payment call"
                );
                return error(StatusCode::BAD_REQUEST, message);
            }
        };

        if let Some(payment) = ledger.payments.get(key) {
            if payment.request != request {
                tracing::info!(
                    call,
                    key,
                    status = 422,
                    outcome = "key reused with another body",
                    "payment call"
                );
                return error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "this Idempotency-Key was used with a different request body",
                );
            }
            tracing::info!(
                call,
                key,
                status = payment.status.as_u16(),
                outcome = "replayed",
                "payment call"
            );
            let mut response = (payment.status, axum::Json(payment.body.clone())).into_response();
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            return response;
        }

        let id = format!("pay_{}", ledger.payments.len() + 1);
        let body = json!({
            "id": id,
            "amount": amount,
            "currency": currency,
            "status": "succeeded",
        });
        tracing::info!(
            call,
            key,
            status = 201,
            outcome = "charged",
            id,
            "payment call"
        );
        ledger.payments.insert(
            key.to_owned(),
            Payment {
                request,
                status: StatusCode::CREATED,
                body: body.clone(),
            },
        );
        (StatusCode::CREATED, axum::Json(body)).into_response()
    }
}

/// The body as JSON, with its `amount` (integer > 0) and `currency`
/// (string); other fields are allowed and take part in the comparison.
fn parse(body: &[u8]) -> Result<(Value, u64, String), &'static str> {
    let request: Value =
        serde_json::from_slice(body).map_err(|_| "the body must be a JSON object")?;
    let object = request
        .as_object()
        .ok_or("the body must be a JSON object")?;
    let amount = object
        .get("amount")
        .and_then(Value::as_u64)
        .filter(|&amount| amount > 0)
        .ok_or("`amount` must be an integer greater than 0")?;
    let currency = object
        .get("currency")
        .and_then(Value::as_str)
        .ok_or("`currency` must be a string")?
        .to_owned();
    Ok((request, amount, currency))
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(json!({ "error": message }))).into_response()
}

async fn stats(State(provider): State<Arc<Provider>>) -> axum::Json<Value> {
    let ledger = provider
        .ledger
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    axum::Json(json!({
        "calls": ledger.calls,
        "charges": ledger.payments.len(),
    }))
}
