//! `idem` beside the peer a Rust team would otherwise pick: the
//! `idempotent` crate 0.3 on Redis behind `idem_tests::peer`'s middleware,
//! around the same charge handler, over real HTTP on loopback, on
//! PostgreSQL. Three checks: duplicates at once, a kill between the
//! handler's commit and its response, and a retry with a changed body.
//! Each asserts idem's behaviour and the peer's observed one (so the gap
//! between them is a tested claim: if the peer changes, a test fails) and
//! prints both. PostgreSQL and Redis are required; each test has its own
//! tables and Redis key prefix. The kill check serves from a child process
//! (this test binary, run as `peer_child_server`) that aborts once the
//! handler has committed.

#![cfg(feature = "postgres")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRef, Request, State};
use axum::http::StatusCode;
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{Idem, Tx, idempotent};
use idem_tests::account::Account;
use idem_tests::peer::{self, Leases, Peer};
use idem_tests::service::{Answer, server_pool};
use idem_tests::unique::unique;
use serde::Deserialize;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};

const POSTGRES_VAR: &str = "IDEM_TEST_POSTGRES_URL";
const REDIS_VAR: &str = "IDEM_TEST_REDIS_URL";
const CHARGE: &str = r#"{"amount": 1250, "currency": "eur"}"#;
/// A request with this header aborts the server once its handler has
/// answered: after the commit, before the peer stores the response and
/// before the client hears of it.
const DIE_AFTER_COMMIT: &str = "x-die-after-commit";
/// The child server's tables and key prefix.
const CHILD_KEYS: &str = "IDEM_PEER_CHILD_KEYS";
const CHILD_CHARGES: &str = "IDEM_PEER_CHILD_CHARGES";
const CHILD_PREFIX: &str = "IDEM_PEER_CHILD_PREFIX";
/// The peer's leases here: a short claim, so the kill check sees it lapse,
/// yet longer than the kill check's restart and first retries take on a
/// loaded machine (the retry must still meet the claim).
const LEASES: Leases = Leases {
    processing: Duration::from_secs(5),
    completed: Duration::from_secs(60),
};
/// The longest any wait here lasts.
const DEADLINE: Duration = Duration::from_secs(20);

/// The two services, one route each around the same charge.
#[derive(Clone, Copy, Debug)]
enum System {
    Idem,
    Peer,
}

impl System {
    fn path(self) -> &'static str {
        match self {
            Self::Idem => "/idem/charges",
            Self::Peer => "/peer/charges",
        }
    }

    /// Each system charges its own account, so their charges count apart.
    fn account(self) -> &'static str {
        match self {
            Self::Idem => "acct-idem",
            Self::Peer => "acct-peer",
        }
    }
}

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<Postgres>,
    pool: PgPool,
    charges: Charges,
}

/// The charges table of this test.
#[derive(Clone)]
struct Charges(Arc<str>);

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

/// A failed statement: 500.
struct Failed(sqlx::Error);

impl From<sqlx::Error> for Failed {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0.to_string()).into_response()
    }
}

