//! `idem::openapi` on handlers of both kinds: one with `#[utoipa::path]`
//! above `#[idempotent]` (its own documentation kept, `idem`'s added
//! beside it), and one the document does not name (its operation created).
//! No server runs: the handlers are routed to show they still are handlers.

use std::borrow::Cow;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::{StatusCode, request::Parts};
use axum::routing::post;
use axum::{Json, Router};
use idem::{Idem, Policy, Scope, Tx, idempotent};
use serde_json::Value;
use sqlx::Postgres;
use utoipa::OpenApi;
use utoipa::openapi::HttpMethod;

struct Account(String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        Ok(Account("acct_1".into()))
    }
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
struct NewRefund {
    charge: i64,
}

/// Refunds a charge.
///
/// The whole charge, once.
#[utoipa::path(
    post,
    path = "/v1/refunds",
    request_body = NewRefund,
    responses(
        (status = 201, description = "Refunded", body = i64),
        (status = 400, description = "Not JSON", body = String, content_type = "text/plain"),
    )
)]
#[idempotent(scope = "account", ttl = "7d", fingerprint(exclude = ["/client_ts"]))]
async fn create_refund(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(new): Json<NewRefund>,
) -> (StatusCode, Json<i64>) {
    let _ = (account, &mut tx);
    (StatusCode::CREATED, Json(new.charge))
}

#[idempotent(scope = "account", key = "optional", wait = "2s")]
async fn create_note(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[derive(OpenApi)]
#[openapi(paths(create_refund))]
struct ApiDoc;

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<Postgres>,
}

fn document() -> Value {
    let mut api = ApiDoc::openapi();
    idem::openapi::IdempotentRoutes::new()
        .route(HttpMethod::Post, "/v1/refunds", create_refund)
        .route(HttpMethod::Post, "/v1/notes", create_note)
        .apply(&mut api);
    serde_json::to_value(&api).unwrap()
}

#[test]
fn a_utoipa_path_keeps_its_documentation_and_gains_idems() {
    let _: Router<AppState> = Router::new()
        .route("/v1/refunds", post(create_refund))
        .route("/v1/notes", post(create_note));
    let api = document();
    assert_eq!(api["openapi"], "3.1.0");
    let operation = &api["paths"]["/v1/refunds"]["post"];
    assert_eq!(operation["operationId"], "create_refund");
    assert_eq!(operation["summary"], "Refunds a charge.");
    let description = operation["description"].as_str().unwrap();
    assert!(
        description.starts_with("The whole charge, once.\n\n**Idempotent.**"),
        "{description}"
    );
    assert!(description.contains("For 7 days"), "{description}");
    assert!(description.contains("`/client_ts`"), "{description}");
    assert!(operation["requestBody"].is_object());
    assert_eq!(operation["parameters"][0]["name"], "Idempotency-Key");
    assert_eq!(operation["parameters"][0]["required"], true);

    let responses = &operation["responses"];
    assert_eq!(responses["201"]["description"], "Refunded");
    assert!(responses["201"]["headers"]["Idempotent-Replayed"].is_object());
    // The handler's own 400 keeps its content; idem's problem is beside it.
    assert_eq!(responses["400"]["description"], "Not JSON");
    assert!(responses["400"]["content"]["text/plain"].is_object());
    assert!(responses["400"]["content"]["application/problem+json"].is_object());
    for status in ["409", "422", "503"] {
        assert!(
            responses[status]["content"]["application/problem+json"].is_object(),
            "{status}"
        );
    }
    let policy = &operation["x-idempotency"];
    assert_eq!(policy["retention"], "PT168H");
    assert_eq!(policy["fingerprint"]["exclude"][0], "/client_ts");
    assert_eq!(policy["wait"], "PT0S");
}

#[test]
fn a_route_the_document_lacks_gets_an_operation() {
    let api = document();
    let operation = &api["paths"]["/v1/notes"]["post"];
    assert_eq!(operation["parameters"][0]["required"], false);
    let codes = &operation["responses"]["400"]["content"]["application/problem+json"]["schema"]["allOf"]
        [1]["properties"]["code"]["enum"];
    // Without a required key, a missing one is no error.
    assert!(
        !codes
            .as_array()
            .unwrap()
            .contains(&"idempotency_key_missing".into())
    );
    assert_eq!(operation["x-idempotency"]["wait"], "PT2S");
    assert!(
        operation["description"]
            .as_str()
            .unwrap()
            .contains("waits up to 2 seconds")
    );
    assert_eq!(Policy::of(create_note).wait().as_secs(), 2);
}
