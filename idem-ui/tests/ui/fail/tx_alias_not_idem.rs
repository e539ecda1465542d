// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::idempotent;
use support::{Account, AppState};

/// An alias named `Tx` that is not `idem::Tx`: sqlx's own transaction.
type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

#[idempotent(scope = "account")]
async fn create(account: Account, tx: Tx) -> &'static str {
    let _ = (account, tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
