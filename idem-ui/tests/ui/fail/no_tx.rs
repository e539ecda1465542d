// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::idempotent;
use support::{Account, AppState};

#[idempotent(scope = "account")]
async fn create(account: Account) -> &'static str {
    let _ = account;
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
