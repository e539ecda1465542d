//! Phased handlers (`Phases<DB>` in place of `Tx<DB>`): local phases, an
//! external step and the last phase, with and without a `lease`, routed
//! in a state that holds the store.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::extract::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use idem::{Phases, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

fn failed(_: sqlx::Error) -> Response {
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

/// Every kind of step, with a lease of its own; the body's last.
#[idempotent(scope = "account", lease = "5s")]
async fn pay(
    account: Account,
    mut phases: Phases<Postgres>,
    Json(amount): Json<i64>,
) -> Result<(StatusCode, Json<String>), Response> {
    let id: i64 = phases
        .local("pending", async |tx| -> Result<i64, Response> {
            sqlx::query_scalar("INSERT INTO payments (amount) VALUES ($1) RETURNING id")
                .bind(amount)
                .fetch_one(tx)
                .await
                .map_err(failed)
        })
        .await?;
    let charge: String = phases
        .external("provider", async |key| -> Result<String, Response> {
            Ok(format!("{}:{key}", account.0))
        })
        .await?;
    let tx = phases.last_phase().await?;
    sqlx::query("UPDATE payments SET charge = $1 WHERE id = $2")
        .bind(&charge)
        .bind(id)
        .execute(tx)
        .await
        .map_err(failed)?;
    Ok((StatusCode::CREATED, Json(charge)))
}

/// The default lease (30s); a handler need not reach its last phase.
#[idempotent(scope = "account")]
async fn default_lease(account: Account, phases: Phases<Postgres>) -> StatusCode {
    let _ = (account, phases.key(), phases.resumed());
    StatusCode::ACCEPTED
}

/// The shortest and the longest lease, with the other arguments a phased
/// handler takes, the `Phases` first and under its full path.
#[idempotent(
    scope = "account",
    lease = "1000ms",
    key = "required",
    ttl = "7d",
    timeout = "1h"
)]
async fn lease_min(phases: idem::Phases<sqlx::Postgres>, account: Account) -> StatusCode {
    let _ = (account, phases);
    StatusCode::CREATED
}

#[idempotent(scope = "account", lease = "1h")]
async fn lease_max(account: Account, phases: Phases<Postgres>) -> StatusCode {
    let _ = (account, phases);
    StatusCode::CREATED
}

/// A caller that middleware put in the extensions: `Extension<T>` is
/// rebuilt from the scope as its `T` is.
#[derive(Clone)]
struct User(String);

impl idem::Scope for User {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        std::borrow::Cow::Borrowed(&self.0)
    }
}

impl idem::FromScope for User {
    fn from_scope(scope: &str) -> Self {
        User(scope.to_owned())
    }
}

#[idempotent(scope = "user", lease = "10s")]
async fn extension(user: Extension<User>, phases: Phases<Postgres>) -> StatusCode {
    let _ = (user, phases);
    StatusCode::CREATED
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/pay", post(pay))
        .route("/default-lease", post(default_lease))
        .route("/lease-min", post(lease_min))
        .route("/lease-max", post(lease_max))
        .route("/extension", post(extension));
}
