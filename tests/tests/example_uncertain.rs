//! A payment whose provider charges and never answers, against the real
//! `charges` and `provider` example binaries as a user runs them
//! (`PROVIDER_LOSE_ANSWERS=1`, `COMPLETER_ATTEMPTS=2`,
//! `COMPLETER_EVERY_MS=500`): once its tries are spent the payment is
//! uncertain, every retry is told so (409 `idempotency_outcome_uncertain`,
//! no `Retry-After`), nothing runs for it again, and the provider charged
//! it once, whatever the number of calls. Driven by the client's retries,
//! or by the completer alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idem_client::{Error, IdemClient, Intent, OperationState};
use idem_tests::examples::{charges, free_port};
use idem_tests::phased::provider::ProviderProcess;

/// `COMPLETER_ATTEMPTS`.
const ATTEMPTS: u64 = 2;
/// How long the payment may take to become uncertain.
const DEADLINE: Duration = Duration::from_secs(30);
const KEY: &str = "pay-lost";

/// The provider that loses every answer, and the `charges` example in
/// front of it with the completer's settings under test.
async fn start() -> (
    ProviderProcess,
    tokio::process::Child,
    String,
    tempfile::TempDir,
) {
    let provider = ProviderProcess::losing_answers().await;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let env = [
        ("PROVIDER_URL", Some(provider.url.as_str())),
        ("COMPLETER_ATTEMPTS", Some("2")),
        ("COMPLETER_EVERY_MS", Some("500")),
    ];
    let server = charges(dir.path(), addr, &env).await;
    (provider, server, format!("http://{addr}"), dir)
}

/// `POST /v1/payments` with [`KEY`].
async fn pay(http: &reqwest::Client, base: &str) -> reqwest::Response {
    http.post(format!("{base}/v1/payments"))
        .bearer_auth("acct_1")
        .header("Idempotency-Key", KEY)
        .json(&serde_json::json!({"amount": 990, "currency": "eur"}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("the charges example answers")
}

/// The answer's status, `code` and `Retry-After`, and its body.
async fn read(response: reqwest::Response) -> (u16, String, Option<String>, serde_json::Value) {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_owned());
    let body = response.text().await.unwrap();
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let code = json["code"].as_str().unwrap_or_default().to_owned();
    (status, code, retry_after, json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_whose_answers_are_lost_becomes_uncertain_and_is_charged_once() {
    let (provider, _server, base, _dir) = start().await;
    let http = reqwest::Client::new();

    // The provider charged and its answer was lost: the handler fails
    // after its external step, so the key is kept, not released.
    let (status, _, _, body) = read(pay(&http, &base).await).await;
    assert_eq!(status, 502, "the provider's answer was lost: {body}");
    assert_eq!(provider.stats().await.charges, 1, "charged all the same");

    // Retried (by the completer, and by these retries once a lease ends)
    // until the tries are spent. Meanwhile a retry runs and fails (502) or
    // finds the key leased (409 in use); then it is told the outcome is
    // uncertain.
    let deadline = Instant::now() + DEADLINE;
    let (retry_after, problem) = loop {
        let (status, code, retry_after, body) = read(pay(&http, &base).await).await;
        match (status, code.as_str()) {
            (409, "idempotency_outcome_uncertain") => break (retry_after, body),
            (502, _) | (409, "idempotency_key_in_use") => {}
            _ => panic!("unexpected answer {status}: {body}"),
        }
        assert!(
            Instant::now() < deadline,
            "not uncertain within {DEADLINE:?}: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(problem["operation_state"], "uncertain", "{problem}");
    assert_eq!(problem["safe_new_key"], false, "{problem}");
    assert_eq!(problem["status"], 409, "{problem}");
    assert_eq!(retry_after, None, "no retry can tell: {problem}");

    // One charge, whatever the number of calls: each try passed the
    // provider the same key, derived from the request's. The tries are
    // the first attempt and COMPLETER_ATTEMPTS more.
    let stats = provider.stats().await;
    assert_eq!(stats.charges, 1, "{stats:?}");
    assert_eq!(stats.calls, 1 + ATTEMPTS, "{stats:?}");

    // Nothing runs for the key any more: the same answer, no call.
    let (status, code, retry_after, _) = read(pay(&http, &base).await).await;
    assert_eq!(
        (status, code.as_str(), retry_after),
        (409, "idempotency_outcome_uncertain", None)
    );
    let payment = http
        .get(format!("{base}/v1/payments/1"))
        .bearer_auth("acct_1")
        .send()
        .await
        .unwrap();
    assert_eq!(payment.status(), 200);
    let payment: serde_json::Value = payment.json().await.unwrap();
    assert_eq!(payment["status"], "pending", "left for a person: {payment}");

    // The retrying client returns it at once, typed, after one attempt.
    let sent = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&sent);
    let client = IdemClient::new(reqwest::Client::new()).on_attempt(move |_| {
        counted.fetch_add(1, Ordering::Relaxed);
    });
    let request = client
        .post(format!("{base}/v1/payments"))
        .bearer_auth("acct_1")
        .json(&serde_json::json!({"amount": 990, "currency": "eur"}));
    let error = client
        .send(&Intent::restore(KEY).unwrap(), request)
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Uncertain { .. }), "{error:?}");
    assert_eq!(error.operation_state(), Some(OperationState::Uncertain));
    assert_eq!(error.safe_new_key(), Some(false));
    assert_eq!(sent.load(Ordering::Relaxed), 1, "not retried");
    assert_eq!(provider.stats().await, stats, "no call since");
}

/// No client retries: the completer alone spends the tries, every
/// `COMPLETER_EVERY_MS`, and the next request is told the outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_alone_makes_it_uncertain_within_its_settings() {
    let (provider, _server, base, _dir) = start().await;
    let http = reqwest::Client::new();
    let (status, _, _, body) = read(pay(&http, &base).await).await;
    assert_eq!(status, 502, "{body}");

    let tried = provider
        .until("the completer's tries", |stats| stats.calls == 1 + ATTEMPTS)
        .await;
    assert_eq!(tried.charges, 1, "{tried:?}");
    // Until the last try's lease ends the key is in use; then the next
    // request (or pass) finds the tries spent.
    let deadline = Instant::now() + DEADLINE;
    let body = loop {
        let (status, code, retry_after, body) = read(pay(&http, &base).await).await;
        if code == "idempotency_outcome_uncertain" {
            assert_eq!((status, retry_after), (409, None), "{body}");
            break body;
        }
        assert_eq!(
            (status, code.as_str()),
            (409, "idempotency_key_in_use"),
            "no try runs: {body}"
        );
        assert!(Instant::now() < deadline, "not uncertain: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(body["operation_state"], "uncertain", "{body}");
    assert_eq!(body["safe_new_key"], false, "{body}");
    // No try beyond COMPLETER_ATTEMPTS, by the completer or this request.
    assert_eq!(provider.stats().await, tried);
}
