#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub use idem_macros::idempotent;
pub use idem_runtime::*;
