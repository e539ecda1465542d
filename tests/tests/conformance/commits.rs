//! How a request ends when its commit is lost, when the handler commits by
//! itself and then fails, and when the handler breaks its side of the
//! contract in ways only the end of the request shows.

use std::time::Duration;

use reqwest::{Method, StatusCode};

use crate::app::TestDb;
use crate::harness::{Answer, Client, Server, send, start, start_with, unique};
use crate::suite::BODY;

/// A keyless request for `caller`, the handler in `mode`.
fn keyless(client: &Client, mode: &str) -> reqwest::RequestBuilder {
    client
        .request(Method::POST, "/effects/optional")
        .header("content-type", "application/json")
        .header("x-test-mode", mode.to_owned())
        .body(BODY)
}

/// Asserts the state a failed commit leaves: with a key, a retry tells
/// whether the commit landed (`in_progress`); without one nothing does
/// (`uncertain`). Neither makes a new key safe.
fn assert_commit_unknown(answer: &Answer, keyed: bool) {
    let state = if keyed { "in_progress" } else { "uncertain" };
    assert_eq!(
        answer.operation_state(),
        (state.into(), false),
        "{answer:?}"
    );
}

/// Asserts a 503 `idempotency_store_unavailable`, with `Retry-After`
/// exactly when the request had a key: without one, the outcome of a
/// failed commit is unknown and a retry is not safe.
fn assert_store_failure(answer: &Answer, keyed: bool) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(answer.problem_code(), "idempotency_store_unavailable");
    let retry_after = answer.header("retry-after");
    if keyed {
        assert_eq!(retry_after, Some("1"), "{answer:?}");
    } else {
        assert_eq!(retry_after, None, "{answer:?}");
    }
}

/// A commit lost for the store's reasons (the server ended the handler's
/// session, as a lost connection does; on SQLite, which has none, a
/// reader keeps the commit from its lock until the busy timeout) is a 503,
/// never the handler's 201: with `Retry-After` and a key, without both
/// when the request had no key. Nothing committed, and the key's retry
/// runs the handler once.
pub async fn lost_commits_are_503<DB: TestDb>() {
    let server = start_with::<DB>(DB::commit_losing_pool().await).await;
    let pool = server.state.idem.pool().clone();
    let caller = unique("lost_commit");
    let client = server.client(&caller);
    for keyed in [true, false] {
        let name = format!("{caller}-{keyed}");
        let mode = format!("session:{name}");
        let request = if keyed {
            client.post_in_mode("/effects", "k", &mode)
        } else {
            keyless(&client, &mode)
        };
        let hold = server.state.holds.get(&name);
        let answer = tokio::spawn(send(request));
        hold.entered().await;
        let saboteur = DB::lose_commit(&pool, hold.session()).await;
        hold.release.notify_one();
        let answer = answer.await.unwrap();
        drop(saboteur);
        assert_store_failure(&answer, keyed);
        assert_commit_unknown(&answer, keyed);
        assert_eq!(server.effects(&caller).await, 0, "keyed {keyed}");
        assert_eq!(server.keys(&caller).await, 0, "keyed {keyed}");
    }
    let retry = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
    assert!(send(client.post("/effects", "k", BODY)).await.replayed());
    assert_eq!(server.effects(&caller).await, 1);
}

/// A handler whose statement meets a lost connection (the server ended its
/// session: a failover, a cut) answers 500 itself; the client is told 503
/// with `Retry-After`, the store's failure, since nothing committed (another
/// connection finds no row of the claim) and a retry is safe. The retry
/// runs the handler once. A handler that had committed its own transaction
/// keeps its 500.
pub async fn handlers_that_lose_their_connection_are_503<DB: TestDb>(
    server: &Server<DB>,
    admin: &sqlx::Pool<DB>,
) {
    let caller = unique("lost_connection");
    let client = server.client(&caller);
    let hold = server.state.holds.get(&caller);
    let mode = format!("session-then-write:{caller}");
    let answer = tokio::spawn(send(client.post_in_mode("/effects", "k", &mode)));
    hold.entered().await;
    DB::end_session(admin, hold.session().expect("a server session")).await;
    hold.release.notify_one();
    let answer = answer.await.unwrap();
    assert_store_failure(&answer, true);
    // Another connection found no row of the claim: nothing was done.
    assert_eq!(answer.operation_state(), ("not_started".into(), true));
    assert_eq!(server.effects(&caller).await, 0);
    assert_eq!(server.keys(&caller).await, 0);
    let retry = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(server.effects(&caller).await, 1);

    // A handler that committed its own transaction (outside the contract)
    // before it lost the connection: its effect and claim are committed,
    // so no 503 invites a retry; the handler's 500, and 409 after.
    let held = format!("{caller}-committed");
    let hold = server.state.holds.get(&held);
    let mode = format!("raw-commit-then-session-then-write:{held}");
    let answer = tokio::spawn(send(client.post_in_mode("/effects", "c", &mode)));
    hold.entered().await;
    DB::end_session(admin, hold.session().expect("a server session")).await;
    hold.release.notify_one();
    let answer = answer.await.unwrap();
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    assert_eq!(
        server.effects(&caller).await,
        2,
        "the committed effect stays"
    );
    let retry = send(client.post("/effects", "c", BODY)).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(server.effects(&caller).await, 2);
}

