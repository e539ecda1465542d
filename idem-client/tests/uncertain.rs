//! Uncertain outcomes and the operation state every error reports, against
//! a real, scripted HTTP server on a manual clock.

mod support;

use std::time::Duration;

use idem_client::reqwest_middleware::ClientBuilder;
use idem_client::{
    Error, IdemClient, IdemMiddleware, Intent, LastAttempt, ManualClock, OperationState,
    RetryPolicy,
};
use support::bounded;
use support::scripted::{Reply, Scripted};

const UNCERTAIN: &str = "idempotency_outcome_uncertain";

fn client(clock: &ManualClock, policy: RetryPolicy) -> IdemClient {
    IdemClient::new(reqwest::Client::new())
        .with_clock(clock.clone())
        .with_seed(11)
        .with_policy(policy.attempt_timeout(Duration::from_secs(10)))
}

async fn charge(
    client: &IdemClient,
    intent: &Intent,
    url: &str,
) -> Result<idem_client::Sent, Error> {
    let request = client
        .post(format!("{url}/v1/payments"))
        .body("{\"amount\":990}");
    client.send(intent, request).await
}

/// The answer an `idem` server gives every request of a key whose outcome
/// is uncertain: 409, no `Retry-After`.
fn uncertain() -> Reply {
    Reply::idem_problem(409, UNCERTAIN, "uncertain")
}

#[tokio::test]
async fn an_uncertain_outcome_is_returned_at_once_and_never_retried() {
    bounded(async {
        // Were it retried, the next answer would be a success.
        let server = Scripted::start(vec![uncertain(), Reply::created("{}")]).await;
        let clock = ManualClock::new();
        let intent = Intent::new();

        let error = charge(
            &client(&clock, RetryPolicy::default()),
            &intent,
            &server.url,
        )
        .await
        .unwrap_err();

        let Error::Uncertain { status, problem } = &error else {
            panic!("{error:?}")
        };
        assert_eq!(*status, 409);
        assert_eq!(problem.code.as_deref(), Some(UNCERTAIN));
        assert_eq!(server.received().len(), 1, "one hit: not retried");
        assert!(clock.sleeps().is_empty(), "no wait either");
        assert_eq!(error.operation_state(), Some(OperationState::Uncertain));
        assert_eq!(error.safe_new_key(), Some(false));
        assert!(
            error.to_string().contains("do not retry with a new key"),
            "{error}"
        );
    })
    .await;
}

#[tokio::test]
async fn uncertain_is_final_even_with_a_retry_after_or_a_retryable_status() {
    bounded(async {
        let cases = [
            // A Retry-After is no reason to retry what no retry can tell.
            uncertain().with("retry-after", "1"),
            // A keyless commit whose outcome is unknown: a 503 saying so.
            Reply::idem_problem(503, "idempotency_store_unavailable", "uncertain"),
            // The stored 500 of an older server, replayed.
            Reply::idem_problem(500, "idempotency_request_abandoned", "uncertain").replayed(),
        ];
        for reply in cases {
            let server = Scripted::start(vec![reply, Reply::created("{}")]).await;
            let clock = ManualClock::new();
            let error = charge(
                &client(&clock, RetryPolicy::default()),
                &Intent::new(),
                &server.url,
            )
            .await
            .unwrap_err();
            assert!(matches!(error, Error::Uncertain { .. }), "{error:?}");
            assert_eq!(server.received().len(), 1, "{error}");
            assert!(clock.sleeps().is_empty());
        }
    })
    .await;
}

#[tokio::test]
async fn a_key_in_progress_is_still_retried_after_its_retry_after() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::idem_problem(409, "idempotency_key_in_use", "in_progress")
                .with("retry-after", "3"),
            Reply::created(r#"{"id":1}"#).replayed(),
        ])
        .await;
        let clock = ManualClock::new();
        let sent = charge(
            &client(&clock, RetryPolicy::default()),
            &Intent::new(),
            &server.url,
        )
        .await
        .unwrap();
        assert!(sent.replayed);
        assert_eq!(server.received().len(), 2);
        assert_eq!(clock.sleeps(), [Duration::from_secs(3)]);
    })
    .await;
}

