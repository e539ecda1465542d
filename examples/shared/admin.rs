//! The operators' idempotency routes, behind `Authorization: Bearer
//! <ADMIN_TOKEN>`: a scope's recent keys, one key, and forgetting a key
//! that is done (so that its next request runs afresh).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use idem::{Admin, Forgotten, Idem, KeyInfo, KeyState};
use serde::Deserialize;

struct AdminState<DB: Admin> {
    idem: Idem<DB>,
    token: Arc<[u8]>,
}

impl<DB: Admin> Clone for AdminState<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            token: Arc::clone(&self.token),
        }
    }
}

/// `GET /admin/idempotency/{scope}`, `GET` and `DELETE
/// /admin/idempotency/{scope}/{key}`, answering only `token`'s bearer.
pub fn router<DB: Admin>(idem: Idem<DB>, token: &str) -> Router {
    Router::new()
        .route("/admin/idempotency/{scope}", get(recent::<DB>))
        .route(
            "/admin/idempotency/{scope}/{key}",
            get(lookup::<DB>).delete(forget::<DB>),
        )
        .with_state(AdminState {
            idem,
            token: token.as_bytes().into(),
        })
}

/// Whether the request carries the token, compared in constant time (for
/// tokens of one length).
fn authorized(headers: &HeaderMap, token: &[u8]) -> bool {
    let Some(sent) = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
    else {
        return false;
    };
    let differ = sent
        .iter()
        .zip(token)
        .fold(0_u8, |differ, (a, b)| differ | (a ^ b));
    differ == 0 && sent.len() == token.len()
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "send Authorization: Bearer <ADMIN_TOKEN>\n",
    )
        .into_response()
}

fn millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    })
}

/// A key as JSON: times in milliseconds since the epoch.
fn json(info: &KeyInfo) -> serde_json::Value {
    let state = match info.state {
        KeyState::InFlight => "in_flight",
        KeyState::Completed => "completed",
        KeyState::Uncertain => "uncertain",
        _ => "expired",
    };
    serde_json::json!({
        "scope": info.scope,
        "key": info.key,
        "state": state,
        "status": info.status,
        "fingerprint": info.fingerprint,
        "method": info.method,
        "path": info.path,
        "created_ms": millis(info.created),
        "expires_ms": millis(info.expires),
        "leased": info.leased,
        "lease_until_ms": info.lease_until.map(millis),
        "phases": info.phases,
        "external": info.external,
        // Its request or recovery point did not open (IDEM_ENCRYPTION_KEYS).
        "unreadable": info.unreadable,
    })
}

fn failed(error: idem::Error) -> Response {
    let cause = std::error::Error::source(&error)
        .map(ToString::to_string)
        .unwrap_or_default();
    tracing::error!(%error, cause, "idempotency admin request failed");
    (StatusCode::INTERNAL_SERVER_ERROR, "key store error\n").into_response()
}

#[derive(Deserialize)]
struct Limit {
    limit: Option<u32>,
}

async fn recent<DB: Admin>(
    State(state): State<AdminState<DB>>,
    headers: HeaderMap,
    Path(scope): Path<String>,
    Query(Limit { limit }): Query<Limit>,
) -> Response {
    if !authorized(&headers, &state.token) {
        return unauthorized();
    }
    match state.idem.recent(&scope, limit.unwrap_or(50)).await {
        Ok(keys) => Json(keys.iter().map(json).collect::<Vec<_>>()).into_response(),
        Err(error) => failed(error),
    }
}

async fn lookup<DB: Admin>(
    State(state): State<AdminState<DB>>,
    headers: HeaderMap,
    Path((scope, key)): Path<(String, String)>,
) -> Response {
    if !authorized(&headers, &state.token) {
        return unauthorized();
    }
    match state.idem.lookup(&scope, &key).await {
        Ok(Some(info)) => Json(json(&info)).into_response(),
        Ok(None) => (StatusCode::NOT_FOUND, "no such key\n").into_response(),
        Err(error) => failed(error),
    }
}

async fn forget<DB: Admin>(
    State(state): State<AdminState<DB>>,
    headers: HeaderMap,
    Path((scope, key)): Path<(String, String)>,
) -> Response {
    if !authorized(&headers, &state.token) {
        return unauthorized();
    }
    match state.idem.forget(&scope, &key).await {
        Ok(Forgotten::Deleted) => {
            // Scopes and keys are the callers' data: logged as tags only.
            tracing::info!(
                scope = %idem::redact(&[&scope]),
                key = %idem::redact(&[&scope, &key]),
                "idempotency key forgotten"
            );
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Forgotten::Absent) => (StatusCode::NOT_FOUND, "no such key\n").into_response(),
        Ok(Forgotten::InFlight) => (
            StatusCode::CONFLICT,
            "the key is in flight: try again once it finishes or expires\n",
        )
            .into_response(),
        Ok(_) => (
            StatusCode::CONFLICT,
            "the key's outcome is uncertain: resolve it\n",
        )
            .into_response(),
        Err(error) => failed(error),
    }
}
