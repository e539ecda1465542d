use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use idem::{Idem, Tx, idempotent};
use sqlx::Postgres;

#[idempotent(scope = "headers")]
async fn create(headers: HeaderMap, _tx: Tx<Postgres>) -> &'static str {
    let _ = headers;
    "created"
}

fn main() {
    let _: Router<Idem<Postgres>> = Router::new().route("/", post(create));
}
