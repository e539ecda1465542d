//! The compile-time checks of `#[idempotent]` (`tests/ui`), and what their
//! cases share: a caller extractor that implements `Scope` (and `FromScope`,
//! for phased handlers), and an application state that holds the store.

use std::borrow::Cow;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::{StatusCode, request::Parts};
use idem::{FromScope, Idem, Scope};
use sqlx::{PgPool, Postgres};

#[derive(Clone, FromRef)]
pub struct AppState {
    pub idem: Idem<Postgres>,
    pub pool: PgPool,
}

/// The authenticated caller, from the `X-Account` header.
pub struct Account(pub String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl FromScope for Account {
    fn from_scope(scope: &str) -> Self {
        Account(scope.to_owned())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get("x-account")
            .and_then(|value| value.to_str().ok())
            .map(|value| Account(value.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}
