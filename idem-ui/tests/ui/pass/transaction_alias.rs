//! A team's own name for the request's transaction: an alias named `Tx`,
//! here in a module of its own, takes its database from the alias. A
//! `Result` return type under an alias of its own is told apart too.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idem::idempotent;
use support::{Account, AppState};

mod db {
    /// The one database every handler of this service writes to.
    pub type Tx = idem::Tx<sqlx::Postgres>;
}

type ApiResult<T> = Result<T, StatusCode>;

#[idempotent(scope = "account")]
async fn create(account: Account, mut tx: db::Tx) -> ApiResult<StatusCode> {
    let _ = (account, &mut tx);
    Ok(StatusCode::CREATED)
}

use db::Tx;

#[idempotent(scope = "account", key = "optional")]
async fn update(account: Account, tx: Tx) -> StatusCode {
    let _ = (account, tx);
    StatusCode::OK
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/", post(create))
        .route("/update", post(update));
}
