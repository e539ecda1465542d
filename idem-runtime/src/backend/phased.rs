//! The storage contract of the phased mode ([`Phased`], its operations
//! [`PhasedStore`]): a claim that commits on its own with a lease and a
//! fencing token, recovery points written under that token, and what the
//! completer reads and writes.
//!
//! Every write after the claim names the token it holds and matches no row
//! once another attempt took the key over (a new token): that is the fence.
//! A phase's own transaction writes its recovery point last, under the
//! token, so a fenced phase rolls back with everything it wrote.

use std::future::Future;
use std::time::Duration;

use sqlx::Pool;

use super::store::decode_finished;
use super::{Acquire, Backend, Claim, FinishError, OpenTx, StoreError};
use crate::fingerprint::Fingerprint;
use crate::response::EncodedResponse;
use crate::seal::{Column, Sealer};

/// Who holds a key in the phased mode: the key and the fencing token the
/// holder's claim got.
#[derive(Debug, Clone)]
pub struct Holder {
    /// The caller the key belongs to.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The fencing token: each claim or takeover of the key gets a larger one.
    pub token: i64,
}

/// A phased claim: the atomic claim's fields, the lease and the request
/// kept for the completer.
#[derive(Debug)]
pub struct LeaseClaim<'a> {
    /// The key, its scope, fingerprint and lifetime.
    pub claim: Claim<'a>,
    /// How long the claim (and each recovery point after it) holds the key.
    pub lease: Duration,
    /// The request as the completer replays it (`request::StoredRequest`).
    pub request: &'a [u8],
    /// The token a completer reserved the key with and handed to the
    /// request it sends: a claim naming it takes the key over though the
    /// reservation's lease is live.
    pub reserved: Option<i64>,
    /// How many resumptions a key gets before its claim gives it up
    /// ([`LeaseOutcome::Exhausted`]); a reservation's request is its own
    /// counted resumption.
    pub max_attempts: u32,
}

/// What a phased claim found.
#[derive(Debug)]
pub enum LeaseOutcome {
    /// The key is ours, committed, under `token`; `recovery` is the last
    /// recovery point of an earlier attempt (`None` for a new key).
    Owned {
        /// Our fencing token.
        token: i64,
        /// The recovery point we resume from.
        recovery: Option<Vec<u8>>,
    },
    /// An attempt finished the key.
    Finished {
        /// The fingerprint it was made with.
        fingerprint: Fingerprint,
        /// Its stored response.
        response: EncodedResponse,
    },
    /// Another attempt holds a live lease for `remaining`.
    Leased {
        /// Until the lease ends.
        remaining: Duration,
    },
    /// The key is held by an attempt of the atomic mode (an endpoint
    /// without phases used the same key).
    Held,
    /// The key is unfinished, for another request (another fingerprint).
    Reused,
    /// The key's lease ended and its attempts are spent
    /// ([`Idem::max_attempts`](crate::Idem::max_attempts)): the caller gives
    /// it up (uncertain, or released when `external` says nothing outside
    /// the database was attempted) rather than resuming it again.
    Exhausted {
        /// The token its lease ended under.
        token: i64,
        /// Its attempts so far.
        attempts: u32,
        /// Its recovery point, as stored (sealed, maybe): whether an
        /// external step may have happened ([`external_step`]).
        recovery: Option<Vec<u8>>,
    },
    /// The key's outcome is uncertain; `fingerprint` is the request it names.
    Uncertain {
        /// The fingerprint the key was claimed with.
        fingerprint: Fingerprint,
    },
}

/// An abandoned key as the completer reads it: unfinished, its lease over.
#[derive(Debug)]
pub struct Abandoned {
    /// The key and the token its lease ended under.
    pub holder: Holder,
    /// How many times it was resumed already (by a completer or a
    /// client's retry).
    pub attempts: u32,
    /// Its recovery point, as stored (sealed, maybe): whether an external
    /// step may have happened ([`external_step`]).
    pub recovery: Option<Vec<u8>>,
    /// The request to send again (`request::StoredRequest`), if kept.
    pub request: Option<Vec<u8>>,
}

