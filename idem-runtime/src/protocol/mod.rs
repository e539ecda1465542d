//! One idempotent request from key to response. This module prepares it
//! (the key checked, the body buffered and fingerprinted) and erases the
//! handler's type; [`atomic`] runs the atomic mode (the claim, the
//! handler and the stored response in one transaction) and [`phased`] the
//! phased mode (a leased claim, phases with recovery points).
//!
//! The macro's generated handler calls [`prepare`] after the parts
//! extractors and [`run`] or [`run_phased`] after the body extractor;
//! everything with a decision in it lives here, where ordinary tests reach
//! it.

mod atomic;
mod phased;

pub use atomic::run;
pub use phased::run_phased;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::RequestExt;
use axum::body::Body;
use axum::extract::{OriginalUri, Request};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header;
use http::request::Parts;
use http_body_util::BodyExt;
use tracing::Span;

use crate::backend::{Backend, Claim, ClaimOutcome, StoreError, Tombstone};
use crate::completer::Resumed;
use crate::fingerprint::Fingerprint;
use crate::idem::Idem;
use crate::key::parse_key;
use crate::observe::{self, Outcome};
use crate::problem::{OperationState, Problem};
use crate::request::StoredRequest;
use crate::response::{
    EncodedResponse, TombstoneWrite, decode_headers, encode_headers, is_storable,
};
use crate::scope::MAX_SCOPE_LEN;
use crate::seal::Column;

/// Whether a handler demands a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyMode {
    /// No key: 400.
    Required,
    /// No key: the handler runs in a plain transaction, nothing is stored.
    Optional,
}

/// A handler's `#[idempotent(...)]` arguments, checked at compile time.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) timeout: Duration,
    pub(crate) key: KeyMode,
    /// The lease of a phased handler; `None` in the atomic mode.
    pub(crate) lease: Option<Duration>,
    /// How long after its response a key is kept as a tombstone (its
    /// fingerprint, status and `Location`), refusing late retries; `None`:
    /// the key is forgotten after `ttl`.
    pub(crate) tombstone: Option<Duration>,
    /// JSON Pointers to the members the fingerprint leaves out.
    pub(crate) exclude: &'static [&'static str],
}

impl Config {
    /// The arguments of one handler.
    pub const fn new(ttl_ms: u64, wait_ms: u64, timeout_ms: u64, key: KeyMode) -> Self {
        Self {
            ttl: Duration::from_millis(ttl_ms),
            wait: Duration::from_millis(wait_ms),
            timeout: Duration::from_millis(timeout_ms),
            key,
            lease: None,
            tombstone: None,
            exclude: &[],
        }
    }

    /// The same arguments for a handler whose keys are kept as tombstones
    /// until `tombstone_ms` after their response (`tombstone = ".."`).
    pub const fn tombstone(mut self, tombstone_ms: u64) -> Self {
        self.tombstone = Some(Duration::from_millis(tombstone_ms));
        self
    }

    /// The same arguments for a handler whose fingerprint leaves out the
    /// members of a JSON body these RFC 6901 JSON Pointers name (see
    /// [`Fingerprint::of_excluding`]).
    pub const fn excluding(mut self, pointers: &'static [&'static str]) -> Self {
        self.exclude = pointers;
        self
    }

    /// The same arguments for a phased handler with a lease of `lease_ms`.
    pub const fn phased(mut self, lease_ms: u64) -> Self {
        self.lease = Some(Duration::from_millis(lease_ms));
        self
    }

    /// The claim of `key` in `scope` under these arguments and `idem`'s
    /// settings: `scope` and `key` as the key table keeps them
    /// ([`Idem::stored`]: hashed where the store hashes them), as every
    /// statement, lock, seal and log line downstream of the claim sees them.
    pub(crate) fn claim<'a, DB: Backend>(
        &self,
        idem: &Idem<DB>,
        scope: &'a str,
        key: &'a str,
        fingerprint: Fingerprint,
    ) -> Claim<'a> {
        Claim {
            scope,
            key,
            fingerprint,
            ttl: self.ttl,
            tombstone_ms: self.tombstone.and_then(|tombstone| {
                u64::try_from(tombstone.as_millis())
                    .ok()
                    .and_then(std::num::NonZeroU64::new)
            }),
            wait: self.wait,
            // The handler's deadline in milliseconds (at most an hour, as
            // the attribute checks).
            timeout_ms: u32::try_from(self.timeout.as_millis()).unwrap_or(u32::MAX),
            advisory: idem.advisory(),
            pooled: idem.pooled(),
        }
    }
}

