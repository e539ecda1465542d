//! A small payments API whose `POST /v1/charges` is safe to retry.
//!
//! ```text
//! cargo run --example charges
//! curl -i -X POST localhost:3000/v1/charges -H 'Authorization: Bearer acct_1' \
//!      -H 'Idempotency-Key: order-42' -H 'Content-Type: application/json' \
//!      -d '{"amount": 1250, "currency": "eur"}'
//! ```
//!
//! Environment:
//! - `DATABASE_URL`: unset, the API keeps its data in the SQLite file
//!   `charges.db` in the working directory (created on first start, path
//!   printed); `postgres://...`, `mysql://...` (`--features mysql`) or
//!   `sqlite:...` choose the database instead.
//! - `ADDR`: where to listen, default `127.0.0.1:3000`.
//! - `CHARGE_DELAY_MS`: the handler waits this long after its insert, to
//!   watch a concurrent retry get 409.
//!
//! The handlers are written once, in `charges_api!`, and stamped out per
//! engine (an `#[idempotent]` handler names its `Tx<DB>`, so it cannot be
//! generic); what differs between engines is the [`Dialect`] below.

use std::future::Future;
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use idem::Scope;
use serde::{Deserialize, Serialize};

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
            .get(axum::http::header::AUTHORIZATION)
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

#[derive(Serialize)]
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

/// What the API's SQL looks like on one engine.
trait Dialect: idem::Backend {
    /// Creates the `charges` table if it is missing.
    const CREATE_CHARGES: &'static str;
    /// One charge by `(id, account)`.
    const SELECT_CHARGE: &'static str;

    /// Inserts a charge and returns its id, on the request's transaction.
    fn insert_charge(
        conn: &mut Self::Connection,
        account: &str,
        charge: &NewCharge,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
}

#[cfg(feature = "postgres")]
impl Dialect for sqlx::Postgres {
    const CREATE_CHARGES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
        currency text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())";
    const SELECT_CHARGE: &'static str =
        "SELECT id, amount, currency FROM charges WHERE id = $1 AND account = $2";

    async fn insert_charge(
        conn: &mut sqlx::PgConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO charges (account, amount, currency) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(account)
        .bind(charge.amount)
        .bind(&charge.currency)
        .fetch_one(conn)
        .await
    }
}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::Sqlite {
    const CREATE_CHARGES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)";
    const SELECT_CHARGE: &'static str =
        "SELECT id, amount, currency FROM charges WHERE id = ? AND account = ?";

    async fn insert_charge(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO charges (account, amount, currency) VALUES (?, ?, ?) RETURNING id",
        )
        .bind(account)
        .bind(charge.amount)
        .bind(&charge.currency)
        .fetch_one(conn)
        .await
    }
}

#[cfg(feature = "mysql")]
impl Dialect for sqlx::MySql {
    const CREATE_CHARGES: &'static str = "CREATE TABLE IF NOT EXISTS charges (
        id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
        amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL,
        created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB";
    const SELECT_CHARGE: &'static str =
        "SELECT id, amount, currency FROM charges WHERE id = ? AND account = ?";

    async fn insert_charge(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        // MySQL has no `INSERT ... RETURNING`; the id comes with the result.
        let done = sqlx::query("INSERT INTO charges (account, amount, currency) VALUES (?, ?, ?)")
            .bind(account)
            .bind(charge.amount)
            .bind(&charge.currency)
            .execute(conn)
            .await?;
        i64::try_from(done.last_insert_id()).map_err(|error| sqlx::Error::Decode(error.into()))
    }
}

