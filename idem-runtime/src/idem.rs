//! [`Idem`]: the key store handlers share through axum state.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use sqlx::Pool;

use crate::backend::{Acquire, Backend};
use crate::error::Error;
use crate::hash::KeyHasher;
use crate::passes::Passes;
use crate::pooler::Pooler;
use crate::recent::FinishedKeys;
use crate::response::{DEFAULT_REPLAY_HEADERS, IDEMPOTENT_REPLAYED, is_forbidden};
use crate::seal::{KeyRing, Sealer};
use crate::table::{Tables, is_table_name};

/// The default table name.
pub const DEFAULT_TABLE: &str = "idem_keys";

/// The default cap on a stored response (its body and replayed headers): 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// The default number of times a phased key is resumed before it becomes
/// uncertain: 5.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// The default time a request body may take to arrive: 30 seconds.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The idempotency key store: a pool, a table and the replay rules.
///
/// Cheap to clone. Put it in your router state and implement
/// `FromRef<AppState> for Idem<DB>`; every `#[idempotent]` handler finds it
/// there. Build one per key table and share it: each keeps a fixed 256 KiB
/// table of the keys it saw finish, so that their retries are answered with
/// one plain read (the database stays the authority).
///
/// ```no_run
/// # use idem_runtime as idem;
/// use axum::extract::FromRef;
/// use idem::Idem;
/// use sqlx::{PgPool, Postgres};
///
/// #[derive(Clone)]
/// struct AppState {
///     idem: Idem<Postgres>,
///     pool: PgPool,
/// }
///
/// impl FromRef<AppState> for Idem<Postgres> {
///     fn from_ref(state: &AppState) -> Self {
///         state.idem.clone()
///     }
/// }
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let idem = Idem::new(pool.clone())
///     .table("payments.idempotency_keys")?
///     .max_response_bytes(256 * 1024);
/// idem.migrate().await?;
/// let state = AppState { idem, pool };
/// # let _ = state; Ok(()) }
/// ```
pub struct Idem<DB: Backend> {
    inner: Arc<Inner<DB>>,
}

pub(crate) struct Inner<DB: Backend> {
    pool: Pool<DB>,
    table: String,
    replay_headers: Vec<HeaderName>,
    max_response_bytes: usize,
    body_timeout: Duration,
    acquire: Acquire,
    advisory_locks: bool,
    pooler: Pooler,
    finished: FinishedKeys,
    replay_marker: HeaderName,
    problem_type_base: Option<Arc<str>>,
    max_attempts: u32,
    ring: Option<KeyRing>,
    hasher: Option<KeyHasher>,
    pub(crate) passes: Arc<Passes>,
    pub(crate) messages: Tables,
}

