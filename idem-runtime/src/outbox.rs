//! The transactional outbox: messages written in the request's own
//! transaction, so they exist if and only if its effects committed, and a
//! relay that delivers committed ones, at least once, to a [`Sink`].

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::backend::{Backend, MessageRow, NewMessage};
use crate::error::Error;
use crate::idem::Idem;
use crate::observe;
use crate::phases::Phases;
use crate::scope::MAX_SCOPE_LEN;
use crate::table::is_table_name;
use crate::tx::Tx;

/// The longest topic the outbox takes, in bytes.
pub const MAX_TOPIC_LEN: usize = 255;

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

    /// How many outbox messages are not delivered yet.
    pub async fn pending_messages(&self) -> Result<u64, Error> {
        Ok(DB::pending_messages(self.pool(), self.outbox_table_name()).await?)
    }

    /// A relay delivering this outbox's committed messages to `sink`: see
    /// [`Relay`].
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use std::time::Duration;
    /// use idem::{Idem, Message, sink_fn};
    ///
    /// # async fn demo(idem: Idem<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// idem.migrate_outbox().await?;
    /// let relay = idem
    ///     .relay(sink_fn(async |message: Message| {
    ///         println!("{} {}", message.topic, message.id);
    ///         Ok(())
    ///     }))
    ///     .every(Duration::from_millis(200))
    ///     .spawn();
    /// # relay.abort(); Ok(()) }
    /// ```
    pub fn relay<S: Sink>(&self, sink: S) -> Relay<DB, S> {
        Relay {
            idem: self.clone(),
            sink: Arc::new(sink),
            every: Duration::from_millis(500),
            batch: 100,
            lease: Duration::from_secs(30),
            delivery_timeout: Duration::from_secs(10),
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 3600),
        }
    }
}

/// Writes outbox messages in a transaction: the request's ([`Tx::outbox`])
/// or a phase's ([`Phases::outbox`]).
///
/// A message's id (256 random bits, in hex) is minted when it is written.
/// A message is written only by the commit that records its request's
/// response or its phase's result, so no retry writes it again, and the
/// relay and the broker redeliver it under the same id. (An id derived
/// from the key would collide once the key expired or was forgotten and
/// the same key came back.)
#[derive(Debug)]
pub struct OutboxWriter {
    table: Arc<str>,
    scope: String,
}

impl OutboxWriter {
    /// Writes a message with `payload` as JSON on `topic`, in the
    /// transaction `conn` is in; returns its id. It is delivered only if
    /// that transaction commits.
    pub async fn write<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        topic: &str,
        payload: &impl Serialize,
    ) -> Result<String, Error> {
        let payload = serde_json::to_vec(payload).map_err(Error::Payload)?;
        enqueue::<DB>(conn, &self.table, &self.scope, topic, &payload).await
    }

    /// [`write`](Self::write) with a payload already in bytes.
    pub async fn write_bytes<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        topic: &str,
        payload: &[u8],
    ) -> Result<String, Error> {
        enqueue::<DB>(conn, &self.table, &self.scope, topic, payload).await
    }
}

/// Writes a message of `scope` on `topic` in the transaction `conn` is in,
/// under a new id, and returns the id.
async fn enqueue<DB: Backend>(
    conn: &mut DB::Connection,
    table: &str,
    scope: &str,
    topic: &str,
    payload: &[u8],
) -> Result<String, Error> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN {
        return Err(Error::InvalidMessage {
            what: "topic",
            len: topic.len(),
            max: MAX_TOPIC_LEN,
        });
    }
    let id = hex::encode(rand::random::<[u8; 32]>());
    let message = NewMessage {
        id: &id,
        scope,
        topic,
        payload,
    };
    DB::enqueue(conn, table, &message).await?;
    Ok(id)
}

impl<DB: Backend> Tx<DB> {
    /// Writes a message with `payload` as JSON on `topic` in the request's
    /// transaction, and returns its id: the message exists if and only if
    /// the handler's writes commit, so a rolled-back attempt sends nothing
    /// and a replay (which does not run the handler) sends nothing again.
    /// A relay ([`Idem::relay`]) delivers it after the commit.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn demo(mut tx: idem::Tx<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// let id = tx
    ///     .outbox("email.receipt", &serde_json::json!({ "to": "a@example.com" }))
    ///     .await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn outbox(&mut self, topic: &str, payload: &impl Serialize) -> Result<String, Error> {
        let payload = serde_json::to_vec(payload).map_err(Error::Payload)?;
        let (conn, table, scope) = self.outbox_parts();
        enqueue::<DB>(conn, table, scope, topic, &payload).await
    }
}

