//! `idem` behind a transaction-mode pooler: a PgBouncer of the test's own
//! (`pool_mode = transaction`, fewer server connections than the service
//! has), in front of the test PostgreSQL server.
//!
//! One workload touches every kind of statement `idem` sends: the migrations,
//! the atomic claim, finish and replay (concurrent duplicates, a changed
//! body, an expired key taken over, the sweep), the phased lease, recovery
//! points and the completer, the outbox write, relay and consumer, and the
//! admin operations. It runs twice: through PgBouncer under load, where a
//! statement that needs its session (a name sqlx prepared, a split
//! parse and execute outside a transaction) fails; and through a recording
//! proxy, whose wire shows no named statement and no session setting.

#![cfg(feature = "postgres")]

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::outbox::sink_fn;
use idem::{Consumed, Idem, PhaseError, Phases, Pooler, Tx, idempotent};
use idem_tests::account::Account;
use idem_tests::pg_proxy::PgProxy;
use idem_tests::pgbouncer::PgBouncer;
use idem_tests::unique::unique;
use serde_json::{Value, json};
use sqlx::Postgres;
use sqlx::postgres::{PgPool, PgPoolOptions};

const EFFECTS_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_pooler_effects (
    account text NOT NULL, key text NOT NULL, kind text NOT NULL, amount bigint NOT NULL)";

/// Clients at once, and keys each sends.
const CLIENTS: usize = 16;
const KEYS_PER_CLIENT: usize = 6;

fn upstream() -> String {
    idem_tests::engines::postgres::url()
}

async fn direct_pool() -> PgPool {
    let pool = idem_tests::engines::postgres::pool(4).await;
    // The tests of this binary run at once: their `CREATE TABLE IF NOT
    // EXISTS` can collide in the catalog, which `prepare` retries.
    idem_tests::service::prepare(&pool, EFFECTS_DDL).await;
    pool
}

/// A pool of `size` at `url`: every connection through the pooler.
async fn pool_at(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .unwrap_or_else(|error| panic!("connect to {url}: {error}"))
}

/// The handlers' own statements, as an application behind a pooler writes
/// them: bound, unnamed (`persistent(false)`), inside the request's
/// transaction.
async fn record_effect(
    conn: &mut sqlx::PgConnection,
    account: &str,
    key: &str,
    kind: &str,
    amount: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idem_pooler_effects (account, key, kind, amount) VALUES ($1, $2, $3, $4)",
    )
    .bind(account)
    .bind(key)
    .bind(kind)
    .bind(amount)
    .persistent(false)
    .execute(conn)
    .await
    .map(drop)
}

fn key_of(tx: &Tx<Postgres>) -> String {
    tx.key()
        .map(|key| key.as_str().to_owned())
        .unwrap_or_default()
}

// Long enough for each key's third attempt to land inside it on a loaded
// machine (every request queues for PgBouncer's two server connections),
// short enough for the expiry check to wait it out.
#[idempotent(scope = "account", ttl = "3s")]
async fn charge(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(req): Json<Value>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
    let amount = req["amount"].as_i64().unwrap_or(0);
    let key = key_of(&tx);
    let failed =
        |error: &dyn std::fmt::Display| (StatusCode::INTERNAL_SERVER_ERROR, error.to_string());
    record_effect(&mut tx, &account.0, &key, "charge", amount)
        .await
        .map_err(|error| failed(&error))?;
    let payload = json!({ "account": account.0, "key": key, "amount": amount });
    tx.outbox("charge.created", &payload)
        .await
        .map_err(|error| failed(&error))?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "key": key, "amount": amount })),
    ))
}

/// The keys the payment step passed to the provider, per request key: a
/// provider deduplicates on that key, so one key per request is one
/// charge (a resumed step may call again, with the same key).
fn provider_calls() -> &'static Mutex<HashMap<String, HashSet<String>>> {
    static CALLS: OnceLock<Mutex<HashMap<String, HashSet<String>>>> = OnceLock::new();
    CALLS.get_or_init(Default::default)
}

