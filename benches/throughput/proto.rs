//! Diagnostic scenarios, not run by default (`IDEM_BENCH_SCENARIOS=...`):
//! what bounds the figures, measured rather than guessed.
//!
//! - `proto_idempotent`: the runtime's PostgreSQL first attempt written by
//!   hand with the same messages (claim on `BEGIN`, response on `COMMIT`,
//!   no extra round trip), but through server-side prepared statements
//!   (`EXECUTE`), so PostgreSQL does not parse and plan the claim, select
//!   and update on every request. The difference to `idempotent` is what
//!   plan caching would buy the runtime.
//! - `read_floor`: a replay at its floor: one prepared indexed read of the
//!   stored row on the pool, no transaction. The best `replay_rps` this
//!   machine allows with sqlx's pool.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use idem::{Fingerprint, StoredResponse};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

use crate::app::{Account, ApiError, NewCharge, created, work};

/// The prototype's key table: the runtime's layout.
pub const PROTO_TABLE: &str = "idem_bench_proto";

/// Run on every new server connection (`after_connect`).
pub async fn prepare(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "PREPARE idem_proto_claim (bytea, bytea, bytea, bigint) AS
            INSERT INTO idem_bench_proto (scope, key, fingerprint, expires_at)
            VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond')
            ON CONFLICT (scope, key) DO NOTHING;
         PREPARE idem_proto_select (bytea, bytea) AS
            SELECT status, fingerprint, headers, body, expires_at <= now() AS expired
            FROM idem_bench_proto WHERE scope = $1 AND key = $2;
         PREPARE idem_proto_finish (bytea, bytea, smallint, bytea, bytea) AS
            UPDATE idem_bench_proto SET status = $3, headers = $4, body = $5
            WHERE scope = $1 AND key = $2;",
    )
    .execute(conn)
    .await?;
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// `proto_idempotent`: see the module documentation.
pub async fn proto_idempotent(
    account: Account,
    Path(statements): Path<u32>,
    State(pool): State<PgPool>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Some(key) = headers.get("idempotency-key").map(|v| v.as_bytes()) else {
        return Ok(StatusCode::BAD_REQUEST.into_response());
    };
    let fingerprint = Fingerprint::of(&method, uri.path(), uri.query(), &headers, &body);
    let Ok(new) = serde_json::from_slice::<NewCharge>(&body) else {
        return Ok(StatusCode::UNPROCESSABLE_ENTITY.into_response());
    };
    let (scope, key) = (hex(account.0.as_bytes()), hex(key));
    let mut conn = pool.acquire().await?;
    let result = first_attempt(
        &mut conn,
        &scope,
        &key,
        &fingerprint,
        &account.0,
        &new,
        statements,
    )
    .await;
    if let Err(error) = &result {
        tracing::error!(%error, "proto_idempotent failed");
        // Never pool a connection inside a transaction.
        conn.close_on_drop();
    }
    Ok(result?)
}

async fn first_attempt(
    conn: &mut PgConnection,
    scope: &str,
    key: &str,
    fingerprint: &Fingerprint,
    account: &str,
    new: &NewCharge,
    statements: u32,
) -> Result<Response, sqlx::Error> {
    let claim = format!(
        "BEGIN; SET LOCAL lock_timeout = '1ms'; \
         EXECUTE idem_proto_claim('\\x{scope}', '\\x{key}', '\\x{}', 86400000); \
         SET LOCAL lock_timeout TO DEFAULT; \
         EXECUTE idem_proto_select('\\x{scope}', '\\x{key}')",
        hex(fingerprint.as_bytes())
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(claim))
        .fetch_all(&mut *conn)
        .await?;
    let status: Option<i16> = rows
        .first()
        .map(|row| row.try_get(0))
        .transpose()?
        .flatten();
    if status.is_some() {
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
        return Ok(StatusCode::CONFLICT.into_response());
    }
    let charge = work(conn, account, new, statements).await?;
    let (stored, original) =
        StoredResponse::capture(created(charge), idem::DEFAULT_REPLAY_HEADERS, 1024 * 1024)
            .await
            .expect("small response");
    let finish = format!(
        "EXECUTE idem_proto_finish('\\x{scope}', '\\x{key}', {}, '\\x{}', '\\x{}'); COMMIT",
        stored.status.as_u16(),
        hex(&stored.encode_headers()),
        hex(&stored.body)
    );
    sqlx::raw_sql(AssertSqlSafe(finish))
        .execute(&mut *conn)
        .await?;
    let mut response = Response::new(axum::body::Body::from(stored.body));
    *response.status_mut() = stored.status;
    *response.headers_mut() = original;
    Ok(response)
}

/// `read_floor`: see the module documentation.
pub async fn read_floor(
    account: Account,
    State(pool): State<PgPool>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Some(key) = headers.get("idempotency-key").map(|v| v.as_bytes()) else {
        return Ok(StatusCode::BAD_REQUEST.into_response());
    };
    let row: Option<(Option<i16>, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT status, body FROM idem_bench_keys WHERE scope = $1 AND key = $2 AND expires_at > now()",
    )
    .bind(account.0.as_bytes())
    .bind(key)
    .fetch_optional(&pool)
    .await?;
    Ok(match row {
        Some((Some(status), Some(body))) => (
            StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK),
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (
                    header::HeaderName::from_static("idempotent-replayed"),
                    HeaderValue::from_static("true"),
                ),
            ],
            body,
        )
            .into_response(),
        _ => StatusCode::NOT_FOUND.into_response(),
    })
}
