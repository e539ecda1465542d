//! The relay: committed messages leased in batches and delivered to a
//! [`Sink`], at least once, in order within each scope, woken by this
//! process's commits and polling for the rest.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{StreamExt, stream};
use tokio::time::Instant;

use crate::backend::{Backend, Failure, MAX_ERROR_LEN, MessageRow};
use crate::error::Error;
use crate::idem::Idem;
use crate::observe;
use crate::passes::{self, LastPass, RelayRun};

use super::sink::{Message, Sink};

impl<DB: Backend> Idem<DB> {
    /// What the last pass of a relay of this store did, and when (`None`
    /// before the first).
    pub fn last_relay_pass(&self) -> Option<LastPass<RelayRun>> {
        passes::last(&self.inner().passes.relay)
    }

    /// A relay delivering this outbox's committed messages to `sink`: see
    /// [`Relay`].
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use std::time::Duration;
    /// use idem::{Idem};
    /// use idem::outbox::{Message, sink_fn};
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
            busy_every: Duration::from_millis(10),
            batch: 100,
            concurrency: 32,
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
/// or several, never lease one message at the same time) and delivers
/// them: different scopes at once (up to
/// [`concurrency`](Self::concurrency) deliveries in flight together), a
/// scope's messages one after another, each waiting for the one before it
/// to be taken. It then marks the delivered ones in one statement and
/// sweeps messages delivered longer than [`retention`](Self::retention)
/// ago. A message whose delivery fails (an error, or no answer within the
/// delivery timeout) is retried after a backoff doubling from
/// [`backoff`](Self::backoff) up to [`max_backoff`](Self::max_backoff),
/// and its scope's later messages wait for it; it is never dropped. A
/// relay that stops mid-batch leaves its lease to lapse, and the batch is
/// delivered again.
///
/// A [spawned](Self::spawn) relay is woken as soon as a request of the
/// same [`Idem`] in this process commits messages ([`Tx::outbox`],
/// or a phase's [`OutboxWriter`](super::OutboxWriter)), so they go out
/// within milliseconds of the commit. Messages other processes write are
/// found by polling: at once after a full batch, after
/// [`busy_every`](Self::busy_every) while passes find work, and backing
/// off to [`every`](Self::every) when idle.
///
/// [`Tx::outbox`]: crate::Tx::outbox
#[derive(Debug)]
pub struct Relay<DB: Backend, S> {
    idem: Idem<DB>,
    sink: Arc<S>,
    every: Duration,
    busy_every: Duration,
    batch: u32,
    concurrency: usize,
    lease: Duration,
    delivery_timeout: Duration,
    backoff: Duration,
    max_backoff: Duration,
    retention: Duration,
}

/// What a pass did with one scope's share of its batch.
#[derive(Debug, Default)]
struct ScopeRun {
    delivered: Vec<i64>,
    /// The message that failed, how long it waits before its retry, and
    /// what the sink said.
    failed: Option<(i64, Duration, String)>,
    deferred: Vec<i64>,
}

impl<DB: Backend, S: Sink> Relay<DB, S> {
    /// How long the spawned relay waits between passes when idle (500 ms
    /// by default): the backstop for messages written by other processes
    /// (this process's commits wake it at once).
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// How long the spawned relay waits after a pass that delivered less
    /// than a full batch (10 ms by default; never longer than
    /// [`every`](Self::every)). Each pass that then finds nothing doubles
    /// the wait, up to `every`.
    pub fn busy_every(mut self, busy: Duration) -> Self {
        self.busy_every = busy;
        self
    }

