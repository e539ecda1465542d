//! Starting the service on loopback, in this process or in a child process
//! that a test can SIGKILL, and talking to it over real HTTP.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};
use tokio::task::JoinHandle;

pub use crate::app::{Answer, send, unique};
use crate::app::{AppState, Hold, Holds, TestDb, percent_encode};

/// The stored-response cap of the test service (the `big` mode exceeds it).
pub const RESPONSE_CAP: usize = 32 * 1024;

/// Tests of one engine that run at once, however many threads libtest
/// uses: each starts at most two pools of `engines::*::SERVER_POOL` (10)
/// connections (two instances, or a killed child and its successor), so
/// a server engine sees at most 80 from this binary, within PostgreSQL's
/// default `max_connections` of 100 on a machine of any size.
const TESTS_AT_ONCE: usize = 4;

/// A place among the [`TESTS_AT_ONCE`] tests of `DB`'s engine; held for
/// the whole test.
pub async fn slot<DB: TestDb>() -> tokio::sync::SemaphorePermit<'static> {
    use tokio::sync::Semaphore;
    static SLOTS: [Semaphore; 3] = [
        Semaphore::const_new(TESTS_AT_ONCE),
        Semaphore::const_new(TESTS_AT_ONCE),
        Semaphore::const_new(TESTS_AT_ONCE),
    ];
    let engine = match DB::ENGINE {
        "postgres" => 0,
        "mysql" => 1,
        _ => 2,
    };
    SLOTS[engine].acquire().await.unwrap()
}

/// A server on 127.0.0.1, stopped when dropped.
pub struct Server<DB: TestDb> {
    pub addr: SocketAddr,
    pub state: AppState<DB>,
    task: tokio::task::JoinHandle<()>,
}

impl<DB: TestDb> Drop for Server<DB> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn start<DB: TestDb>() -> Server<DB> {
    start_with(DB::connect().await).await
}

pub async fn start_with<DB: TestDb>(pool: sqlx::Pool<DB>) -> Server<DB> {
    start_configured(pool, |idem| idem).await
}

/// As [`start_with`], the store configured further by `configure`.
pub async fn start_configured<DB: TestDb>(
    pool: sqlx::Pool<DB>,
    configure: impl FnOnce(idem::Idem<DB>) -> idem::Idem<DB>,
) -> Server<DB> {
    let state = AppState {
        idem: configure(
            idem::Idem::new(pool)
                .max_response_bytes(RESPONSE_CAP)
                .pooler(idem_tests::service::pooler()),
        ),
        holds: Holds::default(),
    };
    let (addr, task) = idem_tests::service::serve(state.clone()).await;
    Server { addr, state, task }
}

impl<DB: TestDb> Server<DB> {
    pub fn client(&self, caller: &str) -> Client {
        Client::new(self.addr, caller)
    }

    /// Sends `request` in `hold:<name>` mode and returns once its handler
    /// has written its effect and parked, with the hold that releases it
    /// and the answer to come.
    pub async fn send_held(
        &self,
        request: reqwest::RequestBuilder,
        name: &str,
    ) -> (Arc<Hold>, JoinHandle<Answer>) {
        let hold = self.state.holds.get(name);
        let answer = tokio::spawn(send(request.header("x-test-mode", format!("hold:{name}"))));
        hold.entered().await;
        (hold, answer)
    }

    /// Effects recorded for a caller.
    pub async fn effects(&self, caller: &str) -> i64 {
        DB::count_effects(self.state.idem.pool(), caller).await
    }

    /// Idempotency rows stored for a caller.
    pub async fn keys(&self, caller: &str) -> i64 {
        DB::count_keys(self.state.idem.pool(), caller).await
    }

    /// Every connection of the service's pool, checked out once all have
    /// come back (sqlx hands one back after the response is out), for a
    /// test to look at the state each was returned in.
    pub async fn pooled_connections(&self) -> Vec<sqlx::pool::PoolConnection<DB>> {
        let pool = self.state.idem.pool();
        until_idle(pool).await;
        let mut connections = Vec::new();
        for _ in 0..pool.size() {
            connections.push(pool.acquire().await.unwrap());
        }
        connections
    }
}

/// Returns once every connection of `pool` is back in it (sqlx hands one
/// back in a task of its own, after its user has let go), within 10 s.
pub async fn until_idle<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pool.num_idle() < pool.size() as usize {
        assert!(
            std::time::Instant::now() < deadline,
            "a connection never came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// An HTTP client acting for one caller.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    caller: String,
}

impl Client {
    pub fn new(addr: SocketAddr, caller: &str) -> Self {
        Self {
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .unwrap(),
            base: format!("http://{addr}"),
            caller: caller.to_owned(),
        }
    }

    /// A request for this caller; add the key and body yourself.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .header("x-caller", percent_encode(self.caller.as_bytes()))
    }

    /// `POST path` with a JSON body and a key.
    pub fn post(&self, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::POST, path)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
    }

    /// `POST path` with `BODY` and a key, the handler in `mode` (see
    /// `x-test-mode` in the app).
    pub fn post_in_mode(&self, path: &str, key: &str, mode: &str) -> reqwest::RequestBuilder {
        self.post(path, key, crate::suite::BODY)
            .header("x-test-mode", mode.to_owned())
    }
}

/// The service in a child process: the test binary re-run in server mode.
pub struct ChildServer {
    pub addr: SocketAddr,
    pub child: Child,
    pub stdout: Lines<BufReader<ChildStdout>>,
}

/// Env var that turns the `child_server` test into a server.
pub const CHILD_ENGINE: &str = "IDEM_TEST_CHILD_ENGINE";

impl ChildServer {
    pub async fn spawn(engine: &str) -> Self {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "child_server",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENGINE, engine)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = stdout
                .next_line()
                .await
                .unwrap()
                .expect("child server exited before listening");
            // libtest may print "test child_server ... " on the same line.
            if let Some((_, addr)) = line.split_once("LISTENING ") {
                break addr.trim().parse().unwrap();
            }
        };
        Self {
            addr,
            child,
            stdout,
        }
    }

    /// Waits for a line the server prints.
    pub async fn expect_line(&mut self, wanted: &str) {
        loop {
            let line = self
                .stdout
                .next_line()
                .await
                .unwrap()
                .expect("child server exited");
            if line.ends_with(wanted) {
                return;
            }
        }
    }
}

/// Runs the service for a parent test until it is killed.
pub async fn serve_as_child<DB: TestDb>() {
    let server = start::<DB>().await;
    println!("LISTENING {}", server.addr);
    std::future::pending::<()>().await;
}
