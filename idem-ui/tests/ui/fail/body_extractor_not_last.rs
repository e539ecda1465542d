// The shared caller and application state.
use idem_ui as support;

use axum::routing::post;
use axum::{Json, Router};
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account")]
async fn create(Json(amount): Json<i64>, account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (amount, account, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
