//! idem in a build where serde_json's `arbitrary_precision` is on: a
//! handler reads `1.000000000000000001` as those digits, not as the double
//! `1`, so a retry carrying that amount under the key of `{"amount":1}` is
//! another request (422), never a replay of the first one's response. Two
//! spellings of one decimal value (`1.50`, `15e-1`) are still one request,
//! and a key stored by a default build keeps its fingerprint: turning the
//! feature on must not make every retry of an older key a 422.
//!
//! A real server on loopback, a real HTTP client and a real SQLite file.

use std::borrow::Cow;

use axum::extract::FromRequestParts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header, request::Parts};
use axum::routing::post;
use axum::{Json, Router};
use idem::canonical::canonicalize;
use idem::{Fingerprint, Idem, Scope, Tx, idempotent};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

struct Account(String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("x-account")
            .and_then(|value| value.to_str().ok())
            .map(|account| Account(account.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

/// Records the amount as the handler reads it, and answers with it.
#[idempotent(scope = "account")]
async fn pay(
    account: Account,
    mut tx: Tx<Sqlite>,
    Json(body): Json<serde_json::Value>,
) -> Result<(StatusCode, String), StatusCode> {
    let amount = body["amount"].to_string();
    sqlx::query("INSERT INTO payments (account, amount) VALUES (?, ?)")
        .bind(&account.0)
        .bind(&amount)
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, amount))
}

#[tokio::test]
async fn exact_amounts_are_told_apart_and_spellings_are_not() {
    // The build is what this crate is for: if the feature were off, the
    // test below would prove nothing.
    assert_eq!(
        serde_json::from_str::<serde_json::Number>("1.000000000000000001")
            .unwrap()
            .to_string(),
        "1.000000000000000001",
        "serde_json's arbitrary_precision is on in this build"
    );

    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("idem-exact-{}.sqlite3", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let pool = SqlitePoolOptions::new()
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .expect("open the SQLite file");
    sqlx::query("CREATE TABLE payments (account TEXT NOT NULL, amount TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let idem = Idem::new(pool.clone());
    idem.migrate().await.unwrap();
    let app = Router::new().route("/pay", post(pay)).with_state(idem);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/pay", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let client = reqwest::Client::new();
    let send = |key: &'static str, body: &'static str| {
        let request = client
            .post(&url)
            .header("x-account", "acct")
            .header("idempotency-key", key)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        async move {
            let response = request.send().await.expect("the server answers");
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            (status, replayed, response.text().await.unwrap())
        }
    };

    assert_eq!(
        send("one", r#"{"amount":1}"#).await,
        (StatusCode::CREATED, false, "1".to_owned())
    );
    // One more digit than a double holds: to the handler another amount.
    let (status, replayed, _) = send("one", r#"{"amount":1.000000000000000001}"#).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::UNPROCESSABLE_ENTITY, false),
        "an amount the handler reads differently is not a replay"
    );
    // Another spelling of the same value is a retry.
    assert_eq!(
        send("one", r#"{ "amount" : 1 }"#).await,
        (StatusCode::CREATED, true, "1".to_owned())
    );

    assert_eq!(
        send("half", r#"{"amount":1.50}"#).await,
        (StatusCode::CREATED, false, "1.50".to_owned())
    );
    for spelling in [r#"{"amount":1.5}"#, r#"{"amount":15e-1}"#] {
        assert_eq!(
            send("half", spelling).await,
            (StatusCode::CREATED, true, "1.50".to_owned()),
            "{spelling} is the same decimal value"
        );
    }

    let amounts: Vec<String> = sqlx::query_scalar("SELECT amount FROM payments ORDER BY rowid")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(amounts, ["1", "1.50"], "each handler ran once");

    server.abort();
    pool.close().await;
    let _ = std::fs::remove_file(&path);
}

/// The golden value of the main workspace's `tests/golden.rs`, computed by
/// a default build: ordinary bodies (integers, short decimals, a large
/// integer) keep their fingerprint when the feature comes on, so keys
/// stored before it are still recognised by their retries.
#[test]
fn ordinary_bodies_keep_their_default_fingerprint() {
    const NESTED: &str = r#"{ "z": {"b": [1, 2.50, {"y": null, "x": true}], "a": "é"},
    "amount": 1250, "account": 9007199254740993 }"#;
    const NESTED_FINGERPRINT: &str =
        "3c3e555f80a680b3d8ea52ebfe11ed0a537d2142e50a7e5c674b3ac0b7a35cc6";
    let json = HeaderMap::from_iter([(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )]);
    let fingerprint = Fingerprint::of(&Method::POST, "/v1/charges", None, &json, NESTED.as_bytes());
    assert_eq!(hex::encode(fingerprint.as_bytes()), NESTED_FINGERPRINT);
    // Doubles RFC 8785 writes in full keep their form too.
    assert_eq!(
        canonicalize(br#"[0.1, 1e21, 1.5e300, 123456.789, -0.000001]"#).unwrap(),
        b"[0.1,1e+21,1.5e+300,123456.789,-0.000001]"
    );
}
