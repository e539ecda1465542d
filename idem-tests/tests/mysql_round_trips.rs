#![cfg(feature = "mysql")]
//! What the wrapper costs on the wire on MySQL/MariaDB: database round trips
//! of one request, counted exactly through a proxy, for the same handler
//! with and without `#[idempotent]` (`round_trips.rs` does the same on
//! PostgreSQL). A regression here is paid on every write, so it fails CI.
//!
//! The MySQL backend (`idem-runtime/src/backend/mysql.rs`) sends the claim
//! as sqlx's own `BEGIN` statement and the stored response in the batch
//! that commits, so a first attempt should cost what the plain handler
//! costs.
//!
//! Also checks the proxy itself.

use idem_tests::account;
use idem_tests::mysql_db;
use idem_tests::mysql_proxy;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::{Idem, Tx, idempotent};
use serde::Deserialize;
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, MySqlPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use account::Account;
use mysql_db::{direct, run, through, unique};
use mysql_proxy::MySqlProxy;

// -------------------------------------------------------------------- setup

/// Waits until every connection is back in the pool: sqlx returns a
/// connection (with a ping) after the response has gone out.
async fn settle(pool: &MySqlPool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.num_idle() < pool.size() as usize {
        assert!(Instant::now() < deadline, "a connection never came back");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn rows(pool: &MySqlPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .expect("count rows")
}

// -------------------------------------------------------------- the service

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<MySql>,
    pool: MySqlPool,
    table: Table,
}

#[derive(Clone)]
struct Table(String);

#[derive(Deserialize)]
struct Charge {
    amount: i64,
    statements: usize,
}

/// The handler's work, the same for both routes: `statements` inserts
/// (prepared statements, cached per connection after the first).
async fn work(
    conn: &mut MySqlConnection,
    table: &str,
    account: &str,
    charge: &Charge,
) -> Result<u64, sqlx::Error> {
    let sql = format!("INSERT INTO {table} (account, amount) VALUES (?, ?)");
    let mut id = 0;
    for _ in 0..charge.statements {
        id = sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(account)
            .bind(charge.amount)
            .execute(&mut *conn)
            .await?
            .last_insert_id();
    }
    Ok(id)
}

fn created(id: Result<u64, sqlx::Error>) -> Response {
    match id {
        Ok(id) => (StatusCode::CREATED, Json(serde_json::json!({ "id": id }))).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// Without the attribute: a plain sqlx transaction.
async fn baseline(
    account: Account,
    State(pool): State<MySqlPool>,
    State(Table(table)): State<Table>,
    Json(charge): Json<Charge>,
) -> Response {
    let result = async {
        let mut tx = pool.begin().await?;
        let id = work(&mut tx, &table, &account.0, &charge).await?;
        tx.commit().await?;
        Ok(id)
    }
    .await;
    created(result)
}

/// The same handler, idempotent.
#[idempotent(scope = "account")]
async fn idempotent(
    account: Account,
    State(Table(table)): State<Table>,
    mut tx: Tx<MySql>,
    Json(charge): Json<Charge>,
) -> Response {
    created(work(&mut tx, &table, &account.0, &charge).await)
}

struct Service {
    addr: SocketAddr,
    http: reqwest::Client,
    account: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Service {
    /// A service (its own `Idem`, so its own memory of finished keys) on
    /// `pool`, keeping keys in `keys` and effects in `table`.
    async fn start(
        pool: MySqlPool,
        keys: &str,
        table: &str,
        configure: impl FnOnce(Idem<MySql>) -> Idem<MySql>,
    ) -> Service {
        let idem = configure(Idem::new(pool.clone()).table(keys).expect("table name"));
        idem.migrate().await.expect("migrate");
        let state = AppState {
            idem,
            pool,
            table: Table(table.to_owned()),
        };
        let app = axum::Router::new()
            .route("/baseline", post(baseline))
            .route("/idempotent", post(idempotent))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Service {
            addr,
            http: reqwest::Client::new(),
            account: unique("acct"),
            task,
        }
    }

    async fn post(&self, route: &str, key: &str, statements: usize) -> reqwest::Response {
        self.http
            .post(format!("http://{}{route}", self.addr))
            .header("x-account", &self.account)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(format!(r#"{{"amount": 1250, "statements": {statements}}}"#))
            .send()
            .await
            .expect("HTTP request")
    }
}

/// A service on a one-connection pool through a counting proxy, with its
/// own effects and key tables (dropped by `stop`).
struct Proxied {
    admin: MySqlPool,
    table: String,
    keys: String,
    proxy: MySqlProxy,
    pool: MySqlPool,
    service: Service,
}

impl Proxied {
    async fn start(prefix: &str, configure: impl FnOnce(Idem<MySql>) -> Idem<MySql>) -> Proxied {
        let (admin, upstream) = direct().await;
        let table = unique(&format!("{prefix}_fx"));
        let keys = unique(&format!("{prefix}_keys"));
        run(
            &admin,
            format!(
                "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB"
            ),
        )
        .await;
        let proxy = MySqlProxy::start(upstream).await;
        let pool = through(&proxy).await;
        let service = Service::start(pool.clone(), &keys, &table, configure).await;
        Proxied {
            admin,
            table,
            keys,
            proxy,
            pool,
            service,
        }
    }

    async fn stop(self) {
        drop(self.service);
        self.pool.close().await;
        for table in [&self.table, &self.keys] {
            run(&self.admin, format!("DROP TABLE IF EXISTS {table}")).await;
        }
    }
}

/// Round trips of one request, the pool's pings included, and what they
/// were.
async fn count(
    fixture: &Proxied,
    service: &Service,
    route: &str,
    key: &str,
    statements: usize,
) -> (u64, Vec<Vec<String>>, reqwest::Response) {
    let Proxied { proxy, pool, .. } = fixture;
    settle(pool).await;
    proxy.reset();
    proxy.record();
    let response = service.post(route, key, statements).await;
    settle(pool).await;
    assert_eq!(proxy.accepted(), 0, "{route} reconnected");
    (proxy.round_trips(), proxy.recorded(), response)
}

/// A recorded round trip's commands, each cut to its first `words` words
/// (the claim and the finish are long batches of inlined hex).
fn short(round_trips: &[Vec<String>], words: usize) -> Vec<Vec<String>> {
    round_trips
        .iter()
        .map(|commands| {
            commands
                .iter()
                .map(|command| {
                    let mut cut: Vec<&str> = command.split_whitespace().take(words).collect();
                    if cut.len() < command.split_whitespace().count() {
                        cut.push("...");
                    }
                    cut.join(" ")
                })
                .collect()
        })
        .collect()
}

// -------------------------------------------------------------------- tests

/// By default `idem` takes an idle connection without the pool's first
/// ping (its first statement tests the connection), which pays for the
/// round trip sqlx's MySQL driver adds (below): no extra round trip. With
/// `checked_acquire(true)` it pings as the plain handler does: one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_first_attempt_on_mysql_adds_sqlx_rollback_and_saves_a_ping() {
    for checked in [false, true] {
        first_attempts_and_replays(checked).await;
    }
}

async fn first_attempts_and_replays(checked: bool) {
    let fixture = Proxied::start("myrt", |idem| idem.checked_acquire(checked)).await;
    let service = &fixture.service;
    // The ping as a connection leaves the pool, which `idem` saves unless
    // `checked`.
    let saved = u64::from(!checked);
    // (statements, extra round trips, what each route sent): asserted last,
    // once every figure is printed and the tables are dropped.
    let mut extras = Vec::new();

    for statements in [1, 3] {
        // Steady state: the inserts and the replay's read prepared and
        // cached on the connection, for both routes.
        for warm in 0..3 {
            let key = unique("warm");
            for route in ["/baseline", "/idempotent", "/idempotent"] {
                let status = service.post(route, &key, statements).await.status();
                assert_eq!(status, 201, "warm-up {warm} {route}");
            }
        }

        let (base, base_sent, response) =
            count(&fixture, service, "/baseline", &unique("b"), statements).await;
        assert_eq!(response.status(), 201);
        let key = unique("k");
        let (idem, idem_sent, response) =
            count(&fixture, service, "/idempotent", &key, statements).await;
        assert_eq!(response.status(), 201);
        assert!(response.headers().get("idempotent-replayed").is_none());
        let (replay, replay_sent, response) =
            count(&fixture, service, "/idempotent", &key, statements).await;
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true");

        let extra = idem as i64 - base as i64;
        println!(
            "mysql checked_acquire({checked}), statements={statements}: baseline {base} round \
             trips, idempotent {idem} (extra_round_trips = {extra}), replay {replay}"
        );
        println!("  baseline:   {:?}", short(&base_sent, 3));
        println!("  idempotent: {:?}", short(&idem_sent, 3));
        println!("  replay:     {:?}", short(&replay_sent, 3));
        extras.push((statements, extra, base_sent, idem_sent));
        // The baseline is its pool pings (sqlx pings a connection as it
        // leaves the pool and as it comes back), BEGIN, the statements,
        // COMMIT.
        let pings = base - statements as u64 - 2;
        assert_eq!(pings, 2, "pings on acquire and release");
        // A replay in the process that stored the response: one plain
        // (prepared, cached) read, no transaction, and the pool's pings.
        assert_eq!(
            replay,
            pings - saved + 1,
            "a replay takes {replay} round trips: {replay_sent:#?}"
        );

        // Another instance never saw the key finish, so it claims: the
        // claim batch (sqlx's BEGIN) inserts nothing on the finished row,
        // reads its status `FOR UPDATE` into a variable, and its last
        // statement, `SELECT 1 INTO @idem_taken` from two rows when the
        // status is set, fails with error 1172 (ER_TOO_MANY_ROWS), which
        // stops the batch inside the transaction it opened. One more round
        // trip, `SELECT status, fingerprint, headers, body ... FOR UPDATE;
        // ROLLBACK`, reads the stored response and ends it: pings + 2. From then on
        // this instance knows the key finished and replays with the read.
        let mut other = Service::start(
            fixture.pool.clone(),
            &fixture.keys,
            &fixture.table,
            |idem| idem.checked_acquire(checked),
        )
        .await;
        other.account.clone_from(&service.account);
        let before = rows(&fixture.admin, &fixture.table).await;
        for (attempt, expected) in [(1, pings - saved + 2), (2, pings - saved + 1)] {
            let (round_trips, sent, answer) =
                count(&fixture, &other, "/idempotent", &key, statements).await;
            assert_eq!(answer.status(), 201);
            assert_eq!(answer.headers()["idempotent-replayed"], "true");
            println!(
                "  replay {attempt} on another instance: {round_trips} round trips {:?}",
                short(&sent, 3)
            );
            assert_eq!(
                round_trips, expected,
                "replay {attempt} on another instance: {sent:#?}"
            );
            if attempt == 1 {
                assert!(
                    sent.iter().any(|round_trip| round_trip
                        .iter()
                        .any(|command| command.starts_with("QUERY SELECT status"))),
                    "the claim's read of the taken key: {sent:#?}"
                );
            }
        }
        assert_eq!(
            rows(&fixture.admin, &fixture.table).await,
            before,
            "replayed, not rerun"
        );
        drop(other);
    }

    fixture.stop().await;
    // The claim rides on BEGIN and the stored response on COMMIT. What is
    // left is sqlx's own: the finish ends with an empty transaction that
    // stands for the one sqlx counts, and sqlx's MySQL driver sends its
    // queued `ROLLBACK` of it, and waits for the answer, before the pool's
    // return ping (its PostgreSQL driver sends both in one round trip).
    // sqlx offers no way to bring its count back to zero without a
    // statement of its own. One round trip, then, and exactly that one,
    // less the ping saved.
    for (statements, extra, base_sent, idem_sent) in extras {
        assert_eq!(
            extra,
            1 - saved as i64,
            "with {statements} statements the wrapper adds {extra} round trips: \
             baseline {base_sent:#?}, idempotent {idem_sent:#?}"
        );
        let lone_rollbacks = idem_sent
            .iter()
            .filter(|round_trip| round_trip.len() == 1 && round_trip[0] == "QUERY ROLLBACK")
            .count();
        assert_eq!(
            lone_rollbacks, 1,
            "the extra round trip is sqlx's queued ROLLBACK: {idem_sent:#?}"
        );
    }
}

// ----------------------------------------------------------- the proxy itself

/// Through a real server: sqlx's pool pings a connection on its way out of
/// the pool (`test_before_acquire`) and on its way back, each a round trip;
/// a text query is one more, a prepared statement two the first time on a
/// connection (`COM_STMT_PREPARE`, then `COM_STMT_EXECUTE`) and one after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_counts_commands_through_mariadb() {
    let (_, upstream) = direct().await;
    let proxy = MySqlProxy::start(upstream).await;
    let pool = through(&proxy).await;
    settle(&pool).await;
    assert_eq!(proxy.connections(), 1, "the pool's one connection");

    proxy.reset();
    proxy.record();
    sqlx::raw_sql("SELECT 1").execute(&pool).await.unwrap();
    settle(&pool).await;
    let simple = proxy.round_trips();
    assert_eq!(
        proxy.recorded(),
        [vec!["PING"], vec!["QUERY SELECT 1"], vec!["PING"]]
    );
    assert_eq!(simple, 3, "SELECT 1 is one round trip beyond the two pings");

    let mut prepared = Vec::new();
    for _ in 0..2 {
        proxy.reset();
        sqlx::query("SELECT ?")
            .bind(1)
            .execute(&pool)
            .await
            .unwrap();
        settle(&pool).await;
        prepared.push(proxy.round_trips());
    }
    assert_eq!(prepared, [simple + 1, simple], "cold, then cached");

    // A dropped transaction: sqlx queues its ROLLBACK, and the pool's
    // return ping sends it. Unlike sqlx's PostgreSQL driver (which writes
    // the ping behind the queued ROLLBACK, one round trip), its MySQL
    // driver flushes the ROLLBACK and reads its answer before it writes
    // the ping (`wait_until_ready`): two round trips.
    proxy.reset();
    proxy.record();
    drop(pool.begin().await.unwrap());
    settle(&pool).await;
    assert_eq!(
        proxy.recorded(),
        [
            vec!["PING"],
            vec!["QUERY BEGIN"],
            vec!["QUERY ROLLBACK"],
            vec!["PING"]
        ]
    );
    assert_eq!(proxy.round_trips(), simple + 1);
    assert_eq!(proxy.accepted(), 0);

    pool.close().await;
    drop(proxy);
}

/// Reads until `upstream` has `want` bytes from the proxy.
async fn receive(upstream: &mut tokio::net::TcpStream, want: usize) -> Vec<u8> {
    let mut got = vec![0; want];
    tokio::time::timeout(Duration::from_secs(10), upstream.read_exact(&mut got))
        .await
        .expect("the proxy forwards")
        .expect("read");
    got
}

fn packet(seq: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len().to_le_bytes();
    let mut packet = vec![len[0], len[1], len[2], seq];
    packet.extend_from_slice(payload);
    packet
}

/// Against a fake server the test drives: the login and an auth exchange
/// are no command; commands sent before the server answers are one round
/// trip, whether written together or a packet split across writes; a
/// command the server never answers (`COM_STMT_CLOSE`) is no round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_frames_packets_and_joins_unanswered_commands() {
    let fake = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = MySqlProxy::start(fake.local_addr().unwrap()).await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    let (mut server, _) = fake.accept().await.unwrap();
    let mut greeting = [0u8; 1];
    // The server's greeting, then the login and an auth switch answer.
    server.write_all(b"g").await.unwrap();
    client.read_exact(&mut greeting).await.unwrap();
    let mut login = 0x000a_a20d_u32.to_le_bytes().to_vec();
    login.resize(40, 0);
    let login = [packet(1, &login), packet(3, b"auth")].concat();
    client.write_all(&login).await.unwrap();
    receive(&mut server, login.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (0, 0));
    server.write_all(b"k").await.unwrap();
    client.read_exact(&mut greeting).await.unwrap();

    proxy.record();
    // Two commands in one write, a third split across two writes, before
    // any answer: one round trip.
    let query = packet(0, b"\x03ROLLBACK");
    let ping = packet(0, b"\x0e");
    client
        .write_all(&[query.clone(), ping[..2].to_vec()].concat())
        .await
        .unwrap();
    receive(&mut server, query.len()).await;
    client.write_all(&ping[2..]).await.unwrap();
    receive(&mut server, ping.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (2, 1));
    client.write_all(&query).await.unwrap();
    receive(&mut server, query.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (3, 1));

    // Answered: the next command is a round trip of its own; one the server
    // never answers is not, and leaves the next one its own.
    server.write_all(b"ok").await.unwrap();
    let mut answer = [0u8; 2];
    client.read_exact(&mut answer).await.unwrap();
    let close = packet(0, b"\x19\x01\x00\x00\x00");
    let sent = [close.clone(), ping.clone()].concat();
    client.write_all(&sent).await.unwrap();
    receive(&mut server, sent.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (5, 2));
    assert_eq!(
        proxy.recorded(),
        [
            vec!["QUERY ROLLBACK", "PING", "QUERY ROLLBACK"],
            vec!["CLOSE", "PING"]
        ]
    );

    assert_eq!(proxy.connections(), 1);
    drop(proxy);
    // Stopped: the proxy closes both sides.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), server.read_to_end(&mut rest))
        .await
        .expect("the proxy closes the server side");
    assert!(closed.is_ok() && rest.is_empty());
}
