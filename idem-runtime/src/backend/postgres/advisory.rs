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
    let Some(mut conn) = own_connection(&options).await else {
        return false;
    };
    let offered = probe_on(&mut conn, &options).await;
    let _ = conn.close().await;
    offered.unwrap_or(false)
}

/// A connection of its own, closed after: the pool's connections and their
/// count stay as the application left them.
async fn own_connection(options: &PgConnectOptions) -> Option<PgConnection> {
    PgConnection::connect_with(options).await.ok()
}

/// [`probe`] on `conn`; `None` where the connection failed.
async fn probe_on(conn: &mut PgConnection, options: &PgConnectOptions) -> Option<bool> {
    // The lock taken is released when the probe's own transaction ends.
    let probe = super::simple(
        "SELECT version() AS version, pg_try_advisory_xact_lock($1)",
        &[Arg::Signed(super::sql::lock_id("", "idem", "probe"))],
    )
    .fetch_one(&mut *conn)
    .await
    .and_then(|row| row.try_get::<String, _>("version"));
    let offered = match probe {
        Ok(version) => !version.contains("CockroachDB"),
        Err(sqlx::Error::Database(error)) => {
            tracing::debug!(%error, "no advisory locks: idem claims without them");
            false
        }
        Err(_) => return None,
    };
    let mut answers = answers();
    if !answers.iter().any(|answer| answer.server.is(options)) {
        answers.push(Answer {
            server: Server::of(options),
            offered,
        });
    }
    Some(offered)
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

/// The key tables resolved so far: one per table and pool's server.
static LOCK_TABLES: Mutex<Vec<LockTable>> = Mutex::new(Vec::new());

/// The name the advisory locks of `table`'s keys are hashed under
/// (`sql::lock_id`). Advisory locks are one space per database, so two
/// key tables of one name in two schemas (a schema per tenant, or per
/// test) must not share it: the name carries the table's schema, except
/// `public`'s, whose tables keep their bare name (the locks instances of
/// earlier releases take during a rolling deploy). A `schema.table` name
/// says its schema; a bare one is resolved by the server as its
/// statements resolve it, once per table and [`Server`] (the schema that
/// holds the table; where none does yet, the one `migrate()` creates it
/// in, asked again by the next claim).
pub(super) async fn lock_table(
    pool: &Pool<Postgres>,
    table: &str,
) -> Result<Arc<str>, sqlx::Error> {
    match known_lock_table(pool, table) {
        Some(name) => Ok(name),
        None => resolve(pool, &pool.connect_options(), table).await,
    }
}

/// Where `pool`'s server offers advisory locks ([`offered`]), the name
/// `table`'s are taken under ([`lock_table`]), `None` where it does not;
/// itself `None` where either is yet to be asked
/// ([`ask_offered_lock_table`]).
pub(super) fn known_offered_lock_table(
    pool: &Pool<Postgres>,
    table: &str,
) -> Option<Option<Arc<str>>> {
    match known(pool)? {
        false => Some(None),
        true => known_lock_table(pool, table).map(Some),
    }
}

/// [`known_offered_lock_table`], asking the server what it does not know,
/// on one connection of its own (as [`probe`]). Where the server cannot be
/// asked, this claim goes without advisory locks, as a failed probe's.
pub(super) async fn ask_offered_lock_table(pool: &Pool<Postgres>, table: &str) -> Option<Arc<str>> {
    let options = pool.connect_options();
    let mut conn = own_connection(&options).await?;
    let offered = match known(pool) {
        Some(offered) => Some(offered),
        None => probe_on(&mut conn, &options).await,
    };
    let name = match offered {
        Some(true) => resolve(&mut conn, &options, table).await.ok(),
        _ => None,
    };
    let _ = conn.close().await;
    name
}

/// [`lock_table`] without asking the server, where that is not needed.
fn known_lock_table(pool: &Pool<Postgres>, table: &str) -> Option<Arc<str>> {
    if let Some((schema, name)) = table.split_once('.') {
        return Some(locked_under(&schema.to_ascii_lowercase(), name));
    }
    let options = pool.connect_options();
    lock_tables()
        .iter()
        .find(|found| found.table == table && found.server.is(&options))
        .map(|found| found.name.clone())
}

/// Asks the server (on `executor`, a session of `options`) which schema
/// `table` resolves to, and records the answer where the table exists.
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

/// `schema.name`, or `name` alone in `public`. `schema` as the server
/// names it; a configured `schema.table` is an unquoted identifier, which
/// the server folds to lower case ([`known_lock_table`] folds it first).
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
