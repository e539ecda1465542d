//! The claim policy PostgreSQL and MySQL share: duplicates of a key in
//! flight in this process wait for it here, holding no connection, and a
//! claim the engine asks to retry is attempted again on a fresh connection.

use std::future::Future;
use std::time::Duration;

use sqlx::{Database, Pool};

use super::connection::replaced;
use super::single_flight::{self, flight_slot};
use super::{Acquire, Backend, Claim, ClaimOutcome, OpenTx, StoreError};

/// Waits, holding no connection, while another attempt of `claim`'s key in
/// this process is in flight, up to the claim's `wait`: the duplicates a
/// first attempt keeps waiting then hold no pool connections (each held
/// one while its claim waited on the row lock, so a few retries of one
/// slow request could starve every other caller). The database still
/// decides: the claim that follows has what is left of the wait, and the
/// attempt that found no flight holds one (returned) until its
/// transaction ends.
pub(crate) async fn wait_in_process<'c, DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    claim: &Claim<'c>,
) -> (Option<single_flight::Flight>, Claim<'c>) {
    let (slot, options) = flight_slot(pool, table, claim.scope, claim.key);
    let deadline = tokio::time::Instant::now() + claim.wait;
    // A duplicate woken by the flight's end takes the slot in turn: if the
    // attempt rolled back, one of them claims and the rest wait for it here
    // too, not in the database holding connections (and a retry arriving
    // later finds the new claimer's flight). After a commit each replays in
    // one short round trip.
    let flight = loop {
        match single_flight::enter(&slot) {
            Ok(flight) => break Some(flight.keep(options)),
            // Boxed: the timer would otherwise sit in every claim's future.
            Err(busy) => {
                if !Box::pin(busy.ended_by(deadline)).await {
                    break None;
                }
            }
        }
    };
    let left = Claim {
        wait: deadline.saturating_duration_since(tokio::time::Instant::now()),
        ..*claim
    };
    (flight, left)
}

/// How many times a claim is attempted while the engine asks for a retry.
pub(crate) const CLAIM_ATTEMPTS: usize = 3;

/// Why one claim attempt did not settle. Its transaction has been ended by
/// then (rolled back, or its connection closed).
pub(crate) enum Failure {
    /// Another attempt holds the key and did not finish within `wait`: 409.
    InUse,
    /// Nothing was claimed and trying again may succeed (a deadlock, a
    /// serialization failure): retried until [`CLAIM_ATTEMPTS`], then the
    /// error.
    Retry(StoreError),
    /// The claim fails with this error.
    Fatal(StoreError),
}

/// One engine's claim, attempted until it settles.
pub(crate) trait ClaimAttempt<DB: Database>: Send {
    /// Tries once on `conn`, a fresh connection; `number` counts from 1.
    fn attempt(
        &mut self,
        conn: OpenTx<DB>,
        number: usize,
    ) -> impl Future<Output = Result<ClaimOutcome<DB>, Failure>> + Send;

    /// Makes the next attempts claim without waiting for the key's holder.
    fn skip_wait(&mut self);

    /// How long the server may keep a session of this claim whose client
    /// vanished ([`Claim::orphan_bound`]).
    fn orphan_bound(&self) -> Duration;
}

/// A claimed key's connection holds this process's flight for the key, if
/// the claim took one, until its transaction ends.
pub(crate) fn held<DB: Database>(
    outcome: Result<ClaimOutcome<DB>, StoreError>,
    flight: Option<single_flight::Flight>,
) -> Result<ClaimOutcome<DB>, StoreError> {
    match (outcome, flight) {
        (Ok(ClaimOutcome::Claimed(conn)), Some(flight)) => {
            Ok(ClaimOutcome::Claimed(conn.hold(flight)))
        }
        // No flight: an attempt of the key in this process was still
        // running when the wait ran out, and it is what holds the key.
        (Ok(ClaimOutcome::InUse { .. }) | Err(StoreError::Orphaned { .. }), None) => {
            Ok(ClaimOutcome::InUse { running: true })
        }
        (outcome, _) => outcome,
    }
}

/// Runs a claim: each attempt gets a fresh connection from `pool` (taken as
/// `acquire` says) and either settles or says how it failed. The retry
/// policy PostgreSQL and MySQL share (SQLite serializes claims in the
/// process and never retries).
///
/// After a connection found gone, the claim may have reached the server
/// before the connection died, leaving a session that holds the key until
/// the server ends it (within the claim's orphan bound). The claim on the new
/// connection therefore does not wait, and a key it finds held is that
/// error, not a 409 promising a running attempt.
pub(crate) async fn claim_with_retries<DB: Backend>(
    pool: &Pool<DB>,
    mut acquire: Acquire,
    mut claim: impl ClaimAttempt<DB>,
) -> Result<ClaimOutcome<DB>, StoreError> {
    let mut number = 1;
    let mut replacement = false;
    loop {
        let (conn, untested) = OpenTx::checkout(pool, acquire)
            .await
            .map_err(StoreError::Database)?;
        match claim.attempt(conn, number).await {
            Ok(outcome) => return Ok(outcome),
            Err(Failure::InUse) if replacement => {
                return Err(StoreError::Orphaned {
                    bound: claim.orphan_bound(),
                });
            }
            Err(Failure::InUse) => return Ok(ClaimOutcome::InUse { running: false }),
            // Nothing a claim attempt does commits: on another connection
            // it starts afresh. Not counted as an attempt.
            Err(Failure::Retry(error) | Failure::Fatal(error))
                if untested && error.is_gone::<DB>() =>
            {
                replaced(&error);
                acquire = Acquire::Checked;
                // A session the server ended told us so before the claim
                // ran; only a connection lost under it (I/O) may have run
                // the claim and lost its answer.
                if matches!(error, StoreError::Database(sqlx::Error::Io(_))) {
                    replacement = true;
                    claim.skip_wait();
                }
            }
            Err(Failure::Retry(_)) if number < CLAIM_ATTEMPTS => number += 1,
            Err(Failure::Retry(error) | Failure::Fatal(error)) => return Err(error),
        }
    }
}