impl<DB: Backend + crate::Phased> Phases<DB> {
    /// A writer of outbox messages for a phase: pass it the phase's
    /// connection, and its messages commit with the phase (and are not
    /// written again when a later attempt skips the phase).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[derive(Debug)] struct ApiError;
    /// # impl From<idem::PhaseError> for ApiError { fn from(_: idem::PhaseError) -> Self { ApiError } }
    /// # impl From<idem::Error> for ApiError { fn from(_: idem::Error) -> Self { ApiError } }
    /// # async fn demo(mut phases: idem::Phases<sqlx::Postgres>) -> Result<(), ApiError> {
    /// let outbox = phases.outbox();
    /// phases
    ///     .local("record", async |tx| -> Result<(), ApiError> {
    ///         outbox
    ///             .write::<sqlx::Postgres>(tx, "charge.created", &serde_json::json!({ "amount": 100 }))
    ///             .await?;
    ///         Ok(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn outbox(&self) -> OutboxWriter {
        let (table, scope) = self.outbox_parts();
        OutboxWriter { table, scope }
    }
}

/// A committed outbox message, as a [`Sink`] receives it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The message's id: stable across the request's retries and the
    /// relay's redeliveries. Deduplicate on it.
    pub id: String,
    /// The scope of the request that wrote it (empty for a request without
    /// a key). The relay keeps a scope's messages in order.
    pub scope: String,
    /// The topic it was written on.
    pub topic: String,
    /// Its payload: JSON, unless written with
    /// [`OutboxWriter::write_bytes`].
    pub payload: Bytes,
    /// How many deliveries of it failed before this one.
    pub attempts: u32,
}

impl Message {
    /// The payload, decoded from JSON.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    fn from_row(row: MessageRow) -> Self {
        Self {
            id: row.id,
            scope: String::from_utf8_lossy(&row.scope).into_owned(),
            topic: row.topic,
            payload: Bytes::from(row.payload),
            attempts: row.attempts.unsigned_abs(),
        }
    }
}

/// Why a sink did not take a message: it is delivered again later.
pub type SinkError = Box<dyn std::error::Error + Send + Sync>;

/// Where a relay delivers messages: a broker, a webhook, an email sender.
///
/// `deliver` returns `Ok` only once the message is safely taken (a
/// broker's acknowledgement of the publish); an `Err`, or no answer
/// within the relay's delivery timeout, delivers the message again later.
/// A message may be delivered more than once (a relay that stopped between
/// delivering and marking): the receiving side deduplicates on
/// [`Message::id`].
pub trait Sink: Send + Sync + 'static {
    /// Delivers one message.
    fn deliver(&self, message: &Message) -> impl Future<Output = Result<(), SinkError>> + Send;
}

/// A [`Sink`] from an async function: see [`sink_fn`].
#[derive(Debug, Clone)]
pub struct FnSink<F>(F);

/// A [`Sink`] calling `deliver` with each message.
///
/// ```
/// # use idem_runtime as idem;
/// let sink = idem::sink_fn(async |message: idem::Message| {
///     println!("{}: {}", message.topic, String::from_utf8_lossy(&message.payload));
///     Ok(())
/// });
/// # let _ = sink;
/// ```
pub fn sink_fn<F, Fut>(deliver: F) -> FnSink<F>
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), SinkError>> + Send,
{
    FnSink(deliver)
}

impl<F, Fut> Sink for FnSink<F>
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), SinkError>> + Send,
{
    fn deliver(&self, message: &Message) -> impl Future<Output = Result<(), SinkError>> + Send {
        (self.0)(message.clone())
    }
}

/// Delivers committed outbox messages to a [`Sink`], at least once, in
/// the order they were written within each scope: made by
/// [`Idem::relay`].
///
/// Each pass leases a batch of messages (several relays, in one process
/// or several, never lease one message at the same time), delivers them
/// one by one, marks the delivered ones and sweeps messages delivered
/// longer than [`retention`](Self::retention) ago. A message whose
/// delivery fails (an error, or no answer within the delivery timeout) is
/// retried after a backoff doubling from [`backoff`](Self::backoff) up to
/// [`max_backoff`](Self::max_backoff), and its scope's later messages wait
/// for it; it is never dropped. A relay that stops mid-batch leaves its
/// lease to lapse, and the batch is delivered again.
#[derive(Debug)]
pub struct Relay<DB: Backend, S> {
    idem: Idem<DB>,
    sink: Arc<S>,
    every: Duration,
    batch: u32,
    lease: Duration,
    delivery_timeout: Duration,
    backoff: Duration,
    max_backoff: Duration,
    retention: Duration,
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

impl<DB: Backend, S: Sink> Relay<DB, S> {
    /// How long the spawned relay waits between passes that found less
    /// than a batch (500 ms by default); a full batch is followed at once.
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// The most messages one pass leases (100 by default, at least 1).
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a pass's lease holds its messages from other relays (30 s
    /// by default): a relay that stops holds them this long. At least
    /// twice the delivery timeout.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one delivery may take before it counts as failed (10 s by
    /// default).
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// The wait after a message's first failed delivery (1 s by default),
    /// doubling with each further failure.
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    /// The longest wait between two deliveries of a message (60 s by
    /// default).
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max;
        self
    }

