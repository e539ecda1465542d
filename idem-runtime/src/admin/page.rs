//! The operator page's routes: the overview, one key, and the forms that
//! resolve or forget a key (each checked against its session's token).

use std::time::SystemTime;

use axum::Form;
use axum::extract::{Query, State};
use axum::response::Response;
use http::StatusCode;
use serde::Deserialize;

use super::Shared;
use super::api::{DEFAULT_LIMIT, log_forgotten, log_resolved};
use super::auth::{Auth, Operator, PageOperator, see_other};
use super::format::{encode, key_page};
use super::html::{self, KeyView, Overview, Viewer};
use super::resolution::FormAsk;
use crate::backend::{Admin, Forgotten, MAX_RECENT, Phased};
use crate::error::Error;
use crate::operations::KeyFilter;
use crate::resolve::Resolved;

/// How many keys of each state, and failing outbox scopes, the overview
/// lists.
const LISTED: u32 = 100;

fn viewer(auth: &Auth, operator: &Operator) -> Viewer {
    Viewer {
        csrf: auth.csrf(operator),
        session: matches!(operator, Operator::Session(_)),
    }
}

/// What a failed read says on the page; the cause goes to the log.
fn said(error: &Error) -> String {
    let cause = std::error::Error::source(error)
        .map(ToString::to_string)
        .unwrap_or_default();
    tracing::error!(%error, cause, "idempotency admin page read failed");
    "the key store failed (the cause is in the service's log)".to_owned()
}

/// What a redirect after a form says.
fn notice(done: Option<&str>) -> Option<&'static str> {
    match done? {
        "resolved" => Some("Resolved: the decision is recorded with the key."),
        "forgotten" => Some("Forgotten: the key's next request runs afresh."),
        _ => None,
    }
}

#[derive(Deserialize)]
pub(super) struct OverviewQuery {
    scope: Option<String>,
    /// Text, as the search form sends it (empty when cleared).
    limit: Option<String>,
    done: Option<String>,
}

/// `GET /admin`.
pub(super) async fn overview<DB: Admin + Phased>(
    PageOperator(operator): PageOperator,
    State(shared): State<Shared<DB>>,
    Query(query): Query<OverviewQuery>,
) -> Response {
    let idem = &shared.idem;
    let scope = query.scope.filter(|scope| !scope.is_empty());
    let limit = query
        .limit
        .and_then(|limit| limit.trim().parse().ok())
        .unwrap_or(DEFAULT_LIMIT)
        .clamp(1, MAX_RECENT);
    let recent = async {
        match &scope {
            Some(scope) => Some(idem.recent(scope, limit).await),
            None => None,
        }
    };
    let (uncertain, in_flight, abandoned, outbox, recent) = tokio::join!(
        idem.keys(KeyFilter::Uncertain, LISTED),
        idem.keys(KeyFilter::InFlight, LISTED),
        idem.keys(KeyFilter::Abandoned, LISTED),
        idem.outbox_status(LISTED),
        recent,
    );
    let view = Overview {
        now: SystemTime::now(),
        notice: notice(query.done.as_deref()),
        uncertain: uncertain.map_err(|e| said(&e)),
        in_flight: in_flight.map_err(|e| said(&e)),
        abandoned: abandoned.map_err(|e| said(&e)),
        search: scope
            .zip(recent)
            .map(|(scope, keys)| (scope, limit, keys.map_err(|e| said(&e)))),
        outbox: outbox.map_err(|e| said(&e)),
        completer: idem.last_completer_pass(),
        relay: idem.last_relay_pass(),
    };
    html::overview(&viewer(&shared.auth, &operator), &view)
}

#[derive(Deserialize)]
pub(super) struct KeyQuery {
    #[serde(default)]
    scope: String,
    #[serde(default)]
    key: String,
    done: Option<String>,
}

/// `GET /admin/key?scope=&key=`.
pub(super) async fn key<DB: Admin + Phased>(
    PageOperator(operator): PageOperator,
    State(shared): State<Shared<DB>>,
    Query(query): Query<KeyQuery>,
) -> Response {
    let viewer = viewer(&shared.auth, &operator);
    if query.key.is_empty() {
        return see_other("/admin");
    }
    let notice = notice(query.done.as_deref());
    match shared.idem.lookup(&query.scope, &query.key).await {
        Ok(Some(info)) => {
            let view = KeyView {
                info: &info,
                now: SystemTime::now(),
                notice,
                refused: None,
            };
            html::key(&viewer, &view, StatusCode::OK)
        }
        Ok(None) => html::no_key(&viewer, &query.scope, &query.key, notice.is_some()),
        Err(error) => {
            said(&error);
            html::store_failed(&viewer)
        }
    }
}

