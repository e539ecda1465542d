//! Whether a server offers transaction-scoped advisory locks to the claim
//! (`sql::CLAIM_TRY`): asked once per server and database, the first time
//! a pool claims a key there.

use std::sync::{Mutex, PoisonError};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Pool, Postgres, Row};

use super::sql::Arg;

/// A server and database, as a pool's options name them.
pub(super) struct Server {
    host: String,
    port: u16,
    database: Option<String>,
}

impl Server {
    pub(super) fn of(options: &PgConnectOptions) -> Self {
        Self {
            host: options.get_host().to_owned(),
            port: options.get_port(),
            database: options.get_database().map(str::to_owned),
        }
    }

    pub(super) fn is(&self, options: &PgConnectOptions) -> bool {
        self.port == options.get_port()
            && self.host == options.get_host()
            && self.database.as_deref() == options.get_database()
    }
}

/// A server and database, and whether it offers advisory locks.
struct Answer {
    server: Server,
    offered: bool,
}

/// The answers so far: a handful at most, looked up on every claim
/// without allocating.
static ANSWERS: Mutex<Vec<Answer>> = Mutex::new(Vec::new());

/// Whether `pool`'s server offers advisory locks, if it has been asked
/// ([`probe`]).
pub(super) fn known(pool: &Pool<Postgres>) -> Option<bool> {
    let options = pool.connect_options();
    answers()
        .iter()
        .find(|answer| answer.server.is(&options))
        .map(|answer| answer.offered)
}

/// Whether `pool`'s server offers advisory locks: as [`known`], else
/// asked ([`probe`]). The probe is boxed: asked once per server, it would
/// otherwise sit in the future of every claim that awaits this.
pub(super) async fn offered(pool: &Pool<Postgres>) -> bool {
    match known(pool) {
        Some(offered) => offered,
        None => Box::pin(probe(pool)).await,
    }
}

/// Asks whether `pool`'s server offers advisory locks, and records the
/// answer: PostgreSQL proper does; CockroachDB (whose advisory lock
/// functions do not exclude) and a server whose `pg_try_advisory_xact_lock`
/// fails do not, and get the portable claim. A probe that could not reach
/// the server answers `false` for this claim only, and is asked again by
/// the next.
pub(super) async fn probe(pool: &Pool<Postgres>) -> bool {
    let options = pool.connect_options();
    // A connection of its own, closed after: the pool's connections and
    // their count stay as the application left them.
    let Ok(mut conn) = PgConnection::connect_with(&options).await else {
        return false;
    };
    // The lock taken is released when the probe's own transaction ends.
    let probe = super::simple(
        "SELECT version() AS version, pg_try_advisory_xact_lock($1)",
        &[Arg::Signed(super::sql::lock_id("", "idem", "probe"))],
    )
    .fetch_one(&mut conn)
    .await
    .and_then(|row| row.try_get::<String, _>("version"));
    let _ = conn.close().await;
    let offered = match probe {
        Ok(version) => !version.contains("CockroachDB"),
        Err(sqlx::Error::Database(error)) => {
            tracing::debug!(%error, "no advisory locks: idem claims without them");
            false
        }
        Err(_) => return false,
    };
    let mut answers = answers();
    if !answers.iter().any(|answer| answer.server.is(&options)) {
        answers.push(Answer {
            server: Server::of(&options),
            offered,
        });
    }
    offered
}

fn answers() -> std::sync::MutexGuard<'static, Vec<Answer>> {
    ANSWERS.lock().unwrap_or_else(PoisonError::into_inner)
}
