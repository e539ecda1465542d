//! MySQL/MariaDB behind [`MySqlProxy`].

use sqlx::{MySql, MySqlConnection};

use super::Proxied;
use crate::engines::mysql as engine;
use crate::mysql_proxy::MySqlProxy;
use crate::round_trip_service::{Charge, RoundTripState};

crate::round_trip_app!(sqlx::MySql);

impl Proxied for MySql {
    type Proxy = MySqlProxy;
    const SCHEME: &'static str = "mysql";
    const PLAIN_TCP: &'static str = "ssl-mode=disabled";
    const QUEUED_ROLLBACK_ROUND_TRIPS: u64 = 1;
    const PING: &'static str = "PING";
    // The claim batch stops inside its transaction on the taken key (error
    // 1690); one more round trip reads the row `FOR UPDATE` and ends it.
    const TAKEN_KEY_READ: &'static str = "QUERY SELECT status";
    const SELECT_PARAMETER: &'static str = "SELECT ?";
    const CHARGES_DDL: &'static str = "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB";
    const EFFECTS_OF_KEY: &'static str = "SELECT id, nonce FROM idem_service_effects \
         WHERE scope = ? AND `key` = ? ORDER BY id";
    const STORED: &'static str = "SELECT status, body FROM idem_keys WHERE scope = ? AND `key` = ?";
    const ORPHANS: &'static str = "SELECT
           (SELECT COUNT(*) FROM idem_service_effects e WHERE e.scope = ? AND NOT EXISTS
              (SELECT 1 FROM idem_keys k
               WHERE k.scope = e.scope AND k.`key` = CAST(e.`key` AS BINARY))),
           (SELECT COUNT(*) FROM idem_keys k WHERE k.scope = ? AND NOT EXISTS
              (SELECT 1 FROM idem_service_effects e
               WHERE e.scope = k.scope AND CAST(e.`key` AS BINARY) = k.`key`)),
           (SELECT COUNT(*) FROM idem_keys k WHERE k.scope = ? AND k.status IS NULL)";
    const DUPLICATES: &'static str = "SELECT CAST(COUNT(*) - COUNT(DISTINCT `key`) AS SIGNED) \
         FROM idem_service_effects WHERE scope = ?";

    crate::proxied_common!(engine, sqlx::mysql::MySqlConnectOptions, MySqlProxy);

    async fn charge(
        conn: &mut MySqlConnection,
        table: &str,
        account: &str,
        charge: &Charge,
    ) -> Result<i64, sqlx::Error> {
        let sql = format!("INSERT INTO {table} (account, amount) VALUES (?, ?)");
        let mut id = 0;
        for _ in 0..charge.statements {
            id = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(account)
                .bind(charge.amount)
                .execute(&mut *conn)
                .await?
                .last_insert_id();
        }
        Ok(i64::try_from(id).expect("an id in range"))
    }

    fn round_trip_router(state: RoundTripState<Self>) -> axum::Router {
        round_trip_handlers::router(state)
    }
}
