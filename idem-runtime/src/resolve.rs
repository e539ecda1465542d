//! Uncertain keys and their resolution: what an operator (or a
//! reconciliation job) decides for a key whose outcome `idem` does not
//! know, and the record each decision leaves.
//!
//! A phased key becomes uncertain when its attempts are exhausted after an
//! external step may have happened, or when a step that must not be
//! repeated ([`Phases::external_once`](crate::Phases::external_once)) may
//! have happened without a recorded result. Every request with the key is
//! then answered `idempotency_outcome_uncertain` and runs nothing, until
//! [`Idem::resolve`](crate::Idem::resolve) says what happened.

use std::time::SystemTime;

use http::StatusCode;

/// What an operator decided for an uncertain key: see
/// [`Idem::resolve`](crate::Idem::resolve).
///
/// ```
/// # use idem_runtime as idem;
/// use idem::Resolution;
/// use http::StatusCode;
///
/// let done = Resolution::completed(StatusCode::CREATED, serde_json::json!({"id": "ch_1"}))
///     .by("ana")
///     .note("the provider's dashboard shows ch_1 captured");
/// let again = Resolution::not_started().by("ana");
/// let resume = Resolution::retry();
/// # let _ = (done, again, resume);
/// ```
#[derive(Debug, Clone)]
pub struct Resolution {
    pub(crate) outcome: Outcome,
    pub(crate) by: Option<String>,
    pub(crate) note: Option<String>,
}

/// What a [`Resolution`] does to the key.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// Store this JSON response; every retry replays it.
    Completed {
        status: StatusCode,
        body: serde_json::Value,
    },
    /// Release the key: the next retry runs afresh.
    NotStarted,
    /// Hand the key back to the completer (and to clients' retries), its
    /// attempts counted from zero and its begun steps cleared.
    Retry,
}

impl Resolution {
    /// The operation happened, and `status` with the JSON `body` is its
    /// response: stored, and replayed to every retry of the key. `status`
    /// must be one `idem` stores (not 1xx, 408, 409, 425, 429 or 5xx
    /// other than 500, 501 and 505).
    pub fn completed(status: StatusCode, body: serde_json::Value) -> Self {
        Self::of(Outcome::Completed { status, body })
    }

    /// The operation did not happen: the key is released, and the next
    /// retry runs the request afresh (calling its external steps again).
    pub fn not_started() -> Self {
        Self::of(Outcome::NotStarted)
    }

    /// Try again: the key goes back to the completer (and to the client's
    /// retries) with its recovery point, its attempts counted afresh, and
    /// the steps marked begun forgotten, so
    /// [`external_once`](crate::Phases::external_once) steps run again.
    pub fn retry() -> Self {
        Self::of(Outcome::Retry)
    }

    /// Who decided, as the record shows them.
    pub fn by(mut self, who: impl Into<String>) -> Self {
        self.by = Some(who.into());
        self
    }

    /// Why, as the record shows it.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    fn of(outcome: Outcome) -> Self {
        Self {
            outcome,
            by: None,
            note: None,
        }
    }

    /// The outcome's name, as records and the admin API write it.
    pub fn outcome(&self) -> &'static str {
        match self.outcome {
            Outcome::Completed { .. } => "completed",
            Outcome::NotStarted => "not_started",
            Outcome::Retry => "retry",
        }
    }
}

/// What [`Idem::resolve`](crate::Idem::resolve) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolved {
    /// The key was uncertain and is resolved as asked; the record is kept.
    Resolved,
    /// No such key.
    Absent,
    /// The key is not uncertain (it is in flight, completed or expired):
    /// nothing changed.
    NotUncertain,
}

/// One resolution of a key, as [`KeyInfo::resolutions`](crate::KeyInfo)
/// lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResolutionRecord {
    /// When it was made (the service's clock).
    pub at: SystemTime,
    /// `completed`, `not_started` or `retry`.
    pub outcome: String,
    /// The status stored, for `completed`.
    pub status: Option<u16>,
    /// Who made it, as given.
    pub by: Option<String>,
    /// Why, as given.
    pub note: Option<String>,
}

/// Why a key is uncertain, as [`KeyInfo::uncertain`](crate::KeyInfo) says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Uncertainty {
    /// Since when (the service's clock).
    pub since: SystemTime,
    /// `attempts_exhausted` (the completer's and clients' attempts ran out
    /// after an external step may have happened) or `step_begun` (an
    /// [`external_once`](crate::Phases::external_once) step may have
    /// happened without a recorded result).
    pub reason: String,
    /// The step, for `step_begun`.
    pub step: Option<String>,
}

/// Why a key became uncertain, as stored in its row.
#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    since_ms: u64,
    reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    step: Option<String>,
}

impl Uncertainty {
    /// The reason of a key whose attempts ran out.
    pub(crate) const EXHAUSTED: &'static str = "attempts_exhausted";
    /// The reason of a key whose `external_once` step began unrecorded.
    pub(crate) const STEP_BEGUN: &'static str = "step_begun";

    /// The bytes an uncertain row keeps: `reason`, `step` and now.
    pub(crate) fn encode(reason: &str, step: Option<&str>) -> Vec<u8> {
        let since_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
            });
        let stored = Stored {
            since_ms,
            reason: reason.to_owned(),
            step: step.map(str::to_owned),
        };
        serde_json::to_vec(&stored).expect("plain fields serialize")
    }

    /// What an uncertain row's bytes say (a reason of `unknown` for bytes
    /// `idem` did not write).
    pub(crate) fn decode(bytes: &[u8]) -> Self {
        match serde_json::from_slice::<Stored>(bytes) {
            Ok(stored) => Self {
                since: SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(stored.since_ms),
                reason: stored.reason,
                step: stored.step,
            },
            Err(_) => Self {
                since: SystemTime::UNIX_EPOCH,
                reason: "unknown".to_owned(),
                step: None,
            },
        }
    }
}
