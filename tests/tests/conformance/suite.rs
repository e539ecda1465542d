//! The contract, written once: every test is generic over the engine and
//! talks to a real server over HTTP on loopback.

use std::time::{Duration, Instant};

use futures::future::join_all;
use reqwest::{Method, StatusCode};

use crate::app::{Effect, Hold, TestDb, until_session_ends};
use crate::harness::{
    Answer, ChildServer, Client, send, start, start_configured, unique, until_idle,
};

pub use crate::bodies::refused_bodies_get_their_problem;
pub use crate::commits::{
    broken_endings_are_internal_errors, cancelled_savepoints_are_internal_errors,
    lost_commits_are_503, self_committed_failures_hold_the_key_until_it_expires,
    serialization_failures_at_commit_are_503,
};
pub use crate::expiry::{
    concurrent_retries_of_an_expired_key_make_one_effect, expired_keys_run_as_new,
    slow_first_attempts_are_kept_for_their_ttl, sweeping_spares_live_and_taken_over_keys,
    tombstones_refuse_late_retries,
};
pub use crate::transactions::{
    connections_come_back_outside_any_transaction, ended_transactions_are_not_successes,
    handler_errors_roll_back, lost_transactions_are_not_successes,
    nested_transactions_are_savepoints,
};

pub const BODY: &str = r#"{"note":"charge 1250 eur"}"#;

