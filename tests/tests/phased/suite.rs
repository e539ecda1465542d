//! The phased mode's contract, in this process: leases and their 409s,
//! fencing of an attempt that stalled past its lease, the failure rule and
//! the completer giving up.

use std::time::{Duration, Instant};

use futures::future::join_all;
use idem_tests::phased::{
    Boundaries, Boundary, FAIL_LOCAL, LEASE, LONG_LEASE, LONG_PATH, PATH, PhasedDb, TOMBSTONE_PATH,
};
use idem_tests::service::unique;
use reqwest::StatusCode;

use crate::harness::{BODY, Fixture, OTHER_BODY, retry_after, retry_while_in_use, send};

/// A first attempt paused past its lease, at each boundary, while a retry
/// takes the key over (and is paused in turn, once it has called the
/// provider): when the first goes on, its next write under its old token
/// is fenced, it answers 409 and that phase rolls back, though the key is
/// still unfinished. Then the retry completes: one charge, one payment,
/// the retry's. (Not at `final` on SQLite: there the first attempt holds
/// the one write lock, which the retry's claim waits for.)
pub async fn stalled_attempts_are_fenced_once_a_retry_took_over<DB: PhasedDb>() {
    let stalls = Boundary::ALL
        .into_iter()
        .filter(|&at| !(DB::SERIAL_WRITES && at == Boundary::Final));
    join_all(stalls.map(stalled_at::<DB>)).await;
}

async fn stalled_at<DB: PhasedDb>(at: Boundary) {
    let context = format!("{} stalled at {at}", DB::ENGINE);
    let fixture = Fixture::<DB>::new(Duration::ZERO, 0).await;
    let (boundaries, pauses) = Boundaries::pauses(&[(1, at), (2, Boundary::Called)]);
    let (stalled, retrying) = (&pauses[0], &pauses[1]);
    let server = fixture.serve(boundaries).await;
    let key = unique("stalled");

    let first = tokio::spawn(send(fixture.post(server.addr, &key)));
    stalled.reached().await;
    let retry = {
        let request = fixture.post(server.addr, &key);
        tokio::spawn(
            async move { retry_while_in_use(|| request.try_clone().unwrap(), LEASE).await },
        )
    };
    retrying.reached().await;
    stalled.release();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CONFLICT, "{context}: {first:?}");
    assert_eq!(first.problem_code(), "idempotency_key_in_use", "{context}");
    let row = fixture.key_row(&key).await;
    assert!(
        row.is_some_and(|row| row.status.is_none()),
        "{context}: fenced by its token, not by a stored response: {row:?}"
    );

    retrying.release();
    let (answer, _) = retry.await.unwrap();
    assert!(!answer.replayed(), "{context}: {answer:?}");
    // One payment row, holding the retry's attempt: whatever the first
    // attempt wrote under its fenced token was rolled back.
    fixture.assert_one_payment(&answer, &context).await;
    // The first attempt calls the provider (again) only if it stopped
    // inside its external step, past the point that checks the token.
    let calls = match at {
        Boundary::Claimed | Boundary::Local => 1,
        Boundary::Calling | Boundary::Called | Boundary::Final => 2,
    };
    let stats = fixture.provider.stats().await;
    assert_eq!((stats.calls, stats.charges), (calls, 1), "{context}");
    let replay = send(fixture.post(server.addr, &key)).await;
    assert!(replay.replayed(), "{context}: {replay:?}");
    assert_eq!(replay.body, answer.body, "{context}");
    drop(server);
    fixture.discard().await;
}

/// A phased handler with `ttl = "2s", tombstone = "6s"`: replayed within
/// its ttl; then the same request gets `idempotency_key_expired` with the
/// first status and `Location`, another 422, and neither calls the
/// provider; after the tombstone the key pays anew.
pub async fn tombstones_refuse_late_retries<DB: PhasedDb>() {
    let fixture = Fixture::<DB>::new(Duration::ZERO, 0).await;
    let server = fixture.serve(Boundaries::none()).await;
    let key = unique("tombstoned");
    let post = |body| fixture.post_to(server.addr, TOMBSTONE_PATH, &key, body);
    let first = send(post(BODY)).await;
    fixture.assert_one_payment(&first, "first attempt").await;
    let location = first.header("location").expect("a Location").to_owned();
    assert!(send(post(BODY)).await.replayed());
    let calls = fixture.provider.stats().await;

    // The passage of time is what is under test here: past the 2 s ttl.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let late = send(post(BODY)).await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{late:?}");
    assert_eq!(late.problem_code(), "idempotency_key_expired");
    assert_eq!(late.json()["original_status"], 201, "{late:?}");
    assert_eq!(late.json()["location"], location.as_str(), "{late:?}");
    assert_eq!(late.operation_state(), ("completed".into(), false));
    let reused = send(post(OTHER_BODY)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{reused:?}"
    );
    assert_eq!(fixture.provider.stats().await, calls, "nothing ran");
    fixture.assert_one_payment(&first, "after the ttl").await;

    // Past the 6 s tombstone, which counts from the response (the steps
    // since the ttl have most of 4 s on a loaded machine).
    tokio::time::sleep(Duration::from_millis(4000)).await;
    let again = send(post(BODY)).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed(), "{again:?}");
    assert_eq!(fixture.payments().await.len(), 2);
    drop(server);
    fixture.discard().await;
}

