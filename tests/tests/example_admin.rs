//! The `charges` example's operator routes, against the real binary: a
//! charge looked up finished, forgotten, then charged again as a first
//! attempt; a wrong token refused; and no routes at all without
//! `ADMIN_TOKEN`.

use std::path::Path;

use idem_tests::examples::{self, free_port};
use tokio::process::Child;

const TOKEN: &str = "s3cret-admin-token";

/// The example serving on a free port, its data in `dir`'s SQLite file,
/// with `admin_token` as its `ADMIN_TOKEN` (unset if `None`); its base URL.
async fn charges(dir: &Path, admin_token: Option<&str>) -> (Child, String) {
    let addr = free_port();
    let env = [("PROVIDER_URL", None), ("ADMIN_TOKEN", admin_token)];
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

    // Looked up: finished with 201; listed among the account's keys.
    let found = http.get(&key_url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(found.status(), 200);
    let info: serde_json::Value = found.json().await.unwrap();
    assert_eq!(info["state"], "completed", "{info}");
    assert_eq!(info["status"], 201, "{info}");
    assert_eq!(info["key"], "order-42", "{info}");
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
    ] {
        let response = request.bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(response.status(), 404);
    }
    // The key is still there: the next charge is replayed.
    assert_eq!(charge(&http, &base).await, (201, true));
}
