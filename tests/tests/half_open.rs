//! A connection that dies on the service's side only (a NAT or load
//! balancer dropping its state) leaves the database session open, idle in
//! its transaction and holding the key's row. The claim bounds such a
//! session by the handler's deadline plus a margin, so the key answers
//! again within that bound, and the effect happens once.
//!
//! Written once, run on PostgreSQL and MariaDB (SQLite has no connection
//! to lose).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use idem::Idem;
use idem_tests::half_open::{Cut, HalfOpenProxy};
use idem_tests::service::{Answer, AppState, Holds, TestDb, send, unique};
use reqwest::StatusCode;
use sqlx::Pool;

/// The `/effects/bounded` handler's `timeout`, and the bound the claim
/// gives its orphaned sessions (`idem`'s margin: 2 s).
const DEADLINE: Duration = Duration::from_secs(2);
const ORPHAN_BOUND: Duration = Duration::from_secs(4);
/// What the test allows beyond the bound: MariaDB counts whole seconds and
/// checks idle sessions about once a second.
const SLACK: Duration = Duration::from_secs(3);
const BODY: &str = r#"{"note":"half-open"}"#;

/// An engine with a server a connection to can be lost.
trait Remote: TestDb {
    fn url() -> String;
    /// The URL's query for a plain-text connection through the proxy.
    const PLAIN: &'static str;
}

impl Remote for sqlx::Postgres {
    fn url() -> String {
        idem_tests::engines::postgres::url()
    }
    const PLAIN: &'static str = "sslmode=disable";
}

#[cfg(feature = "mysql")]
impl Remote for sqlx::MySql {
    fn url() -> String {
        idem_tests::engines::mysql::url()
    }
    const PLAIN: &'static str = "ssl-mode=disabled";
}

/// The service on 127.0.0.1, its pool through a half-open proxy.
struct Service<DB: Remote> {
    addr: SocketAddr,
    state: AppState<DB>,
    proxy: HalfOpenProxy,
    direct: Pool<DB>,
    http: reqwest::Client,
    scope: String,
    task: tokio::task::JoinHandle<()>,
}

impl<DB: Remote> Drop for Service<DB> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<DB: Remote> Service<DB> {
    async fn start(name: &str) -> Self {
        let direct = DB::connect().await;
        let mut url = reqwest::Url::parse(&DB::url()).unwrap();
        let upstream = tokio::net::lookup_host((
            url.host_str().unwrap().to_owned(),
            url.port().expect("the test URL names its port"),
        ))
        .await
        .unwrap()
        .next()
        .unwrap();
        let proxy = HalfOpenProxy::start(upstream).await;
        url.set_ip_host(proxy.addr().ip()).unwrap();
        url.set_port(Some(proxy.addr().port())).unwrap();
        url.set_query(Some(DB::PLAIN));
        let pool = sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(4)
            .connect(url.as_str())
            .await
            .unwrap_or_else(|error| panic!("{} through the proxy: {error}", DB::ENGINE));
        let state = AppState {
            idem: Idem::new(pool),
            holds: Holds::default(),
        };
        let (addr, task) = idem_tests::service::serve(state.clone()).await;
        Service {
            addr,
            state,
            proxy,
            direct,
            http: reqwest::Client::new(),
            scope: unique(name),
            task,
        }
    }

