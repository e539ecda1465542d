//! The hardening tests' harness: the conformance suite's service on
//! PostgreSQL (`tests/conformance/app.rs` and its PostgreSQL engine,
//! included by path), HTTP clients that send hostile input, and direct
//! reads of what the store kept.

use std::net::SocketAddr;
use std::time::Duration;

use idem::Idem;
use sqlx::Postgres;
use sqlx::postgres::PgPool;

use crate::proxied::Proxied;
use crate::service::TestDb;

pub use crate::engines;
pub use crate::service as app;

pub use app::{
    Answer, AppState, BODY_LIMIT, EFFECTS, Effect, Holds, nonce, percent_encode, send, unique,
};
/// A pool of the given size on the real server, with the tables.
pub use engines::postgres::pool as connect;

/// Where PostgreSQL listens, for a proxy to forward to.
pub async fn upstream() -> SocketAddr {
    crate::proxied::upstream::<Postgres>().await
}

/// The test database's URL, through a proxy at `proxy` (plain TCP, so the
/// proxy can read the protocol).
pub fn url_via(proxy: SocketAddr) -> String {
    crate::proxied::url_via::<Postgres>(proxy)
}

/// The service on 127.0.0.1, stopped when dropped (on PostgreSQL unless
/// started on another engine's pool).
pub struct Server<DB: TestDb = Postgres> {
    pub addr: SocketAddr,
    pub state: AppState<DB>,
    task: tokio::task::JoinHandle<()>,
}

impl<DB: TestDb> Drop for Server<DB> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<DB: TestDb> Server<DB> {
    pub async fn start(idem: Idem<DB>) -> Server<DB> {
        let state = AppState {
            idem,
            holds: Holds::default(),
        };
        let (addr, task) = crate::service::serve(state.clone()).await;
        Server { addr, state, task }
    }

    pub fn client(&self, scope: &str) -> Client {
        Client::new(self.addr, scope)
    }

    pub fn pool(&self) -> &sqlx::Pool<DB> {
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
            .header("x-caller", percent_encode(self.scope.as_bytes()))
    }
}

/// The effects written for `(scope, key)`: `(id, nonce)`.
pub async fn effects(pool: &PgPool, scope: &str, key: &str) -> Vec<(i64, String)> {
    <Postgres as Proxied>::effects(pool, scope, key).await
}

/// Effects written for a scope, all keys.
pub async fn effects_in_scope(pool: &PgPool, scope: &str) -> i64 {
    Postgres::count_effects(pool, scope).await
}

/// What the store kept for `(scope, key)` in the default table:
/// `(status, body)`, `status` `None` while a claim is open.
pub async fn stored(pool: &PgPool, scope: &str, key: &str) -> Option<(Option<i16>, Vec<u8>)> {
    <Postgres as Proxied>::stored(pool, scope, key).await
}

/// Rows stored for a scope in the default table.
pub async fn keys_in_scope(pool: &PgPool, scope: &str) -> i64 {
    Postgres::count_keys(pool, scope).await
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

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo).max(1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
}