/// A handler that commits its transaction itself and then fails in any
/// way (`Err`, an `Ok` with a transient status, a panic) keeps its effect,
/// and no retry runs it again before the key expires: 409 each time.
/// After the key's lifetime a retry runs as a first attempt.
pub async fn self_committed_failures_hold_the_key_until_it_expires<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("committed_failed");
    let client = server.client(&caller);
    let mut effects = 0;
    for (key, mode, status) in [
        ("err", "raw-commit-then-error:502", 502),
        ("ok503", "raw-commit-then-status:503", 503),
        ("ok500", "raw-commit-then-status:500", 500),
        ("panic", "raw-commit-then-panic", 500),
    ] {
        let first = send(client.post_in_mode("/effects/short", key, mode)).await;
        assert_eq!(first.status.as_u16(), status, "{key}: {first:?}");
        effects += 1;
        assert_eq!(server.effects(&caller).await, effects, "{key}: committed");
        let retry = send(client.post("/effects/short", key, BODY)).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{key}: {retry:?}");
        assert_eq!(retry.problem_code(), "idempotency_key_in_use", "{key}");
        assert_eq!(server.effects(&caller).await, effects, "{key}: run again");
    }
    // The passage of time is what is under test here: past the 1 s ttl.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for key in ["err", "ok503", "ok500", "panic"] {
        let later = send(client.post("/effects/short", key, BODY)).await;
        assert_eq!(later.status, StatusCode::CREATED, "{key}: {later:?}");
        assert!(!later.replayed(), "{key}: {later:?}");
        assert!(
            send(client.post("/effects/short", key, BODY))
                .await
                .replayed(),
            "{key}"
        );
    }
    assert_eq!(server.effects(&caller).await, effects + 4);
}

/// A `Tx` the handler keeps past its end, and a response body that fails
/// while it is stored, are each a 500 `internal_error`: nothing is
/// committed or stored, and the retry runs once.
pub async fn broken_endings_are_internal_errors<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("broken_end");
    let client = server.client(&caller);

    let kept =
        send(client.post_in_mode("/effects/wait", "kept", &format!("keep-tx:{caller}"))).await;
    kept.assert_internal_error();
    // Dropped, the kept `Tx` closes its connection: the server rolls its
    // transaction back (the retry's `wait` covers the time that takes).
    server.state.holds.get(&caller).drop_kept();

    let failing = send(client.post_in_mode("/effects/wait", "failing", "failing-body")).await;
    failing.assert_internal_error();

    for key in ["kept", "failing"] {
        let retry = send(client.post("/effects/wait", key, BODY)).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {retry:?}");
        assert!(!retry.replayed(), "{key}: {retry:?}");
    }
    assert_eq!(server.effects(&caller).await, 2, "each retry's alone");
    assert_eq!(server.keys(&caller).await, 2);
}

/// PostgreSQL: a nested `begin()` cancelled in flight makes sqlx 0.9 roll
/// back the whole request's transaction, claim included. The handler is
/// stopped at its next use of the `Tx`: 500 `internal_error`, nothing
/// committed (not even the write after the cancellation), nothing stored;
/// the retry runs once. The `begin()` waits behind a statement that waits
/// for this test's lock on an effect row, so it is surely in flight when
/// cancelled; the lock goes while the handler is held after that.
pub async fn cancelled_savepoints_are_internal_errors<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("cancelled_savepoint");
    let client = server.client(&caller);
    let target = send(client.post("/effects", "target", BODY)).await;
    assert_eq!(target.status, StatusCode::CREATED, "{target:?}");
    let holder = DB::lock_effect(server.state.idem.pool(), target.effect().id).await;
    let mode = format!("cancelled-savepoint:{}:{caller}", target.effect().id);
    let hold = server.state.holds.get(&caller);
    let answer = tokio::spawn(send(client.post_in_mode("/effects/wait", "k", &mode)));
    hold.entered().await;
    holder.rollback().await.unwrap();
    hold.release.notify_one();
    answer.await.unwrap().assert_internal_error();
    assert_eq!(server.effects(&caller).await, 1, "`target` alone");
    assert_eq!(server.keys(&caller).await, 1, "`target` alone");
    let retry = send(client.post("/effects/wait", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(server.effects(&caller).await, 2);
}

/// A serialization failure at the commit is the store's: 503, with
/// `Retry-After` and a key, without both for a keyless request; the
/// transaction is rolled back and the key's retry runs once. Two requests
/// of one scope each write an effect and read the scope's effects under
/// SERIALIZABLE (a write skew): both reads come before either commit, so
/// the second to commit fails.
pub async fn serialization_failures_at_commit_are_503<DB: TestDb>(pool: sqlx::Pool<DB>) {
    let server = start_with::<DB>(pool).await;
    for keyed in [true, false] {
        let caller = unique("serialization");
        let client = server.client(&caller);
        let request = |name: &str| {
            let mode = format!("read-then-hold:{caller}-{name}");
            if keyed {
                client.post_in_mode("/effects", name, &mode)
            } else {
                keyless(&client, &mode)
            }
        };
        let mut parked = Vec::new();
        for name in ["first", "second"] {
            let hold = server.state.holds.get(&format!("{caller}-{name}"));
            let answer = tokio::spawn(send(request(name)));
            hold.entered().await;
            parked.push((hold, answer));
        }
        let mut answers = Vec::new();
        for (hold, answer) in parked {
            hold.release.notify_one();
            answers.push(answer.await.unwrap());
        }
        assert_eq!(answers[0].status, StatusCode::CREATED, "{:?}", answers[0]);
        assert_store_failure(&answers[1], keyed);
        assert_commit_unknown(&answers[1], keyed);
        assert_eq!(server.effects(&caller).await, 1, "keyed {keyed}");
        if keyed {
            assert_eq!(server.keys(&caller).await, 1);
            let retry = send(client.post("/effects", "second", BODY)).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
            assert!(!retry.replayed(), "{retry:?}");
            assert_eq!(server.effects(&caller).await, 2);
        }
    }
}
