//! End to end: the client against the real `charges` example behind a
//! fault-injecting proxy. Whatever the fault, one intent is one charge and
//! the client gets the first attempt's answer.

mod support;

use std::time::Duration;

use idem_client::{Clock, Error, IdemClient, Intent, ManualClock, Outcome, RetryPolicy, Sent};
use idem_client::{TransportKind, WaitReason};
use support::charges::{ACCOUNT, Charges};
use support::proxy::{Fault, Proxy};
use support::{GatedClock, bounded};

fn client(clock: impl Clock) -> IdemClient {
    IdemClient::new(reqwest::Client::new())
        .with_clock(clock)
        .with_seed(3)
        .with_policy(RetryPolicy::default().attempt_timeout(Duration::from_secs(10)))
}

async fn charge(
    client: &IdemClient,
    intent: &Intent,
    url: &str,
    amount: i64,
) -> Result<Sent, Error> {
    let request = client
        .post(format!("{url}/v1/charges"))
        .bearer_auth(ACCOUNT)
        .json(&serde_json::json!({"amount": amount, "currency": "eur"}));
    client.send(intent, request).await
}

fn body(sent: &Sent) -> String {
    String::from_utf8(sent.body.to_vec()).unwrap()
}

#[tokio::test]
async fn an_answer_lost_after_the_commit_is_replayed_not_charged_again() {
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let proxy = Proxy::start(server.addr, vec![Fault::DropResponse], None).await;

        let sent = charge(
            &client(ManualClock::new()),
            &Intent::new(),
            &proxy.url,
            4200,
        )
        .await
        .unwrap();

        assert_eq!(server.charges().await.len(), 1);
        let answers = proxy.answers();
        assert_eq!(answers[0].status, 201, "the first attempt committed");
        assert_eq!(body(&sent), answers[0].body, "the first attempt's answer");
        assert!(sent.replayed);
        assert_eq!(sent.attempts.len(), 2);
    })
    .await;
}

#[tokio::test]
async fn connections_reset_before_the_request_arrived_are_sent_again() {
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let faults = vec![Fault::ResetBeforeRequest, Fault::ResetBeforeRequest];
        let proxy = Proxy::start(server.addr, faults, None).await;

        let sent = charge(
            &client(ManualClock::new()),
            &Intent::new(),
            &proxy.url,
            4200,
        )
        .await
        .unwrap();

        assert_eq!(server.charges().await.len(), 1);
        assert_eq!(proxy.answers().len(), 1, "the server saw one request");
        assert_eq!(body(&sent), proxy.answers()[0].body);
        assert!(!sent.replayed);
        assert_eq!(sent.attempts.len(), 3);
        assert!(matches!(
            sent.attempts[0].outcome,
            Outcome::Transport { .. }
        ));
    })
    .await;
}

#[tokio::test]
async fn a_503_is_retried_after_a_jittered_backoff() {
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let proxy = Proxy::start(server.addr, vec![Fault::Answer503; 2], None).await;
        let clock = ManualClock::new();
        let client = client(clock.clone());

        let sent = charge(&client, &Intent::new(), &proxy.url, 4200)
            .await
            .unwrap();

        assert_eq!(server.charges().await.len(), 1);
        assert_eq!(body(&sent), proxy.answers()[0].body);
        let sleeps = clock.sleeps();
        assert_eq!(sleeps.len(), 2);
        for (retry, sleep) in sleeps.iter().enumerate() {
            assert!(*sleep <= client.policy().backoff_bound(retry as u32));
            assert_eq!(
                sent.attempts[retry].wait.unwrap().reason,
                WaitReason::Backoff
            );
        }
    })
    .await;
}

