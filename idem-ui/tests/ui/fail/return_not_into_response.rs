// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

/// Serializable, but not a response.
struct Receipt;

#[idempotent(scope = "account")]
async fn create(account: Account, mut tx: Tx<Postgres>) -> Result<Receipt, String> {
    let _ = (account, &mut tx);
    Ok(Receipt)
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
