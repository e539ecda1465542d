//! One idempotent request from key to response: prepare, claim, run, finish.
//!
//! The macro's generated handler calls [`prepare`] after the parts
//! extractors and [`run`] after the body extractor; everything with a
//! decision in it lives here, where ordinary tests reach it.

use std::borrow::Cow;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::RequestExt;
use axum::body::Body;
use axum::extract::{OriginalUri, Request};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::FutureExt;
use http::request::Parts;
use http_body_util::BodyExt;
use tracing::{Instrument, Span};

use crate::backend::{
    Backend, Claim, ClaimOutcome, FinishError, OpenTx, StoreError, abandon, is_gone,
    transaction_depth,
};
use crate::fingerprint::Fingerprint;
use crate::idem::Idem;
use crate::key::{IdempotencyKey, parse_key};
use crate::observe::{self, Outcome};
use crate::phases::Resumed;
use crate::problem::Problem;
use crate::request::StoredRequest;
use crate::response::{CaptureError, StoredResponse, is_storable};
use crate::scope::MAX_SCOPE_LEN;
use crate::tx::Tx;

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
            exclude: &[],
        }
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

    /// The handler's deadline in milliseconds (at most an hour, as the
    /// attribute checks).
    pub(crate) fn timeout_ms(&self) -> u32 {
        u32::try_from(self.timeout.as_millis()).unwrap_or(u32::MAX)
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

/// Claims the key in `scope`, runs the handler once, stores its response in
/// the handler's own commit, or answers from the store without running it.
///
/// Generic over the handler only as a thin shim: the protocol itself,
/// `run_dyn`, is instantiated once per database.
pub async fn run<'f, DB, H, Fut>(
    idem: Idem<DB>,
    prepared: Prepared,
    scope: Cow<'_, str>,
    handler: H,
) -> Response
where
    DB: Backend,
    H: FnOnce(Tx<DB>) -> Fut + Send,
    Fut: Future<Output = Answer> + Send + 'f,
{
    run_dyn(idem, prepared, scope, &mut call_once(handler)).await
}

/// `run`, with the handler behind a `dyn`.
async fn run_dyn<'f, DB: Backend>(
    idem: Idem<DB>,
    prepared: Prepared,
    scope: Cow<'_, str>,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> Response {
    let span = prepared.span.clone();
    // Hashing costs nothing worth it when no subscriber wants the span.
    let traced = !span.is_disabled();
    if traced {
        span.record("scope", observe::redact(&[&scope]));
    }
    let (outcome, response) = match prepared.key {
        Some((key, fingerprint)) => {
            if traced {
                span.record("key", observe::redact(&[&scope, &key]));
            }
            let claim = Claim {
                scope: &scope,
                key: &key,
                fingerprint,
                ttl: prepared.config.ttl,
                wait: prepared.config.wait,
                timeout_ms: prepared.config.timeout_ms(),
                advisory: idem.advisory(),
                pooled: idem.pooled(),
            };
            run_keyed(&idem, &claim, handler)
                .instrument(span.clone())
                .await
        }
        None => {
            run_without_key(&idem, prepared.config.timeout, handler)
                .instrument(span.clone())
                .await
        }
    };
    observe::finish(&span, outcome);
    idem.typed(response)
}