/// The API on one engine: its state, its two handlers and its server.
macro_rules! charges_api {
    ($engine:ident, $db:ty) => {
        mod $engine {
            use std::time::Duration;

            use axum::extract::{FromRef, Path, State};
            use axum::http::{StatusCode, header};
            use axum::response::{IntoResponse, Response};
            use axum::routing::{get, post};
            use axum::{Json, Router};
            use idem::{Idem, Tx, idempotent};
            use sqlx::Pool;

            use crate::{Account, ApiError, Charge, Dialect, NewCharge};

            #[derive(Clone, FromRef)]
            struct AppState {
                idem: Idem<$db>,
                pool: Pool<$db>,
                delay: Duration,
            }

            #[idempotent(scope = "account", ttl = "24h")]
            async fn create_charge(
                account: Account,
                State(delay): State<Duration>,
                mut tx: Tx<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<impl IntoResponse, ApiError> {
                let id = <$db as Dialect>::insert_charge(&mut tx, &account.0, &new).await?;
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let charge = Charge {
                    id,
                    amount: new.amount,
                    currency: new.currency,
                };
                let location = format!("/v1/charges/{id}");
                Ok((
                    StatusCode::CREATED,
                    [(header::LOCATION, location)],
                    Json(charge),
                ))
            }

            async fn get_charge(
                account: Account,
                State(pool): State<Pool<$db>>,
                Path(id): Path<i64>,
            ) -> Result<Response, ApiError> {
                let charge: Option<(i64, i64, String)> =
                    sqlx::query_as(<$db as Dialect>::SELECT_CHARGE)
                        .bind(id)
                        .bind(&account.0)
                        .fetch_optional(&pool)
                        .await?;
                Ok(match charge {
                    Some((id, amount, currency)) => Json(Charge {
                        id,
                        amount,
                        currency,
                    })
                    .into_response(),
                    None => (StatusCode::NOT_FOUND, "no such charge\n").into_response(),
                })
            }

            /// Migrates and serves until the process ends.
            pub async fn serve(
                pool: Pool<$db>,
                listener: tokio::net::TcpListener,
                delay: Duration,
            ) -> Result<(), Box<dyn std::error::Error>> {
                let idem = Idem::new(pool.clone());
                idem.migrate().await?;
                sqlx::raw_sql(<$db as Dialect>::CREATE_CHARGES)
                    .execute(&pool)
                    .await?;
                idem.spawn_sweeper(Duration::from_secs(60));

                let app = Router::new()
                    .route("/v1/charges", post(create_charge))
                    .route("/v1/charges/{id}", get(get_charge))
                    .with_state(AppState { idem, pool, delay });
                tracing::info!("charges API listening on http://{}", listener.local_addr()?);
                axum::serve(listener, app).await?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "postgres")]
charges_api!(postgres, sqlx::Postgres);
#[cfg(feature = "sqlite")]
charges_api!(sqlite, sqlx::Sqlite);
#[cfg(feature = "mysql")]
charges_api!(mysql, sqlx::MySql);

/// With no `DATABASE_URL`: a SQLite file next to where the example runs.
#[cfg(feature = "sqlite")]
const DEFAULT_DATABASE: &str = "charges.db";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let delay = Duration::from_millis(
        std::env::var("CHARGE_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let url = std::env::var("DATABASE_URL").ok();
    let scheme = url
        .as_deref()
        .map_or("sqlite", |url| url.split(':').next().unwrap_or_default());

    match scheme {
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};
            let options = match &url {
                Some(url) => url.parse::<SqliteConnectOptions>()?,
                None => {
                    let path = std::env::current_dir()?.join(DEFAULT_DATABASE);
                    tracing::info!(
                        "DATABASE_URL is not set: keeping charges in the SQLite file {}",
                        path.display()
                    );
                    SqliteConnectOptions::new().filename(path)
                }
            };
            // WAL lets replays read while a charge is being written.
            let options = options
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal);
            sqlite::serve(SqlitePool::connect_with(options).await?, listener, delay).await
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            let pool = sqlx::PgPool::connect(url.as_deref().unwrap_or_default()).await?;
            postgres::serve(pool, listener, delay).await
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            let pool = sqlx::MySqlPool::connect(url.as_deref().unwrap_or_default()).await?;
            mysql::serve(pool, listener, delay).await
        }
        _ if url.is_none() => {
            Err("DATABASE_URL is not set and this build has no `sqlite` feature".into())
        }
        other => Err(format!(
            "DATABASE_URL scheme {other:?} is not served by this build: use sqlite:, \
             postgres: or mysql: (mysql needs `--features mysql`)"
        )
        .into()),
    }
}