/// While an attempt holds the lease, a duplicate gets 409 with a
/// `Retry-After` within what is left of the lease, and another body under
/// the key 422; once it completed, a retry replays it verbatim (status,
/// body, headers) marked `Idempotent-Replayed`. Another account's same
/// key is another request.
pub async fn leased_keys_are_409_and_finished_ones_replay<DB: PhasedDb>() {
    let fixture = Fixture::<DB>::new(Duration::ZERO, 0).await;
    let (boundaries, pause) = Boundaries::pause_at(Boundary::Local);
    let server = fixture.serve(boundaries).await;
    let key = unique("leased");
    let post = |body| fixture.post_to(server.addr, LONG_PATH, &key, body);

    let sent = Instant::now();
    let first = tokio::spawn(send(post(BODY)));
    pause.reached().await;
    let duplicate = send(post(BODY)).await;
    let elapsed = sent.elapsed().as_secs_f64();
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(duplicate.problem_code(), "idempotency_key_in_use");
    assert_eq!(duplicate.operation_state(), ("in_progress".into(), false));
    let wait = retry_after(&duplicate);
    let lease = LONG_LEASE.as_secs();
    assert!(
        wait <= lease,
        "Retry-After {wait} s beyond the lease of {lease} s"
    );
    assert!(
        wait as f64 >= lease as f64 - elapsed,
        "Retry-After {wait} s, but the lease has {lease} s less the {elapsed:.1} s since the claim"
    );
    let reused = send(post(OTHER_BODY)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{reused:?}"
    );
    assert_eq!(reused.problem_code(), "idempotency_key_reused");
    // The key's own request is still running: not completed.
    assert_eq!(reused.operation_state(), ("in_progress".into(), false));

    pause.release();
    let first = first.await.unwrap();
    assert!(!first.replayed(), "{first:?}");
    fixture.assert_one_payment(&first, "first attempt").await;
    let location = first.header("location").expect("a Location").to_owned();
    assert!(location.starts_with(PATH), "{location}");

    let replay = send(post(BODY)).await;
    assert_eq!(replay.status, first.status, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    for header in ["location", "content-type"] {
        assert_eq!(replay.header(header), first.header(header), "{header}");
    }
    let reused = send(post(OTHER_BODY)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{reused:?}"
    );

    let stranger = unique("stranger");
    let theirs = send(fixture.post_as(&stranger, server.addr, LONG_PATH, &key, BODY)).await;
    assert_eq!(theirs.status, StatusCode::CREATED, "{theirs:?}");
    assert!(!theirs.replayed(), "another account's key is its own");
    assert_ne!(theirs.body, first.body);
    let stats = fixture.provider.stats().await;
    assert_eq!((stats.calls, stats.charges), (2, 2), "one charge each");
    drop(server);
    fixture.discard().await;
}

/// The provider fails the first call: the client gets the handler's 502,
/// which is not stored (the key stays, unfinished, as an external step
/// may have happened); the retry resumes and succeeds with one charge.
pub async fn provider_failures_are_not_stored<DB: PhasedDb>() {
    let fixture = Fixture::<DB>::new(Duration::ZERO, 1).await;
    let server = fixture.serve(Boundaries::none()).await;
    let key = unique("provider_failed");

    let failed = send(fixture.post(server.addr, &key)).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY, "{failed:?}");
    let row = fixture.key_row(&key).await;
    assert!(
        row.is_some_and(|row| row.status.is_none()),
        "the key is kept, unfinished: {row:?}"
    );
    // A failed attempt's lease ends at once: the retry is not told 409.
    let retried = send(fixture.post(server.addr, &key)).await;
    assert!(!retried.replayed(), "{retried:?}");
    fixture.assert_one_payment(&retried, "retry").await;
    let stats = fixture.provider.stats().await;
    assert_eq!((stats.calls, stats.charges), (2, 1));
    let replay = send(fixture.post(server.addr, &key)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, retried.body);
    drop(server);
    fixture.discard().await;
}

/// A handler that fails before any external step (its local phase
/// refuses) releases the key: its row is gone, nothing was written or
/// called, and a retry with the key runs afresh at once.
pub async fn failures_before_any_external_step_release_the_key<DB: PhasedDb>() {
    let fixture = Fixture::<DB>::new(Duration::ZERO, 0).await;
    let server = fixture.serve(Boundaries::none()).await;
    let key = unique("released");

    let failed = send(fixture.post(server.addr, &key).header(FAIL_LOCAL, "1")).await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(fixture.key_row(&key).await, None, "the key is released");
    assert_eq!(fixture.payments().await, [], "the phase rolled back");
    assert_eq!(fixture.provider.stats().await.calls, 0);

    let retried = send(fixture.post(server.addr, &key)).await;
    assert!(!retried.replayed(), "{retried:?}");
    fixture.assert_one_payment(&retried, "retry").await;
    let stats = fixture.provider.stats().await;
    assert_eq!((stats.calls, stats.charges), (1, 1));
    let replay = send(fixture.post(server.addr, &key)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, retried.body);
    drop(server);
    fixture.discard().await;
}
