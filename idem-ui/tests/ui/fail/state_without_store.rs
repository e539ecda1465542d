use std::borrow::Cow;

use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use axum::routing::post;
use idem::{Scope, Tx, idempotent};
use sqlx::Postgres;

/// A state that holds no `Idem<Postgres>`.
#[derive(Clone)]
struct AppState;

struct Account(String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Err(StatusCode::UNAUTHORIZED)
    }
}

#[idempotent(scope = "account")]
async fn create(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