/// The state each answer reported comes back on the error it ended with:
/// at once for what is not retried, as the last attempt's for a budget
/// spent on what is.
#[tokio::test]
async fn every_error_from_an_answer_reports_the_operation_state() {
    bounded(async {
        use OperationState::*;
        let cases = [
            (
                Reply::idem_problem(400, "idempotency_key_missing", "not_started"),
                NotStarted,
                true,
            ),
            (
                Reply::idem_problem(409, "idempotency_key_in_use", "in_progress"),
                InProgress,
                false,
            ),
            (
                Reply::idem_problem(422, "idempotency_key_reused", "completed"),
                Completed,
                false,
            ),
            (
                Reply::idem_problem(503, "idempotency_store_unavailable", "not_started"),
                NotStarted,
                true,
            ),
            (
                Reply::idem_problem(503, "idempotency_store_unavailable", "in_progress"),
                InProgress,
                false,
            ),
            (
                Reply::idem_problem(504, "handler_timeout", "not_started"),
                NotStarted,
                true,
            ),
            (uncertain(), Uncertain, false),
        ];
        for (reply, state, safe) in cases {
            let server = Scripted::start(vec![reply]).await;
            // One attempt: a retryable answer ends the budget at once.
            let policy = RetryPolicy::default().max_attempts(1);
            let error = charge(
                &client(&ManualClock::new(), policy),
                &Intent::new(),
                &server.url,
            )
            .await
            .unwrap_err();
            assert_eq!(error.operation_state(), Some(state), "{error:?}");
            assert_eq!(error.safe_new_key(), Some(safe), "{error:?}");
            assert!(error.problem().is_some(), "{error:?}");
            match state {
                InProgress => assert!(matches!(error, Error::BudgetExhausted { .. }), "{error:?}"),
                Completed => assert!(matches!(error, Error::KeyReused { .. }), "{error:?}"),
                _ => {}
            }
        }
    })
    .await;
}

#[tokio::test]
async fn an_error_without_an_answer_reports_no_state() {
    bounded(async {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let policy = RetryPolicy::default().max_attempts(2);
        let error = charge(&client(&ManualClock::new(), policy), &Intent::new(), &url)
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                Error::BudgetExhausted {
                    last: LastAttempt::Transport(_),
                    ..
                }
            ),
            "{error:?}"
        );
        assert_eq!(error.operation_state(), None, "nobody said");
        assert_eq!(error.safe_new_key(), None);
        // A body that is not idem's problem says nothing either.
        let server = Scripted::start(vec![Reply::status(400)]).await;
        let error = charge(
            &client(&ManualClock::new(), RetryPolicy::default()),
            &Intent::new(),
            &server.url,
        )
        .await
        .unwrap_err();
        assert!(matches!(error, Error::Rejected { .. }), "{error:?}");
        assert_eq!(error.operation_state(), None);
    })
    .await;
}

#[tokio::test]
async fn the_middleware_hands_back_an_uncertain_answer_at_once() {
    bounded(async {
        for reply in [
            uncertain(),
            Reply::idem_problem(503, "idempotency_store_unavailable", "uncertain"),
        ] {
            let server = Scripted::start(vec![reply, Reply::created("{}")]).await;
            let clock = ManualClock::new();
            let middleware = IdemMiddleware::new()
                .with_clock(clock.clone())
                .with_seed(11);
            let stack = ClientBuilder::new(reqwest::Client::new())
                .with(middleware)
                .build();
            let response = stack
                .post(&server.url)
                .body("{}")
                .with_extension(Intent::new())
                .send()
                .await
                .unwrap();
            let status = response.status();
            assert!(status == 409 || status == 503, "{status}");
            let problem: serde_json::Value = response.json().await.unwrap();
            assert_eq!(
                problem["operation_state"], "uncertain",
                "the body is handed on"
            );
            assert_eq!(server.received().len(), 1, "not retried");
            assert!(clock.sleeps().is_empty());
        }
    })
    .await;
}
