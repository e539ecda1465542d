//! A small payments API whose `POST /v1/charges` is safe to retry.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example charges
//! curl -i -X POST localhost:3000/v1/charges -H 'Authorization: Bearer acct_1' \
//!      -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' \
//!      -d '{"amount": 1250, "currency": "eur"}'
//! ```
//!
//! Environment: `DATABASE_URL` (required for now), `ADDR` (default
//! `127.0.0.1:3000`), `CHARGE_DELAY_MS` (the handler waits this long after
//! its insert, to watch a concurrent retry get 409).

use std::time::Duration;

use axum::extract::{FromRef, FromRequestParts, Path, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::{Idem, Scope, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres};

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<Postgres>,
    pool: PgPool,
    delay: Duration,
}

/// The caller, from `Authorization: Bearer <account>`.
struct Account(String);

impl Scope for Account {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .filter(|account| !account.is_empty())
            .map(|account| Account(account.to_owned()))
            .ok_or((
                StatusCode::UNAUTHORIZED,
                "send Authorization: Bearer <account>\n",
            ))
    }
}

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

#[derive(Serialize, sqlx::FromRow)]
struct Charge {
    id: i64,
    amount: i64,
    currency: String,
}

/// Any database error becomes a 500, which `idem` never stores: the
/// transaction rolls back and a retry runs again.
struct ApiError(sqlx::Error);

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        tracing::error!(error = %self.0, "database error");
        (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response()
    }
}

#[idempotent(scope = "account", ttl = "24h")]
async fn create_charge(
    account: Account,
    State(delay): State<Duration>,
    mut tx: Tx<Postgres>,
    Json(new): Json<NewCharge>,
) -> Result<impl IntoResponse, ApiError> {
    let charge: Charge = sqlx::query_as(
        "INSERT INTO charges (account, amount, currency) VALUES ($1, $2, $3) RETURNING id, amount, currency",
    )
    .bind(&account.0)
    .bind(new.amount)
    .bind(&new.currency)
    .fetch_one(&mut *tx)
    .await?;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let location = format!("/v1/charges/{}", charge.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(charge),
    ))
}

async fn get_charge(
    account: Account,
    State(pool): State<PgPool>,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    let charge: Option<Charge> =
        sqlx::query_as("SELECT id, amount, currency FROM charges WHERE id = $1 AND account = $2")
            .bind(id)
            .bind(&account.0)
            .fetch_optional(&pool)
            .await?;
    Ok(match charge {
        Some(charge) => Json(charge).into_response(),
        None => (StatusCode::NOT_FOUND, "no such charge\n").into_response(),
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL, e.g. postgres://postgres@127.0.0.1:5432/test")?;
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let delay = Duration::from_millis(
        std::env::var("CHARGE_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );

    let pool = PgPool::connect(&url).await?;
    let idem = Idem::new(pool.clone());
    idem.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (
            id bigserial PRIMARY KEY,
            account text NOT NULL,
            amount bigint NOT NULL,
            currency text NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .execute(&pool)
    .await?;
    idem.spawn_sweeper(Duration::from_secs(60));

    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .route("/v1/charges/{id}", get(get_charge))
        .with_state(AppState { idem, pool, delay });
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("charges API listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