/// How a failed attempt (or one given up) leaves its key.
#[derive(Debug, Clone, Copy)]
pub enum Release<'a> {
    /// Nothing outside the database was attempted: the row goes, and the
    /// next attempt starts afresh.
    Delete,
    /// An external step may have happened: the row stays, with its recovery
    /// point, and its lease ends after this long (zero: at once).
    Keep(Duration),
    /// Whether an external step happened is unknown and no attempt may
    /// find out: the row becomes uncertain (`status`
    /// [`UNCERTAIN`](super::store::UNCERTAIN), these bytes, the
    /// `resolve::Uncertainty` as JSON, in `body`), its recovery point and
    /// request kept, its lease ended at `created_at` (never `NULL`, so the
    /// lease index lists it).
    Uncertain(&'a [u8]),
}

/// An engine that supports the phased mode: the bound of
/// [`Phases<DB>`](crate::Phases) and of the completer.
///
/// Implemented by every engine `idem` keeps keys in, and by no other type:
/// its operations live on a supertrait no other crate can name.
#[diagnostic::on_unimplemented(
    message = "the phased mode (`Phases<{Self}>`) is not available on `{Self}`",
    label = "phases need a key store with leases",
    note = "the phased mode runs on the engines `idem` keeps keys in: `sqlx::Postgres`, \
            `sqlx::Sqlite` and `sqlx::MySql`, each with its cargo feature"
)]
pub trait Phased: Backend + PhasedStore {}

/// The phased mode's storage operations: what [`Phased`] asks of an
/// engine. Sealed: `pub` in a private module, so only this crate names it.
pub trait PhasedStore: Backend {
    /// Claims the key with a lease, or takes over a lease that ended (or
    /// that `reserved` names), in one statement that commits on its own.
    fn lease(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &LeaseClaim<'_>,
    ) -> impl Future<Output = Result<LeaseOutcome, StoreError>> + Send;

