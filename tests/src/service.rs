//! The service under test, written once: one idempotent handler with
//! knobs, stamped out per engine by `define_app!` (handlers cannot be
//! generic, the SQL dialect can: see `TestDb`), and the setup every engine
//! shares.
//!
//! The conformance suite runs it on every engine; the PostgreSQL hardening
//! tests ([`crate::hardening`]) beat on the same service.
//!
//! Both read its answers as an [`Answer`].
//!
//! The caller travels percent-encoded in `x-caller`, so tests can use scopes
//! with separators, unicode and NUL, none of which a header carries as is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use sqlx::pool::PoolOptions;
use sqlx::{Database, Pool};
use tokio::sync::{Notify, OnceCell};

/// The effects table, on every engine: `scope` holds the caller's bytes (a
/// scope may hold NUL, which PostgreSQL `text` refuses). The engines' SQL
/// spells it out.
pub const EFFECTS: &str = "idem_service_effects";

/// What each engine supplies: a pool, its SQL dialect and its router.
pub trait TestDb: idem::Admin + Sized {
    /// Engine name in messages.
    const ENGINE: &'static str;
    /// One writer at a time (SQLite): while a handler's transaction is
    /// open, every other claim waits for it, whatever its key.
    const SERIAL_WRITES: bool = false;
    /// Inserts one effect: (scope, key, note, nonce), returning its id.
    const INSERT_EFFECT: &'static str;
    /// Rewrites one effect row in place (takes its row lock): `$1`/`?` = id.
    const TOUCH_EFFECT: &'static str;
    /// Counts the effects of one scope: `$1`/`?` = the scope's bytes.
    const COUNT_EFFECTS: &'static str;
    /// Makes the engine itself end the transaction open on `conn`, in which
    /// effect `id` was just inserted, as some errors do: PostgreSQL fails
    /// the transaction, InnoDB rolls it back on a deadlock, SQLite on
    /// `INSERT OR ROLLBACK`. Returns that statement's error, for the handler
    /// to swallow.
    fn end_by_error(
        conn: &mut Self::Connection,
        id: i64,
    ) -> impl std::future::Future<Output = sqlx::Error> + Send;
    /// Opens a transaction holding the row lock of effect `id`.
    fn lock_effect(
        pool: &sqlx::Pool<Self>,
        id: i64,
    ) -> impl std::future::Future<Output = sqlx::Transaction<'static, Self>> + Send;
    /// Connects (failing loudly when the server is missing) and migrates.
    fn connect() -> impl std::future::Future<Output = sqlx::Pool<Self>> + Send;
    /// A pool whose server cannot be reached.
    fn unreachable_pool() -> sqlx::Pool<Self>;
    /// The test service on this engine.
    fn router(state: AppState<Self>) -> axum::Router;
    /// Effects recorded for one scope.
    fn count_effects(
        pool: &sqlx::Pool<Self>,
        scope: &str,
    ) -> impl std::future::Future<Output = i64> + Send;
    /// Idempotency rows stored for one scope (default table).
    fn count_keys(
        pool: &sqlx::Pool<Self>,
        scope: &str,
    ) -> impl std::future::Future<Output = i64> + Send;
    /// Rows in a key table of a test's own (a plain identifier).
    fn rows_in(
        pool: &sqlx::Pool<Self>,
        table: &str,
    ) -> impl std::future::Future<Output = i64> + Send;
    /// Drops a key table of a test's own (a plain identifier).
    fn drop_table(
        pool: &sqlx::Pool<Self>,
        table: &str,
    ) -> impl std::future::Future<Output = ()> + Send;
    /// Claims of `(scope, key)` (default table) waiting for a lock, as the
    /// database shows them: only requests of that scope and key can be
    /// counted, so other tests' waits on the same server never are. `None`
    /// where such a wait is not the database's to show (SQLite: a duplicate
    /// waits in-process, in the store's single flight).
    ///
    /// MariaDB answers this and [`lock_waiters`](Self::lock_waiters) from a
    /// cache of InnoDB's lock tables, refreshed only by a read coming more
    /// than 100 ms after the previous one (anyone's): a caller polling
    /// faster sees the first answer forever. Space reads out (the suite's
    /// `spaced` does, process-wide).
    fn claim_waiters(
        pool: &sqlx::Pool<Self>,
        scope: &str,
        key: &str,
    ) -> impl std::future::Future<Output = Option<i64>> + Send;
    /// Sessions waiting for a lock that the transaction open on `holder`
    /// holds (asked on `holder` itself, which names it). `None` where the
    /// database cannot tell (SQLite: its one write lock is waited for in
    /// each connection's busy handler, invisible to the others).
    fn lock_waiters(
        holder: &mut Self::Connection,
    ) -> impl std::future::Future<Output = Option<i64>> + Send;
    /// Whether `conn` is inside a transaction, as the database (not sqlx's
    /// count) sees it.
    fn in_transaction(
        conn: &mut Self::Connection,
    ) -> impl std::future::Future<Output = bool> + Send;
    /// The server's id of the session behind `conn` (PostgreSQL's backend
    /// pid, MySQL's connection id); `None` without a server (SQLite).
    fn session_id(
        conn: &mut Self::Connection,
    ) -> impl std::future::Future<Output = Option<i64>> + Send {
        let _ = conn;
        async { None }
    }
    /// Ends session `id` from the server's side, as a restart, an idle
    /// timeout or an administrator would, through `admin`; returns once the
    /// server has ended it. Only engines with a server have sessions.
    fn end_session(
        admin: &sqlx::Pool<Self>,
        id: i64,
    ) -> impl std::future::Future<Output = ()> + Send {
        let _ = (admin, id);
        async { unreachable!("{} has no server sessions", Self::ENGINE) }
    }
    /// Whether session `id` is still open on the server, asked through
    /// `admin`. Only engines with a server have sessions.
    fn session_open(
        admin: &sqlx::Pool<Self>,
        id: i64,
    ) -> impl std::future::Future<Output = bool> + Send {
        let _ = (admin, id);
        async { unreachable!("{} has no server sessions", Self::ENGINE) }
    }
    /// A pool (tables migrated) on which [`lose_commit`](Self::lose_commit)
    /// can make a handler's commit fail: the test pool wherever a session
    /// can be ended.
    fn commit_losing_pool() -> impl std::future::Future<Output = sqlx::Pool<Self>> + Send {
        Self::connect()
    }
    /// Makes the next commit of the transaction that a handler parked in
    /// `session:` mode holds on session `session` (of `pool`) fail for the
    /// store's reasons, as a lost connection would: by default the server
    /// ends the session. Returns what must live until that commit failed.
    fn lose_commit(
        pool: &sqlx::Pool<Self>,
        session: Option<i64>,
    ) -> impl std::future::Future<Output = Box<dyn std::any::Any + Send>> + Send {
        async move {
            let id = session.expect("an engine with server sessions");
            Self::end_session(pool, id).await;
            Box::new(()) as Box<dyn std::any::Any + Send>
        }
    }
}