/// Keys whose first attempt fails after the provider was called: the key
/// is kept, and the completer resumes it.
fn fail_once() -> &'static Mutex<HashSet<String>> {
    static KEYS: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    KEYS.get_or_init(Default::default)
}

struct PayError(Response);

impl IntoResponse for PayError {
    fn into_response(self) -> Response {
        self.0
    }
}

impl From<PhaseError> for PayError {
    fn from(error: PhaseError) -> Self {
        PayError(error.into_response())
    }
}

impl From<sqlx::Error> for PayError {
    fn from(error: sqlx::Error) -> Self {
        PayError((StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response())
    }
}

#[idempotent(scope = "account", lease = "1s")]
async fn pay(
    account: Account,
    mut phases: Phases<Postgres>,
    Json(req): Json<Value>,
) -> Result<(StatusCode, Json<Value>), PayError> {
    let amount = req["amount"].as_i64().unwrap_or(0);
    let key = phases.key().as_str().to_owned();
    let scope = account.0.clone();
    let pending_key = key.clone();
    phases
        .local("pending", async |tx| -> Result<_, PayError> {
            record_effect(tx, &scope, &pending_key, "pending", amount).await?;
            Ok(())
        })
        .await?;
    let provider_key = key.clone();
    let provider: String = phases
        .external("provider", async |derived| -> Result<_, PayError> {
            let derived = derived.to_string();
            let mut calls = provider_calls().lock().unwrap();
            calls
                .entry(provider_key)
                .or_default()
                .insert(derived.clone());
            Ok(format!("pay_{derived}"))
        })
        .await?;
    if fail_once().lock().unwrap().remove(&key) {
        return Err(PayError(StatusCode::BAD_GATEWAY.into_response()));
    }
    let tx = phases.last_phase().await?;
    record_effect(tx, &account.0, &key, "paid", amount).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "key": key, "provider": provider })),
    ))
}

fn router(idem: Idem<Postgres>) -> axum::Router {
    axum::Router::new()
        .route("/charges", post(charge))
        .route("/payments", post(pay))
        .with_state(idem)
}

async fn serve(idem: Idem<Postgres>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(idem);
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// One answer, read whole.
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: String,
}

async fn post_json(addr: SocketAddr, path: &str, account: &str, key: &str, body: &Value) -> Answer {
    let response = reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .header("x-account", account)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|error| panic!("POST {path} {key}: {error}"));
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    Answer {
        status,
        replayed,
        body: response.text().await.unwrap(),
    }
}

async fn count(direct: &PgPool, account: &str, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_pooler_effects WHERE account = $1 AND kind = $2")
        .bind(account)
        .bind(kind)
        .fetch_one(direct)
        .await
        .unwrap()
}

