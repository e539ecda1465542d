//! Waking this process's relays when a transaction that wrote outbox
//! messages commits, in memory: no `LISTEN`/`NOTIFY`, which a
//! transaction-mode pooler does not carry and which takes a global lock at
//! commit. Messages other processes write are found by polling.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

/// The wake-up an [`Idem`](crate::Idem) shares with its relays: a counter
/// bumped after each commit that wrote messages. A relay marks the counter
/// seen as a pass begins, so a commit during the pass (whose message the
/// pass may have missed) is followed by another pass at once, and one
/// before it is covered by it.
#[derive(Debug)]
pub(crate) struct Wake(watch::Sender<u64>);

impl Wake {
    pub(crate) fn new() -> Self {
        Self(watch::Sender::new(0))
    }

    /// Wakes every relay of this outbox in the process. Call only after
    /// the commit succeeded: a pass woken earlier finds nothing, and the
    /// message would wait for the next poll.
    pub(crate) fn committed(&self) {
        // `send_modify` notifies even with no relay subscribed (no error
        // path), and a relay that subscribes later polls once first anyway.
        self.0
            .send_modify(|commits| *commits = commits.wrapping_add(1));
    }

    /// A relay's end: `changed()` resolves once a commit happened since it
    /// last marked the counter seen.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// Whether outbox messages were written in a phase's transaction through
/// its [`OutboxWriter`](super::OutboxWriter), which does not see the
/// commit: the phase's commit takes the mark and wakes the relays.
#[derive(Debug, Clone, Default)]
pub(crate) struct Written(Arc<AtomicBool>);

impl Written {
    pub(crate) fn mark(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether a message was written since the last take; clears the mark.
    pub(crate) fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}
