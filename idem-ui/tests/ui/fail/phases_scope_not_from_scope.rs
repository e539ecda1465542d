// The shared application state.
use idem_ui as support;

use std::borrow::Cow;

use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use axum::routing::post;
use idem::{Phases, Scope, idempotent};
use sqlx::Postgres;
use support::AppState;

/// A caller that scopes keys but cannot be rebuilt from a stored scope.
struct Caller(String);

impl Scope for Caller {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Caller("anyone".to_owned()))
    }
}

#[idempotent(scope = "caller")]
async fn create(caller: Caller, phases: Phases<Postgres>) -> &'static str {
    let _ = (caller, phases);
    "created"
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
