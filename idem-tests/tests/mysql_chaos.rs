#![cfg(feature = "mysql")]
//! The database connection cut at the commit, on MySQL/MariaDB (`chaos.rs`
//! cuts it at random on PostgreSQL): a proxy between the service's pool
//! and the server drops the connection at the `COM_QUERY` that carries
//! `COMMIT`, which on MySQL is the finish's one batch (`SAVEPOINT idem_open;
//! RELEASE SAVEPOINT idem_open; UPDATE <the key's row>; ...; COMMIT; START
//! TRANSACTION`, see `idem-runtime/src/backend/mysql.rs`):
//!
//! - before forwarding it: the server never sees the commit and rolls the
//!   transaction back when the connection drops. The client is told 503,
//!   and a retry with the key runs the handler as a first attempt;
//! - after the server answered it (the answer withheld): the effect and the
//!   stored response committed, the client cannot know. The client is told
//!   503, and a retry replays the stored response.
//!
//! Either way exactly one effect, and the pool opens new connections.
//!
//! Also checks the proxy's cuts against the server itself.

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
use sqlx::{AssertSqlSafe, Connection, MySql, MySqlConnection, MySqlPool};

use account::Account;
use mysql_db::{database_url, direct, run, through, unique};
use mysql_proxy::{CutOnCommit, MySqlProxy};

// -------------------------------------------------------------------- setup

/// Waits until the server has ended session `id` (a connection the proxy
/// cut): it rolls back what the session left open before it lets go of
/// it, so from then on its locks are free and its writes undone.
async fn ended(admin: &MySqlPool, id: u32) {
    assert_ne!(id, 0, "the proxy did not read the cut session's id");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let open: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(id)
                .fetch_one(admin)
                .await
                .expect("read the process list");
        if open == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server never ended the cut session {id}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Drops its tables when dropped, even when a test panics (with a
/// connection of its own, on a runtime of its own: a `Drop` cannot await).
struct Tables(Vec<String>);

impl Drop for Tables {
    fn drop(&mut self) {
        let tables = std::mem::take(&mut self.0);
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let mut conn = MySqlConnection::connect(&database_url()).await?;
                for table in &tables {
                    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                        .execute(&mut conn)
                        .await?;
                }
                conn.close().await
            })
        })
        .join();
        if let Ok(Err(error)) = dropped {
            eprintln!("dropping the test tables failed: {error}");
        }
    }
}

// -------------------------------------------------------------- the service

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<MySql>,
    effects: Effects,
}

/// The table the handlers write their effects to.
#[derive(Clone)]
struct Effects(String);

#[derive(Deserialize)]
struct Op {
    op: String,
}

