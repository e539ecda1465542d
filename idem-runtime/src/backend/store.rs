//! The atomic mode's storage contract: what a claim asks, what it finds,
//! the public bound [`Backend`] and its sealed operations [`Store`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

use super::{Acquire, OpenTx};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::EncodedResponse;

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
    /// How long after the response the key is kept as a tombstone (its
    /// fingerprint, status and `Location`), in milliseconds; `None`: not
    /// past `ttl`. (Milliseconds, as `timeout_ms`.)
    pub tombstone_ms: Option<std::num::NonZeroU64>,
    /// How long to wait for a concurrent attempt before answering 409.
    pub wait: Duration,
    /// The handler's deadline in milliseconds: a session left behind by a
    /// lost connection is ended by the server soon after it (`ORPHAN_MARGIN`
    /// later). (Milliseconds, not a `Duration`: claims are copied into
    /// every request's future.)
    pub timeout_ms: u32,
    /// Whether the engine may tell a concurrent attempt by an advisory
    /// lock on the key, where the server offers them
    /// ([`Idem::advisory_locks`](crate::Idem::advisory_locks)).
    pub advisory: bool,
    /// Whether a transaction-mode pooler sits in front of the database
    /// ([`Idem::pooler`](crate::Idem::pooler)): no statement may then rely
    /// on the session outliving the transaction.
    pub pooled: bool,
}

/// How long after a handler's deadline the server ends a session whose
/// client vanished with the claim open (a half-open connection), releasing
/// the key.
pub const ORPHAN_MARGIN: Duration = Duration::from_secs(2);

impl Claim<'_> {
    /// How long the server may keep a claim's session whose client
    /// vanished: the handler's deadline plus `ORPHAN_MARGIN`.
    pub fn orphan_bound(&self) -> Duration {
        self.timeout() + ORPHAN_MARGIN
    }

    /// How long after the response the key is kept as a tombstone.
    pub fn tombstone(&self) -> Option<Duration> {
        self.tombstone_ms.map(|ms| Duration::from_millis(ms.get()))
    }

    /// The handler's deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.into())
    }
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimOutcome<DB: Database> {
    /// The key is ours: the connection holds an open transaction in which
    /// the claim row is the first write.
    Claimed(OpenTx<DB>),
    /// A previous attempt finished; its transaction is already closed.
    Finished {
        /// The fingerprint that attempt was made with.
        fingerprint: Fingerprint,
        /// Its stored response, as the row keeps it (sealed, maybe).
        response: EncodedResponse,
    },
    /// Another attempt holds the key and did not finish within `wait`.
    /// `running`: that attempt is known to be running (in this process);
    /// otherwise the holder may also be a session whose client vanished
    /// (ended by the server within the claim's orphan bound) or an attempt
    /// that committed early and then failed.
    InUse {
        /// Whether the holder is known to be running.
        running: bool,
    },
}

/// Why the key store failed: the database's own errors, and the
/// conditions `idem` finds itself in what the database answered.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or lost a statement.
    #[error(transparent)]
    Database(sqlx::Error),
    /// A stored response did not decode (a row `idem` did not write).
    #[error("corrupt stored idempotent response")]
    Corrupt,
    /// The claim's row was gone at the finish: the handler's transaction
    /// had ended (rolled back by the engine, or by the handler itself).
    #[error(
        "the idempotency claim's row was gone at the finish: the handler's transaction had ended"
    )]
    ClaimGone,
    /// The key's row changed under the claim more often than it reads again.
    #[error("idempotency row changed repeatedly during its claim")]
    Unsettled,
    /// The key's row vanished (swept) between the claim's write and its read.
    #[error("idempotency row vanished during its claim")]
    Vanished,
    /// The connection was lost after the claim may have reached the server,
    /// and the key is held: perhaps by this request's own claim, in a
    /// session the server ends within `bound`.
    #[error(
        "the key store connection was lost during the claim; the key is held until its session ends"
    )]
    Orphaned {
        /// How long the server may keep that session.
        bound: Duration,
    },
    /// The key's outcome is uncertain (`status` [`UNCERTAIN`]): nothing
    /// runs until it is resolved. `fingerprint`: the request it names.
    #[error("the idempotency key's outcome is uncertain")]
    Uncertain {
        /// The fingerprint the key was claimed with.
        fingerprint: Fingerprint,
    },
    /// The key is a tombstone: its operation completed, and its response
    /// is no longer replayed (past the `ttl` of a handler with a
    /// `tombstone`). Nothing runs until the tombstone expires.
    /// (Boxed: every claim's future holds room for its error.)
    #[error("the idempotency key has expired and is kept as a tombstone")]
    Tombstone(Box<Tombstone>),
    /// A scope longer than the engine's key column takes.
    #[error("idempotency scope is {len} bytes; the key store takes at most {max}")]
    ScopeTooLong {
        /// The scope's length in bytes.
        len: usize,
        /// The most the store takes.
        max: usize,
    },
}