/// The side effect both systems protect: one charge row.
async fn charge(
    conn: &mut PgConnection,
    Charges(table): &Charges,
    account: &str,
    new: &NewCharge,
) -> Result<Response, Failed> {
    let sql =
        format!("INSERT INTO {table} (account, amount, currency) VALUES ($1, $2, $3) RETURNING id");
    let id: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(account)
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(conn)
        .await?;
    let body =
        json!({ "id": id, "account": account, "amount": new.amount, "currency": new.currency });
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// idem: the charge in the request's transaction, with its response.
#[idempotent(scope = "account")]
async fn idem_charge(
    account: Account,
    State(charges): State<Charges>,
    mut tx: Tx<Postgres>,
    Json(new): Json<NewCharge>,
) -> Result<Response, Failed> {
    charge(&mut tx, &charges, &account.0, &new).await
}

/// The peer: the charge in a plain transaction; the middleware around it.
async fn peer_charge(
    account: Account,
    State(pool): State<PgPool>,
    State(charges): State<Charges>,
    Json(new): Json<NewCharge>,
) -> Result<Response, Failed> {
    let mut tx = pool.begin().await?;
    let response = charge(&mut tx, &charges, &account.0, &new).await?;
    tx.commit().await?;
    Ok(response)
}

/// Aborts the process once the handler has answered a request marked
/// [`DIE_AFTER_COMMIT`]; inside the peer's middleware, so its completion
/// never runs.
async fn die_after_commit(request: Request, next: Next) -> Response {
    let die = request.headers().contains_key(DIE_AFTER_COMMIT);
    let response = next.run(request).await;
    if die {
        std::process::abort();
    }
    response
}

fn router(state: AppState, peer: Peer) -> Router {
    let idem = post(idem_charge).layer(from_fn(die_after_commit));
    let peer = post(peer_charge)
        .layer(from_fn(die_after_commit))
        .layer(from_fn_with_state(peer, peer::middleware));
    Router::new()
        .route(System::Idem.path(), idem)
        .route(System::Peer.path(), peer)
        .with_state(state)
}

/// One test's world: its key table, charges table and Redis key prefix.
struct Fixture {
    pool: PgPool,
    keys: String,
    charges: String,
    prefix: String,
    /// The peer's store, connected before any table is made.
    peer: Peer,
    http: reqwest::Client,
}

impl Fixture {
    async fn new() -> Self {
        let prefix = unique("idem-test-peer");
        let fixture = Self {
            peer: peer(&prefix).await,
            pool: postgres(10).await,
            keys: unique("peer_keys"),
            charges: unique("peer_charges"),
            prefix,
            http: reqwest::Client::new(),
        };
        let idem = Idem::new(fixture.pool.clone())
            .table(&fixture.keys)
            .unwrap();
        idem.migrate().await.expect("migrate");
        let sql = format!(
            "CREATE TABLE {} (id bigserial PRIMARY KEY, account text NOT NULL, \
             amount bigint NOT NULL, currency text NOT NULL)",
            fixture.charges
        );
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&fixture.pool)
            .await
            .unwrap();
        fixture
    }

    /// Both services on `pool`, served in this process.
    async fn serve(&self) -> SocketAddr {
        let app = app(
            self.pool.clone(),
            &self.keys,
            &self.charges,
            self.peer.clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    }

    fn request(
        &self,
        addr: SocketAddr,
        system: System,
        key: &str,
        body: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .post(format!("http://{addr}{}", system.path()))
            .header("content-type", "application/json")
            .header("x-account", system.account())
            .header("idempotency-key", key)
            .body(body.to_owned())
    }

    async fn send(&self, addr: SocketAddr, system: System, key: &str, body: &str) -> Answer {
        let response = self.request(addr, system, key, body).send().await;
        Answer::of(response.expect("an answer"))
            .await
            .expect("a body")
    }

    /// The charges `system` has written.
    async fn charges(&self, system: System) -> i64 {
        let sql = format!("SELECT count(*) FROM {} WHERE account = $1", self.charges);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(system.account())
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Drops the tables; the peer's Redis keys expire with their leases.
    async fn finish(self) {
        let sql = format!("DROP TABLE {}; DROP TABLE {}", self.keys, self.charges);
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

/// A pool on the test server; fails loudly when PostgreSQL is missing.
async fn postgres(size: u32) -> PgPool {
    let url = idem_tests::engines::postgres::url();
    server_pool(
        PgPoolOptions::new().max_connections(size),
        "PostgreSQL",
        POSTGRES_VAR,
        &url,
    )
    .await
}

/// The peer's store, its keys under `prefix`; fails loudly when Redis is
/// missing.
async fn peer(prefix: &str) -> Peer {
    let url = idem_tests::service::env_or(REDIS_VAR, "redis://127.0.0.1:6379");
    Peer::connect(&url, prefix, LEASES)
        .await
        .unwrap_or_else(|error| panic!("Redis is required at {url} (set {REDIS_VAR}): {error:?}"))
        .scoped(peer::account)
}

/// The router over `pool`, `keys` and `charges`, and `peer`.
fn app(pool: PgPool, keys: &str, charges: &str, peer: Peer) -> Router {
    let state = AppState {
        idem: Idem::new(pool.clone()).table(keys).unwrap(),
        pool,
        charges: Charges(charges.into()),
    };
    router(state, peer)
}

/// An answer as the table shows it.
fn describe(answer: &Answer) -> String {
    let mut text = answer.status.as_str().to_owned();
    if answer.replayed() {
        text.push_str(" replay");
    }
    if let Some(code) = answer.header("idempotent-rejection") {
        text.push_str(&format!(" {code}"));
    }
    text
}

fn print_table(title: &str, rows: &[(&str, String, String)]) {
    println!(
        "\n{title}\n{:<32} | {:<34} | peer (idempotent 0.3)",
        "", "idem"
    );
    for (check, idem, peer) in rows {
        println!("{check:<32} | {idem:<34} | {peer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_charge_once_on_both() {
    let fixture = Fixture::new().await;
    let addr = fixture.serve().await;
    let mut cells = Vec::new();
    for system in [System::Idem, System::Peer] {
        let sends = (0..8).map(|_| fixture.send(addr, system, "dup", CHARGE));
        let answers = futures::future::join_all(sends).await;
        let mut seen: Vec<String> = answers.iter().map(describe).collect();
        seen.sort();
        let charges = fixture.charges(system).await;
        // Both: one first attempt, the others a replay or 409 in-flight.
        let first = answers.iter().filter(|a| a.status == 201 && !a.replayed());
        assert_eq!(first.count(), 1, "{system:?}: {seen:?}");
        assert!(
            answers.iter().all(|a| a.status == 201 || a.status == 409),
            "{system:?}: {seen:?}"
        );
        assert_eq!(charges, 1, "{system:?}: one charge");
        cells.push(format!("{}; charges {charges}", tally(&seen)));
    }
    let [idem, peer] = <[String; 2]>::try_from(cells).unwrap();
    print_table(
        "8 concurrent requests, one key and body",
        &[("answers; charges written", idem, peer)],
    );
    fixture.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_after_commit_replays_on_idem_and_charges_twice_on_the_peer() {
    let fixture = Fixture::new().await;
    // Each system's first attempt commits, then its server dies unanswered.
    kill_after_commit(&fixture, System::Idem).await;
    let claimed = kill_after_commit(&fixture, System::Peer).await;

    // The restarted server; the client retries with the same key and body.
    let child = Child::spawn(&fixture).await;
    let idem = fixture.send(child.addr, System::Idem, "kill", CHARGE).await;
    assert_eq!(idem.status, 201, "{idem:?}");
    assert!(
        idem.replayed(),
        "idem replays the committed charge: {idem:?}"
    );
    assert_eq!(fixture.charges(System::Idem).await, 1, "idem: one charge");

    // The peer holds the key until its claim's lease lapses, then runs the
    // handler again: the charge is written twice.
    let first = fixture.send(child.addr, System::Peer, "kill", CHARGE).await;
    assert_eq!(first.status, 409, "the peer holds the key: {first:?}");
    assert_eq!(first.header("idempotent-rejection"), Some("in-flight"));
    let mut held = 1;
    let last = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let answer = fixture.send(child.addr, System::Peer, "kill", CHARGE).await;
        if answer.status != 409 {
            break answer;
        }
        held += 1;
        assert!(
            claimed.elapsed() < DEADLINE,
            "the peer's claim never lapsed"
        );
    };
    let waited = claimed.elapsed();
    assert!(
        waited >= LEASES.processing,
        "held for its lease: {waited:?}"
    );
    assert_eq!(last.status, 201, "{last:?}");
    assert!(!last.replayed(), "a second run, not a replay: {last:?}");
    assert_eq!(
        fixture.charges(System::Peer).await,
        2,
        "the peer charged twice"
    );
    print_table(
        "killed after the handler's commit; restarted; retried with the same key and body",
        &[
            ("first retry", describe(&idem), describe(&first)),
            (
                "retries until the answer changes",
                "-".to_owned(),
                format!(
                    "{held} x 409 over {:.1} s, then {}",
                    waited.as_secs_f64(),
                    describe(&last)
                ),
            ),
            ("charges written", "1".to_owned(), "2".to_owned()),
        ],
    );
    fixture.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_body_replays_or_refuses_on_idem_and_refuses_on_the_peer() {
    let fixture = Fixture::new().await;
    let addr = fixture.serve().await;
    let spaced = "{\n  \"amount\" : 1250,\n  \"currency\" : \"eur\"\n}";
    let other = r#"{"amount": 9999, "currency": "eur"}"#;
    let mut answers = Vec::new();
    for system in [System::Idem, System::Peer] {
        let first = fixture.send(addr, system, "body", CHARGE).await;
        assert_eq!(first.status, 201, "{system:?}: {first:?}");
        let whitespace = fixture.send(addr, system, "body", spaced).await;
        let amount = fixture.send(addr, system, "body", other).await;
        assert_eq!(fixture.charges(system).await, 1, "{system:?}: one charge");
        answers.push((whitespace, amount));
    }
    let [(idem_spaced, idem_amount), (peer_spaced, peer_amount)] =
        <[(Answer, Answer); 2]>::try_from(answers).unwrap();
    // idem hashes a JSON body in its canonical form (RFC 8785).
    assert_eq!(idem_spaced.status, 201, "{idem_spaced:?}");
    assert!(idem_spaced.replayed(), "{idem_spaced:?}");
    assert_eq!(idem_amount.status, 422, "{idem_amount:?}");
    // The peer hashes the body's bytes: whitespace is another request.
    for answer in [&peer_spaced, &peer_amount] {
        assert_eq!(answer.status, 400, "{answer:?}");
        assert_eq!(
            answer.header("idempotent-rejection"),
            Some("fingerprint-mismatch")
        );
    }
    print_table(
        "the same key again, with a changed body",
        &[
            (
                "whitespace only",
                describe(&idem_spaced),
                describe(&peer_spaced),
            ),
            (
                "another amount",
                describe(&idem_amount),
                describe(&peer_amount),
            ),
            ("charges written", "1".to_owned(), "1".to_owned()),
        ],
    );
    fixture.finish().await;
}

/// Sends `system` a charge that its server, in a child process, commits
/// and then dies on; returns when the request was sent (before its claim).
async fn kill_after_commit(fixture: &Fixture, system: System) -> Instant {
    let mut child = Child::spawn(fixture).await;
    let sent = Instant::now();
    let lost = fixture
        .request(child.addr, system, "kill", CHARGE)
        .header(DIE_AFTER_COMMIT, "1")
        .send()
        .await;
    assert!(
        lost.is_err(),
        "{system:?}: the client hears nothing: {lost:?}"
    );
    let status = tokio::time::timeout(DEADLINE, child.process.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success(), "{system:?}: the server died: {status}");
    assert_eq!(fixture.charges(system).await, 1, "{system:?}: committed");
    sent
}

/// `["201", "201 replay", "201 replay"]` as `201 x1, 201 replay x2`.
fn tally(sorted: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for group in sorted.chunk_by(|a, b| a == b) {
        parts.push(format!("{} x{}", group[0], group.len()));
    }
    parts.join(", ")
}

/// The server in a child process.
struct Child {
    addr: SocketAddr,
    process: tokio::process::Child,
}

impl Child {
    async fn spawn(fixture: &Fixture) -> Self {
        let env = [
            (CHILD_KEYS, Some(fixture.keys.as_str())),
            (CHILD_CHARGES, Some(fixture.charges.as_str())),
            (CHILD_PREFIX, Some(fixture.prefix.as_str())),
        ];
        let (process, addr) = idem_tests::examples::test_server("peer_child_server", &env).await;
        Self { addr, process }
    }
}

/// Not a test: the server the kill check starts in a child process. Run
/// without its parent's environment, it fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the kill check as a child process"]
async fn peer_child_server() {
    use std::io::Write as _;
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let peer = peer(&var(CHILD_PREFIX)).await;
    let app = app(
        postgres(4).await,
        &var(CHILD_KEYS),
        &var(CHILD_CHARGES),
        peer,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("LISTENING {}", listener.local_addr().unwrap());
    let _ = std::io::stdout().flush();
    axum::serve(listener, app).await.unwrap();
}
