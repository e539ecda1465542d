//! PostgreSQL behind [`PgProxy`].

use axum::response::{IntoResponse, Response};
use idem::{Tx, idempotent};
use sqlx::{PgConnection, Postgres};

use super::Proxied;
use crate::account::Account;
use crate::engines::postgres as engine;
use crate::pg_proxy::PgProxy;
use crate::round_trip_service::{Charge, RoundTripState};

crate::round_trip_app!(sqlx::Postgres, "/lock_timeout" => lock_timeout);

/// What `lock_timeout` the handler's own statements run under.
#[idempotent(scope = "account", wait = "0ms")]
async fn lock_timeout(account: Account, mut tx: Tx<Postgres>) -> Response {
    let _ = account;
    match sqlx::query_scalar::<_, String>("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
    {
        Ok(value) => (axum::http::StatusCode::OK, value).into_response(),
        Err(error) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            error.to_string(),
        )
            .into_response(),
    }
}

impl Proxied for Postgres {
    type Proxy = PgProxy;
    const SCHEME: &'static str = "postgres";
    const PLAIN_TCP: &'static str = "sslmode=disable";
    const QUEUED_ROLLBACK_ROUND_TRIPS: u64 = 0;
    const PING: &'static str = "SYNC";
    // The claim's statements fail on the taken key; the next round trip
    // ends the transaction and reads the row.
    const TAKEN_KEY_READ: &'static str = "QUERY ROLLBACK; EXECUTE";
    const SELECT_PARAMETER: &'static str = "SELECT $1::int";
    const CHARGES_DDL: &'static str = "CREATE TABLE {table} (id bigserial PRIMARY KEY, \
         account text NOT NULL, amount bigint NOT NULL)";
    const EFFECTS_OF_KEY: &'static str = "SELECT id, nonce FROM idem_service_effects \
         WHERE scope = $1 AND key = $2 ORDER BY id";
    const STORED: &'static str = "SELECT status, body FROM idem_keys WHERE scope = $1 AND key = $2";
    const ORPHANS: &'static str = "SELECT
           (SELECT count(*) FROM idem_service_effects e WHERE e.scope = $1 AND NOT EXISTS
              (SELECT 1 FROM idem_keys k
               WHERE k.scope = e.scope AND k.key = convert_to(e.key, 'UTF8'))),
           (SELECT count(*) FROM idem_keys k WHERE k.scope = $2 AND NOT EXISTS
              (SELECT 1 FROM idem_service_effects e
               WHERE e.scope = k.scope AND convert_to(e.key, 'UTF8') = k.key)),
           (SELECT count(*) FROM idem_keys k WHERE k.scope = $3 AND k.status IS NULL)";
    const DUPLICATES: &'static str =
        "SELECT count(*) - count(DISTINCT key) FROM idem_service_effects WHERE scope = $1";

    crate::proxied_common!(engine, sqlx::postgres::PgConnectOptions, PgProxy);

    async fn charge(
        conn: &mut PgConnection,
        table: &str,
        account: &str,
        charge: &Charge,
    ) -> Result<i64, sqlx::Error> {
        let sql = format!("INSERT INTO {table} (account, amount) VALUES ($1, $2) RETURNING id");
        let mut id = 0;
        for _ in 0..charge.statements {
            id = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
                .bind(account)
                .bind(charge.amount)
                .fetch_one(&mut *conn)
                .await?;
        }
        Ok(id)
    }

    fn round_trip_router(state: RoundTripState<Self>) -> axum::Router {
        round_trip_handlers::router(state)
    }
}
