//! The charges API's OpenAPI 3.1 document, served at `GET /openapi.json`.
//!
//! The API's own operations are described here with utoipa (the
//! idempotent handlers are stamped out per engine by a macro, so they carry
//! no annotations); `idem` then adds to each idempotent route, from its
//! handler's policy, what the client must know of the protocol: the
//! `Idempotency-Key` parameter, the problems `idem` answers (400, 409
//! with `Retry-After`, 422, 503, ...), the replay header on replayable
//! responses, and the retention and fingerprint policy (`x-idempotency` and
//! the description).
//! Only the public API is documented: the operators' routes
//! (`ADMIN_TOKEN`) are not.
//!
//! `tests/tests/example_openapi.rs` validates this document and runs
//! schemathesis against the running example with it.

// Documentation-only functions and types: utoipa reads their attributes.
#![allow(dead_code)]

use std::sync::Arc;

use axum::Router;
use axum::http::header;
use axum::routing::get;
use idem::{Backend, Idem, IdempotentHandler};
use utoipa::openapi::HttpMethod;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

/// `GET /openapi.json`: the document, built once, with `create_charge` and
/// `create_payment` (the handlers routed at `POST /v1/charges` and `POST
/// /v1/payments`) documented as idempotent, after `idem`'s settings.
pub fn router<DB: Backend>(
    idem: &Idem<DB>,
    create_charge: impl IdempotentHandler,
    create_payment: impl IdempotentHandler,
) -> Router {
    let mut document = ApiDoc::openapi();
    idem.openapi()
        .route(HttpMethod::Post, "/v1/charges", create_charge)
        .route(HttpMethod::Post, "/v1/payments", create_payment)
        .apply(&mut document);
    let json: Arc<str> = document
        .to_pretty_json()
        .expect("the OpenAPI document serializes")
        .into();
    Router::new().route(
        "/openapi.json",
        get(move || async move {
            (
                [(header::CONTENT_TYPE, "application/json")],
                json.to_string(),
            )
        }),
    )
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Charges API",
        description = "A small payments API whose writes are safe to retry: send one \
                       `Idempotency-Key` per charge or payment, on every attempt.",
        version = "0.1.0"
    ),
    paths(create_charge, get_charge, create_payment, get_payment),
    modifiers(&BearerAccount),
    security(("account" = []))
)]
struct ApiDoc;

/// `Authorization: Bearer <account>`: the caller, whose keys are its own.
struct BearerAccount;

impl Modify for BearerAccount {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "account",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// A charge or payment to make.
#[derive(ToSchema)]
struct NewCharge {
    /// In the currency's minor unit: a whole number above 0.
    #[schema(minimum = 1)]
    amount: i64,
    /// An ISO 4217 code.
    #[schema(
        pattern = "^[A-Za-z]{3}$",
        min_length = 3,
        max_length = 3,
        examples("eur")
    )]
    currency: String,
}

/// A charge made.
#[derive(ToSchema)]
struct Charge {
    id: i64,
    amount: i64,
    currency: String,
}

/// A payment: `pending` until the provider has charged it.
#[derive(ToSchema)]
struct Payment {
    id: i64,
    amount: i64,
    currency: String,
    status: String,
    provider_id: Option<String>,
}

/// Charges the caller's account.
#[utoipa::path(
    post,
    path = "/v1/charges",
    tag = "charges",
    request_body = NewCharge,
    responses(
        (status = 201, description = "Charged", body = Charge,
         headers(("Location" = String, description = "The charge's URL"))),
        (status = 400, description = "The body is not JSON", body = String, content_type = "text/plain"),
        (status = 401, description = "No `Authorization: Bearer <account>`", body = String, content_type = "text/plain"),
        (status = 415, description = "The body is not `application/json`", body = String, content_type = "text/plain"),
        (status = 422, description = "The JSON is not a charge", body = String, content_type = "text/plain"),
    )
)]
fn create_charge() {}

/// One of the caller's charges.
#[utoipa::path(
    get,
    path = "/v1/charges/{id}",
    tag = "charges",
    params(("id" = i64, Path, description = "The charge's id")),
    responses(
        (status = 200, description = "The charge", body = Charge),
        (status = 400, description = "The id is not an integer", body = String, content_type = "text/plain"),
        (status = 401, description = "No `Authorization: Bearer <account>`", body = String, content_type = "text/plain"),
        (status = 404, description = "No such charge", body = String, content_type = "text/plain"),
    )
)]
fn get_charge() {}

/// Pays through the payment provider, with a key derived from the
/// request's, so a retry never charges twice.
#[utoipa::path(
    post,
    path = "/v1/payments",
    tag = "payments",
    request_body = NewCharge,
    responses(
        (status = 201, description = "Paid", body = Payment,
         headers(("Location" = String, description = "The payment's URL"))),
        (status = 400, description = "The body is not JSON", body = String, content_type = "text/plain"),
        (status = 401, description = "No `Authorization: Bearer <account>`", body = String, content_type = "text/plain"),
        (status = 415, description = "The body is not `application/json`", body = String, content_type = "text/plain"),
        (status = 422, description = "The JSON is not a payment", body = String, content_type = "text/plain"),
        (status = 502, description = "The payment provider failed: retry with the same key", body = String, content_type = "text/plain"),
    )
)]
fn create_payment() {}

/// One of the caller's payments.
#[utoipa::path(
    get,
    path = "/v1/payments/{id}",
    tag = "payments",
    params(("id" = i64, Path, description = "The payment's id")),
    responses(
        (status = 200, description = "The payment", body = Payment),
        (status = 400, description = "The id is not an integer", body = String, content_type = "text/plain"),
        (status = 401, description = "No `Authorization: Bearer <account>`", body = String, content_type = "text/plain"),
        (status = 404, description = "No such payment", body = String, content_type = "text/plain"),
    )
)]
fn get_payment() {}
