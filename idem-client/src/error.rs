//! What can end an operation without a successful answer.

use std::fmt;

use bytes::Bytes;
use http::StatusCode;

/// Why [`IdemClient::send`](crate::IdemClient::send) returned no successful
/// answer.
///
/// ```no_run
/// use idem_client::{Error, IdemClient, Intent};
///
/// # async fn demo(client: IdemClient, intent: Intent) {
/// let request = client.post("http://127.0.0.1:3000/v1/charges");
/// match client.send(&intent, request).await {
///     Ok(sent) => println!("{}", String::from_utf8_lossy(&sent.body)),
///     Err(Error::KeyReused { .. }) => eprintln!("a bug: one intent, two requests"),
///     Err(Error::Rejected { status, problem, .. }) => {
///         eprintln!("refused with {status}: {problem:?}")
///     }
///     Err(Error::BudgetExhausted { attempts, last }) => {
///         eprintln!("gave up after {attempts} attempts: {last}; keep the intent and try later")
///     }
///     Err(other) => eprintln!("{other}"),
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// 422 `idempotency_key_reused`: the server saw this intent's key with
    /// a different request (method, path, query or body). One intent must
    /// always send the same request; nothing was done for this one.
    #[error("the server refused the request: {problem}")]
    KeyReused {
        /// The server's problem document.
        problem: Problem,
    },

    /// A 4xx that retrying cannot change: 400 (including a missing or
    /// malformed key), 401, 404, 422 other than a reused key, a 409 that is
    /// not a key in use, or any of these replayed. (A `DELETE`'s 404 on a
    /// retry may instead count as done: see
    /// [`IdemClient::not_found_is_done`](crate::IdemClient::not_found_is_done).)
    #[error(
        "the server rejected the request with {status}{}",
        problem_suffix(problem)
    )]
    Rejected {
        /// The status.
        status: StatusCode,
        /// The body, if it was `application/problem+json`.
        problem: Option<Problem>,
        /// The body as it came.
        body: Bytes,
    },

    /// A 5xx that is not retried: 500, 501 and others that are not 502, 503
    /// or 504. (An `idem` server answers 500 after a rollback; the same
    /// intent may be sent again later.)
    #[error("the server failed with {status}{}", problem_suffix(problem))]
    ServerError {
        /// The status.
        status: StatusCode,
        /// The body, if it was `application/problem+json`.
        problem: Option<Problem>,
        /// The body as it came.
        body: Bytes,
    },

    /// The budget or the attempt limit of the
    /// [`RetryPolicy`](crate::RetryPolicy) ran out while the answers were
    /// still retryable: the operation may or may not have been done. Send
    /// the same intent again later to learn which (within the key's
    /// lifetime on the server).
    #[error("gave up after {attempts} attempt{}: the retry budget is spent", plural(*attempts))]
    BudgetExhausted {
        /// Attempts made.
        attempts: u32,
        /// What the last one got.
        #[source]
        last: LastAttempt,
    },

    /// A failure below HTTP that retrying cannot help: the request could not
    /// be built (a bad URL or header) or its redirects failed.
    #[error("the request could not be sent")]
    Transport(#[source] reqwest::Error),

    /// The request's body is a stream, which cannot be sent twice; nothing
    /// was sent. Give the body as bytes.
    #[error("the request body is a stream and cannot be sent again on a retry; nothing was sent")]
    NotCloneable,
}

/// What the last attempt of an exhausted budget got.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LastAttempt {
    /// An answer that was still retryable.
    #[error("the last attempt got {status}{}", problem_suffix(problem))]
    Status {
        /// The status.
        status: StatusCode,
        /// The body, if it was `application/problem+json`.
        problem: Option<Problem>,
    },
    /// No answer: a connection failure or a timeout.
    #[error("the last attempt got no answer")]
    Transport(#[source] reqwest::Error),
}

/// An RFC 9457 `application/problem+json` body, as `idem` answers its own
/// refusals.
///
/// ```
/// use idem_client::Problem;
///
/// let problem: Problem = serde_json::from_str(
///     r#"{"type":"about:blank","title":"Idempotency-Key reused with a different request",
///         "status":422,"code":"idempotency_key_reused",
///         "operation_state":"completed","safe_new_key":false}"#,
/// )?;
/// assert_eq!(problem.code.as_deref(), Some("idempotency_key_reused"));
/// assert_eq!(problem.operation_state.as_deref(), Some("completed"));
/// assert_eq!(problem.safe_new_key, Some(false));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[non_exhaustive]
pub struct Problem {
    /// `type`: a URI naming the kind of problem.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// `title`: a short summary.
    pub title: Option<String>,
    /// `status`: the HTTP status the server meant.
    pub status: Option<u16>,
    /// `detail`: what happened to this request.
    pub detail: Option<String>,
    /// `code`: `idem`'s stable code, such as `idempotency_key_in_use`.
    pub code: Option<String>,
    /// `operation_state`: what became of the operation the key names:
    /// `not_started`, `in_progress`, `uncertain` or `completed`.
    pub operation_state: Option<String>,
    /// `safe_new_key`: true only when a new key cannot duplicate an effect
    /// of the operation the key names.
    pub safe_new_key: Option<bool>,
}

impl Problem {
    /// Reads a problem document; `None` if `body` is not one.
    pub(crate) fn parse(body: &[u8]) -> Option<Self> {
        serde_json::from_slice(body).ok()
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let title = self.title.as_deref().unwrap_or("problem");
        match &self.code {
            Some(code) => write!(f, "{title} ({code})"),
            None => f.write_str(title),
        }
    }
}

fn problem_suffix(problem: &Option<Problem>) -> String {
    problem
        .as_ref()
        .map(|problem| format!(": {problem}"))
        .unwrap_or_default()
}

fn plural(n: u32) -> &'static str {
    if n == 1 { "" } else { "s" }
}
