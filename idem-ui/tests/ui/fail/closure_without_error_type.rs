// A phase's closure that never says its error type: rustc cannot choose
// the `E` of `Phases::local` (nor the type a `?` inside converts into), and
// lists every `From<sqlx::Error>` impl it knows of. That message is
// rustc's, about the user's own closure; the expansion takes no part in
// it. The fix is to name the type: `async |tx| -> Result<i64, Response>`.

// The shared caller and application state.
use idem_ui as support;

use axum::Router;
use axum::extract::Json;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::post;
use idem::{Phases, idempotent};
use sqlx::Postgres;
use support::{Account, AppState};

#[idempotent(scope = "account")]
async fn pay(
    account: Account,
    mut phases: Phases<Postgres>,
    Json(amount): Json<i64>,
) -> Result<StatusCode, Response> {
    let _ = account;
    let id: i64 = phases
        .local("pending", async |tx| {
            let id = sqlx::query_scalar("INSERT INTO payments (amount) VALUES ($1) RETURNING id")
                .bind(amount)
                .fetch_one(tx)
                .await?;
            Ok(id)
        })
        .await?;
    let _ = id;
    Ok(StatusCode::CREATED)
}

fn main() {
    let _: Router<AppState> = Router::new().route("/", post(pay));
}
