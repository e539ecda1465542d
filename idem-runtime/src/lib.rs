//! Runtime of [`idem`](https://docs.rs/idem): claim, replay and finish of
//! idempotent requests, and the stores they use.
//!
//! Depend on the `idem` facade crate rather than on this one; it re-exports
//! everything here together with the `#[idempotent]` attribute.
//!
//! This file is the table of contents: it declares the modules and names
//! what each gives the public API. From the top down: the request's way
//! through `protocol` (its two modes) and the handler's
//! handles ([`Tx`], [`Phases`]); the [`Idem`] store with its settings,
//! operations, outbox and consumers; the completer; the storage contract
//! and its engines in `backend`; and the leaves (keys, scopes,
//! fingerprints, stored requests and responses, problems, observability).

#![warn(missing_docs)]
// What only some engines use is dead in a build without the others; the
// build with every engine (CI's) still reports dead code.
#![cfg_attr(
    not(all(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code)
)]

// A request's way: the attribute's policy, the two modes, the handles.
mod extract;
mod phases;
mod policy;
mod protocol;
mod tx;

// The store handlers share, and what it offers beside requests.
#[cfg(feature = "admin")]
pub mod admin;
pub mod completer;
mod consume;
mod idem;
#[cfg(feature = "openapi")]
pub mod openapi;
mod operations;
pub mod outbox;
mod passes;
mod resolve;

// Where keys are kept: the storage contract and one folder per engine.
mod backend;
mod pooler;
mod recent;
mod table;
mod wake;

// The leaves: what a request is made of and what an answer is.
pub mod canonical;
mod error;
mod fingerprint;
// The fuzz targets' checks, next to the code they check.
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub mod fuzzing;
mod hash;
mod key;
mod observe;
mod problem;
mod recovery;
mod request;
mod response;
mod scope;
mod seal;

pub use backend::{Admin, Backend, Forgotten, KeyInfo, KeyState, MAX_MESSAGE_ID_LEN, Phased};
pub use completer::FromScope;
pub use consume::{ConsumeError, Consumed};
pub use error::Error;
pub use fingerprint::Fingerprint;
pub use hash::{KeyHasher, KeyHasherError};
pub use idem::{
    DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TABLE, Idem,
};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use observe::{Outcome, metrics, redact};
pub use operations::KeyFilter;
pub use passes::LastPass;
pub use phases::{PhaseError, Phases};
pub use policy::{IdempotentHandler, Policy};
pub use pooler::Pooler;
pub use problem::{OperationState, Problem};
pub use resolve::{Resolution, ResolutionRecord, Resolved, Uncertainty};
pub use response::{DEFAULT_REPLAY_HEADERS, IDEMPOTENT_REPLAYED};
pub use scope::{MAX_SCOPE_LEN, Scope};
pub use seal::{KeyRing, KeyRingError, MAX_KEY_ID_LEN};
pub use table::DEFAULT_CONSUMED_RETENTION;
pub use tx::Tx;

// Encryption at rest end to end, on every engine: it drives the protocol,
// so it stands above everything it checks.
#[cfg(test)]
mod sealing_contract;
// Hashed scopes and keys end to end, on every engine.
#[cfg(test)]
mod hashing_contract;

/// What `#[idempotent]`'s expansion names. Not a public API: it changes
/// without notice.
#[doc(hidden)]
#[path = "expand.rs"]
pub mod __private;