impl<DB: Backend> Clone for Idem<DB> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Idem<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idem")
            .field("table", &self.inner.table)
            .field("replay_headers", &self.inner.replay_headers)
            .field("max_response_bytes", &self.inner.max_response_bytes)
            .field("body_timeout", &self.inner.body_timeout)
            .field("checked_acquire", &(self.inner.acquire == Acquire::Checked))
            .field("advisory_locks", &self.inner.advisory_locks)
            .field("pooler", &self.inner.pooler)
            .field("replay_marker", &self.inner.replay_marker)
            .field("problem_type_base", &self.inner.problem_type_base)
            .field("encryption", &self.inner.ring)
            .field("hash_keys", &self.inner.hasher.is_some())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Idem<DB> {
    /// A store keeping keys in `pool`, table [`DEFAULT_TABLE`].
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                table: DEFAULT_TABLE.to_owned(),
                replay_headers: DEFAULT_REPLAY_HEADERS.to_vec(),
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                body_timeout: DEFAULT_BODY_TIMEOUT,
                acquire: Acquire::Idle,
                advisory_locks: true,
                pooler: Pooler::Session,
                finished: FinishedKeys::new(),
                replay_marker: IDEMPOTENT_REPLAYED,
                problem_type_base: None,
                max_attempts: DEFAULT_MAX_ATTEMPTS,
                ring: None,
                hasher: None,
                passes: Arc::default(),
                messages: Tables::beside(DEFAULT_TABLE),
            }),
        }
    }

    pub(crate) fn with(self, change: impl FnOnce(&mut Inner<DB>)) -> Self {
        let inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| Inner {
            pool: shared.pool.clone(),
            table: shared.table.clone(),
            replay_headers: shared.replay_headers.clone(),
            max_response_bytes: shared.max_response_bytes,
            body_timeout: shared.body_timeout,
            acquire: shared.acquire,
            advisory_locks: shared.advisory_locks,
            pooler: shared.pooler,
            finished: FinishedKeys::new(),
            replay_marker: shared.replay_marker.clone(),
            problem_type_base: shared.problem_type_base.clone(),
            max_attempts: shared.max_attempts,
            ring: shared.ring.clone(),
            hasher: shared.hasher.clone(),
            passes: Arc::clone(&shared.passes),
            messages: shared.messages.clone(),
        });
        let mut inner = inner;
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Keeps keys in another table: a plain identifier, optionally
    /// schema-qualified (`schema.table`).
    pub fn table(self, name: &str) -> Result<Self, Error> {
        if !is_table_name(name) {
            return Err(Error::InvalidTableName(name.to_owned()));
        }
        let name = name.to_owned();
        Ok(self.with(|inner| {
            inner.messages.follow(&name);
            inner.table = name;
        }))
    }

    /// Replays these response headers too, besides the defaults
    /// (Content-Type, Location, ETag, Link, Cache-Control, ...).
    ///
    /// Hop-by-hop headers, `Set-Cookie` and `Content-Length` are refused:
    /// they describe one connection or one client, not the result.
    pub fn replay_headers<I>(self, names: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = HeaderName>,
    {
        let names: Vec<HeaderName> = names.into_iter().collect();
        if let Some(bad) = names.iter().find(|name| is_forbidden(name)) {
            return Err(Error::ForbiddenReplayHeader(bad.to_string()));
        }
        Ok(self.with(|inner| {
            for name in names {
                if !inner.replay_headers.contains(&name) {
                    inner.replay_headers.push(name);
                }
            }
        }))
    }

    /// Names the header that marks a replayed response (`<name>: true`):
    /// [`IDEMPOTENT_REPLAYED`] (`Idempotent-Replayed`, as Stripe writes it)
    /// by default; some contracts write `Idempotent-Replay`. A header on the
    /// replay allow-list, hop-by-hop, `Set-Cookie` or `Content-Length` is
    /// refused.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem::Error> {
    /// use axum::http::HeaderName;
    ///
    /// let idem = idem::Idem::new(pool)
    ///     .replay_header(HeaderName::from_static("idempotent-replay"))?;
    /// # Ok(()) }
    /// ```
    pub fn replay_header(self, name: HeaderName) -> Result<Self, Error> {
        if is_forbidden(&name) || self.inner.replay_headers.contains(&name) {
            return Err(Error::InvalidReplayMarker(name.to_string()));
        }
        Ok(self.with(|inner| inner.replay_marker = name))
    }

    /// Types `idem`'s problem responses: their `type` becomes `base`
    /// followed by the problem's `code` (`https://docs.example.com/errors/`
    /// gives `https://docs.example.com/errors/idempotency_key_reused`),
    /// in place of `about:blank`, so clients can follow it to your docs.
    /// `base` must be an absolute URI (`scheme:...`).
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem::Error> {
    /// let idem = idem::Idem::new(pool).problem_type_base("https://docs.example.com/errors/")?;
    /// # Ok(()) }
    /// ```
    pub fn problem_type_base(self, base: &str) -> Result<Self, Error> {
        let absolute = base
            .parse::<http::Uri>()
            .is_ok_and(|uri| uri.scheme().is_some());
        if !absolute {
            return Err(Error::InvalidProblemTypeBase(base.to_owned()));
        }
        let base: Arc<str> = base.into();
        Ok(self.with(|inner| inner.problem_type_base = Some(base)))
    }

    /// Caps the response kept for replay (default 1 MiB): its body and its
    /// replayed headers, each header counting its name, its value and 6
    /// bytes. A handler answer above the cap is rolled back and the client
    /// gets a 500: an effect is never committed without the response that
    /// reports it.
    pub fn max_response_bytes(self, bytes: usize) -> Self {
        self.with(|inner| inner.max_response_bytes = bytes)
    }

    /// Bounds the time a request body may take to arrive (default 30 s):
    /// a slower client gets 408 before anything is claimed, so a trickling
    /// body cannot hold a connection or a key.
    pub fn body_timeout(self, timeout: Duration) -> Self {
        self.with(|inner| inner.body_timeout = timeout)
    }

    /// Whether every request's connection passes the pool's own checks
    /// on acquire: sqlx's `test_before_acquire` ping and a `before_acquire`
    /// hook. Default `false`: `idem` takes an idle connection as it is
    /// ([`Pool::try_acquire`]), one round trip fewer on every request,
    /// because its own first statement on it (the claim, a replay's read,
    /// a keyless request's `BEGIN`) tests it anyway. A connection that
    /// statement finds gone (closed by the server, a restart, the network)
    /// is closed and the statement runs again on a connection the pool
    /// checks: nothing it did can have committed. With no idle connection
    /// at hand, `idem` waits in [`Pool::acquire`] as usual.
    ///
    /// Set it when the pool's `before_acquire` hook must run for every
    /// checkout (one that does more than test the connection).
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let idem = idem::Idem::new(pool).checked_acquire(true);
    /// # }
    /// ```
    pub fn checked_acquire(self, checked: bool) -> Self {
        let acquire = if checked {
            Acquire::Checked
        } else {
            Acquire::Idle
        };
        self.with(|inner| inner.acquire = acquire)
    }

    /// Whether a claim may take a transaction-scoped advisory lock on its
    /// key, where the server offers them (default `true`). On PostgreSQL
    /// proper (chosen once per server: not CockroachDB, nor a server whose
    /// `pg_try_advisory_xact_lock` fails) the claim then tells a concurrent
    /// attempt by that lock, on a 64-bit hash of the table, scope and key,
    /// in place of a lock timeout set and reset around its insert: cheaper
    /// for the server. The key table's unique index stays the authority: two
    /// keys whose hashes collide at most answer each other 409 while both
    /// are in flight, and a `wait` still waits for the first attempt.
    /// Other engines ignore it.
    ///
    /// Every service claiming keys in one table should agree on it: a claim
    /// with advisory locks that meets a row in flight from a claim without
    /// them (another service, or an older `idem` during a rolling upgrade)
    /// waits for that attempt to end instead of answering 409. Set it to
    /// `false` where the application's own advisory locks use 64-bit keys
    /// that must never wait on `idem`'s.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let idem = idem::Idem::new(pool).advisory_locks(false);
    /// # }
    /// ```
    pub fn advisory_locks(self, allowed: bool) -> Self {
        self.with(|inner| inner.advisory_locks = allowed)
    }

    pub(crate) fn advisory(&self) -> bool {
        self.inner.advisory_locks
    }

    /// Says what sits between the service and its database (default
    /// [`Pooler::Session`]). Behind a transaction-mode pooler such as
    /// PgBouncer's `pool_mode = transaction`, set [`Pooler::Transaction`]:
    /// the claim, the finish and the replay's read then keep nothing in the
    /// session: on PostgreSQL (with advisory locks) they call functions that
    /// [`migrate`](Self::migrate) makes for the key table, whose plans each
    /// server session keeps, instead of statements prepared once per
    /// connection (the call is parsed per request); where the functions
    /// are missing, the statements run with their values inlined. Every other statement of
    /// `idem`'s holds nothing in the session on any setting. The application's own
    /// queries need `.persistent(false)` there: sqlx names every statement
    /// it prepares otherwise.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let idem = idem::Idem::new(pool).pooler(idem::Pooler::Transaction);
    /// # }
    /// ```
    pub fn pooler(self, pooler: Pooler) -> Self {
        self.with(|inner| inner.pooler = pooler)
    }

    /// How many duplicates of `key` in `scope` wait in this process for
    /// the attempt in flight: a request that arrives while another with
    /// its key runs waits for it (up to the handler's `wait`) holding no
    /// database connection. For a dashboard or a test that must see a
    /// duplicate waiting before it acts.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/app").unwrap();
    /// let idem = idem::Idem::new(pool);
    /// assert_eq!(idem.waiting_duplicates("acct_1", "order-42"), 0);
    /// # }
    /// ```
    pub fn waiting_duplicates(&self, scope: &str, key: &str) -> usize {
        crate::backend::waiting_duplicates(self.pool(), self.table_name(), scope, key)
    }

    /// How many times a phased key whose attempt stopped after an external
    /// step may have happened is resumed, by the completer and by clients'
    /// retries together, before it becomes uncertain (default
    /// [`DEFAULT_MAX_ATTEMPTS`]): a client that retries without end ends
    /// there too, rather than resuming without end. At least 1.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # fn demo(pool: sqlx::PgPool) {
    /// let idem = idem::Idem::new(pool).max_attempts(3);
    /// # let _ = idem; }
    /// ```
    pub fn max_attempts(self, attempts: u32) -> Self {
        self.with(|inner| inner.max_attempts = attempts.max(1))
    }

    /// Seals what the key table keeps of a request with `ring`
    /// (AES-256-GCM): stored responses (headers and body), and for phased
    /// keys the kept request and the recovery points. Values are sealed
    /// with the ring's newest key and opened with the key their stored id
    /// names; each is bound to its table, scope, key and column, so a value
    /// copied to another row does not open (the table as
    /// [`table`](Self::table) spells it: keep the spelling while sealed
    /// values live). Fingerprints (hashes already),
    /// statuses, times and an uncertain key's reason stay plain.
    ///
    /// A stored response that does not open (its key removed from the
    /// ring, a value copied from another row, corruption) is answered 500
    /// `idempotency_response_unreadable` with `operation_state`
    /// `completed`: nothing runs again, a new key is not safe, and the
    /// failure is logged and counted (`idem_unreadable_total`).
    ///
    /// Plain values stored before encryption was turned on are read as
    /// they are, unless the ring [refuses them](KeyRing::refuse_plaintext).
    /// Turning encryption off leaves sealed values unreadable: keep the
    /// ring until they have expired.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use idem::{Idem, KeyRing};
    ///
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// // `IDEM_ENCRYPTION_KEYS=2026-12:<base64 of 32 bytes>,...`, newest last.
    /// let mut idem = Idem::new(pool);
    /// if let Some(ring) = KeyRing::from_env("IDEM_ENCRYPTION_KEYS")? {
    ///     idem = idem.encryption(ring);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn encryption(self, ring: KeyRing) -> Self {
        self.with(|inner| inner.ring = Some(ring))
    }

    /// Keeps scopes and keys hashed with `hasher` (HMAC-SHA256): the key
    /// table (and its `<table>_resolutions` table) then holds no caller's
    /// scope, such as an account id, and no key in the clear, only their
    /// hashes (43 characters each, a key's bound to its scope; see
    /// [`KeyHasher`]). Any scope length is kept then (the stored one is 43
    /// bytes), where [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN) bounds a clear
    /// one.
    ///
    /// Handlers see the clear scope and key as before
    /// ([`Tx::key`](crate::Tx::key), derived keys), and the operations
    /// ([`lookup`](Self::lookup), [`forget`](Self::forget),
    /// [`resolve`](Self::resolve), [`recent`](Self::recent)) take them clear
    /// too. What lists keys ([`recent`](Self::recent),
    /// [`keys`](Self::keys), the admin page) shows the hashes, which cannot
    /// be turned back; the operations take a listed pair of hashes as well.
    ///
    /// A phased key's kept request then carries its clear scope and key, as
    /// the completer resumes it with them: seal it with
    /// [`encryption`](Self::encryption) for the table to show neither.
    ///
    /// Turning it on (or changing the secret) makes every key stored
    /// before unknown: their retries run as new requests. Turn it on
    /// where a retry of a key already stored cannot come (a new table, or
    /// after a quiet period longer than the keys' TTL), and keep the
    /// secret as long as the keys it hashed live.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use idem::{Idem, KeyHasher};
    ///
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// // `IDEM_HASH_SECRET=$(openssl rand -base64 32)`
    /// let mut idem = Idem::new(pool);
    /// if let Some(hasher) = KeyHasher::from_env("IDEM_HASH_SECRET")? {
    ///     idem = idem.hash_keys(hasher);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn hash_keys(self, hasher: KeyHasher) -> Self {
        self.with(|inner| inner.hasher = Some(hasher))
    }

    /// The store's key hasher, if it hashes scopes and keys.
    pub(crate) fn key_hasher(&self) -> Option<&KeyHasher> {
        self.inner.hasher.as_ref()
    }

    /// `scope` and its `key` as the key table keeps them: hashed where the
    /// store hashes them, as they are otherwise.
    pub(crate) fn stored<'a>(&self, scope: &'a str, key: &'a str) -> (Cow<'a, str>, Cow<'a, str>) {
        match &self.inner.hasher {
            Some(hasher) => (
                Cow::Owned(hasher.scope(scope)),
                Cow::Owned(hasher.key(scope, key)),
            ),
            None => (Cow::Borrowed(scope), Cow::Borrowed(key)),
        }
    }

    /// `scope` as the key table keeps it.
    pub(crate) fn stored_scope<'a>(&self, scope: &'a str) -> Cow<'a, str> {
        match &self.inner.hasher {
            Some(hasher) => Cow::Owned(hasher.scope(scope)),
            None => Cow::Borrowed(scope),
        }
    }

    /// How this store keeps its values: sealed with its ring, or plain.
    pub(crate) fn sealer(&self) -> Sealer<'_> {
        Sealer {
            ring: self.inner.ring.as_ref(),
            table: &self.inner.table,
        }
    }

    pub(crate) fn attempts_limit(&self) -> u32 {
        self.inner.max_attempts
    }

    /// Whether statements must keep nothing in the session.
    pub(crate) fn pooled(&self) -> bool {
        self.inner.pooler == Pooler::Transaction
    }

    pub(crate) fn body_read_timeout(&self) -> Duration {
        self.inner.body_timeout
    }

    pub(crate) fn acquire(&self) -> Acquire {
        self.inner.acquire
    }

    /// The pool keys are kept in.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// The table keys are kept in.
    pub fn table_name(&self) -> &str {
        &self.inner.table
    }

    pub(crate) fn replay_header_names(&self) -> &[HeaderName] {
        &self.inner.replay_headers
    }

    /// The header that marks a replay.
    pub(crate) fn replay_marker(&self) -> &HeaderName {
        &self.inner.replay_marker
    }

    pub(crate) fn problem_type_prefix(&self) -> Option<&str> {
        self.inner.problem_type_base.as_deref()
    }

    /// `problem` as this store's services answer it.
    pub(crate) fn problem(&self, problem: crate::problem::Problem) -> axum::response::Response {
        problem.render(self.problem_type_prefix(), problem.operation_state())
    }

    /// `response` on its way out: one of `idem`'s problems gets the
    /// configured type (see [`problem_type_base`](Self::problem_type_base)).
    pub(crate) fn typed(&self, response: axum::response::Response) -> axum::response::Response {
        let Some(base) = self.problem_type_prefix() else {
            return response;
        };
        match response.extensions().get::<crate::problem::Rendered>() {
            Some(&crate::problem::Rendered(problem, state)) => {
                problem.rerender(&response, Some(base), state)
            }
            None => response,
        }
    }

    pub(crate) fn response_cap(&self) -> usize {
        self.inner.max_response_bytes
    }

    pub(crate) fn inner(&self) -> &Inner<DB> {
        &self.inner
    }

    /// The keys this process saw finish, for the replay fast path.
    pub(crate) fn finished_keys(&self) -> &FinishedKeys {
        &self.inner.finished
    }

    /// Creates the key table and its expiry index if they are missing.
    /// Safe to run on every start, from several instances at once.
    ///
    /// Behind a declared transaction-mode pooler
    /// ([`pooler`](Self::pooler)), it also makes what the claims there use
    /// (on PostgreSQL, three functions named after the table, whose plans
    /// the server keeps where it cannot keep prepared statements).
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate(&self.inner.pool, &self.inner.table).await?;
        if self.pooled() {
            DB::migrate_pooled(&self.inner.pool, &self.inner.table).await?;
        }
        Ok(())
    }

    /// Deletes up to `batch` expired keys, then turns up to the rest of
    /// `batch` keys past their replay into tombstones (a handler's
    /// `tombstone`: their stored body and headers dropped, their
    /// fingerprint, status and `Location` kept); returns how many keys it
    /// deleted or turned.
    ///
    /// Expired keys already count as absent, and a key past its replay
    /// already answers as a tombstone, so sweeping only reclaims space.
    /// Small batches keep each statement short.
    pub async fn sweep_expired(&self, batch: u32) -> Result<u64, Error> {
        Ok(DB::sweep(&self.inner.pool, &self.inner.table, batch).await?)
    }

    /// Spawns a task that sweeps expired keys every `every`
    /// ([`sweep_expired`](Self::sweep_expired)), in batches of 1,000 until
    /// none are left, and logs a warning for a sweep that
    /// fails (it tries again at the next tick). Abort the returned handle
    /// to stop it between batches (a batch in flight still ends).
    ///
    /// The sweeper keeps this `Idem`'s configuration: spawn it once the
    /// builder calls ([`table`](Self::table) and the rest) are done, as a
    /// later one makes a new `Idem` the sweeper does not see.
    ///
    /// # Panics
    ///
    /// If `every` is zero, here rather than in the task (where nobody
    /// would see it, and no sweep would ever run).
    pub fn spawn_sweeper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        self.spawn_sweeping(every, Swept::Keys)
    }

    /// Spawns a task that deletes records of processed messages
    /// ([`consume`](Self::consume)) past their retention every `every`, as
    /// [`spawn_sweeper`](Self::spawn_sweeper) does keys.
    ///
    /// # Panics
    ///
    /// If `every` is zero.
    pub fn spawn_consumed_sweeper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        self.spawn_sweeping(every, Swept::Consumed)
    }

    /// Every `every`, sweeps `what` in batches of 1,000 until a batch
    /// deletes fewer; a failure is logged and tried again at the next tick.
    fn spawn_sweeping(&self, every: Duration, what: Swept) -> tokio::task::JoinHandle<()> {
        assert!(!every.is_zero(), "sweeper: `every` must be more than zero");
        let idem = self.clone();
        let mut ticks = tokio::time::interval(every);
        tokio::spawn(async move {
            loop {
                ticks.tick().await;
                loop {
                    let batch = idem.clone();
                    let Some(swept) = crate::passes::uncut(async move {
                        match what {
                            Swept::Keys => batch.sweep_expired(1000).await,
                            Swept::Consumed => batch.sweep_consumed(1000).await,
                        }
                    })
                    .await
                    else {
                        return;
                    };
                    match swept {
                        Ok(1000) => continue,
                        Ok(_) => break,
                        Err(error) => {
                            // `Error`'s display leaves its source to
                            // reporters that walk the chain: name it.
                            let cause = std::error::Error::source(&error)
                                .map(ToString::to_string)
                                .unwrap_or_default();
                            tracing::warn!(error = %error, cause, swept = ?what, "sweeping failed");
                            break;
                        }
                    }
                }
            }
        })
    }
}