/// Everything `idem` does, through `idem`'s pool; checked through
/// `direct`. `clients` send their keys at once.
async fn workload(idem: Idem<Postgres>, direct: &PgPool, clients: usize) {
    let account = unique("pooled");
    // Two services migrating at once, through the pooler.
    let (a, b) = tokio::join!(idem.migrate(), idem.migrate());
    a.and(b).expect("migrate through the pooler");
    idem.migrate_outbox().await.expect("migrate the outbox");
    let addr = serve(idem.clone()).await;

    // Atomic: every client sends each of its keys twice at once, then once
    // more: one effect per key, every answer the first one's.
    let sent = futures::future::join_all((0..clients).map(|client| {
        let account = account.clone();
        async move {
            for n in 0..KEYS_PER_CLIENT {
                let key = format!("c{client}-{n}");
                let body = json!({ "amount": 100 + n });
                let (first, second) = tokio::join!(
                    post_json(addr, "/charges", &account, &key, &body),
                    post_json(addr, "/charges", &account, &key, &body),
                );
                let third = post_json(addr, "/charges", &account, &key, &body).await;
                assert_eq!(third.status, StatusCode::CREATED, "{key}: {}", third.body);
                assert!(third.replayed, "{key}: the third attempt is a replay");
                for other in [first, second] {
                    if other.status == StatusCode::CONFLICT {
                        continue; // the duplicate met the first attempt in flight
                    }
                    assert_eq!(other.status, StatusCode::CREATED, "{key}: {}", other.body);
                    assert_eq!(other.body, third.body, "{key}: replays are verbatim");
                }
            }
        }
    }))
    .await;
    assert_eq!(sent.len(), clients);
    let keys = i64::try_from(clients * KEYS_PER_CLIENT).unwrap();
    assert_eq!(
        count(direct, &account, "charge").await,
        keys,
        "one charge per key"
    );

    // Same key, other body: 422, nothing runs.
    let other = post_json(addr, "/charges", &account, "c0-0", &json!({ "amount": 1 })).await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        other.body
    );

    // Admin: a finished key is found, listed, and forgotten.
    let found = idem
        .lookup(&account, "c0-1")
        .await
        .unwrap()
        .expect("c0-1 is stored");
    assert_eq!(found.status, Some(201));
    let recent = idem.recent(&account, 5).await.unwrap();
    assert_eq!(recent.len(), 5);
    assert_eq!(
        idem.forget(&account, "c0-1").await.unwrap(),
        idem::Forgotten::Deleted
    );
    assert!(idem.lookup(&account, "c0-1").await.unwrap().is_none());

    // Expiry: past its 3 s ttl the key runs as new, and the sweep deletes
    // what expired.
    let expired = wait_until_expired(&idem, &account, "c0-2").await;
    assert!(expired, "c0-2 expires within its ttl and a margin");
    let again = post_json(
        addr,
        "/charges",
        &account,
        "c0-2",
        &json!({ "amount": 102 }),
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed, "an expired key runs again");
    assert_eq!(count(direct, &account, "charge").await, keys + 1);
    let swept = idem
        .sweep_expired(1000)
        .await
        .expect("sweep through the pooler");
    assert!(swept > 0, "the sweep deleted the expired keys");

    // The outbox: every charge's message relayed once, then consumed once.
    // The first delivery fails, so its error is kept and shown.
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let refused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let relay = idem
        .relay(sink_fn({
            let delivered = Arc::clone(&delivered);
            move |message: idem::outbox::Message| {
                let (delivered, refused) = (Arc::clone(&delivered), Arc::clone(&refused));
                async move {
                    if !refused.swap(true, Ordering::SeqCst) {
                        return Err("refused once".into());
                    }
                    delivered.lock().unwrap().push(message.id.clone());
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
                }
            }
        }))
        .backoff(Duration::from_millis(1));
    let first = relay
        .run_once()
        .await
        .expect("relay pass through the pooler");
    assert_eq!(first.failed, 1, "{first:?}");
    let status = idem
        .outbox_status(10)
        .await
        .expect("outbox status through the pooler");
    assert_eq!(status.failing.len(), 1, "{status:?}");
    assert_eq!(
        status.failing[0].last_error.as_deref(),
        Some("refused once")
    );
    tokio::time::timeout(Duration::from_secs(30), async {
        while idem.pending_messages().await.unwrap() > 0 {
            relay
                .run_once()
                .await
                .expect("relay pass through the pooler");
        }
    })
    .await
    .expect("the outbox drained");
    let ids = delivered.lock().unwrap().clone();
    assert!(
        ids.len() > usize::try_from(keys).unwrap(),
        "every charge sent a message"
    );
    let applied = AtomicUsize::new(0);
    for id in ids.iter().chain(ids.iter().take(3)) {
        let done = idem
            .consume(&account, id, async |tx| {
                record_effect(tx, &account, id, "consumed", 1).await
            })
            .await
            .expect("consume through the pooler");
        if matches!(done, Consumed::Applied(())) {
            applied.fetch_add(1, Ordering::Relaxed);
        }
    }
    assert_eq!(applied.into_inner(), ids.len(), "each message applied once");
    relay.sweep(1000).await.expect("relay sweep");
    idem.sweep_consumed(1000).await.expect("consumed sweep");

    // Phased: payments at once, one of them failing after its provider
    // call; the completer finishes it once its lease ends.
    let abandoned = format!("{account}-p-abandoned");
    fail_once().lock().unwrap().insert(abandoned.clone());
    let payments = futures::future::join_all((0..clients).map(|client| {
        let account = account.clone();
        let key = if client == 0 {
            abandoned.clone()
        } else {
            format!("{account}-p{client}")
        };
        async move {
            let body = json!({ "amount": 990 });
            let first = post_json(addr, "/payments", &account, &key, &body).await;
            (key, first)
        }
    }))
    .await;
    for (key, answer) in &payments {
        if *key == abandoned {
            assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.body);
        } else {
            assert_eq!(answer.status, StatusCode::CREATED, "{key}: {}", answer.body);
        }
    }
    let completer = idem.completer(router(idem.clone()));
    let completed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let run = completer
                .run_once()
                .await
                .expect("completer pass through the pooler");
            if run.completed > 0 {
                return run;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the completer finished the abandoned payment");
    assert_eq!((completed.uncertain, completed.released), (0, 0));
    let resumed = post_json(
        addr,
        "/payments",
        &account,
        &abandoned,
        &json!({ "amount": 990 }),
    )
    .await;
    assert_eq!(resumed.status, StatusCode::CREATED, "{}", resumed.body);
    assert!(resumed.replayed, "the completer's answer is replayed");
    let paid = count(direct, &account, "paid").await;
    assert_eq!(paid, i64::try_from(clients).unwrap(), "one payment per key");
    let calls = provider_calls().lock().unwrap().clone();
    for (key, _) in &payments {
        let derived = calls.get(key).map(HashSet::len);
        assert_eq!(derived, Some(1), "{key}: one provider key, one charge");
    }
}

