//! The admin JSON routes: a scope's recent keys, one key, forgetting it
//! and resolving it. Their paths and field names are a contract.

use std::time::SystemTime;

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::Deserialize;

use super::Shared;
use super::auth::ApiOperator;
use super::format::{millis, millis_left, problem};
use super::resolution::JsonAsk;
use crate::backend::{Admin, Forgotten, KeyInfo, KeyState, Phased};
use crate::error::Error;
use crate::observe::redact;
use crate::resolve::Resolved;

/// How many keys a scope's list shows without `?limit=`.
pub(super) const DEFAULT_LIMIT: u32 = 50;

/// A key's state as the routes name it.
pub(super) fn state_name(state: KeyState) -> &'static str {
    match state {
        KeyState::InFlight => "in_flight",
        KeyState::Completed => "completed",
        KeyState::Uncertain => "uncertain",
        KeyState::Expired => "expired",
        KeyState::Tombstone => "tombstone",
    }
}

/// A key as JSON: times in milliseconds since the epoch (`lease_left_ms`
/// from now, while leased).
pub(super) fn json(info: &KeyInfo, now: SystemTime) -> serde_json::Value {
    let uncertain = info.uncertain.as_ref().map(|uncertain| {
        serde_json::json!({
            "since_ms": millis(uncertain.since),
            "reason": uncertain.reason,
            "step": uncertain.step,
        })
    });
    let resolutions: Vec<_> = info
        .resolutions
        .iter()
        .map(|record| {
            serde_json::json!({
                "at_ms": millis(record.at),
                "outcome": record.outcome,
                "status": record.status,
                "by": record.by,
                "note": record.note,
            })
        })
        .collect();
    let lease_left = info
        .lease_until
        .filter(|_| info.leased)
        .map(|until| millis_left(until, now));
    serde_json::json!({
        "scope": info.scope,
        "key": info.key,
        "state": state_name(info.state),
        "status": info.status,
        "fingerprint": info.fingerprint,
        "method": info.method,
        "path": info.path,
        "created_ms": millis(info.created),
        "expires_ms": millis(info.expires),
        "leased": info.leased,
        "lease_until_ms": info.lease_until.map(millis),
        "lease_left_ms": lease_left,
        "attempts": info.attempts,
        "phases": info.phases,
        "external": info.external,
        "begun": info.begun,
        "unreadable": info.unreadable,
        "uncertain": uncertain,
        "resolutions": resolutions,
    })
}

/// 500 for a store that failed, its cause logged (not sent).
pub(super) fn failed(error: &Error) -> Response {
    let cause = std::error::Error::source(error)
        .map(ToString::to_string)
        .unwrap_or_default();
    tracing::error!(%error, cause, "idempotency admin request failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "store_error",
        "the key store failed; see the service's log",
    )
}

fn absent() -> Response {
    problem(StatusCode::NOT_FOUND, "key_absent", "no such key")
}

#[derive(Deserialize)]
pub(super) struct Limit {
    limit: Option<u32>,
}

/// `GET /admin/idempotency/{scope}`: its recent keys, newest first.
pub(super) async fn recent<DB: Admin + Phased>(
    _: ApiOperator,
    State(shared): State<Shared<DB>>,
    Path(scope): Path<String>,
    Query(Limit { limit }): Query<Limit>,
) -> Response {
    match shared
        .idem
        .recent(&scope, limit.unwrap_or(DEFAULT_LIMIT))
        .await
    {
        Ok(keys) => {
            let now = SystemTime::now();
            Json(keys.iter().map(|info| json(info, now)).collect::<Vec<_>>()).into_response()
        }
        Err(error) => failed(&error),
    }
}

/// `GET /admin/idempotency/{scope}/{key}`.
pub(super) async fn lookup<DB: Admin + Phased>(
    _: ApiOperator,
    State(shared): State<Shared<DB>>,
    Path((scope, key)): Path<(String, String)>,
) -> Response {
    match shared.idem.lookup(&scope, &key).await {
        Ok(Some(info)) => Json(json(&info, SystemTime::now())).into_response(),
        Ok(None) => absent(),
        Err(error) => failed(&error),
    }
}

/// `DELETE /admin/idempotency/{scope}/{key}`: forgets a finished or
/// expired key.
pub(super) async fn forget<DB: Admin + Phased>(
    _: ApiOperator,
    State(shared): State<Shared<DB>>,
    Path((scope, key)): Path<(String, String)>,
) -> Response {
    match shared.idem.forget(&scope, &key).await {
        Ok(Forgotten::Deleted) => {
            log_forgotten(&scope, &key);
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Forgotten::Absent) => absent(),
        Ok(Forgotten::InFlight) => problem(
            StatusCode::CONFLICT,
            "key_in_flight",
            "the key is in flight: try again once it finishes or expires",
        ),
        Ok(Forgotten::Uncertain) => problem(
            StatusCode::CONFLICT,
            "key_uncertain",
            "the key's outcome is uncertain: resolve it (POST .../resolve) rather than forget it",
        ),
        Err(error) => failed(&error),
    }
}

/// Scopes and keys are the callers' data: logged as tags only.
pub(super) fn log_forgotten(scope: &str, key: &str) {
    tracing::info!(
        scope = %redact(&[scope]),
        key = %redact(&[scope, key]),
        "idempotency key forgotten by an operator"
    );
}

/// `POST /admin/idempotency/{scope}/{key}/resolve`: resolves an uncertain
/// key, answering the key as it is after.
pub(super) async fn resolve<DB: Admin + Phased>(
    _: ApiOperator,
    State(shared): State<Shared<DB>>,
    Path((scope, key)): Path<(String, String)>,
    ask: Result<Json<JsonAsk>, JsonRejection>,
) -> Response {
    let ask = match ask {
        Ok(Json(ask)) => ask,
        Err(rejection) => {
            return problem(
                rejection.status(),
                "invalid_resolution",
                &rejection.body_text(),
            );
        }
    };
    let resolution = match ask.resolution() {
        Ok(resolution) => resolution,
        Err(why) => return problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid_resolution", &why),
    };
    let outcome = resolution.outcome();
    match shared.idem.resolve(&scope, &key, resolution).await {
        Ok(Resolved::Resolved) => {
            log_resolved(&scope, &key, outcome);
            match shared.idem.lookup(&scope, &key).await {
                Ok(Some(info)) => Json(json(&info, SystemTime::now())).into_response(),
                // Resolved and gone since (released, forgotten).
                Ok(None) => Json(serde_json::json!({
                    "scope": scope,
                    "key": key,
                    "state": "absent",
                }))
                .into_response(),
                Err(error) => failed(&error),
            }
        }
        Ok(Resolved::Absent) => absent(),
        Ok(_) => problem(
            StatusCode::CONFLICT,
            "key_not_uncertain",
            "the key is not uncertain (in flight, completed or expired): nothing changed",
        ),
        Err(Error::InvalidResolution(why)) => {
            problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid_resolution", &why)
        }
        Err(error) => failed(&error),
    }
}

/// A resolution, logged with the scope and key as tags.
pub(super) fn log_resolved(scope: &str, key: &str, outcome: &str) {
    tracing::info!(
        scope = %redact(&[scope]),
        key = %redact(&[scope, key]),
        outcome,
        "uncertain idempotency key resolved by an operator"
    );
}
