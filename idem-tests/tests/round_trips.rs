//! What the wrapper costs on the wire: database round trips of one request,
//! counted exactly through a proxy, for the same handler with and without
//! `#[idempotent]`. A regression here is paid on every write, so it fails CI.
//!
//! Also checks the proxy itself (cut, refuse, cut at commit), which the
//! chaos tests rely on.

use idem_tests::pg_proxy;
use idem_tests::round_trip_service as service;

use std::time::{Duration, Instant};

use pg_proxy::{CutOnCommit, PgProxy};
use service::{
    Proxied, Service, count, create_table, database_url, direct, drop_table, settle, through,
    unique,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

/// Round trips of a first attempt and of its replays, against the same
/// handler without the attribute, on a pool that pings a connection as it
/// hands it out (sqlx's default `test_before_acquire`) and as it takes it
/// back. By default `idem` takes an idle connection without the first
/// ping, since its first statement tests the connection anyway: a first
/// attempt then costs one round trip fewer than the plain handler, and a
/// replay two. With `checked_acquire(true)` it pays the ping, as the plain
/// handler does, and adds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_first_attempt_adds_no_round_trip() {
    for checked in [false, true] {
        first_attempts_and_replays(checked).await;
    }
}

async fn first_attempts_and_replays(checked: bool) {
    let fixture = Proxied::start_configured("rt", |idem| idem.checked_acquire(checked)).await;
    let Proxied {
        proxy,
        pool,
        service,
        ..
    } = &fixture;
    // The pool's own pings: one as a connection is handed out (which
    // `idem` saves unless `checked`), one as it comes back.
    let saved = u64::from(!checked);

    for statements in [1, 3] {
        // Steady state: statements prepared and cached on both routes.
        for warm in 0..3 {
            let key = unique("warm");
            for route in ["/baseline", "/idempotent", "/idempotent"] {
                let status = service.post(route, &key, statements).await.status();
                assert_eq!(status, 201, "warm-up {warm} {route}");
            }
        }

        let (base, response) =
            count(proxy, pool, service, "/baseline", &unique("b"), statements).await;
        assert_eq!(response.status(), 201);
        let key = unique("k");
        let (idem, response) = count(proxy, pool, service, "/idempotent", &key, statements).await;
        assert_eq!(response.status(), 201);
        let (replay, response) = count(proxy, pool, service, "/idempotent", &key, statements).await;
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true");

        let extra = idem as i64 - base as i64;
        println!(
            "checked_acquire({checked}), statements={statements}: baseline {base} round trips, \
             idempotent {idem} (extra_round_trips = {extra}), replay {replay}"
        );
        // The design's budget is one; the claim rides on BEGIN and the
        // stored response on COMMIT, so the wrapper adds none, and saves
        // the first ping where it may. Keep it there.
        assert!(extra <= 1, "the wrapper adds {extra} round trips");
        assert_eq!(
            extra,
            -(saved as i64),
            "the wrapper adds {extra} round trips"
        );
        // The baseline is its pool pings, BEGIN, the statements, COMMIT.
        let pings = base - statements as u64 - 2;
        assert_eq!(pings, 2, "the pool pings on the way out and back");
        // A replay in the process that stored the response: one plain
        // read, no transaction, and the pool's pings.
        assert_eq!(
            replay,
            pings - saved + 1,
            "a replay takes {replay} round trips"
        );

        // Another instance never saw the key finish: its first replay
        // goes through the claim (which finds the finished row) and its
        // rollback; from then on it knows the key too.
        let mut other =
            Service::start_configured(pool.clone(), &fixture.keys, &fixture.table, |idem| {
                idem.checked_acquire(checked)
            })
            .await;
        other.account.clone_from(&service.account);
        for (attempt, expected) in [(1, pings - saved + 2), (2, pings - saved + 1)] {
            let (round_trips, answer) =
                count(proxy, pool, &other, "/idempotent", &key, statements).await;
            assert_eq!(answer.headers()["idempotent-replayed"], "true");
            assert_eq!(
                round_trips, expected,
                "replay {attempt} on another instance"
            );
        }
    }

    fixture.stop().await;
}

