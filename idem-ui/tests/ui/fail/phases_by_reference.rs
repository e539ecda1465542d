// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Phases, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account")]
async fn create(account: Account, phases: &mut Phases<Postgres>) -> &'static str {
    let _ = (account, phases);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
