//! What operators see: one `tracing` span per idempotent request carrying
//! its [`Outcome`], and counters and a claim-latency histogram through the
//! `metrics` facade.
//!
//! Scopes and keys are never logged raw: both are hashed (SHA-256, first 8
//! bytes in hex), enough to correlate lines, useless to replay a key.

use std::time::Duration;

use sha2::{Digest, Sha256};
use tracing::Span;

/// Counter of requests through `#[idempotent]` handlers, by `outcome`.
pub const REQUESTS_TOTAL: &str = "idem_requests_total";
/// Histogram of the claim's duration in seconds (acquire, claim, and any
/// wait for a concurrent attempt), by `outcome` of the claim.
pub const CLAIM_SECONDS: &str = "idem_claim_seconds";

/// Counter of phases and external steps of phased handlers, by `phase`
/// (its name) and `outcome`: `committed`, `called`, `skipped` (recorded by
/// an earlier attempt), `failed`, `fenced`.
pub const PHASES_TOTAL: &str = "idem_phases_total";
/// Counter of phased attempts that resumed an earlier one's recovery point.
pub const RESUMES_TOTAL: &str = "idem_resumes_total";
/// Counter of phased commits refused because another attempt took the key
/// over.
pub const FENCED_TOTAL: &str = "idem_fenced_total";
/// Counter of the completer's attempts, by `outcome`: `completed`,
/// `failed`, `uncertain`, `released`.
pub const COMPLETER_TOTAL: &str = "idem_completer_total";
/// Counter of keys that became uncertain, by `reason`:
/// `attempts_exhausted`, `step_begun`.
pub const UNCERTAIN_TOTAL: &str = "idem_uncertain_total";
/// Gauge of uncertain keys, by key `table`, set by each completer pass.
pub const UNCERTAIN_KEYS: &str = "idem_uncertain_keys";
/// Counter of resolutions of uncertain keys, by `outcome`: `completed`,
/// `not_started`, `retry`.
pub const RESOLVED_TOTAL: &str = "idem_resolved_total";
/// Counter of stored values that did not open or decode
/// ([`Idem::encryption`](crate::Idem::encryption)), by `column`
/// (`headers`, `body`, `request`, `recovery`) and `reason` (`malformed`,
/// `unknown_key`, `forged`, `plain`).
pub const UNREADABLE_TOTAL: &str = "idem_unreadable_total";
/// Counter of the outbox relay's deliveries, by `outcome`: `delivered`,
/// `failed` (retried later).
pub const OUTBOX_TOTAL: &str = "idem_outbox_total";
/// Counter of messages offered to [`Idem::consume`](crate::Idem::consume),
/// by `outcome`: `applied`, `duplicate`, `failed`.
pub const CONSUMED_TOTAL: &str = "idem_consumed_total";

/// How one request through an `#[idempotent]` handler ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The key was claimed, the handler ran and its response committed.
    Claimed,
    /// A finished attempt's response was replayed.
    Replayed,
    /// Another attempt held the key: 409.
    InUse,
    /// The key was used for another request: 422.
    Reused,
    /// The request was refused before any claim: bad or missing key, body
    /// over the limit or too slow.
    Rejected,
    /// The handler ran but nothing was kept: a transient answer, an error,
    /// a panic, or a response over the cap.
    RolledBack,
    /// The handler passed its deadline (`timeout`): dropped, rolled back,
    /// 504.
    TimedOut,
    /// The store could not be reached, or the commit failed: 503.
    StoreUnavailable,
    /// No key on a `key = "optional"` handler: it ran in a plain transaction.
    Unkeyed,
    /// A phased attempt lost its key to another attempt (its lease had
    /// ended) and stopped: 409, nothing of its last phase committed.
    Fenced,
    /// The key's outcome is uncertain (now, or since an earlier attempt):
    /// nothing ran, 409 `idempotency_outcome_uncertain`.
    Uncertain,
    /// The key's stored response did not open or decode: nothing ran, 500
    /// `idempotency_response_unreadable`.
    Unreadable,
    /// The key is a tombstone (its response no longer kept): nothing ran,
    /// 409 `idempotency_key_expired`.
    Expired,
}