/// The statements of each simple query (idem's values are hex, so a `;`
/// only ever separates statements), each as its first three words, an
/// `EXECUTE` as the suffix of its statement's name.
fn verbs(queries: &[String]) -> Vec<Vec<String>> {
    queries
        .iter()
        .map(|query| {
            query
                .split(';')
                .map(str::trim)
                .filter(|statement| !statement.is_empty())
                .map(|statement| {
                    let words: Vec<&str> = statement.split_whitespace().take(3).collect();
                    match words.as_slice() {
                        ["EXECUTE", name, ..] => {
                            let suffix = name.split('(').next().unwrap_or(name);
                            format!("EXECUTE {}", suffix.rsplit('_').next().unwrap_or(suffix))
                        }
                        words => words.join(" "),
                    }
                })
                .collect()
        })
        .collect()
}

/// One 1-statement request, and the statements it sent.
async fn sent(
    proxy: &PgProxy,
    pool: &PgPool,
    service: &Service,
    route: &str,
    key: &str,
) -> (reqwest::Response, Vec<Vec<String>>) {
    settle(pool).await;
    proxy.record_queries();
    let response = service.post(route, key, 1).await;
    settle(pool).await;
    (response, verbs(&proxy.recorded_queries()))
}

/// What the server parses for a first attempt, beyond the baseline's
/// `BEGIN` and `COMMIT`: the claim and the stored response, each one
/// `EXECUTE` of a prepared statement, the claim's lock timeout set and
/// reset, the bound on a session whose client vanishes, and the empty
/// transaction that keeps sqlx's transaction depth
/// right (opened after the commit, rolled back with the pool's ping).
/// Statements, not round trips, are most of the wrapper's database cost
/// (`benches/instructions.sh`): this pins their number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_attempt_adds_seven_statements_and_a_replay_through_the_claim_two() {
    let fixture = Proxied::start("verbs").await;
    let Proxied {
        proxy,
        pool,
        service,
        ..
    } = &fixture;
    // Statements prepared on the connection, sqlx's cached.
    for route in ["/baseline", "/idempotent"] {
        let status = service.post(route, &unique("warm"), 1).await.status();
        assert_eq!(status, 201, "warm-up {route}");
    }

    let (response, baseline) = sent(proxy, pool, service, "/baseline", &unique("b")).await;
    assert_eq!(response.status(), 201);
    assert_eq!(baseline, [vec!["BEGIN"], vec!["COMMIT"]]);

    let claim = [
        "BEGIN",
        "SET LOCAL lock_timeout",
        "SET LOCAL idle_in_transaction_session_timeout",
        "EXECUTE claim",
        "SET LOCAL lock_timeout",
    ];
    let key = unique("k");
    let (response, first) = sent(proxy, pool, service, "/idempotent", &key).await;
    assert_eq!(response.status(), 201);
    assert_eq!(
        first,
        [
            claim.to_vec(),
            vec!["EXECUTE finish", "COMMIT", "BEGIN"],
            vec!["ROLLBACK"],
        ]
    );

    // Another instance, which never saw the key finish: the claim fails on
    // the taken key, and one more round trip ends the transaction and
    // reads the row.
    let mut other = Service::start(pool.clone(), &fixture.keys, &fixture.table).await;
    other.account.clone_from(&service.account);
    let (replay, replayed) = sent(proxy, pool, &other, "/idempotent", &key).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(
        replayed,
        [claim.to_vec(), vec!["ROLLBACK", "EXECUTE select"],]
    );
    drop(other);
    fixture.stop().await;
}

