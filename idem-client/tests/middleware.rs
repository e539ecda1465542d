//! `IdemMiddleware` in a `ClientWithMiddleware` stack: requests with an
//! intent are keyed and retried, others pass through untouched.

mod support;

use std::time::Duration;

use idem_client::reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use idem_client::{AlreadyGone, IdemMiddleware, Intent, ManualClock, RetryPolicy};
use support::bounded;
use support::charges::{ACCOUNT, Charges};
use support::proxy::{Fault, Proxy};
use support::scripted::{Reply, Scripted};

fn stack(clock: &ManualClock, policy: RetryPolicy) -> ClientWithMiddleware {
    let middleware = IdemMiddleware::new()
        .with_clock(clock.clone())
        .with_seed(5)
        .with_policy(policy.attempt_timeout(Duration::from_secs(10)));
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

#[tokio::test]
async fn a_request_with_an_intent_is_keyed_and_retried() {
    bounded(async {
        let server = Scripted::start(vec![
            Reply::status(503),
            Reply::problem(409, "idempotency_key_in_use").with("retry-after", "2"),
            Reply::created(r#"{"id":1}"#).replayed(),
        ])
        .await;
        let clock = ManualClock::new();
        let policy = RetryPolicy::default();
        let intent = Intent::new();

        let response = stack(&clock, policy)
            .post(&server.url)
            .body("{}")
            .with_extension(intent.clone())
            .send()
            .await
            .unwrap();

        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        assert_eq!(response.text().await.unwrap(), r#"{"id":1}"#);
        let keys: Vec<_> = server.received().into_iter().flat_map(|r| r.keys).collect();
        assert_eq!(keys, vec![intent.to_string(); 3]);
        let sleeps = clock.sleeps();
        assert!(sleeps[0] <= policy.backoff_bound(0));
        assert_eq!(sleeps[1], Duration::from_secs(2));
    })
    .await;
}

#[tokio::test]
async fn a_request_without_an_intent_passes_through_untouched() {
    bounded(async {
        let server = Scripted::start(vec![Reply::status(503), Reply::created("{}")]).await;
        let clock = ManualClock::new();

        let response = stack(&clock, RetryPolicy::default())
            .post(&server.url)
            .body("{}")
            .send()
            .await
            .unwrap();

        assert_eq!(response.status(), 503);
        let received = server.received();
        assert_eq!(received.len(), 1);
        assert!(received[0].keys.is_empty());
        assert!(clock.sleeps().is_empty());
    })
    .await;
}

#[tokio::test]
async fn a_final_answer_is_handed_on_with_its_body() {
    bounded(async {
        // A 409 read to learn its code, then given up on: the caller still
        // gets the whole answer. A 422 is handed on at once.
        let server = Scripted::start(vec![
            Reply::problem(409, "idempotency_key_in_use").with("retry-after", "120"),
            Reply::problem(422, "idempotency_key_reused"),
        ])
        .await;
        let client = stack(&ManualClock::new(), RetryPolicy::default());

        for expected in [409, 422] {
            let response = client
                .post(&server.url)
                .body("{}")
                .with_extension(Intent::new())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), expected);
            assert_eq!(
                response.headers()["content-type"],
                "application/problem+json"
            );
            let problem: serde_json::Value = response.json().await.unwrap();
            assert_eq!(problem["status"], expected);
        }
        assert_eq!(server.received().len(), 2);
    })
    .await;
}

/// Charges 4200 with `intent` through the stack: the status, whether it was
/// replayed and the body.
async fn charge(client: &ClientWithMiddleware, url: &str, intent: &Intent) -> (u16, bool, String) {
    let response = client
        .post(format!("{url}/v1/charges"))
        .bearer_auth(ACCOUNT)
        .header("content-type", "application/json")
        .body(r#"{"amount": 4200, "currency": "eur"}"#)
        .with_extension(intent.clone())
        .send()
        .await
        .unwrap();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    (
        response.status().as_u16(),
        replayed,
        response.text().await.unwrap(),
    )
}

#[tokio::test]
async fn the_same_intent_twice_through_the_stack_is_one_charge() {
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let client = stack(&ManualClock::new(), RetryPolicy::default());
        let intent = Intent::new();

        let first = charge(&client, &server.url, &intent).await;
        let second = charge(&client, &server.url, &intent).await;

        assert_eq!((first.0, first.1), (201, false));
        assert_eq!((second.0, second.1), (201, true));
        assert_eq!(first.2, second.2);
        assert_eq!(server.charges().await.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn an_answer_lost_on_the_way_back_is_replayed_by_the_middleware() {
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let proxy = Proxy::start(server.addr, vec![Fault::DropResponse], None).await;
        let clock = ManualClock::new();
        let client = stack(&clock, RetryPolicy::default());

        let (status, replayed, body) = charge(&client, &proxy.url, &Intent::new()).await;

        assert_eq!((status, replayed), (201, true));
        assert_eq!(body, proxy.answers()[0].body, "the first attempt's answer");
        assert_eq!(clock.sleeps().len(), 1);
        assert_eq!(server.charges().await.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_deletes_404_on_a_retry_is_marked_already_gone_when_asked() {
    bounded(async {
        // Per case: the script, whether the option is on, and whether the
        // final 404 is marked.
        let cases = [
            (vec![Reply::status(503), Reply::status(404)], true, true),
            (vec![Reply::status(404)], true, false),
            (vec![Reply::status(503), Reply::status(404)], false, false),
            (
                vec![Reply::status(503), Reply::status(404).replayed()],
                true,
                false,
            ),
        ];
        for (replies, on, marked) in cases {
            let attempts = replies.len();
            let server = Scripted::start(replies).await;
            let middleware = IdemMiddleware::new()
                .with_clock(ManualClock::new())
                .with_seed(5)
                .not_found_is_done(on);
            let client = ClientBuilder::new(reqwest::Client::new())
                .with(middleware)
                .build();
            let response = client
                .delete(format!("{}/v1/things/7", server.url))
                .with_extension(Intent::new())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 404);
            assert_eq!(
                response.extensions().get::<AlreadyGone>().is_some(),
                marked,
                "{attempts} attempts, option {on}"
            );
            assert_eq!(server.received().len(), attempts);
        }
    })
    .await;
}
