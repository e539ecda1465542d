//! The points of a phased request where a test looks in: each announced
//! on stdout as `BOUNDARY <name>`, and where the service may pause a
//! request for the test.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// Where the handler announces itself, in the order it passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// The start of the handler's body: the key is claimed, committed.
    Claimed,
    /// The local phase "pending" has committed its payment.
    Local,
    /// The external step is recorded as attempted; the provider is not
    /// called yet.
    Calling,
    /// The provider answered; its answer is not recorded yet.
    Called,
    /// The last phase's write is done, its transaction open; nothing is
    /// stored yet.
    Final,
}

impl Boundary {
    pub const ALL: [Boundary; 5] = [
        Boundary::Claimed,
        Boundary::Local,
        Boundary::Calling,
        Boundary::Called,
        Boundary::Final,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Boundary::Claimed => "claimed",
            Boundary::Local => "local",
            Boundary::Calling => "calling",
            Boundary::Called => "called",
            Boundary::Final => "final",
        }
    }

    pub fn parse(name: &str) -> Option<Boundary> {
        Boundary::ALL.into_iter().find(|b| b.name() == name)
    }
}

impl std::fmt::Display for Boundary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the service pauses requests. Each execution of the handler is
/// numbered, from 1, as it starts ([`Boundaries::attempt`]); each
/// [`Pause`] stops one execution, by number, at one boundary.
#[derive(Clone, Default)]
pub struct Boundaries(Arc<Pauses>);

#[derive(Default)]
struct Pauses {
    pauses: Vec<Arc<Pause>>,
    started: AtomicUsize,
}

/// A pause of one execution of the handler at one boundary.
pub struct Pause {
    at: Boundary,
    attempt: usize,
    /// In a child process: never let go (the test kills the process).
    forever: bool,
    reached: Notify,
    release: Notify,
}

/// One execution of the handler, as it passes the boundaries.
pub struct Attempt {
    number: usize,
    boundaries: Boundaries,
}

impl Boundaries {
    /// No pause: the boundaries are only announced.
    pub fn none() -> Self {
        Self::default()
    }

    /// Pauses the first execution at `at` until the test lets it go.
    pub fn pause_at(at: Boundary) -> (Self, Arc<Pause>) {
        let (boundaries, mut pauses) = Self::pauses(&[(1, at)]);
        (boundaries, pauses.remove(0))
    }

    /// A pause for each `(execution, boundary)`, in that order.
    pub fn pauses(at: &[(usize, Boundary)]) -> (Self, Vec<Arc<Pause>>) {
        let pauses: Vec<_> = at
            .iter()
            .map(|&(attempt, at)| Arc::new(Pause::new(at, attempt, false)))
            .collect();
        let boundaries = Self(Arc::new(Pauses {
            pauses: pauses.clone(),
            started: AtomicUsize::new(0),
        }));
        (boundaries, pauses)
    }

    /// Stops the first execution at `at` for good.
    pub fn stop_at(at: Boundary) -> Self {
        Self(Arc::new(Pauses {
            pauses: vec![Arc::new(Pause::new(at, 1, true))],
            started: AtomicUsize::new(0),
        }))
    }

    /// Numbers an execution of the handler that starts.
    pub fn attempt(&self) -> Attempt {
        Attempt {
            number: self.0.started.fetch_add(1, Ordering::SeqCst) + 1,
            boundaries: self.clone(),
        }
    }
}

impl Attempt {
    /// Announces `boundary` on stdout, then waits there if told to.
    pub async fn reach(&self, boundary: Boundary) {
        println!("BOUNDARY {boundary}");
        let _ = std::io::stdout().flush();
        let pauses = &self.boundaries.0.pauses;
        let Some(pause) = pauses
            .iter()
            .find(|pause| pause.at == boundary && pause.attempt == self.number)
        else {
            return;
        };
        pause.reached.notify_one();
        if pause.forever {
            std::future::pending::<()>().await;
        }
        pause.release.notified().await;
    }
}

impl Pause {
    fn new(at: Boundary, attempt: usize, forever: bool) -> Self {
        Self {
            at,
            attempt,
            forever,
            reached: Notify::new(),
            release: Notify::new(),
        }
    }

    /// Returns once the paused request is there (within 30 s).
    pub async fn reached(&self) {
        tokio::time::timeout(Duration::from_secs(30), self.reached.notified())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "execution {} never reached `{}` within 30 s",
                    self.attempt, self.at
                )
            });
    }

    /// Lets the paused request go on.
    pub fn release(&self) {
        self.release.notify_one();
    }
}