    /// How long delivered messages are kept before they are swept (24 h
    /// by default).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// One pass: lease a batch, deliver it, mark what was delivered.
    ///
    /// # Panics
    ///
    /// If the lease is shorter than twice the delivery timeout: a delivery
    /// could then outlive its lease and another relay deliver the same
    /// message at the same moment.
    pub async fn run_once(&self) -> Result<RelayRun, Error> {
        self.check_lease();
        let pool = self.idem.pool();
        let table = self.idem.outbox_table_name();
        let token = rand::random::<i64>() & i64::MAX;
        let leased_at = Instant::now();
        let rows = DB::lease_messages(pool, table, token, self.lease, self.batch).await?;
        let mut run = RelayRun::default();
        let (mut delivered, mut deferred, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        let mut blocked: HashSet<Vec<u8>> = HashSet::new();
        for row in rows {
            // A delivery must end inside the lease, or another relay could
            // lease the message while it is still on its way.
            let spent = leased_at.elapsed() + self.delivery_timeout;
            if blocked.contains(&row.scope) || spent * 2 > self.lease {
                deferred.push(row.seq);
                continue;
            }
            let seq = row.seq;
            let scope = row.scope.clone();
            let message = Message::from_row(row);
            let outcome =
                tokio::time::timeout(self.delivery_timeout, self.sink.deliver(&message)).await;
            let failure = match outcome {
                Ok(Ok(())) => {
                    delivered.push(seq);
                    continue;
                }
                Ok(Err(error)) => error.to_string(),
                Err(_) => format!("no answer within {:?}", self.delivery_timeout),
            };
            let wait = self.wait_after(message.attempts);
            tracing::warn!(
                message = %message.id,
                topic = %message.topic,
                attempts = message.attempts + 1,
                retry_in = ?wait,
                error = %failure,
                "delivering an outbox message failed; it is delivered again later"
            );
            failed.push((seq, wait));
            blocked.insert(scope);
            run.failed += 1;
        }
        // What the sink took is marked first: a store error after it
        // would otherwise leave it to be delivered again.
        if !delivered.is_empty() {
            DB::mark_delivered(pool, table, token, &delivered).await?;
            run.delivered = u32::try_from(delivered.len()).unwrap_or(u32::MAX);
        }
        for (seq, wait) in failed {
            DB::unlease(pool, table, token, &[seq], Some(wait)).await?;
        }
        if !deferred.is_empty() {
            DB::unlease(pool, table, token, &deferred, None).await?;
            run.deferred = u32::try_from(deferred.len()).unwrap_or(u32::MAX);
        }
        observe::relayed("delivered", delivered.len() as u64);
        observe::relayed("failed", u64::from(run.failed));
        Ok(run)
    }

    /// Deletes up to `batch` messages delivered longer than the retention
    /// ago; returns how many went.
    pub async fn sweep(&self, batch: u32) -> Result<u64, Error> {
        let table = self.idem.outbox_table_name();
        Ok(DB::sweep_delivered(self.idem.pool(), table, self.retention, batch).await?)
    }

    /// Panics unless the lease is at least twice the delivery timeout.
    fn check_lease(&self) {
        assert!(
            self.lease >= self.delivery_timeout * 2,
            "Relay: the lease ({:?}) must be at least twice the delivery timeout ({:?})",
            self.lease,
            self.delivery_timeout
        );
    }

    fn wait_after(&self, attempts: u32) -> Duration {
        self.backoff
            .saturating_mul(1 << attempts.min(20))
            .min(self.max_backoff)
    }

    /// Runs passes until the returned handle is aborted: at once after a
    /// full batch, otherwise every [`every`](Self::every); a failed pass (the
    /// database unreachable) is logged and tried again at the next tick.
    /// Delivered messages are swept once a minute.
    ///
    /// # Panics
    ///
    /// As [`run_once`](Self::run_once), here rather than in the task.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        self.check_lease();
        tokio::spawn(async move {
            let mut swept = Instant::now();
            loop {
                let full = match self.run_once().await {
                    // After a failure, wait: the sink may be down.
                    Ok(run) => run.failed == 0 && run.delivered + run.deferred >= self.batch,
                    Err(error) => {
                        let cause = std::error::Error::source(&error)
                            .map(ToString::to_string)
                            .unwrap_or_default();
                        tracing::warn!(error = %error, cause, "an outbox relay pass failed");
                        false
                    }
                };
                if swept.elapsed() >= Duration::from_secs(60) {
                    swept = Instant::now();
                    while let Ok(1000) = self.sweep(1000).await {}
                }
                if !full {
                    tokio::time::sleep(self.every).await;
                }
            }
        })
    }
}

/// Checks a scope for the stores' columns.
pub(crate) fn check_scope(scope: &str) -> Result<(), Error> {
    if scope.len() > MAX_SCOPE_LEN {
        return Err(Error::InvalidMessage {
            what: "scope",
            len: scope.len(),
            max: MAX_SCOPE_LEN,
        });
    }
    Ok(())
}
