// The shared caller and application state.
use idem_ui as support;

use axum::routing::post;
use axum::{Extension, Router};
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::AppState;

#[idempotent(scope = "account")]
async fn create(Extension(account): Extension<String>, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
