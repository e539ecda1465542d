//! The guide's walkthrough of `POST /v1/payments`
//! (`docs/guide/getting-started.md`), against the real
//! `charges` and `provider` example binaries as a user runs them: a
//! payment, its replay, a concurrent duplicate told the lease's time left,
//! and a server killed during the provider's call whose payment the
//! restarted server's completer finishes, with one charge per payment.

use std::time::{Duration, Instant};

use idem_tests::examples::{charges, free_port};
use idem_tests::phased::provider::ProviderProcess;

/// The example's lease (`lease = "5s"` on its handler).
const LEASE_SECS: u64 = 5;

/// `POST /v1/payments` as the README's `pay` does.
async fn pay(http: &reqwest::Client, base: &str, key: &str) -> reqwest::Result<reqwest::Response> {
    http.post(format!("{base}/v1/payments"))
        .bearer_auth("acct_1")
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"amount": 990, "currency": "eur"}))
        .send()
        .await
}

async fn json(response: reqwest::Response) -> (u16, bool, serde_json::Value) {
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    (status, replayed, response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_holds() {
    let provider = ProviderProcess::start(Duration::from_millis(2500), 0).await;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let base = format!("http://{addr}");
    let provider_url = [("PROVIDER_URL", Some(provider.url.as_str()))];
    let mut server = charges(dir.path(), addr, &provider_url).await;
    let http = reqwest::Client::new();

    // A payment, then its replay.
    let (status, replayed, first) = json(pay(&http, &base, "pay-1").await.unwrap()).await;
    assert_eq!((status, replayed), (201, false), "{first}");
    assert_eq!(first["status"], "succeeded");
    let (status, replayed, again) = json(pay(&http, &base, "pay-1").await.unwrap()).await;
    assert_eq!((status, replayed, &again), (201, true, &first));

    // A duplicate while the first attempt is at the provider: 409, with
    // what is left of the lease.
    let running = tokio::spawn({
        let (http, base) = (http.clone(), base.clone());
        async move { json(pay(&http, &base, "pay-2").await.unwrap()).await }
    });
    provider
        .until("the second payment's call", |stats| stats.calls == 2)
        .await;
    let duplicate = pay(&http, &base, "pay-2").await.unwrap();
    assert_eq!(duplicate.status(), 409);
    let retry_after: u64 = duplicate.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=LEASE_SECS).contains(&retry_after), "{retry_after}");
    let (status, _, second) = running.await.unwrap();
    assert_eq!(
        (status, &second["status"]),
        (201, &serde_json::json!("succeeded"))
    );

    // Killed during the provider's call: the restarted server's completer
    // finishes the payment, without the client.
    let lost = tokio::spawn({
        let (http, base) = (http.clone(), base.clone());
        async move { pay(&http, &base, "pay-3").await }
    });
    provider
        .until("the third payment's call", |stats| stats.calls == 3)
        .await;
    server.kill().await.unwrap();
    assert!(lost.await.unwrap().is_err(), "the killed server answered");
    let _server = charges(dir.path(), addr, &provider_url).await;
    let deadline = Instant::now() + Duration::from_secs(40);
    let finished = loop {
        let payment = http
            .get(format!("{base}/v1/payments/3"))
            .bearer_auth("acct_1")
            .send()
            .await
            .unwrap();
        assert_eq!(payment.status(), 200, "the pending payment was committed");
        let payment: serde_json::Value = payment.json().await.unwrap();
        if payment["status"] == "succeeded" {
            break payment;
        }
        assert_eq!(payment["status"], "pending");
        assert!(
            Instant::now() < deadline,
            "the completer never finished {payment}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let stats = provider.stats().await;
    assert_eq!(stats.charges, 3, "one charge per payment: {stats:?}");
    // The client's retry now gets the completer's answer.
    let (status, replayed, third) = json(pay(&http, &base, "pay-3").await.unwrap()).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(third, finished);
}
