//! The same service on SQLite (a WAL file), the embedded engine: the same
//! handler three ways, the same SQL. Writers are serialized by SQLite, so
//! every write transaction starts with `BEGIN IMMEDIATE`, as the runtime's
//! claim does (a deferred `BEGIN` would fail with `SQLITE_BUSY` under load).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRef, Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::{Fingerprint, Idem, Tx, idempotent};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Connection, Sqlite, SqlitePool};

use crate::app::{Account, ApiError, KEYS_TABLE, NewCharge, created, work};

pub async fn connect(path: &str, size: u32) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .connect_with(options)
        .await
        .unwrap_or_else(|error| panic!("cannot open the SQLite database {path}: {error}"))
}

/// A new database file with the tables.
pub async fn setup(path: &str) -> Result<(), Box<dyn std::error::Error>> {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{path}{suffix}"));
    }
    let pool = connect(path, 1).await;
    Idem::new(pool.clone()).table(KEYS_TABLE)?.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE bench_charges (
            id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL,
            amount INTEGER NOT NULL, currency TEXT NOT NULL);
         CREATE TABLE bench_accounts (
            account TEXT PRIMARY KEY, balance INTEGER NOT NULL DEFAULT 0,
            charges INTEGER NOT NULL DEFAULT 0);
         CREATE TABLE bench_ledger (
            id INTEGER PRIMARY KEY AUTOINCREMENT, charge_id INTEGER NOT NULL,
            account TEXT NOT NULL, amount INTEGER NOT NULL);
         CREATE TABLE bench_two_phase_keys (
            scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
            status INTEGER, body BLOB, expires_at INTEGER NOT NULL,
            PRIMARY KEY (scope, key));
         WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n < 255)
         INSERT INTO bench_accounts (account) SELECT 'c' || n FROM i;",
    )
    .execute(&pool)
    .await?;
    pool.close().await;
    Ok(())
}

#[derive(Clone, FromRef)]
struct AppState {
    idem: Idem<Sqlite>,
    pool: SqlitePool,
}

pub fn router(pool: SqlitePool) -> axum::Router {
    let idem = Idem::new(pool.clone())
        .table(KEYS_TABLE)
        .expect("table name");
    axum::Router::new()
        .route("/{statements}/baseline", post(baseline))
        .route("/{statements}/idempotent", post(idempotent))
        .route("/{statements}/two_phase", post(two_phase))
        .with_state(AppState { idem, pool })
}

async fn baseline(
    account: Account,
    Path(statements): Path<u32>,
    State(pool): State<SqlitePool>,
    Json(new): Json<NewCharge>,
) -> Result<Response, ApiError> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let charge = work::<Sqlite>(&mut tx, &account.0, &new, statements).await?;
    tx.commit().await?;
    Ok(created(charge))
}

#[idempotent(scope = "account")]
async fn idempotent(
    account: Account,
    Path(statements): Path<u32>,
    mut tx: Tx<Sqlite>,
    Json(new): Json<NewCharge>,
) -> Result<Response, ApiError> {
    Ok(created(
        work::<Sqlite>(&mut tx, &account.0, &new, statements).await?,
    ))
}

/// The two-phase recipe, as on PostgreSQL: an autocommitted claim, then
/// the work and the response in a second transaction.
async fn two_phase(
    account: Account,
    Path(statements): Path<u32>,
    State(pool): State<SqlitePool>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return Ok(StatusCode::BAD_REQUEST.into_response());
    };
    let fingerprint = Fingerprint::of(&method, uri.path(), uri.query(), &headers, &body);
    let Ok(new) = serde_json::from_slice::<NewCharge>(&body) else {
        return Ok(StatusCode::UNPROCESSABLE_ENTITY.into_response());
    };
    let mut conn = pool.acquire().await?;
    let claimed = sqlx::query(
        "INSERT INTO bench_two_phase_keys (scope, key, fingerprint, expires_at) \
         VALUES ($1, $2, $3, unixepoch() + 86400) ON CONFLICT (scope, key) DO NOTHING",
    )
    .bind(&account.0)
    .bind(key)
    .bind(&fingerprint.as_bytes()[..])
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if !claimed {
        return Ok(StatusCode::CONFLICT.into_response());
    }
    let mut tx = Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE").await?;
    let charge = work::<Sqlite>(&mut tx, &account.0, &new, statements).await?;
    sqlx::query(
        "UPDATE bench_two_phase_keys SET status = 201, body = $3 WHERE scope = $1 AND key = $2",
    )
    .bind(&account.0)
    .bind(key)
    .bind(serde_json::to_vec(&charge).expect("serializable"))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(created(charge))
}