/// What a sweeper deletes.
#[derive(Debug, Clone, Copy)]
enum Swept {
    /// Expired idempotency keys.
    Keys,
    /// Records of processed messages past their retention.
    Consumed,
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use http::HeaderName;

    use super::Idem;
    use crate::error::Error;
    use crate::table::is_table_name;

    /// A store whose pool never connects, for tests that only read its
    /// settings.
    pub(crate) fn idem() -> Idem<sqlx::Postgres> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://127.0.0.1:1/none")
            .unwrap();
        Idem::new(pool)
    }

    /// Added headers join the defaults once each; a header that describes
    /// one connection or one client is refused, and nothing is added.
    #[tokio::test]
    async fn replay_headers_add_to_the_defaults_and_refuse_forbidden_ones() {
        let cost = HeaderName::from_static("x-request-cost");
        let idem = idem().replay_headers([cost.clone(), cost.clone()]).unwrap();
        let names = idem.replay_header_names();
        assert_eq!(names.iter().filter(|name| **name == cost).count(), 1);
        assert!(names.contains(&http::header::LOCATION), "{names:?}");
        for forbidden in [
            "set-cookie",
            "content-length",
            "connection",
            "transfer-encoding",
            "proxy-connection",
        ] {
            let refused = idem.clone().replay_headers([
                HeaderName::from_static("x-other"),
                HeaderName::from_static(forbidden),
            ]);
            assert!(
                matches!(&refused, Err(Error::ForbiddenReplayHeader(name)) if name == forbidden),
                "{forbidden}: {refused:?}"
            );
        }
        assert!(
            !idem
                .replay_header_names()
                .contains(&HeaderName::from_static("x-other"))
        );
    }

    /// The sweeper's first tick comes at once and deletes every expired
    /// key, 1,000 at a time, however many there are, and nothing else.
    /// The batches are counted on the pool's one connection, by SQLite's
    /// hooks: the rows each commit deleted.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn the_sweeper_deletes_every_expired_key_in_batches() {
        use std::sync::{Arc, Mutex};

        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let idem = Idem::new(pool.clone());
        idem.migrate().await.unwrap();
        sqlx::raw_sql(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 2502) \
             INSERT INTO idem_keys (scope, \"key\", fingerprint, created_at, expires_at) \
             SELECT 's', CAST(i AS BLOB), x'00', 0, CASE WHEN i < 2500 THEN 1 ELSE 9e15 END FROM n",
        )
        .execute(&pool)
        .await
        .unwrap();
        // (rows deleted in the open transaction, rows each commit deleted)
        let batches = Arc::new(Mutex::new((0_usize, Vec::new())));
        {
            let mut conn = pool.acquire().await.unwrap();
            let mut handle = conn.lock_handle().await.unwrap();
            let deleted = batches.clone();
            handle.set_update_hook(move |change| {
                if matches!(change.operation, sqlx::sqlite::SqliteOperation::Delete) {
                    deleted.lock().unwrap().0 += 1;
                }
            });
            let committed = batches.clone();
            handle.set_commit_hook(move || {
                let mut batches = committed.lock().unwrap();
                let rows = std::mem::take(&mut batches.0);
                if rows > 0 {
                    batches.1.push(rows);
                }
                true
            });
        }
        let sweeper = idem.spawn_sweeper(Duration::from_secs(3600));
        let count = || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_keys")
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while count().await > 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} keys left",
                count().await
            );
            tokio::task::yield_now().await;
        }
        assert_eq!(count().await, 3, "the live keys stay");
        assert_eq!(batches.lock().unwrap().1, [1000, 1000, 500]);
        assert!(!sweeper.is_finished(), "it keeps running");
        sweeper.abort();
    }

    /// A replay marker that would clobber a replayed or hop-by-hop header
    /// is refused; a type base must be absolute. Problems then carry
    /// `<base><code>`, replays the chosen marker.
    #[tokio::test]
    async fn the_replay_marker_and_problem_type_are_checked_and_applied() {
        for refused in ["content-type", "location", "set-cookie", "connection"] {
            let result = idem().replay_header(HeaderName::from_static(refused));
            assert!(
                matches!(&result, Err(Error::InvalidReplayMarker(name)) if name == refused),
                "{refused}: {result:?}"
            );
        }
        for refused in ["errors/", "", "/errors/"] {
            assert!(matches!(
                idem().problem_type_base(refused),
                Err(Error::InvalidProblemTypeBase(_))
            ));
        }
        let idem = idem()
            .replay_header(HeaderName::from_static("idempotent-replay"))
            .unwrap()
            .problem_type_base("https://docs.example.com/errors/")
            .unwrap();
        assert_eq!(idem.replay_marker(), "idempotent-replay");
        // Typed on its way out, a problem keeps the state it reported.
        let typed = idem.typed(
            crate::problem::Problem::KeyReused.answer(crate::problem::OperationState::InProgress),
        );
        let body = http_body_util::BodyExt::collect(typed.into_body())
            .await
            .unwrap()
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            json["type"],
            "https://docs.example.com/errors/idempotency_key_reused"
        );
        assert_eq!(json["operation_state"], "in_progress");
        let untouched = idem.typed(axum::response::Response::new("plain".into()));
        assert!(untouched.extensions().is_empty());
    }

    #[test]
    fn table_names_are_plain_identifiers() {
        for good in ["idem_keys", "_k", "payments.idem_keys", "K2"] {
            assert!(is_table_name(good), "{good}");
        }
        for bad in [
            "",
            "1k",
            "a.b.c",
            "keys; DROP TABLE x",
            "k-1",
            "\"k\"",
            ".k",
            "k.",
            &"k".repeat(64),
        ] {
            assert!(!is_table_name(bad), "{bad}");
        }
    }

    /// A zero period panics where the sweeper is spawned, not in its task.
    #[tokio::test]
    #[should_panic(expected = "`every` must be more than zero")]
    async fn a_zero_sweep_period_panics_at_the_call() {
        drop(idem().spawn_sweeper(Duration::ZERO));
    }
}
