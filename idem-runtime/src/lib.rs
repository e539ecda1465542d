//! Runtime of [`idem`](https://docs.rs/idem): claim, replay and finish of
//! idempotent requests, and the stores they use.
//!
//! Depend on the `idem` facade crate rather than on this one; it re-exports
//! everything here together with the `#[idempotent]` attribute.

#![warn(missing_docs)]
// What only some engines use is dead in a build without the others; the
// build with every engine (CI's) still reports dead code.
#![cfg_attr(
    not(all(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code)
)]

mod admin;
mod backend;
pub mod canonical;
mod completer;
mod consume;
mod error;
mod extract;
mod fingerprint;
// The fuzz targets' checks of crate-private code; `fuzz/` builds with it.
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub mod fuzzing;
mod idem;
mod key;
#[cfg(feature = "nats")]
pub mod nats;
mod observe;
#[cfg(feature = "openapi")]
pub mod openapi;
mod outbox;
mod phased;
mod phases;
mod policy;
mod pooler;
mod problem;
mod protocol;
mod recent;
mod request;
mod response;
mod scope;
mod table;
mod tx;

pub use backend::MAX_MESSAGE_ID_LEN;
pub use backend::{Admin, Backend, Forgotten, KeyInfo, KeyState, Phased};
pub use completer::{Completer, CompleterRun};
pub use consume::{ConsumeError, Consumed};
pub use error::Error;
pub use fingerprint::Fingerprint;
pub use idem::{DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TABLE, Idem};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use observe::{Outcome, redact};
pub use outbox::{
    FnSink, MAX_TOPIC_LEN, Message, OutboxWriter, Relay, RelayRun, Sink, SinkError, sink_fn,
};
pub use phases::{FromScope, PhaseError, Phases, Resumed};
pub use policy::{IdempotentHandler, Policy};
pub use pooler::Pooler;
pub use problem::Problem;
pub use response::{DEFAULT_REPLAY_HEADERS, IDEMPOTENT_REPLAYED};
pub use scope::{MAX_SCOPE_LEN, Scope};
pub use table::DEFAULT_CONSUMED_RETENTION;
pub use tx::Tx;

/// The names of the metrics `idem` records through the `metrics` crate,
/// for dashboards and tests.
pub mod metrics {
    pub use crate::observe::{
        CLAIM_SECONDS, COMPLETER_TOTAL, CONSUMED_TOTAL, FENCED_TOTAL, OUTBOX_TOTAL, PHASES_TOTAL,
        REQUESTS_TOTAL, RESUMES_TOTAL,
    };
}

/// What `#[idempotent]` expands to, and the storage contract and encoders
/// the project's own tests and benchmarks reach. Not a public API: it
/// changes without notice.
#[doc(hidden)]
pub mod __private {
    pub use crate::backend::Phased;
    pub use crate::backend::{Acquire, Claim, ClaimOutcome, FinishError, OpenTx, StoreError};
    pub use crate::backend::{NewMessage, OutboxStore};
    pub use crate::extract::{__IdemFromBody, __IdemFromParts, __IdemFromRef, __IdemFromRequest};
    pub use crate::fingerprint::Fingerprint;
    pub use crate::phased::run_phased;
    pub use crate::protocol::{Answer, Config, KeyMode, Prepared, prepare, run};
    pub use crate::response::{StoredResponse, is_storable};
    pub use axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
    pub use axum::handler::Handler;
    pub use axum::response::{IntoResponse, Response};

    /// How many duplicates of `(scope, key)` wait in this process for its
    /// attempt in flight, holding no connection: a test's way to see one
    /// wait.
    pub fn waiting_duplicates<DB: crate::Backend>(
        idem: &crate::Idem<DB>,
        scope: &str,
        key: &str,
    ) -> usize {
        crate::backend::waiting_duplicates(idem.pool(), idem.table_name(), scope, key)
    }

    /// The future a generated handler returns.
    pub type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send>>;

    /// A reference to a handler's output, for telling an `Err` apart by
    /// autoref specialisation: `(&ErrProbe(&output)).__idem_is_err()` finds
    /// [`ResultErr`] for a `Result` (whatever alias names it), and
    /// [`NotResult`], one reference further, for any other type. Neither
    /// needs `IntoResponse`, so a type that is not one is still reported by
    /// the conversion, on the return type.
    pub struct ErrProbe<'a, T>(pub &'a T);

    /// [`ErrProbe`] of a `Result`.
    pub trait ResultErr {
        /// Whether the handler returned `Err`.
        fn __idem_is_err(&self) -> bool;
    }

    impl<T, E> ResultErr for ErrProbe<'_, Result<T, E>> {
        fn __idem_is_err(&self) -> bool {
            self.0.is_err()
        }
    }

    /// [`ErrProbe`] of anything else: never an error.
    pub trait NotResult {
        /// Always `false`.
        fn __idem_is_err(&self) -> bool {
            false
        }
    }

    impl<T> NotResult for &ErrProbe<'_, T> {}

    /// The database of a `Tx` type, however it is named: a handler's bare
    /// `Tx` (an alias such as `type Tx = idem::Tx<Postgres>;`) names its
    /// database through this.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not `idem::Tx<DB>` over a database `idem` keeps keys in",
        label = "the request's transaction must be `idem::Tx<DB>` (`DB` one of the enabled \
                 engines: `sqlx::Postgres`, `sqlx::Sqlite`, `sqlx::MySql`), or an alias of it \
                 named `Tx`"
    )]
    pub trait TxDatabase {
        /// The `DB` of `Tx<DB>`.
        type Database: crate::Backend;
        /// The request's transaction as this type.
        fn from_tx(tx: crate::Tx<Self::Database>) -> Self;
    }

    impl<DB: crate::Backend> TxDatabase for crate::Tx<DB> {
        type Database = DB;
        fn from_tx(tx: Self) -> Self {
            tx
        }
    }

    /// [`TxDatabase`] of `T`, asked of the router's state `Self` so that
    /// the bound stays open until the state is known: a `T` that is no
    /// `Tx` is then one error, at the handler's route, pointing at `T`.
    pub trait __IdemTxOf<T> {
        /// `T`'s database.
        type Database: crate::Backend;
        /// The request's transaction as `T`.
        fn from_tx(tx: crate::Tx<Self::Database>) -> T;
    }

    impl<S, T: TxDatabase> __IdemTxOf<T> for S {
        type Database = T::Database;
        fn from_tx(tx: crate::Tx<Self::Database>) -> T {
            T::from_tx(tx)
        }
    }

    /// Splits a request for the parts extractors.
    pub fn into_parts(request: Request) -> (http::request::Parts, axum::body::Body) {
        request.into_parts()
    }
}
