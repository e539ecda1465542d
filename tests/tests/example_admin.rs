//! The `charges` example's operator routes (`idem::admin`), against the
//! real binary: a charge looked up completed, forgotten, then charged
//! again as a first attempt; a wrong token refused; a payment seen in
//! flight; resolutions that are not ones refused, changing nothing; and
//! no routes at all without `ADMIN_TOKEN`.

use std::path::Path;
use std::time::{Duration, Instant};

use idem_tests::examples::{self, free_port};
use tokio::process::Child;

const TOKEN: &str = "s3cret-admin-token";

/// The example serving on a free port, its data in `dir`'s SQLite file,
/// with `admin_token` as its `ADMIN_TOKEN` (unset if `None`); its base URL.
async fn charges(dir: &Path, admin_token: Option<&str>) -> (Child, String) {
    charges_with(dir, admin_token, None).await
}

/// As [`charges`], its in-process provider answering each payment after
/// `provider_delay_ms`.
async fn charges_with(
    dir: &Path,
    admin_token: Option<&str>,
    provider_delay_ms: Option<&str>,
) -> (Child, String) {
    let addr = free_port();
    let env = [
        ("PROVIDER_URL", None),
        ("ADMIN_TOKEN", admin_token),
        ("PROVIDER_DELAY_MS", provider_delay_ms),
    ];
    (
        examples::charges(dir, addr, &env).await,
        format!("http://{addr}"),
    )
}

