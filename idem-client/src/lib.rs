#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod clock;
mod error;
mod intent;
mod middleware;
mod policy;
mod retry;
mod rules;
mod send;

pub use clock::{Clock, ManualClock, Sleep, TokioClock};
pub use error::{Error, LastAttempt, OperationState, Problem, UnknownState};
pub use intent::{Intent, InvalidKey, MAX_KEY_LEN};
pub use middleware::{AlreadyGone, IdemMiddleware};
pub use policy::RetryPolicy;
pub use retry::{Attempt, Outcome, TransportKind, Wait, WaitReason};
pub use rules::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use send::{IdemClient, Sendable, Sent};

/// `reqwest-middleware`, whose [`Middleware`](reqwest_middleware::Middleware)
/// trait [`IdemMiddleware`] implements.
pub use reqwest_middleware;
