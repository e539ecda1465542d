//! Where keys are kept: the storage contract, the connection handling and
//! claim policy the engines share, and one folder per engine.
//!
//! Each contract is a public trait users name as a bound ([`Backend`],
//! [`Phased`], [`Admin`]) over a sealed one that carries its methods
//! ([`store::Store`], [`phased::PhasedStore`], [`admin::AdminStore`],
//! [`outbox_store::OutboxStore`]): `pub` traits in private modules, so no
//! other crate can name, call or implement them, and their arguments'
//! types stay internal. A file is named after the trait it holds, in this
//! folder and in every engine's: `store.rs`, `phased.rs`, `admin.rs`,
//! `outbox_store.rs`. Besides them an engine has its shared helpers and
//! documentation (`mod.rs`), its SQL (`sql.rs`) and its tests (`tests.rs`);
//! the key table's rows are decoded for every engine in `rows.rs`.
//!
//! The shared logic of a request (outcomes, fingerprint, capture, replay)
//! lives in [`crate::protocol`]; an engine only knows how to claim a key
//! inside a new transaction, store a response in the same commit, and end a
//! transaction.

mod admin;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod claim;
mod connection;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
mod outbox_store;
mod phased;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod rows;
pub(crate) mod single_flight;
mod sql;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
mod store;
#[cfg(test)]
pub(crate) mod test_support;

pub use admin::{Admin, Forgotten, KeyInfo, KeyState, MAX_RECENT};
pub(crate) use admin::{KeyReads, Param, Write};
pub use connection::{Acquire, OpenTx};
pub(crate) use connection::{abandon, in_autocommit, is_gone, transaction_depth};
pub(crate) use outbox_store::OutboxStore;
pub(crate) use outbox_store::{FailingRow, Failure, MAX_ERROR_LEN, MessageRow};
pub use outbox_store::{MAX_MESSAGE_ID_LEN, NewMessage};
pub use phased::Phased;
pub(crate) use phased::{Holder, LeaseClaim, LeaseOutcome, Release, external_step};
pub(crate) use single_flight::waiting_duplicates;
pub use store::{Backend, Claim, ClaimOutcome, FinishError, StoreError, Tombstone};
pub(crate) use store::{ConnectOptions, UNCERTAIN};

/// FNV-1a: a stable 64-bit name for any text (a statement's, an index's),
/// not a secret.
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
