//! The retry rules against a real, scripted HTTP server, on a manual clock
//! with seeded randomness: no test waits real time for a backoff.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idem_client::{
    Attempt, Error, IdemClient, Intent, LastAttempt, ManualClock, Outcome, RetryPolicy,
    TransportKind, WaitReason,
};
use support::bounded;
use support::scripted::{Received, Reply, Scripted};

fn client(clock: &ManualClock) -> IdemClient {
    IdemClient::new(reqwest::Client::new())
        .with_clock(clock.clone())
        .with_seed(1)
        .with_policy(RetryPolicy::default().attempt_timeout(Duration::from_secs(10)))
}

async fn charge(
    client: &IdemClient,
    intent: &Intent,
    url: &str,
) -> Result<idem_client::Sent, Error> {
    let request = client
        .post(format!("{url}/v1/charges"))
        .body("{\"amount\":4200}");
    client.send(intent, request).await
}

fn keys(received: &[Received]) -> Vec<String> {
    received.iter().flat_map(|r| r.keys.clone()).collect()
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[tokio::test]
async fn every_attempt_carries_the_intents_key_and_a_replay_is_a_success() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::status(503),
            Reply::status(502),
            Reply::created(r#"{"id":7}"#).replayed(),
        ])
        .await;
        let clock = ManualClock::new();
        let intent = Intent::new();

        let sent = charge(&client(&clock), &intent, &server.url).await.unwrap();

        assert_eq!(keys(&server.received()), vec![intent.to_string(); 3]);
        assert!(
            server
                .received()
                .iter()
                .all(|r| r.body == "{\"amount\":4200}")
        );
        assert_eq!(sent.status, 201);
        assert!(sent.replayed);
        assert_eq!(&sent.body[..], br#"{"id":7}"#);
        assert_eq!(sent.attempts.len(), 3);
        assert!(sent.attempts[2].replayed && sent.attempts[2].wait.is_none());
    })
    .await;
}

#[tokio::test]
async fn backoff_waits_stay_within_the_full_jitter_bounds_and_repeat_with_the_seed() {
    bounded(async {
        let policy = RetryPolicy::default()
            .initial_backoff(Duration::from_millis(100))
            .max_backoff(secs(1))
            .max_attempts(8);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut replies = vec![Reply::status(503); 7];
            replies.push(Reply::created("{}"));
            let server = Scripted::start(replies).await;
            let clock = ManualClock::new();
            let sent = charge(
                &client(&clock).with_policy(policy),
                &Intent::new(),
                &server.url,
            )
            .await
            .unwrap();
            let sleeps = clock.sleeps();
            assert_eq!(sleeps.len(), 7);
            for (retry, sleep) in sleeps.iter().enumerate() {
                let bound = policy.backoff_bound(retry as u32);
                assert!(*sleep <= bound, "retry {retry}: {sleep:?} > {bound:?}");
                let logged = sent.attempts[retry].wait.unwrap();
                assert_eq!(
                    (logged.duration, logged.reason),
                    (*sleep, WaitReason::Backoff)
                );
            }
            // Full jitter draws from the whole range, so seven draws are not
            // all at the bound (as a jitter-free backoff would be).
            assert!((0..7).any(|r| sleeps[r] < policy.backoff_bound(r as u32)));
            runs.push(sleeps);
        }
        assert_eq!(runs[0], runs[1], "the same seed gives the same waits");
    })
    .await;
}

#[tokio::test]
async fn retry_after_in_seconds_overrides_the_backoff() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::status(429).with("retry-after", "2"),
            Reply::status(503).with("retry-after", "0"),
            Reply::created("{}"),
        ])
        .await;
        let clock = ManualClock::new();
        let sent = charge(&client(&clock), &Intent::new(), &server.url)
            .await
            .unwrap();
        assert_eq!(clock.sleeps(), [secs(2), secs(0)]);
        let reasons: Vec<_> = sent.attempts[..2]
            .iter()
            .map(|a| a.wait.unwrap().reason)
            .collect();
        assert_eq!(reasons, [WaitReason::RetryAfter; 2]);
    })
    .await;
}

#[tokio::test]
async fn retry_after_as_an_http_date_is_honoured() {
    bounded(async {
        let now = SystemTime::UNIX_EPOCH + secs(1_800_000_000);
        let in_7s = httpdate::fmt_http_date(now + secs(7));
        let long_ago = httpdate::fmt_http_date(now - secs(3600));
        let server = Scripted::start(vec![
            Reply::status(503).with("retry-after", in_7s),
            Reply::status(503).with("retry-after", long_ago),
            Reply::created("{}"),
        ])
        .await;
        let clock = ManualClock::at(now);
        charge(&client(&clock), &Intent::new(), &server.url)
            .await
            .unwrap();
        assert_eq!(clock.sleeps(), [secs(7), secs(0)]);
    })
    .await;
}