/// Polls the key until its ttl has passed (bounded).
async fn wait_until_expired(idem: &Idem<Postgres>, account: &str, key: &str) -> bool {
    for _ in 0..200 {
        match idem.lookup(account, key).await.unwrap() {
            Some(info) if info.state == idem::KeyState::Expired => return true,
            None => return true,
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    false
}

/// Through PgBouncer with 2 server connections, a service with 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn everything_works_behind_pgbouncer_in_transaction_mode() {
    let direct = direct_pool().await;
    let bouncer = PgBouncer::start(&upstream(), 2);
    let pool = pool_at(&bouncer.url(&upstream()), 16).await;
    // The control: sqlx's own named statements do fail here, so the
    // workload's passing says something.
    let named = futures::future::join_all((0..64).map(|n: i32| {
        sqlx::query_scalar::<_, i32>("SELECT $1::int4 + 0")
            .bind(n)
            .fetch_one(&pool)
    }))
    .await;
    assert!(
        named.iter().any(Result::is_err),
        "sqlx's named statements failed nowhere behind PgBouncer: the test proves nothing"
    );
    let idem = Idem::new(pool)
        .table(&unique("pooled_keys"))
        .unwrap()
        .pooler(Pooler::Transaction);
    workload(idem, &direct, CLIENTS).await;
    // Only the control's statements failed on the server.
    let log = bouncer.log();
    let errors: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("ERROR") || line.contains("WARNING"))
        .filter(|line| !line.contains("sqlx_s_"))
        .collect();
    assert!(
        errors.is_empty(),
        "PgBouncer saw errors:\n{}",
        errors.join("\n")
    );
}

