//! The charges example's SQL, once per engine: what differs
//! between PostgreSQL, SQLite and MySQL (placeholders, column types, how
//! an insert returns its id). The handlers in `charges.rs` are generic over
//! [`Sql`] and never name an engine.
//!
//! Every statement binds with `persistent(database::persistent())`: behind a
//! transaction-mode pooler it is not kept by name in the session.

use std::future::Future;

use crate::database::persistent;
use crate::{Charge, NewCharge, Payment};

/// The API's tables and statements on one engine, each run on the
/// connection it is given (the request's transaction, or a phase's).
pub(crate) trait Sql: idem::Phased + idem::Admin {
    /// Creates the `charges` and `payments` tables if they are missing.
    fn create_tables(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Inserts the account's charge and returns its id.
    fn insert_charge(
        conn: &mut Self::Connection,
        account: &str,
        charge: &NewCharge,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// The account's charge `id`, if it has one.
    fn select_charge(
        conn: &mut Self::Connection,
        account: &str,
        id: i64,
    ) -> impl Future<Output = Result<Option<Charge>, sqlx::Error>> + Send;

    /// Inserts the account's payment, `pending`, and returns its id.
    fn insert_payment(
        conn: &mut Self::Connection,
        account: &str,
        payment: &NewCharge,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// Marks payment `id` succeeded, charged by the provider as `provider_id`.
    fn mark_paid(
        conn: &mut Self::Connection,
        id: i64,
        provider_id: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The account's payment `id`, if it has one.
    fn select_payment(
        conn: &mut Self::Connection,
        account: &str,
        id: i64,
    ) -> impl Future<Output = Result<Option<Payment>, sqlx::Error>> + Send;
}

/// A charge's columns, as selected.
type ChargeRow = (i64, i64, String);
/// A payment's columns, as selected.
type PaymentRow = (i64, i64, String, String, Option<String>);

fn charge((id, amount, currency): ChargeRow) -> Charge {
    Charge {
        id,
        amount,
        currency,
    }
}

fn payment((id, amount, currency, status, provider_id): PaymentRow) -> Payment {
    Payment {
        id,
        amount,
        currency,
        status,
        provider_id,
    }
}

#[cfg(feature = "postgres")]
impl Sql for sqlx::Postgres {
    async fn create_tables(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (
                id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
                currency text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&mut *conn)
        .await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS payments (
                id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL,
                currency text NOT NULL, status text NOT NULL, provider_id text,
                created_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn insert_charge(
        conn: &mut sqlx::PgConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO charges (account, amount, currency) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(account)
        .bind(charge.amount)
        .bind(&charge.currency)
        .persistent(persistent())
        .fetch_one(conn)
        .await
    }

    async fn select_charge(
        conn: &mut sqlx::PgConnection,
        account: &str,
        id: i64,
    ) -> Result<Option<Charge>, sqlx::Error> {
        let row: Option<ChargeRow> = sqlx::query_as(
            "SELECT id, amount, currency FROM charges WHERE id = $1 AND account = $2",
        )
        .bind(id)
        .bind(account)
        .persistent(persistent())
        .fetch_optional(conn)
        .await?;
        Ok(row.map(charge))
    }

    async fn insert_payment(
        conn: &mut sqlx::PgConnection,
        account: &str,
        payment: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO payments (account, amount, currency, status) \
             VALUES ($1, $2, $3, 'pending') RETURNING id",
        )
        .bind(account)
        .bind(payment.amount)
        .bind(&payment.currency)
        .persistent(persistent())
        .fetch_one(conn)
        .await
    }

    async fn mark_paid(
        conn: &mut sqlx::PgConnection,
        id: i64,
        provider_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE payments SET status = 'succeeded', provider_id = $1 WHERE id = $2")
            .bind(provider_id)
            .bind(id)
            .persistent(persistent())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn select_payment(
        conn: &mut sqlx::PgConnection,
        account: &str,
        id: i64,
    ) -> Result<Option<Payment>, sqlx::Error> {
        let row: Option<PaymentRow> = sqlx::query_as(
            "SELECT id, amount, currency, status, provider_id \
             FROM payments WHERE id = $1 AND account = $2",
        )
        .bind(id)
        .bind(account)
        .persistent(persistent())
        .fetch_optional(conn)
        .await?;
        Ok(row.map(payment))
    }
}

#[cfg(feature = "sqlite")]
impl Sql for sqlx::Sqlite {
    async fn create_tables(conn: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (
                id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, amount INTEGER NOT NULL,
                currency TEXT NOT NULL, created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
        )
        .execute(&mut *conn)
        .await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS payments (
                id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, amount INTEGER NOT NULL,
                currency TEXT NOT NULL, status TEXT NOT NULL, provider_id TEXT,
                created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn insert_charge(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO charges (account, amount, currency) VALUES (?, ?, ?) RETURNING id",
        )
        .bind(account)
        .bind(charge.amount)
        .bind(&charge.currency)
        .persistent(persistent())
        .fetch_one(conn)
        .await
    }

    async fn select_charge(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        id: i64,
    ) -> Result<Option<Charge>, sqlx::Error> {
        let row: Option<ChargeRow> =
            sqlx::query_as("SELECT id, amount, currency FROM charges WHERE id = ? AND account = ?")
                .bind(id)
                .bind(account)
                .persistent(persistent())
                .fetch_optional(conn)
                .await?;
        Ok(row.map(charge))
    }

    async fn insert_payment(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        payment: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO payments (account, amount, currency, status) \
             VALUES (?, ?, ?, 'pending') RETURNING id",
        )
        .bind(account)
        .bind(payment.amount)
        .bind(&payment.currency)
        .persistent(persistent())
        .fetch_one(conn)
        .await
    }

    async fn mark_paid(
        conn: &mut sqlx::SqliteConnection,
        id: i64,
        provider_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE payments SET status = 'succeeded', provider_id = ? WHERE id = ?")
            .bind(provider_id)
            .bind(id)
            .persistent(persistent())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn select_payment(
        conn: &mut sqlx::SqliteConnection,
        account: &str,
        id: i64,
    ) -> Result<Option<Payment>, sqlx::Error> {
        let row: Option<PaymentRow> = sqlx::query_as(
            "SELECT id, amount, currency, status, provider_id \
             FROM payments WHERE id = ? AND account = ?",
        )
        .bind(id)
        .bind(account)
        .persistent(persistent())
        .fetch_optional(conn)
        .await?;
        Ok(row.map(payment))
    }
}

#[cfg(feature = "mysql")]
impl Sql for sqlx::MySql {
    async fn create_tables(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (
                id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
                amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL,
                created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
        )
        .execute(&mut *conn)
        .await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS payments (
                id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(255) NOT NULL,
                amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL, status VARCHAR(16) NOT NULL,
                provider_id VARCHAR(64) NULL,
                created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn insert_charge(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        charge: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        // MySQL has no `INSERT ... RETURNING`; the id comes with the result.
        let done = sqlx::query("INSERT INTO charges (account, amount, currency) VALUES (?, ?, ?)")
            .bind(account)
            .bind(charge.amount)
            .bind(&charge.currency)
            .persistent(persistent())
            .execute(conn)
            .await?;
        i64::try_from(done.last_insert_id()).map_err(|error| sqlx::Error::Decode(error.into()))
    }

    async fn select_charge(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        id: i64,
    ) -> Result<Option<Charge>, sqlx::Error> {
        let row: Option<ChargeRow> =
            sqlx::query_as("SELECT id, amount, currency FROM charges WHERE id = ? AND account = ?")
                .bind(id)
                .bind(account)
                .persistent(persistent())
                .fetch_optional(conn)
                .await?;
        Ok(row.map(charge))
    }

    async fn insert_payment(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        payment: &NewCharge,
    ) -> Result<i64, sqlx::Error> {
        let done = sqlx::query(
            "INSERT INTO payments (account, amount, currency, status) VALUES (?, ?, ?, 'pending')",
        )
        .bind(account)
        .bind(payment.amount)
        .bind(&payment.currency)
        .persistent(persistent())
        .execute(conn)
        .await?;
        i64::try_from(done.last_insert_id()).map_err(|error| sqlx::Error::Decode(error.into()))
    }

    async fn mark_paid(
        conn: &mut sqlx::MySqlConnection,
        id: i64,
        provider_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE payments SET status = 'succeeded', provider_id = ? WHERE id = ?")
            .bind(provider_id)
            .bind(id)
            .persistent(persistent())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn select_payment(
        conn: &mut sqlx::MySqlConnection,
        account: &str,
        id: i64,
    ) -> Result<Option<Payment>, sqlx::Error> {
        let row: Option<PaymentRow> = sqlx::query_as(
            "SELECT id, amount, currency, status, provider_id \
             FROM payments WHERE id = ? AND account = ?",
        )
        .bind(id)
        .bind(account)
        .persistent(persistent())
        .fetch_optional(conn)
        .await?;
        Ok(row.map(payment))
    }
}