#[tokio::test]
async fn a_concurrent_duplicates_409_waits_what_the_server_said_then_gets_the_replay() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::problem(409, "idempotency_key_in_use").with("retry-after", "2"),
            Reply::created(r#"{"id":1}"#).replayed(),
        ])
        .await;
        let clock = ManualClock::new();
        let sent = charge(&client(&clock), &Intent::new(), &server.url)
            .await
            .unwrap();
        assert_eq!(clock.sleeps(), [secs(2)]);
        assert!(sent.replayed);
        assert_eq!(
            sent.attempts[0].outcome,
            Outcome::Status(reqwest::StatusCode::CONFLICT)
        );
    })
    .await;
}

#[tokio::test]
async fn retryable_statuses_are_retried() {
    bounded(async {
        for status in [429, 502, 503, 504] {
            let server = Scripted::start(vec![Reply::status(status), Reply::created("{}")]).await;
            let sent = charge(&client(&ManualClock::new()), &Intent::new(), &server.url)
                .await
                .unwrap_or_else(|e| panic!("{status}: {e}"));
            assert_eq!(sent.attempts.len(), 2, "{status}");
        }
    })
    .await;
}

#[tokio::test]
async fn answers_that_retrying_cannot_change_end_after_one_attempt() {
    bounded(async {
        let cases = [
            (Reply::problem(400, "idempotency_key_invalid"), 400),
            (Reply::problem(409, "order_conflict"), 409),
            (Reply::problem(422, "validation_failed"), 422),
            (Reply::status(404), 404),
            (Reply::status(500), 500),
            (
                Reply::problem(503, "idempotency_store_unavailable").replayed(),
                503,
            ),
        ];
        for (reply, status) in cases {
            let server = Scripted::start(vec![reply, Reply::created("{}")]).await;
            let clock = ManualClock::new();
            let error = charge(&client(&clock), &Intent::new(), &server.url)
                .await
                .unwrap_err();
            match &error {
                Error::Rejected { status: got, .. } | Error::ServerError { status: got, .. } => {
                    assert_eq!(*got, status)
                }
                other => panic!("{status}: {other:?}"),
            }
            assert_eq!(server.received().len(), 1, "{status}: {error}");
            assert!(clock.sleeps().is_empty());
        }
    })
    .await;
}

#[tokio::test]
async fn a_bad_request_is_rejected_with_its_problem() {
    bounded(async {
        let server = Scripted::start(vec![Reply::problem(400, "idempotency_key_invalid")]).await;
        let error = charge(&client(&ManualClock::new()), &Intent::new(), &server.url)
            .await
            .unwrap_err();
        let Error::Rejected {
            status, problem, ..
        } = error
        else {
            panic!("{error:?}")
        };
        assert_eq!(status, 400);
        assert_eq!(
            problem.unwrap().code.as_deref(),
            Some("idempotency_key_invalid")
        );
    })
    .await;
}

#[tokio::test]
async fn a_reused_key_is_its_own_error_after_one_attempt() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::problem(422, "idempotency_key_reused"),
            Reply::created("{}"),
        ])
        .await;
        let error = charge(&client(&ManualClock::new()), &Intent::new(), &server.url)
            .await
            .unwrap_err();
        assert!(
            matches!(&error, Error::KeyReused { problem } if problem.code.as_deref() == Some("idempotency_key_reused")),
            "{error:?}"
        );
        assert_eq!(server.received().len(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_retry_after_past_the_budget_gives_up_without_waiting() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::status(503).with("retry-after", "30"),
            Reply::created("{}"),
        ])
        .await;
        let clock = ManualClock::new();
        let client = client(&clock).with_policy(RetryPolicy::default().budget(secs(10)));
        let error = charge(&client, &Intent::new(), &server.url)
            .await
            .unwrap_err();
        let Error::BudgetExhausted { attempts, last } = error else {
            panic!("{error:?}")
        };
        assert_eq!(attempts, 1);
        assert!(matches!(last, LastAttempt::Status { status, .. } if status == 503));
        assert!(clock.sleeps().is_empty());
        assert_eq!(server.received().len(), 1);
    })
    .await;
}

