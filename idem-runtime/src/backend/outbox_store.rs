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

/// The longest delivery error a message keeps, in characters: enough for a
/// broker's message and its causes, short enough to read on a page.
pub const MAX_ERROR_LEN: usize = 1000;

/// A failed delivery, as [`OutboxStore::unlease`] counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure<'a> {
    /// How long the message waits before its next delivery.
    pub retry_after: Duration,
    /// What the sink said, at most [`MAX_ERROR_LEN`] characters, no NUL.
    pub error: &'a str,
}

/// The head of a scope whose delivery is failing: its oldest undelivered
/// message, which failed at least once.
#[derive(Debug, Clone)]
pub struct FailingRow {
    /// The scope's bytes.
    pub scope: Vec<u8>,
    /// The scope's undelivered messages.
    pub pending: i64,
    /// The head's failed deliveries.
    pub attempts: i32,
    /// What its last failed delivery said (`NULL` for a failure counted
    /// before the column existed).
    pub last_error: Option<String>,
    /// When its next delivery is due, in milliseconds since the Unix epoch.
    pub next_attempt_ms: i64,
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

    /// Ends the lease of these messages under `token`; with a `failure`:
    /// counts a failed delivery, keeps its error and makes them wait its
    /// `retry_after`.
    fn unlease(
        pool: &Pool<Self>,
        outbox: &str,
        token: i64,
        seqs: &[i64],
        failure: Option<Failure<'_>>,
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

    /// Up to `limit` scopes whose head (oldest undelivered message) failed
    /// a delivery, the most failed first, then the oldest.
    fn failing_scopes(
        pool: &Pool<Self>,
        outbox: &str,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<FailingRow>, sqlx::Error>> + Send;

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

/// The failing heads' list, one text for every engine: `next_ms` is the
/// engine's expression of `h.available_at` in epoch milliseconds. A head
/// is a scope's undelivered message with no older undelivered one; only a
/// head that failed is read, so the scan starts from the messages that
/// failed (few) rather than from every pending one.
pub(crate) fn failing_sql(outbox: &str, next_ms: &str, limit: u32) -> String {
    format!(
        "SELECT h.scope, h.attempts, h.last_error, {next_ms} AS next_ms, \
             (SELECT count(*) FROM {outbox} p \
                 WHERE p.scope = h.scope AND p.delivered_at IS NULL) AS pending \
         FROM {outbox} h \
         WHERE h.delivered_at IS NULL AND h.attempts > 0 \
             AND NOT EXISTS (SELECT 1 FROM {outbox} o \
                 WHERE o.scope = h.scope AND o.delivered_at IS NULL AND o.seq < h.seq) \
         ORDER BY h.attempts DESC, h.seq LIMIT {limit}"
    )
}
