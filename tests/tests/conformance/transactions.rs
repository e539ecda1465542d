//! The request's transaction as sqlx sees it: a handler's nested
//! transactions are savepoints of it, and every connection goes back to
//! the pool outside any transaction, whichever way the request went.

use reqwest::{Method, StatusCode};
use sqlx::Connection;

use crate::app::TestDb;
use crate::harness::{send, start, start_with, unique};
use crate::suite::BODY;

/// A transaction the handler opens on its `Tx` (sqlx's `begin`, as
/// repository code does) is a savepoint of the request's: released, rolled
/// back or dropped, the request's claim, effects and stored response still
/// commit together, or not at all.
pub async fn nested_transactions_are_savepoints<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("nested");
    let client = server.client(&caller);
    let mode = |key: &str, mode: &str| {
        client
            .post("/effects", key, BODY)
            .header("x-test-mode", format!("savepoint:{mode}"))
    };
    let mut effects = 0;
    for (key, nested_kept) in [("commit", true), ("rollback", false), ("drop", false)] {
        let first = send(mode(key, key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}: {first:?}");
        effects += 1 + i64::from(nested_kept);
        assert_eq!(server.effects(&caller).await, effects, "{key}");
        let retry = send(client.post("/effects", key, BODY)).await;
        assert!(
            retry.replayed(),
            "{key}: the response was not stored: {retry:?}"
        );
        assert_eq!(retry.body, first.body);
        assert_eq!(server.effects(&caller).await, effects, "{key}: ran twice");
    }
    // A released savepoint, then a transient failure: nothing stays.
    let failed = send(mode("failed", "commit:503")).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.effects(&caller).await, effects, "a 503 kept effects");
    assert_eq!(server.keys(&caller).await, 3, "a 503 kept its key");
    let again = send(client.post("/effects", "failed", BODY)).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed());
}

/// Every way a request can end leaves its connection outside any
/// transaction, in the database and in sqlx's count: one that came back
/// still counted inside a transaction would turn the next user's `begin()`
/// into a savepoint of nothing.
pub async fn connections_come_back_outside_any_transaction<DB: TestDb>() {
    let server = start::<DB>().await;
    // Another instance on the same pool never saw the key finish: its
    // retries go through the claim, which finds the key taken.
    let other = start_with::<DB>(server.state.idem.pool().clone()).await;
    let caller = unique("clean");
    let client = server.client(&caller);
    let elsewhere = other.client(&caller);
    let mode = |key: &str, mode: &str| {
        client
            .post("/effects", key, BODY)
            .header("x-test-mode", mode.to_owned())
    };
    let keyless = client
        .request(Method::POST, "/effects/optional")
        .header("content-type", "application/json")
        .body(BODY);
    let mut statuses = Vec::new();
    for request in [
        client.post("/effects", "k", BODY),
        client.post("/effects", "k", BODY),
        elsewhere.post("/effects", "k", BODY),
        elsewhere.post("/effects", "k", r#"{"note":"another"}"#),
        mode("failed", "fail-503"),
        mode("nested", "savepoint:rollback"),
        keyless,
    ] {
        statuses.push(send(request).await.status.as_u16());
    }
    assert_eq!(statuses, [201, 201, 201, 422, 503, 201, 201]);
    let (hold, first) = server
        .send_held(client.post("/effects", "held", BODY), &caller)
        .await;
    let busy = send(client.post("/effects", "held", BODY)).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    hold.release.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);

    for conn in &mut server.pooled_connections().await {
        assert!(
            !conn.is_in_transaction(),
            "a connection came back inside a transaction"
        );
        // sqlx's count can be wrong the other way, and a plain `BEGIN`
        // inside a transaction only warns (PostgreSQL) or commits it
        // (MySQL): ask the database.
        assert!(
            !DB::in_transaction(&mut **conn).await,
            "a connection came back inside a transaction, unknown to sqlx"
        );
        let plain = conn.begin().await.expect("a plain BEGIN");
        plain.commit().await.expect("its COMMIT");
    }
}