/// What a session keeps, found in the statements on the wire: a statement
/// prepared by name (protocol or SQL), a session `SET`, `LISTEN`, a session
/// advisory lock, a temporary table. The body of a function being defined
/// (between `$idem$`s) runs nothing then, and is left out.
fn session_state(recorded: &[Vec<String>]) -> Vec<String> {
    let mut found = Vec::new();
    for command in recorded.iter().flatten() {
        if let Some(parse) = command.strip_prefix("PARSE ") {
            if parse.starts_with("NAMED ") {
                found.push(command.clone());
            }
            continue;
        }
        let Some(sql) = command.strip_prefix("QUERY ") else {
            continue;
        };
        let run: String = sql.split("$idem$").step_by(2).collect();
        for statement in run.split(';') {
            let statement = statement.trim().to_ascii_uppercase();
            let keeps = statement.starts_with("PREPARE ")
                || statement.starts_with("EXECUTE ")
                || statement.starts_with("LISTEN ")
                || (statement.starts_with("SET ") && !statement.starts_with("SET LOCAL "))
                || statement.contains("PG_ADVISORY_LOCK(")
                || statement.contains("PG_TRY_ADVISORY_LOCK(")
                || statement.contains("PG_ADVISORY_LOCK_SHARED(")
                || statement.contains("PG_TRY_ADVISORY_LOCK_SHARED(")
                || statement.contains("SET_CONFIG(")
                || statement.contains("TEMP TABLE")
                || statement.contains("TEMPORARY TABLE");
            if keeps {
                found.push(statement);
            }
        }
    }
    found
}

/// The wire of the whole workload, through a recording proxy: nothing
/// `idem` sends (nor the handlers' unnamed statements) keeps anything in
/// the session. The same workload with `Pooler::Session` does prepare
/// statements in the session: the check can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nothing_is_kept_in_the_session() {
    let direct = direct_pool().await;
    let upstream_addr = {
        let options: sqlx::postgres::PgConnectOptions = upstream().parse().unwrap();
        tokio::net::lookup_host((options.get_host(), options.get_port()))
            .await
            .unwrap()
            .next()
            .unwrap()
    };
    for pooler in [Pooler::Transaction, Pooler::Session] {
        let proxy = PgProxy::start(upstream_addr).await;
        let url = format!("postgres://postgres@{}/test?sslmode=disable", proxy.addr());
        let pool = pool_at(&url, 8).await;
        proxy.record();
        let keys = unique("wire_keys");
        let idem = Idem::new(pool.clone()).table(&keys).unwrap().pooler(pooler);
        workload(idem, &direct, 4).await;
        let recorded = proxy.recorded();
        let kept = session_state(&recorded);
        match pooler {
            Pooler::Transaction => {
                assert!(kept.is_empty(), "kept in the session: {kept:#?}");
                // The claims, finishes and replays called the table's
                // functions, whose plans the server keeps.
                for function in ["_idem_claim_v1(", "_idem_finish_v1(", "_idem_peek_v1("] {
                    let calls = recorded
                        .iter()
                        .flatten()
                        .filter(|command| {
                            command.starts_with("QUERY ")
                                && command.contains(function)
                                && !command.contains("CREATE OR REPLACE FUNCTION")
                        })
                        .count();
                    assert!(calls > 0, "no call of {function}");
                }
            }
            _ => assert!(
                kept.iter()
                    .any(|statement| statement.starts_with("PREPARE ")),
                "a session pooler's claim prepares its statements: {kept:#?}"
            ),
        }
        pool.close().await;
        idem_tests::engines::postgres::drop_functions(&direct, &keys).await;
    }
}

