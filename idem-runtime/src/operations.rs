//! [`Idem`]'s key operations for support and operators: look a key up,
//! list a scope's recent keys, forget a key that is done.

use std::borrow::Cow;
use std::time::SystemTime;

use axum::response::IntoResponse;
use http::StatusCode;

use crate::backend::single_flight;
use crate::backend::{
    Admin, Forgotten, KeyInfo, KeyReads, KeyState, MAX_RECENT, Param, UNCERTAIN, Write,
};
use crate::error::Error;
use crate::hash::looks_hashed;
use crate::idem::Idem;
use crate::observe;
use crate::recovery::Recovery;
use crate::resolve::{self, Resolution, Resolved};
use crate::response::{StoredResponse, is_storable};
use crate::seal::{Column, Sealer};
use crate::table::resolutions_table;

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
    /// An atomic claim in progress has written nothing others can read
    /// until it commits: it is reported in flight (with no fingerprint, and
    /// the lookup's time for its times) when this process runs it, and on
    /// PostgreSQL and MySQL when another process does (seen by its lock);
    /// on SQLite only then. A phased key is seen as soon as it is claimed.
    ///
    /// Where the store hashes scopes and keys ([`hash_keys`](Self::hash_keys)),
    /// give the clear ones; the [`KeyInfo`] then shows the hashes, as the
    /// table keeps them. A pair of hashes as a listing shows them finds
    /// the key too.
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
        for (scope, key) in self.names(scope, key) {
            if let Some(info) = self.lookup_stored(&scope, &key).await? {
                return Ok(Some(info));
            }
        }
        Ok(None)
    }

    /// The names a key may be given by to an operation, as the table keeps
    /// them, in the order to try them: its clear scope and key (hashed where
    /// the store hashes them), then where the store hashes them and they
    /// look like hashes, the names as given (a listing's).
    fn names<'a>(&self, scope: &'a str, key: &'a str) -> Vec<(Cow<'a, str>, Cow<'a, str>)> {
        let mut names = vec![self.stored(scope, key)];
        if self.key_hasher().is_some() && looks_hashed(scope) && looks_hashed(key) {
            names.push((Cow::Borrowed(scope), Cow::Borrowed(key)));
        }
        names
    }

    /// [`lookup`](Self::lookup) of a key by its names as the table keeps
    /// them.
    async fn lookup_stored(&self, scope: &str, key: &str) -> Result<Option<KeyInfo>, Error> {
        let Some(row) = DB::lookup(self.pool(), self.table_name(), scope, key).await? else {
            let running = self.running_here(scope, key)
                || DB::claim_in_flight(self.pool(), self.table_name(), scope, key).await?;
            return Ok(running.then(|| claim_in_flight(scope, key)));
        };
        let mut info = row.opened(&self.sealer()).into_info();
        let sql = format!(
            "SELECT resolved_ms, outcome, status, by_name, note FROM {} \
             WHERE scope = {} AND {} = {} ORDER BY resolved_ms",
            resolutions_table(self.table_name()),
            DB::param(1),
            DB::READS.key,
            DB::param(2),
        );
        let params = [Param::Bytes(scope.as_bytes()), Param::Bytes(key.as_bytes())];
        info.resolutions = DB::read_resolutions(self.pool(), sql, params).await?;
        Ok(Some(info))
    }

    /// Whether this process runs an atomic claim of the key.
    fn running_here(&self, scope: &str, key: &str) -> bool {
        let (slot, _) = single_flight::flight_slot(self.pool(), self.table_name(), scope, key);
        single_flight::in_flight(&slot).is_some()
    }

    /// The most recent keys of `scope` (by creation, newest first), at
    /// most `limit`, itself capped at 1,000.
    ///
    /// Where the store hashes scopes and keys ([`hash_keys`](Self::hash_keys)),
    /// give the clear scope (or its hash, as a listing shows it); the keys
    /// listed show the hashes, as the table keeps them.
    pub async fn recent(&self, scope: &str, limit: u32) -> Result<Vec<KeyInfo>, Error> {
        let limit = limit.min(MAX_RECENT);
        let stored = self.stored_scope(scope);
        let mut rows = DB::recent(self.pool(), self.table_name(), &stored, limit).await?;
        if rows.is_empty() && self.key_hasher().is_some() && looks_hashed(scope) {
            rows = DB::recent(self.pool(), self.table_name(), scope, limit).await?;
        }
        let sealer = self.sealer();
        Ok(rows
            .into_iter()
            .map(|row| row.opened(&sealer).into_info())
            .collect())
    }

    /// Up to `limit` keys of every scope that `filter` names (capped at
    /// 1,000): in flight and abandoned ones by their lease's end, uncertain
    /// ones the longest uncertain first. For an operator's overview; the
    /// keys' resolutions are not read (see [`lookup`](Self::lookup)).
    /// Where the store hashes scopes and keys, they show the hashes.
    pub async fn keys(&self, filter: KeyFilter, limit: u32) -> Result<Vec<KeyInfo>, Error> {
        // Phased and uncertain rows keep a `lease_until` and a token,
        // finished ones no lease: the lease index finds these few among the
        // whole table. Ended leases sort first, so a page of abandoned
        // keys is never crowded out by live ones, and the reverse.
        let (status, order) = match filter {
            KeyFilter::InFlight => ("status IS NULL", "DESC"),
            KeyFilter::Abandoned => ("status IS NULL", "ASC"),
            KeyFilter::Uncertain => ("status = 0", "ASC"),
        };
        let KeyReads {
            columns,
            key,
            params: [first, second],
        } = DB::READS;
        let sql = format!(
            "SELECT {columns} FROM {} WHERE lease_until IS NOT NULL AND {status} \
                 AND lease_token >= {first} \
             ORDER BY lease_until {order}, {key} LIMIT {second}",
            self.table_name()
        );
        let params = [Param::Int(0), Param::Int(limit.min(MAX_RECENT).into())];
        let rows = DB::read_keys(self.pool(), sql, params).await?;
        let sealer = self.sealer();
        Ok(rows
            .into_iter()
            .map(|row| row.opened(&sealer).into_info())
            .filter(|info| match filter {
                KeyFilter::InFlight => info.state == KeyState::InFlight && info.leased,
                KeyFilter::Abandoned => info.state == KeyState::InFlight && !info.leased,
                KeyFilter::Uncertain => info.state == KeyState::Uncertain,
            })
            .collect())
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
    /// `scope` and `key` are named as for [`lookup`](Self::lookup).
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
        let response = match &resolution.outcome {
            resolve::Outcome::Completed { status, body } => Some(completed(*status, body).await?),
            _ => None,
        };
        let mut found = None;
        for (scope, key) in self.names(scope, key) {
            if let Some(row) = DB::lookup(self.pool(), self.table_name(), &scope, &key).await? {
                found = Some((scope, key, row));
                break;
            }
        }
        let Some((scope, key, row)) = found else {
            return Ok(Resolved::Absent);
        };
        let (scope, key) = (&*scope, &*key);
        let sealer = self.sealer();
        if row.state() != KeyState::Uncertain {
            return Ok(Resolved::NotUncertain);
        }
        let recovery = row.recovery;
        // Stored as a request's answer is: sealed where the store encrypts.
        let response = response.map(|response| response.seal(&sealer, scope, key));
        let table = self.table_name();
        let p = DB::param;
        let key_column = DB::READS.key;
        let (scope_bytes, key_bytes) = (scope.as_bytes(), key.as_bytes());
        let cleared;
        // The first write changes the row only while it is uncertain, so
        // two operators resolving at once cannot both act.
        let first = match (&resolution.outcome, &response) {
            (resolve::Outcome::Completed { .. }, Some(response)) => Write {
                sql: format!(
                    "UPDATE {table} SET status = {}, headers = {}, body = {}, recovery = NULL, \
                         request = NULL, lease_until = NULL \
                     WHERE scope = {} AND {key_column} = {} AND status = {UNCERTAIN}",
                    p(1),
                    p(2),
                    p(3),
                    p(4),
                    p(5)
                ),
                params: vec![
                    Param::Int(response.status.as_u16().into()),
                    Param::Bytes(&response.headers),
                    Param::Bytes(&response.body),
                    Param::Bytes(scope_bytes),
                    Param::Bytes(key_bytes),
                ],
            },
            (resolve::Outcome::NotStarted, ..) => Write {
                sql: format!(
                    "DELETE FROM {table} WHERE scope = {} AND {key_column} = {} \
                         AND status = {UNCERTAIN}",
                    p(1),
                    p(2)
                ),
                params: vec![Param::Bytes(scope_bytes), Param::Bytes(key_bytes)],
            },
            _ => {
                cleared = retried(&sealer, scope, key, recovery.as_deref());
                Write {
                    sql: format!(
                        "UPDATE {table} SET status = NULL, body = NULL, attempts = 0, \
                             recovery = {}, lease_until = created_at \
                         WHERE scope = {} AND {key_column} = {} AND status = {UNCERTAIN}",
                        p(1),
                        p(2),
                        p(3)
                    ),
                    params: vec![
                        Param::Bytes(&cleared),
                        Param::Bytes(scope_bytes),
                        Param::Bytes(key_bytes),
                    ],
                }
            }
        };
        let at = i64::try_from(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |since| since.as_millis()),
        )
        .unwrap_or(i64::MAX);
        let status = response.as_ref().map(|response| response.status.as_u16());
        let record = Write {
            sql: format!(
                "INSERT INTO {} (scope, {key_column}, resolved_ms, outcome, status, by_name, note) \
                 VALUES ({}, {}, {}, {}, {}, {}, {})",
                resolutions_table(table),
                p(1),
                p(2),
                p(3),
                p(4),
                p(5),
                p(6),
                p(7)
            ),
            params: vec![
                Param::Bytes(scope_bytes),
                Param::Bytes(key_bytes),
                Param::Int(at),
                Param::Text(Some(resolution.outcome())),
                match status {
                    Some(status) => Param::Int(status.into()),
                    None => Param::Text(None),
                },
                Param::Text(resolution.by.as_deref()),
                Param::Text(resolution.note.as_deref()),
            ],
        };
        if !DB::write_all(self.pool(), vec![first, record]).await? {
            return Ok(Resolved::NotUncertain);
        }
        if matches!(resolution.outcome, resolve::Outcome::Completed { .. }) {
            self.finished_keys().remember(scope, key);
        }
        observe::resolved(resolution.outcome());
        tracing::info!(
            scope = observe::redact(&[scope]),
            key = observe::redact(&[scope, key]),
            outcome = resolution.outcome(),
            by = resolution.by.as_deref(),
            "an uncertain idempotency key was resolved"
        );
        Ok(Resolved::Resolved)
    }

    /// Deletes `key` in `scope` if it is finished or expired, so that its
    /// next request runs as a first attempt. A key in flight (unfinished
    /// and unexpired: a phased key, or an atomic claim this process is
    /// running) is refused, and so is an uncertain one (resolve it with
    /// [`resolve`](Self::resolve), which records the decision); nothing is
    /// deleted then.
    ///
    /// The check and the delete are one statement, so a claim racing the
    /// forget never loses its row. An atomic claim running in another
    /// process has written nothing others can see before its commit: on
    /// PostgreSQL and SQLite the forget then finds no row (`Absent`), and
    /// the claim's finished row lands after it; on MySQL the delete waits
    /// for the claim up to a second, then answers `InFlight`.
    ///
    /// `scope` and `key` are named as for [`lookup`](Self::lookup).
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
    ///     Forgotten::Uncertain => println!("outcome unknown: resolve it instead"),
    ///     _ => {}
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn forget(&self, scope: &str, key: &str) -> Result<Forgotten, Error> {
        let mut forgotten = Forgotten::Absent;
        for (scope, key) in self.names(scope, key) {
            forgotten = self.forget_stored(&scope, &key).await?;
            if forgotten != Forgotten::Absent {
                break;
            }
        }
        Ok(forgotten)
    }

    /// [`forget`](Self::forget) of a key by its names as the table keeps
    /// them.
    async fn forget_stored(&self, scope: &str, key: &str) -> Result<Forgotten, Error> {
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
            match row.map(|row| row.state()) {
                None => return Ok(Forgotten::Absent),
                Some(KeyState::InFlight) => return Ok(Forgotten::InFlight),
                Some(KeyState::Uncertain) => return Ok(Forgotten::Uncertain),
                Some(_) => {}
            }
        }
        Ok(Forgotten::InFlight)
    }
}