/// The effect: one row, its id in the 201.
async fn effect(conn: &mut MySqlConnection, table: &str, account: &str, op: &str) -> Response {
    let sql = format!("INSERT INTO {table} (account, op) VALUES (?, ?)");
    let inserted = sqlx::query(AssertSqlSafe(sql))
        .bind(account)
        .bind(op)
        .execute(conn)
        .await;
    match inserted {
        Ok(done) => (
            StatusCode::CREATED,
            Json(serde_json::json!({ "id": done.last_insert_id(), "op": op })),
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

#[idempotent(scope = "account")]
async fn charge(
    account: Account,
    State(Effects(table)): State<Effects>,
    mut tx: Tx<MySql>,
    Json(op): Json<Op>,
) -> Response {
    effect(&mut tx, &table, &account.0, &op.op).await
}

/// The same, a key optional: without one, its finish is the same batch
/// without the stored response.
#[idempotent(scope = "account", key = "optional")]
async fn charge_keyless(
    account: Account,
    State(Effects(table)): State<Effects>,
    mut tx: Tx<MySql>,
    Json(op): Json<Op>,
) -> Response {
    effect(&mut tx, &table, &account.0, &op.op).await
}

/// What the client got.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<String>,
    content_type: Option<String>,
    body: String,
}

impl Answer {
    async fn of(response: reqwest::Response) -> Answer {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|value| value.to_str().unwrap().to_owned())
        };
        Answer {
            status: response.status().as_u16(),
            replayed: header("idempotent-replayed").as_deref() == Some("true"),
            retry_after: header("retry-after"),
            content_type: header("content-type"),
            body: response.text().await.expect("response body"),
        }
    }

    /// The effect id of a 201.
    fn id(&self) -> u64 {
        let body: serde_json::Value =
            serde_json::from_str(&self.body).unwrap_or_else(|error| panic!("{error}: {self:?}"));
        body["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no effect id: {self:?}"))
    }

    /// 503, `idempotency_store_unavailable`, with `Retry-After`: "retry
    /// with the same key", never success.
    fn assert_unavailable(&self, what: &str) {
        assert_eq!(self.status, 503, "{what}: {self:?}");
        assert_eq!(self.retry_after.as_deref(), Some("1"), "{what}: {self:?}");
        assert_eq!(
            self.content_type.as_deref(),
            Some("application/problem+json"),
            "{what}: {self:?}"
        );
        let problem: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        assert_eq!(
            problem["code"], "idempotency_store_unavailable",
            "{what}: {self:?}"
        );
        assert!(!self.replayed, "{what}: {self:?}");
    }

    /// Without a key: 503 with the same stable code, but no `Retry-After`
    /// and a detail that says the outcome is unknown (a retry could do the
    /// work twice), and why a key would have helped.
    fn assert_outcome_unknown(&self, what: &str) {
        assert_eq!(self.status, 503, "{what}: {self:?}");
        assert_eq!(self.retry_after, None, "{what}: {self:?}");
        let problem: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        assert_eq!(
            problem["code"], "idempotency_store_unavailable",
            "{what}: {self:?}"
        );
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("may or may not have been done") && detail.contains("Idempotency-Key"),
            "{what}: {self:?}"
        );
    }
}

/// A service whose pool (one connection) goes through a proxy that can cut
/// at the commit, with its own effects and key tables.
struct Fixture {
    admin: MySqlPool,
    effects: String,
    keys: String,
    proxy: MySqlProxy,
    pool: MySqlPool,
    addr: SocketAddr,
    http: reqwest::Client,
    account: String,
    task: tokio::task::JoinHandle<()>,
    _tables: Tables,
}

impl Fixture {
    async fn start(prefix: &str) -> Fixture {
        let (admin, upstream) = direct().await;
        let effects = unique(&format!("{prefix}_fx"));
        let keys = unique(&format!("{prefix}_keys"));
        let tables = Tables(vec![effects.clone(), keys.clone()]);
        run(
            &admin,
            format!(
                "CREATE TABLE {effects} (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 account VARCHAR(255) NOT NULL, op VARCHAR(255) NOT NULL) ENGINE = InnoDB"
            ),
        )
        .await;
        let proxy = MySqlProxy::start(upstream).await;
        let pool = through(&proxy).await;
        let idem = Idem::new(pool.clone()).table(&keys).expect("table name");
        idem.migrate().await.expect("migrate");
        let state = AppState {
            idem,
            effects: Effects(effects.clone()),
        };
        let app = axum::Router::new()
            .route("/charge", post(charge))
            .route("/keyless", post(charge_keyless))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Fixture {
            admin,
            effects,
            keys,
            proxy,
            pool,
            addr,
            http: reqwest::Client::new(),
            account: unique("acct"),
            task,
            _tables: tables,
        }
    }

    /// `POST /charge` with `key` (also the effect's `op`).
    async fn charge(&self, key: &str) -> Answer {
        self.send("/charge", Some(key), key).await
    }

    /// `POST /keyless` without a key.
    async fn keyless(&self, op: &str) -> Answer {
        self.send("/keyless", None, op).await
    }

