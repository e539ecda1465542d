//! `idem::admin`'s routes without a browser: a real axum server on
//! loopback over PostgreSQL, asked with reqwest as a browser or a script
//! would. The bearer token and only it; the sign-in's cookie and what it
//! holds; forms refused without their session's token or from another
//! site; a scope that is markup shown as text.

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Idem, Tx, idempotent};
use idem_tests::account::Account;
use idem_tests::engines::postgres;
use idem_tests::service::{percent_encode, unique};
use reqwest::header::{self, HeaderMap};
use serde_json::{Value, json};
use sqlx::Postgres;

const TOKEN: &str = "router-test-token-0123456789";

/// Stores a small response for any key, in the caller's scope.
#[idempotent(scope = "account")]
async fn create(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(_): Json<Value>,
) -> (StatusCode, Json<Value>) {
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    (StatusCode::CREATED, Json(json!({"account": account.0})))
}

/// The service with the admin routes, on a free port; its base URL.
async fn serve() -> String {
    let idem = Idem::new(postgres::pool(4).await);
    idem.migrate().await.unwrap();
    let app = Router::new()
        .route("/v1/things", post(create))
        .with_state(idem.clone())
        .merge(idem::admin::router(idem, TOKEN));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    base
}

/// A client that shows redirects rather than following them.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// Stores a key of `scope`.
async fn stored(http: &reqwest::Client, base: &str, scope: &str, key: &str) {
    let response = http
        .post(format!("{base}/v1/things"))
        .header("x-account", scope)
        .header("Idempotency-Key", key)
        .json(&json!({"n": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
}

/// `pairs` as an HTML form sends them.
fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={}", percent_encode(value.as_bytes())))
        .collect::<Vec<_>>()
        .join("&")
}

/// POSTs `pairs` as a form from `origin` (the admin's own, unless a test
/// says otherwise), with `headers`.
async fn post_form(
    http: &reqwest::Client,
    url: &str,
    headers: HeaderMap,
    pairs: &[(&str, &str)],
) -> reqwest::Response {
    http.post(url)
        .headers(headers)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(form(pairs))
        .send()
        .await
        .unwrap()
}

/// Signs in as a browser would; the cookie's value and its whole
/// `Set-Cookie`.
async fn sign_in(http: &reqwest::Client, base: &str, extra: &[(&str, &str)]) -> (String, String) {
    let mut headers = HeaderMap::new();
    headers.insert(header::ORIGIN, base.parse().unwrap());
    for (name, value) in extra {
        headers.insert(
            header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    let response = post_form(
        http,
        &format!("{base}/admin/login"),
        headers,
        &[("token", TOKEN), ("next", "/admin")],
    )
    .await;
    assert_eq!(response.status(), 303);
    assert_eq!(response.headers()[header::LOCATION], "/admin");
    let set = response.headers()[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .to_owned();
    let value = set
        .strip_prefix("idem_admin=")
        .and_then(|rest| rest.split(';').next())
        .expect("the session cookie")
        .to_owned();
    (value, set)
}

/// The page's form token, read from a page's hidden input.
fn csrf_of(html: &str) -> String {
    let (_, rest) = html
        .split_once(r#"name="csrf" value=""#)
        .expect("a form with its token");
    rest.split('"').next().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_signs_in_and_only_it() {
    let base = serve().await;
    let http = client();
    let scope = unique("acct");
    stored(&http, &base, &scope, "k1").await;
    let list = format!("{base}/admin/idempotency/{scope}");

    // JSON: 401 with a challenge without the token or with a wrong one;
    // 200 with it.
    for token in [None, Some("wrong"), Some(&TOKEN[..TOKEN.len() - 1])] {
        let request = http.get(&list);
        let request = match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{token:?}");
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
    }
    let listed = http.get(&list).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(listed.status(), 200);
    let listed: Value = listed.json().await.unwrap();
    assert_eq!(listed[0]["key"], "k1", "{listed}");
    assert_eq!(listed[0]["state"], "completed", "{listed}");

    // The page, not signed in: to the login page, and back after.
    let page = http
        .get(format!("{base}/admin?scope=x"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 303);
    assert_eq!(
        page.headers()[header::LOCATION],
        "/admin/login?next=%2Fadmin%3Fscope%3Dx"
    );
    // The bearer reads the page as well.
    let page = http
        .get(format!("{base}/admin"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);

    // A wrong token: 401, the form again, no cookie.
    let mut same_site = HeaderMap::new();
    same_site.insert(header::ORIGIN, base.parse().unwrap());
    let wrong = post_form(
        &http,
        &format!("{base}/admin/login"),
        same_site.clone(),
        &[("token", "guess")],
    )
    .await;
    assert_eq!(wrong.status(), 401);
    assert!(!wrong.headers().contains_key(header::SET_COOKIE));
    assert!(wrong.text().await.unwrap().contains("not the admin token"));
    // A sign-in posted from another site: refused, no cookie.
    let mut elsewhere = HeaderMap::new();
    elsewhere.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
    let forged = post_form(
        &http,
        &format!("{base}/admin/login"),
        elsewhere,
        &[("token", TOKEN)],
    )
    .await;
    assert_eq!(forged.status(), 403);
    assert!(!forged.headers().contains_key(header::SET_COOKIE));

    // The token: a cookie that is not the token, HttpOnly, SameSite=Strict,
    // on /admin; Secure only when the request came over HTTPS.
    let (session, set) = sign_in(&http, &base, &[]).await;
    assert!(!session.contains(TOKEN) && session.len() > 64, "{set}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/admin"] {
        assert!(
            set.split("; ").any(|a| a == attribute),
            "{attribute}: {set}"
        );
    }
    assert!(!set.contains("Secure"), "{set}");
    let (_, secure) = sign_in(&http, &base, &[("x-forwarded-proto", "https")]).await;
    assert!(secure.split("; ").any(|a| a == "Secure"), "{secure}");

    // Signed in: the page and the JSON reads answer; the JSON writes want
    // the bearer.
    let cookie = format!("idem_admin={session}");
    let page = http
        .get(format!("{base}/admin"))
        .header(header::COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(page.headers()[header::CACHE_CONTROL], "no-store");
    let html = page.text().await.unwrap();
    assert!(html.contains(r#"<meta name="viewport""#));
    for landmark in ["<header", "<nav", "<main"] {
        assert!(html.contains(landmark), "{landmark}");
    }
    let read = http
        .get(&list)
        .header(header::COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    let key_url = format!("{list}/k1");
    let write = http
        .delete(&key_url)
        .header(header::COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(write.status(), 401);

    // A forged cookie, or one for another token: not signed in.
    // The signature's last hex digit changed (to another digit, whatever
    // it was: one time in sixteen it is already `0`).
    let (signed, last) = session.split_at(session.len() - 1);
    let other = if last == "0" { "1" } else { "0" };
    for forged in [
        format!("idem_admin={signed}{other}"),
        "idem_admin=1.2.3".to_owned(),
        format!("idem_admin={TOKEN}"),
    ] {
        let page = http
            .get(format!("{base}/admin"))
            .header(header::COOKIE, forged.as_str())
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), 303, "{forged}");
    }

    // Signed out: the cookie is cleared, and a copy of it no longer works.
    let page = http
        .get(format!("{base}/admin"))
        .header(header::COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    let csrf = csrf_of(&page.text().await.unwrap());
    let mut signed_in = same_site.clone();
    signed_in.insert(header::COOKIE, cookie.parse().unwrap());
    let out = post_form(
        &http,
        &format!("{base}/admin/logout"),
        signed_in,
        &[("csrf", &csrf)],
    )
    .await;
    assert_eq!(out.status(), 303);
    assert!(
        out.headers()[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    let after = http
        .get(format!("{base}/admin"))
        .header(header::COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), 303);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forms_need_their_session_token_and_this_site() {
    let base = serve().await;
    let http = client();
    let scope = unique("acct");
    stored(&http, &base, &scope, "k1").await;
    let key_url = format!("{base}/admin/idempotency/{scope}/k1");
    let (session, _) = sign_in(&http, &base, &[]).await;
    let cookie = format!("idem_admin={session}");
    let page = http
        .get(format!(
            "{base}/admin/key?scope={}&key=k1",
            percent_encode(scope.as_bytes())
        ))
        .header(header::COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csrf = csrf_of(&page.text().await.unwrap());
    let forget = format!("{base}/admin/key/forget");
    let headers = |pairs: &[(&str, &str)]| {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, cookie.parse().unwrap());
        for (name, value) in pairs {
            headers.insert(
                header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        headers
    };
    let own = [("origin", base.as_str())];

    // Without the token, with another session's, from another origin or
    // site: 403, and the key is still there.
    let another = "0".repeat(64);
    for (what, headers, token) in [
        ("no token", headers(&own), ""),
        ("a wrong token", headers(&own), another.as_str()),
        (
            "another origin",
            headers(&[("origin", "http://127.0.0.1:1")]),
            csrf.as_str(),
        ),
        (
            "another site",
            headers(&[("sec-fetch-site", "cross-site")]),
            csrf.as_str(),
        ),
        (
            "a sibling site",
            headers(&[("sec-fetch-site", "same-site")]),
            csrf.as_str(),
        ),
        (
            "an opaque origin",
            headers(&[("origin", "null")]),
            csrf.as_str(),
        ),
    ] {
        let pairs = [("scope", scope.as_str()), ("key", "k1"), ("csrf", token)];
        let refused = post_form(&http, &forget, headers, &pairs).await;
        assert_eq!(refused.status(), 403, "{what}");
        let still = http.get(&key_url).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(still.status(), 200, "{what}");
    }

    // Not signed in at all: to the login page, nothing done.
    let pairs = [("scope", scope.as_str()), ("key", "k1"), ("csrf", "")];
    let anonymous = post_form(&http, &forget, HeaderMap::new(), &pairs).await;
    assert_eq!(anonymous.status(), 303);
    assert!(
        anonymous.headers()[header::LOCATION]
            .to_str()
            .unwrap()
            .starts_with("/admin/login")
    );

    // With its token, from this origin: forgotten, then back to the scope.
    let pairs = [("scope", scope.as_str()), ("key", "k1"), ("csrf", &csrf)];
    let done = post_form(
        &http,
        &forget,
        headers(&[("origin", &base), ("sec-fetch-site", "same-origin")]),
        &pairs,
    )
    .await;
    assert_eq!(done.status(), 303);
    let gone = http.get(&key_url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(gone.status(), 404);

    // A bearer's forms need no session token (no browser sends a bearer
    // by itself).
    stored(&http, &base, &scope, "k2").await;
    let mut bearer = HeaderMap::new();
    bearer.insert(
        header::AUTHORIZATION,
        format!("Bearer {TOKEN}").parse().unwrap(),
    );
    let pairs = [("scope", scope.as_str()), ("key", "k2")];
    let done = post_form(&http, &forget, bearer, &pairs).await;
    assert_eq!(done.status(), 303);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markup_in_a_scope_or_key_is_shown_as_text() {
    let base = serve().await;
    let http = client();
    let scope = format!("<script>alert({})</script>", unique("x"));
    let key = "<img/src=x/onerror=alert(1)>";
    stored(&http, &base, &scope, key).await;
    let escaped_scope = scope.replace('<', "&lt;").replace('>', "&gt;");

    for url in [
        format!("{base}/admin?scope={}", percent_encode(scope.as_bytes())),
        format!(
            "{base}/admin/key?scope={}&key={}",
            percent_encode(scope.as_bytes()),
            percent_encode(key.as_bytes())
        ),
    ] {
        let page = http.get(&url).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(page.status(), 200, "{url}");
        let html = page.text().await.unwrap();
        assert!(!html.contains("<script"), "{url}: {html}");
        assert!(!html.contains("<img"), "{url}: {html}");
        assert!(html.contains(&escaped_scope), "{url}: {html}");
        assert!(
            html.contains("&lt;img/src=x/onerror=alert(1)&gt;"),
            "{url}: {html}"
        );
    }
    // And the JSON has it as data.
    let found: Value = http
        .get(format!(
            "{base}/admin/idempotency/{}/{}",
            percent_encode(scope.as_bytes()),
            percent_encode(key.as_bytes())
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(found["scope"], scope.as_str());
    assert_eq!(found["key"], key);
}
