//! What `#[idempotent]`'s expansion names, and nothing else. Not a public
//! API: it changes without notice.

pub use crate::backend::Phased;
pub use crate::extract::{__IdemFromBody, __IdemFromParts, __IdemFromRef, __IdemFromRequest};
pub use crate::protocol::{Answer, Config, KeyMode, prepare, run, run_phased};
pub use axum::extract::Request;
pub use axum::handler::Handler;
pub use axum::response::IntoResponse;

use axum::response::Response;

use crate::backend::Backend;
use crate::tx::Tx;

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
    type Database: Backend;
    /// The request's transaction as this type.
    fn from_tx(tx: Tx<Self::Database>) -> Self;
}

impl<DB: Backend> TxDatabase for Tx<DB> {
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
    type Database: Backend;
    /// The request's transaction as `T`.
    fn from_tx(tx: Tx<Self::Database>) -> T;
}

impl<S, T: TxDatabase> __IdemTxOf<T> for S {
    type Database = T::Database;
    fn from_tx(tx: Tx<Self::Database>) -> T {
        T::from_tx(tx)
    }
}

/// Splits a request for the parts extractors.
pub fn into_parts(request: Request) -> (http::request::Parts, axum::body::Body) {
    request.into_parts()
}