/// A request whose key is valid and whose body is buffered and fingerprinted.
#[derive(Debug)]
pub struct Prepared {
    pub(crate) key: Option<(String, Fingerprint)>,
    pub(crate) config: Config,
    pub(crate) span: Span,
    /// A phased request as the completer would send it again.
    pub(crate) request: Option<Vec<u8>>,
    /// The completer's mark on a request it sent.
    pub(crate) resumed: Option<Resumed>,
}

impl Prepared {
    /// The body extractor's rejection, answered as is: the request ends as
    /// `rejected` (its span and `idem_requests_total` say so), having
    /// claimed nothing.
    pub fn rejected(&self, rejection: Response) -> Response {
        observe::finish(&self.span, Outcome::Rejected);
        rejection
    }
}

/// Validates the key, buffers the body once (honouring `DefaultBodyLimit`
/// and [`Idem::body_timeout`]) and fingerprints the request. Returns the
/// request rebuilt around the buffered body, for the body extractor.
pub async fn prepare<DB: Backend>(
    idem: &Idem<DB>,
    parts: Parts,
    body: Body,
    config: &Config,
) -> Result<(Prepared, Request), Response> {
    let span = observe::request_span();
    let rejected = |problem: Problem| {
        observe::finish(&span, Outcome::Rejected);
        idem.problem(problem)
    };
    let key = match parse_key(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if config.key == KeyMode::Optional => {
            let prepared = Prepared {
                key: None,
                config: *config,
                span,
                request: None,
                resumed: None,
            };
            return Ok((prepared, Request::from_parts(parts, body)));
        }
        Ok(None) => return Err(rejected(Problem::KeyMissing)),
        Err(error) => return Err(rejected(Problem::KeyInvalid(error))),
    };
    let buffered = tokio::time::timeout(idem.body_read_timeout(), buffer(parts, body)).await;
    let (parts, bytes) = match buffered {
        Ok(Ok(buffered)) => buffered,
        Ok(Err(problem)) => return Err(rejected(problem)),
        Err(_elapsed) => return Err(rejected(Problem::BodyTimeout)),
    };
    let path = match parts.extensions.get::<OriginalUri>() {
        Some(OriginalUri(uri)) => uri.path(),
        None => parts.uri.path(),
    };
    let fingerprint = fingerprint(&parts, path, &bytes, config.exclude).await;
    let request = config.lease.map(|_| {
        let uri = match parts.extensions.get::<OriginalUri>() {
            Some(OriginalUri(uri)) => uri,
            None => &parts.uri,
        };
        StoredRequest::encode(&parts.method, uri, &parts.headers, &bytes)
    });
    let prepared = Prepared {
        key: Some((key, fingerprint)),
        config: *config,
        span,
        request,
        resumed: parts.extensions.get::<Resumed>().cloned(),
    };
    Ok((prepared, Request::from_parts(parts, Body::from(bytes))))
}

/// Records the request's scope, and its key when it has one, on its span
/// (redacted); hashing costs nothing worth it when no subscriber wants it.
pub(crate) fn record(span: &Span, scope: &str, key: Option<&str>) {
    if span.is_disabled() {
        return;
    }
    span.record("scope", observe::redact(&[scope]));
    if let Some(key) = key {
        span.record("key", observe::redact(&[scope, key]));
    }
}

/// Bodies from this size on are fingerprinted on tokio's blocking pool:
/// canonicalizing and hashing a JSON body takes some 4 ms a megabyte,
/// which would hold up every other request on the worker thread. Smaller
/// ones are fingerprinted in place, as axum's `Json` parses its body:
/// moved to other threads, their buffers would spread over those threads'
/// malloc arenas (measured: docs/benchmarks-memory.md).
const BLOCKING_FINGERPRINT: usize = 1024 * 1024;

