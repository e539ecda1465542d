//! Docs, `#[cfg]`, lint attributes and strict crate-level lints: nothing
//! the macro generates adds a warning.
#![deny(warnings, clippy::all, missing_docs, missing_debug_implementations)]
#![deny(unused_qualifications, rust_2018_idioms, unreachable_pub)]

// The shared caller and application state.

use idem_ui as support;

use axum::Router;
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

/// Creates a charge; the docs land on the generated handler type.
#[idempotent(scope = "account")]
#[allow(clippy::unused_async)]
pub async fn create_charge(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

/// Compiled out: neither the handler nor its impls exist.
#[idempotent(scope = "account")]
#[cfg(any())]
pub async fn compiled_out(account: Account, tx: Tx<Postgres>) -> DoesNotExist {
    let _ = (account, tx);
}

/// Deprecated: the warning is where it is routed (allowed there), never
/// at its definition.
#[idempotent(scope = "account")]
#[deprecated(note = "use create_charge")]
pub async fn old_charge(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

/// Traced: `#[tracing::instrument]` below the attribute goes onto the
/// kept function, which has the handler's name, so its span does too.
#[idempotent(scope = "account")]
#[tracing::instrument(skip_all)]
pub async fn traced(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

#[allow(deprecated)]
fn main() {
    let _: Router<AppState> = Router::new()
        .route("/", post(create_charge))
        .route("/old", post(old_charge))
        .route("/traced", post(traced));
}