/// The read that answers a retry this process saw finish is only a hint's
/// fast path: when the server refuses it, the claim answers instead, the
/// same replay, and the next retry reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_read_falls_back_to_the_claim() {
    let fixture = Proxied::start("peek").await;
    let Proxied {
        admin,
        table,
        proxy,
        service,
        ..
    } = &fixture;
    let key = unique("k");
    let first = service.post("/idempotent", &key, 1).await;
    assert_eq!(first.status(), 201);
    let body = first.text().await.unwrap();
    let effects = rows(admin, table).await;

    // The server rejects the read (an unknown column): the claim answers.
    proxy.set_rewrite(Some(("AND status IS NOT NULL", "AND no_such_column")));
    proxy.record_queries();
    let replay = service.post("/idempotent", &key, 1).await;
    let claimed = proxy.recorded_queries();
    proxy.set_rewrite(None);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), body);
    assert!(
        claimed.iter().any(|sql| sql.starts_with("BEGIN")),
        "no claim among {claimed:#?}"
    );

    // The claim found the key finished: the next retry reads again.
    proxy.record_queries();
    let replay = service.post("/idempotent", &key, 1).await;
    let sent = proxy.recorded_queries();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), body);
    assert!(sent.is_empty(), "a claim among {sent:#?}");
    assert_eq!(rows(admin, table).await, effects, "replayed, not rerun");

    fixture.stop().await;
}

/// idem's statements on this connection: the server's own list.
async fn idem_statements(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'idem\\_%' ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .expect("list prepared statements")
}

async fn deallocate(pool: &PgPool, names: &[String]) {
    for name in names {
        sqlx::raw_sql(AssertSqlSafe(format!("DEALLOCATE {name}")))
            .execute(pool)
            .await
            .expect("deallocate");
    }
}

/// The claim, select, expiry delete and finish are prepared once per
/// connection (planning them per request was most of the wrapper's
/// database CPU), and a session that lost them (`DEALLOCATE`, `DISCARD
/// ALL`) prepares them again without failing a request or half-doing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_are_prepared_once_per_connection_and_again_when_lost() {
    let fixture = Proxied::start("ps").await;
    let Proxied {
        admin,
        table,
        keys,
        proxy,
        pool,
        service,
    } = &fixture;

    assert!(idem_statements(pool).await.is_empty());
    let (first, response) = count(proxy, pool, service, "/idempotent", &unique("k"), 1).await;
    assert_eq!(response.status(), 201);
    let prepared = idem_statements(pool).await;
    assert_eq!(
        prepared.len(),
        4,
        "claim, select, take over, finish: {prepared:?}"
    );
    // Preparing costs the first claim on a connection two round trips
    // (the failed EXECUTE's rollback with the lookup; the PREPAREs ride on
    // the claim), and sqlx prepares the handler's INSERT once.
    let (warm, response) = count(proxy, pool, service, "/idempotent", &unique("k"), 1).await;
    assert_eq!(response.status(), 201);
    assert_eq!(first, warm + 3, "first {first}, then {warm}");
    let (again, _) = count(proxy, pool, service, "/idempotent", &unique("k"), 1).await;
    assert_eq!(again, warm, "prepared once, not per request");

    // All lost: the next claim prepares them again, and its key works.
    deallocate(pool, &prepared).await;
    let key = unique("lost");
    let response = service.post("/idempotent", &key, 1).await;
    assert_eq!(response.status(), 201);
    let replay = service.post("/idempotent", &key, 1).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(idem_statements(pool).await, prepared);

    // Only the finish lost: the claim cannot notice, so that one request
    // fails whole (nothing committed, no key stored, 503), its connection
    // is replaced, and its retry runs as a first attempt.
    let finish: Vec<String> = prepared
        .iter()
        .filter(|name| name.ends_with("_finish"))
        .cloned()
        .collect();
    deallocate(pool, &finish).await;
    let before = rows(admin, table).await;
    let key = unique("finish-lost");
    let response = service.post("/idempotent", &key, 1).await;
    assert_eq!(response.status(), 503);
    assert_eq!(
        rows(admin, table).await,
        before,
        "no effect without its memory"
    );
    let stored: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {keys} WHERE key = $1"
    )))
    .bind(key.as_bytes())
    .fetch_one(admin)
    .await
    .unwrap();
    assert_eq!(stored, 0, "no memory without its effect");
    let retry = service.post("/idempotent", &key, 1).await;
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(rows(admin, table).await, before + 1);
    assert_eq!(idem_statements(pool).await, prepared);

    fixture.stop().await;
}