    async fn send(&self, route: &str, key: Option<&str>, op: &str) -> Answer {
        let mut request = self
            .http
            .post(format!("http://{}{route}", self.addr))
            .header("x-account", &self.account)
            .json(&serde_json::json!({ "op": op }))
            .timeout(Duration::from_secs(30));
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        Answer::of(request.send().await.expect("HTTP request")).await
    }

    /// The committed effects of `op`, their ids.
    async fn effects(&self, op: &str) -> Vec<u64> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(id AS UNSIGNED) FROM {} WHERE account = ? AND op = ? ORDER BY id",
            self.effects
        )))
        .bind(&self.account)
        .bind(op)
        .fetch_all(&self.admin)
        .await
        .expect("read the effects")
    }

    /// The committed key row of `key`: `(status, body)`, `status` `None`
    /// for an unfinished claim.
    async fn stored(&self, key: &str) -> Option<(Option<i16>, String)> {
        let row: Option<(Option<i16>, Option<Vec<u8>>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, body FROM {} WHERE scope = ? AND `key` = ?",
            self.keys
        )))
        .bind(self.account.as_bytes())
        .bind(key.as_bytes())
        .fetch_optional(&self.admin)
        .await
        .expect("read the key row");
        row.map(|(status, body)| {
            let body = String::from_utf8(body.unwrap_or_default()).expect("a UTF-8 body");
            (status, body)
        })
    }

    /// Key rows in the account's scope.
    async fn keys_in_scope(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {} WHERE scope = ?",
            self.keys
        )))
        .bind(self.account.as_bytes())
        .fetch_one(&self.admin)
        .await
        .expect("count the key rows")
    }

    /// The one session cut since the last call, once the server ended it.
    async fn cut_once(&self, cuts_before: usize) -> u32 {
        let cut = self.proxy.cut_sessions();
        assert_eq!(
            cut.len(),
            cuts_before + 1,
            "one cut at the commit, not {:?}",
            &cut[cuts_before..]
        );
        ended(&self.admin, cut[cuts_before]).await;
        cut[cuts_before]
    }

    /// `key` committed as the first attempt `first` reported: one effect,
    /// its id in the stored 201, whose body is `first`'s.
    async fn assert_committed(&self, key: &str, first: &Answer) {
        assert_eq!(
            self.effects(key).await,
            [first.id()],
            "exactly one effect, the one {first:?} reports"
        );
        assert_eq!(
            self.stored(key).await,
            Some((Some(201), first.body.clone())),
            "the stored response is the one the client got"
        );
    }

    async fn stop(self) {
        self.task.abort();
        self.pool.close().await;
        drop(self.proxy);
        // `_tables` drops the tables.
    }
}

// -------------------------------------------------------------------- tests

/// The commit never reaches the server: nothing committed, the client is
/// told 503 (retry with the key), and the retry is a first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_cut_before_the_server_sees_it_is_503_and_the_retry_runs_once() {
    let fixture = Fixture::start("mych_before").await;
    let key = unique("k");

    fixture
        .proxy
        .set_cut_on_commit(CutOnCommit::BeforeForwarding);
    let first = fixture.charge(&key).await;
    fixture.proxy.set_cut_on_commit(CutOnCommit::Off);
    println!("cut before forwarding the finish's COMMIT: {first:?}");
    first.assert_unavailable("the first attempt, its commit cut");
    fixture.cut_once(0).await;
    assert!(
        fixture.effects(&key).await.is_empty(),
        "the effect rolled back"
    );
    assert_eq!(fixture.stored(&key).await, None, "the claim rolled back");

    let retry = fixture.charge(&key).await;
    println!("the retry: {retry:?}");
    assert_eq!(retry.status, 201, "the retry: {retry:?}");
    assert!(!retry.replayed, "nothing was stored to replay: {retry:?}");
    fixture.assert_committed(&key, &retry).await;

    let replay = fixture.charge(&key).await;
    assert_eq!((replay.status, replay.replayed), (201, true), "{replay:?}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(fixture.effects(&key).await.len(), 1, "exactly one effect");
    fixture.stop().await;
}

