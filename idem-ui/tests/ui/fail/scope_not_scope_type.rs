// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::AppState;

#[idempotent(scope = "headers")]
async fn create(headers: HeaderMap, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (headers, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