/// 1. Same request twice: one effect, the second a verbatim replay.
pub async fn replay_is_verbatim<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("replay");
    let client = server.client(&caller);
    let first = send(client.post("/effects", "k1", BODY)).await;
    let second = send(client.post("/effects", "k1", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(second.replayed(), "{second:?}");
    assert_eq!(
        first.body, second.body,
        "replayed body must be byte-identical"
    );
    for header in ["location", "etag", "content-type"] {
        assert_eq!(first.header(header), second.header(header), "{header}");
        assert!(first.header(header).is_some(), "{header}");
    }
    assert_eq!(server.effects(&caller).await, 1);
    assert_eq!(server.keys(&caller).await, 1);
}

/// The RFC 9651 string form and the bare token are the same key.
pub async fn quoted_and_bare_keys_match<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("quoted");
    let client = server.client(&caller);
    let first = send(client.post("/effects", "\"k-1\"", BODY)).await;
    let second = send(client.post("/effects", "k-1", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(server.effects(&caller).await, 1);
}

/// 2. 32 attempts with one key at once: one effect; replays or 409s only.
pub async fn concurrent_duplicates_make_one_effect<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("race");
    let client = server.client(&caller);
    let answers = join_all((0..32).map(|_| send(client.post("/effects", "same", BODY)))).await;
    let mut originals = 0;
    for answer in &answers {
        match answer.status {
            StatusCode::CREATED if answer.replayed() => {}
            StatusCode::CREATED => originals += 1,
            StatusCode::CONFLICT => {
                assert_eq!(answer.header("retry-after"), Some("1"));
                assert_eq!(answer.problem_code(), "idempotency_key_in_use");
            }
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert_eq!(originals, 1, "exactly one attempt runs the handler");
    assert_eq!(server.effects(&caller).await, 1);
    let bodies: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .map(|a| &a.body)
        .collect();
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "every 201 carries the one stored body"
    );
}

/// A retry while the first attempt is still running: 409 at once with
/// `wait = 0`; with `wait` it blocks and then replays.
pub async fn in_flight_duplicates_get_409_or_wait<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("inflight");
    let client = server.client(&caller);
    let (hold, first) = server
        .send_held(client.post("/effects", "k", BODY), &caller)
        .await;

    let duplicates = join_all((0..8).map(|_| send(client.post("/effects", "k", BODY)))).await;
    for answer in &duplicates {
        assert_eq!(answer.status, StatusCode::CONFLICT, "{answer:?}");
        assert_eq!(answer.header("retry-after"), Some("1"));
        assert_eq!(answer.problem_code(), "idempotency_key_in_use");
    }
    let mut first = Some(first);
    if DB::SERIAL_WRITES {
        // One write lock (SQLite): the held transaction blocks every other
        // claim, whatever its key, so it must end before the next part.
        release_and_replay(&hold, first.take().unwrap(), &client).await;
    }
    // A duplicate allowed to wait blocks on the claim until the first commits.
    let waiting = tokio::spawn(send(client.post("/effects/wait", "w", BODY)));
    let (hold_w, waiting_first) = server
        .send_held(
            client.post("/effects/wait", "w2", BODY),
            &format!("{caller}-w"),
        )
        .await;
    // The first attempt goes on only once its duplicates are seen waiting:
    // their answers then come after the wait, and must be the first
    // attempt's. In this process a duplicate waits for the attempt in
    // flight holding no connection (the store's single flight).
    let waiter = tokio::spawn(send(client.post("/effects/wait", "w2", BODY)));
    let seen = one_waiter("a duplicate of w2 waiting in this process", async || {
        let waiting = server.state.idem.waiting_duplicates(&caller, "w2");
        Some(i64::try_from(waiting).unwrap())
    })
    .await;
    assert!(seen, "{}: no wait to see", DB::ENGINE);
    // Another instance's duplicate (another pool: another process, in
    // effect) waits in its claim, on the first attempt's row lock. SQLite
    // shows no such wait: one file is one flight, whatever the pool.
    let other = start::<DB>().await;
    let other_client = other.client(&caller);
    let across = tokio::spawn(send(other_client.post("/effects/wait", "w2", BODY)));
    let pool = server.state.idem.pool();
    let seen = one_waiter("the other instance's claim of w2", async || {
        DB::claim_waiters(pool, &caller, "w2").await
    })
    .await;
    assert!(
        seen || DB::ENGINE == "sqlite",
        "{}: no wait to see",
        DB::ENGINE
    );
    hold_w.release.notify_one();
    let original_w = waiting_first.await.unwrap();
    assert_eq!(original_w.status, StatusCode::CREATED);
    for waited in [waiter.await.unwrap(), across.await.unwrap()] {
        assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
        assert!(waited.replayed(), "{waited:?}");
        assert_eq!(waited.body, original_w.body);
    }
    assert_eq!(waiting.await.unwrap().status, StatusCode::CREATED);

    if let Some(first) = first {
        release_and_replay(&hold, first, &client).await;
    }
    assert_eq!(server.effects(&caller).await, 3, "k, w and w2 once each");
}

/// Duplicates that wait for a first attempt hold no pool connection: with
/// a pool of two, the held first attempt has one, three duplicates allowed
/// to wait are seen waiting, and a request of another key still gets the
/// other connection and its answer while they wait (each duplicate held a
/// connection through its claim's lock wait, so a few retries of one slow
/// request starved every other caller). The same after the first attempt
/// rolls back: one duplicate claims (and is held in its turn), the others
/// wait for it in process, not in the database. Then they replay.
pub async fn waiting_duplicates_hold_no_connection<DB: TestDb>(pool: sqlx::Pool<DB>) {
    let server = crate::harness::start_with::<DB>(pool).await;
    let caller = unique("pooled");
    let client = server.client(&caller);
    let waiting = |count: usize| {
        let idem = &server.state.idem;
        let caller = &caller;
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while idem.waiting_duplicates(caller, "k") < count {
                assert!(Instant::now() < deadline, "{count} duplicates never waited");
                tokio::task::yield_now().await;
            }
        }
    };
    let other_key = async |key: &str| {
        let other = tokio::time::timeout(
            Duration::from_secs(10),
            send(client.post("/effects", key, BODY)),
        )
        .await
        .expect("a request of another key is answered while duplicates wait");
        assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    };
    let failing = server.state.holds.get(&format!("{caller}-fails"));
    let first = tokio::spawn(send(
        client
            .post("/effects/wait", "k", BODY)
            .header("x-test-mode", format!("hold-then-503:{caller}-fails")),
    ));
    failing.entered().await;
    // The duplicates are held too when they run: the one that claims after
    // the rollback stays in its handler until released.
    let held = server.state.holds.get(&caller);
    let duplicates: Vec<_> = (0..3)
        .map(|_| {
            let request = client
                .post("/effects/wait", "k", BODY)
                .header("x-test-mode", format!("hold:{caller}"));
            tokio::spawn(send(request))
        })
        .collect();
    waiting(3).await;
    other_key("other").await;
    failing.release.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
    held.entered().await;
    waiting(2).await;
    other_key("another").await;
    held.release.notify_one();
    let mut answers = Vec::new();
    for duplicate in duplicates {
        answers.push(duplicate.await.unwrap());
    }
    let original = answers
        .iter()
        .find(|answer| !answer.replayed())
        .expect("one duplicate ran")
        .clone();
    assert_eq!(original.status, StatusCode::CREATED, "{original:?}");
    for answer in &answers {
        assert_eq!(answer.body, original.body, "{answer:?}");
    }
    assert_eq!(
        answers.iter().filter(|answer| answer.replayed()).count(),
        2,
        "{answers:?}"
    );
    assert_eq!(
        server.effects(&caller).await,
        3,
        "k, other and another, once each"
    );
}

