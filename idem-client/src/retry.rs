//! The retry loop both senders share, and the record of its attempts.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use rand::rngs::StdRng;
use rand::{Rng, RngExt, SeedableRng};

use crate::clock::{Clock, TokioClock};
use crate::policy::RetryPolicy;

/// One attempt, as the sender saw it: for logs and progress output.
///
/// ```
/// use idem_client::{Attempt, IdemClient};
///
/// let client = IdemClient::new(reqwest::Client::new())
///     .on_attempt(|attempt: &Attempt| eprintln!("{attempt}"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// 1 for the first attempt.
    pub number: u32,
    /// What it got.
    pub outcome: Outcome,
    /// Whether the answer was a replay (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// The wait honoured after it, before the next attempt; `None` for the
    /// last attempt.
    pub wait: Option<Wait>,
}

/// What an attempt got.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// An answer with this status.
    Status(StatusCode),
    /// No answer.
    Transport {
        /// How it failed.
        kind: TransportKind,
        /// reqwest's message, with its causes.
        message: String,
    },
}

/// How an attempt without an answer failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// No connection could be made.
    Connect,
    /// The attempt timed out.
    Timeout,
    /// The connection failed while sending or receiving.
    Other,
}

/// A wait between two attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Wait {
    /// How long.
    pub duration: Duration,
    /// Why that long.
    pub reason: WaitReason,
}

/// Where a wait's length came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitReason {
    /// The answer's `Retry-After`.
    RetryAfter,
    /// The policy's jittered backoff.
    Backoff,
}

impl fmt::Display for Attempt {
    /// `attempt 1: 409 Conflict, replayed: no, waiting 2s (Retry-After)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "attempt {}: ", self.number)?;
        match &self.outcome {
            Outcome::Status(status) => write!(f, "{status}")?,
            Outcome::Transport { message, .. } => write!(f, "no answer ({message})")?,
        }
        let replayed = if self.replayed { "yes" } else { "no" };
        write!(f, ", replayed: {replayed}")?;
        if let Some(wait) = self.wait {
            let reason = match wait.reason {
                WaitReason::RetryAfter => "Retry-After",
                WaitReason::Backoff => "backoff",
            };
            // Whole seconds as `2s`, anything else to the millisecond.
            let (secs, millis) = (wait.duration.as_secs(), wait.duration.subsec_millis());
            if wait.duration.subsec_nanos() == 0 {
                write!(f, ", waiting {secs}s ({reason})")?;
            } else {
                write!(
                    f,
                    ", waiting {}ms ({reason})",
                    secs * 1000 + u64::from(millis)
                )?;
            }
        }
        Ok(())
    }
}

impl Outcome {
    /// Whether the request may have reached the server: anything but a
    /// connection that could not be made (which sent nothing).
    pub(crate) fn may_have_reached_server(&self) -> bool {
        !matches!(
            self,
            Self::Transport {
                kind: TransportKind::Connect,
                ..
            }
        )
    }

    pub(crate) fn transport(error: &reqwest::Error) -> Self {
        let kind = if error.is_connect() {
            TransportKind::Connect
        } else if error.is_timeout() {
            TransportKind::Timeout
        } else {
            TransportKind::Other
        };
        let mut message = error.to_string();
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Self::Transport { kind, message }
    }
}

/// A hook called after every attempt.
pub(crate) type Hook = Arc<dyn Fn(&Attempt) + Send + Sync>;

/// A uniform draw in `[0, max]`.
type Draw = Box<dyn FnMut(u64) -> u64 + Send>;

/// Policy, time, randomness and the attempt hook: what a sender is
/// configured with.
#[derive(Clone)]
pub(crate) struct Retrier {
    pub(crate) policy: RetryPolicy,
    pub(crate) clock: Arc<dyn Clock>,
    draw: Arc<Mutex<Draw>>,
    hook: Option<Hook>,
}

/// One attempt's result, as the loop needs it.
pub(crate) struct Tried<T, L> {
    pub(crate) outcome: Outcome,
    pub(crate) replayed: bool,
    pub(crate) next: Next<T, L>,
}

/// Whether the loop ends with `T` or may go on, remembering `L`.
pub(crate) enum Next<T, L> {
    Stop(T),
    Retry {
        retry_after: Option<Duration>,
        last: L,
    },
}

/// What to do after an attempt.
pub(crate) enum Flow<T, L> {
    /// The operation is over.
    Stop(T),
    /// The wait is over: make the next attempt.
    Again,
    /// No wait fits: give up.
    Exhausted(Exhausted<L>),
}

/// The loop gave up; `last` is what the last attempt got.
pub(crate) struct Exhausted<L> {
    pub(crate) attempts: u32,
    pub(crate) last: L,
}

impl Retrier {
    pub(crate) fn new() -> Self {
        Self {
            policy: RetryPolicy::default(),
            clock: Arc::new(TokioClock),
            draw: Arc::new(Mutex::new(draw_from(StdRng::from_rng(&mut rand::rng())))),
            hook: None,
        }
    }

