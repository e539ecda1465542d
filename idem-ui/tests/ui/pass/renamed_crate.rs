//! A renamed `idem` dependency (`my_idem = { package = "idem", ... }` in
//! Cargo.toml, simulated with `extern crate ... as`), named by `crate`.
#![deny(warnings, clippy::all)]

extern crate idem as my_idem;

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use my_idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account", crate = "my_idem")]
async fn relative(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

#[idempotent(scope = "account", crate = "::my_idem")]
async fn absolute(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

mod nested {
    use my_idem::{Tx, idempotent};
    use sqlx::Postgres;

    use crate::support::Account;

    /// Inside a module only the absolute path (or one in scope) resolves.
    #[idempotent(scope = "account", crate = "::my_idem")]
    pub async fn create(account: Account, mut tx: Tx<Postgres>) -> &'static str {
        let _ = (account, &mut tx);
        "created"
    }
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/relative", post(relative))
        .route("/absolute", post(absolute))
        .route("/nested", post(nested::create));
}
