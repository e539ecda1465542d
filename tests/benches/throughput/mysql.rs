//! The same service on MariaDB (10.5+: the handlers' inserts use
//! `RETURNING`), in a database of its own (`idem_bench` in the benchmark's
//! URL): its pool and its tables. Its handlers are PostgreSQL's, stamped
//! out for it in `handlers`, with the SQL of its `Dialect`.

use std::str::FromStr;

use idem::Idem;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Connection, MySqlConnection, MySqlPool};

use crate::app::{ACCOUNTS, KEYS_TABLE};

/// The server's pool of `size` connections on `url`.
pub async fn connect(url: &str, size: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .connect(url)
        .await
        .unwrap_or_else(|error| panic!("MariaDB is required at {url}: {error}"))
}

/// Creates the database `url` names if it is missing, and in it the
/// tables, anew: every run starts alike. Only the benchmark's own tables
/// are dropped, so `url` may name a shared database.
pub async fn setup(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let options = MySqlConnectOptions::from_str(url)?;
    let database = options
        .get_database()
        .ok_or_else(|| format!("{url} names no database"))?
        .to_owned();
    // Inlined into the DDL below: an identifier, nothing to quote.
    if !database
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(format!("database name {database:?}: letters, digits and _ only").into());
    }
    // The database may not exist yet: connect to one that always does.
    let mut server =
        MySqlConnection::connect_with(&options.clone().database("information_schema")).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE DATABASE IF NOT EXISTS `{database}`"
    )))
    .execute(&mut server)
    .await?;
    server.close().await?;

    let pool = connect(url, 1).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS bench_charges, bench_accounts, bench_ledger, bench_two_phase_keys,
            bench_payments, {KEYS_TABLE}"
    )))
    .execute(&pool)
    .await?;
    Idem::new(pool.clone()).table(KEYS_TABLE)?.migrate().await?;
    let accounts: Vec<String> = (0..ACCOUNTS).map(|i| format!("('c{i}')")).collect();
    // The two-phase scope and key are binary, as in the runtime's table:
    // compared byte for byte, as PostgreSQL's `text` is.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE bench_charges (
            id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
            amount BIGINT NOT NULL, currency VARCHAR(255) NOT NULL,
            created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB;
         CREATE TABLE bench_accounts (
            account VARCHAR(255) PRIMARY KEY, balance BIGINT NOT NULL DEFAULT 0,
            charges BIGINT NOT NULL DEFAULT 0) ENGINE = InnoDB;
         CREATE TABLE bench_ledger (
            id BIGINT AUTO_INCREMENT PRIMARY KEY, charge_id BIGINT NOT NULL,
            account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB;
         CREATE TABLE bench_two_phase_keys (
            scope VARBINARY(255) NOT NULL, `key` VARBINARY(255) NOT NULL,
            fingerprint VARBINARY(32) NOT NULL, status SMALLINT NULL, body LONGBLOB NULL,
            expires_at DATETIME(6) NOT NULL, PRIMARY KEY (scope, `key`)) ENGINE = InnoDB;
         CREATE TABLE bench_payments (
            id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
            amount BIGINT NOT NULL, currency VARCHAR(255) NOT NULL,
            status VARCHAR(16) NOT NULL, provider_id VARCHAR(255) NULL) ENGINE = InnoDB;
         INSERT INTO bench_accounts (account) VALUES {};",
        accounts.join(", ")
    )))
    .execute(&pool)
    .await?;
    pool.close().await;
    Ok(())
}
