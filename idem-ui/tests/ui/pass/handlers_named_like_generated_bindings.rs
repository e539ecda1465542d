//! A handler may be named like any binding the expansion uses: each
//! handler is also a unit struct of its module, and a struct in scope turns
//! a `let` of its name into a pattern (found by review: a handler named
//! `value` broke every other handler of its module). The handlers' own
//! code binds none of these names: a user's `let body` meets the `body`
//! handler's struct as it would any unit struct of the module.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

macro_rules! handlers {
    ($($name:ident),* $(,)?) => {
        $(
            #[idempotent(scope = "account")]
            async fn $name(
                account: Account,
                headers: HeaderMap,
                tx: Tx<Postgres>,
                Json(payload): Json<serde_json::Value>,
            ) -> Json<serde_json::Value> {
                drop((account, headers, tx));
                Json(payload)
            }
        )*

        fn routes() -> Router<AppState> {
            Router::new()$(.route(concat!("/", stringify!($name)), post($name)))*
        }
    };
}

handlers!(
    value, rejection, extracted, request, state, parts, body, prepared, response, output, scope,
    store, failed,
);

fn main() {
    let _: Router<AppState> = routes();
}