    fn post(&self, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("http://{}/effects/bounded", self.addr))
            .header("x-caller", &self.scope)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(BODY)
    }

    async fn effects(&self) -> i64 {
        DB::count_effects(&self.direct, &self.scope).await
    }

    /// Retries `key` as a client would until it is done, each answer in
    /// between a retryable one; returns the first success and how long
    /// after `since` it came.
    async fn retry_until_done(&self, key: &str, since: Instant) -> (Answer, Duration) {
        loop {
            let answer = send(self.post(key)).await;
            if answer.status == StatusCode::CREATED {
                return (answer, since.elapsed());
            }
            assert!(
                matches!(
                    answer.status,
                    StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
                ),
                "{}: a retry of a held key answered {answer:?}",
                DB::ENGINE
            );
            assert!(
                since.elapsed() < ORPHAN_BOUND + SLACK,
                "{}: the key was still held {:?} after the cut",
                DB::ENGINE,
                since.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The request ran once: one effect, and the key replays it.
    async fn assert_done_once(&self, key: &str, done: &Answer) {
        assert_eq!(self.effects().await, 1, "{}: effects", DB::ENGINE);
        let again = send(self.post(key)).await;
        assert!(again.replayed(), "{}: {again:?}", DB::ENGINE);
        assert_eq!(again.body, done.body);
    }

    /// Sends `key` with its handler parked after its write; returns once
    /// it is parked, with the request and the hold.
    async fn parked(
        &self,
        key: &str,
    ) -> (
        tokio::task::JoinHandle<Answer>,
        std::sync::Arc<idem_tests::service::Hold>,
    ) {
        let name = format!("{}-{key}", self.scope);
        let hold = self.state.holds.get(&name);
        let request = self.post(key).header("x-test-mode", format!("hold:{name}"));
        let request = tokio::spawn(send(request));
        hold.entered().await;
        (request, hold)
    }
}

/// The connection dies on the service's side while the handler runs, after
/// the claim and its write: now (`Cut::Now`), or as the service sends its
/// `COMMIT`, which never reaches the server (`Cut::BeforeCommit`). The
/// service answers 503; the session stays idle in its transaction holding
/// the key until the server ends it within the bound; the retry then runs
/// the request once (nothing of the first attempt committed).
async fn cut_while_held<DB: Remote>(cut: Cut) {
    let service = Service::<DB>::start("half-open").await;
    let (request, hold) = service.parked("k").await;
    service.proxy.arm(cut);
    let since = Instant::now();
    hold.release.notify_one();
    let failed = request.await.unwrap();
    assert_eq!(
        service.proxy.cuts(),
        1,
        "{}: one connection cut ({cut:?})",
        DB::ENGINE
    );
    service.proxy.arm(Cut::Off);
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE, "{failed:?}");
    assert!(failed.header("retry-after").is_some());
    let (done, after) = service.retry_until_done("k", since).await;
    assert!(after <= ORPHAN_BOUND + SLACK, "{after:?}");
    service.assert_done_once("k", &done).await;
}

/// The claim runs on the server but its answer is lost with the
/// connection: the request's own claim on a fresh connection finds the key
/// held by that orphan and says so at once, 503 with a `Retry-After`
/// covering the orphan's end, instead of waiting on it or promising a
/// replay; the key then works.
async fn lost_claim_answer<DB: Remote>() {
    let service = Service::<DB>::start("half-open-answer").await;
    // An idle pooled connection, which the claim takes untested.
    assert_eq!(send(service.post("warm")).await.status, StatusCode::CREATED);
    let pool = service.state.idem.pool();
    let parked = Instant::now();
    while pool.num_idle() == 0 {
        assert!(
            parked.elapsed() < DEADLINE,
            "the connection never came back"
        );
        tokio::task::yield_now().await;
    }
    service.proxy.arm(Cut::NextAnswer);
    let cut = Instant::now();
    let lost = send(service.post("k")).await;
    assert_eq!(
        service.proxy.cuts(),
        1,
        "{}: the claim's answer was cut",
        DB::ENGINE
    );
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE, "{lost:?}");
    assert_eq!(lost.problem_code(), "idempotency_store_unavailable");
    let retry_after: u64 = lost.header("retry-after").unwrap().parse().unwrap();
    assert!(
        Duration::from_secs(retry_after) >= ORPHAN_BOUND,
        "Retry-After {retry_after} s does not cover the orphan's end"
    );
    assert!(
        cut.elapsed() < DEADLINE,
        "{}: the replacement claim waited on the orphan ({:?})",
        DB::ENGINE,
        cut.elapsed()
    );
    let (done, after) = service.retry_until_done("k", cut).await;
    assert!(after <= ORPHAN_BOUND + SLACK, "{after:?}");
    assert_eq!(service.effects().await, 2, "{}: warm-up and k", DB::ENGINE);
    let again = send(service.post("k")).await;
    assert!(again.replayed());
    assert_eq!(again.body, done.body);
}

macro_rules! half_open {
    ($engine:ident, $db:ty) => {
        mod $engine {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cut_after_the_claim() {
                super::cut_while_held::<$db>(super::Cut::Now).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cut_before_commit() {
                super::cut_while_held::<$db>(super::Cut::BeforeCommit).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_claim_answer() {
                super::lost_claim_answer::<$db>().await;
            }
        }
    };
}

half_open!(postgres, sqlx::Postgres);
#[cfg(feature = "mysql")]
half_open!(mysql, sqlx::MySql);
