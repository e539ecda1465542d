//! Key operations for support and operators: what a key's row says
//! ([`KeyInfo`]), a scope's recent keys, and deleting a key that is done
//! ([`Forgotten`]), as every engine reads and deletes them.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Pool;

use super::Backend;
use super::store::UNCERTAIN;
use crate::request::StoredRequest;
use crate::resolve::{ResolutionRecord, Uncertainty};
use crate::seal::{Column, Sealer};

/// The most keys [`Idem::recent`](crate::Idem::recent) lists at once.
pub const MAX_RECENT: u32 = 1000;

/// Where a key stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyState {
    /// Unfinished and unexpired: an attempt holds it (a phased key, an
    /// atomic claim that committed early, or one this process is running).
    /// See [`KeyInfo::leased`].
    InFlight,
    /// An attempt finished it (or an operator resolved it so): its
    /// response is replayed until it expires.
    Completed,
    /// Its outcome is unknown: every request with it is answered
    /// `idempotency_outcome_uncertain` until
    /// [`Idem::resolve`](crate::Idem::resolve) says what happened. See
    /// [`KeyInfo::uncertain`].
    Uncertain,
    /// Past its expiry: the next claim takes it over, as if it were absent.
    Expired,
    /// Completed, past its handler's `ttl`, and kept as a tombstone (its
    /// handler's `tombstone`): its response is no longer replayed, and
    /// every request with it is answered `idempotency_key_expired` until it
    /// expires.
    Tombstone,
}

/// What a key's row says, for support and operators: never a stored
/// response's headers or body, nor a recovery point's values.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KeyInfo {
    /// The caller the key belongs to, as the table keeps it: hashed where
    /// the store hashes scopes and keys
    /// ([`Idem::hash_keys`](crate::Idem::hash_keys)).
    pub scope: String,
    /// The key, as the table keeps it (hashed, bound to its scope, where
    /// the store hashes them).
    pub key: String,
    /// Where it stands.
    pub state: KeyState,
    /// The request's fingerprint, in hex.
    pub fingerprint: String,
    /// The stored response's status, once finished.
    pub status: Option<u16>,
    /// The request's method: kept for phased keys only (`None` for atomic
    /// ones, which keep no request).
    pub method: Option<String>,
    /// The request's path and query, as [`method`](Self::method).
    pub path: Option<String>,
    /// When the key was claimed (taken over, for a takeover).
    pub created: SystemTime,
    /// When it expires.
    pub expires: SystemTime,
    /// Whether a phased attempt's lease on the key is live now.
    pub leased: bool,
    /// When the phased lease ends (or ended); `None` for an atomic key or a
    /// finished one.
    pub lease_until: Option<SystemTime>,
    /// The names of the phases and steps a phased key recorded, sorted;
    /// their values are never read.
    pub phases: Vec<String>,
    /// Whether a phased attempt may have run an external step.
    pub external: bool,
    /// The [`external_once`](crate::Phases::external_once) steps that
    /// began without a recorded result, sorted.
    pub begun: Vec<String>,
    /// How many times the key's request was resumed (by the completer or
    /// a client's retry after its lease ended).
    pub attempts: u32,
    /// Why and since when the key is uncertain, when it is.
    pub uncertain: Option<Uncertainty>,
    /// The key's resolutions, oldest first: read by
    /// [`Idem::lookup`](crate::Idem::lookup) only (empty in lists).
    pub resolutions: Vec<ResolutionRecord>,
    /// Whether the key's kept request or recovery point did not open with
    /// the store's [key ring](crate::Idem::encryption) (or decode): what
    /// they would say (the method, path, phases) is then missing.
    pub unreadable: bool,
}

/// What [`Idem::forget`](crate::Idem::forget) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Forgotten {
    /// The key was finished or expired, and is gone: its next request is a
    /// first attempt.
    Deleted,
    /// No such key (or only one whose claim has not committed yet in
    /// another session: see [`Idem::forget`](crate::Idem::forget)).
    Absent,
    /// The key is in flight (unfinished and unexpired): refused, nothing
    /// deleted.
    InFlight,
    /// The key's outcome is uncertain: refused, nothing deleted (resolve
    /// it with [`Idem::resolve`](crate::Idem::resolve), which records the
    /// decision).
    Uncertain,
}

/// A key's row as the engines read it, times in milliseconds since the
/// Unix epoch and judged by the database's clock.
#[derive(Debug)]
pub struct KeyRow {
    /// The scope's bytes.
    pub scope: Vec<u8>,
    /// The key's bytes.
    pub key: Vec<u8>,
    /// The fingerprint's bytes.
    pub fingerprint: Vec<u8>,
    /// The stored status.
    pub status: Option<i64>,
    /// `created_at`.
    pub created_ms: i64,
    /// `expires_at`.
    pub expires_ms: i64,
    /// `lease_until`.
    pub lease_until_ms: Option<i64>,
    /// `replay_until`: a tombstone's end of replay.
    pub replay_until_ms: Option<i64>,
    /// The database's now.
    pub now_ms: i64,
    /// The recovery point.
    pub recovery: Option<Vec<u8>>,
    /// The kept request (`request::StoredRequest`).
    pub request: Option<Vec<u8>>,
    /// `attempts`.
    pub attempts: i32,
    /// An uncertain row's `body`: its `resolve::Uncertainty`.
    pub uncertainty: Option<Vec<u8>>,
    /// Whether its request or recovery point did not open
    /// ([`opened`](Self::opened)).
    pub unreadable: bool,
}