/// The `TestDb` methods every engine writes alike, but for its
/// placeholder (`$1` or `?`).
#[macro_export]
macro_rules! test_db_queries {
    ($placeholder:literal) => {
        async fn lock_effect(pool: &Pool<Self>, id: i64) -> sqlx::Transaction<'static, Self> {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(Self::TOUCH_EFFECT)
                .bind(id)
                .persistent($crate::service::persistent())
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }

        const COUNT_EFFECTS: &'static str = concat!(
            "SELECT count(*) FROM idem_service_effects WHERE scope = ",
            $placeholder
        );

        async fn count_effects(pool: &Pool<Self>, scope: &str) -> i64 {
            // In a transaction, unnamed: what every topology runs (see
            // `persistent`).
            let mut tx = pool.begin().await.unwrap();
            let count = sqlx::query_scalar(Self::COUNT_EFFECTS)
                .bind(scope.as_bytes())
                .persistent($crate::service::persistent())
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            count
        }

        async fn rows_in(pool: &Pool<Self>, table: &str) -> i64 {
            let sql = format!("SELECT count(*) FROM {table}");
            let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .fetch_one(pool)
                .await
                .unwrap();
            sqlx::Row::get(&row, 0)
        }

        async fn drop_table(pool: &Pool<Self>, table: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
                .execute(pool)
                .await
                .unwrap();
        }

        async fn count_keys(pool: &Pool<Self>, scope: &str) -> i64 {
            let mut tx = pool.begin().await.unwrap();
            let count = sqlx::query_scalar(concat!(
                "SELECT count(*) FROM idem_keys WHERE scope = ",
                $placeholder
            ))
            .bind(scope.as_bytes())
            .persistent($crate::service::persistent())
            .fetch_one(&mut *tx)
            .await
            .unwrap();
            tx.commit().await.unwrap();
            count
        }
    };
}