/// Polls `waiters` (a `TestDb` count of lock waiters) until it counts one,
/// within a deadline; `false` at once if the engine cannot show the wait
/// (`None`). More than one is a failure: the counts are of one request.
async fn one_waiter(what: &str, mut waiters: impl AsyncFnMut() -> Option<i64>) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match spaced(&mut waiters).await {
            None => return false,
            Some(0) => {}
            Some(1) => return true,
            Some(n) => panic!("{what}: {n} waiters, expected one"),
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never seen waiting for a lock"
        );
    }
}

/// Runs one count of lock waiters, at least 150 ms after the previous one
/// in this process: MariaDB's information schema refreshes its copy of
/// InnoDB's lock tables only for a read more than 100 ms after the last
/// (see `TestDb::claim_waiters`), so faster polls, or two tests' polls
/// interleaved, would read a stale copy forever.
async fn spaced(waiters: &mut impl AsyncFnMut() -> Option<i64>) -> Option<i64> {
    static LAST: tokio::sync::Mutex<Option<Instant>> = tokio::sync::Mutex::const_new(None);
    let mut last = LAST.lock().await;
    if let Some(last) = *last {
        tokio::time::sleep_until((last + Duration::from_millis(150)).into()).await;
    }
    let count = waiters().await;
    *last = Some(Instant::now());
    count
}

/// Lets a held first attempt of `k` finish; a retry then replays it.
async fn release_and_replay(hold: &Hold, first: tokio::task::JoinHandle<Answer>, client: &Client) {
    hold.release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(client.post("/effects", "k", BODY)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
}

/// A sub-second `wait` is honoured: the duplicate of a held attempt waits
/// about that long, then gets 409 (MySQL's whole-second lock timeout is
/// refined by MariaDB's statement time limit).
pub async fn short_waits_are_honoured<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("brief");
    let client = server.client(&caller);
    let (hold, first) = server
        .send_held(client.post("/effects/brief", "k", BODY), &caller)
        .await;
    let started = std::time::Instant::now();
    let duplicate = send(client.post("/effects/brief", "k", BODY)).await;
    let waited = started.elapsed();
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(duplicate.problem_code(), "idempotency_key_in_use");
    assert_eq!(duplicate.operation_state(), ("in_progress".into(), false));
    assert!(
        waited >= std::time::Duration::from_millis(300),
        "the duplicate waited {waited:?}, less than its 300ms"
    );
    assert!(
        waited < std::time::Duration::from_secs(1),
        "the duplicate waited {waited:?}, a whole second's lock timeout, not its 300ms"
    );
    hold.release.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(
        send(client.post("/effects/brief", "k", BODY))
            .await
            .replayed()
    );
    assert_eq!(server.effects(&caller).await, 1);
}