/// The `charges` example started as the README says behind PgBouncer
/// (`DATABASE_URL` at PgBouncer, `DATABASE_POOLER=transaction`), in a
/// database of its own: 16 clients post charges and payments, each twice;
/// every first answer is 201, every retry replays it, one row per key, and
/// the relay's and completer's passes log no failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_example_serves_behind_pgbouncer() {
    let direct = direct_pool().await;
    let database = unique("pooler_example");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&direct)
        .await
        .unwrap();
    // As Debian ships it: no startup parameter ignored.
    let bouncer = PgBouncer::start_with(&upstream(), 2, "");
    let addr = idem_tests::examples::free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut example = idem_tests::examples::charges_logged(
        dir.path(),
        addr,
        &[
            (
                "DATABASE_URL",
                Some(&bouncer.database_url(&upstream(), &database)),
            ),
            ("DATABASE_POOLER", Some("transaction")),
            ("NATS_URL", None),
            ("PROVIDER_URL", None),
            ("ADMIN_TOKEN", None),
        ],
        Arc::clone(&log),
    )
    .await;
    let http = reqwest::Client::new();
    let answers = futures::future::join_all((0..CLIENTS).map(|client| {
        let http = http.clone();
        async move {
            let mut seen = Vec::new();
            for n in 0..KEYS_PER_CLIENT {
                for path in ["/v1/charges", "/v1/payments"] {
                    let key = format!("{path}-{client}-{n}");
                    let send = || {
                        http.post(format!("http://{addr}{path}"))
                            .bearer_auth(format!("acct_{client}"))
                            .header("idempotency-key", &key)
                            .json(&json!({ "amount": 100 + n, "currency": "eur" }))
                            .send()
                    };
                    let first = send().await.unwrap();
                    let status = first.status();
                    let body = first.text().await.unwrap();
                    assert_eq!(status, StatusCode::CREATED, "{key}: {body}");
                    let again = send().await.unwrap();
                    assert_eq!(again.status(), StatusCode::CREATED, "{key}");
                    assert!(again.headers().contains_key("idempotent-replayed"), "{key}");
                    assert_eq!(
                        again.text().await.unwrap(),
                        body,
                        "{key}: replays are verbatim"
                    );
                    seen.push(key);
                }
            }
            seen
        }
    }))
    .await;
    let keys = answers.iter().map(Vec::len).sum::<usize>();
    let example_db = pool_at(&direct_url(&database), 2).await;
    let rows = |table: &'static str| {
        let pool = example_db.clone();
        async move {
            let sql = format!("SELECT count(*) FROM {table}");
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (charges, payments, stored) = (
        rows("charges").await,
        rows("payments").await,
        rows("idem_keys").await,
    );
    assert_eq!(
        charges,
        i64::try_from(CLIENTS * KEYS_PER_CLIENT).unwrap(),
        "one charge per key"
    );
    assert_eq!(payments, charges, "one payment per key");
    assert_eq!(
        stored,
        i64::try_from(keys).unwrap(),
        "one stored response per key"
    );
    // The relay has delivered every charge's message (printed, without
    // NATS) within its polling period.
    let delivered = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_keys_outbox WHERE delivered_at IS NULL",
            )
            .fetch_one(&example_db)
            .await
            .unwrap();
            if left == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        delivered.is_ok(),
        "the relay delivered every message behind PgBouncer"
    );
    example.kill().await.unwrap();
    let lines = log.lock().unwrap().clone();
    // sqlx's warnings of a slow statement or acquire are the queue for
    // PgBouncer's two server connections on a loaded machine, not failures.
    let failures: Vec<&String> = lines
        .iter()
        .filter(|line| line.contains("ERROR") || line.contains("WARN"))
        .filter(|line| !line.contains("exceeded slow threshold"))
        .filter(|line| !line.contains("exceeded alert threshold"))
        .collect();
    assert!(
        failures.is_empty(),
        "the example logged failures:\n{failures:#?}"
    );
    example_db.close().await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {database} WITH (FORCE)"
    )))
    .execute(&direct)
    .await;
}

/// `database` on the upstream server, directly.
fn direct_url(database: &str) -> String {
    let options: sqlx::postgres::PgConnectOptions = upstream().parse().unwrap();
    format!(
        "postgres://{}@{}:{}/{database}",
        options.get_username(),
        options.get_host(),
        options.get_port()
    )
}