/// Behind a pooler that moves server sessions under a connection, a claim
/// can look up its statements on one session and prepare them on another
/// that has them. The proxy simulates that (the lookup is told nothing is
/// prepared): the claim then runs, and the finish stores, with inlined
/// arguments, and the request is neither failed nor half-done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_cannot_keep_statements_gets_them_inlined() {
    let fixture = Proxied::start("pool").await;
    let Proxied {
        admin,
        table,
        proxy,
        pool,
        service,
        ..
    } = &fixture;
    let response = service.post("/idempotent", &unique("k"), 1).await;
    assert_eq!(response.status(), 201);
    let prepared = idem_statements(pool).await;
    assert_eq!(prepared.len(), 4);

    // The claim's statement is gone; the lookup will say all are, so the
    // claim's PREPAREs collide with the three still there.
    let claim: Vec<String> = prepared
        .iter()
        .filter(|name| name.ends_with("_claim"))
        .cloned()
        .collect();
    deallocate(pool, &claim).await;
    proxy.set_rewrite(Some((
        "pg_catalog.pg_prepared_statements WHERE",
        "pg_catalog.pg_prepared_statements WHERE false AND",
    )));
    settle(pool).await;
    proxy.record_queries();
    let before = rows(admin, table).await;
    let key = unique("inlined");
    let response = service.post("/idempotent", &key, 1).await;
    assert_eq!(response.status(), 201);
    let body = response.text().await.unwrap();
    settle(pool).await;
    let sent = proxy.recorded_queries();
    proxy.set_rewrite(None);
    assert_eq!(rows(admin, table).await, before + 1);

    let inlined = |needle: &str| {
        sent.iter()
            .any(|sql| sql.contains(needle) && !sql.contains("EXECUTE"))
    };
    assert!(
        inlined("(scope, key, fingerprint, expires_at) VALUES (E'"),
        "no inlined claim among {sent:#?}"
    );
    assert!(
        inlined("SET status = 201"),
        "no inlined finish among {sent:#?}"
    );
    let replay = service.post("/idempotent", &key, 1).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), body);
    assert_eq!(rows(admin, table).await, before + 1, "replayed, not rerun");

    // The session kept what it prepared: the next claim runs prepared.
    assert_eq!(idem_statements(pool).await, prepared);
    proxy.record_queries();
    let response = service.post("/idempotent", &unique("k"), 1).await;
    assert_eq!(response.status(), 201);
    settle(pool).await;
    assert!(
        proxy
            .recorded_queries()
            .iter()
            .any(|sql| sql.starts_with("EXECUTE") && sql.ends_with("COMMIT; BEGIN")),
        "the finish went back to its prepared statement"
    );

    fixture.stop().await;
}

