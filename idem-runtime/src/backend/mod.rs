//! Where keys are kept: the storage contract, the connection handling and
//! claim policy the engines share, and one folder per engine, each with its
//! logic (`mod.rs`), its SQL (`sql.rs`) and its tests (`tests.rs`).
//!
//! The shared logic of a request (outcomes, fingerprint, capture, replay)
//! lives in [`crate::protocol`]; an engine only knows how to claim a key
//! inside a new transaction, store a response in the same commit, and end a
//! transaction.

mod admin;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod claim;
mod connection;
mod contract;
mod lease;
#[cfg(feature = "mysql")]
mod mysql;
mod outbox;
#[cfg(feature = "postgres")]
mod postgres;
pub(crate) mod single_flight;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(test)]
mod test_support;

pub use admin::{Admin, Forgotten, KeyInfo, KeyState, MAX_RECENT};
pub use connection::{Acquire, OpenTx};
pub(crate) use connection::{abandon, in_autocommit, is_gone, transaction_depth};
pub(crate) use contract::ConnectOptions;
pub use contract::{Backend, Claim, ClaimOutcome, FinishError, StoreError};
pub use lease::Phased;
pub(crate) use lease::{Holder, LeaseClaim, LeaseOutcome, Release};
pub(crate) use outbox::MessageRow;
pub use outbox::{MAX_MESSAGE_ID_LEN, NewMessage, OutboxStore};
pub(crate) use single_flight::waiting_duplicates;

/// FNV-1a: a stable 64-bit name for any text (a statement's, an index's),
/// not a secret.
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
