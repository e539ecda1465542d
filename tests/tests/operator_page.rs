//! The operator page (`idem::admin`) in a real browser, headless Chromium
//! over its DevTools protocol, against the `charges` example as a user
//! runs it: a payment whose provider loses its answers becomes uncertain;
//! an operator who is refused without the token and with a wrong one
//! signs in with it, finds the key on the page and resolves it completed
//! with a 201; the client's retry then replays that 201. Posts from
//! another origin, with the operator's cookie, change nothing.
//!
//! Screenshots land in `target/screenshots/`; with
//! `IDEM_SCREENSHOT_DOCS=1` the overview's also replaces
//! `docs/images/operator-page.png`, the README's.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::response::Html;
use idem_tests::browser::{Browser, Page};
use idem_tests::examples::{self, free_port};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

const TOKEN: &str = "operator-page-token-0123456789abcdef";
const KEY: &str = "pay-lost";
/// What the operator found at the provider and records.
const FOUND: &str =
    r#"{"id": 1, "amount": 990, "currency": "eur", "status": "succeeded", "provider_id": "pay_1"}"#;

/// `target/screenshots/<name>.png`.
fn screenshot(name: &str) -> PathBuf {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent()
        .expect("target/tmp is in the target directory")
        .join("screenshots")
        .join(format!("{name}.png"))
}

/// The `provider` example, recording each charge and then losing its
/// answer; its base URL.
async fn provider_losing_answers() -> (Child, String) {
    let mut command = Command::new(examples::binary("provider"));
    command
        .env("PROVIDER_ADDR", "127.0.0.1:0")
        .env("PROVIDER_LOSE_ANSWERS", "1");
    let listening = |line: &str| {
        let (_, rest) = line.split_once("listening on http://")?;
        let addr: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
            .collect();
        Some(addr)
    };
    let (child, addr) = examples::start_until(command, "the provider example", listening).await;
    (child, format!("http://{addr}"))
}

