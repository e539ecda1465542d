//! The key table's server-side functions, for claims behind a declared
//! transaction-mode pooler.
//!
//! There the statements cannot be prepared in the session, so each one
//! would be parsed and planned on every request, which costs PostgreSQL
//! more than the rest of the request. PL/pgSQL keeps the plans of the
//! statements inside a function for the session's life, and a function is
//! a schema object, not session state: any server session a pooler hands
//! out may call it. `Idem::migrate` makes them when a pooler is declared;
//! a claim uses them once they are found (asked once per server, database
//! and table; again a minute after they were found missing), and the
//! inlined statements otherwise. (On a direct connection the prepared
//! statements cost less than the calls, which wrap their statement in a
//! second executor: docs/benchmarks.md.)
//!
//! Their names carry a revision, bumped whenever a body changes: an
//! instance of the previous release keeps calling its own during a
//! rolling deploy.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, Pool, Postgres};

use super::advisory::Server;
use super::all_hold;
use super::sql::{FunctionNames as Names, functions_ddl};
use crate::error::Error;

/// A call that cannot be made: `undefined_function` (the function is not
/// there, or not with these arguments) or `insufficient_privilege` (this
/// role may not call it).
pub(super) const UNCALLABLE: [&str; 2] = ["42883", "42501"];

/// Makes `table`'s functions unless all three exist. The `CREATE`s run in
/// one transaction under an advisory lock of their own, so instances
/// migrating at once make them one after the other (concurrent `CREATE OR
/// REPLACE FUNCTION`s of one name can fail each other).
pub(super) async fn create(pool: &Pool<Postgres>, table: &str) -> Result<(), Error> {
    let names = Names::of(table);
    if exist(pool, &names).await? {
        record(pool, table, true);
        return Ok(());
    }
    let ddl = functions_ddl(table, &names);
    sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await?;
    record(pool, table, true);
    Ok(())
}

/// Whether all of `names`' functions exist, with the signatures the calls
/// name, and this role may call them (a database may revoke `EXECUTE` from
/// the roles that did not make them).
async fn exist(pool: &Pool<Postgres>, names: &Names) -> Result<bool, sqlx::Error> {
    let procedures = names.procedures();
    let procedures: Vec<&str> = procedures.iter().map(String::as_str).collect();
    let check = "coalesce(has_function_privilege(to_regprocedure($), 'EXECUTE'), false)";
    all_hold(pool, check, &procedures).await
}

/// A server, database and table, and whether the table's functions exist.
struct Answer {
    server: Server,
    table: String,
    found: bool,
    asked: Instant,
}

impl Answer {
    fn is(&self, options: &PgConnectOptions, table: &str) -> bool {
        self.table == table && self.server.is(options)
    }
}

/// How long a claim trusts that the functions are missing before it asks
/// again: another instance's migration may make them after this process
/// started.
const ASK_AGAIN: Duration = Duration::from_secs(60);

/// The answers so far: a handful at most.
static ANSWERS: Mutex<Vec<Answer>> = Mutex::new(Vec::new());

fn answers() -> std::sync::MutexGuard<'static, Vec<Answer>> {
    ANSWERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `table`'s functions exist on `pool`'s server, if known (that
/// they are missing, for [`ASK_AGAIN`] after it was asked).
pub(super) fn known(pool: &Pool<Postgres>, table: &str) -> Option<bool> {
    let options = pool.connect_options();
    answers()
        .iter()
        .find(|answer| answer.is(&options, table))
        .filter(|answer| answer.found || answer.asked.elapsed() < ASK_AGAIN)
        .map(|answer| answer.found)
}

/// Makes the answer for `table` as old as [`ASK_AGAIN`].
#[cfg(test)]
pub(super) fn age(pool: &Pool<Postgres>, table: &str) {
    let options = pool.connect_options();
    for answer in answers()
        .iter_mut()
        .filter(|answer| answer.is(&options, table))
    {
        answer.asked = Instant::now()
            .checked_sub(ASK_AGAIN)
            .expect("a clock past a minute");
    }
}

/// Whether `table`'s functions exist on `pool`'s server: as [`known`],
/// else asked ([`probe`], boxed as `advisory::offered`'s probe).
pub(super) async fn found(pool: &Pool<Postgres>, table: &str) -> bool {
    match known(pool, table) {
        Some(found) => found,
        None => Box::pin(probe(pool, table)).await,
    }
}

/// Asks whether `table`'s functions exist, and records the answer. A
/// question that fails answers `false` for this claim only.
async fn probe(pool: &Pool<Postgres>, table: &str) -> bool {
    match exist(pool, &Names::of(table)).await {
        Ok(found) => {
            record(pool, table, found);
            found
        }
        Err(error) => {
            tracing::debug!(%error, "idem's functions not looked up; inlining its statements");
            false
        }
    }
}

/// Forgets what was known of `table`'s functions (a call found one
/// missing): the next claim asks again.
pub(super) fn forget(pool: &Pool<Postgres>, table: &str) {
    let options = pool.connect_options();
    answers().retain(|answer| !answer.is(&options, table));
}

fn record(pool: &Pool<Postgres>, table: &str, found: bool) {
    let options = pool.connect_options();
    let mut answers = answers();
    match answers.iter_mut().find(|answer| answer.is(&options, table)) {
        Some(answer) => {
            answer.found = found;
            answer.asked = Instant::now();
        }
        None => answers.push(Answer {
            server: Server::of(&options),
            table: table.to_owned(),
            found,
            asked: Instant::now(),
        }),
    }
}