impl StoreError {
    /// Whether the connection was gone rather than a statement failing
    /// (see [`is_gone`](super::connection::is_gone)).
    pub(crate) fn is_gone<DB: Backend>(&self) -> bool {
        matches!(self, Self::Database(error) if super::connection::is_gone::<DB>(error))
    }
}

/// What a tombstone keeps ([`StoreError::Tombstone`]).
#[derive(Debug)]
pub struct Tombstone {
    /// The fingerprint the key was claimed with.
    pub fingerprint: Fingerprint,
    /// The status the operation was answered with.
    pub status: http::StatusCode,
    /// Its `Location` header, as the `location` column keeps it (encoded
    /// as the headers column is, and sealed where the store encrypts).
    pub location: Option<Vec<u8>>,
}

/// Why the finish of a request's transaction (`Store::finish`) did not
/// commit.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    /// The request's transaction had already failed or ended before the
    /// finish: a statement of the handler's failed (PostgreSQL then refuses
    /// every statement until the rollback; InnoDB and SQLite roll some
    /// failures back whole), and the handler answered as if it had not.
    /// Nothing of the transaction commits.
    #[error("the transaction had already failed: {0}")]
    Ended(#[source] StoreError),
    /// The store failed the finish: a lost connection, a refused commit.
    /// The commit may have landed, in which case a retry replays it.
    #[error(transparent)]
    Store(StoreError),
}

/// Neither error type has a `From<sqlx::Error>`: the engines convert by
/// name (`StoreError::Database`, `FinishError::store`), so a handler's
/// closure that leaves its error type to inference is never offered these
/// internal types as candidates.
impl FinishError {
    /// The store failed the finish with `error`.
    pub(crate) fn store(error: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(error))
    }
}

/// A database engine `idem` can keep keys in: the bound of
/// [`Idem<DB>`](crate::Idem), [`Tx<DB>`](crate::Tx) and everything built
/// on them.
///
/// Implemented for the sqlx database types of the enabled features
/// (`sqlx::Postgres` with `postgres`, `sqlx::Sqlite` with `sqlite`,
/// `sqlx::MySql` with `mysql`), and for no other type: its operations live
/// on a supertrait no other crate can name, because every engine must keep
/// the atomic contract, which the conformance suite checks.
pub trait Backend: Database + Store + super::OutboxStore {}

/// The atomic mode's storage operations: what [`Backend`] asks of an
/// engine. Sealed: `pub` in a private module, so only this crate names it.
pub trait Store: Database {
    /// Creates the key table and its expiry index if they do not exist.
    fn migrate(pool: &Pool<Self>, table: &str) -> impl Future<Output = Result<(), Error>> + Send;