#[tokio::test]
async fn a_client_that_times_out_while_the_first_attempt_runs_gets_its_answer() {
    bounded(async {
        // The handler takes 1.5 s; the client gives each attempt 0.5 s, and
        // the proxy never hands the first answer on.
        let server = Charges::start(Duration::from_millis(1500)).await;
        let proxy = Proxy::start(server.addr, vec![Fault::Hold], None).await;
        // Retry only once the first attempt committed, whatever the timing.
        let clock = GatedClock::new(proxy.committed());
        let client = client(clock.clone())
            .with_policy(RetryPolicy::default().attempt_timeout(Duration::from_millis(500)));

        let sent = charge(&client, &Intent::new(), &proxy.url, 4200)
            .await
            .unwrap();

        assert!(matches!(
            sent.attempts[0].outcome,
            Outcome::Transport {
                kind: TransportKind::Timeout,
                ..
            }
        ));
        assert_eq!(server.charges().await.len(), 1);
        assert_eq!(proxy.answers()[0].status, 201);
        assert_eq!(body(&sent), proxy.answers()[0].body, "the held answer");
        assert!(sent.replayed);
    })
    .await;
}

#[tokio::test]
async fn a_concurrent_duplicate_waits_the_servers_retry_after_then_gets_the_replay() {
    bounded(async {
        let server = Charges::start(Duration::from_millis(1500)).await;
        // The example answers a duplicate `Retry-After: 1`; the proxy makes
        // it 2 so the wait is visibly the server's and not a default.
        let proxy = Proxy::start(server.addr, vec![], Some(2)).await;
        let (a, b) = (
            GatedClock::new(proxy.committed()),
            GatedClock::new(proxy.committed()),
        );
        let intent = Intent::new();

        let (client_a, client_b) = (client(a.clone()), client(b.clone()));
        let (first, second) = tokio::join!(
            charge(&client_a, &intent, &proxy.url, 4200),
            charge(&client_b, &intent, &proxy.url, 4200),
        );
        let (first, second) = (first.unwrap(), second.unwrap());

        // Which of the two the server ran first is up to it.
        let ((ran, _), (waited, waited_clock)) = if first.replayed {
            ((second, b), (first, a))
        } else {
            ((first, a), (second, b))
        };
        assert!(!ran.replayed);
        assert_eq!(ran.attempts.len(), 1);
        assert_eq!(
            waited.attempts[0].outcome,
            Outcome::Status(reqwest::StatusCode::CONFLICT),
            "the duplicate arrived while the first attempt ran: {:?}",
            waited.attempts
        );
        assert_eq!(waited_clock.manual.sleeps(), [Duration::from_secs(2)]);
        assert_eq!(
            waited.attempts[0].wait.unwrap().reason,
            WaitReason::RetryAfter
        );
        assert!(waited.replayed);
        assert_eq!(body(&waited), body(&ran));
        assert_eq!(server.charges().await.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_reused_key_with_another_body_is_key_reused_after_one_attempt() {
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let proxy = Proxy::start(server.addr, vec![], None).await;
        let clock = ManualClock::new();
        let client = client(clock.clone());
        let intent = Intent::new();
        charge(&client, &intent, &proxy.url, 4200).await.unwrap();

        let error = charge(&client, &intent, &proxy.url, 999).await.unwrap_err();

        let Error::KeyReused { problem } = &error else {
            panic!("{error:?}")
        };
        assert_eq!(problem.code.as_deref(), Some("idempotency_key_reused"));
        assert_eq!(proxy.answers().len(), 2, "one attempt each");
        assert!(clock.sleeps().is_empty());
        assert_eq!(server.charges().await.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn two_intents_are_two_charges() {
    // The other tests' "one charge" would also hold if nothing were charged
    // twice because nothing could be counted twice: this one counts two.
    bounded(async {
        let server = Charges::start(Duration::ZERO).await;
        let client = client(ManualClock::new());
        let one = charge(&client, &Intent::new(), &server.url, 4200)
            .await
            .unwrap();
        let two = charge(&client, &Intent::new(), &server.url, 4200)
            .await
            .unwrap();
        assert_ne!(body(&one), body(&two));
        assert_eq!(server.charges().await.len(), 2);
    })
    .await;
}