impl Outcome {
    /// The label value used in spans and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claimed => "claimed",
            Self::Replayed => "replayed",
            Self::InUse => "in_use",
            Self::Reused => "reused",
            Self::Rejected => "rejected",
            Self::RolledBack => "rolled_back",
            Self::TimedOut => "timed_out",
            Self::StoreUnavailable => "store_unavailable",
            Self::Unkeyed => "unkeyed",
            Self::Fenced => "fenced",
            Self::Uncertain => "uncertain",
            Self::Unreadable => "unreadable",
            Self::Expired => "expired",
        }
    }
}

/// The span of one request; fields are filled in as they become known.
pub(crate) fn request_span() -> Span {
    tracing::info_span!(
        "idem",
        outcome = tracing::field::Empty,
        scope = tracing::field::Empty,
        key = tracing::field::Empty,
    )
}

/// Records the outcome on the span and in the counter.
pub(crate) fn finish(span: &Span, outcome: Outcome) {
    span.record("outcome", outcome.as_str());
    ::metrics::counter!(REQUESTS_TOTAL, "outcome" => outcome.as_str()).increment(1);
    tracing::debug!(parent: span, outcome = outcome.as_str(), "idempotent request finished");
}

pub(crate) fn claim_latency(outcome: &'static str, elapsed: Duration) {
    ::metrics::histogram!(CLAIM_SECONDS, "outcome" => outcome).record(elapsed.as_secs_f64());
}

/// A phase or external step of a phased handler ended as `outcome`.
pub(crate) fn phase(name: &str, outcome: &'static str) {
    ::metrics::counter!(PHASES_TOTAL, "phase" => name.to_owned(), "outcome" => outcome)
        .increment(1);
    tracing::debug!(phase = name, outcome, "phase");
}

pub(crate) fn resumed() {
    ::metrics::counter!(RESUMES_TOTAL).increment(1);
}

pub(crate) fn fenced() {
    ::metrics::counter!(FENCED_TOTAL).increment(1);
}

pub(crate) fn completer(outcome: &'static str) {
    ::metrics::counter!(COMPLETER_TOTAL, "outcome" => outcome).increment(1);
}

/// A key became uncertain: counted, and logged at warning level with its
/// tags (never the scope or key themselves).
pub(crate) fn uncertain(scope: &str, key: &str, reason: &'static str, step: Option<&str>) {
    ::metrics::counter!(UNCERTAIN_TOTAL, "reason" => reason).increment(1);
    tracing::warn!(
        scope = redact(&[scope]),
        key = redact(&[scope, key]),
        reason,
        step,
        "an idempotency key's outcome is uncertain: its request may have had effects outside \
         the service, and every retry is refused until a person resolves it"
    );
}

/// The most keys whose unreadable values are remembered as logged; past
/// it the memory starts afresh (and each key may be logged once more).
const UNREADABLE_LOGGED: usize = 4096;

/// A stored value of a key did not open or decode: counted every time,
/// logged at error level once per key (by its tags) per process, so a
/// client retrying it does not flood the log.
pub(crate) fn unreadable(
    table: &str,
    scope: &str,
    key: &str,
    column: &'static str,
    reason: &'static str,
) {
    ::metrics::counter!(UNREADABLE_TOTAL, "column" => column, "reason" => reason).increment(1);
    if first_report(redact(&[table, scope, key])) {
        tracing::error!(
            table,
            scope = redact(&[scope]),
            key = redact(&[scope, key]),
            column,
            reason,
            "a stored idempotency value does not open or decode (a key removed from the \
             encryption key ring, a value copied from another row, or corruption); its \
             requests are refused, nothing runs again (logged once per key)"
        );
    }
}

