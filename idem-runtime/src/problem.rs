//! The answers `idem` gives itself: RFC 9457 `application/problem+json`.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

use crate::key::KeyError;

/// One of the responses `idem` answers without running the handler.
///
/// Each has a stable `code` member clients can branch on.
///
/// ```
/// use axum::response::IntoResponse;
/// use idem_runtime::Problem;
///
/// assert_eq!(Problem::KeyReused.code(), "idempotency_key_reused");
/// let response = Problem::KeyInUse.into_response();
/// assert_eq!(response.status(), 409);
/// assert_eq!(response.headers()["retry-after"], "1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// 400: no key on a handler that requires one.
    KeyMissing,
    /// 400: the key header is malformed.
    KeyInvalid(KeyError),
    /// 409: another attempt with this key is still running.
    KeyInUse,
    /// 409: a phased attempt holds the key's lease, which ends in
    /// `retry_after` seconds (when a retry resumes its work if it stopped).
    KeyLeased {
        /// Seconds until the lease ends.
        retry_after: u32,
    },
    /// 409: the key is held, by an attempt that may be running or by a
    /// session the server has yet to end (its client gone), or by an
    /// attempt that committed early and failed.
    KeyHeld,
    /// 422: the key was used for a different request.
    KeyReused,
    /// 413: the request body is over the limit.
    BodyTooLarge,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 408: the request body did not arrive within the body timeout.
    BodyTimeout,
    /// 503: the key store cannot be reached or refused the claim.
    StoreUnavailable,
    /// 503: the connection to the key store was lost after the claim may
    /// have reached it; the key is held until the server ends that session,
    /// within `retry_after` seconds.
    ConnectionLost {
        /// Seconds until the key is free again.
        retry_after: u32,
    },
    /// 503: the database failed while committing a request that carried no
    /// key (`key = "optional"`): it may or may not have been done, so no
    /// `Retry-After` invites a retry.
    CommitOutcomeUnknown,
    /// 500: the handler panicked; nothing was committed.
    HandlerPanicked,
    /// 504: the handler did not answer within its deadline (the attribute's
    /// `timeout`); it was dropped and nothing was committed.
    HandlerTimeout,
    /// 500: the handler's transaction failed or ended before the commit: a
    /// database error the handler caught rather than returned, a deferred
    /// constraint its writes broke at the commit, or the transaction ended
    /// inside the handler; no answer was stored.
    TransactionFailed,
    /// 500: the response could not be stored, so the work was rolled back.
    ResponseNotStored,
    /// 409 without `Retry-After`: the key's operation may or may not have
    /// had its effect outside the service (a phased request whose attempts
    /// ran out after an external step, or an
    /// [`external_once`](crate::Phases::external_once) step begun without
    /// a recorded result). Nothing runs until a person resolves it
    /// ([`Idem::resolve`](crate::Idem::resolve)); retrying does not help,
    /// and neither does a new key, which could do it twice.
    OutcomeUncertain,
    /// 500 without `Retry-After`: the key's operation completed, but its
    /// stored response cannot be read back (sealed with a key since
    /// removed from the [`KeyRing`](crate::KeyRing), copied from another
    /// key's row, or corrupted). Nothing runs again; the state is
    /// `completed`, so a new key is not safe (it would do the operation
    /// twice). An operator restores the key to the ring, or
    /// [forgets](crate::Idem::forget) the key once the client knows.
    ResponseUnreadable,
    /// 409 without `Retry-After`: the key's operation completed, its
    /// response was kept for the handler's `ttl` and no longer is, and the
    /// key is kept as a tombstone (the handler's `tombstone`). Nothing runs
    /// again. The problem reports the original `status` (as
    /// `original_status`) and its `Location` header, if it had one (as
    /// `location`); the state is `completed`, so a new key is not safe.
    KeyExpired {
        /// The status the operation was first answered with.
        status: u16,
    },
    /// 500: the caller's scope is longer than
    /// [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN); nothing ran. The scope comes
    /// from the server's own extractor, so a retry cannot help.
    ScopeTooLong,
}

