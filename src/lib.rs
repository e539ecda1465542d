#![doc = include_str!("../docs/crate.md")]
#![warn(missing_docs)]

pub use idem_macros::idempotent;
pub use idem_runtime::*;

/// The client half: intents and a retrying reqwest sender (`client` feature).
#[cfg(feature = "client")]
pub use idem_client as client;

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
