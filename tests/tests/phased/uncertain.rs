//! Uncertain outcomes: a key whose attempts ran out after its external
//! step may have happened, or whose `external_once` step began without a
//! recorded result, runs nothing and answers `idempotency_outcome_uncertain`
//! until an operator resolves it; each resolution then does what it says.

use std::time::{Duration, Instant};

use futures::future::join_all;
use idem::{KeyFilter, KeyState, Resolution, Resolved};
use idem_tests::phased::{self, Boundaries, Boundary, ChildOptions, ONCE_PATH, PhasedDb};
use idem_tests::service::unique;
use reqwest::StatusCode;

use crate::harness::{Answer, BODY, Fixture, InProcess, OTHER_BODY, send};

/// The attempts a key gets in these tests.
const ATTEMPTS: u32 = 2;

/// The service in this process, its keys given [`ATTEMPTS`] attempts.
async fn serve<DB: PhasedDb>(fixture: &Fixture<DB>) -> InProcess<DB> {
    fixture
        .serve_configured(Boundaries::none(), |idem| idem.max_attempts(ATTEMPTS))
        .await
}

/// Asserts that `answer` is the uncertain problem: 409 without
/// `Retry-After`, `operation_state` uncertain, no new key safe.
fn assert_uncertain(answer: &Answer, context: &str) {
    assert_eq!(answer.status, StatusCode::CONFLICT, "{context}: {answer:?}");
    assert_eq!(
        answer.problem_code(),
        "idempotency_outcome_uncertain",
        "{context}"
    );
    assert_eq!(
        answer.operation_state(),
        ("uncertain".into(), false),
        "{context}"
    );
    assert_eq!(answer.header("retry-after"), None, "{context}: {answer:?}");
}

/// A key whose provider call keeps failing, driven by the completer until
/// its attempts run out: uncertain. Returns the provider's calls by then.
async fn until_uncertain<DB: PhasedDb>(
    fixture: &Fixture<DB>,
    server: &InProcess<DB>,
    key: &str,
) -> u64 {
    let failed = send(fixture.post(server.addr, key)).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY, "{failed:?}");
    let completer = server
        .state
        .idem
        .completer(DB::phased_router(server.state.clone()))
        .backoff(Duration::from_millis(20));
    let (mut resumed, mut uncertain) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while uncertain == 0 {
        assert!(Instant::now() < deadline, "the key never became uncertain");
        let run = completer.run_once().await.expect("a completer pass");
        assert_eq!((run.completed, run.released), (0, 0), "{run:?}");
        resumed += run.resumed;
        uncertain += run.uncertain;
        // The backoff between the key's attempts is the wait.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!((resumed, uncertain), (ATTEMPTS, 1));
    assert_eq!(completer.run_once().await.unwrap().resumed, 0, "given up");
    let pass = server
        .state
        .idem
        .last_completer_pass()
        .expect("a pass kept");
    assert_eq!(pass.result, Ok(completer.run_once().await.unwrap()));
    fixture.provider.stats().await.calls
}

