//! What only PostgreSQL shows on the wire: the statements `idem` sends
//! (prepared once per connection, inlined where a session cannot keep
//! them), the claim's fallback for a refused read, and the lock timeout
//! the handler runs under.

use idem::{Idem, Pooler};
use idem_tests::engines::postgres as engine;
use idem_tests::round_trip_service::{Service, Wired, drop_table, settle, unique};

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool, Postgres};

type Proxied = Wired<Postgres>;

/// The statements of each simple query (idem's values are hex, so a `;`
/// only ever separates statements), each as its first three words, an
/// `EXECUTE` as the suffix of its statement's name, a call of one of the
/// key table's functions as `CALL` and the function's suffix.
fn verbs(queries: &[String]) -> Vec<Vec<String>> {
    queries
        .iter()
        .map(|query| {
            query
                .split(';')
                .map(str::trim)
                .filter(|statement| !statement.is_empty())
                .map(|statement| {
                    let call = statement
                        .split_whitespace()
                        .find(|word| word.contains("_idem_") && word.contains('('));
                    if let Some(call) = call {
                        let function = call.split('(').next().unwrap_or(call);
                        let suffix = function.rsplit("_idem_").next().unwrap_or(function);
                        return format!("CALL {suffix}");
                    }
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
    fixture: &Proxied,
    service: &Service,
    route: &str,
    key: &str,
) -> (reqwest::Response, Vec<Vec<String>>) {
    let Proxied { proxy, pool, .. } = fixture;
    settle(pool).await;
    proxy.record();
    let response = service.post(route, key, 1).await;
    settle(pool).await;
    (response, verbs(&proxy.recorded_queries()))
}

/// One request to each route, so that the connection has prepared its
/// statements and sqlx cached its own.
async fn warm_up(service: &Service) {
    for route in ["/baseline", "/idempotent"] {
        let status = service.post(route, &unique("warm"), 1).await.status();
        assert_eq!(status, 201, "warm-up {route}");
    }
}

/// A first attempt at a fresh key sends `claim`, then the stored response
/// with the `COMMIT` and the empty transaction sqlx counts, then sqlx's
/// `ROLLBACK` of it. Another instance of the service (its store configured
/// by `configure`, as the fixture's), which never saw the key finish, then
/// replays it through the same claim, which fails on the taken key: one
/// more round trip ends the transaction and reads the row.
/// `finish` and `read` are how the stored response and the read of the
/// taken key are sent.
async fn first_attempt_and_replay_elsewhere(
    fixture: &Proxied,
    claim: &[&str],
    [finish, read]: [&str; 2],
    configure: impl FnOnce(Idem<Postgres>) -> Idem<Postgres>,
) -> String {
    let Proxied { pool, service, .. } = fixture;
    let key = unique("k");
    let (response, first) = sent(fixture, service, "/idempotent", &key).await;
    assert_eq!(response.status(), 201);
    assert_eq!(
        first,
        [
            claim.to_vec(),
            vec![finish, "COMMIT", "BEGIN"],
            vec!["ROLLBACK"],
        ]
    );

    let mut other =
        Service::start_configured(pool.clone(), &fixture.keys, &fixture.table, configure).await;
    other.account.clone_from(&service.account);
    let (replay, replayed) = sent(fixture, &other, "/idempotent", &key).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replayed, [claim.to_vec(), vec!["ROLLBACK", read]]);
    key
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
    warm_up(&fixture.service).await;

    let (response, baseline) = sent(&fixture, &fixture.service, "/baseline", &unique("b")).await;
    assert_eq!(response.status(), 201);
    assert_eq!(baseline, [vec!["BEGIN"], vec!["COMMIT"]]);

    let claim = [
        "BEGIN",
        "SET LOCAL lock_timeout",
        "SET LOCAL idle_in_transaction_session_timeout",
        "EXECUTE claim",
        "SET LOCAL lock_timeout",
    ];
    let prepared = ["EXECUTE finish", "EXECUTE select"];
    first_attempt_and_replay_elsewhere(&fixture, &claim, prepared, |idem| idem).await;
    fixture.stop().await;
}

/// The advisory claim (PostgreSQL proper, the default): a first attempt's
/// claim is one round trip with no lock timeout to set or reset, the
/// advisory lock taken inside its one statement; the rest is the portable
/// claim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_advisory_claim_is_one_round_trip_with_no_lock_timeout() {
    let advisory = |idem: Idem<Postgres>| idem.advisory_locks(true);
    let fixture = Proxied::start_configured("advisory", advisory).await;
    // The once-per-server probe made, too.
    warm_up(&fixture.service).await;

    let claim = [
        "BEGIN",
        "SET LOCAL idle_in_transaction_session_timeout",
        "EXECUTE try",
    ];
    let prepared = ["EXECUTE finish", "EXECUTE select"];
    first_attempt_and_replay_elsewhere(&fixture, &claim, prepared, advisory).await;
    fixture.stop().await;
}

/// Behind a declared pooler, the advisory claim is one call of the key
/// table's claim function and the stored response one call of the
/// finish's, in the same round trips as the prepared statements; the read
/// of a taken key is inlined; a retry this process saw finish is one call
/// of the read's function.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_pooler_the_claim_finish_and_read_call_the_tables_functions() {
    let pooled = |idem: Idem<Postgres>| idem.advisory_locks(true).pooler(Pooler::Transaction);
    let fixture = Proxied::start_configured("pooled", pooled).await;
    // The once-per-server probe and the functions' lookup made, too.
    warm_up(&fixture.service).await;

    let calls = ["CALL finish_v1", "SELECT status, fingerprint,"];
    let claim = ["BEGIN", "CALL claim_v1"];
    let key = first_attempt_and_replay_elsewhere(&fixture, &claim, calls, pooled).await;
    let (replay, read) = sent(&fixture, &fixture.service, "/idempotent", &key).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(read, [["CALL peek_v1"]]);
    assert!(idem_statements(&fixture.pool).await.is_empty());
    let (admin, keys) = (fixture.admin.clone(), fixture.keys.clone());
    fixture.stop().await;
    engine::drop_functions(&admin, &keys).await;
}

/// The read that answers a retry this process saw finish is only a hint's
/// fast path: when the server refuses it, the claim answers instead, the
/// same replay, and the next retry reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_read_falls_back_to_the_claim() {
    let fixture = Proxied::start("peek").await;
    let Proxied { proxy, service, .. } = &fixture;
    let key = unique("k");
    let first = service.post("/idempotent", &key, 1).await;
    assert_eq!(first.status(), 201);
    let body = first.text().await.unwrap();
    let effects = fixture.rows().await;

    // The server rejects the read (an unknown column): the claim answers.
    proxy.set_rewrite(Some(("AND status IS NOT NULL", "AND no_such_column")));
    proxy.record();
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
    proxy.record();
    let replay = service.post("/idempotent", &key, 1).await;
    let sent = proxy.recorded_queries();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), body);
    assert!(sent.is_empty(), "a claim among {sent:#?}");
    assert_eq!(fixture.rows().await, effects, "replayed, not rerun");

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
        keys,
        pool,
        service,
        ..
    } = &fixture;

    assert!(idem_statements(pool).await.is_empty());
    let (first, _, response) = fixture.count(service, "/idempotent", &unique("k"), 1).await;
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
    let (warm, _, response) = fixture.count(service, "/idempotent", &unique("k"), 1).await;
    assert_eq!(response.status(), 201);
    assert_eq!(first, warm + 3, "first {first}, then {warm}");
    let (again, _, _) = fixture.count(service, "/idempotent", &unique("k"), 1).await;
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
    let before = fixture.rows().await;
    let key = unique("finish-lost");
    let response = service.post("/idempotent", &key, 1).await;
    assert_eq!(response.status(), 503);
    assert_eq!(fixture.rows().await, before, "no effect without its memory");
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
    assert_eq!(fixture.rows().await, before + 1);
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
    proxy.record();
    let before = fixture.rows().await;
    let key = unique("inlined");
    let response = service.post("/idempotent", &key, 1).await;
    assert_eq!(response.status(), 201);
    let body = response.text().await.unwrap();
    settle(pool).await;
    let sent = proxy.recorded_queries();
    proxy.set_rewrite(None);
    assert_eq!(fixture.rows().await, before + 1);

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
    assert_eq!(fixture.rows().await, before + 1, "replayed, not rerun");

    // The session kept what it prepared: the next claim runs prepared.
    assert_eq!(idem_statements(pool).await, prepared);
    proxy.record();
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
    let admin = engine::pool(2).await;
    let keys = unique("lt_keys");
    for (configured, expected) in [(None, "0"), (Some("7s"), "7s")] {
        let mut options: sqlx::postgres::PgConnectOptions =
            engine::url().parse().expect("database URL");
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