/// A handler that catches the error of a statement after which the engine
/// ended its transaction (PostgreSQL's failed transaction, InnoDB's
/// deadlock victim, SQLite's `INSERT OR ROLLBACK`), and answers 201 anyway,
/// is not reported as a success: its effect is gone, so its client is told
/// 500 (the handler's fault, not the store's) and a retry runs it again.
/// With a key (on MySQL, the finish must not commit in autocommit) and
/// without one (PostgreSQL answers `COMMIT` in a failed transaction with a
/// silent rollback).
pub async fn ended_transactions_are_not_successes<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("ended");
    let client = server.client(&caller);
    let keyed = client
        .post("/effects", "k", BODY)
        .header("x-test-mode", "end-by-error");
    let keyless = client
        .request(Method::POST, "/effects/optional")
        .header("content-type", "application/json")
        .header("x-test-mode", "end-by-error")
        .body(BODY);
    for (what, request) in [("keyed", keyed), ("keyless", keyless)] {
        let answer = send(request).await;
        assert_eq!(
            answer.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{what}: {answer:?}"
        );
        assert_eq!(answer.problem_code(), "internal_error", "{what}");
        assert_eq!(server.effects(&caller).await, 0, "{what}");
    }
    assert_eq!(server.keys(&caller).await, 0, "no response was stored");

    let retry = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(server.effects(&caller).await, 1);
    assert!(send(client.post("/effects", "k", BODY)).await.replayed());
}

