//! The relay: committed messages leased in batches and delivered to a
//! [`Sink`], at least once, in order within each scope.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::Backend;
use crate::error::Error;
use crate::idem::Idem;
use crate::observe;

use super::sink::{Message, Sink};

impl<DB: Backend> Idem<DB> {
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