/// `POST /v1/payments` with [`KEY`], as the README's `pay`.
async fn pay(http: &reqwest::Client, base: &str) -> reqwest::Response {
    http.post(format!("{base}/v1/payments"))
        .bearer_auth("acct_1")
        .header("Idempotency-Key", KEY)
        .json(&json!({"amount": 990, "currency": "eur"}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap()
}

/// The key's JSON, by the bearer token.
async fn key_json(http: &reqwest::Client, base: &str) -> Value {
    let response = http
        .get(format!("{base}/admin/idempotency/acct_1/{KEY}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// Serves `html` on another loopback origin (another port: the same site
/// as the admin's, another origin); its URL.
async fn another_origin(html: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let app = axum::Router::new().route("/", axum::routing::get(move || async { Html(html) }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Whether the page's text contains `text`.
fn shows(text: &str) -> String {
    format!(
        "document.body && document.body.innerText.includes({})",
        serde_json::to_string(text).unwrap()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_uncertain_payment_in_a_browser() {
    // A browser first: without Chromium this fails at once, loudly.
    let browser = Browser::start().await;
    let (_provider, provider_url) = provider_losing_answers().await;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let base = format!("http://{addr}");
    let env = [
        ("PROVIDER_URL", Some(provider_url.as_str())),
        ("ADMIN_TOKEN", Some(TOKEN)),
        ("COMPLETER_ATTEMPTS", Some("2")),
        ("COMPLETER_EVERY_MS", Some("500")),
    ];
    let _server = examples::charges(dir.path(), addr, &env).await;
    let http = reqwest::Client::new();

    // The provider charges, and its answer is lost: after the client's
    // attempt and the completer's, the payment's outcome is uncertain.
    let first = pay(&http, &base).await;
    assert_ne!(first.status(), 201, "the provider lost no answer");
    let deadline = Instant::now() + Duration::from_secs(90);
    let info = loop {
        let info = key_json(&http, &base).await;
        if info["state"] == "uncertain" {
            break info;
        }
        assert!(Instant::now() < deadline, "never uncertain: {info}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(info["uncertain"]["reason"], "attempts_exhausted", "{info}");
    let retry = pay(&http, &base).await;
    assert_eq!(retry.status(), 409);
    let problem: Value = retry.json().await.unwrap();
    assert_eq!(
        problem["code"], "idempotency_outcome_uncertain",
        "{problem}"
    );

    // Through the JSON routes: it cannot be forgotten, nor completed with
    // a status `idem` would not store; nothing changes.
    let key_url = format!("{base}/admin/idempotency/acct_1/{KEY}");
    let forget = http
        .delete(&key_url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(forget.status(), 409);
    let not_stored = json!({"outcome": "completed", "status": 503, "body": {}});
    let refused = http
        .post(format!("{key_url}/resolve"))
        .bearer_auth(TOKEN)
        .json(&not_stored)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    assert_eq!(key_json(&http, &base).await["state"], "uncertain");

    let page = browser.page().await;
    signs_in_with_the_token_only(&page, &base).await;

    // The overview lists the key among the uncertain ones.
    page.goto(&format!("{base}/admin")).await;
    let in_list = format!(
        "[...document.querySelectorAll('[aria-labelledby=uncertain-keys] a')]\
         .some(a => a.textContent === {})",
        serde_json::to_string(KEY).unwrap()
    );
    page.wait_for("the key among the uncertain ones", &in_list)
        .await;
    page.screenshot(&screenshot("operator-overview")).await;
    if std::env::var_os("IDEM_SCREENSHOT_DOCS").is_some() {
        let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/images");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::copy(
            screenshot("operator-overview"),
            docs.join("operator-page.png"),
        )
        .unwrap();
    }
    // On a phone: the page fits the screen's width (wide tables scroll in
    // their own region).
    page.screen(390, 844, true).await;
    page.goto(&format!("{base}/admin")).await;
    let fits = page
        .eval("document.documentElement.scrollWidth <= window.innerWidth")
        .await;
    assert_eq!(fits, json!(true), "the page scrolls sideways on a phone");
    page.screenshot(&screenshot("operator-overview-phone"))
        .await;
    page.call("Emulation.clearDeviceMetricsOverride", json!({}))
        .await;

    // Its page, by its link: the recovery point's phases, the forms.
    page.goto(&format!("{base}/admin")).await;
    let link = format!("[aria-labelledby=uncertain-keys] a[href$='key={}']", KEY);
    page.click(&link).await;
    page.wait_for(
        "the key's page",
        "!!document.querySelector('#completed-status')",
    )
    .await;
    let h1 = page.eval("document.querySelector('h1').innerText").await;
    assert!(h1.as_str().unwrap().contains(KEY), "{h1}");
    page.wait_for("the recorded phase", &shows("pending")).await;

    cross_site_posts_change_nothing(&browser, &http, &base).await;

    // Resolved as completed with a 201 and what the provider shows.
    page.type_into("#completed-status", "201").await;
    page.type_into("#completed-body", FOUND).await;
    page.type_into("#completed-by", "ana").await;
    page.type_into("#completed-note", "the provider's dashboard shows pay_1")
        .await;
    page.screenshot(&screenshot("operator-key-uncertain")).await;
    page.click("form[aria-labelledby=completed-h] button[type=submit]")
        .await;
    page.wait_for(
        "the resolution's notice",
        &shows("Resolved: the decision is recorded"),
    )
    .await;
    page.wait_for(
        "the key completed",
        "document.querySelector('dl.facts .state').textContent === 'completed'",
    )
    .await;
    page.screenshot(&screenshot("operator-key-resolved")).await;
    let info = key_json(&http, &base).await;
    assert_eq!(info["state"], "completed", "{info}");
    assert_eq!(info["status"], 201, "{info}");
    let record = &info["resolutions"][0];
    assert_eq!(record["outcome"], "completed", "{info}");
    assert_eq!(record["by"], "ana", "{info}");

    // The client's retry replays that 201.
    let replay = pay(&http, &base).await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let body: Value = replay.json().await.unwrap();
    assert_eq!(body, serde_json::from_str::<Value>(FOUND).unwrap());
}

/// Refused without the token and with a wrong one (no cookie), then
/// signed in with it, pressing Enter as a keyboard user would.
async fn signs_in_with_the_token_only(page: &Page, base: &str) {
    page.goto(&format!("{base}/admin")).await;
    page.wait_for(
        "the login page",
        "location.pathname === '/admin/login' && !!document.querySelector('#token')",
    )
    .await;
    page.screenshot(&screenshot("operator-login")).await;

    page.type_into("#token", "not-the-token").await;
    page.press_enter().await;
    page.wait_for(
        "the wrong token refused",
        &shows("That is not the admin token"),
    )
    .await;
    let cookies = page.cookies(&format!("{base}/admin")).await;
    assert!(
        cookies.iter().all(|cookie| cookie["name"] != "idem_admin"),
        "{cookies:?}"
    );

    page.type_into("#token", TOKEN).await;
    page.click("form[action='/admin/login'] button[type=submit]")
        .await;
    page.wait_for(
        "the overview",
        "location.pathname === '/admin' && document.querySelector('h1').innerText === 'Idempotency keys'",
    )
    .await;
    let cookies = page.cookies(&format!("{base}/admin")).await;
    let session = cookies
        .iter()
        .find(|cookie| cookie["name"] == "idem_admin")
        .unwrap_or_else(|| panic!("a session cookie: {cookies:?}"));
    assert_eq!(session["httpOnly"], true, "{session}");
    assert_eq!(session["sameSite"], "Strict", "{session}");
    assert_eq!(session["path"], "/admin", "{session}");
    assert!(!session["value"].as_str().unwrap().contains(TOKEN));
}

/// A page of another origin posts forms to the admin, in the signed-in
/// browser (whose cookie goes along: same site): refused, and the key is
/// still uncertain.
async fn cross_site_posts_change_nothing(browser: &Browser, http: &reqwest::Client, base: &str) {
    let field =
        |name: &str, value: &str| format!(r#"<input type="hidden" name="{name}" value='{value}'>"#);
    let fields = [
        field("scope", "acct_1"),
        field("key", KEY),
        field("outcome", "completed"),
        field("status", "201"),
        field("body", r#"{"forged": true}"#),
        field("csrf", "forged"),
    ]
    .concat();
    let forged = format!(
        "<!doctype html><title>Win a prize</title>\
         <form id=page method=post action='{base}/admin/key/resolve'>{fields}\
         <button id=one>Claim</button></form>\
         <form id=api method=post enctype=text/plain \
         action='{base}/admin/idempotency/acct_1/{KEY}/resolve'>\
         <input type=hidden name='{{\"outcome\": \"retry\", \"x\": \"' value='\"}}'>\
         <button id=two>Claim</button></form>"
    );
    let url = another_origin(forged).await;
    let attacker = browser.page().await;

    attacker.goto(&url).await;
    attacker.click("#one").await;
    attacker
        .wait_for("the page's form refused", &shows("Refused"))
        .await;
    attacker
        .screenshot(&screenshot("operator-cross-site"))
        .await;

    attacker.goto(&url).await;
    attacker.click("#two").await;
    attacker
        .wait_for("the JSON route's refusal", &shows("Bearer"))
        .await;

    assert_eq!(key_json(http, base).await["state"], "uncertain");
}