/// The state of the operation a key names, as every problem reports it in
/// its `operation_state` member, beside `safe_new_key`.
///
/// ```
/// use idem_runtime::{OperationState, Problem};
///
/// assert_eq!(Problem::KeyInUse.operation_state(), OperationState::InProgress);
/// assert_eq!(OperationState::InProgress.as_str(), "in_progress");
/// assert!(!Problem::KeyInUse.safe_new_key());
/// assert!(Problem::KeyMissing.safe_new_key());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OperationState {
    /// Nothing of it was done: a retry runs it afresh, and a new key
    /// cannot duplicate any effect of it.
    NotStarted,
    /// An attempt is running, or stopped and is kept to be resumed, or its
    /// outcome is known only to a retry with the same key: retry with it.
    InProgress,
    /// It may or may not have had its effect, and no retry can tell: a
    /// person (or a reconciliation) decides. Retrying does not help.
    Uncertain,
    /// It completed: a retry with its key replays its response.
    Completed,
}

impl OperationState {
    /// The `operation_state` member's value: `not_started`, `in_progress`,
    /// `uncertain` or `completed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotStarted => "not_started",
            Self::InProgress => "in_progress",
            Self::Uncertain => "uncertain",
            Self::Completed => "completed",
        }
    }

    /// The `safe_new_key` member: true only when a new key cannot
    /// duplicate an effect of the operation, which is when nothing of it
    /// was done.
    pub fn safe_new_key(self) -> bool {
        self == Self::NotStarted
    }
}

/// Seconds a client should wait before retrying a 409 or 503.
const RETRY_AFTER_SECS: u32 = 1;

