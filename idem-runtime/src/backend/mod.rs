//! The storage protocol each engine implements, once per file.
//!
//! The shared logic (outcomes, fingerprint, capture, replay) lives in
//! [`crate::protocol`]; a backend only knows how to claim a key inside a new
//! transaction, store a response in the same commit, and end a transaction.

use std::future::Future;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

use crate::Error;
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

#[cfg(feature = "postgres")]
mod postgres;

/// One claim of `(scope, key)`: what a backend needs to insert the row.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The caller the key belongs to.
    pub scope: &'a str,
    /// The validated key.
    pub key: &'a str,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the stored response is kept.
    pub ttl: Duration,
    /// How long to wait for a concurrent attempt before answering 409.
    pub wait: Duration,
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimOutcome<DB: Database> {
    /// The key is ours: the connection holds an open transaction in which
    /// the claim row is the first write.
    Claimed(PoolConnection<DB>),
    /// A previous attempt finished; its transaction is already closed.
    Finished {
        /// The fingerprint that attempt was made with.
        fingerprint: Fingerprint,
        /// Its stored response.
        response: StoredResponse,
    },
    /// Another attempt holds the key and did not finish within `wait`.
    InUse,
}

mod sealed {
    pub trait Sealed {}
}

/// A database engine `idem` can keep keys in.
///
/// Implemented for the sqlx database types of the enabled features
/// (`sqlx::Postgres` with `postgres`); sealed, because every engine must keep
/// the atomic contract, which the conformance suite checks.
pub trait Backend: Database + sealed::Sealed {
    /// Creates the key table and its expiry index if they do not exist.
    #[doc(hidden)]
    fn migrate(pool: &Pool<Self>, table: &str) -> impl Future<Output = Result<(), Error>> + Send;

    /// Opens a transaction and claims the key as its first write.
    #[doc(hidden)]
    fn claim(
        pool: &Pool<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome<Self>, sqlx::Error>> + Send;

    /// Opens a plain transaction (a request without a key, `key = "optional"`).
    #[doc(hidden)]
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<PoolConnection<Self>, sqlx::Error>> + Send;

    /// Stores the response on the claimed row and commits, in as few round
    /// trips as the engine allows. `None` commits without storing.
    #[doc(hidden)]
    fn finish(
        conn: &mut PoolConnection<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&StoredResponse>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Rolls the open transaction back.
    #[doc(hidden)]
    fn rollback(
        conn: &mut PoolConnection<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Deletes up to `batch` expired rows; returns how many went.
    #[doc(hidden)]
    fn sweep(
        pool: &Pool<Self>,
        table: &str,
        batch: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// Ends a transaction that will not commit. A connection whose rollback
/// fails is closed instead of going back to the pool, so no later checkout
/// can ever run inside a half-finished transaction.
pub(crate) async fn abandon<DB: Backend>(mut conn: PoolConnection<DB>) {
    if let Err(error) = DB::rollback(&mut conn).await {
        tracing::warn!(%error, "rollback failed; closing the connection");
        conn.close_on_drop();
    }
}

/// The hex form used to inline binary values into simple-protocol SQL:
/// only `[0-9a-f]` reaches the statement, so nothing can inject.
pub(crate) fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}