/// A transaction sqlx ended inside the handler is never reported as a
/// success, and nothing the handler writes after that commits on its own.
/// On PostgreSQL a savepoint after a caught error fails, and sqlx 0.9
/// answers by rolling back the whole transaction (its `begin()` guard
/// rolls back at the outer depth): the handler is stopped at its next use
/// of the `Tx`, with a 500, nothing committed and nothing stored; the retry
/// runs once. Elsewhere the failed statement leaves the transaction usable,
/// so the savepoint works and the answer is the handler's, stored.
pub async fn lost_transactions_are_not_successes<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("lost");
    let client = server.client(&caller);
    let lost = || client.post_in_mode("/effects", "k", "savepoint-after-error");
    let first = send(lost()).await;
    if DB::ENGINE == "postgres" {
        first.assert_internal_error();
        assert_eq!(
            server.effects(&caller).await,
            0,
            "a write outside the request's transaction committed"
        );
        assert_eq!(server.keys(&caller).await, 0, "no response was stored");
        let retry = send(client.post("/effects", "k", BODY)).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert!(!retry.replayed());
        assert_eq!(server.effects(&caller).await, 1);

        // Where the handler writes through a connection it borrowed before
        // the loss, idem cannot stop it: that write committed on its own.
        // The answer is still a 500, never the handler's 201.
        let held = "savepoint-after-error-held";
        send(client.post_in_mode("/effects", "held", held))
            .await
            .assert_internal_error();
        assert_eq!(server.keys(&caller).await, 1, "only `k` is stored");
        assert_eq!(
            server.effects(&caller).await,
            2,
            "`k`, and the write after the loss"
        );
        // Without a key too, though no stored response is missing there.
        let keyless = client
            .request(Method::POST, "/effects/optional")
            .header("content-type", "application/json")
            .header("x-test-mode", held)
            .body(BODY);
        send(keyless).await.assert_internal_error();
    } else {
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert_eq!(
            server.effects(&caller).await,
            2,
            "the effect and the later write"
        );
        let retry = send(lost()).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, first.body);
    }

    // A handler that sends its own `ROLLBACK` (sqlx still counts the
    // transaction) is not a success either: the response has no claim to
    // be stored on. Its write after the `ROLLBACK` committed on its own,
    // as it would without idem; nothing else did.
    let caller = unique("rolled_back_by_hand");
    let client = server.client(&caller);
    send(client.post_in_mode("/effects", "k", "raw-rollback"))
        .await
        .assert_internal_error();
    assert_eq!(server.keys(&caller).await, 0, "no response was stored");
    assert_eq!(server.effects(&caller).await, 1, "only the write after it");

    // The same on an expired key: the `ROLLBACK` brings the old, finished
    // row back, and the response must not be written over it.
    let first = send(client.post("/effects/short", "old", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // The passage of time is what is under test here: past the 1 s ttl.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    send(client.post_in_mode("/effects/short", "old", "raw-rollback"))
        .await
        .assert_internal_error();
    let retry = send(client.post("/effects/short", "old", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(
        !retry.replayed(),
        "the old row was finished anew: {retry:?}"
    );

    // A handler that commits its transaction itself: the claim and the
    // effect committed then, and the response is stored just after, so a
    // retry replays it rather than running again.
    let committed = send(client.post_in_mode("/effects", "committed", "raw-commit")).await;
    assert_eq!(committed.status, StatusCode::CREATED, "{committed:?}");
    let retry = send(client.post("/effects", "committed", BODY)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, committed.body);

    // One that commits itself and then fails: its effect and the unfinished
    // claim committed then, with no response to replay. No retry may run
    // it again (a second charge): the key stays in progress, 409, until it
    // expires, on every engine.
    let before = server.effects(&caller).await;
    let failed = "raw-commit-then-error:502";
    let first = send(client.post_in_mode("/effects", "committed-failed", failed)).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(
        server.effects(&caller).await,
        before + 1,
        "committed by hand"
    );
    for _ in 0..2 {
        let retry = send(client.post("/effects", "committed-failed", BODY)).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
        assert_eq!(retry.problem_code(), "idempotency_key_in_use");
    }
    assert_eq!(server.effects(&caller).await, before + 1, "never run again");

    // Every connection came back out of any transaction (or was closed).
    for mut conn in server.pooled_connections().await {
        assert!(!DB::in_transaction(&mut conn).await);
    }
}

/// A handler that returns `Err` after writing rolls back whatever the
/// error's status, as a plain sqlx handler's `?` drops its transaction: a
/// 402 `Err` leaves no effect and stores nothing, so a retry runs again,
/// while the same 402 as `Ok` is stored with its effect.
pub async fn handler_errors_roll_back<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("errors");
    let client = server.client(&caller);
    let mode = |key: &str, mode: &str| {
        client
            .post("/effects", key, BODY)
            .header("x-test-mode", mode.to_owned())
    };
    for status in [402, 404, 409, 200, 201] {
        let key = format!("err{status}");
        let failed = send(mode(&key, &format!("error:{status}"))).await;
        assert_eq!(failed.status.as_u16(), status, "{failed:?}");
        assert_eq!(failed.body, &b"refused\n"[..]);
        assert_eq!(
            server.effects(&caller).await,
            0,
            "Err({status}) kept its write"
        );
        assert_eq!(server.keys(&caller).await, 0, "Err({status}) was stored");
    }
    let retry = send(client.post("/effects", "err402", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(server.effects(&caller).await, 1);

    // Without a key too.
    let keyless = client
        .request(Method::POST, "/effects/optional")
        .header("content-type", "application/json")
        .header("x-test-mode", "error:402")
        .body(BODY);
    assert_eq!(send(keyless).await.status.as_u16(), 402);
    assert_eq!(
        server.effects(&caller).await,
        1,
        "a keyless Err kept its write"
    );

    let refused = send(mode("ok402", "status:402")).await;
    assert_eq!(refused.status.as_u16(), 402);
    assert_eq!(server.effects(&caller).await, 2, "Ok(402) commits");
    let again = send(client.post("/effects", "ok402", BODY)).await;
    assert!(again.replayed(), "Ok(402) is stored: {again:?}");
    assert_eq!(again.body, refused.body);
}