async fn run_keyed<'f, DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> (Outcome, Response) {
    if let Some(refused) = scope_too_long(claim) {
        return refused;
    }
    let started = std::time::Instant::now();
    let claimed = claim_or_read(idem, claim).await;
    let conn = match claimed {
        Ok(ClaimOutcome::Claimed(conn)) => {
            observe::claim_latency("claimed", started.elapsed());
            conn
        }
        Ok(ClaimOutcome::Finished {
            fingerprint,
            response,
        }) => {
            observe::claim_latency("finished", started.elapsed());
            return answer_finished(idem, claim, fingerprint, response);
        }
        Ok(ClaimOutcome::InUse { running }) => {
            observe::claim_latency("in_use", started.elapsed());
            let problem = if running {
                Problem::KeyInUse
            } else {
                Problem::KeyHeld
            };
            return (Outcome::InUse, problem.into_response());
        }
        Err(StoreError::Orphaned { bound }) => {
            observe::claim_latency("error", started.elapsed());
            tracing::warn!(
                bound_ms = bound.as_millis(),
                "the key store connection was lost during the claim; the key is held until \
                 the server ends that session"
            );
            let retry_after = retry_after_secs(bound);
            return (
                Outcome::StoreUnavailable,
                Problem::ConnectionLost { retry_after }.into_response(),
            );
        }
        Err(error) => {
            observe::claim_latency("error", started.elapsed());
            tracing::warn!(error = %error, "idempotency key store unavailable");
            return (
                Outcome::StoreUnavailable,
                Problem::StoreUnavailable.into_response(),
            );
        }
    };
    let key = IdempotencyKey::new(claim.scope.to_owned(), claim.key.to_owned());
    let (response, mut conn) = match execute(conn, Some(key), idem, claim.timeout(), handler).await
    {
        Ok((answer, conn)) if answer.commits() => (answer.response, conn),
        Ok((answer, conn)) => return rolled_back(conn, idem, claim, answer.response).await,
        Err(ended) => return ended,
    };
    let (stored, parts) = match StoredResponse::capture(
        response,
        idem.replay_header_names(),
        idem.response_cap(),
    )
    .await
    {
        Ok(captured) => captured,
        Err(error) => {
            abandon(conn).await;
            let response = match error {
                CaptureError::TooLarge { limit } => {
                    tracing::error!(
                        limit,
                        "idempotent handler's response exceeds the stored-response cap; \
                             its transaction was rolled back (raise Idem::max_response_bytes)"
                    );
                    Problem::ResponseNotStored.into_response()
                }
                CaptureError::Body(error) => {
                    tracing::error!(error = %error, "idempotent handler's response body failed; rolled back");
                    Problem::HandlerPanicked.into_response()
                }
            };
            return (Outcome::RolledBack, response);
        }
    };
    match DB::finish(&mut conn, idem.table_name(), Some(claim), Some(&stored)).await {
        Ok(()) => {
            conn.release();
            idem.finished_keys().remember(claim.scope, claim.key);
            (Outcome::Claimed, stored.into_original(parts))
        }
        Err(error) => commit_failed(conn, error, true).await,
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
/// or 422 for another request.
pub(crate) fn answer_finished<DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    fingerprint: Fingerprint,
    response: StoredResponse,
) -> (Outcome, Response) {
    if fingerprint == claim.fingerprint {
        (
            Outcome::Replayed,
            response.replay(idem.replay_header_names(), idem.replay_marker()),
        )
    } else {
        (Outcome::Reused, Problem::KeyReused.into_response())
    }
}