    pub(crate) fn set_rng<R: Rng + Send + 'static>(&mut self, rng: R) {
        self.draw = Arc::new(Mutex::new(draw_from(rng)));
    }

    pub(crate) fn set_hook(&mut self, hook: Hook) {
        self.hook = Some(hook);
    }

    /// Starts the attempts of one operation: the budget counts from now.
    pub(crate) fn start(&self) -> Run<'_> {
        Run {
            retrier: self,
            start: self.clock.now(),
            number: 1,
            log: Vec::new(),
        }
    }

    fn draw(&self, max: u64) -> u64 {
        let mut draw = self.draw.lock().unwrap_or_else(|p| p.into_inner());
        draw(max)
    }
}

/// The attempts of one operation, driven by its sender:
///
/// ```text
/// let mut run = retrier.start();
/// loop {
///     let tried = attempt(run.timeout()).await;
///     match run.after(tried).await { Flow::Again => continue, .. }
/// }
/// ```
pub(crate) struct Run<'a> {
    retrier: &'a Retrier,
    start: Instant,
    number: u32,
    log: Vec<Attempt>,
}

impl Run<'_> {
    /// The timeout to give the next attempt: the policy's, shortened to what
    /// is left of the budget.
    pub(crate) fn timeout(&self) -> Option<Duration> {
        let policy = &self.retrier.policy;
        let left = policy.get_budget().saturating_sub(self.elapsed());
        policy.get_attempt_timeout().map(|t| t.min(left))
    }

    /// Records an attempt; if it may be retried and the next wait fits the
    /// budget and the attempt limit, waits.
    pub(crate) async fn after<T, L>(&mut self, tried: Tried<T, L>) -> Flow<T, L> {
        let retrier = self.retrier;
        let policy = &retrier.policy;
        let number = self.number;
        let (retry_after, last) = match tried.next {
            Next::Stop(value) => {
                self.record(tried.outcome, tried.replayed, None);
                return Flow::Stop(value);
            }
            Next::Retry { retry_after, last } => (retry_after, last),
        };
        let wait = match retry_after {
            Some(duration) => Wait {
                duration,
                reason: WaitReason::RetryAfter,
            },
            None => Wait {
                duration: policy.backoff_with(number - 1, |max| retrier.draw(max)),
                reason: WaitReason::Backoff,
            },
        };
        // A wait that ends at the budget's end would leave no time for the
        // attempt after it.
        let within_budget = self
            .elapsed()
            .checked_add(wait.duration)
            .is_some_and(|end| end < policy.get_budget());
        if number >= policy.get_max_attempts() || !within_budget {
            self.record(tried.outcome, tried.replayed, None);
            return Flow::Exhausted(Exhausted {
                attempts: number,
                last,
            });
        }
        self.record(tried.outcome, tried.replayed, Some(wait));
        retrier.clock.sleep(wait.duration).await;
        self.number += 1;
        Flow::Again
    }

    /// Whether an attempt made so far may have reached the server (and done
    /// the operation without its answer reaching us).
    pub(crate) fn may_have_reached_server(&self) -> bool {
        self.log.iter().any(|a| a.outcome.may_have_reached_server())
    }

    /// Every attempt so far.
    pub(crate) fn into_log(self) -> Vec<Attempt> {
        self.log
    }

    fn elapsed(&self) -> Duration {
        self.retrier
            .clock
            .now()
            .saturating_duration_since(self.start)
    }

    fn record(&mut self, outcome: Outcome, replayed: bool, wait: Option<Wait>) {
        let attempt = Attempt {
            number: self.number,
            outcome,
            replayed,
            wait,
        };
        if let Some(hook) = &self.retrier.hook {
            hook(&attempt);
        }
        self.log.push(attempt);
    }
}

fn draw_from<R: Rng + Send + 'static>(mut rng: R) -> Draw {
    Box::new(move |max| rng.random_range(0..=max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_reads_as_one_line() {
        let mut attempt = Attempt {
            number: 1,
            outcome: Outcome::Status(StatusCode::CONFLICT),
            replayed: false,
            wait: Some(Wait {
                duration: Duration::from_secs(2),
                reason: WaitReason::RetryAfter,
            }),
        };
        assert_eq!(
            attempt.to_string(),
            "attempt 1: 409 Conflict, replayed: no, waiting 2s (Retry-After)"
        );
        attempt.wait = Some(Wait {
            duration: Duration::from_micros(1_199_974),
            reason: WaitReason::Backoff,
        });
        assert!(attempt.to_string().ends_with("waiting 1199ms (backoff)"));
        attempt.outcome = Outcome::Status(StatusCode::CREATED);
        attempt.replayed = true;
        attempt.wait = None;
        assert_eq!(attempt.to_string(), "attempt 1: 201 Created, replayed: yes");
    }
}