/// What the suites' service sits behind: `IDEM_TEST_POOLER=transaction`
/// runs them through a transaction-mode pooler (`tests/pooler.rs` sets it
/// for the suites it runs again through PgBouncer).
pub fn pooler() -> idem::Pooler {
    match std::env::var("IDEM_TEST_POOLER").as_deref() {
        Ok("transaction") => idem::Pooler::Transaction,
        Err(_) | Ok("" | "session") => idem::Pooler::Session,
        Ok(other) => panic!("IDEM_TEST_POOLER={other:?}: `transaction` or `session`"),
    }
}

/// Whether the tests' own statements may be kept by name in the session
/// (sqlx's default): not behind a transaction-mode pooler, where they are
/// also run inside a transaction (a bound statement outside one is parsed
/// and run in two exchanges, which such a pooler may send to two server
/// sessions).
pub fn persistent() -> bool {
    pooler() != idem::Pooler::Transaction
}

/// `name` from the environment, else `default`.
pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// A pool on the server at `url` (from `$var`); panics loudly when the
/// server is missing, so a skipped suite never looks green.
pub async fn server_pool<DB: Database>(
    options: PoolOptions<DB>,
    engine: &str,
    var: &str,
    url: &str,
) -> Pool<DB> {
    options
        .connect(url)
        .await
        .unwrap_or_else(|error| panic!("{engine} is required at {url} (set {var}): {error}"))
}

/// A pool whose server at `url` cannot be reached: every checkout fails
/// within two seconds.
pub fn unreachable<DB: Database>(options: PoolOptions<DB>, url: &str) -> Pool<DB> {
    options
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(url)
        .unwrap()
}

/// Creates the key table and the effects table (`ddl`, idempotent). Other
/// test binaries may race us in the catalog; the loser retries and finds
/// the tables.
pub async fn prepare<DB: idem::Backend>(pool: &Pool<DB>, ddl: &'static str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    idem::Idem::new(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    for attempt in 0.. {
        match sqlx::raw_sql(ddl).execute(pool).await {
            Ok(_) => return,
            // PostgreSQL: another binary created the table or its type at
            // the same moment.
            Err(sqlx::Error::Database(db))
                if attempt < 5 && matches!(db.code().as_deref(), Some("23505" | "42P07")) => {}
            Err(error) => panic!("create {EFFECTS}: {error}"),
        }
    }
}

/// [`prepare`], once per process and engine (`ready`).
pub async fn prepare_once<DB: idem::Backend>(
    ready: &OnceCell<()>,
    pool: &Pool<DB>,
    ddl: &'static str,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    ready.get_or_init(|| prepare(pool, ddl)).await;
}

/// Shared by the test and the server it starts.
pub struct AppState<DB: idem::Backend> {
    pub idem: idem::Idem<DB>,
    pub holds: Holds,
}

impl<DB: idem::Backend> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            holds: self.holds.clone(),
        }
    }
}

impl<DB: idem::Backend> axum::extract::FromRef<AppState<DB>> for idem::Idem<DB> {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.idem.clone()
    }
}

impl<DB: idem::Backend> axum::extract::FromRef<AppState<DB>> for Holds {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.holds.clone()
    }
}