/// The response a `completed` resolution stores: `body` as JSON with
/// `status`, which must be one `idem` stores and a client can act on.
async fn completed(status: StatusCode, body: &serde_json::Value) -> Result<StoredResponse, Error> {
    if !is_storable(status)
        || status.is_informational()
        || status == StatusCode::CONFLICT
        || status == StatusCode::UNPROCESSABLE_ENTITY
    {
        return Err(Error::InvalidResolution(format!(
            "status {} is not one a request's answer is stored with: give a 2xx, 3xx or a \
             4xx other than 408, 409, 422 and 429",
            status.as_u16()
        )));
    }
    let response = (status, axum::Json(body)).into_response();
    StoredResponse::capture(response, &[http::header::CONTENT_TYPE], usize::MAX)
        .await
        .map(|(stored, _)| stored)
        .map_err(|_| Error::InvalidResolution("the body did not serialise".to_owned()))
}

/// A recovery point handed back by a `retry` resolution: the steps begun
/// without a result forgotten, so they run again, as the operator asked;
/// opened and sealed again where the store encrypts. (One that does not
/// open or decode is handed back empty, as the operator's retry runs the
/// request afresh.)
fn retried(sealer: &Sealer<'_>, scope: &str, key: &str, recovery: Option<&[u8]>) -> Vec<u8> {
    let opened = sealer.open_logged(scope, key, Column::Recovery, recovery);
    let mut recovery = match opened {
        Ok(opened) => Recovery::decode(opened.as_deref()).unwrap_or_default(),
        Err(_) => Recovery::default(),
    };
    recovery.begun.clear();
    sealer
        .seal(scope, key, Column::Recovery, &recovery.encode())
        .into_owned()
}

/// An atomic claim in progress, which has written nothing others can read
/// yet: in flight, with what is known of it (no fingerprint; its times are
/// the lookup's).
fn claim_in_flight(scope: &str, key: &str) -> KeyInfo {
    let now = SystemTime::now();
    KeyInfo {
        scope: scope.to_owned(),
        key: key.to_owned(),
        state: KeyState::InFlight,
        fingerprint: String::new(),
        status: None,
        method: None,
        path: None,
        created: now,
        expires: now,
        leased: true,
        lease_until: None,
        phases: Vec::new(),
        external: false,
        begun: Vec::new(),
        attempts: 0,
        uncertain: None,
        resolutions: Vec::new(),
        unreadable: false,
    }
}