/// The recovery point's names, read without its values.
#[derive(serde::Deserialize)]
struct Recovery {
    #[serde(default)]
    steps: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
    #[serde(default)]
    external: bool,
    #[serde(default)]
    begun: Vec<String>,
}

fn time(ms: i64) -> SystemTime {
    match u64::try_from(ms) {
        Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
        Err(_) => UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs()),
    }
}

impl KeyRow {
    /// The row with its request and recovery point opened where sealed;
    /// one that does not open is dropped, and the row marked unreadable.
    pub(crate) fn opened(mut self, sealer: &Sealer<'_>) -> Self {
        let (scope, key) = (
            String::from_utf8_lossy(&self.scope).into_owned(),
            String::from_utf8_lossy(&self.key).into_owned(),
        );
        for (column, value) in [
            (Column::Request, &mut self.request),
            (Column::Recovery, &mut self.recovery),
        ] {
            match sealer.open_logged(&scope, &key, column, value.as_deref()) {
                Ok(Some(std::borrow::Cow::Owned(opened))) => *value = Some(opened),
                Ok(_) => {}
                Err(_) => {
                    *value = None;
                    self.unreadable = true;
                }
            }
        }
        self
    }

    /// Where the key stands, read from its status and times alone.
    pub(crate) fn state(&self) -> KeyState {
        match self.status {
            _ if self.expires_ms <= self.now_ms => KeyState::Expired,
            Some(UNCERTAIN) => KeyState::Uncertain,
            Some(_)
                if self
                    .replay_until_ms
                    .is_some_and(|until| until <= self.now_ms) =>
            {
                KeyState::Tombstone
            }
            Some(_) => KeyState::Completed,
            None => KeyState::InFlight,
        }
    }

    /// What the row says (its request and recovery point plain: see
    /// [`opened`](Self::opened)).
    pub(crate) fn into_info(self) -> KeyInfo {
        let state = self.state();
        let recovery = self
            .recovery
            .as_deref()
            .and_then(|bytes| serde_json::from_slice::<Recovery>(bytes).ok());
        let request = self.request.as_deref().and_then(StoredRequest::decode);
        let unreadable = self.unreadable
            || (self
                .request
                .as_deref()
                .is_some_and(|bytes| !bytes.is_empty())
                && request.is_none())
            || (self
                .recovery
                .as_deref()
                .is_some_and(|bytes| !bytes.is_empty())
                && recovery.is_none());
        KeyInfo {
            scope: String::from_utf8_lossy(&self.scope).into_owned(),
            key: String::from_utf8_lossy(&self.key).into_owned(),
            state,
            fingerprint: hex::encode(&self.fingerprint),
            status: self
                .status
                .filter(|&status| status != UNCERTAIN)
                .and_then(|status| u16::try_from(status).ok()),
            method: request.as_ref().map(|request| request.method.to_string()),
            path: request.as_ref().map(|request| {
                request
                    .uri
                    .path_and_query()
                    .map_or_else(|| request.uri.to_string(), ToString::to_string)
            }),
            created: time(self.created_ms),
            expires: time(self.expires_ms),
            leased: state == KeyState::InFlight
                && self.lease_until_ms.is_some_and(|until| until > self.now_ms),
            lease_until: self.lease_until_ms.map(time),
            phases: recovery
                .as_ref()
                .map(|recovery| recovery.steps.keys().cloned().collect())
                .unwrap_or_default(),
            external: recovery.as_ref().is_some_and(|recovery| recovery.external),
            begun: recovery
                .map(|recovery| {
                    let mut begun = recovery.begun;
                    begun.retain(|step| !recovery.steps.contains_key(step));
                    begun.sort();
                    begun
                })
                .unwrap_or_default(),
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            uncertain: (state == KeyState::Uncertain)
                .then(|| Uncertainty::decode(self.uncertainty.as_deref().unwrap_or_default())),
            resolutions: Vec::new(),
            unreadable,
        }
    }
}

/// An engine whose single keys can be read and deleted: the bound of
/// [`Idem::lookup`](crate::Idem::lookup), [`Idem::recent`](crate::Idem::recent)
/// and [`Idem::forget`](crate::Idem::forget).
///
/// Implemented by every engine `idem` keeps keys in, and by no other type:
/// its operations live on a supertrait no other crate can name.
pub trait Admin: Backend + AdminStore {}

