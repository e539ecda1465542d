//! The peer `idem` is measured against: the `idempotent` crate 0.3 (its
//! [`ValkeyStore`] on Redis) behind the thin axum middleware a team writes
//! around it, following the crate's documented flow: claim the key with the
//! request's fingerprint, run the handler, complete the claim with the
//! response under its fencing token.
//!
//! 0.3 has no HTTP layer; where it leaves a choice this one does what the
//! crate's later `IdempotencyLayer` does: the operation hashed is the method
//! and the path with its query, the body byte for byte; a running key is
//! 409 (`retry-after: 1`), a key reused with another request 400, a store
//! failure 503 (`retry-after: 5`); keys are scoped by a hash of the caller;
//! the handler runs in a task of its own, so a client that hangs up cannot
//! cancel it mid side effect; whatever it answers is cached, except a
//! `cache-control: no-store` answer, whose claim is removed; a replay
//! carries `idempotent-replayed: true`; a completion the store refuses
//! still sends the handler's response. Two leases, as the later crate has:
//! the claim's (how long a dead worker holds the key) and the completed
//! entry's (how long retries replay).
//!
//! What the store keeps is the crate's [`CachedResponse`]: a status and a
//! body. 0.3's `Metadata` can be neither filled nor read, so a replay
//! carries no header of the original (no `content-type`, no `location`).

use std::error::Error as _;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::LengthLimitError;
use idempotent::entry::{ExistingEntry, FencingToken, Processing};
use idempotent::fingerprint::{DefaultFingerprintStrategy, FingerprintStrategy};
use idempotent::store::valkey::{ValkeyError, ValkeyStore};
use idempotent::store::{IdempotencyStore, InsertResult};
use idempotent::{CachedResponse, Fingerprint, IdempotencyEntry, IdempotencyKey, Metadata};
use xxhash_rust::xxh3::xxh3_128;

/// The largest request body buffered for the fingerprint: axum's default
/// body limit, which the handler's `Json` would apply anyway.
const MAX_BODY: usize = 2 * 1024 * 1024;

/// The caller a key is scoped to, read from the request (`None`: 400).
pub type ScopeFn = for<'a> fn(&'a Parts) -> Option<&'a str>;

/// The store and the leases: the middleware's state, cheap to clone.
#[derive(Clone)]
pub struct Peer {
    store: Arc<ValkeyStore>,
    leases: Leases,
    scope: Option<ScopeFn>,
}

/// How long the store keeps an entry, per state. 0.3 gives an entry one
/// `ttl`, set at the claim; the completed entry's is set before `complete`.
#[derive(Clone, Copy, Debug)]
pub struct Leases {
    /// A claim's: how long a worker that died mid-handler holds the key.
    pub processing: Duration,
    /// A completed entry's: how long retries are replayed.
    pub completed: Duration,
}

impl Default for Leases {
    /// The later crate's guidance: a minute, and a day.
    fn default() -> Self {
        Self {
            processing: Duration::from_secs(60),
            completed: Duration::from_secs(24 * 60 * 60),
        }
    }
}

impl Peer {
    /// A store at `redis_url` whose keys start with `prefix` (what keeps
    /// runs and tests apart on one server), connected now.
    pub async fn connect(
        redis_url: &str,
        prefix: &str,
        leases: Leases,
    ) -> Result<Self, ValkeyError> {
        let client = redis::Client::open(redis_url)?;
        let store = ValkeyStore::with_prefix(client, Some(prefix)).await?;
        Ok(Self {
            store: Arc::new(store),
            leases,
            scope: None,
        })
    }

    /// Scopes every key by the caller `scope` reads.
    pub fn scoped(mut self, scope: ScopeFn) -> Self {
        self.scope = Some(scope);
        self
    }
}

/// The `x-account` header, the caller of this crate's services.
pub fn account(parts: &Parts) -> Option<&str> {
    parts.headers.get("x-account")?.to_str().ok()
}

/// The middleware (`axum::middleware::from_fn_with_state(peer, middleware)`).
/// A request without `Idempotency-Key` goes through untouched.
pub async fn middleware(State(peer): State<Peer>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let Some(raw) = parts.headers.get("idempotency-key") else {
        return next.run(Request::from_parts(parts, body)).await;
    };
    let key = match stored_key(&peer, &parts, raw) {
        Ok(key) => key,
        Err(rejection) => return rejection.into_response(),
    };
    let body = match to_bytes(body, MAX_BODY).await {
        Ok(body) => body,
        Err(error)
            if error
                .source()
                .is_some_and(|inner| inner.is::<LengthLimitError>()) =>
        {
            return Rejection::BodyTooLarge.into_response();
        }
        Err(_) => return Rejection::RequestBodyFailed.into_response(),
    };
    let operation = match parts.uri.path_and_query() {
        Some(target) => format!("{} {target}", parts.method),
        None => format!("{} {}", parts.method, parts.uri.path()),
    };
    let fingerprint = DefaultFingerprintStrategy.compute(&operation, &body);
    let entry = IdempotencyEntry::new(fingerprint, peer.leases.processing);
    match peer.store.try_insert(&key, entry.clone()).await {
        Ok(InsertResult::Claimed { fencing_token }) => {
            let request = Request::from_parts(parts, Body::from(body));
            run(&peer, &key, entry, fencing_token, next, request).await
        }
        Ok(InsertResult::Exists(existing)) => answer_existing(existing, fingerprint),
        Err(_) => Rejection::StoreError.into_response(),
    }
}

