// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account", ttl = "7d", tombstone = "7d")]
async fn create(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
