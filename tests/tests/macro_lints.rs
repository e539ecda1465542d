//! No lint fires in user code from what `#[idempotent]` generates.
//!
//! These handlers compile under the strictest lint levels a team might
//! set; `cargo clippy --all-targets -- -D warnings` checks the expansion
//! with clippy's lints too. The test itself only builds the router: no
//! database is needed.
#![deny(warnings, clippy::all, clippy::pedantic)]
#![deny(
    missing_debug_implementations,
    rust_2018_idioms,
    unused_qualifications,
    unreachable_pub,
    unused_results,
    trivial_casts,
    unused_lifetimes,
    single_use_lifetimes
)]

use std::borrow::Cow;
use std::collections::HashMap;

use axum::extract::{FromRef, FromRequestParts, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{Idem, Scope, Tx, idempotent};
use serde::Deserialize;
use sqlx::{PgPool, Postgres};

#[derive(Clone, Debug, FromRef)]
struct AppState {
    idem: Idem<Postgres>,
    pool: PgPool,
}

#[derive(Clone, Debug)]
struct Account(String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get("x-account")
            .and_then(|value| value.to_str().ok())
            .map(|value| Account(value.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

#[derive(Debug, Deserialize)]
struct Paging {
    dry_run: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct NewNote {
    text: String,
}

/// Every kind of extractor, the `Tx` among them, a `Result` return.
#[idempotent(scope = "account", ttl = "1h", wait = "2s")]
async fn create_note(
    account: Account,
    State(pool): State<PgPool>,
    Path(book): Path<i64>,
    Query(paging): Query<Paging>,
    headers: HeaderMap,
    mut tx: Tx<Postgres>,
    Json(note): Json<NewNote>,
) -> Result<(StatusCode, Json<HashMap<String, String>>), StatusCode> {
    let _ = (pool.size(), paging.dry_run, headers.len());
    let _ = sqlx::query("INSERT INTO notes (account, book, text) VALUES ($1, $2, $3)")
        .bind(&account.0)
        .bind(book)
        .bind(&note.text)
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(HashMap::new())))
}

/// The scope last, no body, `impl IntoResponse`, an optional key.
#[idempotent(scope = "account", key = "optional")]
async fn touch(mut tx: Tx<Postgres>, account: Account) -> impl IntoResponse {
    let _ = sqlx::query("SELECT $1")
        .bind(&account.0)
        .execute(&mut *tx)
        .await;
    if tx.key().is_some() {
        StatusCode::CREATED
    } else {
        StatusCode::ACCEPTED
    }
}

/// A custom last extractor, the marker inferred at the route.
#[idempotent(scope = "account", crate = "::idem")]
async fn raw(account: Account, tx: Tx<Postgres>, body: axum::body::Bytes) -> Response {
    drop(tx);
    (StatusCode::OK, format!("{} {}", account.0, body.len())).into_response()
}

/// Parameters and locals named like the handler.
#[idempotent(scope = "account")]
async fn refund(account: Account, tx: Tx<Postgres>, Json(refund): Json<i64>) -> Json<i64> {
    drop((account, tx));
    let doubled = refund * 2;
    let refund = doubled + 1;
    Json(refund)
}

/// The user's lint attributes come after the macro's own: an expectation
/// of a lint the macro also allows holds (clippy checks it).
#[idempotent(scope = "account")]
#[expect(clippy::unused_async, reason = "a handler that does not await yet")]
async fn expected(account: Account, tx: Tx<Postgres>) -> StatusCode {
    drop((account, tx));
    StatusCode::NO_CONTENT
}

/// The caller as authentication middleware leaves it, in the extensions.
#[idempotent(scope = "account")]
async fn from_middleware(account: axum::Extension<Account>, tx: Tx<Postgres>) -> StatusCode {
    drop((account, tx));
    StatusCode::CREATED
}

/// A public handler in a module, with docs.
mod api {
    use idem::{Tx, idempotent};
    use sqlx::Postgres;

    use super::Account;

    /// Public in a private module.
    #[idempotent(scope = "account")]
    pub(crate) async fn create(account: Account, tx: Tx<Postgres>) {
        drop((account, tx));
    }
}

fn router() -> Router<AppState> {
    Router::new()
        .route("/books/{book}/notes", post(create_note))
        .route("/touch", post(touch))
        .route("/raw", post(raw))
        .route("/refunds", post(refund))
        .route("/api", post(api::create))
        .route("/expected", post(expected))
        .route("/middleware", post(from_middleware))
}

#[test]
fn handlers_route() {
    let _router = router();
}
