//! The service under test, per engine: `POST /emails` sends a receipt
//! through the outbox in the request's transaction, and fails (rolling
//! back) when asked to; `POST /phased-emails` sends it from a phased
//! handler's local phase (`"phase": "local"`) or its last phase
//! (`"phase": "last"`), through the phases' outbox writer.

use std::future::Future;

use axum::Router;
use idem::Idem;

/// What each engine's handler module provides.
pub trait OutboxDb: idem_tests::phased::PhasedDb {
    /// `POST /emails` and `POST /phased-emails` on `idem`.
    fn outbox_router(idem: Idem<Self>) -> Router;
    /// Runs `sql` (statements without parameters).
    fn run(
        pool: &sqlx::Pool<Self>,
        sql: String,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Inserts ledger row `id` into `table` on `conn`.
    fn insert_ledger(
        conn: &mut Self::Connection,
        table: &str,
        id: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// How many rows `table` has.
    fn count(pool: &sqlx::Pool<Self>, table: &str) -> impl Future<Output = i64> + Send;
}

macro_rules! handlers {
    ($($module:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            mod $module {
                use axum::Json;
                use axum::http::StatusCode;
                use axum::response::{IntoResponse, Response};
                use axum::routing::post;
                use idem::{Idem, Phases, Tx, idempotent};
                use idem_tests::account::Account;
                use serde_json::{Value, json};

                #[idempotent(scope = "account")]
                async fn send(
                    account: Account,
                    mut tx: Tx<$db>,
                    Json(email): Json<Value>,
                ) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
                    let payload = json!({ "to": email["to"], "n": email["n"], "account": account.0 });
                    let id = tx
                        .outbox("email.receipt", &payload)
                        .await
                        .map_err(|error| (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
                    if email["fail"] == json!(true) {
                        // An `Err` rolls the transaction back, the message with it.
                        return Err((StatusCode::CONFLICT, "refused".into()));
                    }
                    Ok((StatusCode::CREATED, Json(json!({ "message": id }))))
                }

                #[idempotent(scope = "account", lease = "30s")]
                async fn send_phased(
                    account: Account,
                    mut phases: Phases<$db>,
                    Json(email): Json<Value>,
                ) -> Result<(StatusCode, Json<Value>), Response> {
                    let outbox = phases.outbox();
                    let payload = json!({ "to": email["to"], "n": email["n"], "account": account.0 });
                    let failed = |error: idem::Error| {
                        (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
                    };
                    let id: String = if email["phase"] == json!("last") {
                        let tx = phases.last_phase().await?;
                        outbox
                            .write(tx, "email.receipt", &payload)
                            .await
                            .map_err(failed)?
                    } else {
                        phases
                            .local("email", async |tx| -> Result<String, Response> {
                                outbox
                                    .write(tx, "email.receipt", &payload)
                                    .await
                                    .map_err(failed)
                            })
                            .await?
                    };
                    Ok((StatusCode::CREATED, Json(json!({ "message": id }))))
                }

                impl super::OutboxDb for $db {
                    fn outbox_router(idem: Idem<$db>) -> axum::Router {
                        axum::Router::new()
                            .route("/emails", post(send))
                            .route("/phased-emails", post(send_phased))
                            .with_state(idem)
                    }

                    async fn run(pool: &sqlx::Pool<$db>, sql: String) -> Result<(), sqlx::Error> {
                        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.map(drop)
                    }

                    async fn insert_ledger(
                        conn: &mut <$db as sqlx::Database>::Connection,
                        table: &str,
                        id: &str,
                    ) -> Result<(), sqlx::Error> {
                        let placeholder = if <$db as idem_tests::service::TestDb>::ENGINE == "mysql" { "?" } else { "$1" };
                        let sql = format!("INSERT INTO {table} (id) VALUES ({placeholder})");
                        sqlx::query(sqlx::AssertSqlSafe(sql))
                            .bind(id)
                            .persistent(idem_tests::service::persistent())
                            .execute(conn)
                            .await
                            .map(drop)
                    }

                    async fn count(pool: &sqlx::Pool<$db>, table: &str) -> i64 {
                        let sql = format!("SELECT COUNT(*) FROM {table}");
                        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap();
                        sqlx::Row::get(&row, 0)
                    }
                }
            }
        )*
    };
}

handlers!(
    postgres: sqlx::Postgres, feature = "postgres";
    sqlite: sqlx::Sqlite, feature = "sqlite";
    mysql: sqlx::MySql, feature = "mysql";
);