/// How an engine writes the operators' reads, which are otherwise one
/// statement text for every engine.
#[derive(Debug)]
pub struct KeyReads {
    /// The columns [`key_row`](super::rows::key_row) reads, the times as
    /// epoch milliseconds and judged by the database's clock.
    pub columns: &'static str,
    /// The key column, quoted where the engine reserves the word.
    pub key: &'static str,
    /// The statement's first and second parameters.
    pub params: [&'static str; 2],
}

/// A statement's parameter.
#[derive(Debug, Clone, Copy)]
pub enum Param<'a> {
    /// Bytes: a scope, a key, a response's parts.
    Bytes(&'a [u8]),
    /// An integer: a limit, a status, a time.
    Int(i64),
    /// Text or `NULL`: who resolved a key, and why.
    Text(Option<&'a str>),
}

/// One statement of an operator's write, with its parameters in the order
/// its text numbers them.
#[derive(Debug)]
pub struct Write<'a> {
    /// The text, its parameters written as [`AdminStore::param`] writes them.
    pub sql: String,
    /// The parameters.
    pub params: Vec<Param<'a>>,
}

/// The key operations for operators: what [`Admin`] asks of an engine.
/// Sealed: `pub` in a private module, so only this crate names it.
pub trait AdminStore: Backend {
    /// How the engine writes the reads.
    const READS: KeyReads;

    /// The rows `sql` finds with `params` as its two parameters, bound or
    /// inlined as the engine sends values.
    fn read_keys(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> impl Future<Output = Result<Vec<KeyRow>, sqlx::Error>> + Send;

    /// The `n`th parameter (from 1) as the engine's statements write it;
    /// statements number theirs in text order, so `?` serves too.
    fn param(n: usize) -> String;

    /// Whether the engine can see another session's atomic claim of a key
    /// before it commits ([`claim_in_flight`](Self::claim_in_flight)).
    const SEES_CLAIMS: bool = false;

    /// Whether an atomic claim of the key, not committed yet, is in flight
    /// in another session (another process's included), where the engine
    /// can tell: by the claim's transaction-scoped advisory lock on
    /// PostgreSQL, by the uncommitted row's lock on MySQL. `false` where
    /// it cannot (SQLite).
    fn claim_in_flight(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send {
        let _ = (pool, table, scope, key);
        async { Ok(false) }
    }

    /// Runs one write on `conn`: the rows it changed.
    fn execute(
        conn: &mut Self::Connection,
        write: &Write<'_>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs `writes` in order in one transaction, committed only if the
    /// first changed exactly one row: whether it did.
    fn write_all(
        pool: &Pool<Self>,
        writes: Vec<Write<'_>>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send {
        async move {
            let mut tx = pool.begin().await?;
            for (n, write) in writes.iter().enumerate() {
                if Self::execute(&mut tx, write).await? != 1 && n == 0 {
                    tx.rollback().await?;
                    return Ok(false);
                }
            }
            tx.commit().await?;
            Ok(true)
        }
    }

    /// The resolutions `sql` finds (`resolved_ms`, `outcome`, `status`,
    /// `by_name`, `note`) with `params` as its two parameters.
    fn read_resolutions(
        pool: &Pool<Self>,
        sql: String,
        params: [Param<'_>; 2],
    ) -> impl Future<Output = Result<Vec<ResolutionRecord>, sqlx::Error>> + Send;

    /// The key's row, if any (expired or not).
    fn lookup(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<KeyRow>, sqlx::Error>> + Send {
        let KeyReads {
            columns,
            key: key_column,
            params: [first, second],
        } = Self::READS;
        let sql = format!(
            "SELECT {columns} FROM {table} WHERE scope = {first} AND {key_column} = {second}"
        );
        async move {
            let params = [Param::Bytes(scope.as_bytes()), Param::Bytes(key.as_bytes())];
            Ok(Self::read_keys(pool, sql, params).await?.pop())
        }
    }

    /// Up to `limit` rows of `scope`, the latest created first.
    fn recent(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<KeyRow>, sqlx::Error>> + Send {
        let KeyReads {
            columns,
            key,
            params: [first, second],
        } = Self::READS;
        let sql = format!(
            "SELECT {columns} FROM {table} WHERE scope = {first} \
             ORDER BY created_at DESC, {key} DESC LIMIT {second}"
        );
        let params = [Param::Bytes(scope.as_bytes()), Param::Int(limit.into())];
        Self::read_keys(pool, sql, params)
    }

    /// Deletes the key's row if it is finished or expired, checked and
    /// deleted in one statement: `Deleted`; `InFlight` when another
    /// transaction holds the row (a claim in progress the engine makes
    /// the delete wait for); `Absent` when nothing was deleted, and the
    /// caller reads the row to tell an absent key from one in flight.
    fn forget(
        pool: &Pool<Self>,
        table: &str,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Forgotten, sqlx::Error>> + Send;
}