    /// Makes what claims behind a declared transaction-mode pooler use
    /// beside the key table, where the engine has any (PostgreSQL: the
    /// table's server-side functions). Run by `Idem::migrate` when a
    /// pooler is declared, after [`migrate`](Store::migrate).
    fn migrate_pooled(
        pool: &Pool<Self>,
        table: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Opens a transaction and claims the key as its first write.
    fn claim(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome<Self>, StoreError>> + Send;

    /// Reads the key's stored response, if it is finished and unexpired,
    /// with one indexed read outside any transaction: the fast path for a
    /// retry of a key this process saw finish. `None`, or a database error
    /// (the server refused the read), sends the request through
    /// [`Store::claim`], the authority.
    fn peek(
        pool: &Pool<Self>,
        acquire: Acquire,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Option<ClaimOutcome<Self>>, StoreError>> + Send;

    /// Opens a plain transaction (a request without a key, `key = "optional"`).
    fn begin(
        pool: &Pool<Self>,
        acquire: Acquire,
    ) -> impl Future<Output = Result<OpenTx<Self>, sqlx::Error>> + Send;

    /// Stores the response on the claimed row and commits, in as few round
    /// trips as the engine allows. `None` commits without storing. Neither
    /// commits a transaction that has already failed or ended.
    fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&EncodedResponse>,
    ) -> impl Future<Output = Result<(), FinishError>> + Send;

    /// After the request's transaction was rolled back: whether the key's
    /// row is nonetheless there, committed without a response. Only a
    /// handler that committed the transaction itself (a raw `COMMIT`, or a
    /// MySQL statement that commits implicitly) leaves one; the key then
    /// answers 409 until it expires.
    fn stranded(
        conn: &mut PoolConnection<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Rolls the open transaction back.
    fn rollback(
        conn: &mut PoolConnection<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Deletes up to `batch` expired rows; returns how many went.
    fn sweep(
        pool: &Pool<Self>,
        table: &str,
        batch: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Whether a database error says the session is gone rather than that a
    /// statement failed. By default SQLSTATE class 08 (connection
    /// exception).
    fn session_gone(error: &dyn sqlx::error::DatabaseError) -> bool {
        error.code().is_some_and(|code| code.starts_with("08"))
    }

    /// Writes the name of `pool`'s database for the in-process single
    /// flight ([`single_flight`](super::single_flight)): attempts of one key on one name wait for
    /// each other in this process. By default the pool's own: the address
    /// of its connect options, which a flight keeps alive, so no other pool
    /// can take the address while the flight lives. (After
    /// `Pool::set_connect_options` the pool has a new name; duplicates of
    /// attempts begun before then wait in the database instead.)
    fn flight_database(options: &Arc<ConnectOptions<Self>>, out: &mut Vec<u8>) {
        out.extend_from_slice(&(Arc::as_ptr(options) as usize).to_le_bytes());
    }
}

/// A pool's connect options.
pub(crate) type ConnectOptions<DB> = <<DB as Database>::Connection as sqlx::Connection>::Options;

/// What a claim found in a finished row ([`finished_row`](super::rows::finished_row)).
pub(crate) fn finished<DB: Database>(
    (fingerprint, response): (Fingerprint, EncodedResponse),
) -> ClaimOutcome<DB> {
    ClaimOutcome::Finished {
        fingerprint,
        response,
    }
}

/// The `status` of a key whose outcome is uncertain: no HTTP status, so
/// that every statement that takes or replays a finished row (`status IS
/// NOT NULL`) leaves it alone, and every read of it finds
/// [`StoreError::Uncertain`]. Its `body` holds the
/// [`Uncertainty`](crate::resolve::Uncertainty) as JSON, and its recovery
/// point and request stay for a resolution that retries.
pub(crate) const UNCERTAIN: i64 = 0;

/// A finished row's fingerprint and response, as every engine reads them;
/// an uncertain row's fingerprint as [`StoreError::Uncertain`], and a
/// tombstone's (`past_ttl`: the row's replay has ended) as
/// [`StoreError::Tombstone`], with its `location`. The
/// response's columns are handed on as they are: the protocol opens and
/// decodes them ([`EncodedResponse::open`]), where it knows the store's
/// key ring, and only for a request whose fingerprint matches.
pub(crate) fn decode_finished(
    status: i64,
    fingerprint: &[u8],
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
    tombstone: Option<Option<Vec<u8>>>,
) -> Result<(Fingerprint, EncodedResponse), StoreError> {
    let fingerprint = Fingerprint::from_bytes(fingerprint).ok_or(StoreError::Corrupt)?;
    if status == UNCERTAIN {
        return Err(StoreError::Uncertain { fingerprint });
    }
    let status = u16::try_from(status)
        .ok()
        .and_then(|status| http::StatusCode::from_u16(status).ok())
        .ok_or(StoreError::Corrupt)?;
    if let Some(location) = tombstone {
        return Err(StoreError::Tombstone(Box::new(Tombstone {
            fingerprint,
            status,
            location,
        })));
    }
    let response = EncodedResponse {
        status,
        headers: headers.unwrap_or_default(),
        body: body.unwrap_or_default().into(),
        tombstone: None,
    };
    Ok((fingerprint, response))
}

/// The assignments that keep a finished row as a tombstone, for the write
/// of a response of a handler with `tombstone` (empty for any other):
/// its `location`, the end of its replay (`replay_until`) and of the row
/// (`expires_at`), both counted from the write. `literal` writes bytes as
/// the engine's SQL literal, `after_ms` the engine's clock plus so many
/// milliseconds. (No column is read: MySQL applies assignments in order.)
pub(crate) fn tombstone_assignments(
    response: &EncodedResponse,
    literal: impl Fn(&[u8]) -> String,
    after_ms: impl Fn(i64) -> String,
) -> String {
    let Some(tombstone) = &response.tombstone else {
        return String::new();
    };
    let location = tombstone
        .location
        .as_deref()
        .map_or_else(|| "NULL".to_owned(), literal);
    format!(
        ", location = {location}, replay_until = {}, expires_at = {}",
        after_ms(ms(tombstone.replay)),
        after_ms(ms(tombstone.keep))
    )
}

/// Whole milliseconds, as the engines bind them.
pub(crate) fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