/// Claims the key; a key this process saw finish is first looked up with a
/// plain read, which answers a retry without the claim's transaction (see
/// `recent`).
async fn claim_or_read<DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
) -> Result<ClaimOutcome<DB>, StoreError> {
    if let Some(finished) = read_seen(idem, claim).await? {
        return Ok(finished);
    }
    let claimed = DB::claim(idem.pool(), idem.acquire(), idem.table_name(), claim).await;
    if let Ok(ClaimOutcome::Finished { .. }) = &claimed {
        idem.finished_keys().remember(claim.scope, claim.key);
    }
    claimed
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

/// The answer to a claimed request whose handler's answer will not be
/// stored: rolled back, and the handler's answer, except where that is a
/// 5xx and its connection turns out lost (a failover, a cut, a session the
/// server ended): then 503 with `Retry-After`, which a retry with the same
/// key can act on, unless the claim's row is found committed without a
/// response (the handler committed its own transaction, and the key
/// answers 409 until it expires).
async fn rolled_back<DB: Backend>(
    conn: OpenTx<DB>,
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    response: Response,
) -> (Outcome, Response) {
    let stranded = match abandon_keyed(conn, idem, claim).await {
        Abandoned::Open => return (Outcome::RolledBack, response),
        Abandoned::Gone { stranded } => stranded,
    };
    if !response.status().is_server_error() || stranded == Some(true) {
        return (Outcome::RolledBack, response);
    }
    // Nothing of the claim is committed (`Some(false)`), or the store is
    // down and cannot say (`None`), where only a handler that committed its
    // own transaction, outside the contract, leaves a row behind.
    tracing::warn!(
        status = response.status().as_u16(),
        checked = stranded.is_some(),
        "the key store connection was lost during the handler; answering 503"
    );
    (
        Outcome::StoreUnavailable,
        Problem::StoreUnavailable.into_response(),
    )
}

/// How a rolled-back request's connection ended.
enum Abandoned {
    /// The connection answered the rollback (and the check of the key).
    Open,
    /// The connection was gone. `stranded`: whether the key's row is there
    /// without a response, as another connection read it; `None` if it
    /// could not be read within [`STRANDED_CHECK`].
    Gone { stranded: Option<bool> },
}

/// How long a request whose connection was lost waits for another to
/// look at its key.
const STRANDED_CHECK: Duration = Duration::from_secs(1);

/// Rolls back a claimed request that will not be stored, and says so where
/// the handler had committed the transaction itself: its claim row stayed,
/// without a response, and the key answers 409 until it expires.
async fn abandon_keyed<DB: Backend>(
    mut conn: OpenTx<DB>,
    idem: &Idem<DB>,
    claim: &Claim<'_>,
) -> Abandoned {
    // A rollback can fail because the handler's own commit left nothing to
    // roll back (SQLite says so): the check runs either way, and only a
    // connection whose rollback and check both succeeded goes back.
    let rolled_back = DB::rollback(&mut conn).await;
    if let Err(error) = &rolled_back {
        tracing::warn!(%error, "rollback failed; closing the connection");
    }
    let gone = matches!(&rolled_back, Err(error) if is_gone::<DB>(error));
    let checked = if gone {
        drop(conn);
        let check = async {
            let mut other = idem.pool().acquire().await?;
            DB::stranded(&mut other, idem.table_name(), claim).await
        };
        // Boxed: sqlx's acquisition would otherwise sit in every request's
        // future (see `OpenTx::acquire`).
        tokio::time::timeout(STRANDED_CHECK, Box::pin(check))
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    } else {
        let checked = DB::stranded(&mut conn, idem.table_name(), claim).await;
        if rolled_back.is_ok() && checked.is_ok() {
            conn.release();
        }
        checked
    };
    match &checked {
        Ok(true) => tracing::error!(
            scope = observe::redact(&[claim.scope]),
            key = observe::redact(&[claim.scope, claim.key]),
            "an idempotent handler committed its transaction itself and then failed: \
             its key is held without a response and answers 409 until it expires"
        ),
        Ok(false) => {}
        Err(error) => tracing::debug!(%error, "checking the key after a rollback failed"),
    }
    if gone {
        Abandoned::Gone {
            stranded: checked.ok(),
        }
    } else {
        Abandoned::Open
    }
}

/// A request without a key on a `key = "optional"` handler: one plain
/// transaction, committed on a storable answer, nothing remembered.
async fn run_without_key<'f, DB: Backend>(
    idem: &Idem<DB>,
    timeout: Duration,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> (Outcome, Response) {
    let conn = match DB::begin(idem.pool(), idem.acquire()).await {
        Ok(conn) => conn,
        Err(error) => {
            tracing::warn!(error = %error, "database unavailable");
            return (
                Outcome::StoreUnavailable,
                Problem::StoreUnavailable.into_response(),
            );
        }
    };
    let (response, mut conn) = match execute(conn, None, idem, timeout, handler).await {
        Ok((answer, conn)) if answer.commits() => (answer.response, conn),
        Ok((answer, conn)) => {
            abandon(conn).await;
            return (Outcome::RolledBack, answer.response);
        }
        Err(ended) => return ended,
    };
    match DB::finish(&mut conn, idem.table_name(), None, None).await {
        Ok(()) => {
            conn.release();
            (Outcome::Unkeyed, response)
        }
        Err(error) => commit_failed(conn, error, false).await,
    }
}

/// Runs the handler on the claimed transaction and takes the connection
/// back. A panic, or a `Tx` that outlives its handler, rolls back.
async fn execute<'f, DB: Backend>(
    conn: OpenTx<DB>,
    key: Option<IdempotencyKey>,
    idem: &Idem<DB>,
    timeout: Duration,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> Result<(Answer, OpenTx<DB>), (Outcome, Response)> {
    let outbox = Arc::clone(&idem.inner().messages.outbox);
    let (tx, mut back) = Tx::new(conn, key, outbox);
    let run = tokio::time::timeout(timeout, AssertUnwindSafe(handler(tx)).catch_unwind());
    let outcome = match run.await {
        Ok(outcome) => outcome,
        Err(_elapsed) => {
            // The handler was dropped where it stood, perhaps inside a
            // statement: its connection is closed, never reused, and the
            // server rolls its transaction back.
            drop(back.try_recv());
            tracing::warn!(
                timeout_ms = timeout.as_millis(),
                "idempotent handler passed its deadline; dropped and rolled back"
            );
            return Err((Outcome::TimedOut, Problem::HandlerTimeout.into_response()));
        }
    };
    let mut conn = back.try_recv();
    // Whether the handler left the transaction as the claim opened it.
    let intact = match &mut conn {
        Ok(conn) => settled_depth(conn).await == 1,
        Err(_) => false,
    };
    let response = match outcome {
        Ok(answer) => answer,
        Err(_) => {
            // A connection whose transaction the handler ended is closed.
            if let Ok(conn) = conn
                && intact
            {
                abandon(conn).await;
            }
            tracing::error!("idempotent handler panicked; its transaction was rolled back");
            return Err((
                Outcome::RolledBack,
                Problem::HandlerPanicked.into_response(),
            ));
        }
    };
    match conn {
        Ok(conn) if intact => Ok((response, conn)),
        Ok(conn) => {
            // Not the transaction the claim opened: something in the handler
            // ended it (see `Tx`'s `DerefMut`) or left a savepoint open. What
            // the connection is in is unknown, so it is dropped unreleased,
            // which closes it and rolls back whatever is still open.
            tracing::error!(
                depth = transaction_depth::<DB>(&conn),
                "an idempotent handler's transaction ended or changed inside the handler; \
                 nothing was committed by idem"
            );
            drop(conn);
            Err((
                Outcome::RolledBack,
                Problem::TransactionFailed.into_response(),
            ))
        }
        Err(_) => {
            // Dropping the stray Tx later closes its connection, which
            // rolls the transaction back on the server.
            tracing::error!(
                "an idempotent handler kept its Tx after returning; nothing was committed"
            );
            Err((
                Outcome::RolledBack,
                Problem::HandlerPanicked.into_response(),
            ))
        }
    }
}

/// The transactions sqlx counts on the connection once it has caught up:
/// 1, the request's, while the handler has not ended it. sqlx's SQLite
/// driver lowers its count for a savepoint the handler dropped on its
/// worker thread, after the drop; a round trip through the worker (a ping)
/// settles it, and is spent only when the count is not 1.
async fn settled_depth<DB: Backend>(conn: &mut OpenTx<DB>) -> usize {
    use sqlx::Connection as _;
    if transaction_depth::<DB>(conn) != 1 {
        // A failed ping leaves the count as it is, which then fails the
        // request.
        let _ = conn.ping().await;
    }
    transaction_depth::<DB>(conn)
}

/// Whole seconds of `Retry-After` that cover `bound`.
pub(crate) fn retry_after_secs(bound: Duration) -> u32 {
    u32::try_from(bound.as_secs() + u64::from(bound.subsec_nanos() > 0)).unwrap_or(u32::MAX)
}

/// The commit failed, so the client must not be told the work succeeded.
/// If the commit did land, a retry with the key replays it; if not, a retry
/// redoes it. Without a key (`keyed` false) nothing tells which. (A commit
/// lost with a half-open connection leaves its session holding the key
/// until the server ends it; the retries meanwhile get 409 with
/// `Retry-After`. Most lost commits free the key at once, so the first
/// retry is invited soon.)
async fn commit_failed<DB: Backend>(
    conn: OpenTx<DB>,
    error: FinishError,
    keyed: bool,
) -> (Outcome, Response) {
    abandon(conn).await;
    match error {
        FinishError::Ended(error) => {
            tracing::error!(
                error = %error,
                "the handler's transaction had already failed when it answered \
                 (a database error the handler did not return?); rolled back"
            );
            (
                Outcome::RolledBack,
                Problem::TransactionFailed.into_response(),
            )
        }
        FinishError::Store(error) => {
            tracing::warn!(error = %error, "committing the handler's transaction failed");
            let problem = if keyed {
                Problem::StoreUnavailable
            } else {
                Problem::CommitOutcomeUnknown
            };
            (Outcome::StoreUnavailable, problem.into_response())
        }
    }
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

    /// sqlx's `acquire` future is several KiB; held inline, it would make
    /// every idempotent handler's future as big, and each `.await` on the
    /// way down would copy it. The backends box it (sizes measured either
    /// way: docs/design.md).
    #[tokio::test]
    async fn the_wrapper_future_stays_small() {
        fn size<DB: Backend>(idem: &Idem<DB>) -> (usize, usize) {
            let claim = Claim {
                scope: "s",
                key: "k",
                fingerprint: Fingerprint::from_bytes(&[0; 32]).unwrap(),
                ttl: Duration::from_secs(1),
                wait: Duration::ZERO,
                timeout_ms: 30_000,
                advisory: true,
                pooled: false,
            };
            let acquire = std::mem::size_of_val(&idem.pool().acquire());
            let mut answer = |_tx| -> HandlerFuture<'static> {
                Box::pin(async move { Answer::new(Response::default(), false) })
            };
            let run = std::mem::size_of_val(&run_keyed(idem, &claim, &mut answer));
            (run, acquire)
        }
        let mut sizes = vec![("postgres", size(&idem()))];
        #[cfg(feature = "sqlite")]
        sizes.push((
            "sqlite",
            size(&Idem::new(
                sqlx::SqlitePool::connect_lazy("sqlite::memory:").unwrap(),
            )),
        ));
        #[cfg(feature = "mysql")]
        sizes.push((
            "mysql",
            size(&Idem::new(
                sqlx::MySqlPool::connect_lazy("mysql://127.0.0.1:1/none").unwrap(),
            )),
        ));
        for (engine, (run, acquire)) in sizes {
            assert!(
                run <= 2304,
                "{engine}: run_keyed's future is {run} bytes (acquire's: {acquire})"
            );
        }
    }
}
