//! What the background tasks' passes (the completer's, the relays') did,
//! and the last of each, as an operator's page shows them; and how every
//! background task runs a pass ([`uncut`]).

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// What a background task's last pass did, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LastPass<R> {
    /// When it ended (the service's clock).
    pub at: SystemTime,
    /// How long it took.
    pub took: Duration,
    /// What it did, or why it failed.
    pub result: Result<R, String>,
}

/// The last passes an [`Idem`](crate::Idem) saw, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct Passes {
    pub(crate) completer: Mutex<Option<LastPass<CompleterRun>>>,
    pub(crate) relay: Mutex<Option<LastPass<RelayRun>>>,
}

impl<R> LastPass<R> {
    /// A pass that began at `started` and ended now with `result`.
    pub(crate) fn ended<E: std::fmt::Display>(
        started: std::time::Instant,
        result: &Result<R, E>,
    ) -> Self
    where
        R: Clone,
    {
        Self {
            at: SystemTime::now(),
            took: started.elapsed(),
            result: match result {
                Ok(run) => Ok(run.clone()),
                Err(error) => Err(error.to_string()),
            },
        }
    }
}

/// Runs `pass` in a task of its own and waits for its end. A background
/// task aborted meanwhile stops here, between passes, and leaves the pass
/// to finish: a future dropped mid-statement could hand a connection back
/// to the pool out of step with its server, or still holding a lock or a
/// transaction. A panic in the pass is resumed here; `None` when the
/// runtime is shutting down.
pub(crate) async fn uncut<T: Send + 'static>(
    pass: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    match tokio::spawn(pass).await {
        Ok(done) => Some(done),
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(_) => None,
    }
}

/// Keeps `pass` as the last one in `slot`.
pub(crate) fn keep<R>(slot: &Mutex<Option<LastPass<R>>>, pass: LastPass<R>) {
    *slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(pass);
}

/// The last pass kept in `slot`.
pub(crate) fn last<R: Clone>(slot: &Mutex<Option<LastPass<R>>>) -> Option<LastPass<R>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// What one pass of the completer did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleterRun {
    /// Abandoned keys it sent a request for.
    pub resumed: u32,
    /// Of those, the ones that answered with a stored response.
    pub completed: u32,
    /// Keys whose attempts ran out after an external step may have
    /// happened: made uncertain, for a person to resolve.
    pub uncertain: u32,
    /// Keys whose attempts ran out before any external step: released, so
    /// that the next retry runs afresh.
    pub released: u32,
}

/// What one pass of a relay did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayRun {
    /// Messages the sink took.
    pub delivered: u32,
    /// Messages whose delivery failed: retried after a backoff.
    pub failed: u32,
    /// Messages leased but not tried (a scope's later messages after a
    /// failure, or a lease running short): taken again at once.
    pub deferred: u32,
}
