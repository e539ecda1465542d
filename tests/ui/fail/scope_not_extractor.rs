use std::borrow::Cow;

use axum::Router;
use axum::routing::post;
use idem::{Idem, Scope, Tx, idempotent};
use sqlx::Postgres;

/// Implements `Scope`, but axum cannot extract it from a request.
struct AccountId(String);

impl Scope for AccountId {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[idempotent(scope = "account")]
async fn create(account: AccountId, _tx: Tx<Postgres>) -> &'static str {
    let _ = account;
    "created"
}

fn main() {
    let _: Router<Idem<Postgres>> = Router::new().route("/", post(create));
}