/// Whether `tag` (a key's) is reported for the first time in this process
/// (or since the memory of [`UNREADABLE_LOGGED`] tags started afresh).
fn first_report(tag: String) -> bool {
    use std::collections::HashSet;
    use std::sync::{Mutex, PoisonError};
    static LOGGED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut logged = LOGGED.lock().unwrap_or_else(PoisonError::into_inner);
    let logged = logged.get_or_insert_with(HashSet::new);
    if logged.len() >= UNREADABLE_LOGGED {
        logged.clear();
    }
    logged.insert(tag)
}

pub(crate) fn resolved(outcome: &'static str) {
    ::metrics::counter!(RESOLVED_TOTAL, "outcome" => outcome).increment(1);
}

pub(crate) fn uncertain_keys(table: &str, count: u64) {
    #[allow(clippy::cast_precision_loss)]
    ::metrics::gauge!(UNCERTAIN_KEYS, "table" => table.to_owned()).set(count as f64);
}

pub(crate) fn relayed(outcome: &'static str, count: u64) {
    ::metrics::counter!(OUTBOX_TOTAL, "outcome" => outcome).increment(count);
}

pub(crate) fn consumed(outcome: &'static str) {
    ::metrics::counter!(CONSUMED_TOTAL, "outcome" => outcome).increment(1);
}

/// A short, stable, non-reversible tag for a scope or a key: what `idem`
/// logs in their place, so a service's own logs can carry the same tags.
///
/// ```
/// // The tags of a request of caller `acct_1` with key `order-42`.
/// let scope = idem_runtime::redact(&["acct_1"]);
/// let key = idem_runtime::redact(&["acct_1", "order-42"]);
/// assert_eq!(scope.len(), 16);
/// assert_ne!(scope, key);
/// assert_eq!(scope, idem_runtime::redact(&["acct_1"]));
/// ```
pub fn redact(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hex::encode(&hasher.finalize()[..8])
}

/// The names of the metrics `idem` records through the `metrics` crate,
/// for dashboards and tests.
pub mod metrics {
    pub use super::{
        CLAIM_SECONDS, COMPLETER_TOTAL, CONSUMED_TOTAL, FENCED_TOTAL, OUTBOX_TOTAL, PHASES_TOTAL,
        REQUESTS_TOTAL, RESOLVED_TOTAL, RESUMES_TOTAL, UNCERTAIN_KEYS, UNCERTAIN_TOTAL,
        UNREADABLE_TOTAL,
    };
}

#[cfg(test)]
mod tests {
    /// An unreadable value is counted at every request that meets it, by
    /// column and reason, and logged once per key.
    #[test]
    fn unreadable_values_are_counted_each_time_and_logged_once() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let scope = format!("scope-{:?}", std::time::SystemTime::now());
        ::metrics::with_local_recorder(&recorder, || {
            for _ in 0..3 {
                unreadable("keys", &scope, "k", "body", "unknown_key");
            }
        });
        let counted: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == UNREADABLE_TOTAL)
            .map(|(key, _, _, value)| {
                let labels: Vec<_> = key
                    .key()
                    .labels()
                    .map(|label| format!("{}={}", label.key(), label.value()))
                    .collect();
                (labels, value)
            })
            .collect();
        assert_eq!(
            counted,
            [(
                vec!["column=body".to_owned(), "reason=unknown_key".to_owned()],
                DebugValue::Counter(3)
            )]
        );
        assert!(
            !first_report(redact(&["keys", &scope, "k"])),
            "the key was logged already"
        );
        assert!(first_report(redact(&["keys", &scope, "other"])));
    }

    use super::*;

    #[test]
    fn each_unreadable_key_is_logged_once() {
        let tag = redact(&["t", "s", "once"]);
        assert!(first_report(tag.clone()));
        assert!(!first_report(tag.clone()));
        assert!(first_report(redact(&["t", "s", "other"])));
        assert!(!first_report(tag));
    }

    #[test]
    fn redaction_hides_and_separates() {
        let tag = redact(&["acct_1"]);
        assert_eq!(tag.len(), 16);
        assert!(!tag.contains("acct"));
        assert_eq!(tag, redact(&["acct_1"]));
        assert_ne!(redact(&["a", "bc"]), redact(&["ab", "c"]));
    }
}
