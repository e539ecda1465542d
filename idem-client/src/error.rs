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
///     Err(Error::Uncertain { .. }) => {
///         eprintln!("it may or may not have happened: keep the intent, never mint another")
///     }
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

    /// The server cannot know whether the operation had its effect, and no
    /// retry can tell: `idempotency_outcome_uncertain` (a 409 without
    /// `Retry-After`), or any answer whose problem says `operation_state`
    /// `uncertain`. An `idem` server says so when a phased request may have
    /// reached a provider and its attempts ran out, and keeps saying so to
    /// every request with the key until a person (or a reconciliation job)
    /// resolves it.
    ///
    /// Never retried. Never send the operation under a new [`Intent`]
    /// either: that could do it twice (the server's `safe_new_key` is
    /// `false`). Keep the intent and report the operation as pending; once
    /// the key is resolved, sending the same intent again gets the
    /// resolution (the operation's response replayed, or, if it was found
    /// not to have happened, a first attempt).
    ///
    /// [`Intent`]: crate::Intent
    #[error("the outcome is uncertain ({status}): {problem}; do not retry with a new key")]
    Uncertain {
        /// The status (409 from `idem`).
        status: StatusCode,
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

impl Error {
    /// What became of the operation, as the server's last answer said
    /// (its problem's `operation_state`): `Some` for every answer of an
    /// `idem` server, whether it ended the operation or was the last of
    /// an exhausted budget; always [`OperationState::Uncertain`] for
    /// [`Error::Uncertain`]. `None` when no answer said (no answer at
    /// all, a request that was never sent, or a body that is not `idem`'s
    /// problem).
    ///
    /// ```no_run
    /// use idem_client::{IdemClient, Intent, OperationState};
    ///
    /// # async fn demo(client: IdemClient, intent: Intent) {
    /// let request = client.post("http://127.0.0.1:3000/v1/charges");
    /// if let Err(error) = client.send(&intent, request).await {
    ///     match error.operation_state() {
    ///         Some(OperationState::NotStarted) => println!("nothing was done: {error}"),
    ///         Some(OperationState::Completed) => println!("done, under another request"),
    ///         // In progress, uncertain, or not said: keep the intent.
    ///         _ => println!("keep {intent} and send it again later: {error}"),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn operation_state(&self) -> Option<OperationState> {
        match self {
            Self::Uncertain { .. } => Some(OperationState::Uncertain),
            _ => self.problem()?.operation_state,
        }
    }

    /// Whether a new key cannot duplicate an effect of the operation, as
    /// the server's last answer said (its problem's `safe_new_key`):
    /// `Some(true)` only when nothing of the operation was done. Always
    /// `Some(false)` for [`Error::Uncertain`]; `None` when no answer said.
    pub fn safe_new_key(&self) -> Option<bool> {
        match self {
            Self::Uncertain { .. } => Some(false),
            _ => self.problem()?.safe_new_key,
        }
    }

    /// The problem document of the answer that ended the operation (or of
    /// the last attempt of an exhausted budget), if it had one.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            Self::KeyReused { problem } | Self::Uncertain { problem, .. } => Some(problem),
            Self::Rejected { problem, .. } | Self::ServerError { problem, .. } => problem.as_ref(),
            Self::BudgetExhausted {
                last: LastAttempt::Status { problem, .. },
                ..
            } => problem.as_ref(),
            Self::BudgetExhausted {
                last: LastAttempt::Transport(_),
                ..
            }
            | Self::Transport(_)
            | Self::NotCloneable => None,
        }
    }
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
/// use idem_client::{OperationState, Problem};
///
/// let problem: Problem = serde_json::from_str(
///     r#"{"type":"about:blank","title":"Idempotency-Key reused with a different request",
///         "status":422,"code":"idempotency_key_reused",
///         "operation_state":"completed","safe_new_key":false}"#,
/// )?;
/// assert_eq!(problem.code.as_deref(), Some("idempotency_key_reused"));
/// assert_eq!(problem.operation_state, Some(OperationState::Completed));
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
    /// `operation_state`: what became of the operation the key names.
    /// `None` when absent, or a state this version does not know.
    #[serde(default, deserialize_with = "known_state")]
    pub operation_state: Option<OperationState>,
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

/// What became of the operation a key names, as an `idem` server says in
/// every problem it answers (`operation_state`).
///
/// ```
/// use idem_client::OperationState;
///
/// let state: OperationState = "in_progress".parse()?;
/// assert_eq!(state, OperationState::InProgress);
/// assert_eq!(state.to_string(), "in_progress");
/// # Ok::<(), idem_client::UnknownState>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OperationState {
    /// `not_started`: nothing of it was done. Sending it again runs it
    /// afresh, and a new key cannot duplicate an effect.
    NotStarted,
    /// `in_progress`: an attempt is running, or stopped and is kept to be
    /// resumed, or only a retry with the same key can tell whether it
    /// landed. Send the same intent again.
    InProgress,
    /// `uncertain`: it may or may not have had its effect, and no retry
    /// can tell; a person decides ([`Error::Uncertain`]).
    Uncertain,
    /// `completed`: the key's request was answered (another request under
    /// the same key gets 422).
    Completed,
}

impl OperationState {
    /// The wire form: `not_started`, `in_progress`, `uncertain` or
    /// `completed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotStarted => "not_started",
            Self::InProgress => "in_progress",
            Self::Uncertain => "uncertain",
            Self::Completed => "completed",
        }
    }
}

impl fmt::Display for OperationState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OperationState {
    type Err = UnknownState;

    fn from_str(state: &str) -> Result<Self, Self::Err> {
        [
            Self::NotStarted,
            Self::InProgress,
            Self::Uncertain,
            Self::Completed,
        ]
        .into_iter()
        .find(|known| known.as_str() == state)
        .ok_or(UnknownState)
    }
}

/// A string that is none of [`OperationState`]'s wire forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not an operation state: not_started, in_progress, uncertain or completed")]
pub struct UnknownState;

/// `operation_state` leniently: a state a newer server adds reads as
/// `None` rather than losing the whole problem document.
fn known_state<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<OperationState>, D::Error> {
    let state: Option<String> = serde::Deserialize::deserialize(deserializer)?;
    Ok(state.and_then(|state| state.parse().ok()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_this_version_does_not_know_keeps_the_rest_of_the_problem() {
        let problem = Problem::parse(
            br#"{"code":"idempotency_key_in_use","operation_state":"paused","safe_new_key":false}"#,
        )
        .expect("still a problem");
        assert_eq!(problem.code.as_deref(), Some("idempotency_key_in_use"));
        assert_eq!(problem.operation_state, None);
        assert_eq!(problem.safe_new_key, Some(false));
        let absent = Problem::parse(br#"{"code":"x"}"#).unwrap();
        assert_eq!(absent.operation_state, None);
    }

    #[test]
    fn states_read_their_wire_form() {
        for state in [
            OperationState::NotStarted,
            OperationState::InProgress,
            OperationState::Uncertain,
            OperationState::Completed,
        ] {
            assert_eq!(state.as_str().parse(), Ok(state));
            let json = format!(r#"{{"operation_state":"{state}"}}"#);
            assert_eq!(
                Problem::parse(json.as_bytes()).unwrap().operation_state,
                Some(state)
            );
        }
        assert_eq!("Uncertain".parse::<OperationState>(), Err(UnknownState));
    }
}
