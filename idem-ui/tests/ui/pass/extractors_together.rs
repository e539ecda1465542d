//! A handler using State, Path, Query, HeaderMap and Json together, routed
//! in a concrete `Router<AppState>` and in a generic `Router<S>`.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use std::collections::HashMap;

use axum::Json;
use axum::Router;
use axum::extract::{FromRef, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use idem::{Idem, Tx, idempotent};
use serde::Deserialize;
use sqlx::{PgPool, Postgres};
use support::{Account, AppState};

#[derive(Deserialize)]
struct Paging {
    dry_run: Option<bool>,
}

#[derive(Deserialize)]
struct NewNote {
    text: String,
}

#[idempotent(scope = "account")]
async fn create_note(
    State(pool): State<PgPool>,
    Path(book): Path<i64>,
    Query(paging): Query<Paging>,
    headers: HeaderMap,
    account: Account,
    mut tx: Tx<Postgres>,
    Json(note): Json<NewNote>,
) -> Result<(StatusCode, Json<HashMap<String, String>>), StatusCode> {
    let _ = (&pool, paging.dry_run, headers.len());
    sqlx::query("INSERT INTO notes (account, book, text) VALUES ($1, $2, $3)")
        .bind(&account.0)
        .bind(book)
        .bind(&note.text)
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(HashMap::new())))
}

fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    Idem<Postgres>: FromRef<S>,
    PgPool: FromRef<S>,
{
    Router::new().route("/books/{book}/notes", post(create_note))
}

fn main() {
    let _concrete: Router<AppState> = Router::new().route("/notes/{book}", post(create_note));
    let _generic: Router<AppState> = routes();
}
