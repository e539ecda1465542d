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
//! - [`Settings::lose_answers`]: every `POST` has its outcome decided (and a
//!   charge recorded), then its connection is closed without a byte of
//!   answer: the caller sees a connection error and never a status, and
//!   cannot know whether it was charged.
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
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::{IncomingStream, Listener};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// How the fake provider misbehaves.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// Slept on every `POST` after its outcome is decided, before answering.
    pub delay: Duration,
    /// How many `POST`s, counted from the first, answer `503`.
    pub fail_first: u64,
    /// Every `POST`, once decided (and charged), closes its connection
    /// instead of answering.
    pub lose_answers: bool,
}

impl Settings {
    /// Reads `PROVIDER_DELAY_MS` (milliseconds) and `PROVIDER_FAIL_FIRST`,
    /// both unsigned integers defaulting to 0 when unset, and
    /// `PROVIDER_LOSE_ANSWERS`, `1` (on) or `0` (off, the default).
    ///
    /// A set but malformed value (including an empty one) is an error naming
    /// the variable and its value, rather than a silent default.
    pub fn from_env() -> Result<Self, String> {
        let lose_answers = match env_u64("PROVIDER_LOSE_ANSWERS")? {
            0 => false,
            1 => true,
            other => return Err(format!("PROVIDER_LOSE_ANSWERS={other:?} is not 0 or 1")),
        };
        Ok(Self {
            delay: Duration::from_millis(env_u64("PROVIDER_DELAY_MS")?),
            fail_first: env_u64("PROVIDER_FAIL_FIRST")?,
            lose_answers,
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

/// The provider's `Router`, with fresh state (no calls, no charges). Served
/// on a [`Cuttable`] listener, whose connections it can close unanswered.
fn router(settings: Settings) -> Router {
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
pub async fn serve(listener: TcpListener, settings: Settings) -> io::Result<()> {
    let app = router(settings).into_make_service_with_connect_info::<Cut>();
    axum::serve(Cuttable(listener), app).await
}

/// Binds `127.0.0.1:0`, serves there in a tokio task and returns the address.
///
/// For in-process use: the task lives as long as the runtime; a serving
/// error is logged, as nobody awaits the task.
pub async fn spawn(settings: Settings) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
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
    ConnectInfo(cut): ConnectInfo<Cut>,
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
    if provider.settings.lose_answers {
        // Decided and recorded, never told: the connection fails before
        // the response's first byte (see `Cuttable`).
        tracing::info!(key, "payment answer lost: closing the connection");
        cut.cut();
    }
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

/// A listener whose connections a handler can close without an answer:
/// each connection's [`Cut`] reaches the handler as its `ConnectInfo`.
struct Cuttable(TcpListener);

/// One connection's switch: once [`cut`](Self::cut), its reads and writes
/// fail, so the server closes it before writing the response it was given.
#[derive(Clone, Default)]
pub struct Cut(Arc<AtomicBool>);

impl Cut {
    /// Closes the connection instead of answering on it.
    fn cut(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_cut(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A connection of a [`Cuttable`] listener.
struct CuttableStream {
    stream: TcpStream,
    cut: Cut,
}

impl Listener for Cuttable {
    type Io = CuttableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (stream, addr) = Listener::accept(&mut self.0).await;
        let cut = Cut::default();
        (CuttableStream { stream, cut }, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

impl Connected<IncomingStream<'_, Cuttable>> for Cut {
    fn connect_info(stream: IncomingStream<'_, Cuttable>) -> Self {
        stream.io().cut.clone()
    }
}

fn aborted() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "answer lost on purpose")
}

impl AsyncRead for CuttableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.cut.is_cut() {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for CuttableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // hyper writes nothing of a response before the handler returns
        // it, so a cut made in the handler fails its first byte.
        if self.cut.is_cut() {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.cut.is_cut() {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