async fn fingerprint(
    parts: &Parts,
    path: &str,
    body: &Bytes,
    exclude: &'static [&'static str],
) -> Fingerprint {
    let query = parts.uri.query();
    if body.len() < BLOCKING_FINGERPRINT {
        return Fingerprint::of_excluding(
            &parts.method,
            path,
            query,
            &parts.headers,
            body,
            exclude,
        );
    }
    let method = parts.method.clone();
    let path = path.to_owned();
    let query = query.map(str::to_owned);
    let headers = parts.headers.clone();
    let body = body.clone();
    let hashed = tokio::task::spawn_blocking(move || {
        Fingerprint::of_excluding(&method, &path, query.as_deref(), &headers, &body, exclude)
    });
    match hashed.await {
        Ok(fingerprint) => fingerprint,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}

async fn buffer(parts: Parts, body: Body) -> Result<(Parts, Bytes), Problem> {
    // `with_limited_body` reads the `DefaultBodyLimit` the app configured
    // from the request's extensions, the same limit axum's extractors use.
    let (parts, body) = Request::from_parts(parts, body)
        .with_limited_body()
        .into_parts();
    match body.collect().await {
        Ok(collected) => Ok((parts, collected.to_bytes())),
        Err(error) if is_length_limit(&error) => Err(Problem::BodyTooLarge),
        Err(_) => Err(Problem::BodyUnreadable),
    }
}

fn is_length_limit(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = source {
        if error.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// What a handler answered, as the code `#[idempotent]` generates hands it
/// over: the response, and whether the handler returned `Err`.
#[derive(Debug)]
pub struct Answer {
    pub(crate) response: Response,
    failed: bool,
}

impl Answer {
    /// The handler's response; `failed` when it returned `Err`, whatever the
    /// error's status: its transaction then rolls back, and nothing is
    /// stored, as when a plain sqlx handler's `?` drops its `Transaction`.
    pub fn new(response: Response, failed: bool) -> Self {
        Self { response, failed }
    }

    /// Whether the transaction may commit with this answer: not after an
    /// `Err`, nor with a transient status (5xx, 408, 429), which roll back.
    pub(crate) fn commits(&self) -> bool {
        !self.failed && is_storable(self.response.status())
    }
}

/// The handler as the protocol below runs it: called once, with the
/// request's transaction, its future boxed. Through this the protocol is
/// compiled once per database rather than once per handler; the cost is one
/// allocation per request that reaches the handler.
pub(crate) type HandlerFuture<'f> = Pin<Box<dyn Future<Output = Answer> + Send + 'f>>;

/// A handler behind [`HandlerFuture`], given `A` (its `Tx`, or its
/// `Phases`): an `FnMut` called at most once (a `&mut dyn FnMut` needs no
/// allocation, a `Box<dyn FnOnce>` would).
pub(crate) type DynHandler<'h, 'f, A> = dyn FnMut(A) -> HandlerFuture<'f> + Send + 'h;

/// `handler` as a [`DynHandler`] can be made of it: the generated
/// handler's one generic step, so that the protocol behind it is compiled
/// once per database.
pub(crate) fn call_once<'f, A, H, Fut>(handler: H) -> impl FnMut(A) -> HandlerFuture<'f> + Send
where
    H: FnOnce(A) -> Fut + Send,
    Fut: Future<Output = Answer> + Send + 'f,
{
    let mut handler = Some(handler);
    move |argument: A| -> HandlerFuture<'f> {
        let handler = handler
            .take()
            .expect("the protocol calls a handler at most once");
        Box::pin(handler(argument))
    }
}

/// A scope longer than any engine keeps: refused before anything runs.
pub(crate) fn scope_too_long(claim: &Claim<'_>) -> Option<(Outcome, Response)> {
    if claim.scope.len() <= MAX_SCOPE_LEN {
        return None;
    }
    // The scope comes from the server's own extractor, so no retry can
    // help: a 500, not a 503 with `Retry-After`.
    tracing::error!(
        bytes = claim.scope.len(),
        "idempotency scope longer than MAX_SCOPE_LEN ({MAX_SCOPE_LEN} bytes): request refused"
    );
    Some((Outcome::Rejected, Problem::ScopeTooLong.into_response()))
}

/// A finished key's answer to a request with `fingerprint`: its replay,
/// or 422 for another request. The stored response is opened here, once
/// the fingerprint matches: one that does not open is answered 500
/// `idempotency_response_unreadable`, and nothing runs.
pub(crate) fn answer_finished<DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    fingerprint: Fingerprint,
    response: EncodedResponse,
) -> (Outcome, Response) {
    if fingerprint != claim.fingerprint {
        return (Outcome::Reused, Problem::KeyReused.into_response());
    }
    match response.open(&idem.sealer(), claim.scope, claim.key) {
        Ok(response) => (
            Outcome::Replayed,
            response.replay(idem.replay_header_names(), idem.replay_marker()),
        ),
        Err((column, error)) => {
            observe::unreadable(
                idem.table_name(),
                claim.scope,
                claim.key,
                column.as_str(),
                error.as_str(),
            );
            (
                Outcome::Unreadable,
                Problem::ResponseUnreadable.into_response(),
            )
        }
    }
}

/// A tombstone's answer to a request with `fingerprint`: 409
/// `idempotency_key_expired` with the operation's first status and
/// `Location`, or 422 for another request. Nothing runs either way. A
/// `location` that does not open is logged and counted, and left out.
pub(crate) fn answer_tombstone<DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    tombstone: &Tombstone,
) -> (Outcome, Response) {
    if tombstone.fingerprint != claim.fingerprint {
        return (
            Outcome::Reused,
            Problem::KeyReused.answer(OperationState::Completed),
        );
    }
    let opened = idem.sealer().open_logged(
        claim.scope,
        claim.key,
        Column::Location,
        tombstone.location.as_deref(),
    );
    let location = opened
        .ok()
        .flatten()
        .and_then(|opened| decode_headers(&opened))
        .and_then(|headers| {
            headers
                .into_iter()
                .find_map(|(name, value)| (name == header::LOCATION).then_some(value))
        });
    (
        Outcome::Expired,
        Problem::expired(tombstone.status, location),
    )
}

