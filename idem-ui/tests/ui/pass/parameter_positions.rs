//! The `Tx` anywhere among the parameters; the scope first, in the middle
//! or last; patterns and every kind of return type.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account")]
async fn tx_first(mut tx: Tx<Postgres>, account: Account) {
    let _ = (account, &mut tx);
}

#[idempotent(scope = "caller")]
async fn scope_last(_headers: HeaderMap, mut tx: Tx<Postgres>, caller: Account) -> Response {
    let _ = (caller, &mut tx);
    StatusCode::NO_CONTENT.into_response()
}

#[idempotent(scope = "account")]
async fn tx_after_body(account: Account, Json(body): Json<i64>, tx: Tx<Postgres>) -> Json<i64> {
    let _ = (account, tx);
    Json(body)
}

#[idempotent(scope = "account")]
async fn tx_in_the_middle(
    method: Method,
    mut account: Account,
    _: Tx<Postgres>,
    headers: HeaderMap,
) -> impl IntoResponse {
    account.0.push('!');
    (
        StatusCode::CREATED,
        format!("{method} {} {}", account.0, headers.len()),
    )
}

#[idempotent(scope = "account")]
async fn returns_result(
    account: Account,
    mut tx: Tx<Postgres>,
) -> Result<impl IntoResponse, StatusCode> {
    sqlx::query("SELECT $1")
        .bind(&account.0)
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(StatusCode::CREATED)
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/a", post(tx_first))
        .route("/b", post(scope_last))
        .route("/c", post(tx_after_body))
        .route("/d", post(tx_in_the_middle))
        .route("/e", post(returns_result));
}