/// The key as the store holds it: the client's, behind the hex of the
/// caller's 128-bit hash when keys are scoped (so any caller name makes a
/// valid key and none is stored as itself).
fn stored_key(peer: &Peer, parts: &Parts, raw: &HeaderValue) -> Result<IdempotencyKey, Rejection> {
    let key = raw.to_str().map_err(|_| Rejection::InvalidKey)?;
    let key = match peer.scope {
        Some(scope) => {
            let caller = scope(parts).ok_or(Rejection::MissingScope)?;
            IdempotencyKey::new(format!("{:032x}/{key}", xxh3_128(caller.as_bytes())))
        }
        None => IdempotencyKey::new(key),
    };
    key.map_err(|_| Rejection::InvalidKey)
}

/// A key another request holds: its cached response if this request is
/// the same one, else a rejection.
fn answer_existing(existing: ExistingEntry, fingerprint: Fingerprint) -> Response {
    match existing {
        ExistingEntry::Processing(entry) if entry.fingerprint_matches(fingerprint) => {
            Rejection::InFlight.into_response()
        }
        ExistingEntry::Completed(entry) if entry.fingerprint_matches(fingerprint) => {
            let cached = entry.into_response();
            let status = StatusCode::from_u16(cached.status_code)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            // Built bare: axum would label a `Bytes` body octet-stream.
            let mut response = Response::new(Body::from(cached.body));
            *response.status_mut() = status;
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            response
        }
        _ => Rejection::FingerprintMismatch.into_response(),
    }
}

/// The claimed request: the handler, in a task of its own, then its
/// response completes the claim. A handler that panicked, or a response
/// body that failed, leaves the claim to expire with its lease.
async fn run(
    peer: &Peer,
    key: &IdempotencyKey,
    entry: IdempotencyEntry<Processing>,
    fencing_token: FencingToken,
    next: Next,
    request: Request,
) -> Response {
    let Ok(response) = tokio::spawn(next.run(request)).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    if response.headers().get(header::CACHE_CONTROL) == Some(&HeaderValue::from_static("no-store"))
    {
        // The handler refused before doing anything: the key is free again.
        let _ = peer.store.remove(key).await;
        return response;
    }
    let (parts, body) = response.into_parts();
    let Ok(body) = to_bytes(body, usize::MAX).await else {
        return Rejection::ResponseBodyFailed.into_response();
    };
    let mut completed = entry.complete(CachedResponse {
        status_code: parts.status.as_u16(),
        metadata: Metadata::default(),
        body: body.clone(),
    });
    completed.ttl = peer.leases.completed;
    if let Err(error) = peer.store.complete(key, completed, fencing_token).await {
        // The side effect happened: its response goes out all the same.
        tracing::warn!(%key, ?error, "peer: the store refused the completion");
    }
    Response::from_parts(parts, Body::from(body))
}

/// What the middleware answers on its own, as the later crate's layer
/// does: plain text, `idempotent-rejection: <code>`, and `retry-after`
/// where a retry can succeed.
#[derive(Clone, Copy, Debug)]
enum Rejection {
    InvalidKey,
    MissingScope,
    BodyTooLarge,
    RequestBodyFailed,
    FingerprintMismatch,
    InFlight,
    ResponseBodyFailed,
    StoreError,
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let (status, code, retry_after, message) = match self {
            Self::InvalidKey => (400, "invalid-key", None, "invalid idempotency key"),
            Self::MissingScope => (
                400,
                "missing-scope",
                None,
                "the key cannot be scoped to a caller",
            ),
            Self::BodyTooLarge => (413, "body-too-large", None, "request body too large"),
            Self::RequestBodyFailed => {
                (400, "request-body-failed", None, "the request body failed")
            }
            Self::FingerprintMismatch => (
                400,
                "fingerprint-mismatch",
                None,
                "this idempotency key was already used with a different request",
            ),
            Self::InFlight => (
                409,
                "in-flight",
                Some(1),
                "a request with this idempotency key is already being processed",
            ),
            Self::ResponseBodyFailed => (500, "response-body-failed", None, "the response failed"),
            Self::StoreError => (
                503,
                "store-error",
                Some(5),
                "the idempotency store is unavailable",
            ),
        };
        let status = StatusCode::from_u16(status).expect("a valid status");
        let mut response = (status, Bytes::from_static(message.as_bytes())).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert("idempotent-rejection", HeaderValue::from_static(code));
        if let Some(seconds) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