/// The tombstone the write of a response (its `parts`) sets up for
/// `scope`'s `key`, whose handler keeps its keys as tombstones for `keep`
/// (its `tombstone`) after a replay of `replay` (its `ttl`): the response's
/// `Location`, encoded as the headers column is and sealed as the
/// `location` column. `None` for a handler without `tombstone`.
pub(crate) fn tombstone_write<DB: Backend>(
    idem: &Idem<DB>,
    (scope, key): (&str, &str),
    replay: Duration,
    keep: Option<Duration>,
    parts: &http::response::Parts,
) -> Option<Box<TombstoneWrite>> {
    let keep = keep?;
    let location = parts.headers.get(header::LOCATION).map(|location| {
        let encoded = encode_headers(&[(header::LOCATION, location.clone())]);
        idem.sealer()
            .seal(scope, key, Column::Location, &encoded)
            .into_owned()
    });
    Some(Box::new(TombstoneWrite {
        replay,
        keep,
        location,
    }))
}

/// An uncertain key's answer to a request with `fingerprint`: 409
/// `idempotency_outcome_uncertain`, or 422 for another request. Nothing
/// runs either way.
pub(crate) fn answer_uncertain(
    claim: &Claim<'_>,
    fingerprint: &Fingerprint,
) -> (Outcome, Response) {
    if *fingerprint == claim.fingerprint {
        (
            Outcome::Uncertain,
            Problem::OutcomeUncertain.into_response(),
        )
    } else {
        (
            Outcome::Reused,
            Problem::KeyReused.answer(OperationState::Uncertain),
        )
    }
}