/// The completer's attempts run out on a key whose provider call failed:
/// the key is uncertain (its own retries 409, another body 422, nothing
/// runs, the provider is not called again); the lookup and the listing say
/// why; then each resolution does what it says.
pub async fn spent_attempts_make_the_key_uncertain<DB: PhasedDb>() {
    // Three keys' first attempts and two resumptions each fail; then the
    // provider answers.
    let fixture = Fixture::<DB>::new(Duration::ZERO, 3 * (1 + u64::from(ATTEMPTS))).await;
    let server = serve(&fixture).await;
    let keys = [unique("completed"), unique("not_started"), unique("retry")];
    for key in &keys {
        until_uncertain(&fixture, &server, key).await;
    }
    let calls = fixture.provider.stats().await;
    assert_eq!(
        (calls.calls, calls.charges),
        (3 * (1 + u64::from(ATTEMPTS)), 0)
    );
    let idem = &server.state.idem;
    for key in &keys {
        let context = format!("{} {key}", DB::ENGINE);
        let retry = send(fixture.post(server.addr, key)).await;
        assert_uncertain(&retry, &context);
        let other = send(fixture.post_to(server.addr, phased::PATH, key, OTHER_BODY)).await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
        assert_eq!(other.operation_state(), ("uncertain".into(), false));
        let info = idem.lookup(&fixture.account, key).await.unwrap().unwrap();
        assert_eq!(info.state, KeyState::Uncertain, "{context}: {info:?}");
        let why = info.uncertain.clone().expect("why it is uncertain");
        assert_eq!(why.reason, "attempts_exhausted", "{context}");
        assert_eq!(info.attempts, ATTEMPTS, "{context}");
        assert!(info.external && info.phases == ["pending"], "{info:?}");
    }
    assert_eq!(fixture.provider.stats().await, calls, "nothing ran");
    let listed = idem.keys(KeyFilter::Uncertain, 1000).await.unwrap();
    for key in &keys {
        assert!(listed.iter().any(|info| &info.key == key), "{key} listed");
    }
    assert_eq!(
        idem.forget(&fixture.account, &keys[0]).await.unwrap(),
        idem::Forgotten::Uncertain,
        "an uncertain key is resolved, not forgotten"
    );

    // Completed: the given response is stored, and every retry replays it.
    let found = serde_json::json!({"id": 7, "status": "succeeded", "by": "reconciliation"});
    let bad = Resolution::completed(StatusCode::BAD_GATEWAY, found.clone());
    assert!(matches!(
        idem.resolve(&fixture.account, &keys[0], bad).await,
        Err(idem::Error::InvalidResolution(_))
    ));
    let resolution = Resolution::completed(StatusCode::CREATED, found.clone())
        .by("ana")
        .note("the provider's report shows it paid");
    let resolved = idem.resolve(&fixture.account, &keys[0], resolution.clone());
    assert_eq!(resolved.await.unwrap(), Resolved::Resolved);
    let again = idem.resolve(&fixture.account, &keys[0], resolution).await;
    assert_eq!(again.unwrap(), Resolved::NotUncertain);
    let replay = send(fixture.post(server.addr, &keys[0])).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.json(), found);
    let info = idem
        .lookup(&fixture.account, &keys[0])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.state, KeyState::Completed);
    assert_eq!(info.resolutions.len(), 1, "{info:?}");
    let record = &info.resolutions[0];
    assert_eq!(
        (
            record.outcome.as_str(),
            record.status,
            record.by.as_deref(),
            record.note.as_deref()
        ),
        (
            "completed",
            Some(201),
            Some("ana"),
            Some("the provider's report shows it paid")
        )
    );

    // Not started: the key is released, and the next retry runs afresh
    // (the provider now charges: once more, as the operator asked).
    let resolved = idem.resolve(&fixture.account, &keys[1], Resolution::not_started());
    assert_eq!(resolved.await.unwrap(), Resolved::Resolved);
    let rerun = send(fixture.post(server.addr, &keys[1])).await;
    assert_eq!(rerun.status, StatusCode::CREATED, "{rerun:?}");
    assert!(!rerun.replayed(), "{rerun:?}");
    let info = idem
        .lookup(&fixture.account, &keys[1])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.state, KeyState::Completed);
    assert_eq!(info.resolutions.len(), 1, "kept after the key was released");
    assert_eq!(info.resolutions[0].outcome, "not_started");

    // Retry: the completer takes the key again, from its recovery point.
    let resolved = idem.resolve(&fixture.account, &keys[2], Resolution::retry().by("bo"));
    assert_eq!(resolved.await.unwrap(), Resolved::Resolved);
    let completer = idem.completer(DB::phased_router(server.state.clone()));
    let run = completer.run_once().await.unwrap();
    assert_eq!((run.resumed, run.completed), (1, 1), "{run:?}");
    let replay = send(fixture.post(server.addr, &keys[2])).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");

    let stats = fixture.provider.stats().await;
    assert_eq!((stats.calls, stats.charges), (calls.calls + 2, 2));
    let absent = idem.resolve(&fixture.account, "no-such-key", Resolution::retry());
    assert_eq!(absent.await.unwrap(), Resolved::Absent);
    drop(server);
    fixture.discard().await;
}

