//! A diagnostic scenario, not run by default (`IDEM_BENCH_SCENARIOS=read_floor`):
//! a replay at its floor, one prepared indexed read of the stored row on
//! the pool, no transaction, no body read. The best `replay_rps` this
//! machine allows with sqlx's pool; a real replay in the process that
//! stored the key is this read plus the wrapper's own work (the key, the
//! body's fingerprint, the stored headers), and one that reaches another
//! instance also claims the key and rolls that transaction back.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sqlx::PgPool;

use crate::app::{Account, ApiError};

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