/// The suites run again through PgBouncer (`IDEM_TEST_POOLER=transaction`,
/// `SUITE_SERVER_CONNECTIONS` for every test's pools at once): the test binary
/// `name` of this build, its tests matching `filter` but `skip`, which
/// must run at least `at_least` tests and pass. Returns how many passed.
fn run_suite_behind(
    bouncer_url: &str,
    name: &str,
    filter: &[&str],
    skip: &[&str],
    at_least: usize,
) -> usize {
    let binary = test_binary(name);
    println!("{name}: {}", binary.display());
    let mut command = std::process::Command::new(&binary);
    command
        .args(filter)
        .env("IDEM_TEST_POSTGRES_URL", bouncer_url)
        .env("IDEM_TEST_POOLER", "transaction")
        .env("RUST_BACKTRACE", "0");
    for test in skip {
        command.args(["--skip", test]);
    }
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("{}: {error}", binary.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{name} behind PgBouncer failed:\n{stdout}\n{stderr}"
    );
    let passed = stdout
        .lines()
        .filter_map(|line| line.strip_prefix("test result: ok. "))
        .filter_map(|rest| rest.split(' ').next()?.parse::<usize>().ok())
        .sum::<usize>();
    assert!(
        passed >= at_least,
        "{name} behind PgBouncer ran {passed} tests, expected at least {at_least}:\n{stdout}"
    );
    println!("{name}: {passed} passed behind PgBouncer");
    passed
}

/// The newest test binary called `name` beside this one
/// (`target/<profile>/deps/<name>-<hash>`): `cargo test` builds every
/// test binary before it runs any.
fn test_binary(name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let prefix = format!("{name}-");
    std::fs::read_dir(deps)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|entry| {
            let file = entry.file_name();
            let file = file.to_string_lossy();
            file.strip_prefix(&prefix)
                .is_some_and(|hash| hash.chars().all(|c| c.is_ascii_hexdigit()))
        })
        .filter_map(|entry| {
            let meta = entry.metadata().ok()?;
            let runnable = meta.is_file() && meta.permissions().mode() & 0o111 != 0;
            Some((meta.modified().ok()?, entry.path())).filter(|_| runnable)
        })
        .max()
        .map(|(_, path)| path)
        .unwrap_or_else(|| {
            panic!(
                "no test binary {name} in {}: run through `cargo test --workspace --all-features`",
                deps.display()
            )
        })
}

/// The PostgreSQL instantiations of the conformance, phased and outbox
/// suites and the storage contracts (keys' operations, leases, outbox,
/// encryption at rest, hashed keys) again, through PgBouncer in transaction mode. Left out, as about a
/// session itself: a session-level isolation set by startup option (which
/// PgBouncer refuses: only a pooler in session mode can keep one), a
/// server session ended by its pid under the pool's feet, and a handler
/// that writes through its connection after its transaction was lost (a
/// bound statement outside any transaction, which such a pooler may parse
/// on one server session and run on another: the application's own
/// statement, not `idem`'s).
/// The server connections the suites share behind PgBouncer: fewer than
/// their pools' connections, so that transactions move between server
/// sessions, and enough for the most a test holds at once (the in-flight
/// duplicates hold two transactions open while a third instance's claim
/// must reach the server to be seen waiting) beside the test running in
/// parallel with it.
const SUITE_SERVER_CONNECTIONS: u32 = 8;

#[test]
fn the_suites_pass_behind_pgbouncer() {
    let bouncer = PgBouncer::start(&upstream(), SUITE_SERVER_CONNECTIONS);
    let url = bouncer.url(&upstream());
    let mut passed = 0;
    passed += run_suite_behind(
        &url,
        "conformance",
        &["postgres"],
        &[
            "serialization_failures_at_commit_are_503",
            "postgres_ended_idle_sessions_are_replaced",
            "lost_transactions_are_not_successes",
            "postgres_handlers_that_lose_their_connection_are_503",
        ],
        39,
    );
    passed += run_suite_behind(&url, "phased", &["postgres"], &[], 12);
    passed += run_suite_behind(&url, "outbox", &["postgres"], &[], 8);
    passed += run_suite_behind(
        &url,
        "idem_runtime",
        &[
            "backend::postgres::tests::the_",
            "sealing_contract::the_encryption_contract_holds_on_postgres",
            "hashing_contract::the_hashing_contract_holds_on_postgres",
        ],
        &["the_longest_table_name", "the_sweeper_spares"],
        5,
    );
    println!("{passed} tests passed behind PgBouncer");
}
