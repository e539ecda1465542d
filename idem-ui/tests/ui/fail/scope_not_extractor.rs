// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Scope, Tx, idempotent};
use sqlx::Postgres;
use std::borrow::Cow;
use support::AppState;

/// Implements `Scope`, but axum cannot extract it from a request.
struct AccountId(String);

impl Scope for AccountId {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[idempotent(scope = "account")]
async fn create(account: AccountId, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
