//! Time, injectable: the senders measure their budget, read `Retry-After`
//! dates and wait between attempts only through a [`Clock`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The future a [`Clock`] returns for a wait.
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Where the senders get the time and how they wait.
///
/// [`TokioClock`] is the default; tests use a [`ManualClock`], which waits
/// no real time and records every wait. The per-attempt timeout is not on
/// the clock: it is reqwest's own request timeout.
///
/// ```
/// use std::time::{Duration, Instant, SystemTime};
/// use idem_client::{Clock, Sleep};
///
/// /// Waits half as long as asked: for a demo, not for production.
/// struct Hasty;
///
/// impl Clock for Hasty {
///     fn now(&self) -> Instant { Instant::now() }
///     fn wall(&self) -> SystemTime { SystemTime::now() }
///     fn sleep(&self, duration: Duration) -> Sleep {
///         Box::pin(tokio::time::sleep(duration / 2))
///     }
/// }
/// ```
pub trait Clock: Send + Sync + 'static {
    /// Monotonic time: the retry budget is measured with it.
    fn now(&self) -> Instant;

    /// Wall-clock time: a `Retry-After` HTTP-date is read against it.
    fn wall(&self) -> SystemTime;

    /// A future that completes after `duration`.
    fn sleep(&self, duration: Duration) -> Sleep;
}

/// The real clock: [`tokio::time`] for waits and the monotonic time (so a
/// runtime with paused time pauses it too), [`SystemTime`] for dates.
///
/// ```
/// # use idem_client::{Clock, TokioClock};
/// let before = TokioClock.now();
/// assert!(TokioClock.now() >= before);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// A clock that only moves when told: every [`sleep`](Clock::sleep)
/// completes at once, moves the clock forward by its duration and is
/// recorded, so a test can assert how long a sender waited without waiting.
///
/// Clones share one time and one record.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use idem_client::{Clock, ManualClock};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let clock = ManualClock::at(SystemTime::UNIX_EPOCH);
/// let start = clock.now();
/// clock.sleep(Duration::from_secs(2)).await;
/// assert_eq!(clock.sleeps(), [Duration::from_secs(2)]);
/// assert_eq!(clock.now() - start, Duration::from_secs(2));
/// assert_eq!(clock.wall(), SystemTime::UNIX_EPOCH + Duration::from_secs(2));
/// # }
/// ```
#[derive(Clone)]
pub struct ManualClock {
    start: Instant,
    wall_start: SystemTime,
    state: Arc<Mutex<ManualState>>,
}

#[derive(Default)]
struct ManualState {
    elapsed: Duration,
    sleeps: Vec<Duration>,
}

impl ManualClock {
    /// A clock whose wall time starts now.
    pub fn new() -> Self {
        Self::at(SystemTime::now())
    }

    /// A clock whose wall time starts at `wall`.
    pub fn at(wall: SystemTime) -> Self {
        Self {
            start: Instant::now(),
            wall_start: wall,
            state: Arc::default(),
        }
    }

    /// Moves the clock forward without recording a sleep.
    pub fn advance(&self, duration: Duration) {
        self.lock().elapsed += duration;
    }

    /// How far the clock has moved since it was made.
    pub fn elapsed(&self) -> Duration {
        self.lock().elapsed
    }

    /// Every sleep asked of this clock (and its clones), in order.
    pub fn sleeps(&self) -> Vec<Duration> {
        self.lock().sleeps.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ManualState> {
        // The state stays consistent across a panic: every update is one
        // assignment or push.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("ManualClock")
            .field("elapsed", &state.elapsed)
            .field("sleeps", &state.sleeps)
            .finish()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    fn wall(&self) -> SystemTime {
        self.wall_start + self.elapsed()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        let mut state = self.lock();
        state.elapsed += duration;
        state.sleeps.push(duration);
        Box::pin(std::future::ready(()))
    }
}