#[tokio::test]
async fn backoff_never_waits_past_the_budget() {
    bounded(async {
        let budget = secs(3);
        let policy = RetryPolicy::default()
            .initial_backoff(secs(1))
            .max_attempts(100)
            .budget(budget);
        let server = Scripted::start(vec![Reply::status(503); 100]).await;
        let clock = ManualClock::new();
        let error = charge(
            &client(&clock).with_policy(policy),
            &Intent::new(),
            &server.url,
        )
        .await
        .unwrap_err();
        let Error::BudgetExhausted { attempts, .. } = error else {
            panic!("{error:?}")
        };
        assert!(clock.elapsed() < budget, "{:?}", clock.elapsed());
        assert_eq!(clock.sleeps().iter().sum::<Duration>(), clock.elapsed());
        assert_eq!(attempts as usize, server.received().len());
        assert_eq!(attempts as usize, clock.sleeps().len() + 1);
    })
    .await;
}

#[tokio::test]
async fn the_attempt_limit_is_honoured() {
    bounded(async {
        let server = Scripted::start(vec![Reply::status(503); 10]).await;
        let clock = ManualClock::new();
        let client = client(&clock).with_policy(RetryPolicy::default().max_attempts(3));
        let error = charge(&client, &Intent::new(), &server.url)
            .await
            .unwrap_err();
        assert!(
            matches!(error, Error::BudgetExhausted { attempts: 3, .. }),
            "{error:?}"
        );
        assert_eq!(server.received().len(), 3);
        assert_eq!(clock.sleeps().len(), 2);
    })
    .await;
}

#[tokio::test]
async fn connection_failures_are_retried() {
    bounded(async {
        // A port nothing listens on: every connection is refused.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let clock = ManualClock::new();
        let client = client(&clock).with_policy(RetryPolicy::default().max_attempts(4));
        let error = charge(&client, &Intent::new(), &url).await.unwrap_err();
        let Error::BudgetExhausted { attempts, last } = &error else {
            panic!("{error:?}")
        };
        assert_eq!(*attempts, 4);
        assert!(
            matches!(last, LastAttempt::Transport(e) if e.is_connect()),
            "{last:?}"
        );
        assert_eq!(clock.sleeps().len(), 3);
        // The cause stays reachable for whoever prints the error.
        assert!(std::error::Error::source(&error).is_some());
    })
    .await;
}

#[tokio::test]
async fn an_attempt_that_times_out_is_retried_with_the_same_key() {
    bounded(async {
        let server = Scripted::start(vec![Reply::Hang, Reply::created("{}")]).await;
        let clock = ManualClock::new();
        let policy = RetryPolicy::default().attempt_timeout(Duration::from_millis(200));
        let intent = Intent::new();
        let sent = charge(&client(&clock).with_policy(policy), &intent, &server.url)
            .await
            .unwrap();
        assert!(matches!(
            sent.attempts[0].outcome,
            Outcome::Transport {
                kind: TransportKind::Timeout,
                ..
            }
        ));
        assert_eq!(keys(&server.received()), vec![intent.to_string(); 2]);
    })
    .await;
}

#[tokio::test]
async fn a_streaming_body_is_refused_before_anything_is_sent() {
    bounded(async {
        let server = Scripted::start(vec![Reply::created("{}")]).await;
        let client = client(&ManualClock::new());
        let request = client
            .post(format!("{}/v1/charges", server.url))
            .body(reqwest::Body::wrap(String::from("{\"amount\":4200}")));
        let error = client.send(&Intent::new(), request).await.unwrap_err();
        assert!(matches!(error, Error::NotCloneable), "{error:?}");
        assert!(server.received().is_empty());
    })
    .await;
}

#[tokio::test]
async fn the_hook_sees_every_attempt_and_an_existing_key_header_is_replaced() {
    bounded(async {
        let server = Scripted::start(vec![Reply::status(503), Reply::created("{}")]).await;
        let seen = Arc::new(Mutex::new(Vec::<Attempt>::new()));
        let log = seen.clone();
        let client =
            client(&ManualClock::new()).on_attempt(move |a| log.lock().unwrap().push(a.clone()));
        let intent = Intent::restore("order-42").unwrap();
        let request = client
            .post(format!("{}/v1/charges", server.url))
            .header("idempotency-key", "minted-in-a-loop");
        let sent = client.send(&intent, request).await.unwrap();
        assert_eq!(*seen.lock().unwrap(), sent.attempts);
        assert_eq!(keys(&server.received()), ["order-42", "order-42"]);
    })
    .await;
}