    /// Writes the recovery point and renews the lease, if `holder` still
    /// holds the key: inside a phase's transaction (its last write) or on
    /// its own. `false`: fenced, nothing written.
    fn record(
        conn: &mut Self::Connection,
        table: &str,
        holder: &Holder,
        recovery: &[u8],
        lease: Duration,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// [`record`](Self::record) as a phase's last write, then its commit:
    /// one round trip where the engine allows (by default two, the write
    /// and then the commit). `false`: fenced, nothing committed (the
    /// caller rolls back).
    fn record_and_commit(
        conn: &mut OpenTx<Self>,
        table: &str,
        holder: &Holder,
        recovery: &[u8],
        lease: Duration,
    ) -> impl Future<Output = Result<bool, FinishError>> + Send {
        async move {
            let written = Self::record(&mut ***conn, table, holder, recovery, lease).await;
            commit_if(conn, table, written).await
        }
    }

    /// [`store`](Self::store) in the last phase, then its commit, as
    /// `record_and_commit`.
    fn store_and_commit(
        conn: &mut OpenTx<Self>,
        table: &str,
        holder: &Holder,
        response: &EncodedResponse,
    ) -> impl Future<Output = Result<bool, FinishError>> + Send {
        async move {
            let written = Self::store(&mut ***conn, table, holder, response).await;
            commit_if(conn, table, written).await
        }
    }

    /// Stores the response on the key, in the final phase's transaction, if
    /// `holder` still holds it; the recovery point and kept request go.
    /// `false`: fenced, nothing written.
    fn store(
        conn: &mut Self::Connection,
        table: &str,
        holder: &Holder,
        response: &EncodedResponse,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Leaves the key after a failed attempt, if `holder` still holds it.
    fn release(
        conn: &mut Self::Connection,
        table: &str,
        holder: &Holder,
        how: Release<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Up to `limit` abandoned keys, the longest abandoned first.
    fn abandoned(
        pool: &Pool<Self>,
        table: &str,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Abandoned>, sqlx::Error>> + Send;

    /// How many of the table's keys are uncertain.
    fn count_uncertain(
        pool: &Pool<Self>,
        table: &str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Reserves an abandoned key for one completer's attempt: a new token
    /// and a lease of `lease`, and one more attempt counted, if its lease is
    /// still over and `holder` names its token. `None`: someone else has it.
    fn reserve(
        pool: &Pool<Self>,
        table: &str,
        holder: &Holder,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;
}

/// A key's row that a phased claim did not take, as every engine reads it.
pub(crate) struct Unclaimed {
    pub(crate) status: Option<i64>,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    /// The row's fencing token: `None` without a lease (an atomic
    /// claim's row).
    pub(crate) token: Option<i64>,
    /// The lease's time left (negative: over).
    pub(crate) remaining_ms: i64,
    /// How many times the key was resumed.
    pub(crate) attempts: i64,
    /// Its recovery point.
    pub(crate) recovery: Option<Vec<u8>>,
    /// A tombstone's location (see [`decode_finished`]).
    pub(crate) tombstone: Option<Option<Vec<u8>>>,
}

impl Unclaimed {
    /// What it tells a claim made with `fingerprint`, whose takeover the
    /// engine refused once the key had been resumed `max_attempts` times.
    pub(crate) fn outcome(
        self,
        fingerprint: &Fingerprint,
        max_attempts: u32,
    ) -> Result<LeaseOutcome, StoreError> {
        if let Some(status) = self.status {
            return match decode_finished(
                status,
                &self.fingerprint,
                self.headers,
                self.body,
                self.tombstone,
            ) {
                Ok((fingerprint, response)) => Ok(LeaseOutcome::Finished {
                    fingerprint,
                    response,
                }),
                Err(StoreError::Uncertain { fingerprint }) => {
                    Ok(LeaseOutcome::Uncertain { fingerprint })
                }
                Err(error) => Err(error),
            };
        }
        if self.fingerprint[..] != fingerprint.as_bytes()[..] {
            return Ok(LeaseOutcome::Reused);
        }
        let Some(token) = self.token else {
            return Ok(LeaseOutcome::Held);
        };
        if self.remaining_ms <= 0 && self.attempts >= i64::from(max_attempts) {
            return Ok(LeaseOutcome::Exhausted {
                token,
                attempts: u32::try_from(self.attempts).unwrap_or(u32::MAX),
                recovery: self.recovery,
            });
        }
        // A lease that ended since the claim's statement: its taker is
        // about to appear, or the next attempt takes it over.
        let remaining = u64::try_from(self.remaining_ms).unwrap_or(0);
        Ok(LeaseOutcome::Leased {
            remaining: Duration::from_millis(remaining),
        })
    }
}

/// Whether `holder`'s stored recovery point says an external step may
/// have happened (one that does not open or decode says so too: resuming
/// from it is refused, and nothing proves the key did nothing).
pub(crate) fn external_step(sealer: &Sealer<'_>, holder: &Holder, recovery: Option<&[u8]>) -> bool {
    let opened = sealer.open_logged(&holder.scope, &holder.key, Column::Recovery, recovery);
    match opened.map(|opened| crate::recovery::Recovery::decode(opened.as_deref())) {
        Ok(Ok(recovery)) => recovery.external,
        _ => true,
    }
}

/// The completer's list of abandoned keys, one text for every engine:
/// `key` is the key column as the engine quotes it, `now` its clock (or a
/// parameter bound to it).
pub(crate) fn abandoned_sql(table: &str, key: &str, now: &str, limit: u32) -> String {
    format!(
        "SELECT scope, {key}, lease_token, attempts, request, recovery FROM {table} \
         WHERE status IS NULL AND lease_token IS NOT NULL \
             AND lease_until <= {now} AND expires_at > {now} \
         ORDER BY lease_until LIMIT {limit}"
    )
}

/// The statement counting uncertain keys, one text for every engine: an
/// uncertain row keeps a `lease_until` (an ended one), so the lease index
/// finds it among the few phased rows rather than the whole table.
pub(crate) fn count_uncertain_sql(table: &str) -> String {
    format!(
        "SELECT COUNT(*) AS uncertain FROM {table} WHERE lease_until IS NOT NULL AND status = {}",
        super::store::UNCERTAIN
    )
}

/// Commits after a guarded write that `written` says matched (engines that
/// send the two apart); `false` commits nothing.
async fn commit_if<DB: Backend>(
    conn: &mut OpenTx<DB>,
    table: &str,
    written: Result<bool, sqlx::Error>,
) -> Result<bool, FinishError> {
    if !written.map_err(FinishError::store)? {
        return Ok(false);
    }
    DB::finish(conn, table, None, None).await?;
    Ok(true)
}
