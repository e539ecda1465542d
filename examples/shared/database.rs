//! The examples' database, from `DATABASE_URL`: `sqlite:...`,
//! `postgres://...` or `mysql://...` (with `--features mysql`); unset, an
//! SQLite file in the current directory. `DATABASE_POOLER=transaction`
//! says the URL is a transaction-mode pooler (PgBouncer): `idem` and the
//! examples' own statements then keep nothing in the session.
//! `IDEM_ENCRYPTION_KEYS` (`id:base64-of-32-bytes`, comma-separated,
//! newest last; unset, nothing is encrypted) seals what `idem` stores.

use std::error::Error;
use std::sync::OnceLock;

use idem::{Backend, Idem, KeyRing, Pooler};

/// `DATABASE_POOLER`: `session` (or unset) or `transaction`.
fn pooler() -> Result<Pooler, String> {
    static POOLER: OnceLock<Result<Pooler, String>> = OnceLock::new();
    POOLER
        .get_or_init(|| match std::env::var("DATABASE_POOLER").as_deref() {
            Err(_) | Ok("" | "session") => Ok(Pooler::Session),
            Ok("transaction") => Ok(Pooler::Transaction),
            Ok(other) => Err(format!(
                "DATABASE_POOLER={other:?}: use `transaction` (a transaction-mode pooler such as \
                 PgBouncer) or `session`"
            )),
        })
        .clone()
}

/// `IDEM_ENCRYPTION_KEYS`: the key ring `idem` seals its stored
/// responses, requests and recovery points with; `None` when unset.
fn key_ring() -> Result<Option<KeyRing>, String> {
    static RING: OnceLock<Result<Option<KeyRing>, String>> = OnceLock::new();
    RING.get_or_init(|| {
        KeyRing::from_env("IDEM_ENCRYPTION_KEYS")
            .map_err(|error| format!("IDEM_ENCRYPTION_KEYS: {error}"))
    })
    .clone()
}

/// Whether the examples' own statements may be prepared and kept by name
/// in the session (sqlx's default): not behind a transaction-mode pooler,
/// which hands each transaction any server session.
pub fn persistent() -> bool {
    pooler() != Ok(Pooler::Transaction)
}

/// `idem` on `pool`, told what sits in front of the database, sealing
/// what it stores when `IDEM_ENCRYPTION_KEYS` is set (checked by
/// [`connect`] first).
pub fn idem<DB: Backend>(pool: &sqlx::Pool<DB>) -> Idem<DB> {
    let idem = Idem::new(pool.clone()).pooler(pooler().unwrap_or_default());
    match key_ring() {
        Ok(Some(ring)) => idem.encryption(ring),
        _ => idem,
    }
}

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
    if pooler()? == Pooler::Transaction {
        tracing::info!("DATABASE_POOLER=transaction: statements keep nothing in the session");
    }
    if let Some(ring) = key_ring()? {
        // The ids only: never a key.
        let ids: Vec<_> = ring.ids().collect();
        tracing::info!(
            ?ids,
            sealing_with = ring.current_id(),
            "IDEM_ENCRYPTION_KEYS: stored values are encrypted"
        );
    }
    // Only the SQLite default file uses them.
    #[cfg(not(feature = "sqlite"))]
    let _ = (default_file, what);
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
        "postgres" | "postgresql" => {
            let mut options: sqlx::postgres::PgConnectOptions =
                url.as_deref().unwrap_or_default().parse()?;
            if pooler()? == Pooler::Transaction {
                // A stock PgBouncer refuses startup parameters it does not
                // track, and sqlx sends `extra_float_digits` by default.
                options = options.extra_float_digits(None);
            }
            Ok(Database::Postgres(
                sqlx::PgPool::connect_with(options).await?,
            ))
        }
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