impl Problem {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyMissing | Self::KeyInvalid(_) | Self::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Self::KeyInUse
            | Self::KeyHeld
            | Self::KeyLeased { .. }
            | Self::OutcomeUncertain
            | Self::KeyExpired { .. } => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::StoreUnavailable | Self::ConnectionLost { .. } | Self::CommitOutcomeUnknown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::HandlerTimeout => StatusCode::GATEWAY_TIMEOUT,
            Self::HandlerPanicked
            | Self::TransactionFailed
            | Self::ResponseNotStored
            | Self::ResponseUnreadable
            | Self::ScopeTooLong => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable `code` member.
    pub fn code(self) -> &'static str {
        match self {
            Self::KeyMissing => "idempotency_key_missing",
            Self::KeyInvalid(_) => "idempotency_key_invalid",
            Self::KeyInUse | Self::KeyHeld | Self::KeyLeased { .. } => "idempotency_key_in_use",
            Self::KeyReused => "idempotency_key_reused",
            Self::BodyTooLarge => "request_body_too_large",
            Self::BodyUnreadable => "request_body_unreadable",
            Self::BodyTimeout => "request_body_timeout",
            Self::StoreUnavailable | Self::ConnectionLost { .. } | Self::CommitOutcomeUnknown => {
                "idempotency_store_unavailable"
            }
            Self::HandlerPanicked | Self::TransactionFailed => "internal_error",
            Self::HandlerTimeout => "handler_timeout",
            Self::ResponseNotStored => "idempotency_response_not_stored",
            Self::ResponseUnreadable => "idempotency_response_unreadable",
            Self::ScopeTooLong => "idempotency_scope_too_long",
            Self::OutcomeUncertain => "idempotency_outcome_uncertain",
            Self::KeyExpired { .. } => "idempotency_key_expired",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency-Key header missing",
            Self::KeyInvalid(_) => "Idempotency-Key header invalid",
            Self::KeyInUse | Self::KeyLeased { .. } => {
                "A request with this Idempotency-Key is still in progress"
            }
            Self::KeyHeld => "This Idempotency-Key is held by another attempt",
            Self::KeyReused => "Idempotency-Key reused with a different request",
            Self::BodyTooLarge => "Request body too large",
            Self::BodyUnreadable => "Request body could not be read",
            Self::BodyTimeout => "Request body too slow",
            Self::StoreUnavailable | Self::ConnectionLost { .. } => {
                "Idempotency key store unavailable"
            }
            Self::CommitOutcomeUnknown => "Outcome unknown",
            Self::HandlerPanicked | Self::TransactionFailed => "Internal server error",
            Self::HandlerTimeout => "Request took too long",
            Self::ResponseNotStored => "Response could not be stored",
            Self::ResponseUnreadable => "Stored response unreadable",
            Self::ScopeTooLong => "Idempotency scope too long",
            Self::OutcomeUncertain => "Outcome uncertain",
            Self::KeyExpired { .. } => "Idempotency-Key expired",
        }
    }

    fn detail(self) -> String {
        match self {
            Self::KeyMissing => "Send an Idempotency-Key header, one per logical operation, on every attempt.".into(),
            Self::KeyInvalid(error) => format!("{error}."),
            Self::KeyInUse => "Retry after the time given in Retry-After; the first attempt's response will be replayed.".into(),
            Self::KeyLeased { .. } => "Another attempt is working on this request. Retry after the time given in Retry-After, with the same key: its response will be replayed, or your retry resumes its work where it stopped.".into(),
            Self::OutcomeUncertain => "This request was interrupted after it may have had effects outside this service, and whether it did is not known. It has been reported for a person to check; until then every retry gets this answer. Do not retry it with a new key: that could do it twice.".into(),
            Self::KeyHeld => "Another attempt holds this key. Retry after the time given in Retry-After, with the same key: if that attempt completed, its response will be replayed; if it did nothing, your request will run.".into(),
            Self::ConnectionLost { .. } => "The connection to the key store was lost while this request held its key; the store releases it within the time given in Retry-After. Retry then, with the same Idempotency-Key: the request either did nothing, or its answer will be replayed.".into(),
            Self::KeyReused => "This key was first used with a different method, path, query or body. Use a new key for a new operation.".into(),
            Self::BodyTooLarge => "The request body is larger than this endpoint accepts.".into(),
            Self::BodyUnreadable => "The request body ended before it was complete.".into(),
            Self::BodyTimeout => "The request body did not arrive in time. Nothing was done; retrying is safe.".into(),
            Self::StoreUnavailable => "Retry after the time given in Retry-After, with the same Idempotency-Key if the request had one: the request either did nothing, or its answer will be replayed.".into(),
            Self::CommitOutcomeUnknown => "The database failed while committing this request, which carried no Idempotency-Key: it may or may not have been done. Send an Idempotency-Key to make retries safe.".into(),
            Self::HandlerPanicked => "Nothing was done. Retrying is safe, with the same Idempotency-Key if the request had one.".into(),
            Self::HandlerTimeout => "The request did not finish within the server's deadline and was stopped. Nothing was done: retry after the time given in Retry-After, with the same Idempotency-Key if the request had one.".into(),
            Self::TransactionFailed => "The request's transaction failed or ended before it could commit, and no answer was stored: a retry with the same key runs the request again.".into(),
            Self::ResponseNotStored => "Nothing was done: the response is larger than can be stored for replay.".into(),
            Self::ResponseUnreadable => "This request was already done, but the server cannot read back the response it stored for it. It was not done again. Do not retry it with a new key: that would do it twice. The server's operators have been alerted.".into(),
            Self::KeyExpired { status } => format!("This request was already done (it was answered {status}), and its response is no longer kept. It was not done again; `original_status` and `location` say what it answered. Do not retry it with a new key unless you mean to do it again."),
            Self::ScopeTooLong => "Nothing was done: the server identifies this caller by a scope longer than its idempotency key store keeps. Retrying will not help.".into(),
        }
    }

    /// The state of the operation the request's key names, as this
    /// problem reports it where `idem` answers it in the atomic mode (the
    /// phased mode says `in_progress` instead where a failed attempt's key
    /// is kept to be resumed).
    pub fn operation_state(self) -> OperationState {
        match self {
            Self::KeyMissing
            | Self::KeyInvalid(_)
            | Self::BodyTooLarge
            | Self::BodyUnreadable
            | Self::BodyTimeout
            | Self::StoreUnavailable
            | Self::HandlerPanicked
            | Self::HandlerTimeout
            | Self::TransactionFailed
            | Self::ResponseNotStored
            | Self::ScopeTooLong => OperationState::NotStarted,
            // A lost connection's commit may have landed: a retry with the
            // key replays it or runs it.
            Self::KeyInUse
            | Self::KeyLeased { .. }
            | Self::KeyHeld
            | Self::ConnectionLost { .. } => OperationState::InProgress,
            // The key's first request was answered (in the phased mode a
            // request with another fingerprint may also meet it in flight).
            // An unreadable response's operation committed with it: it is
            // done, not uncertain (no resolution applies), only its answer
            // is lost.
            Self::KeyReused | Self::ResponseUnreadable | Self::KeyExpired { .. } => {
                OperationState::Completed
            }
            Self::CommitOutcomeUnknown | Self::OutcomeUncertain => OperationState::Uncertain,
        }
    }

    /// Whether a new key cannot duplicate an effect of the operation this
    /// key names: see [`OperationState::safe_new_key`].
    pub fn safe_new_key(self) -> bool {
        self.operation_state().safe_new_key()
    }

    /// Seconds for `Retry-After`, where the answer invites a retry.
    fn retry_after(self) -> Option<u32> {
        match self {
            Self::KeyInUse | Self::KeyHeld | Self::StoreUnavailable | Self::HandlerTimeout => {
                Some(RETRY_AFTER_SECS)
            }
            Self::ConnectionLost { retry_after } | Self::KeyLeased { retry_after } => {
                Some(retry_after)
            }
            _ => None,
        }
    }
}

