//! Handlers in nested modules, with every visibility, routed from outside.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::routing::post;
use support::AppState;

mod api {
    pub mod v1 {
        use axum::Json;
        use axum::http::StatusCode;
        use idem::{Tx, idempotent};
        use sqlx::Postgres;

        use crate::support::Account;

        /// Public: routed from the crate root.
        #[idempotent(scope = "account")]
        pub async fn create_charge(
            account: Account,
            mut tx: Tx<Postgres>,
            Json(amount): Json<i64>,
        ) -> (StatusCode, Json<i64>) {
            let _ = (account, &mut tx);
            (StatusCode::CREATED, Json(amount))
        }

        #[idempotent(scope = "account", ttl = "1h")]
        pub(crate) async fn create_refund(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
            let _ = (account, &mut tx);
            StatusCode::CREATED
        }

        #[idempotent(scope = "account")]
        pub(super) async fn create_payout(account: Account, mut tx: Tx<Postgres>) -> StatusCode {
            let _ = (account, &mut tx);
            StatusCode::CREATED
        }
    }

    pub fn routes() -> axum::Router<crate::AppState> {
        axum::Router::new().route("/payouts", axum::routing::post(v1::create_payout))
    }
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/charges", post(api::v1::create_charge))
        .route("/refunds", post(api::v1::create_refund))
        .merge(api::routes());
}
