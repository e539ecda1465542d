//! The transactional outbox: messages written in the request's own
//! transaction, so they exist if and only if its effects committed, and a
//! relay that delivers committed ones, at least once, to a [`Sink`].
//!
//! - Writing: [`Tx::outbox`](crate::Tx::outbox) in a handler, or a phase's
//!   [`OutboxWriter`] ([`Phases::outbox`](crate::Phases::outbox)).
//! - Delivering: [`Idem::relay`](crate::Idem::relay) makes a [`Relay`] for
//!   a [`Sink`]: your function ([`sink_fn`]), NATS JetStream (`nats`,
//!   feature `nats`) or RabbitMQ (`rabbitmq`, feature `rabbitmq`). Each
//!   pass reports a [`RelayRun`].
//! - Applying once, on the receiving side:
//!   [`Idem::consume`](crate::Idem::consume).

mod relay;
mod sink;
mod writer;

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

pub use crate::passes::RelayRun;
pub use relay::Relay;
pub use sink::{FnSink, Message, Sink, SinkError, sink_fn};
pub use writer::{MAX_TOPIC_LEN, OutboxWriter};

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::{Backend, FailingRow};
use crate::error::Error;
use crate::idem::Idem;
use crate::table::is_table_name;

impl<DB: Backend> Idem<DB> {
    /// Keeps outbox messages in `name` (a plain identifier, optionally
    /// `schema.table`) instead of `<key table>_outbox`.
    pub fn outbox_table(self, name: &str) -> Result<Self, Error> {
        if !is_table_name(name) {
            return Err(Error::InvalidTableName(name.to_owned()));
        }
        let name: Arc<str> = name.into();
        Ok(self.with(|inner| inner.messages.name_outbox(name)))
    }

    /// Keeps the records of processed messages ([`consume`](Self::consume))
    /// in `name` instead of `<key table>_consumed`.
    pub fn consumed_table(self, name: &str) -> Result<Self, Error> {
        if !is_table_name(name) {
            return Err(Error::InvalidTableName(name.to_owned()));
        }
        let name: Arc<str> = name.into();
        Ok(self.with(|inner| inner.messages.name_consumed(name)))
    }

    /// How long [`consume`](Self::consume) remembers a processed message:
    /// a redelivery within it is acknowledged without a second effect; one
    /// after it is processed as new. Seven days by default: longer than
    /// any broker's redelivery of an unacknowledged message.
    pub fn consumed_retention(self, retention: Duration) -> Self {
        self.with(|inner| inner.messages.retention = retention)
    }

    /// The outbox table's name.
    pub fn outbox_table_name(&self) -> &str {
        &self.inner().messages.outbox
    }

    /// The consumed-messages table's name.
    pub fn consumed_table_name(&self) -> &str {
        &self.inner().messages.consumed
    }

    /// Creates the outbox and consumed-messages tables and their indexes if
    /// they are missing. Safe to run on every start, from several
    /// instances at once. [`migrate`](Self::migrate) makes the key table
    /// only: call this too when you use the outbox or [`consume`](Self::consume).
    pub async fn migrate_outbox(&self) -> Result<(), Error> {
        let tables = &self.inner().messages;
        DB::migrate_outbox(self.pool(), &tables.outbox, &tables.consumed).await
    }

    /// Wakes this process's relays of this outbox: called after a commit
    /// that wrote messages, never before it.
    pub(crate) fn wake_relays(&self) {
        self.inner().messages.wake.committed();
    }

    /// The outbox's backlog as an operator's page shows it: how many
    /// messages wait, and up to `limit` scopes whose head message (the
    /// oldest undelivered one, which holds the scope's later messages
    /// back) failed its last delivery, with the sink's error. The most
    /// failed deliveries come first (with the backoff doubling, the
    /// longest failing), then the oldest messages.
    ///
    /// Two reads, not one snapshot: a scope may be counted in `pending`
    /// and be delivered by the time the failing ones are read.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn demo(idem: idem::Idem<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// let status = idem.outbox_status(20).await?;
    /// println!("{} messages wait", status.pending);
    /// for scope in &status.failing {
    ///     println!(
    ///         "{}: {} waiting, {} failed deliveries: {}",
    ///         scope.scope,
    ///         scope.pending,
    ///         scope.attempts,
    ///         scope.last_error.as_deref().unwrap_or("(no error kept)")
    ///     );
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn outbox_status(&self, limit: u32) -> Result<OutboxStatus, Error> {
        let (pool, table) = (self.pool(), self.outbox_table_name());
        let pending = DB::pending_messages(pool, table).await?;
        let failing = DB::failing_scopes(pool, table, limit).await?;
        Ok(OutboxStatus {
            pending,
            failing: failing.into_iter().map(FailingScope::from_row).collect(),
        })
    }

    /// How many outbox messages are not delivered yet.
    pub async fn pending_messages(&self) -> Result<u64, Error> {
        Ok(DB::pending_messages(self.pool(), self.outbox_table_name()).await?)
    }
}

/// The outbox's backlog: see [`Idem::outbox_status`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Messages not delivered yet.
    pub pending: u64,
    /// Scopes whose head message failed its last delivery.
    pub failing: Vec<FailingScope>,
}

/// A scope whose delivery is failing: its head message waits for a retry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailingScope {
    /// The scope.
    pub scope: String,
    /// Its messages not delivered yet.
    pub pending: u64,
    /// The head message's failed deliveries so far.
    pub attempts: u32,
    /// What its last failed delivery said, as the sink reported it (with
    /// its causes, at most 1000 characters); `None` for a failure counted
    /// before the outbox kept errors.
    pub last_error: Option<String>,
    /// When its next delivery is due (the database's clock; in the past
    /// when it is due now, or under way).
    pub next_attempt: Option<SystemTime>,
}

impl FailingScope {
    fn from_row(row: FailingRow) -> Self {
        let next = match u64::try_from(row.next_attempt_ms) {
            Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
            Err(_) => UNIX_EPOCH - Duration::from_millis(row.next_attempt_ms.unsigned_abs()),
        };
        Self {
            scope: String::from_utf8_lossy(&row.scope).into_owned(),
            pending: row.pending.unsigned_abs(),
            attempts: row.attempts.unsigned_abs(),
            last_error: row.last_error,
            next_attempt: Some(next),
        }
    }
}
