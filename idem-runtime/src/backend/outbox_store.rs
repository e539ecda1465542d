//! The storage contract of the outbox and of idempotent consumers: a
//! message row written in the caller's transaction, leases a relay takes
//! on committed rows, and the record of a processed message.
//!
//! Messages are numbered by the engine's sequence (`seq`) as they are
//! written. A relay leases, in one short transaction serialised across
//! relays, the oldest deliverable messages, and of a scope only a prefix:
//! a message whose scope has an older message undelivered and not leased
//! with it (waiting for a retry, or leased by another relay) is left, so a
//! scope's messages are delivered in order by one relay at a time.

use std::future::Future;
use std::time::Duration;

use sqlx::{Database, Pool};

use crate::error::Error;

/// The longest message id [`Idem::consume`](crate::Idem::consume) takes,
/// in bytes: the consumed-messages table's id column.
pub const MAX_MESSAGE_ID_LEN: usize = 255;

/// A message to write: its stable id, the scope it belongs to, its topic
/// and its payload's bytes.
#[derive(Debug, Clone, Copy)]
pub struct NewMessage<'a> {
    /// The message's id, stable across the request's retries.
    pub id: &'a str,
    /// The caller the message belongs to (ordering is per scope).
    pub scope: &'a str,
    /// Where it goes (a subject, a routing key, an event name).
    pub topic: &'a str,
    /// The payload.
    pub payload: &'a [u8],
}

/// A committed message as a relay leased it.
#[derive(Debug, Clone)]
pub struct MessageRow {
    /// The engine's sequence number: the order messages were written in.
    pub seq: i64,
    /// The message's id.
    pub id: String,
    /// The scope's bytes.
    pub scope: Vec<u8>,
    /// The topic.
    pub topic: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// How many deliveries failed before this one.
    pub attempts: i32,
}

/// What the outbox and the consumers ask of an engine: a supertrait of
/// [`Backend`](super::Backend), implemented by every engine. Sealed as the
/// others once `idem::__private` no longer re-exports it.
pub trait OutboxStore: Database {
    /// Creates the outbox and the consumed-messages tables if missing.
    fn migrate_outbox(
        pool: &Pool<Self>,
        outbox: &str,
        consumed: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Writes a message in the transaction `conn` is in.
    fn enqueue(
        conn: &mut Self::Connection,
        outbox: &str,
        message: &NewMessage<'_>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Leases up to `batch` deliverable messages under `token` for
    /// `lease`, oldest first, each scope's a prefix of its undelivered
    /// ones; commits before returning.
    fn lease_messages(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        lease: Duration,
        batch: u32,
    ) -> impl Future<Output = Result<Vec<MessageRow>, sqlx::Error>> + Send;

    /// Marks these messages, leased under `token`, delivered.
    fn mark_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        seqs: &[i64],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Ends the lease of these messages under `token`; `retry_after`:
    /// counts a failed delivery and makes them wait that long.
    fn unlease(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        seqs: &[i64],
        retry_after: Option<Duration>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes up to `batch` messages delivered more than `retention` ago.
    fn sweep_delivered(
        pool: &Pool<Self>,
        outbox: &str,
        retention: Duration,
        batch: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// How many messages are not delivered yet.
    fn pending_messages(
        pool: &Pool<Self>,
        outbox: &str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Records `(scope, id)` as processed in the transaction `conn` is in,
    /// kept for `retention`. `false`: it was recorded before (by a
    /// committed transaction; an uncommitted one is waited for).
    fn record_consumed(
        conn: &mut Self::Connection,
        consumed: &str,
        scope: &str,
        id: &str,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes up to `batch` processed-message records past their retention.
    fn sweep_consumed(
        pool: &Pool<Self>,
        consumed: &str,
        batch: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// `seqs` as a SQL list: integers the engine gave us, formatted here.
pub(crate) fn seq_list(seqs: &[i64]) -> String {
    let mut list = String::with_capacity(seqs.len() * 8);
    for (i, seq) in seqs.iter().enumerate() {
        if i > 0 {
            list.push(',');
        }
        list.push_str(&seq.to_string());
    }
    list
}

/// A duration in whole milliseconds, for SQL arithmetic.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The message columns every engine's lease returns, in this order.
pub(crate) const MESSAGE_COLUMNS: &str = "seq, id, scope, topic, payload, attempts";
