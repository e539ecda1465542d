//! Every argument combination that should compile, routed with `post`.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account")]
async fn defaults(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", ttl = "500ms")]
async fn ttl_ms(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", ttl = "90s")]
async fn ttl_s(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", ttl = "15m")]
async fn ttl_m(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", ttl = "48h")]
async fn ttl_h(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// A tombstone, here the longest.
#[idempotent(scope = "account", ttl = "24h", tombstone = "3650d")]
async fn tombstone(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// The longest `ttl`.
#[idempotent(scope = "account", ttl = "365d")]
async fn ttl_max(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", key = "required")]
async fn key_required(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// Without a key the handler still runs, in a plain transaction.
#[idempotent(scope = "account", key = "optional")]
async fn key_optional(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    if tx.key().is_some() {
        StatusCode::CREATED
    } else {
        StatusCode::ACCEPTED
    }
}

/// `wait = "0ms"` is the default: a concurrent duplicate gets 409 at once.
#[idempotent(scope = "account", wait = "0ms")]
async fn wait_zero(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// The longest `wait`.
#[idempotent(scope = "account", wait = "60s")]
async fn wait_max(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// `wait` may equal `ttl`.
#[idempotent(scope = "account", ttl = "1s", wait = "1000ms")]
async fn wait_equals_ttl(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// `timeout` from a millisecond to an hour.
#[idempotent(scope = "account", timeout = "1ms")]
async fn timeout_min(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", timeout = "1h")]
async fn timeout_max(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

#[idempotent(scope = "account", crate = "::idem")]
async fn krate(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

/// Every argument, in any order, with a trailing comma.
#[idempotent(
    crate = "idem",
    wait = "2s",
    key = "optional",
    ttl = "7d",
    scope = "account"
)]
async fn everything(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
    let _ = (account, &mut tx);
    StatusCode::CREATED
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/defaults", post(defaults))
        .route("/ttl-ms", post(ttl_ms))
        .route("/tombstone", post(tombstone))
        .route("/ttl-s", post(ttl_s))
        .route("/ttl-m", post(ttl_m))
        .route("/ttl-h", post(ttl_h))
        .route("/ttl-max", post(ttl_max))
        .route("/key-required", post(key_required))
        .route("/key-optional", post(key_optional))
        .route("/wait-zero", post(wait_zero))
        .route("/wait-max", post(wait_max))
        .route("/wait-equals-ttl", post(wait_equals_ttl))
        .route("/timeout-min", post(timeout_min))
        .route("/timeout-max", post(timeout_max))
        .route("/crate", post(krate))
        .route("/everything", post(everything));
}
