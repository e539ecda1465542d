// The shared caller and application state.
use idem_ui as support;

use axum::routing::post;
use axum::{Json, Router};
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

/// No `Deserialize`: cannot be a JSON payload.
struct NewCharge {
    amount: i64,
}

#[idempotent(scope = "account")]
async fn create(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(new): Json<NewCharge>,
) -> &'static str {
    let _ = (account, &mut tx, new.amount);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