/// The commit lands and its answer is lost: the client is told 503 (it
/// cannot know), and the retry replays what committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_cut_after_the_server_answered_is_503_and_the_retry_replays() {
    let fixture = Fixture::start("mych_after").await;
    let key = unique("k");

    fixture
        .proxy
        .set_cut_on_commit(CutOnCommit::AfterForwarding);
    let first = fixture.charge(&key).await;
    fixture.proxy.set_cut_on_commit(CutOnCommit::Off);
    println!("cut after the server answered the finish's COMMIT: {first:?}");
    first.assert_unavailable("the first attempt, its commit's answer cut");
    // The proxy read the whole answer before it cut: committed already.
    let effects = fixture.effects(&key).await;
    assert_eq!(effects.len(), 1, "the effect committed: {effects:?}");
    let Some((Some(201), stored)) = fixture.stored(&key).await else {
        panic!("the response committed with the effect");
    };
    let body: serde_json::Value = serde_json::from_str(&stored).unwrap();
    assert_eq!(body["id"].as_u64(), Some(effects[0]), "{stored}");
    fixture.cut_once(0).await;

    let retry = fixture.charge(&key).await;
    println!("the retry: {retry:?}");
    assert_eq!(retry.status, 201, "the retry: {retry:?}");
    assert!(
        retry.replayed,
        "the committed response is replayed: {retry:?}"
    );
    assert_eq!(retry.body, stored);
    fixture.assert_committed(&key, &retry).await;
    fixture.stop().await;
}

/// Commit after commit cut, each on the pool's one connection: every
/// request gets a new one, nothing piles up, and once the cuts stop new
/// keys succeed and the cut ones settle (rerun or replayed, once each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_reconnects_after_cut_commits() {
    let fixture = Fixture::start("mych_pool").await;
    let proxy = &fixture.proxy;
    proxy.reset();

    let mut cut = Vec::new();
    for (mode, count) in [
        (CutOnCommit::BeforeForwarding, 3),
        (CutOnCommit::AfterForwarding, 2),
    ] {
        proxy.set_cut_on_commit(mode);
        for _ in 0..count {
            let key = unique("cut");
            let answer = fixture.charge(&key).await;
            answer.assert_unavailable(&format!("{mode:?}"));
            cut.push((mode, key));
        }
    }
    proxy.set_cut_on_commit(CutOnCommit::Off);
    let sessions = proxy.cut_sessions();
    let mut distinct = sessions.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        cut.len(),
        "each cut request ran on a new connection: {sessions:?}"
    );
    for &session in &sessions {
        ended(&fixture.admin, session).await;
    }
    // The first cut request ran on the pool's connection, each later one
    // on a new one.
    assert_eq!(proxy.accepted(), cut.len() as u64 - 1, "connections opened");

    for _ in 0..5 {
        let key = unique("new");
        let answer = fixture.charge(&key).await;
        assert_eq!((answer.status, answer.replayed), (201, false), "{answer:?}");
        fixture.assert_committed(&key, &answer).await;
    }
    for (mode, key) in &cut {
        let answer = fixture.charge(key).await;
        let replayed = *mode == CutOnCommit::AfterForwarding;
        assert_eq!(
            (answer.status, answer.replayed),
            (201, replayed),
            "{mode:?}: {answer:?}"
        );
        fixture.assert_committed(key, &answer).await;
    }
    // One more connection, which served every later request.
    assert_eq!(proxy.accepted(), cut.len() as u64, "connections opened");
    assert_eq!(proxy.connections(), 1, "the pool's one connection");
    fixture.stop().await;
}