/// A client that retries without end ends at uncertain too: its retries
/// after a failed attempt count toward the same attempts as the
/// completer's.
pub async fn a_clients_retries_count_toward_the_attempts<DB: PhasedDb>() {
    let fixture = Fixture::<DB>::new(Duration::ZERO, 1_000).await;
    let server = serve(&fixture).await;
    let key = unique("retried");
    for attempt in 0..=ATTEMPTS {
        let failed = send(fixture.post(server.addr, &key)).await;
        assert_eq!(
            failed.status,
            StatusCode::BAD_GATEWAY,
            "{attempt}: {failed:?}"
        );
    }
    let spent = send(fixture.post(server.addr, &key)).await;
    assert_uncertain(&spent, DB::ENGINE);
    let again = send(fixture.post(server.addr, &key)).await;
    assert_uncertain(&again, DB::ENGINE);
    let stats = fixture.provider.stats().await;
    assert_eq!(stats.calls, 1 + u64::from(ATTEMPTS), "{stats:?}");
    drop(server);
    fixture.discard().await;
}

/// A server SIGKILLed inside an `external_once` step (before or after the
/// provider's call): the next attempt, the client's retry or the
/// completer's, never calls the provider again; the key is uncertain.
pub async fn external_once_steps_are_never_called_twice<DB: PhasedDb>() {
    let kills = [
        (Boundary::Calling, false),
        (Boundary::Called, false),
        (Boundary::Called, true),
    ];
    join_all(kills.map(|(at, completer)| killed_in_step::<DB>(at, completer))).await;
}

async fn killed_in_step<DB: PhasedDb>(at: Boundary, by_completer: bool) {
    let context = format!("{} killed at {at}, completer {by_completer}", DB::ENGINE);
    let fixture = Fixture::<DB>::new(Duration::ZERO, 0).await;
    let key = unique("once");
    let post = |addr| fixture.post_to(addr, ONCE_PATH, &key, BODY);
    let mut first = fixture
        .child(ChildOptions {
            stop_at: Some(at),
            complete_every: None,
        })
        .await;
    let lost = tokio::spawn(post(first.addr).send());
    first.until_boundary(at).await;
    first.kill().await;
    assert!(lost.await.unwrap().is_err(), "{context}: answered");
    let calls = u64::from(at == Boundary::Called);
    assert_eq!(fixture.provider.stats().await.calls, calls, "{context}");

    let second = fixture
        .child(ChildOptions {
            stop_at: None,
            complete_every: by_completer.then_some(Duration::from_millis(200)),
        })
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        if by_completer {
            if let Some(row) = fixture.key_row(&key).await
                && row.status == Some(0)
            {
                break send(post(second.addr)).await;
            }
        } else {
            let answer = send(post(second.addr)).await;
            if answer.status != StatusCode::CONFLICT
                || answer.problem_code() != "idempotency_key_in_use"
            {
                break answer;
            }
        }
        assert!(Instant::now() < deadline, "{context}: never uncertain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_uncertain(&answer, &context);
    assert_eq!(
        fixture.provider.stats().await.calls,
        calls,
        "{context}: the step is never called again"
    );
    let payments = fixture.payments().await;
    assert_eq!(payments.len(), 1, "{context}: {payments:?}");
    assert_eq!(payments[0].status, "pending", "{context}");
    drop(second);
    fixture.discard().await;
}
