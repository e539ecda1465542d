//! [`Idem`]'s key operations for support and operators: look a key up,
//! list a scope's recent keys, forget a key that is done.

use crate::backend::single_flight;
use crate::backend::{Admin, Forgotten, KeyInfo, KeyState, MAX_RECENT};
use crate::error::Error;
use crate::idem::Idem;
use crate::resolve::{Resolution, Resolved};

/// Which keys [`Idem::keys`] lists, across every scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFilter {
    /// Unfinished keys whose attempt holds a live lease (phased keys, and
    /// atomic claims that committed early).
    InFlight,
    /// Unfinished phased keys whose lease is over: the completer resumes
    /// them (or a client's retry does).
    Abandoned,
    /// Keys whose outcome is uncertain, waiting for
    /// [`Idem::resolve`](crate::Idem::resolve).
    Uncertain,
}

impl<DB: Admin> Idem<DB> {
    /// What the store holds for `key` in `scope`: its state, fingerprint,
    /// response status and times, and for a phased key its lease, the
    /// request's method and path and the names of the phases it recorded.
    /// `None`: no such key.
    ///
    /// Reads committed rows: an atomic claim commits its row with the
    /// response, so an atomic attempt in progress is not seen until it
    /// finishes (a phased one is, as soon as it is claimed).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use idem::{Idem, KeyState};
    ///
    /// # async fn demo(idem: Idem<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// if let Some(info) = idem.lookup("acct_1", "order-42").await? {
    ///     if info.state == KeyState::Completed {
    ///         println!("answered {:?} at {:?}", info.status, info.created);
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn lookup(&self, scope: &str, key: &str) -> Result<Option<KeyInfo>, Error> {
        let row = DB::lookup(self.pool(), self.table_name(), scope, key).await?;
        Ok(row.map(|row| row.into_info()))
    }

    /// The most recent keys of `scope` (by creation, newest first), at
    /// most `limit`, itself capped at 1,000.
    pub async fn recent(&self, scope: &str, limit: u32) -> Result<Vec<KeyInfo>, Error> {
        let rows = DB::recent(self.pool(), self.table_name(), scope, limit.min(MAX_RECENT)).await?;
        Ok(rows.into_iter().map(|row| row.into_info()).collect())
    }

    /// Up to `limit` keys of every scope that `filter` names (capped at
    /// 1,000): in flight and abandoned ones by their lease's end, uncertain
    /// ones the longest uncertain first. For an operator's overview; the
    /// keys' resolutions are not read (see [`lookup`](Self::lookup)).
    pub async fn keys(&self, filter: KeyFilter, limit: u32) -> Result<Vec<KeyInfo>, Error> {
        let _ = (filter, limit);
        todo!()
    }

    /// Resolves an uncertain key as an operator (or a reconciliation job)
    /// decided, and records the decision (when, [`by`](Resolution::by),
    /// [`note`](Resolution::note)), which [`lookup`](Self::lookup) lists
    /// in [`KeyInfo::resolutions`]:
    ///
    /// - [`Resolution::completed`] stores the given response: every retry
    ///   replays it;
    /// - [`Resolution::not_started`] releases the key: the next retry runs
    ///   the request afresh;
    /// - [`Resolution::retry`] hands the key back to the completer.
    ///
    /// A key that is not uncertain is left as it is
    /// ([`Resolved::NotUncertain`]); a status `idem` would not store is
    /// refused ([`Error::InvalidResolution`]) and changes nothing.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use idem::{Idem, Resolution, Resolved};
    ///
    /// # async fn demo(idem: Idem<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// let found = serde_json::json!({"id": "pay_7", "status": "succeeded"});
    /// let resolution = Resolution::completed(http::StatusCode::CREATED, found)
    ///     .by("reconciler")
    ///     .note("settled in the provider's report of 2026-12-05");
    /// match idem.resolve("acct_1", "order-42", resolution).await? {
    ///     Resolved::Resolved => println!("retries now replay the 201"),
    ///     Resolved::Absent => println!("no such key"),
    ///     other => println!("left as it is: {other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn resolve(
        &self,
        scope: &str,
        key: &str,
        resolution: Resolution,
    ) -> Result<Resolved, Error> {
        let _ = (scope, key, resolution);
        todo!()
    }

    /// Deletes `key` in `scope` if it is finished or expired, so that its
    /// next request runs as a first attempt. A key in flight (unfinished
    /// and unexpired: a phased key, or an atomic claim this process is
    /// running) is refused, and nothing is deleted.
    ///
    /// The check and the delete are one statement, so a claim racing the
    /// forget never loses its row. An atomic claim running in another
    /// process has written nothing others can see before its commit: on
    /// PostgreSQL and SQLite the forget then finds no row (`Absent`), and
    /// the claim's finished row lands after it; on MySQL the delete waits
    /// for the claim up to a second, then answers `InFlight`.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use idem::{Forgotten, Idem};
    ///
    /// # async fn demo(idem: Idem<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// match idem.forget("acct_1", "order-42").await? {
    ///     Forgotten::Deleted => println!("the next request runs afresh"),
    ///     Forgotten::Absent => println!("no such key"),
    ///     Forgotten::InFlight => println!("still running: try again later"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn forget(&self, scope: &str, key: &str) -> Result<Forgotten, Error> {
        let (slot, _) = single_flight::flight_slot(self.pool(), self.table_name(), scope, key);
        if single_flight::in_flight(&slot).is_some() {
            return Ok(Forgotten::InFlight);
        }
        // When the delete deletes nothing, a read tells an absent key from
        // one in flight; a row finished or expired between the two (a claim
        // that committed) is deleted on another try.
        for _ in 0..3 {
            let forgotten = DB::forget(self.pool(), self.table_name(), scope, key).await?;
            if forgotten != Forgotten::Absent {
                return Ok(forgotten);
            }
            let row = DB::lookup(self.pool(), self.table_name(), scope, key).await?;
            match row.map(|row| row.into_info().state) {
                None => return Ok(Forgotten::Absent),
                Some(KeyState::InFlight) => return Ok(Forgotten::InFlight),
                Some(KeyState::Uncertain) => return Ok(Forgotten::Uncertain),
                Some(_) => {}
            }
        }
        Ok(Forgotten::InFlight)
    }
}
