//! The examples' database, from `DATABASE_URL`: `sqlite:...`,
//! `postgres://...` or `mysql://...` (with `--features mysql`); unset, an
//! SQLite file in the current directory.

use std::error::Error;

/// A pool on the engine `DATABASE_URL` names.
pub enum Database {
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

/// Connects to `DATABASE_URL`, or, unset, to the SQLite file
/// `default_file` in the current directory (logged as keeping `what`).
pub async fn connect(default_file: &str, what: &str) -> Result<Database, Box<dyn Error>> {
    let url = std::env::var("DATABASE_URL").ok();
    let scheme = url
        .as_deref()
        .map_or("sqlite", |url| url.split(':').next().unwrap_or_default());
    match scheme {
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};
            let options = match &url {
                Some(url) => url.parse::<SqliteConnectOptions>()?,
                None => {
                    let path = std::env::current_dir()?.join(default_file);
                    tracing::info!(
                        "DATABASE_URL is not set: keeping {what} in the SQLite file {}",
                        path.display()
                    );
                    SqliteConnectOptions::new().filename(path)
                }
            };
            // WAL lets readers (replays) read while a write is in progress.
            let options = options
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal);
            Ok(Database::Sqlite(SqlitePool::connect_with(options).await?))
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Database::Postgres(
            sqlx::PgPool::connect(url.as_deref().unwrap_or_default()).await?,
        )),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Ok(Database::MySql(
            sqlx::MySqlPool::connect(url.as_deref().unwrap_or_default()).await?,
        )),
        _ if url.is_none() => {
            Err("DATABASE_URL is not set and this build has no `sqlite` feature".into())
        }
        other => Err(format!(
            "DATABASE_URL scheme {other:?} is not served by this build: use sqlite:, \
             postgres: or mysql: (mysql needs `--features mysql`)"
        )
        .into()),
    }
}