/// Serves `state`'s router on 127.0.0.1 until the task is aborted.
pub async fn serve<DB: TestDb>(
    state: AppState<DB>,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = DB::router(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, task)
}

/// Handlers in `hold:<name>` mode park here after their write until the
/// test releases them: the test drives the timing, not sleeps.
#[derive(Clone, Default)]
pub struct Holds(Arc<Mutex<HashMap<String, Arc<Hold>>>>);

#[derive(Default)]
pub struct Hold {
    pub entered: Notify,
    pub release: Notify,
    /// Notified when a held handler's future is dropped unfinished.
    pub dropped: Notify,
    /// The server's id of the held handler's session (`session:` mode;
    /// `None` on SQLite).
    pub session: Mutex<Option<i64>>,
    /// A `Tx` the handler kept past its end (`keep-tx:` mode), for the
    /// test to drop.
    pub kept: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Hold {
    /// Waits until the held handler has written its effect, bounded: a
    /// broken store that answers without running the handler fails the
    /// test instead of hanging it.
    pub async fn entered(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.entered.notified())
            .await
            .expect("the held handler never started");
    }

    /// The held handler's session, as it recorded it.
    pub fn session(&self) -> Option<i64> {
        *self.session.lock().unwrap()
    }

    /// Drops the `Tx` a handler kept past its end, which closes its
    /// connection and so rolls its transaction back.
    pub fn drop_kept(&self) {
        let kept = self.kept.lock().unwrap().take();
        assert!(kept.is_some(), "the handler kept no Tx");
    }
}

/// Signals `Hold::dropped` if the handler is cancelled while parked.
pub struct DropSignal(pub Option<Arc<Hold>>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        if let Some(hold) = self.0.take() {
            hold.dropped.notify_one();
        }
    }
}

impl Holds {
    pub fn get(&self, name: &str) -> Arc<Hold> {
        self.0
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_default()
            .clone()
    }
}

/// The caller, percent-decoded from `x-caller`; 401 without it.
pub struct Caller(pub String);

impl idem::Scope for Caller {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let raw = parts
            .headers
            .get("x-caller")
            .ok_or((StatusCode::UNAUTHORIZED, "send x-caller\n"))?;
        percent_decode(raw.as_bytes()).map(Caller).ok_or((
            StatusCode::UNAUTHORIZED,
            "x-caller is not percent-encoded UTF-8\n",
        ))
    }
}

#[derive(Deserialize)]
pub struct EffectRequest {
    pub note: String,
}

/// What the handler answers; `nonce` is random per execution, so a replay
/// repeats it and a second execution cannot.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Effect {
    pub id: i64,
    pub note: String,
    pub nonce: String,
}

/// What the annotated handlers return: an alias, so the suite shows that
/// an `Err` is told apart by its type, not by how the return type is
/// spelt (`handler_errors_roll_back`).
pub type HandlerResult = Result<Response, HandlerError>;

/// The handler's `Err`.
pub enum HandlerError {
    /// A statement failed: 500, with the error.
    Database(sqlx::Error),
    /// The handler refused the request, after writing, with this status
    /// (`error:<status>` mode): an `Err` rolls back whatever its status.
    Refused(StatusCode),
}

impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl IntoResponse for HandlerError {
    fn into_response(self) -> Response {
        match self {
            Self::Database(error) => {
                (StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")).into_response()
            }
            Self::Refused(status) => (status, "refused\n").into_response(),
        }
    }
}

/// The largest request body the service takes.
pub const BODY_LIMIT: usize = 64 * 1024;

/// The handler's knob, from `x-test-mode` (not part of the fingerprint, so
/// a retry without it is the same request).
pub fn mode(headers: &HeaderMap) -> String {
    headers
        .get("x-test-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// A name no other test, nor an earlier run, uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", nonce())
}

/// Random enough to tell executions apart, across threads and processes.
pub fn nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    format!("{:016x}", hasher.finish())
}

