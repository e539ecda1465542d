// The shared caller and application state.
use idem_ui as support;

use axum::routing::post;
use axum::{Json, Router};
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = acount, ttl = "0s", colour = "red", wait = "2m")]
fn create(Json(amount): Json<i64>, account: Account, audit: Tx<Postgres>) {
    let _ = (amount, account, audit);
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
