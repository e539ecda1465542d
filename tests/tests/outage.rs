//! The database going away and coming back, and a deployment migrating it,
//! while requests are in flight. A proxy between the service and
//! PostgreSQL stands in for the restart: the real server is shared with
//! other tests and stays up.

use idem_tests::hardening;
use idem_tests::pg_proxy;

use std::time::Duration;

use hardening::{Answer, Server, connect, effects, send, unique};
use idem::Idem;
use pg_proxy::PgProxy;
use sqlx::postgres::PgPoolOptions;

const OP_BODY: &str = r#"{"note":"outage"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_outage_is_503_and_service_resumes_by_itself() {
    const IN_FLIGHT: usize = 3;
    const LOAD_CLIENTS: usize = 6;
    const LOAD_EACH: usize = 3;
    let direct = connect(4).await;
    let proxy = PgProxy::start(hardening::upstream().await).await;
    let url = hardening::url_via(proxy.addr());
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_millis(800))
        .connect(&url)
        .await
        .unwrap();
    let server = Server::start(Idem::new(pool)).await;
    let scope = unique("outage");
    let client = server.client(&scope);

    let before = send(client.post("before", OP_BODY)).await;
    assert_eq!(before.status, 201);

    // Requests inside their transactions when the database goes away.
    let held: Vec<_> = (0..IN_FLIGHT)
        .map(|i| {
            let name = format!("{scope}-held-{i}");
            let hold = server.state.holds.get(&name);
            let request = client
                .post(&format!("held-{i}"), OP_BODY)
                .header("x-test-mode", format!("hold:{name}"))
                .send();
            (hold, tokio::spawn(request))
        })
        .collect();
    for (hold, _) in &held {
        hold.entered().await;
    }

    // "Restart": every connection dropped, new ones refused.
    proxy.set_refuse(true);
    proxy.cut_all();
    for (hold, request) in held {
        hold.release.notify_one();
        let answer = Answer::of(request.await.unwrap().unwrap()).await.unwrap();
        assert_unavailable(&answer);
    }
    // Load while it is down: every answer a prompt 503, none stored.
    let load = (0..LOAD_CLIENTS).map(|c| {
        let client = client.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            for i in 0..LOAD_EACH {
                answers.push(send(client.post(&format!("down-{c}-{i}"), OP_BODY)).await);
            }
            answers
        })
    });
    for task in load.collect::<Vec<_>>() {
        for answer in task.await.unwrap() {
            assert_unavailable(&answer);
        }
    }
    // Even the finished key cannot be read back: 503, not a wrong answer.
    assert_unavailable(&send(client.post("before", OP_BODY)).await);
    assert_eq!(
        hardening::keys_in_scope(&direct, &scope).await,
        1,
        "only `before` is stored"
    );
    assert_eq!(hardening::effects_in_scope(&direct, &scope).await, 1);

    // Back up. The server is not touched: the next request just works.
    proxy.set_refuse(false);
    let replay = send(client.post("before", OP_BODY)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, before.body);
    let keys = (0..IN_FLIGHT).map(|i| format!("held-{i}")).chain(
        (0..LOAD_CLIENTS).flat_map(|c| (0..LOAD_EACH).map(move |i| format!("down-{c}-{i}"))),
    );
    for key in keys {
        let answer = send(client.post(&key, OP_BODY)).await;
        assert_eq!(answer.status, 201, "{key}: {answer:?}");
        assert!(
            !answer.replayed(),
            "{key}: nothing was stored during the outage"
        );
        assert_eq!(effects(&direct, &scope, &key).await.len(), 1, "{key}");
    }
    assert_eq!(
        hardening::effects_in_scope(&direct, &scope).await,
        (1 + IN_FLIGHT + LOAD_CLIENTS * LOAD_EACH) as i64
    );
}

fn assert_unavailable(answer: &Answer) {
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(answer.header("retry-after"), Some("1"), "{answer:?}");
    assert_eq!(answer.problem_code(), "idempotency_store_unavailable");
}

/// A new instance runs `migrate()` on start while others serve: with a
/// claim transaction open (a handler mid-flight), the migration must
/// neither wait for it nor make new claims wait behind the migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_while_claims_are_open_blocks_nobody() {
    let pool = connect(8).await;
    let server = Server::start(Idem::new(pool.clone())).await;
    let scope = unique("deploy");
    let client = server.client(&scope);
    let hold = server.state.holds.get(&scope);
    let held = tokio::spawn(
        client
            .post("in-flight", OP_BODY)
            .header("x-test-mode", format!("hold:{scope}"))
            .send(),
    );
    hold.entered().await;

    // The new instance's start-up migration, on its own connection.
    let migrating = tokio::spawn({
        let pool = pool.clone();
        async move { Idem::new(pool).migrate().await }
    });
    let migrated = tokio::time::timeout(Duration::from_secs(15), async {
        // Either it is done, or it is queued for a table lock: then a
        // fresh claim in the meantime shows whether others queue behind it.
        loop {
            if migrating.is_finished() {
                return true;
            }
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND query LIKE 'CREATE TABLE IF NOT EXISTS idem_keys%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if waiting > 0 {
                return false;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or(false);
    let fresh = send(
        client
            .post("fresh", OP_BODY)
            .timeout(Duration::from_secs(5)),
    )
    .await;

    // Release the handler first, so a stuck migration ends with the test.
    hold.release.notify_one();
    let held = Answer::of(held.await.unwrap().unwrap()).await.unwrap();
    assert_eq!(held.status, 201);
    let finished = tokio::time::timeout(Duration::from_secs(15), migrating).await;
    assert!(
        migrated,
        "migrate() waited for an open claim transaction (CREATE INDEX IF NOT EXISTS takes a \
         SHARE lock on the key table even when the index exists); meanwhile a fresh claim \
         got {fresh:?}"
    );
    assert_eq!(fresh.status, 201, "a claim during the migration: {fresh:?}");
    finished.unwrap().unwrap().expect("migrate");
}