    /// The most messages one pass leases (100 by default, at least 1).
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How many scopes a pass delivers to at once, each with one message
    /// in flight (32 by default, at least 1).
    pub fn concurrency(mut self, scopes: usize) -> Self {
        self.concurrency = scopes.max(1);
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

    /// One pass: lease a batch, deliver it (scopes at once, each in
    /// order), mark what was delivered. Kept as the store's last relay
    /// pass ([`Idem::last_relay_pass`]), failed or not.
    ///
    /// # Panics
    ///
    /// If the lease is shorter than twice the delivery timeout: a delivery
    /// could then outlive its lease and another relay deliver the same
    /// message at the same moment.
    pub async fn run_once(&self) -> Result<RelayRun, Error> {
        self.check_lease();
        let started = std::time::Instant::now();
        let run = self.pass().await;
        passes::keep(
            &self.idem.inner().passes.relay,
            LastPass::ended(started, &run),
        );
        run
    }

    async fn pass(&self) -> Result<RelayRun, Error> {
        let pool = self.idem.pool();
        let table = self.idem.outbox_table_name();
        let token = rand::random::<i64>() & i64::MAX;
        let leased_at = Instant::now();
        let rows = DB::lease_messages(pool, table, token, self.lease, self.batch).await?;
        if rows.is_empty() {
            return Ok(RelayRun::default());
        }
        // Each scope's share, in `seq` order (the lease returns it so):
        // a scope's chain delivers it one message after another.
        let mut scopes: Vec<Vec<MessageRow>> = Vec::new();
        let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
        for row in rows {
            match index.get(&row.scope) {
                Some(&at) => scopes[at].push(row),
                None => {
                    index.insert(row.scope.clone(), scopes.len());
                    scopes.push(vec![row]);
                }
            }
        }
        let runs: Vec<ScopeRun> = stream::iter(
            scopes
                .into_iter()
                .map(|rows| self.deliver_scope(rows, leased_at)),
        )
        .buffer_unordered(self.concurrency)
        .collect()
        .await;

        let mut run = RelayRun::default();
        let (mut delivered, mut deferred) = (Vec::new(), Vec::new());
        // Failures grouped by wait and error, one statement each: a sink
        // that is down fails every scope alike.
        let mut failed: Vec<(Duration, String, Vec<i64>)> = Vec::new();
        for scope in runs {
            delivered.extend(scope.delivered);
            deferred.extend(scope.deferred);
            if let Some((seq, wait, error)) = scope.failed {
                run.failed += 1;
                match failed
                    .iter_mut()
                    .find(|(same, said, _)| *same == wait && *said == error)
                {
                    Some((_, _, seqs)) => seqs.push(seq),
                    None => failed.push((wait, error, vec![seq])),
                }
            }
        }
        // What the sink took is marked first, in one statement: a store
        // error after it would otherwise leave it to be delivered again.
        if !delivered.is_empty() {
            DB::mark_delivered(pool, table, token, &delivered).await?;
            run.delivered = count(delivered.len());
        }
        // A failed message is unleased before its scope's deferred ones,
        // so those stay behind it (the lease skips a scope whose older
        // message waits for its retry).
        for (wait, error, seqs) in failed {
            let failure = Failure {
                retry_after: wait,
                error: &error,
            };
            DB::unlease(pool, table, token, &seqs, Some(failure)).await?;
        }
        if !deferred.is_empty() {
            DB::unlease(pool, table, token, &deferred, None).await?;
            run.deferred = count(deferred.len());
        }
        observe::relayed("delivered", u64::from(run.delivered));
        observe::relayed("failed", u64::from(run.failed));
        Ok(run)
    }

    /// Delivers one scope's leased messages in order: each after the one
    /// before it was taken; after a failure, or once the lease is too
    /// short for another delivery, the rest are deferred.
    async fn deliver_scope(&self, rows: Vec<MessageRow>, leased_at: Instant) -> ScopeRun {
        let mut run = ScopeRun::default();
        let mut rows = rows.into_iter();
        while let Some(row) = rows.next() {
            // A delivery must end inside the lease, or another relay could
            // lease the message while it is still on its way.
            let spent = leased_at.elapsed() + self.delivery_timeout;
            if spent * 2 > self.lease {
                run.deferred.push(row.seq);
                run.deferred.extend(rows.map(|row| row.seq));
                break;
            }
            let seq = row.seq;
            let message = Message::from_row(row);
            let outcome =
                tokio::time::timeout(self.delivery_timeout, self.sink.deliver(&message)).await;
            let failure = match outcome {
                Ok(Ok(())) => {
                    run.delivered.push(seq);
                    continue;
                }
                Ok(Err(error)) => with_causes(&*error),
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
            run.failed = Some((seq, wait, kept(&failure)));
            run.deferred.extend(rows.map(|row| row.seq));
            break;
        }
        run
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

    /// Runs passes until the returned handle is aborted. A commit of this
    /// process that wrote messages starts a pass at once, cutting any wait
    /// short; otherwise the next pass follows at once after a full batch,
    /// after [`busy_every`](Self::busy_every) after one that delivered
    /// something, and after twice the last wait (up to
    /// [`every`](Self::every)) after one that found nothing. A failed pass
    /// (the database unreachable) is logged and tried again after `every`.
    /// Delivered messages are swept once a minute.
    ///
    /// Aborting the handle stops the relay between passes: a pass in
    /// flight runs to its end, so none of its statements is cut half-way.
    ///
    /// # Panics
    ///
    /// As [`run_once`](Self::run_once), here rather than in the task.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        self.check_lease();
        let mut woken = self.idem.inner().messages.wake.subscribe();
        let relay = Arc::new(self);
        tokio::spawn(async move {
            let busy = relay.busy_every.min(relay.every);
            let mut swept = Instant::now();
            let mut wait = relay.every;
            loop {
                // Commits up to here are this pass's to find; one during
                // the pass (perhaps after its lease) wakes the next.
                woken.borrow_and_update();
                let sweep = swept.elapsed() >= Duration::from_secs(60);
                if sweep {
                    swept = Instant::now();
                }
                let this = Arc::clone(&relay);
                let Some(run) = passes::uncut(async move {
                    let run = this.run_once().await;
                    if sweep {
                        while let Ok(1000) = this.sweep(1000).await {}
                    }
                    run
                })
                .await
                else {
                    return;
                };
                match run {
                    Ok(run) if run.failed == 0 && run.delivered + run.deferred >= relay.batch => {
                        // A full batch: more may be waiting.
                        wait = Duration::ZERO;
                    }
                    Ok(run) if run.delivered > 0 => wait = busy,
                    // Nothing, or only failures (the sink may be down):
                    // back off towards the idle period.
                    Ok(_) => wait = wait.saturating_mul(2).clamp(busy, relay.every),
                    Err(error) => {
                        let cause = std::error::Error::source(&error)
                            .map(ToString::to_string)
                            .unwrap_or_default();
                        tracing::warn!(error = %error, cause, "an outbox relay pass failed");
                        wait = relay.every;
                    }
                }
                if wait.is_zero() {
                    continue;
                }
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    woke = woken.changed() => {
                        if woke.is_err() {
                            // No sender: unreachable while this relay holds
                            // its Idem; fall back to polling.
                            tokio::time::sleep(wait).await;
                        }
                    }
                }
            }
        })
    }
}

/// `error` and its sources, as one line: `error: cause: cause`.
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

/// A delivery error as a message keeps it: at most [`MAX_ERROR_LEN`]
/// characters, without NUL (which PostgreSQL's text cannot hold).
fn kept(error: &str) -> String {
    error
        .chars()
        .map(|c| {
            if c == '\0' {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .take(MAX_ERROR_LEN)
        .collect()
}

/// A count of messages as [`RelayRun`] keeps it.
fn count(messages: usize) -> u32 {
    u32::try_from(messages).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_error_is_cut_to_its_length_without_nul() {
        assert_eq!(kept("refused"), "refused");
        assert_eq!(kept("a\0b"), "a\u{fffd}b");
        let long = "é".repeat(MAX_ERROR_LEN + 5);
        assert_eq!(kept(&long).chars().count(), MAX_ERROR_LEN);
    }

    #[test]
    fn an_error_reads_with_its_causes() {
        let io = std::io::Error::other("connection refused");
        let error: Box<dyn std::error::Error + Send + Sync> =
            Box::new(crate::error::Error::from(sqlx::Error::Io(io)));
        let line = with_causes(&*error);
        assert!(line.ends_with("connection refused"), "{line}");
    }
}