/// The key's page again, saying why `ask` changed nothing.
async fn refused<DB: Admin + Phased>(
    shared: &Shared<DB>,
    viewer: &Viewer,
    status: StatusCode,
    why: String,
    ask: &FormAsk,
) -> Response {
    match shared.idem.lookup(&ask.scope, &ask.key).await {
        Ok(Some(info)) => {
            let view = KeyView {
                info: &info,
                now: SystemTime::now(),
                notice: None,
                refused: Some((why, ask)),
            };
            html::key(viewer, &view, status)
        }
        Ok(None) => html::no_key(viewer, &ask.scope, &ask.key, false),
        Err(error) => {
            said(&error);
            html::store_failed(viewer)
        }
    }
}

/// `POST /admin/key/resolve`: the page's resolve forms.
pub(super) async fn resolve<DB: Admin + Phased>(
    PageOperator(operator): PageOperator,
    State(shared): State<Shared<DB>>,
    Form(ask): Form<FormAsk>,
) -> Response {
    if !shared.auth.csrf_ok(&operator, &ask.csrf) {
        return html::stale_form();
    }
    let viewer = viewer(&shared.auth, &operator);
    let resolution = match ask.resolution() {
        Ok(resolution) => resolution,
        Err(why) => {
            return refused(
                &shared,
                &viewer,
                StatusCode::UNPROCESSABLE_ENTITY,
                why,
                &ask,
            )
            .await;
        }
    };
    let outcome = resolution.outcome();
    match shared.idem.resolve(&ask.scope, &ask.key, resolution).await {
        Ok(Resolved::Resolved) => {
            log_resolved(&ask.scope, &ask.key, outcome);
            see_other(&format!("{}&done=resolved", key_page(&ask.scope, &ask.key)))
        }
        Ok(Resolved::Absent) => html::no_key(&viewer, &ask.scope, &ask.key, false),
        Ok(_) => {
            let why = "The key is not uncertain (any more): it is shown as it is now.".to_owned();
            refused(&shared, &viewer, StatusCode::CONFLICT, why, &ask).await
        }
        Err(Error::InvalidResolution(why)) => {
            refused(
                &shared,
                &viewer,
                StatusCode::UNPROCESSABLE_ENTITY,
                why,
                &ask,
            )
            .await
        }
        Err(error) => {
            said(&error);
            html::store_failed(&viewer)
        }
    }
}

#[derive(Deserialize)]
pub(super) struct ForgetForm {
    #[serde(default)]
    scope: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    csrf: String,
}

/// `POST /admin/key/forget`: the page's forget form.
pub(super) async fn forget<DB: Admin + Phased>(
    PageOperator(operator): PageOperator,
    State(shared): State<Shared<DB>>,
    Form(form): Form<ForgetForm>,
) -> Response {
    if !shared.auth.csrf_ok(&operator, &form.csrf) {
        return html::stale_form();
    }
    let viewer = viewer(&shared.auth, &operator);
    let ask = FormAsk {
        scope: form.scope,
        key: form.key,
        ..FormAsk::default()
    };
    let why = match shared.idem.forget(&ask.scope, &ask.key).await {
        Ok(Forgotten::Deleted) => {
            log_forgotten(&ask.scope, &ask.key);
            let scope = encode(&ask.scope);
            return see_other(&format!("/admin?scope={scope}&done=forgotten"));
        }
        Ok(Forgotten::Absent) => return html::no_key(&viewer, &ask.scope, &ask.key, false),
        Ok(Forgotten::InFlight) => "The key is in flight: forget it once it finishes or expires.",
        Ok(Forgotten::Uncertain) => {
            "The key's outcome is uncertain: resolve it (below) rather than forget it."
        }
        Err(error) => {
            said(&error);
            return html::store_failed(&viewer);
        }
    };
    refused(&shared, &viewer, StatusCode::CONFLICT, why.to_owned(), &ask).await
}
