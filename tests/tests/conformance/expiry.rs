//! Expiry: a key past its lifetime runs as new, and the sweeper reclaims
//! expired rows without ever touching a live or re-claimed one.

use std::time::Duration;

use futures::future::join_all;
use reqwest::StatusCode;

use crate::app::TestDb;
use crate::harness::{send, start, start_configured, unique};
use crate::suite::BODY;

/// 10. With `ttl = "1s"` the key replays inside the second and is new after it.
pub async fn expired_keys_run_as_new<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("ttl");
    let client = server.client(&caller);
    let first = send(client.post("/effects/short", "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        send(client.post("/effects/short", "k", BODY))
            .await
            .replayed()
    );
    // The passage of time is what is under test here.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let later = send(client.post("/effects/short", "k", r#"{"note":"another day"}"#)).await;
    assert_eq!(later.status, StatusCode::CREATED, "{later:?}");
    assert!(!later.replayed());
    assert_eq!(server.effects(&caller).await, 2);
    assert_eq!(
        server.keys(&caller).await,
        1,
        "the expired row was taken over, not duplicated"
    );
    assert!(
        send(client.post("/effects/short", "k", r#"{"note":"another day"}"#))
            .await
            .replayed()
    );
}

/// With `ttl = "1s", tombstone = "6s"`: the key replays inside the
/// second; after it, the same request is refused with
/// `idempotency_key_expired`, carrying the first status and `Location`,
/// and another request gets 422, neither running anything; the sweeper
/// drops the response and keeps the answer; after the tombstone, the key
/// runs as new. In a key table of the test's own, which it sweeps.
pub async fn tombstones_refuse_late_retries<DB: TestDb>() {
    let table = format!("idem_tomb_{}", crate::app::nonce());
    let server = start_configured(DB::connect().await, |idem| {
        idem.table(&table).expect("a plain table name")
    })
    .await;
    server.state.idem.migrate().await.expect("migrate");
    let caller = unique("tomb");
    let client = server.client(&caller);
    let route = "/effects/tombstoned";
    let first = send(client.post(route, "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let location = first.header("location").expect("a location").to_owned();
    assert!(send(client.post(route, "k", BODY)).await.replayed());
    // The passage of time is what is under test here: past the 1 s ttl.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expired = |answer: &crate::app::Answer| {
        assert_eq!(answer.status, StatusCode::CONFLICT, "{answer:?}");
        assert_eq!(answer.problem_code(), "idempotency_key_expired");
        assert_eq!(answer.json()["original_status"], 201, "{answer:?}");
        assert_eq!(answer.json()["location"], location.as_str(), "{answer:?}");
        assert_eq!(answer.operation_state(), ("completed".to_owned(), false));
        assert!(answer.header("retry-after").is_none(), "{answer:?}");
        assert!(!answer.replayed());
    };
    expired(&send(client.post(route, "k", BODY)).await);
    let other = send(client.post(route, "k", r#"{"note":"another"}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
    assert_eq!(other.problem_code(), "idempotency_key_reused");
    assert_eq!(server.effects(&caller).await, 1, "nothing ran again");
    let info = server.state.idem.lookup(&caller, "k").await.unwrap();
    assert_eq!(info.map(|info| info.state), Some(idem::KeyState::Tombstone));

    // The sweeper turns it into a tombstone proper: the response goes,
    // the answer stays. (The count's "table" carries its condition.)
    let pool = server.state.idem.pool().clone();
    let dropped = format!("{table} WHERE status IS NOT NULL AND body IS NULL AND headers IS NULL");
    assert_eq!(DB::rows_in(&pool, &dropped).await, 0);
    let swept = server.state.idem.sweep_expired(1000).await.expect("sweep");
    assert_eq!(swept, 1, "the sweep converts the one tombstone");
    assert_eq!(DB::rows_in(&pool, &dropped).await, 1);
    assert_eq!(server.state.idem.sweep_expired(1000).await.unwrap(), 0);
    expired(&send(client.post(route, "k", BODY)).await);
    assert_eq!(server.effects(&caller).await, 1);

    // The passage of time is what is under test here: past the 6 s
    // tombstone, which counts from the response (the steps since the ttl
    // have most of 5 s on a loaded machine).
    tokio::time::sleep(Duration::from_millis(5000)).await;
    let again = send(client.post(route, "k", BODY)).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed());
    assert_eq!(
        server.effects(&caller).await,
        2,
        "a new request after the tombstone"
    );
    assert!(send(client.post(route, "k", BODY)).await.replayed());
    DB::drop_table(&pool, &table).await;
}

/// A first attempt that runs longer than its key's lifetime still has its
/// response kept and replayed: the expiry of a slow request counts from its
/// response, not from its claim (which it would have outlived, committing
/// already expired, so the very retry the key is for would run again).
pub async fn slow_first_attempts_are_kept_for_their_ttl<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("slow");
    let client = server.client(&caller);
    let (hold, first) = server
        .send_held(client.post("/effects/slow", "k", BODY), &caller)
        .await;
    // The passage of time is what is under test here: past the 2 s ttl.
    // (The retry then has 2 s to arrive, ample on a loaded machine.)
    tokio::time::sleep(Duration::from_millis(2200)).await;
    hold.release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = send(client.post("/effects/slow", "k", BODY)).await;
    assert!(
        retry.replayed(),
        "the slow attempt's response was not kept: {retry:?}"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(server.effects(&caller).await, 1);
}

/// The sweeper deletes expired keys only: never a live one, nor one
/// that a retry took over and holds while the sweep runs. On PostgreSQL
/// the takeover deletes the expired row and inserts a new one; on MySQL it
/// rewrites the row in place; either way the sweep skips the row the
/// takeover holds and runs to its end before the takeover is let go. On
/// SQLite the sweep waits for the write lock the takeover holds, so it
/// runs after it whatever the order. A swept key then runs as new.
///
/// In a key table of the test's own: a sweep deletes every expired row of
/// its table, in the shared one other tests' expired keys too, while
/// those tests count on them.
pub async fn sweeping_spares_live_and_taken_over_keys<DB: TestDb>() {
    let table = format!("idem_sweep_{}", crate::app::nonce());
    let server = start_configured(DB::connect().await, |idem| {
        idem.table(&table).expect("a plain table name")
    })
    .await;
    server.state.idem.migrate().await.expect("migrate");
    let pool = server.state.idem.pool().clone();
    let caller = unique("sweep");
    let client = server.client(&caller);
    for key in ["swept", "taken"] {
        let first = send(client.post("/effects/short", key, BODY)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    }
    let live = send(client.post("/effects", "live", BODY)).await;
    assert_eq!(live.status, StatusCode::CREATED, "{live:?}");
    // The passage of time is what is under test here.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let (hold, taking) = server
        .send_held(client.post("/effects/short", "taken", BODY), &caller)
        .await;
    let idem = server.state.idem.clone();
    let sweep = tokio::spawn(async move { idem.sweep_expired(10_000).await });
    let swept = if DB::SERIAL_WRITES {
        hold.release.notify_one();
        sweep.await
    } else {
        let swept = tokio::time::timeout(Duration::from_secs(10), sweep)
            .await
            .expect("the sweep waited for the row the takeover holds");
        hold.release.notify_one();
        swept
    };
    let swept = swept.unwrap().expect("the sweep");
    let taken = taking.await.unwrap();
    assert_eq!(taken.status, StatusCode::CREATED, "{taken:?}");
    assert!(!taken.replayed(), "an expired key runs as new");
    assert_eq!(swept, 1, "the sweep deletes `swept` alone");

    assert_eq!(
        DB::rows_in(&pool, &table).await,
        2,
        "`live` and `taken` remain"
    );
    let retry = send(client.post("/effects/short", "taken", BODY)).await;
    assert!(
        retry.replayed(),
        "the takeover's response was lost: {retry:?}"
    );
    assert_eq!(retry.body, taken.body);
    assert!(send(client.post("/effects", "live", BODY)).await.replayed());
    let again = send(client.post("/effects/short", "swept", BODY)).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed(), "a swept key runs as new");
    assert_eq!(
        server.effects(&caller).await,
        5,
        "swept and taken twice, live once"
    );
    drop(server);
    DB::drop_table(&pool, &table).await;
}

/// Retries of an expired key at once: one of them runs as new (the row is
/// deleted and claimed again, or rewritten in place), the others replay it
/// or are told it is in use.
pub async fn concurrent_retries_of_an_expired_key_make_one_effect<DB: TestDb>() {
    let server = start::<DB>().await;
    let caller = unique("expired_race");
    let client = server.client(&caller);
    let first = send(client.post("/effects/short", "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The passage of time is what is under test here.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let again = r#"{"note":"another day"}"#;
    let answers = join_all((0..16).map(|_| send(client.post("/effects/short", "k", again)))).await;
    let mut originals = 0;
    for answer in &answers {
        match answer.status {
            StatusCode::CREATED if answer.replayed() => {}
            StatusCode::CREATED => originals += 1,
            StatusCode::CONFLICT => {
                assert_eq!(answer.problem_code(), "idempotency_key_in_use");
            }
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert_eq!(originals, 1, "exactly one retry runs the handler");
    assert_eq!(server.effects(&caller).await, 2);
    assert_eq!(server.keys(&caller).await, 1);
    assert!(
        send(client.post("/effects/short", "k", again))
            .await
            .replayed()
    );
}
