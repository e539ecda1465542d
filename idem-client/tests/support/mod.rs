//! Real parts for the client's tests: a scripted HTTP server, the `charges`
//! example binary, a fault-injecting proxy in front of it, and a manual
//! clock whose waits can be held until the test says.

#![allow(dead_code)] // each test binary uses its own share

pub mod charges;
pub mod proxy;
pub mod scripted;

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use idem_client::{Clock, ManualClock, Sleep};
use tokio::sync::watch;

/// Every test ends within this, whatever goes wrong.
pub const TEST_LIMIT: Duration = Duration::from_secs(60);

/// Runs `test` within [`TEST_LIMIT`].
pub async fn bounded<T>(test: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test did not finish within its time limit")
}

/// A [`ManualClock`] whose waits, once recorded, also wait for a gate the
/// test opens: "retry only after the first attempt has committed", without
/// sleeping on real time for it.
#[derive(Clone)]
pub struct GatedClock {
    pub manual: ManualClock,
    gate: watch::Receiver<bool>,
}

impl GatedClock {
    pub fn new(gate: watch::Receiver<bool>) -> Self {
        Self {
            manual: ManualClock::new(),
            gate,
        }
    }
}

impl Clock for GatedClock {
    fn now(&self) -> Instant {
        self.manual.now()
    }

    fn wall(&self) -> SystemTime {
        self.manual.wall()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        let recorded = self.manual.sleep(duration);
        let mut gate = self.gate.clone();
        Box::pin(async move {
            recorded.await;
            gate.wait_for(|open| *open)
                .await
                .expect("the gate's sender lives as long as the test");
        })
    }
}
