//! The caller of the round-trip tests' and the benchmark's handlers, from
//! the `x-account` header: the scope their keys live in.

use std::borrow::Cow;

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use idem::Scope;

/// The caller; a request without `x-account` is 401.
pub struct Account(pub String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        self.0.as_str().into()
    }
}

/// How a phased handler's completer names the caller it resumes (the
/// benchmark's phased handler is one).
impl idem::FromScope for Account {
    fn from_scope(scope: &str) -> Self {
        Account(scope.to_owned())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let account = parts
            .headers
            .get("x-account")
            .ok_or(StatusCode::UNAUTHORIZED)?;
        let account = account.to_str().map_err(|_| StatusCode::UNAUTHORIZED)?;
        Ok(Account(account.to_owned()))
    }
}
