//! The service the hardening tests beat on, and their helpers: one
//! idempotent handler with knobs, an effects table keyed by raw scope bytes,
//! and direct reads of what the store kept.
//!
//! The scope travels percent-encoded in `x-scope`, so tests can use scopes
//! with separators, unicode and NUL, none of which a header carries as is.

// Each test binary uses a part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::{HeaderMap, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idem::{Idem, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Postgres, Row};
use tokio::sync::{Notify, OnceCell};

/// The effects table: `scope` is bytea because a scope may hold NUL, which
/// PostgreSQL `text` refuses.
pub const EFFECTS: &str = "idem_hardening_effects";

pub fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Where PostgreSQL listens, for a proxy to forward to.
pub async fn upstream() -> SocketAddr {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(&pg_url()).unwrap();
    tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .unwrap()
        .next()
        .expect("the PostgreSQL host resolves")
}

/// The test database's URL, through a proxy at `proxy` (plain TCP, so the
/// proxy can read the protocol).
pub fn url_via(proxy: SocketAddr) -> String {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(&pg_url()).unwrap();
    format!(
        "postgres://{}@{proxy}/{}?sslmode=disable",
        options.get_username(),
        options.get_database().unwrap_or("test")
    )
}

/// A pool on the real server; panics loudly when PostgreSQL is missing.
pub async fn connect(max_connections: u32) -> PgPool {
    let url = pg_url();
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(&url)
        .await
        .unwrap_or_else(|error| {
            panic!("PostgreSQL is required at {url} (set IDEM_TEST_POSTGRES_URL): {error}")
        });
    ensure_schema(&pool).await;
    pool
}

static SCHEMA: OnceCell<()> = OnceCell::const_new();

/// Creates the key table and the effects table once per process. Other test
/// binaries may race us in the catalog; the loser retries and finds them.
/// When both exist nothing runs: DDL would queue for locks behind other
/// tests' open transactions.
pub async fn ensure_schema(pool: &PgPool) {
    SCHEMA
        .get_or_init(|| async {
            let ready: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT to_regclass('idem_keys_expires_at_idx') IS NOT NULL \
                 AND to_regclass('{EFFECTS}_scope_key') IS NOT NULL"
            )))
            .fetch_one(pool)
            .await
            .expect("query the catalog");
            if ready {
                return;
            }
            Idem::new(pool.clone()).migrate().await.expect("migrate");
            let ddl = format!(
                "CREATE TABLE IF NOT EXISTS {EFFECTS} (
                    id bigserial PRIMARY KEY, scope bytea NOT NULL, key text NOT NULL,
                    note text NOT NULL, nonce text NOT NULL);
                 CREATE INDEX IF NOT EXISTS {EFFECTS}_scope_key ON {EFFECTS} (scope, key);"
            );
            for attempt in 0.. {
                match sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone()))
                    .execute(pool)
                    .await
                {
                    Ok(_) => break,
                    Err(sqlx::Error::Database(db))
                        if attempt < 5
                            && matches!(db.code().as_deref(), Some("23505" | "42P07")) =>
                    {
                        continue;
                    }
                    Err(error) => panic!("create {EFFECTS}: {error}"),
                }
            }
        })
        .await;
}

#[derive(Clone, FromRef)]
pub struct AppState {
    pub idem: Idem<Postgres>,
    pub holds: Holds,
}

/// Handlers in `hold:<name>` mode park after their write until the test
/// releases them: the test drives the timing.
#[derive(Clone, Default)]
pub struct Holds(Arc<Mutex<HashMap<String, Arc<Hold>>>>);

#[derive(Default)]
pub struct Hold {
    pub entered: Notify,
    pub release: Notify,
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

/// The caller, percent-decoded from `x-scope`; 401 without it.
pub struct Tenant(pub String);

impl idem::Scope for Tenant {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let raw = parts
            .headers
            .get("x-scope")
            .ok_or((StatusCode::UNAUTHORIZED, "send x-scope\n"))?;
        percent_decode(raw.as_bytes()).map(Tenant).ok_or((
            StatusCode::UNAUTHORIZED,
            "x-scope is not percent-encoded UTF-8\n",
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

pub struct HandlerError(sqlx::Error);

impl IntoResponse for HandlerError {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, format!("{}\n", self.0)).into_response()
    }
}

async fn effect(
    tenant: &Tenant,
    headers: &HeaderMap,
    holds: &Holds,
    tx: &mut Tx<Postgres>,
    note: String,
) -> Result<Response, HandlerError> {
    let nonce = nonce();
    let key = tx.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
    let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {EFFECTS} (scope, key, note, nonce) VALUES ($1, $2, $3, $4) RETURNING id"
    )))
    .bind(tenant.0.as_bytes())
    .bind(&key)
    .bind(&note)
    .bind(&nonce)
    .fetch_one(&mut **tx)
    .await
    .map_err(HandlerError)?;
    let mode = headers
        .get("x-test-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    match mode {
        "panic" => panic!("handler panicked on purpose"),
        "announce" => {
            println!("EFFECT_WRITTEN {key}");
            std::future::pending::<()>().await;
        }
        m if m.starts_with("hold:") => {
            let hold = holds.get(&m[5..]);
            hold.entered.notify_one();
            hold.release.notified().await;
        }
        // A deliberate pause inside the transaction: it widens the window
        // in which the chaos harness kills or cuts a request mid-flight.
        m if m.starts_with("delay:") => {
            let ms: u64 = m[6..].parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        m if m.starts_with("status:") => {
            let status = StatusCode::from_u16(m[7..].parse().unwrap()).unwrap();
            return Ok((status, Json(Effect { id, note, nonce })).into_response());
        }
        _ => {}
    }
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/effects/{id}"))],
        Json(Effect { id, note, nonce }),
    )
        .into_response())
}

