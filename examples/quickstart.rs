//! The smallest complete service: one idempotent handler on SQLite.
//!
//! ```text
//! cargo run --example quickstart
//! curl -i localhost:3000/v1/charges -H 'Authorization: Bearer acct_1' \
//!      -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' \
//!      -d '{"amount": 1250}'
//! ```
//!
//! Send the same request again: the answer is the same 201, with
//! `idempotent-replayed: true`, and no second charge. The same key with
//! another amount is 422. `ADDR` sets the address (default
//! `127.0.0.1:3000`), `DATABASE_URL` the SQLite file (default
//! `sqlite:quickstart.db`, created if missing).

use std::borrow::Cow;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Idem, Scope, Tx, idempotent};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};

/// The caller, from `Authorization: Bearer <account>`: keys are scoped to it.
struct Account(String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let bearer = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        match bearer.and_then(|v| v.strip_prefix("Bearer ")) {
            Some(account) => Ok(Account(account.to_owned())),
            None => Err(StatusCode::UNAUTHORIZED),
        }
    }
}

#[derive(serde::Deserialize)]
struct NewCharge {
    amount: i64,
}

/// Runs once per key: the charge and the stored answer commit together.
#[idempotent(scope = "account", ttl = "24h")]
async fn create_charge(
    account: Account,
    mut tx: Tx<Sqlite>,
    Json(new): Json<NewCharge>,
) -> Result<impl IntoResponse, StatusCode> {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO charges (account, amount) VALUES (?, ?) RETURNING id")
            .bind(&account.0)
            .bind(new.amount)
            .fetch_one(&mut *tx)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let charge = serde_json::json!({ "id": id, "amount": new.amount });
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/v1/charges/{id}"))],
        Json(charge),
    ))
}

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<Sqlite>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite:quickstart.db".into());
    let options: SqliteConnectOptions = url.parse()?;
    let pool = SqlitePool::connect_with(options.create_if_missing(true)).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            account TEXT NOT NULL,
            amount INTEGER NOT NULL
        )",
    )
    .execute(&pool)
    .await?;
    let idem = Idem::new(pool);
    idem.migrate().await?;

    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .with_state(AppState { idem });
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("quickstart listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