/// Every byte outside RFC 3986's unreserved set as `%XX`.
pub fn percent_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Inverse of [`percent_encode`]; `None` for a malformed escape or bytes
/// that are not UTF-8.
pub fn percent_decode(input: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(input.len());
    let mut bytes = input.iter();
    while let Some(&b) = bytes.next() {
        if b == b'%' {
            let hi = (*bytes.next()? as char).to_digit(16)?;
            let lo = (*bytes.next()? as char).to_digit(16)?;
            out.push((hi * 16 + lo) as u8);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

/// A response read whole, for comparing attempts (the tests' side of the
/// service).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: reqwest::StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    pub async fn of(response: reqwest::Response) -> reqwest::Result<Answer> {
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        Ok(Answer {
            status,
            headers,
            body,
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {self:?}"))
    }

    pub fn effect(&self) -> Effect {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not an effect: {} {:?}", self.status, self.body))
    }

    /// Asserts a 500 `internal_error` problem.
    pub fn assert_internal_error(&self) {
        assert_eq!(
            self.status,
            reqwest::StatusCode::INTERNAL_SERVER_ERROR,
            "{self:?}"
        );
        assert_eq!(self.problem_code(), "internal_error", "{self:?}");
    }

    /// The `code` member of a problem+json body.
    pub fn problem_code(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        self.json()["code"].as_str().unwrap().to_owned()
    }

    /// The problem's `operation_state` and `safe_new_key` members, which
    /// every problem of `idem`'s carries.
    pub fn operation_state(&self) -> (String, bool) {
        let json = self.json();
        let state = json["operation_state"].as_str();
        let safe = json["safe_new_key"].as_bool();
        match (state, safe) {
            (Some(state), Some(safe)) => (state.to_owned(), safe),
            _ => panic!("a problem without operation_state and safe_new_key: {self:?}"),
        }
    }
}

/// Sends `request` and reads the whole answer; panics if the exchange
/// fails.
pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    Answer::of(request.send().await.expect("request failed"))
        .await
        .expect("body failed")
}

/// Stamps out the handlers and router for one engine, as `handlers`, in a
/// module where this file is in scope as `app`.
#[macro_export]
macro_rules! define_app {
    ($db:ty) => {
        pub mod handlers {
            use std::time::Duration;

            use axum::Json;
            use axum::extract::State;
            use axum::http::{HeaderMap, StatusCode, header};
            use axum::response::{IntoResponse, Response};
            use idem::{Tx, idempotent};

            use super::app::{
                self, Caller, DropSignal, Effect, EffectRequest, HandlerError, Holds, TestDb,
            };

            /// Records one effect on `conn`, returning its id.
            async fn insert_effect(
                conn: &mut <$db as sqlx::Database>::Connection,
                caller: &Caller,
                key: &str,
                note: &str,
                nonce: &str,
            ) -> Result<i64, sqlx::Error> {
                sqlx::query_scalar(<$db as TestDb>::INSERT_EFFECT)
                    .bind(caller.0.as_bytes())
                    .bind(key)
                    .bind(note)
                    .bind(nonce)
                    .persistent(app::persistent())
                    .fetch_one(conn)
                    .await
            }

            async fn effect(
                caller: &Caller,
                headers: &HeaderMap,
                holds: &Holds,
                tx: &mut Tx<$db>,
                note: String,
            ) -> Result<Response, HandlerError> {
                let nonce = app::nonce();
                let key = tx.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                let id = insert_effect(&mut **tx, caller, &key, &note, &nonce).await?;
                match app::mode(headers).as_str() {
                    "fail-503" => {
                        return Ok((StatusCode::SERVICE_UNAVAILABLE, "try later").into_response());
                    }
                    "panic" => panic!("handler panicked on purpose"),
                    "big" => return Ok("x".repeat(64 * 1024).into_response()),
                    // Past any deadline: the effect is written, then nothing.
                    "stall" => std::future::pending::<()>().await,
                    "announce" => {
                        // The kill tests wait for this line, then SIGKILL us.
                        println!("EFFECT_WRITTEN {key}");
                        std::future::pending::<()>().await;
                    }
                    m if m.starts_with("hold:") => {
                        let hold = holds.get(&m[5..]);
                        let mut signal = DropSignal(Some(hold.clone()));
                        hold.entered.notify_one();
                        hold.release.notified().await;
                        signal.0 = None;
                    }
                    // Held as in `hold:`, its session recorded for the
                    // test to end (`TestDb::lose_commit`).
                    m if m.starts_with("session:") => {
                        let hold = holds.get(&m[8..]);
                        *hold.session.lock().unwrap() =
                            <$db as TestDb>::session_id(&mut **tx).await;
                        hold.entered.notify_one();
                        hold.release.notified().await;
                    }
                    // As `session:`, then a statement: the test has ended
                    // the session meanwhile (a failover, a cut), so the
                    // statement fails and the handler answers 500. With
                    // `raw-commit-then-`, it first commits its own
                    // transaction (misuse): its claim's row stays, without
                    // a response.
                    m if m.starts_with("session-then-write:")
                        || m.starts_with("raw-commit-then-session-then-write:") =>
                    {
                        let (mode, name) = m.split_once(':').unwrap();
                        if mode.starts_with("raw-commit-then-") {
                            sqlx::raw_sql("COMMIT").execute(&mut **tx).await?;
                        }
                        let hold = holds.get(name);
                        *hold.session.lock().unwrap() =
                            <$db as TestDb>::session_id(&mut **tx).await;
                        hold.entered.notify_one();
                        hold.release.notified().await;
                        sqlx::query(<$db as TestDb>::TOUCH_EFFECT)
                            .bind(id)
                            .persistent(app::persistent())
                            .execute(&mut **tx)
                            .await?;
                    }
                    // Reads its scope's effects (a predicate a concurrent
                    // writer of the scope conflicts with, under
                    // SERIALIZABLE), then is held as in `hold:`.
                    m if m.starts_with("read-then-hold:") => {
                        let _count: i64 = sqlx::query_scalar(<$db as TestDb>::COUNT_EFFECTS)
                            .bind(caller.0.as_bytes())
                            .persistent(app::persistent())
                            .fetch_one(&mut **tx)
                            .await?;
                        let hold = holds.get(&m[15..]);
                        hold.entered.notify_one();
                        hold.release.notified().await;
                    }
                    // A response whose body fails while it is read.
                    "failing-body" => {
                        let failing = futures::stream::once(async {
                            Err::<bytes::Bytes, _>(std::io::Error::other("the body failed"))
                        });
                        return Ok(
                            (StatusCode::CREATED, axum::body::Body::from_stream(failing))
                                .into_response(),
                        );
                    }
                    // A nested `begin()` cancelled in flight (as by a
                    // timeout around repository code), then the handler
                    // writes on. The `begin()` is held up behind a statement
                    // that waits for the test's lock on effect `<id>`, sent
                    // and abandoned first, so one poll surely leaves it in
                    // flight. Then the handler is held at `<name>` while the
                    // test lets its lock go. (599, never stored, if either
                    // came back within its one poll: nothing was cancelled.)
                    m if m.starts_with("cancelled-savepoint:") => {
                        use futures::FutureExt as _;
                        let (target, name) = m[20..].split_once(':').unwrap();
                        let blocked = sqlx::query(<$db as TestDb>::TOUCH_EFFECT)
                            .bind(target.parse::<i64>().unwrap())
                            .persistent(app::persistent())
                            .execute(&mut **tx)
                            .now_or_never()
                            .is_some();
                        let begun = sqlx::Connection::begin(&mut **tx).now_or_never().is_some();
                        if blocked || begun {
                            return Ok(StatusCode::from_u16(599).unwrap().into_response());
                        }
                        let hold = holds.get(name);
                        hold.entered.notify_one();
                        hold.release.notified().await;
                        insert_effect(&mut **tx, caller, &key, "after", &app::nonce()).await?;
                    }
                    // Held, then a transient failure: rolled back.
                    m if m.starts_with("hold-then-503:") => {
                        let hold = holds.get(&m[14..]);
                        hold.entered.notify_one();
                        hold.release.notified().await;
                        return Err(HandlerError::Refused(StatusCode::SERVICE_UNAVAILABLE));
                    }
                    // A deliberate pause inside the transaction: it widens
                    // the window in which the chaos harness kills or cuts a
                    // request mid-flight.
                    m if m.starts_with("delay:") => {
                        let ms: u64 = m[6..].parse().unwrap_or(0);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    m if m.starts_with("touch:") => {
                        let target: i64 = m[6..].parse().unwrap();
                        sqlx::query(<$db as TestDb>::TOUCH_EFFECT)
                            .bind(target)
                            .persistent(app::persistent())
                            .execute(&mut **tx)
                            .await?;
                    }
                    // A nested sqlx transaction, as repository code opens
                    // one: it must be a savepoint of the request's.
                    m if m.starts_with("savepoint:") => {
                        let mut nested = sqlx::Connection::begin(&mut **tx).await?;
                        insert_effect(&mut nested, caller, &key, "nested", &app::nonce()).await?;
                        match &m[10..] {
                            "rollback" => nested.rollback().await?,
                            "drop" => drop(nested),
                            _ => nested.commit().await?,
                        }
                        if m.ends_with(":503") {
                            return Ok(
                                (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response()
                            );
                        }
                    }
                    // A handler that catches the error of a statement that
                    // ended its transaction, and answers 201 anyway.
                    "end-by-error" => {
                        let _swallowed = <$db as TestDb>::end_by_error(&mut **tx, id).await;
                    }
                    // A handler that catches a failed statement's error,
                    // then opens a savepoint and writes on. On PostgreSQL
                    // the savepoint fails in the failed transaction, and
                    // sqlx 0.9 then rolls back the whole transaction, claim
                    // included: the write after it would commit on its own.
                    "savepoint-after-error" => {
                        let _caught = sqlx::query("SELECT * FROM idem_no_such_table")
                            .persistent(app::persistent())
                            .execute(&mut **tx)
                            .await;
                        let _ignored = sqlx::Connection::begin(&mut **tx).await.map(drop);
                        insert_effect(&mut **tx, caller, &key, "after", &app::nonce()).await?;
                    }
                    // The same through one borrow of the connection, as
                    // repository code taking `&mut PgConnection` does: no
                    // later use of the `Tx` to stop it at.
                    "savepoint-after-error-held" => {
                        let conn: &mut <$db as sqlx::Database>::Connection = &mut **tx;
                        let _caught = sqlx::query("SELECT * FROM idem_no_such_table")
                            .persistent(app::persistent())
                            .execute(&mut *conn)
                            .await;
                        let _ignored = sqlx::Connection::begin(&mut *conn).await.map(drop);
                        insert_effect(conn, caller, &key, "after", &app::nonce()).await?;
                    }
                    // Misuse: the handler commits the transaction itself,
                    // then writes on (that write commits on its own).
                    "raw-commit" => {
                        sqlx::raw_sql("COMMIT").execute(&mut **tx).await?;
                        insert_effect(&mut **tx, caller, &key, "after", &app::nonce()).await?;
                    }
                    // Misuse: the handler commits the transaction itself,
                    // then fails (as after a MySQL statement that commits
                    // implicitly, such as `CREATE TABLE`).
                    m if m.starts_with("raw-commit-then-error:") => {
                        sqlx::raw_sql("COMMIT").execute(&mut **tx).await?;
                        let status = StatusCode::from_u16(m[22..].parse().unwrap()).unwrap();
                        return Err(HandlerError::Refused(status));
                    }
                    // The same, then a panic, unwound without the panic
                    // hook: its backtrace (with `RUST_BACKTRACE` set) can
                    // take longer than the 1 s ttl of the route testing it.
                    "raw-commit-then-panic" => {
                        sqlx::raw_sql("COMMIT").execute(&mut **tx).await?;
                        std::panic::resume_unwind(Box::new("handler panicked after committing"));
                    }
                    // The same, then an `Ok` with a transient status.
                    m if m.starts_with("raw-commit-then-status:") => {
                        sqlx::raw_sql("COMMIT").execute(&mut **tx).await?;
                        let status = StatusCode::from_u16(m[23..].parse().unwrap()).unwrap();
                        return Ok((status, "failed after committing").into_response());
                    }
                    // Misuse: the handler ends the transaction itself,
                    // then writes on (that write commits on its own).
                    "raw-rollback" => {
                        sqlx::raw_sql("ROLLBACK").execute(&mut **tx).await?;
                        insert_effect(&mut **tx, caller, &key, "after", &app::nonce()).await?;
                    }
                    m if m.starts_with("error:") => {
                        let status = StatusCode::from_u16(m[6..].parse().unwrap()).unwrap();
                        return Err(HandlerError::Refused(status));
                    }
                    m if m.starts_with("status:") => {
                        let status = StatusCode::from_u16(m[7..].parse().unwrap()).unwrap();
                        return Ok((status, Json(Effect { id, note, nonce })).into_response());
                    }
                    _ => {}
                }
                Ok((
                    StatusCode::CREATED,
                    [
                        (header::LOCATION, format!("/effects/{id}")),
                        (header::ETAG, format!("\"{nonce}\"")),
                    ],
                    Json(Effect { id, note, nonce }),
                )
                    .into_response())
            }

            $crate::handler!($db, create, scope = "caller");
            $crate::handler!($db, create_waiting, scope = "caller", wait = "10s");
            $crate::handler!($db, create_brief, scope = "caller", wait = "300ms");
            $crate::handler!($db, create_short, scope = "caller", ttl = "1s");
            $crate::handler!($db, create_slow, scope = "caller", ttl = "2s");
            $crate::handler!(
                $db,
                create_tombstoned,
                scope = "caller",
                ttl = "1s",
                tombstone = "6s"
            );
            $crate::handler!($db, create_optional, scope = "caller", key = "optional");
            $crate::handler!($db, create_deadline, scope = "caller", timeout = "500ms");
            $crate::handler!($db, create_bounded, scope = "caller", timeout = "2s");
            $crate::handler!(
                $db,
                create_excluding,
                scope = "caller",
                fingerprint(exclude = ["/client_ts", "/trace/id"])
            );

            pub fn router(state: app::AppState<$db>) -> axum::Router {
                use axum::routing::post;
                axum::Router::new()
                    .route("/effects", post(create).put(create))
                    .route("/other", post(create))
                    .route("/effects/wait", post(create_waiting))
                    .route("/effects/brief", post(create_brief))
                    .route("/effects/short", post(create_short))
                    .route("/effects/slow", post(create_slow))
                    .route("/effects/tombstoned", post(create_tombstoned))
                    .route("/effects/optional", post(create_optional))
                    .route("/effects/deadline", post(create_deadline))
                    .route("/effects/bounded", post(create_bounded))
                    .route(
                        "/effects/excluding",
                        post(create_excluding).put(create_excluding),
                    )
                    .route("/other/excluding", post(create_excluding))
                    .layer(axum::extract::DefaultBodyLimit::max(app::BODY_LIMIT))
                    .with_state(state)
            }
        }
    };
}

/// One annotated handler of `define_app!`: the attribute's arguments vary,
/// the body is `effect`'s.
#[macro_export]
macro_rules! handler {
    ($db:ty, $name:ident, $($arg:tt)*) => {
        #[idempotent($($arg)*)]
        pub async fn $name(
            caller: Caller,
            headers: HeaderMap,
            State(holds): State<Holds>,
            mut tx: Tx<$db>,
            Json(req): Json<EffectRequest>,
        ) -> app::HandlerResult {
            let answer = effect(&caller, &headers, &holds, &mut tx, req.note).await;
            // Misuse: the handler keeps its `Tx` past its end.
            if let Some(name) = app::mode(&headers).strip_prefix("keep-tx:") {
                *holds.get(name).kept.lock().unwrap() = Some(Box::new(tx));
            }
            answer
        }
    };
}

/// Returns once the server no longer lists session `id` (within 10 s).
pub async fn until_session_ends<DB: TestDb>(admin: &sqlx::Pool<DB>, id: i64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while DB::session_open(admin, id).await {
        assert!(
            std::time::Instant::now() < deadline,
            "session {id} did not end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
