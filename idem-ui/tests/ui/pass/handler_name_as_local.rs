//! A handler's body and parameter patterns may bind locals named like the
//! handler itself, as in a plain `async fn`.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Tx, idempotent};
use serde::Deserialize;
use sqlx::Postgres;
use support::{Account, AppState};

#[derive(Deserialize)]
struct Transfer {
    amount: i64,
}

#[derive(Deserialize)]
struct Payout {
    payout: i64,
}

/// A `let` named like the handler.
#[idempotent(scope = "account")]
async fn refund(account: Account, mut tx: Tx<Postgres>) -> Json<usize> {
    let _ = &mut tx;
    let refund = account.0.len();
    let doubled = match refund {
        refund => refund * 2,
    };
    let inner = || {
        let refund = doubled + 1;
        refund
    };
    Json(inner())
}

/// A parameter pattern binding the handler's name.
#[idempotent(scope = "account")]
async fn transfer(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(transfer): Json<Transfer>,
) -> (StatusCode, Json<i64>) {
    let _ = (account, &mut tx);
    (StatusCode::CREATED, Json(transfer.amount))
}

/// The name in a struct pattern's shorthand, and a plain binding.
#[idempotent(scope = "payout_account")]
async fn payout(
    payout_account: Account,
    tx: Tx<Postgres>,
    Json(Payout { payout }): Json<Payout>,
) -> Json<i64> {
    drop((payout_account, tx));
    Json(payout)
}

#[idempotent(scope = "settle")]
async fn settle(settle: Account, tx: Tx<Postgres>) -> String {
    drop(tx);
    settle.0
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/refunds", post(refund))
        .route("/transfers", post(transfer))
        .route("/payouts", post(payout))
        .route("/settlements", post(settle));
}