/// 3. Same key, different body: 422; the original still replays; JSON
///    spelled differently is the same request.
pub async fn different_body_is_422<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("reuse");
    let client = server.client(&caller);
    let first = send(client.post("/effects", "k", r#"{"note":"a","x":{"p":1,"q":[1,2]}}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(client.post("/effects", "k", r#"{"note":"b","x":{"p":1,"q":[1,2]}}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem_code(), "idempotency_key_reused");
    assert_eq!(other.operation_state(), ("completed".into(), false));
    let respelled = send(client.post(
        "/effects",
        "k",
        "{ \"x\" : { \"q\": [1, 2], \"p\": 1 },\n  \"note\": \"a\" }",
    ))
    .await;
    assert!(respelled.replayed(), "{respelled:?}");
    assert_eq!(respelled.body, first.body);
    assert_eq!(server.effects(&caller).await, 1);
}

/// A service that names its own replay marker and problem type: replays
/// carry `Idempotent-Replay: true` and not the default header; every
/// problem `idem` answers (here 422 and 400) carries `<base><code>`.
pub async fn replay_marker_and_problem_type_are_configurable<DB: TestDb>() {
    let base = "https://docs.example.com/errors/";
    let server = crate::harness::start_configured(DB::connect().await, |idem| {
        idem.replay_header(reqwest::header::HeaderName::from_static(
            "idempotent-replay",
        ))
        .expect("a marker header")
        .problem_type_base(base)
        .expect("an absolute base")
    })
    .await;
    let caller = unique("configured");
    let client = server.client(&caller);
    let first = send(client.post("/effects", "k", r#"{"note":"a"}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(client.post("/effects", "k", r#"{"note":"a"}"#)).await;
    assert_eq!(
        replay.header("idempotent-replay"),
        Some("true"),
        "{replay:?}"
    );
    assert!(
        !replay.replayed(),
        "the default marker is not sent: {replay:?}"
    );
    assert_eq!(replay.body, first.body);
    let reused = send(client.post("/effects", "k", r#"{"note":"b"}"#)).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        reused.json()["type"],
        format!("{base}idempotency_key_reused")
    );
    let bad_key = send(client.post("/effects", "a b", r#"{"note":"a"}"#)).await;
    assert_eq!(bad_key.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        bad_key.json()["type"],
        format!("{base}idempotency_key_invalid")
    );
    assert_eq!(server.effects(&caller).await, 1);
}

/// A retry that reaches another instance (which never saw the key finish)
/// gets the same answer as one that comes back to the first, whichever
/// instance answered before; a changed body is refused on both.
pub async fn every_instance_replays_the_same_answer<DB: TestDb>() {
    let first_instance = start::<DB>().await;
    let pool = first_instance.state.idem.pool().clone();
    let second_instance = crate::harness::start_with::<DB>(pool).await;
    let caller = unique("instances");
    let (a, b) = (
        first_instance.client(&caller),
        second_instance.client(&caller),
    );
    let first = send(a.post("/effects", "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for (instance, client) in [("second", &b), ("second", &b), ("first", &a)] {
        let again = send(client.post("/effects", "k", BODY)).await;
        assert!(again.replayed(), "{instance}: {again:?}");
        assert_eq!(again.body, first.body, "{instance}");
        assert_eq!(again.header("location"), first.header("location"));
        let changed = send(client.post("/effects", "k", r#"{"note":"other"}"#)).await;
        assert_eq!(
            changed.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{instance}"
        );
    }
    assert_eq!(first_instance.effects(&caller).await, 1);
}

/// 4. Same key on another path or method: 422.
pub async fn other_path_or_method_is_422<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("path");
    let client = server.client(&caller);
    assert_eq!(
        send(client.post("/effects", "k", BODY)).await.status,
        StatusCode::CREATED
    );
    let put = client
        .request(Method::PUT, "/effects")
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(BODY);
    let put = send(put).await;
    assert_eq!(put.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(put.problem_code(), "idempotency_key_reused");
    let other = send(client.post("/other", "k", BODY)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    let query = send(client.post("/effects?x=1", "k", BODY)).await;
    assert_eq!(query.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(server.effects(&caller).await, 1);
}

/// A handler with `fingerprint(exclude = ["/client_ts", "/trace/id"])`:
/// a retry that differs only in those members (changed, dropped, or the
/// body respelled) is a replay; any other change, to a member, the method,
/// the path or the query, is still 422.
pub async fn excluded_members_are_replays<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("excluding");
    let client = server.client(&caller);
    let path = "/effects/excluding";
    let body = r#"{"note":"a","client_ts":"09:00","trace":{"id":"t1","hop":1}}"#;
    let first = send(client.post(path, "k", body)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    for same in [
        r#"{"note":"a","client_ts":"09:01","trace":{"id":"t2","hop":1}}"#,
        r#"{ "trace": { "hop": 1 }, "note": "a" }"#,
    ] {
        let retry = send(client.post(path, "k", same)).await;
        assert!(retry.replayed(), "{same}: {retry:?}");
        assert_eq!(retry.body, first.body);
    }
    for other in [
        r#"{"note":"b","client_ts":"09:00","trace":{"id":"t1","hop":1}}"#,
        r#"{"note":"a","client_ts":"09:00","trace":{"id":"t1","hop":2}}"#,
    ] {
        let reused = send(client.post(path, "k", other)).await;
        assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY, "{other}");
        assert_eq!(reused.problem_code(), "idempotency_key_reused");
    }
    let put = client
        .request(Method::PUT, path)
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(body);
    assert_eq!(send(put).await.status, StatusCode::UNPROCESSABLE_ENTITY);
    let moved = send(client.post("/other/excluding", "k", body)).await;
    assert_eq!(moved.status, StatusCode::UNPROCESSABLE_ENTITY);
    let query = send(client.post(&format!("{path}?x=1"), "k", body)).await;
    assert_eq!(query.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(server.effects(&caller).await, 1);
}

/// 5. Same key from two scopes: two effects, never the other's response.
pub async fn scopes_are_independent<DB: TestDb>() {
    let server = start::<DB>().await;
    let (alice, bob) = (unique("alice"), unique("bob"));
    let a = send(server.client(&alice).post("/effects", "shared", BODY)).await;
    let b = send(server.client(&bob).post("/effects", "shared", BODY)).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    let a2 = send(server.client(&alice).post("/effects", "shared", BODY)).await;
    let b2 = send(server.client(&bob).post("/effects", "shared", BODY)).await;
    assert_eq!((a2.body.clone(), b2.body.clone()), (a.body, b.body));
    assert_eq!(
        (server.effects(&alice).await, server.effects(&bob).await),
        (1, 1)
    );
}

/// 5b. A scope of `MAX_SCOPE_LEN` bytes, as incompressible as hex of
///     random bytes can be, with a key of 255 characters, is kept and
///     replayed on every engine (PostgreSQL's btree entries stop at about
///     2.7 KB); one byte longer is a 500 before anything runs, never a 503
///     whose `Retry-After` would have the client retry forever.
pub async fn long_scopes_are_kept_or_refused_whole<DB: TestDb>() {
    let server = start::<DB>().await;
    let prefix = unique("long");
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let noise: String = std::iter::repeat_with(|| {
        // xorshift64: no repeats a compressor could find.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        format!("{state:016x}")
    })
    .take(idem::MAX_SCOPE_LEN / 16 + 1)
    .collect();
    let longest = format!("{prefix}{noise}")[..idem::MAX_SCOPE_LEN].to_owned();
    let too_long = format!("{longest}0");
    let key = "k".repeat(idem::MAX_KEY_LEN);

    let refused = send(server.client(&too_long).post("/effects", &key, BODY)).await;
    assert_eq!(
        refused.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{refused:?}"
    );
    assert_eq!(refused.problem_code(), "idempotency_scope_too_long");
    assert!(
        !refused.headers.contains_key(reqwest::header::RETRY_AFTER),
        "{refused:?}"
    );
    assert_eq!(
        server.effects(&too_long).await,
        0,
        "the handler did not run"
    );
    assert_eq!(server.keys(&too_long).await, 0);

    let kept = send(server.client(&longest).post("/effects", &key, BODY)).await;
    assert_eq!(kept.status, StatusCode::CREATED, "{kept:?}");
    let again = send(server.client(&longest).post("/effects", &key, BODY)).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, kept.body);
    assert_eq!(
        (server.effects(&longest).await, server.keys(&longest).await),
        (1, 1)
    );
}

/// 6. A transient answer after the write: nothing committed or stored; the
///    retry runs again and succeeds once. Non-transient 4xx are stored.
pub async fn transient_answers_roll_back<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("transient");
    let client = server.client(&caller);
    for (key, mode, status) in [
        ("k503", "fail-503", 503),
        ("k408", "status:408", 408),
        ("k429", "status:429", 429),
        ("k502", "status:502", 502),
    ] {
        let failed = send(
            client
                .post("/effects", key, BODY)
                .header("x-test-mode", mode),
        )
        .await;
        assert_eq!(failed.status.as_u16(), status);
        assert_eq!(
            server.effects(&caller).await,
            0,
            "{mode}: the write was rolled back"
        );
        assert_eq!(server.keys(&caller).await, 0, "{mode}: nothing stored");
    }
    let retry = send(client.post("/effects", "k503", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(send(client.post("/effects", "k503", BODY)).await.replayed());
    assert_eq!(server.effects(&caller).await, 1);

    let rejected = send(
        client
            .post("/effects", "k400", BODY)
            .header("x-test-mode", "status:400"),
    )
    .await;
    assert_eq!(rejected.status, StatusCode::BAD_REQUEST);
    let again = send(client.post("/effects", "k400", BODY)).await;
    assert_eq!(
        again.status,
        StatusCode::BAD_REQUEST,
        "a 4xx answer is the operation's result"
    );
    assert!(again.replayed());
    assert_eq!(again.body, rejected.body);
}

/// 7. A panic after the write: 500, nothing committed, the retry succeeds once.
pub async fn panics_roll_back<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("panic");
    let client = server.client(&caller);
    let panicked = send(
        client
            .post("/effects", "k", BODY)
            .header("x-test-mode", "panic"),
    )
    .await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.effects(&caller).await, 0);
    assert_eq!(server.keys(&caller).await, 0);
    let retry = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(server.effects(&caller).await, 1);
}

/// 8. SIGKILL the server between the handler's write and its return; a
///    restarted server completes the retry exactly once.
pub async fn killed_server_leaves_nothing_behind<DB: TestDb>() {
    let mut child = ChildServer::spawn(DB::ENGINE).await;
    let caller = unique("kill");
    let client = crate::harness::Client::new(child.addr, &caller);
    let doomed = tokio::spawn(
        client
            .post("/effects", "k", BODY)
            .header("x-test-mode", "announce")
            .send(),
    );
    child.expect_line("EFFECT_WRITTEN k").await;
    child.child.kill().await.unwrap();
    assert!(
        doomed.await.unwrap().is_err(),
        "the client never got an answer"
    );

    let server = start::<DB>().await;
    assert_eq!(
        server.effects(&caller).await,
        0,
        "the write died with its transaction"
    );
    assert_eq!(
        server.keys(&caller).await,
        0,
        "the claim died with it: no memory without its effect"
    );
    // `wait` lets the retry queue behind the dead transaction until the
    // database notices the closed connection and rolls it back.
    let retry = send(server.client(&caller).post("/effects/wait", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(server.effects(&caller).await, 1);
    assert_eq!(server.keys(&caller).await, 1);
    let again = send(server.client(&caller).post("/effects/wait", "k", BODY)).await;
    assert!(again.replayed());
    assert_eq!(server.effects(&caller).await, 1);
}

/// 9. Missing and malformed keys: 400 problem+json, handler not run.
pub async fn bad_keys_are_400<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("badkey");
    let client = server.client(&caller);
    let missing = client
        .request(Method::POST, "/effects")
        .header("content-type", "application/json")
        .body(BODY);
    let missing = send(missing).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem_code(), "idempotency_key_missing");
    assert_eq!(missing.operation_state(), ("not_started".into(), true));
    let long = "k".repeat(300);
    // `a,b`: two headers as a proxy folds them.
    let bad: [&[u8]; 6] = [
        b"",
        b"\"\"",
        long.as_bytes(),
        b"a\tb",
        b"caf\xc3\xa9",
        b"a,b",
    ];
    for key in bad {
        let request = client
            .request(Method::POST, "/effects")
            .header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            )
            .header("content-type", "application/json")
            .body(BODY);
        let answer = send(request).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{key:?}");
        assert_eq!(answer.problem_code(), "idempotency_key_invalid", "{key:?}");
    }
    let twice = client
        .request(Method::POST, "/effects")
        .header("idempotency-key", "a")
        .header("idempotency-key", "a")
        .header("content-type", "application/json")
        .body(BODY);
    assert_eq!(send(twice).await.problem_code(), "idempotency_key_invalid");
    let max = "k".repeat(255);
    assert_eq!(
        send(client.post("/effects", &max, BODY)).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        server.effects(&caller).await,
        1,
        "only the 255-character key ran"
    );
    assert_eq!(server.keys(&caller).await, 1);
}

/// 11. The Json extractor's rejection passes through; nothing stored.
pub async fn extractor_rejections_store_nothing<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("reject");
    let client = server.client(&caller);
    let broken = send(client.post("/effects", "k", "{not json")).await;
    assert_eq!(broken.status, StatusCode::BAD_REQUEST);
    assert_ne!(
        broken.header("content-type"),
        Some("application/problem+json"),
        "axum's own rejection"
    );
    let no_caller = reqwest::Client::new()
        .post(format!("http://{}/effects", server.addr))
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(BODY);
    assert_eq!(send(no_caller).await.status, StatusCode::UNAUTHORIZED);
    let too_big = send(client.post(
        "/effects",
        "k",
        &format!(r#"{{"note":"{}"}}"#, "x".repeat(70 * 1024)),
    ))
    .await;
    assert_eq!(too_big.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(too_big.problem_code(), "request_body_too_large");
    assert_eq!(server.effects(&caller).await, 0);
    assert_eq!(server.keys(&caller).await, 0);
    let ok = send(client.post("/effects", "k", BODY)).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
}

/// A response over the stored-response cap: 500 and rollback.
pub async fn oversized_responses_roll_back<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("big");
    let client = server.client(&caller);
    let big = send(
        client
            .post("/effects", "k", BODY)
            .header("x-test-mode", "big"),
    )
    .await;
    assert_eq!(big.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(big.problem_code(), "idempotency_response_not_stored");
    assert_eq!(server.effects(&caller).await, 0);
    assert_eq!(server.keys(&caller).await, 0);
}

/// `key = "optional"`: without a key the handler runs each time, stores
/// nothing; with one it is idempotent.
pub async fn optional_keys<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("optional");
    let client = server.client(&caller);
    for _ in 0..2 {
        let request = client
            .request(Method::POST, "/effects/optional")
            .header("content-type", "application/json")
            .body(BODY);
        let answer = send(request).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(server.effects(&caller).await, 2);
    assert_eq!(server.keys(&caller).await, 0);
    let failed = client
        .request(Method::POST, "/effects/optional")
        .header("content-type", "application/json")
        .header("x-test-mode", "fail-503")
        .body(BODY);
    assert_eq!(send(failed).await.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        server.effects(&caller).await,
        2,
        "a keyless 503 still rolls back"
    );
    let keyed = send(client.post("/effects/optional", "k", BODY)).await;
    assert_eq!(keyed.status, StatusCode::CREATED, "{keyed:?}");
    assert!(!keyed.replayed(), "{keyed:?}");
    assert_eq!(server.keys(&caller).await, 1, "a keyed request is stored");
    let again = send(client.post("/effects/optional", "k", BODY)).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, keyed.body);
    assert_eq!(server.effects(&caller).await, 3);
}

/// A handler past its deadline (`timeout`) is dropped where it stands: 504
/// `handler_timeout` with `Retry-After`, its write rolled back, nothing
/// stored, the key free at once; the retry runs once and is replayed after.
pub async fn handlers_past_their_deadline_are_504<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("deadline");
    let client = server.client(&caller);
    let late = send(
        client
            .post("/effects/deadline", "k", BODY)
            .header("x-test-mode", "stall"),
    )
    .await;
    assert_eq!(late.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(late.problem_code(), "handler_timeout");
    assert_eq!(late.header("retry-after"), Some("1"));
    assert_eq!(late.operation_state(), ("not_started".into(), true));
    assert_eq!(
        server.effects(&caller).await,
        0,
        "the write was rolled back"
    );
    assert_eq!(server.keys(&caller).await, 0, "nothing stored");

    let retry = send(client.post("/effects/deadline", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let again = send(client.post("/effects/deadline", "k", BODY)).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(server.effects(&caller).await, 1);
}

/// Replies carry what the handler produced; its JSON decodes.
pub async fn first_answer_is_the_handlers<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("shape");
    let answer = send(server.client(&caller).post("/effects", "k", BODY)).await;
    let effect: Effect = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(effect.note, "charge 1250 eur");
    assert_eq!(
        answer.header("location"),
        Some(format!("/effects/{}", effect.id).as_str())
    );
}

/// The key store unreachable: 503 + Retry-After, the handler never runs.
pub async fn unreachable_store_is_503<DB: TestDb>() {
    let server = crate::harness::start_with::<DB>(DB::unreachable_pool()).await;
    let answer = send(server.client(&unique("down")).post("/effects", "k", BODY)).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert_eq!(answer.problem_code(), "idempotency_store_unavailable");
    assert_eq!(answer.operation_state(), ("not_started".into(), true));
}

/// A client that gives up mid-handler: the dropped request rolls back and
/// its connection never returns to the pool inside the transaction.
pub async fn cancelled_requests_roll_back<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("cancel");
    let client = server.client(&caller);
    let hold = server.state.holds.get(&caller);
    let request = client
        .post("/effects", "k", BODY)
        .header("x-test-mode", format!("hold:{caller}"));
    let abandoned = tokio::spawn(request.send());
    hold.entered.notified().await;
    abandoned.abort();
    tokio::time::timeout(std::time::Duration::from_secs(10), hold.dropped.notified())
        .await
        .expect("the server drops the handler of a closed connection");
    assert_eq!(server.effects(&caller).await, 0);
    let retry = send(client.post("/effects/wait", "k", BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    // Every pooled connection is usable and outside any transaction: many
    // requests in a row each commit exactly their own effect, and the
    // database finds each connection of the pool outside a transaction.
    for i in 0..20 {
        let answer = send(client.post("/effects", &format!("after-{i}"), BODY)).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    assert_eq!(server.effects(&caller).await, 21);
    for conn in &mut server.pooled_connections().await {
        assert!(
            !DB::in_transaction(&mut **conn).await,
            "a connection came back inside a transaction"
        );
    }
}

/// The claim's short lock timeout covers the claim only: the handler's own
/// statements may wait on locks as long as they need.
pub async fn handler_statements_may_wait_on_locks<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("locks");
    let client = server.client(&caller);
    let target = send(client.post("/effects", "target", BODY)).await;
    let id = serde_json::from_slice::<Effect>(&target.body).unwrap().id;
    let mut holder = DB::lock_effect(server.state.idem.pool(), id).await;
    let waiting = tokio::spawn(send(
        client
            .post("/effects", "k", BODY)
            .header("x-test-mode", format!("touch:{id}")),
    ));
    // Only this test's handler can wait for `holder`: the row is this
    // test's. Seen waiting, it must still wait well past the claim's 1 ms
    // lock timeout (the hold's length is the point, not a synchronisation).
    let mut waits = async || DB::lock_waiters(&mut *holder).await;
    if one_waiter("the handler's UPDATE", &mut waits).await {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            spaced(&mut waits).await,
            Some(1),
            "the handler's UPDATE gave up"
        );
    } else {
        // SQLite shows no wait: its one write lock makes the claim's own
        // `BEGIN IMMEDIATE` wait for `holder` (under the busy timeout, not
        // the claim's), so there the handler's statements never wait.
        assert_eq!(DB::ENGINE, "sqlite", "no wait to see");
    }
    holder.commit().await.unwrap();
    let answer = waiting.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert!(send(client.post("/effects", "k", BODY)).await.replayed());
    assert_eq!(server.effects(&caller).await, 2);
}

/// How the server ends an idle session in [`ended_idle_sessions_are_replaced`].
#[derive(Debug, Clone, Copy)]
pub enum Ending {
    /// Through another session (`pg_terminate_backend`, `KILL CONNECTION`),
    /// as an administrator or a restart would.
    Terminated,
    /// By itself, the pool's sessions having a short idle timeout.
    IdleTimeout,
}

/// An idle connection whose session the server ended (a restart, an idle
/// timeout, an administrator) is replaced without the client noticing,
/// whether `idem` takes idle connections as they are (the default: its
/// first statement finds the session gone and runs again on a connection
/// the pool checks) or through the pool's ping (`checked_acquire`). On a
/// pool of one connection, whose session the server has ended before
/// each: a first attempt, its replay and a keyless request each succeed,
/// and the effect is written once per attempt that ran.
pub async fn ended_idle_sessions_are_replaced<DB: TestDb>(
    pool: sqlx::Pool<DB>,
    admin: sqlx::Pool<DB>,
    checked: bool,
    ending: Ending,
) {
    assert_eq!(pool.options().get_max_connections(), 1);
    let server = start_configured(pool.clone(), |idem| idem.checked_acquire(checked)).await;
    let caller = unique("ended");
    let client = server.client(&caller);
    for step in ["first attempt", "replay", "keyless"] {
        end_idle_session(&pool, &admin, ending).await;
        let request = match step {
            "keyless" => client
                .request(Method::POST, "/effects/optional")
                .header("content-type", "application/json")
                .body(BODY),
            _ => client.post("/effects", "k", BODY),
        };
        let answer = send(request).await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{step} after its session ended ({ending:?}, checked_acquire {checked}): {answer:?}"
        );
        assert_eq!(answer.replayed(), step == "replay", "{step}");
    }
    assert_eq!(server.effects(&caller).await, 2);
}

/// Has the server end the session of the one idle connection of `pool`,
/// leaving the connection in the pool.
async fn end_idle_session<DB: TestDb>(
    pool: &sqlx::Pool<DB>,
    admin: &sqlx::Pool<DB>,
    ending: Ending,
) {
    let id = pool_session(pool).await;
    match ending {
        Ending::Terminated => DB::end_session(admin, id).await,
        Ending::IdleTimeout => until_session_ends::<DB>(admin, id).await,
    }
}

/// The session of `pool`'s one connection, once it is back and idle.
async fn pool_session<DB: TestDb>(pool: &sqlx::Pool<DB>) -> i64 {
    until_idle(pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let id = DB::session_id(&mut conn)
        .await
        .expect("an engine with a server");
    drop(conn);
    until_idle(pool).await;
    id
}
