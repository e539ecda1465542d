//! A handler's body still warns of the deprecated items it uses: only a
//! `#[deprecated]` handler's own impls allow `deprecated`.
#![deny(deprecated)]

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[deprecated(note = "use the new pricing")]
fn old_price() -> i64 {
    100
}

#[idempotent(scope = "account")]
async fn create(account: Account, mut tx: Tx<Postgres>) -> String {
    let _ = (account, &mut tx);
    old_price().to_string()
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
