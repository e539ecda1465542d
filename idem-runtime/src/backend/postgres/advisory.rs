//! Whether a server offers transaction-scoped advisory locks to the claim
//! (`sql::CLAIM_TRY`): asked once per server and database, the first time
//! a pool claims a key there; and the name a key table's locks are taken
//! under ([`lock_table`]).

use std::sync::{Arc, Mutex, PoisonError};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Pool, Postgres, Row};

use super::sql::Arg;

/// A server and database, and the user and startup options (a search
/// path among them) a pool's sessions have there, as its options name them.
pub(super) struct Server {
    host: String,
    port: u16,
    database: Option<String>,
    user: String,
    options: Option<String>,
}

impl Server {
    pub(super) fn of(options: &PgConnectOptions) -> Self {
        Self {
            host: options.get_host().to_owned(),
            port: options.get_port(),
            database: options.get_database().map(str::to_owned),
            user: options.get_username().to_owned(),
            options: options.get_options().map(str::to_owned),
        }
    }

    pub(super) fn is(&self, options: &PgConnectOptions) -> bool {
        self.port == options.get_port()
            && self.host == options.get_host()
            && self.database.as_deref() == options.get_database()
            && self.user == options.get_username()
            && self.options.as_deref() == options.get_options()
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

/// A key table as a pool names it, and the name its locks are taken under.
struct LockTable {
    server: Server,
    table: String,
    name: Arc<str>,
}

/// The key tables resolved so far: one per bare name and pool's server.
static LOCK_TABLES: Mutex<Vec<LockTable>> = Mutex::new(Vec::new());

/// The name the advisory locks of `table`'s keys are hashed under
/// (`sql::lock_id`). Advisory locks are one space per database, so two
/// key tables of one name in two schemas (a schema per tenant, or per
/// test) must not share it. A `schema.table` name is its own, as written;
/// a bare one carries the schema the server resolves it to in the pool's
/// sessions, except `public`, whose tables keep their bare name (as
/// earlier releases hash every name: a rolling deploy keeps one lock per
/// key). `None` where it must be asked ([`resolve`]).
pub(super) fn known_lock_table(pool: &Pool<Postgres>, table: &str) -> Option<Arc<str>> {
    if table.contains('.') {
        return Some(Arc::from(table));
    }
    let options = pool.connect_options();
    lock_tables()
        .iter()
        .find(|found| found.table == table && found.server.is(&options))
        .map(|found| found.name.clone())
}

/// [`known_lock_table`], asked of the server on `executor` where it must
/// be: a session of `pool`'s (its search path as the claims' own).
pub(super) async fn lock_table<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    pool: &Pool<Postgres>,
    table: &str,
) -> Result<Arc<str>, sqlx::Error> {
    match known_lock_table(pool, table) {
        Some(name) => Ok(name),
        None => resolve(executor, &pool.connect_options(), table).await,
    }
}

/// Asks the server which schema `table` resolves to in `executor`'s
/// session, and records the answer where the table exists (where it does
/// not yet, the name is the schema `migrate()` would create it in, asked
/// again by the next claim).
async fn resolve<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    options: &PgConnectOptions,
    table: &str,
) -> Result<Arc<str>, sqlx::Error> {
    let row = super::simple(
        "SELECT n.nspname::text AS found, current_schema()::text AS current \
         FROM (SELECT 1) AS one LEFT JOIN pg_class c ON c.oid = to_regclass($1) \
         LEFT JOIN pg_namespace n ON n.oid = c.relnamespace",
        &[Arg::Text(table)],
    )
    .fetch_one(executor)
    .await?;
    let found: Option<String> = row.try_get("found")?;
    let Some(schema) = found else {
        let current: Option<String> = row.try_get("current")?;
        return Ok(locked_under(current.as_deref().unwrap_or("public"), table));
    };
    let name = locked_under(&schema, table);
    let mut resolved = lock_tables();
    if !resolved
        .iter()
        .any(|found| found.table == table && found.server.is(options))
    {
        resolved.push(LockTable {
            server: Server::of(options),
            table: table.to_owned(),
            name: name.clone(),
        });
    }
    Ok(name)
}

/// `schema.name`, or `name` alone in `public` (`schema` as the server
/// names it).
fn locked_under(schema: &str, name: &str) -> Arc<str> {
    if schema == "public" {
        Arc::from(name)
    } else {
        Arc::from(format!("{schema}.{name}"))
    }
}

fn lock_tables() -> std::sync::MutexGuard<'static, Vec<LockTable>> {
    LOCK_TABLES.lock().unwrap_or_else(PoisonError::into_inner)
}
