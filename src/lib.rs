#![doc = include_str!("../docs/crate.md")]
#![warn(missing_docs)]

pub use idem_macros::idempotent;
pub use idem_runtime::*;

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
