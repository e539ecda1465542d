//! `fingerprint(exclude = [...])`: JSON Pointers to members (and array
//! elements) of the body, beside the other arguments.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::Json;
use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account", fingerprint(exclude = ["/client_ts", "/trace/id"]))]
async fn create(account: Account, mut tx: Tx<Postgres>, Json(body): Json<serde_json::Value>) -> StatusCode {
    let _ = (account, &mut tx, body);
    StatusCode::CREATED
}

/// Escapes, array elements, a trailing comma, among other arguments.
#[idempotent(
    ttl = "1h",
    fingerprint(exclude = ["/a~1b", "/m~0n", "/items/0/ts", "/-",],),
    scope = "account",
    key = "optional",
)]
async fn everything(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/create", post(create))
        .route("/everything", post(everything));
}
