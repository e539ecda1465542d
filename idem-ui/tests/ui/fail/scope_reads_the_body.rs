// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::AppState;

/// `String` implements `Scope`, but as an extractor it reads the body: a
/// caller could pick any scope it likes.
#[idempotent(scope = "account")]
async fn create(mut tx: Tx<Postgres>, account: String) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
