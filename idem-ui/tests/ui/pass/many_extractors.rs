//! axum's own `Handler` impls stop at 16 extractors; `#[idempotent]`
//! implements `Handler` itself, so a handler may take more, and the `Tx`
//! does not count against any limit.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::http::{HeaderMap, Method, Uri};
use axum::routing::post;
use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account")]
#[allow(clippy::too_many_arguments)]
async fn create(
    account: Account,
    h1: HeaderMap,
    h2: HeaderMap,
    h3: HeaderMap,
    h4: HeaderMap,
    h5: HeaderMap,
    h6: HeaderMap,
    m1: Method,
    m2: Method,
    m3: Method,
    m4: Method,
    m5: Method,
    u1: Uri,
    u2: Uri,
    u3: Uri,
    u4: Uri,
    u5: Uri,
    mut tx: Tx<Postgres>,
    body: String,
) -> String {
    let _ = (account, &mut tx, h1, h2, h3, h4, h5, h6, m1, m2, m3, m4, m5);
    let _ = (u1, u2, u3, u4, u5);
    body
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(create));
}