/// A key this process saw finish, read with one plain read: `None` when
/// the process never saw it finish, or the read found it no longer
/// finished or the server refused the read (the claim decides then). An
/// error: no connection, which the claim would wait for again.
pub(crate) async fn read_seen<DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
) -> Result<Option<ClaimOutcome<DB>>, StoreError> {
    let finished = idem.finished_keys();
    if !finished.seen(claim.scope, claim.key) {
        return Ok(None);
    }
    // Boxed: most requests never take this branch, and sqlx's futures
    // would otherwise inflate every request's (see `OpenTx::acquire`).
    match Box::pin(DB::peek(
        idem.pool(),
        idem.acquire(),
        idem.table_name(),
        claim,
    ))
    .await
    {
        Ok(Some(outcome)) => return Ok(Some(outcome)),
        Ok(None) => {}
        // The server refused the read (a pooler that keeps no prepared
        // statements, say): the claim may still work.
        Err(StoreError::Database(sqlx::Error::Database(error))) => {
            tracing::debug!(%error, "reading a finished key failed; claiming it");
        }
        Err(error) => return Err(error),
    }
    finished.forget(claim.scope, claim.key);
    Ok(None)
}
/// Whole seconds of `Retry-After` that cover `bound`.
pub(crate) fn retry_after_secs(bound: Duration) -> u32 {
    u32::try_from(bound.as_secs() + u64::from(bound.subsec_nanos() > 0)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)], body: &'static str) -> (Parts, Body) {
        let mut builder = Request::builder().method("POST").uri("/v1/charges?x=1");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(Body::from(body)).unwrap().into_parts()
    }

    const REQUIRED: Config = Config::new(1000, 0, 30_000, KeyMode::Required);

    /// `prepare` only reads the store's settings: a pool that never connects.
    use crate::idem::tests::idem;

    /// A large body is fingerprinted off the worker thread, to the same
    /// fingerprint.
    #[tokio::test]
    async fn large_bodies_get_the_same_fingerprint() {
        let body = format!("[{}0]", "1,".repeat(BLOCKING_FINGERPRINT / 2));
        let headers = [
            ("idempotency-key", "k"),
            ("content-type", "application/json"),
        ];
        let (parts, request_body) = request(&headers, Box::leak(body.clone().into_boxed_str()));
        let expected = Fingerprint::of(
            &parts.method,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
            body.as_bytes(),
        );
        let (prepared, _) = prepare(&idem(), parts, request_body, &REQUIRED)
            .await
            .unwrap();
        assert_eq!(prepared.key.unwrap().1, expected);
    }

    #[tokio::test]
    async fn a_missing_key_is_400_unless_optional() {
        let (parts, body) = request(&[], "{}");
        let response = prepare(&idem(), parts, body, &REQUIRED).await.unwrap_err();
        assert_eq!(response.status(), 400);
        let (parts, body) = request(&[], "{}");
        let optional = Config::new(1000, 0, 30_000, KeyMode::Optional);
        let (prepared, _) = prepare(&idem(), parts, body, &optional).await.unwrap();
        assert!(prepared.key.is_none());
    }

    #[tokio::test]
    async fn the_body_is_fingerprinted_and_handed_on() {
        let (parts, body) = request(
            &[
                ("idempotency-key", "\"k1\""),
                ("content-type", "application/json"),
            ],
            "{\"b\":1, \"a\":2}",
        );
        let (prepared, request) = prepare(&idem(), parts, body, &REQUIRED).await.unwrap();
        let (key, fingerprint) = prepared.key.unwrap();
        assert_eq!(key, "k1");
        let (parts, body) = request.into_parts();
        let expected = Fingerprint::of(
            &parts.method,
            "/v1/charges",
            Some("x=1"),
            &parts.headers,
            br#"{"a":2,"b":1}"#,
        );
        assert_eq!(fingerprint, expected);
        assert_eq!(
            &body.collect().await.unwrap().to_bytes()[..],
            b"{\"b\":1, \"a\":2}"
        );
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_413() {
        let (parts, body) = request(&[("idempotency-key", "k")], "0123456789");
        // What a `DefaultBodyLimit::max(4)` layer does to the body.
        let body = Body::new(http_body_util::Limited::new(body, 4));
        let response = prepare(&idem(), parts, body, &REQUIRED).await.unwrap_err();
        assert_eq!(response.status(), 413);
    }
}
