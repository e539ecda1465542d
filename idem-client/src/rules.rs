//! Which answers end an operation and which are retried, read from the
//! status, the `idem` problem code, `Retry-After` and `Idempotent-Replayed`.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, StatusCode, header};

use crate::error::{OperationState, Problem};

/// The response header with which a server says it replayed a stored answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The problem code of a 409 whose key is held by an attempt still running.
pub(crate) const KEY_IN_USE: &str = "idempotency_key_in_use";
/// The problem code of a 422 whose key was used with another request.
pub(crate) const KEY_REUSED: &str = "idempotency_key_reused";
/// The problem code of a store that could not take the claim (503, or 409
/// on a lock conflict).
const STORE_UNAVAILABLE: &str = "idempotency_store_unavailable";
/// The problem code of a key whose operation may or may not have happened
/// (409, without `Retry-After`).
pub(crate) const OUTCOME_UNCERTAIN: &str = "idempotency_outcome_uncertain";

/// What one answer means for the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Below 400, a replay included: the operation has its answer.
    Success,
    /// Try again: nothing was done, or what was done will be replayed.
    Retry,
    /// 422 `idempotency_key_reused`.
    KeyReused,
    /// `idempotency_outcome_uncertain`, or a problem whose
    /// `operation_state` is `uncertain`: final, whatever the status.
    Uncertain,
    /// Any other 4xx.
    Rejected,
    /// Any other 5xx.
    ServerError,
}

/// The verdict on one answer, read with its problem document if it had
/// one. A replayed answer is the operation's stored answer, so it is final
/// whatever its status. An uncertain outcome is final too, replayed or
/// not, even where its status alone would be retried (a 503): no retry can
/// tell what happened.
pub(crate) fn verdict(status: StatusCode, replayed: bool, problem: Option<&Problem>) -> Verdict {
    if status.as_u16() < 400 {
        return Verdict::Success;
    }
    let code = problem.and_then(|problem| problem.code.as_deref());
    let state = problem.and_then(|problem| problem.operation_state);
    if code == Some(OUTCOME_UNCERTAIN) || state == Some(OperationState::Uncertain) {
        return Verdict::Uncertain;
    }
    if !replayed {
        match status {
            StatusCode::CONFLICT if matches!(code, Some(KEY_IN_USE | STORE_UNAVAILABLE)) => {
                return Verdict::Retry;
            }
            StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT => return Verdict::Retry,
            StatusCode::UNPROCESSABLE_ENTITY if code == Some(KEY_REUSED) => {
                return Verdict::KeyReused;
            }
            _ => {}
        }
    }
    if status.is_client_error() {
        Verdict::Rejected
    } else {
        Verdict::ServerError
    }
}

/// Whether an attempt that failed below HTTP may be tried again.
///
/// Every failure to connect, send, or read the answer is: the key makes the
/// retry safe whether or not the server saw the request. What the request
/// itself got wrong (a bad URL, a redirect loop) is not.
pub(crate) fn transport_retryable(error: &reqwest::Error) -> bool {
    !(error.is_builder() || error.is_redirect() || error.is_status())
        && (error.is_connect() || error.is_timeout() || error.is_request() || error.is_body())
}

/// Whether the server says it replayed a stored answer: `Idempotent-Replayed:
/// true` (Stripe's spelling, `idem`'s default) or `Idempotent-Replay: true`
/// (as some contracts write it, and `idem` can be set to).
pub(crate) fn replayed(headers: &HeaderMap) -> bool {
    [
        IDEMPOTENT_REPLAYED,
        HeaderName::from_static("idempotent-replay"),
    ]
    .iter()
    .filter_map(|name| headers.get(name))
    .any(|value| value.as_bytes().trim_ascii().eq_ignore_ascii_case(b"true"))
}

/// The wait `Retry-After` asks for: delta-seconds, or an HTTP-date read
/// against `now` (a date in the past asks for no wait). `None` when absent
/// or unreadable.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // More digits than a u64 holds is still "very long".
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether a response body is `application/problem+json`.
pub(crate) fn is_problem(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/problem+json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_retry_after(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static(value));
        headers
    }

    fn problem(code: Option<&str>, state: Option<OperationState>) -> Problem {
        Problem {
            code: code.map(str::to_owned),
            operation_state: state,
            ..Problem::default()
        }
    }

    #[test]
    fn verdicts() {
        use Verdict::*;
        let cases = [
            (201, false, None, Success),
            (303, false, None, Success),
            (201, true, None, Success),
            (409, false, Some(KEY_IN_USE), Retry),
            (409, false, Some(STORE_UNAVAILABLE), Retry),
            (409, false, Some("order_conflict"), Rejected),
            // A tombstone: done long ago, never retried (nor with a new key).
            (409, false, Some("idempotency_key_expired"), Rejected),
            (409, false, None, Rejected),
            (429, false, None, Retry),
            (502, false, None, Retry),
            (503, false, Some(STORE_UNAVAILABLE), Retry),
            (504, false, None, Retry),
            (400, false, Some("idempotency_key_invalid"), Rejected),
            (422, false, Some(KEY_REUSED), KeyReused),
            (422, false, None, Rejected),
            (422, true, Some(KEY_REUSED), Rejected),
            (404, false, None, Rejected),
            (500, false, None, ServerError),
            (501, false, None, ServerError),
            (503, true, None, ServerError),
            (409, false, Some(OUTCOME_UNCERTAIN), Uncertain),
            (409, true, Some(OUTCOME_UNCERTAIN), Uncertain),
        ];
        for (status, replayed, code, expected) in cases {
            let status = StatusCode::from_u16(status).unwrap();
            let problem = code.map(|code| problem(Some(code), None));
            assert_eq!(
                verdict(status, replayed, problem.as_ref()),
                expected,
                "{status} {code:?}"
            );
        }
    }

    #[test]
    fn an_uncertain_state_is_final_whatever_the_code_and_status() {
        let uncertain = |code| problem(code, Some(OperationState::Uncertain));
        for (status, code) in [
            (503, Some(STORE_UNAVAILABLE)),
            (500, Some("idempotency_request_abandoned")),
            (409, None),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            for replayed in [false, true] {
                assert_eq!(
                    verdict(status, replayed, Some(&uncertain(code))),
                    Verdict::Uncertain,
                    "{status} {code:?} replayed: {replayed}"
                );
            }
        }
        let in_progress = problem(Some(KEY_IN_USE), Some(OperationState::InProgress));
        assert_eq!(
            verdict(StatusCode::CONFLICT, false, Some(&in_progress)),
            Verdict::Retry
        );
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            retry_after(&with_retry_after("2"), now),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            retry_after(&with_retry_after(" 0 "), now),
            Some(Duration::ZERO)
        );
        let in_7s = httpdate::fmt_http_date(now + Duration::from_secs(7));
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, in_7s.parse().unwrap());
        assert_eq!(retry_after(&headers, now), Some(Duration::from_secs(7)));
        assert_eq!(
            retry_after(&headers, now + Duration::from_secs(60)),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&with_retry_after("soon"), now), None);
        assert_eq!(retry_after(&with_retry_after("-1"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn replayed_and_problem_headers() {
        let mut headers = HeaderMap::new();
        assert!(!replayed(&headers));
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        assert!(replayed(&headers));
        let mut other = HeaderMap::new();
        other.insert("idempotent-replay", HeaderValue::from_static("TRUE"));
        assert!(replayed(&other));
        other.insert("idempotent-replay", HeaderValue::from_static("false"));
        assert!(!replayed(&other));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json; charset=utf-8"),
        );
        assert!(is_problem(&headers));
    }
}