/// `POST /v1/charges` as the README's: its status and whether replayed.
async fn charge(http: &reqwest::Client, base: &str) -> (u16, bool) {
    let response = http
        .post(format!("{base}/v1/charges"))
        .bearer_auth("acct_1")
        .header("Idempotency-Key", "order-42")
        .json(&serde_json::json!({"amount": 1250, "currency": "eur"}))
        .send()
        .await
        .unwrap();
    (
        response.status().as_u16(),
        response.headers().contains_key(idem::IDEMPOTENT_REPLAYED),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_look_up_and_forget_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, base) = charges(dir.path(), Some(TOKEN)).await;
    let http = reqwest::Client::new();
    let key_url = format!("{base}/admin/idempotency/acct_1/order-42");

    assert_eq!(charge(&http, &base).await, (201, false));
    assert_eq!(charge(&http, &base).await, (201, true));

    // Looked up: completed with 201; listed among the account's keys.
    let found = http.get(&key_url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(found.status(), 200);
    let info: serde_json::Value = found.json().await.unwrap();
    assert_eq!(info["state"], "completed", "{info}");
    assert_eq!(info["status"], 201, "{info}");
    assert_eq!(info["key"], "order-42", "{info}");
    assert_eq!(info["attempts"], 0, "{info}");
    assert_eq!(info["uncertain"], serde_json::Value::Null, "{info}");
    assert_eq!(info["resolutions"], serde_json::json!([]), "{info}");
    let listed: serde_json::Value = http
        .get(format!("{base}/admin/idempotency/acct_1?limit=10"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed[0]["key"], "order-42", "{listed}");

    // A wrong or missing token: 401, and nothing is forgotten.
    for wrong in [Some("s3cret-admin-tokeN"), Some("s3cret"), None] {
        let request = http.delete(&key_url);
        let request = match wrong {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        assert_eq!(request.send().await.unwrap().status(), 401, "{wrong:?}");
    }
    let status = |response: reqwest::Response| response.status().as_u16();
    let get = http.get(&key_url).bearer_auth("nope").send().await.unwrap();
    assert_eq!(status(get), 401);

    // Forgotten: 204, then absent (404), and the same charge is a first
    // attempt again.
    let forgot = http
        .delete(&key_url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(status(forgot), 204);
    let again = http
        .delete(&key_url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(status(again), 404);
    let gone = http.get(&key_url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(status(gone), 404);
    assert_eq!(charge(&http, &base).await, (201, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_admin_token_the_routes_do_not_exist() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, base) = charges(dir.path(), None).await;
    let http = reqwest::Client::new();
    assert_eq!(charge(&http, &base).await, (201, false));
    let key_url = format!("{base}/admin/idempotency/acct_1/order-42");
    for request in [
        http.get(&key_url),
        http.delete(&key_url),
        http.get(format!("{base}/admin/idempotency/acct_1")),
        http.post(format!("{key_url}/resolve")),
        http.get(format!("{base}/admin")),
        http.get(format!("{base}/admin/login")),
    ] {
        let response = request.bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(response.status(), 404);
    }
    // The key is still there: the next charge is replayed.
    assert_eq!(charge(&http, &base).await, (201, true));
}

/// `POST /v1/payments` with `key`, as the README's `pay`.
async fn pay(http: &reqwest::Client, base: &str, key: &str) -> reqwest::Response {
    http.post(format!("{base}/v1/payments"))
        .bearer_auth("acct_1")
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"amount": 990, "currency": "eur"}))
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_in_flight_is_seen_with_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    // The provider holds each payment 3 s: the key is in flight meanwhile.
    let (_server, base) = charges_with(dir.path(), Some(TOKEN), Some("3000")).await;
    let http = reqwest::Client::new();
    let paying = tokio::spawn({
        let (http, base) = (http.clone(), base.clone());
        async move { pay(&http, &base, "pay-slow").await.status().as_u16() }
    });

    // Its JSON, once its first phase is recorded (the provider's call
    // under way): in flight, leased, with what is left of the 5 s lease.
    let key_url = format!("{base}/admin/idempotency/acct_1/pay-slow");
    let deadline = Instant::now() + Duration::from_secs(20);
    let info = loop {
        let response = http.get(&key_url).bearer_auth(TOKEN).send().await.unwrap();
        if response.status() == 200 {
            let info: serde_json::Value = response.json().await.unwrap();
            let pending = info["phases"]
                .as_array()
                .is_some_and(|p| p.contains(&"pending".into()));
            if pending {
                break info;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the payment never showed in flight"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (&info["state"], &info["leased"]),
        (&"in_flight".into(), &true.into()),
        "{info}"
    );
    let left = info["lease_left_ms"].as_u64().expect("a lease left");
    assert!((1..=5_000).contains(&left), "{info}");
    assert_eq!(info["method"], "POST", "{info}");
    assert_eq!(info["path"], "/v1/payments", "{info}");
    assert!(
        info["phases"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == "pending"),
        "{info}"
    );

    // The page lists it among the keys in flight.
    let page = http
        .get(format!("{base}/admin"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    let (_, in_flight) = html
        .split_once(r#"id="in-flight""#)
        .expect("the in-flight section");
    let (in_flight, _) = in_flight.split_once("</section>").unwrap();
    assert!(in_flight.contains("pay-slow"), "{in_flight}");

    // Finished, it is completed.
    assert_eq!(paying.await.unwrap(), 201);
    let info: serde_json::Value = http
        .get(&key_url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["state"], "completed", "{info}");
    assert_eq!(info["lease_left_ms"], serde_json::Value::Null, "{info}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_resolutions_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, base) = charges(dir.path(), Some(TOKEN)).await;
    let http = reqwest::Client::new();
    assert_eq!(charge(&http, &base).await, (201, false));
    let key_url = format!("{base}/admin/idempotency/acct_1/order-42");
    let resolve = format!("{key_url}/resolve");
    let send = |body: String| {
        http.post(&resolve)
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    // Input that is no resolution: 400 (not JSON) or 422, with a problem.
    let cases = [
        (r#"{"outcome": "finished"}"#, 422),
        (r#"{"outcome": "completed", "body": {"id": 1}}"#, 422),
        (r#"{"outcome": "completed", "status": 201}"#, 422),
        (
            r#"{"outcome": "completed", "status": 1000, "body": {}}"#,
            422,
        ),
        (
            r#"{"outcome": "completed", "status": "201", "body": {}}"#,
            422,
        ),
        (r#"{"outcome": "not_started", "status": 201}"#, 422),
        (r#"{"outcome": "retry", "colour": "red"}"#, 422),
        (r#"{"status": 201, "body": {}}"#, 422),
        (r#"{"outcome": "retry""#, 400),
    ];
    for (body, status) in cases {
        let response = send(body.to_owned()).await.unwrap();
        assert_eq!(response.status(), status, "{body}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{body}"
        );
    }
    // Without the token: 401, whatever the body.
    let anonymous = http
        .post(&resolve)
        .json(&serde_json::json!({"outcome": "retry"}))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);

    // A resolution of a key that is not uncertain: 409; of no key: 404.
    let done = serde_json::json!({"outcome": "completed", "status": 201, "body": {"id": 9}});
    let response = send(done.to_string()).await.unwrap();
    assert_eq!(response.status(), 409);
    let absent = http
        .post(format!(
            "{base}/admin/idempotency/acct_1/no-such-key/resolve"
        ))
        .bearer_auth(TOKEN)
        .json(&done)
        .send()
        .await
        .unwrap();
    assert_eq!(absent.status(), 404);

    // Nothing changed: the key as it was, replayed as it was.
    let info: serde_json::Value = http
        .get(&key_url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["state"], "completed", "{info}");
    assert_eq!(info["status"], 201, "{info}");
    assert_eq!(info["resolutions"], serde_json::json!([]), "{info}");
    assert_eq!(charge(&http, &base).await, (201, true));
}