/// Without a key, the same cuts: 503 both times, nothing stored; the
/// commit either never happened or did (a keyless request has no memory to
/// make a retry safe: that is what the key is for), and the answer says
/// so instead of inviting a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_commit_cut_is_503_and_stores_nothing() {
    let fixture = Fixture::start("mych_keyless").await;

    fixture
        .proxy
        .set_cut_on_commit(CutOnCommit::BeforeForwarding);
    let before = unique("op");
    let answer = fixture.keyless(&before).await;
    answer.assert_outcome_unknown("keyless, cut before forwarding");
    fixture.cut_once(0).await;
    assert!(fixture.effects(&before).await.is_empty(), "rolled back");

    fixture
        .proxy
        .set_cut_on_commit(CutOnCommit::AfterForwarding);
    let after = unique("op");
    let answer = fixture.keyless(&after).await;
    answer.assert_outcome_unknown("keyless, cut after the answer");
    fixture.cut_once(1).await;
    assert_eq!(fixture.effects(&after).await.len(), 1, "committed");

    fixture.proxy.set_cut_on_commit(CutOnCommit::Off);
    let calm = unique("op");
    let answer = fixture.keyless(&calm).await;
    assert_eq!((answer.status, answer.replayed), (201, false), "{answer:?}");
    assert_eq!(fixture.effects(&calm).await, [answer.id()]);
    assert_eq!(fixture.keys_in_scope().await, 0, "no key, nothing stored");
    fixture.stop().await;
}

// ----------------------------------------------------------- the proxy itself

/// Plain sqlx on a proxied pool: the cut before forwarding leaves nothing,
/// the cut after the answer leaves the commit (even in a batch whose later
/// results are a result set), the session ids are the server's, and
/// `cut_all` drops an open connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_cuts_at_commit_on_mariadb() {
    let (admin, upstream) = direct().await;
    let table = unique("mych_proxy");
    let _tables = Tables(vec![table.clone()]);
    run(
        &admin,
        format!("CREATE TABLE {table} (n INT NOT NULL) ENGINE = InnoDB"),
    )
    .await;
    let count = || async {
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(&admin)
            .await
            .unwrap();
        rows
    };
    let proxy = MySqlProxy::start(upstream).await;
    let pool = through(&proxy).await;
    let insert = format!("INSERT INTO {table} (n) VALUES (1)");

    let session: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&pool)
        .await
        .unwrap();
    proxy.set_cut_on_commit(CutOnCommit::BeforeForwarding);
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(insert.clone()))
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(tx.commit().await.is_err(), "the commit was cut");
    assert_eq!(proxy.cut_sessions(), [session as u32], "the server's id");
    ended(&admin, proxy.cut_sessions()[0]).await;
    assert_eq!(count().await, 0, "the server never saw COMMIT");

    proxy.set_cut_on_commit(CutOnCommit::AfterForwarding);
    let batch =
        format!("START TRANSACTION; {insert}; SELECT 1; COMMIT; SELECT 2, 'x' UNION SELECT 3, 'y'");
    let cut = sqlx::raw_sql(AssertSqlSafe(batch)).execute(&pool).await;
    assert!(cut.is_err(), "the answer was withheld: {cut:?}");
    // No wait: the proxy cut only once it had read the whole answer.
    assert_eq!(count().await, 1, "the forwarded COMMIT landed");
    assert_eq!(proxy.cut_sessions().len(), 2);

    proxy.set_cut_on_commit(CutOnCommit::Off);
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(insert.clone()))
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.expect("commits again once off");
    assert_eq!(count().await, 2);
    assert_eq!(proxy.cut_sessions().len(), 2, "no cut while off");

    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql("SELECT 1").execute(&mut *conn).await.unwrap();
    proxy.cut_all();
    assert!(sqlx::raw_sql("SELECT 1").execute(&mut *conn).await.is_err());
    conn.close_on_drop();
    drop(conn);
    sqlx::raw_sql("SELECT 1")
        .execute(&pool)
        .await
        .expect("a new connection after cut_all");

    pool.close().await;
    drop(proxy);
}