/// The claim waits at most `wait` (here 1 ms) for a concurrent attempt, but
/// the handler's statements and the commit run under the connection's
/// configured `lock_timeout`, not the claim's: a handler that waits on a
/// busy row must not fail after a millisecond.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_runs_under_the_configured_lock_timeout_not_the_claims() {
    let (admin, _) = direct().await;
    let keys = unique("lt_keys");
    for (configured, expected) in [(None, "0"), (Some("7s"), "7s")] {
        let mut options: sqlx::postgres::PgConnectOptions =
            database_url().parse().expect("database URL");
        if let Some(value) = configured {
            options = options.options([("lock_timeout", value)]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("connect");
        let service = Service::start(pool.clone(), &keys, "unused").await;
        for attempt in 0..3 {
            let response = service.post("/lock_timeout", &unique("k"), 0).await;
            assert_eq!(response.status(), 200);
            let seen = response.text().await.unwrap();
            assert_eq!(
                seen, expected,
                "attempt {attempt}, configured {configured:?}"
            );
        }
        drop(service);
        pool.close().await;
    }
    drop_table(&admin, &keys).await;
}

// ----------------------------------------------------------- the proxy itself

async fn insert(pool: &PgPool, table: &str) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (account, amount) VALUES ('proxy', 1)"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

async fn rows(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .expect("count rows")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_counts_queries_and_syncs() {
    let (_, upstream) = direct().await;
    let proxy = PgProxy::start(upstream).await;
    let pool = through(&proxy).await;
    settle(&pool).await;
    proxy.reset();
    // Simple protocol: one Query.
    sqlx::raw_sql("SELECT 1").execute(&pool).await.unwrap();
    settle(&pool).await;
    let simple = proxy.round_trips();
    // Extended protocol: sqlx prepares a statement the first time it sees
    // it on a connection (Parse/Describe, Sync), then runs it
    // (Bind/Execute, Sync): hence the warm-up before every count.
    let mut extended = Vec::new();
    for _ in 0..2 {
        proxy.reset();
        sqlx::query("SELECT $1::int")
            .bind(1)
            .execute(&pool)
            .await
            .unwrap();
        settle(&pool).await;
        extended.push(proxy.round_trips());
    }
    assert_eq!(extended, [simple + 1, simple], "cold, then cached");
    assert_eq!(proxy.queries(), 0);
    assert!(proxy.syncs() >= 1);
    // A dropped transaction: sqlx queues its ROLLBACK, which goes out with
    // the pool's return ping, two messages in one round trip.
    proxy.reset();
    drop(pool.begin().await.unwrap());
    settle(&pool).await;
    assert_eq!(proxy.queries(), 2, "BEGIN and ROLLBACK");
    assert_eq!(proxy.round_trips(), simple, "the ROLLBACK rode on the ping");
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_cuts_and_refuses() {
    let (_, upstream) = direct().await;
    let proxy = PgProxy::start(upstream).await;
    let pool = through(&proxy).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql("SELECT 1").execute(&mut *conn).await.unwrap();
    proxy.cut_all();
    assert!(sqlx::raw_sql("SELECT 1").execute(&mut *conn).await.is_err());
    conn.close_on_drop();
    drop(conn);

    proxy.set_refuse(true);
    let refused = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(
            database_url()
                .parse::<sqlx::postgres::PgConnectOptions>()
                .unwrap()
                .host("127.0.0.1")
                .port(proxy.addr().port())
                .ssl_mode(sqlx::postgres::PgSslMode::Disable),
        )
        .await;
    assert!(refused.is_err(), "connected while refusing");
    proxy.set_refuse(false);
    sqlx::raw_sql("SELECT 1").execute(&pool).await.unwrap();
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_cuts_at_commit_before_or_after_forwarding() {
    let (admin, upstream) = direct().await;
    let table = unique("rt_cut");
    create_table(&admin, &table).await;
    let proxy = PgProxy::start(upstream).await;
    let pool = through(&proxy).await;

    proxy.set_cut_on_commit(CutOnCommit::BeforeForwarding);
    assert!(insert(&pool, &table).await.is_err());
    assert_eq!(rows(&admin, &table).await, 0, "the server never saw COMMIT");

    proxy.set_cut_on_commit(CutOnCommit::AfterForwarding);
    assert!(insert(&pool, &table).await.is_err());
    // The server commits what it received before the connection closed.
    let deadline = Instant::now() + Duration::from_secs(5);
    while rows(&admin, &table).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the forwarded COMMIT never landed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    proxy.set_cut_on_commit(CutOnCommit::Off);
    insert(&pool, &table).await.expect("commits again once off");
    assert_eq!(rows(&admin, &table).await, 2);
    pool.close().await;
    drop_table(&admin, &table).await;
}