impl Problem {
    /// The problem as a response reporting `state`, in place of its
    /// default [`operation_state`](Self::operation_state).
    pub(crate) fn answer(self, state: OperationState) -> Response {
        self.render(None, state)
    }

    /// The problem as a response whose `type` is `type_base` followed by
    /// its `code` (`about:blank` without a base).
    pub(crate) fn render(self, type_base: Option<&str>, state: OperationState) -> Response {
        self.render_with(type_base, state, None)
    }

    /// [`Problem::KeyExpired`] for an operation first answered with
    /// `status` and `location`.
    pub(crate) fn expired(status: StatusCode, location: Option<HeaderValue>) -> Response {
        let problem = Self::KeyExpired {
            status: status.as_u16(),
        };
        problem.render_with(None, problem.operation_state(), location)
    }

    /// [`render`](Self::render), with the `location` a
    /// [`Problem::KeyExpired`] reports (kept on the response as
    /// [`ExpiredLocation`], so that a response rendered again keeps it).
    fn render_with(
        self,
        type_base: Option<&str>,
        state: OperationState,
        location: Option<HeaderValue>,
    ) -> Response {
        let kind = match type_base {
            Some(base) => format!("{base}{}", self.code()),
            None => "about:blank".to_owned(),
        };
        let mut body = serde_json::json!({
            "type": kind,
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": self.detail(),
            "code": self.code(),
            "operation_state": state.as_str(),
            "safe_new_key": state.safe_new_key(),
        });
        if let Self::KeyExpired { status } = self {
            body["original_status"] = status.into();
            body["location"] = location
                .as_ref()
                .and_then(|location| location.to_str().ok())
                .into();
        }
        let mut response = (self.status(), body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(Rendered(self, state));
        if let Some(location) = location {
            response.extensions_mut().insert(ExpiredLocation(location));
        }
        response
    }

    /// `response`, which renders this problem, rendered again with
    /// `type_base` and `state` (what it reports besides kept).
    pub(crate) fn rerender(
        self,
        response: &Response,
        type_base: Option<&str>,
        state: OperationState,
    ) -> Response {
        let location = response
            .extensions()
            .get::<ExpiredLocation>()
            .map(|ExpiredLocation(location)| location.clone());
        self.render_with(type_base, state, location)
    }
}

/// The `Location` a [`Problem::KeyExpired`] response reports.
#[derive(Debug, Clone)]
pub(crate) struct ExpiredLocation(HeaderValue);

/// Marks a response as `idem`'s problem, so that a service's problem type
/// base can be applied to it on its way out, wherever it was made (a
/// handler that returned a [`PhaseError`](crate::PhaseError) too).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rendered(pub(crate) Problem, pub(crate) OperationState);

/// `response` reporting `state` if it is one of `idem`'s problems (a
/// [`PhaseError`](crate::PhaseError) a phased handler returned, say), as it
/// is otherwise.
pub(crate) fn restate(response: Response, state: OperationState) -> Response {
    match response.extensions().get::<Rendered>() {
        Some(&Rendered(problem, was)) if was != state => problem.rerender(&response, None, state),
        _ => response,
    }
}

/// With `type: about:blank`; a service that configured
/// [`Idem::problem_type_base`](crate::Idem::problem_type_base) has its
/// requests' problems typed on their way out.
impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        self.render(None, self.operation_state())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn problems_are_rfc9457_with_a_stable_code() {
        let response = Problem::KeyInUse.into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["code"], "idempotency_key_in_use");
        assert_eq!(json["status"], 409);
        assert!(
            !Problem::KeyReused
                .into_response()
                .headers()
                .contains_key(header::RETRY_AFTER)
        );
    }

    async fn body(problem: Problem) -> serde_json::Value {
        let body = problem.into_response().into_body().collect().await.unwrap();
        serde_json::from_slice(&body.to_bytes()).unwrap()
    }

    /// Only a 409 for an attempt known to be running promises a replay;
    /// a held key, a lost connection and a deadline each say what they
    /// know, and when to come back.
    #[tokio::test]
    async fn each_retryable_problem_says_what_is_known() {
        let running = body(Problem::KeyInUse).await;
        let held = body(Problem::KeyHeld).await;
        assert_eq!(held["code"], running["code"]);
        assert_eq!(held["status"], 409);
        assert!(
            running["detail"]
                .as_str()
                .unwrap()
                .contains("will be replayed")
        );
        assert!(
            !held["detail"]
                .as_str()
                .unwrap()
                .contains("response will be replayed.")
        );

        let lost = Problem::ConnectionLost { retry_after: 33 }.into_response();
        assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(lost.headers()[header::RETRY_AFTER], "33");
        let lost = body(Problem::ConnectionLost { retry_after: 33 }).await;
        assert_eq!(lost["code"], "idempotency_store_unavailable");

        let late = Problem::HandlerTimeout.into_response();
        assert_eq!(late.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(late.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            body(Problem::HandlerTimeout).await["code"],
            "handler_timeout"
        );
    }

    /// Every problem reports the state of the operation its key names, and
    /// whether a new key is safe, as members beside its code.
    #[tokio::test]
    async fn every_problem_says_what_became_of_the_operation() {
        use OperationState::*;
        let cases = [
            (Problem::KeyMissing, NotStarted),
            (Problem::KeyInvalid(KeyError::Empty), NotStarted),
            (Problem::BodyTooLarge, NotStarted),
            (Problem::BodyTimeout, NotStarted),
            (Problem::StoreUnavailable, NotStarted),
            (Problem::HandlerTimeout, NotStarted),
            (Problem::HandlerPanicked, NotStarted),
            (Problem::KeyInUse, InProgress),
            (Problem::KeyLeased { retry_after: 3 }, InProgress),
            (Problem::KeyHeld, InProgress),
            (Problem::ConnectionLost { retry_after: 3 }, InProgress),
            (Problem::KeyReused, Completed),
            (Problem::ResponseUnreadable, Completed),
            (Problem::CommitOutcomeUnknown, Uncertain),
            (Problem::OutcomeUncertain, Uncertain),
        ];
        for (problem, state) in cases {
            let json = body(problem).await;
            assert_eq!(json["operation_state"], state.as_str(), "{problem:?}");
            assert_eq!(
                json["safe_new_key"],
                state == NotStarted,
                "{problem:?}: a new key is safe only when nothing was done"
            );
        }
        // A phased attempt's key kept after an external step: the same
        // problem reports the operation in progress.
        let kept = Problem::HandlerTimeout.answer(InProgress);
        let restated = restate(Problem::StoreUnavailable.into_response(), Uncertain);
        for (response, state) in [(kept, InProgress), (restated, Uncertain)] {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(json["operation_state"], state.as_str());
            assert_eq!(json["safe_new_key"], false);
        }
    }
}