#[idempotent(scope = "tenant")]
pub async fn create(
    tenant: Tenant,
    headers: HeaderMap,
    State(holds): State<Holds>,
    mut tx: Tx<Postgres>,
    Json(req): Json<EffectRequest>,
) -> Result<Response, HandlerError> {
    effect(&tenant, &headers, &holds, &mut tx, req.note).await
}

#[idempotent(scope = "tenant", key = "optional")]
pub async fn create_optional(
    tenant: Tenant,
    headers: HeaderMap,
    State(holds): State<Holds>,
    mut tx: Tx<Postgres>,
    Json(req): Json<EffectRequest>,
) -> Result<Response, HandlerError> {
    effect(&tenant, &headers, &holds, &mut tx, req.note).await
}

/// The largest request body the service takes.
pub const BODY_LIMIT: usize = 64 * 1024;

pub fn router(state: AppState) -> axum::Router {
    use axum::routing::post;
    axum::Router::new()
        .route("/effects", post(create))
        .route("/effects/optional", post(create_optional))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

/// The service on 127.0.0.1, stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    pub state: AppState,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    pub async fn start(idem: Idem<Postgres>) -> Server {
        let state = AppState {
            idem,
            holds: Holds::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Server { addr, state, task }
    }

    pub fn client(&self, scope: &str) -> Client {
        Client::new(self.addr, scope)
    }

    pub fn pool(&self) -> &PgPool {
        self.state.idem.pool()
    }
}

/// No test request waits longer than this, whatever the server does.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// An HTTP client acting for one scope.
#[derive(Clone)]
pub struct Client {
    pub http: reqwest::Client,
    pub base: String,
    pub scope: String,
}

impl Client {
    pub fn new(addr: SocketAddr, scope: &str) -> Client {
        Client::with(
            reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .timeout(REQUEST_TIMEOUT)
                .build()
                .unwrap(),
            addr,
            scope,
        )
    }

    pub fn with(http: reqwest::Client, addr: SocketAddr, scope: &str) -> Client {
        Client {
            http,
            base: format!("http://{addr}"),
            scope: scope.to_owned(),
        }
    }

    /// `POST /effects` with a JSON body and a key.
    pub fn post(&self, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.post_to("/effects", key, body)
    }

    pub fn post_to(&self, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.bare(path)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(body.to_owned())
    }

    /// `POST path` with the scope and nothing else (reqwest's `header`
    /// appends, so a test that wants an odd header value starts here).
    pub fn bare(&self, path: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.base))
            .header("x-scope", percent_encode(self.scope.as_bytes()))
    }
}

/// A response read whole.
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

    pub fn effect(&self) -> Effect {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not an effect: {} {:?}", self.status, self.body))
    }

    /// The `code` member of a problem+json body.
    pub fn problem_code(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        json["code"].as_str().unwrap().to_owned()
    }
}

pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    Answer::of(request.send().await.expect("request failed"))
        .await
        .expect("body failed")
}

/// The effects written for `(scope, key)`: `(id, nonce)`.
pub async fn effects(pool: &PgPool, scope: &str, key: &str) -> Vec<(i64, String)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, nonce FROM {EFFECTS} WHERE scope = $1 AND key = $2 ORDER BY id"
    )))
    .bind(scope.as_bytes())
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Effects written for a scope, all keys.
pub async fn effects_in_scope(pool: &PgPool, scope: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {EFFECTS} WHERE scope = $1"
    )))
    .bind(scope.as_bytes())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// What the store kept for `(scope, key)` in the default table:
/// `(status, body)`, `status` `None` while a claim is open.
pub async fn stored(pool: &PgPool, scope: &str, key: &str) -> Option<(Option<i16>, Vec<u8>)> {
    sqlx::query("SELECT status, body FROM idem_keys WHERE scope = $1 AND key = $2")
        .bind(scope.as_bytes())
        .bind(key.as_bytes())
        .fetch_optional(pool)
        .await
        .unwrap()
        .map(|row| {
            (
                row.get::<Option<i16>, _>("status"),
                row.get::<Option<Vec<u8>>, _>("body").unwrap_or_default(),
            )
        })
}

/// Rows stored for a scope in the default table.
pub async fn keys_in_scope(pool: &PgPool, scope: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE scope = $1")
        .bind(scope.as_bytes())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A name no other test, nor an earlier run, uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", nonce())
}

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

/// A small deterministic generator (xorshift64*), seeded and printed by
/// each randomised test so a failing run can be replayed.
pub struct Rng(u64);

impl Rng {
    /// Seeded from `IDEM_SEED` if set, else from the clock.
    pub fn from_env(name: &str) -> Rng {
        let seed = std::env::var("IDEM_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        // Past libtest's capture, so every log shows how to replay it.
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{name}: IDEM_SEED={seed}");
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo).max(1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}
