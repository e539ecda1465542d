//! PostgreSQL: the claim rides on the transaction's `BEGIN`, the stored
//! response on its `COMMIT`, so a first attempt costs no extra round trip.
//!
//! sqlx has no pipelining, but the simple query protocol runs several
//! statements in one round trip. Those statements cannot take bind
//! parameters, so every value is inlined as hex (`E'\\x..'`) or
//! as an integer we formatted: no client-controlled character reaches SQL.
//! Only statements PostgreSQL, CockroachDB and YugabyteDB all run are used.
//!
//! The statements themselves are SQL-level prepared statements, prepared
//! once per connection and run with `EXECUTE`, so the server does not parse
//! and plan them per request. Where a session cannot keep them (a
//! transaction-mode pooler), the same statements run with inlined
//! arguments.

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Column, Pool, Postgres, Row};

use super::{Backend, Claim, ClaimOutcome, Failure, OpenTx, push_hex};
use crate::Error;
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

impl super::sealed::Sealed for Postgres {}

const LOCK_NOT_AVAILABLE: &str = "55P03";
const UNIQUE_VIOLATION: &str = "23505";
const DUPLICATE_TABLE: &str = "42P07";
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";
/// `invalid_sql_statement_name`: `EXECUTE` of a statement this session has
/// not prepared.
const UNDEFINED_STATEMENT: &str = "26000";
/// `duplicate_prepared_statement`.
const DUPLICATE_STATEMENT: &str = "42P05";

/// How many statements a claim runs, reading again a row that committed
/// after its snapshot, vanished (swept) or was taken over, before giving up
/// with a store error.
const SETTLE_ATTEMPTS: usize = 4;

impl Backend for Postgres {
    async fn migrate(pool: &Pool<Self>, table: &str) -> Result<(), Error> {
        let index = format!(
            "{}_expires_at_idx",
            table.rsplit('.').next().unwrap_or(table)
        );
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                scope bytea NOT NULL,
                key bytea NOT NULL,
                fingerprint bytea NOT NULL,
                status smallint,
                headers bytea,
                body bytea,
                created_at timestamptz NOT NULL DEFAULT now(),
                expires_at timestamptz NOT NULL,
                PRIMARY KEY (scope, key)
            );
            CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);"
        );
        // `CREATE INDEX IF NOT EXISTS` takes a SHARE lock on the table before
        // it looks for the index: on a live table it would wait for every
        // open claim and queue every new claim behind it. The catalog read
        // locks nothing, so a migrated table costs a start-up nothing.
        let qualified_index = match table.rsplit_once('.') {
            Some((schema, _)) => format!("{schema}.{index}"),
            None => index.clone(),
        };
        let migrated: bool = sqlx::query_scalar(
            "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL",
        )
        .bind(table)
        .bind(&qualified_index)
        .fetch_one(pool)
        .await?;
        if migrated {
            return Ok(());
        }
        // Two services migrating at once can both pass `IF NOT EXISTS` and
        // collide in the catalog; the loser's retry then finds the table.
        for attempt in 0.. {
            match sqlx::raw_sql(AssertSqlSafe(ddl.clone()))
                .execute(pool)
                .await
            {
                Ok(_) => return Ok(()),
                Err(error)
                    if attempt < 3 && has_code(&error, &[UNIQUE_VIOLATION, DUPLICATE_TABLE]) =>
                {
                    continue;
                }
                Err(error) => return Err(error.into()),
            }
        }
        unreachable!()
    }

    async fn claim(
        pool: &Pool<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        let row = ClaimRow::new(table, claim);
        super::claim_with_retries(
            pool,
            PgClaim {
                row,
                wait: claim.wait,
            },
        )
        .await
    }

    async fn peek(
        pool: &Pool<Self>,
        table: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome<Self>>, sqlx::Error> {
        // An ordinary sqlx query: prepared and cached by sqlx per
        // connection, as the pool's own configuration says.
        let row = sqlx::query(AssertSqlSafe(PEEK.replace("{table}", table)))
            .bind(claim.scope.as_bytes())
            .bind(claim.key.as_bytes())
            .fetch_optional(pool)
            .await?;
        Ok(match row.as_ref().map(read_row).transpose()? {
            Some(Found::Finished(fingerprint, response)) => Some(ClaimOutcome::Finished {
                fingerprint,
                response,
            }),
            _ => None,
        })
    }

    async fn begin(pool: &Pool<Self>) -> Result<OpenTx<Self>, sqlx::Error> {
        let mut conn = OpenTx::acquire(pool).await?;
        sqlx::raw_sql("BEGIN").execute(&mut **conn).await?;
        Ok(conn)
    }

    async fn finish(
        conn: &mut OpenTx<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&StoredResponse>,
    ) -> Result<(), sqlx::Error> {
        let sql = match (claim, response) {
            (Some(claim), Some(response)) => {
                let mut row = ClaimRow::new(table, claim);
                row.prepared = !conn.inlined;
                format!("{}; COMMIT", row.finish(response))
            }
            _ => "COMMIT".to_owned(),
        };
        let result = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut ***conn)
            .await;
        if let Err(error) = &result
            && has_code(error, &[UNDEFINED_STATEMENT])
        {
            // Someone deallocated the finish statement but not the claim's,
            // so the claim did not notice: a new connection prepares all.
            conn.close_on_drop();
        }
        result.map(drop)
    }

    async fn rollback(conn: &mut PoolConnection<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await?;
        Ok(())
    }

    async fn sweep(pool: &Pool<Self>, table: &str, batch: u32) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM {table} WHERE (scope, key) IN \
             (SELECT scope, key FROM {table} WHERE expires_at < now() LIMIT {batch})"
        );
        Ok(sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(pool)
            .await?
            .rows_affected())
    }
}

/// `lock_timeout = 0` means "wait forever" in PostgreSQL, so `wait = 0`
/// becomes the smallest positive timeout instead.
fn lock_timeout_ms(claim: &Claim<'_>) -> u128 {
    claim.wait.as_millis().max(1)
}

/// A claim on PostgreSQL: the row's statements, kept across attempts
/// (they remember whether the server keeps prepared statements).
struct PgClaim {
    row: ClaimRow,
    wait: std::time::Duration,
}

impl super::ClaimAttempt<Postgres> for PgClaim {
    async fn attempt(
        &mut self,
        mut conn: OpenTx<Postgres>,
        number: usize,
    ) -> Result<ClaimOutcome<Postgres>, Failure> {
        let error = match claim_on(&mut conn, &mut self.row).await {
            Ok(Settled::Ours) => return Ok(ClaimOutcome::Claimed(conn)),
            Ok(Settled::Finished(fingerprint, response)) => {
                super::abandon(conn).await;
                return Ok(ClaimOutcome::Finished {
                    fingerprint,
                    response,
                });
            }
            Err(error) => error,
        };
        super::abandon(conn).await;
        Err(if has_code(&error, &[LOCK_NOT_AVAILABLE]) {
            // A timeout this short can also be a brief wait on another lock
            // (extending the table, say) rather than a duplicate: look once
            // more before telling a fresh key it is in use.
            if number == 1 && self.wait < SHORT_WAIT {
                Failure::Retry(error)
            } else {
                Failure::InUse
            }
        } else if has_code(&error, &[SERIALIZATION_FAILURE, DEADLOCK_DETECTED]) {
            // CockroachDB and YugabyteDB ask clients to retry these; the
            // claim has done nothing yet, so retrying it is always safe.
            Failure::Retry(error)
        } else {
            Failure::Fatal(error)
        })
    }
}

/// Below this `wait`, a lock timeout during the claim is retried once.
const SHORT_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Claims on one connection through its prepared statements, preparing
/// them on the connection's first claim. A connection that cannot keep
/// them (a transaction-mode pooler hands each transaction another server
/// session) gets the same statements with their arguments inlined; `row`
/// remembers that for a retry of the claim, and `conn` for the finish.
async fn claim_on(conn: &mut OpenTx<Postgres>, row: &mut ClaimRow) -> Result<Settled, sqlx::Error> {
    let settled = claim_with_fallback(conn, row).await;
    conn.inlined = !row.prepared;
    settled
}

async fn claim_with_fallback(
    conn: &mut PoolConnection<Postgres>,
    row: &mut ClaimRow,
) -> Result<Settled, sqlx::Error> {
    match settle(conn, row, String::new()).await {
        Err(error) if has_code(&error, &[UNDEFINED_STATEMENT]) => {}
        settled => return settled,
    }
    // The failed `EXECUTE` aborted the transaction; end it, and ask which
    // of this table's statements the session lacks in the same round trip.
    let names = row.statements.names();
    let listed = sqlx::raw_sql(AssertSqlSafe(format!(
        "ROLLBACK; SELECT name FROM pg_catalog.pg_prepared_statements WHERE name IN ('{}')",
        names.join("', '")
    )))
    .fetch_all(&mut **conn)
    .await;
    let present = listed.and_then(|rows| {
        rows.iter()
            .map(|row| row.try_get::<String, _>("name"))
            .collect::<Result<Vec<_>, _>>()
    });
    let error = match present {
        Ok(present) => {
            let prepare = row.statements.prepare_missing(&present);
            match settle(conn, row, prepare).await {
                Err(error) if has_code(&error, &[UNDEFINED_STATEMENT, DUPLICATE_STATEMENT]) => {
                    error
                }
                settled => return settled,
            }
        }
        // A server without the view: the lookup's error is no claim's.
        Err(sqlx::Error::Database(error)) => sqlx::Error::Database(error),
        Err(error) => return Err(error),
    };
    tracing::debug!(%error, "prepared statements not kept; inlining idem's arguments");
    sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await?;
    row.prepared = false;
    settle(conn, row, String::new()).await
}

/// Runs the claim statements until the row is ours or finished by another
/// attempt. An expired row is taken over with an `UPDATE` that re-checks
/// expiry under the row lock, so of two concurrent takeovers one wins and
/// the other sees its committed result. `prelude` runs first, before the
/// transaction begins (the `PREPARE`s a new connection needs).
///
/// The claim statement answers with the row it inserted, or else the row
/// its snapshot sees; neither when it waited for another attempt that then
/// committed (the row is newer than the statement's snapshot), and then a
/// second statement reads it. A row that vanished (swept) in between is
/// claimed again.
async fn settle(
    conn: &mut PoolConnection<Postgres>,
    row: &ClaimRow,
    prelude: String,
) -> Result<Settled, sqlx::Error> {
    let mut sql = format!("{prelude}BEGIN; {}", row.insert());
    let mut claiming = true;
    for _ in 0..SETTLE_ATTEMPTS {
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut **conn)
            .await?;
        let claim_row = rows.iter().find(|row| has_column(row, "expired"));
        (sql, claiming) = match claim_row.map(read_row).transpose()? {
            None if claiming => (row.select(), false),
            None => (row.insert(), true),
            Some(Found::Expired) => {
                let taken = sqlx::raw_sql(AssertSqlSafe(row.take_over()))
                    .fetch_all(&mut **conn)
                    .await?;
                if taken.iter().any(|row| has_column(row, "taken")) {
                    return Ok(Settled::Ours);
                }
                (row.select(), false)
            }
            Some(Found::Ours) => return Ok(Settled::Ours),
            Some(Found::Finished(fingerprint, response)) => {
                return Ok(Settled::Finished(fingerprint, response));
            }
        };
    }
    Err(sqlx::Error::Protocol(
        "idempotency row changed repeatedly during its claim".into(),
    ))
}

/// What the claim's `SELECT` saw.
enum Found {
    Ours,
    Expired,
    Finished(Fingerprint, StoredResponse),
}

/// Where a claim ended: expired rows have been taken over by then.
enum Settled {
    Ours,
    Finished(Fingerprint, StoredResponse),
}

fn read_row(row: &PgRow) -> Result<Found, sqlx::Error> {
    if row.try_get::<bool, _>("expired")? {
        return Ok(Found::Expired);
    }
    let Some(status) = row.try_get::<Option<i16>, _>("status")? else {
        return Ok(Found::Ours);
    };
    let corrupt = || sqlx::Error::Decode("corrupt stored idempotent response".into());
    let fingerprint =
        Fingerprint::from_bytes(&row.try_get::<Vec<u8>, _>("fingerprint")?).ok_or_else(corrupt)?;
    let headers: Vec<u8> = row
        .try_get::<Option<Vec<u8>>, _>("headers")?
        .unwrap_or_default();
    let body: Vec<u8> = row
        .try_get::<Option<Vec<u8>>, _>("body")?
        .unwrap_or_default();
    let response = StoredResponse::decode(status.into(), &headers, body).ok_or_else(corrupt)?;
    Ok(Found::Finished(fingerprint, response))
}

/// One of `idem`'s statements on the key table, written once with `$n`
/// parameters: prepared per connection and run with `EXECUTE`, so the
/// server parses and plans it once per connection instead of per request
/// (that planning was most of the wrapper's database CPU).
struct Statement {
    /// Tells this statement apart among a table's statements.
    suffix: &'static str,
    /// The parameter types, in order.
    types: &'static str,
    /// The text, `{table}` standing for the table.
    text: &'static str,
}

/// The claim: the inserted row (status unset: ours), or else the row this
/// statement's snapshot sees, read in the same statement. The read is
/// skipped when the insert succeeded (a one-time filter).
const CLAIM: Statement = Statement {
    suffix: "claim",
    types: "bytea, bytea, bytea, bigint",
    text: "WITH inserted AS (\
               INSERT INTO {table} (scope, key, fingerprint, expires_at) \
               VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond') \
               ON CONFLICT (scope, key) DO NOTHING \
               RETURNING status, fingerprint, headers, body) \
           SELECT status, fingerprint, headers, body, false AS expired FROM inserted \
           UNION ALL \
           SELECT status, fingerprint, headers, body, expires_at <= now() \
           FROM {table} WHERE scope = $1 AND key = $2 \
           AND NOT EXISTS (SELECT 1 FROM inserted)",
};

const SELECT: Statement = Statement {
    suffix: "select",
    types: "bytea, bytea",
    text: "SELECT status, fingerprint, headers, body, expires_at <= now() AS expired \
           FROM {table} WHERE scope = $1 AND key = $2",
};

/// A finished, unexpired row, read outside the claim (`Backend::peek`);
/// run by sqlx, not among the `PREPARE`d statements.
const PEEK: &str = "SELECT status, fingerprint, headers, body, false AS expired \
                    FROM {table} WHERE scope = $1 AND key = $2 \
                    AND status IS NOT NULL AND expires_at > now()";

const TAKE_OVER: Statement = Statement {
    suffix: "take_over",
    types: "bytea, bytea, bytea, bigint",
    text: "UPDATE {table} SET fingerprint = $3, status = NULL, headers = NULL, body = NULL, \
           created_at = now(), expires_at = now() + $4 * interval '1 millisecond' \
           WHERE scope = $1 AND key = $2 AND expires_at <= now() RETURNING true AS taken",
};

const FINISH: Statement = Statement {
    suffix: "finish",
    types: "bytea, bytea, smallint, bytea, bytea",
    text: "UPDATE {table} SET status = $3, headers = $4, body = $5 \
           WHERE scope = $1 AND key = $2",
};

/// The statements of one key table, named after it: `Idem`s on different
/// tables can share a pool without their statements colliding, and the
/// names keep clear of sqlx's own (`sqlx_s_*`).
struct Statements {
    table: String,
    prefix: String,
}

impl Statements {
    const ALL: [Statement; 4] = [CLAIM, SELECT, TAKE_OVER, FINISH];

    fn new(table: &str) -> Self {
        // FNV-1a: a stable name for any table name, within PostgreSQL's
        // 63-byte identifiers; only the name of a statement, not a secret.
        let hash = table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
        Self {
            table: table.to_owned(),
            prefix: format!("idem_{hash:016x}_"),
        }
    }

    fn name(&self, statement: &Statement) -> String {
        format!("{}{}", self.prefix, statement.suffix)
    }

    fn names(&self) -> Vec<String> {
        Self::ALL
            .iter()
            .map(|statement| self.name(statement))
            .collect()
    }

    fn text(&self, statement: &Statement) -> String {
        statement.text.replace("{table}", &self.table)
    }

    /// `PREPARE`s for the statements not among `present`.
    fn prepare_missing(&self, present: &[String]) -> String {
        Self::ALL
            .iter()
            .filter(|statement| !present.contains(&self.name(statement)))
            .map(|statement| {
                format!(
                    "PREPARE {} ({}) AS {}; ",
                    self.name(statement),
                    statement.types,
                    self.text(statement)
                )
            })
            .collect()
    }

    /// Runs `statement` with `args`, SQL expressions we formatted: through
    /// its prepared statement, or with the arguments in place of `$n`.
    fn run(&self, statement: &Statement, prepared: bool, args: &[&str]) -> String {
        if prepared {
            return format!("EXECUTE {}({})", self.name(statement), args.join(", "));
        }
        // From the last parameter down, so `$1` never matches inside `$10`.
        args.iter()
            .enumerate()
            .rev()
            .fold(self.text(statement), |text, (index, arg)| {
                text.replace(&format!("${}", index + 1), arg)
            })
    }
}

/// The row of one claim, with its values already as SQL expressions.
struct ClaimRow {
    statements: Statements,
    /// Through prepared statements (`EXECUTE`), or inlined.
    prepared: bool,
    scope: String,
    key: String,
    fingerprint: String,
    ttl_ms: String,
    lock_timeout_ms: u128,
}

impl ClaimRow {
    fn new(table: &str, claim: &Claim<'_>) -> Self {
        Self {
            statements: Statements::new(table),
            prepared: true,
            scope: bytea(claim.scope.as_bytes()),
            key: bytea(claim.key.as_bytes()),
            fingerprint: bytea(claim.fingerprint.as_bytes()),
            ttl_ms: claim.ttl.as_millis().to_string(),
            lock_timeout_ms: lock_timeout_ms(claim),
        }
    }

    fn run(&self, statement: &Statement, args: &[&str]) -> String {
        self.statements.run(statement, self.prepared, args)
    }

    /// Runs `statement` under the claim's lock timeout, then puts the
    /// timeout back to its configured default: the handler's own statements
    /// and the final commit must not inherit a timeout of a millisecond.
    ///
    /// `SET LOCAL` is a utility statement, nothing to plan, so this costs
    /// next to nothing. (Saving and restoring the exact previous value with
    /// `set_config` doubled the database's CPU per claim in the benchmark.)
    /// The default is what `postgresql.conf`, the role, the database or the
    /// connection's startup options say; a plain session `SET lock_timeout`
    /// does not reach into `idem`'s transactions.
    fn bounded(&self, statement: &str) -> String {
        format!(
            "SET LOCAL lock_timeout = '{}ms'; {statement}; SET LOCAL lock_timeout TO DEFAULT;",
            self.lock_timeout_ms
        )
    }

    fn insert(&self) -> String {
        let args = [&*self.scope, &self.key, &self.fingerprint, &self.ttl_ms];
        self.bounded(&self.run(&CLAIM, &args))
    }

    fn take_over(&self) -> String {
        let args = [&*self.scope, &self.key, &self.fingerprint, &self.ttl_ms];
        self.bounded(&self.run(&TAKE_OVER, &args))
    }

    fn select(&self) -> String {
        format!("{};", self.run(&SELECT, &[&self.scope, &self.key]))
    }

    fn finish(&self, response: &StoredResponse) -> String {
        let status = response.status.as_u16().to_string();
        let headers = bytea(&response.encode_headers());
        let body = bytea(&response.body);
        self.run(&FINISH, &[&self.scope, &self.key, &status, &headers, &body])
    }
}

/// A `bytea` value as an SQL literal in hex input form. An escape string
/// (`E'\\x..'`) reads the same whatever `standard_conforming_strings`
/// says, and, unlike `decode(..)`, costs the server no function call to
/// resolve and fold per argument.
fn bytea(bytes: &[u8]) -> String {
    let mut literal = String::with_capacity(bytes.len() * 2 + 6);
    literal.push_str("E'\\\\x");
    push_hex(&mut literal, bytes);
    literal.push('\'');
    literal
}

fn has_column(row: &PgRow, name: &str) -> bool {
    row.columns().iter().any(|column| column.name() == name)
}

fn has_code(error: &sqlx::Error, codes: &[&str]) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|code| codes.contains(&&*code)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::StatusCode;
    use sqlx::postgres::PgPoolOptions;

    use super::*;

    /// A pool on the test server, `configure`d; fails loudly without one.
    async fn test_pool(
        max_connections: u32,
        configure: impl FnOnce(sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions,
    ) -> Pool<Postgres> {
        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(configure(url.parse().expect("database URL")))
            .await
            .unwrap_or_else(|error| panic!("PostgreSQL is required at {url}: {error}"))
    }

    /// One scripted attempt: `None` settles, `Some` fails so.
    type Step = Option<fn() -> Failure>;

    /// A claim that goes as scripted, recording the number of each attempt.
    struct Scripted {
        script: std::collections::VecDeque<Step>,
        attempts: Vec<usize>,
    }

    impl crate::backend::ClaimAttempt<Postgres> for &mut Scripted {
        async fn attempt(
            &mut self,
            conn: OpenTx<Postgres>,
            number: usize,
        ) -> Result<ClaimOutcome<Postgres>, Failure> {
            self.attempts.push(number);
            match self.script.pop_front().expect("an attempt past the script") {
                None => Ok(ClaimOutcome::Claimed(conn)),
                Some(failure) => {
                    conn.release();
                    Err(failure())
                }
            }
        }
    }

    /// The retry policy both server engines share: retryable failures are
    /// tried again up to `CLAIM_ATTEMPTS` in all, each on a fresh
    /// connection; "in use" is a 409 at once; anything else fails at once.
    #[tokio::test]
    async fn claims_are_retried_only_when_the_engine_asks() {
        let pool = test_pool(1, |options| options).await;
        let retry = || Failure::Retry(sqlx::Error::PoolTimedOut);
        let fatal = || Failure::Fatal(sqlx::Error::RowNotFound);
        let in_use = || Failure::InUse;
        let cases: [(&[Step], &str, &[usize]); 5] = [
            (&[Some(retry), Some(retry), None], "claimed", &[1, 2, 3]),
            (
                &[Some(retry), Some(retry), Some(retry)],
                "timed out",
                &[1, 2, 3],
            ),
            (&[Some(retry), Some(in_use)], "in use", &[1, 2]),
            (&[Some(in_use)], "in use", &[1]),
            (&[Some(fatal)], "no rows", &[1]),
        ];
        for (script, expected, attempts) in cases {
            let mut claim = Scripted {
                script: script.iter().copied().collect(),
                attempts: Vec::new(),
            };
            let outcome = crate::backend::claim_with_retries(&pool, &mut claim).await;
            let got = match outcome {
                Ok(ClaimOutcome::Claimed(mut conn)) => {
                    // A live connection, handed over by the last attempt.
                    sqlx::raw_sql("SELECT 1")
                        .execute(&mut **conn)
                        .await
                        .unwrap();
                    conn.release();
                    "claimed".to_owned()
                }
                Ok(ClaimOutcome::InUse) => "in use".to_owned(),
                Ok(ClaimOutcome::Finished { .. }) => "finished".to_owned(),
                Err(error) => error.to_string(),
            };
            assert!(got.contains(expected), "{script:?}: {got}");
            assert_eq!(claim.attempts, attempts, "{expected}");
            assert!(claim.script.is_empty(), "{expected}: script not used up");
        }
    }

    #[test]
    fn inlined_statements_put_every_argument_in_place() {
        let statements = Statements::new("keys");
        let args = [&*bytea(b"a"), &*bytea(b"b"), "201"];
        let finish = statements.run(&FINISH, false, &[args[0], args[1], args[2], "h", "b"]);
        assert_eq!(
            finish,
            r"UPDATE keys SET status = 201, headers = h, body = b WHERE scope = E'\\x61' AND key = E'\\x62'"
        );
        assert!(!finish.contains('$'));
        let prepared = statements.run(&SELECT, true, &args[..2]);
        assert_eq!(
            prepared,
            format!(r"EXECUTE {}(E'\\x61', E'\\x62')", statements.name(&SELECT))
        );
        // Tables get their own statements.
        assert_ne!(
            Statements::new("a.keys").name(&CLAIM),
            Statements::new("b.keys").name(&CLAIM)
        );
        assert!(statements.name(&TAKE_OVER).len() <= 63);
    }

    /// Values reach the row byte for byte, prepared or inlined, even on a
    /// server still configured with `standard_conforming_strings = off`.
    #[tokio::test]
    async fn bytes_arrive_intact_whatever_standard_conforming_strings_says() {
        let table = format!("idem_scs_{}", std::process::id());
        let scope = "a'b\\c\\x41\0\u{e9}";
        for setting in ["on", "off"] {
            let pool = test_pool(1, |options| {
                options.options([("standard_conforming_strings", setting)])
            })
            .await;
            Postgres::migrate(&pool, &table).await.expect("migrate");
            for prepared in [true, false] {
                let key = format!("k-{setting}-{prepared}");
                let claim = Claim {
                    scope,
                    key: &key,
                    fingerprint: Fingerprint::from_bytes(&[0x5c; 32]).unwrap(),
                    ttl: Duration::from_secs(60),
                    wait: Duration::from_millis(100),
                };
                let mut row = ClaimRow::new(&table, &claim);
                row.prepared = prepared;
                let mut conn = OpenTx::new(pool.acquire().await.unwrap());
                let settled = claim_on(&mut conn, &mut row).await.expect("claim");
                assert!(matches!(settled, Settled::Ours));
                assert_eq!(conn.inlined, !prepared);
                let response = StoredResponse {
                    status: StatusCode::OK,
                    headers: Vec::new(),
                    body: b"\\x00'\\".to_vec().into(),
                };
                Postgres::finish(&mut conn, &table, Some(&claim), Some(&response))
                    .await
                    .expect("finish");
                conn.release();
                let (stored_scope, body): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(
                    format!("SELECT scope, body FROM {table} WHERE key = $1"),
                ))
                .bind(key.as_bytes())
                .fetch_one(&pool)
                .await
                .unwrap();
                assert_eq!(
                    stored_scope,
                    scope.as_bytes(),
                    "{setting}, prepared {prepared}"
                );
                assert_eq!(body, b"\\x00'\\", "{setting}, prepared {prepared}");
            }
            sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
                .execute(&pool)
                .await
                .unwrap();
        }
    }

    /// The fallback for sessions that cannot keep prepared statements (a
    /// transaction-mode pooler): the same claim, takeover, replay and
    /// finish with inlined arguments, on the real server.
    #[tokio::test]
    async fn inlined_statements_claim_finish_replay_and_take_over() {
        let pool = test_pool(2, |options| options).await;
        let table = format!("idem_inline_{}", std::process::id());
        Postgres::migrate(&pool, &table).await.expect("migrate");
        let fingerprint = Fingerprint::from_bytes(&[7; 32]).unwrap();
        let claim = Claim {
            scope: "acct",
            key: "inline-1",
            fingerprint,
            ttl: Duration::from_secs(60),
            wait: Duration::from_millis(100),
        };
        let mut row = ClaimRow::new(&table, &claim);
        row.prepared = false;

        let mut conn = OpenTx::new(pool.acquire().await.unwrap());
        let settled = settle(&mut conn, &row, String::new()).await.expect("claim");
        assert!(matches!(settled, Settled::Ours));
        conn.inlined = true;
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: "{\"id\":1}".into(),
        };
        Postgres::finish(&mut conn, &table, Some(&claim), Some(&response))
            .await
            .expect("finish");
        conn.release();
        let prepared: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idem\\_%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(prepared, 0, "inlined mode prepares nothing");

        let mut conn = OpenTx::new(pool.acquire().await.unwrap());
        match settle(&mut conn, &row, String::new())
            .await
            .expect("replay")
        {
            Settled::Finished(stored, replayed) => {
                assert_eq!(stored, fingerprint);
                assert_eq!(replayed.status, StatusCode::CREATED);
                assert_eq!(&replayed.body[..], b"{\"id\":1}");
            }
            Settled::Ours => panic!("a finished key was claimed again"),
        }
        super::super::abandon(conn).await;

        // Expired: taken over, with the new fingerprint and no response.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {table} SET expires_at = now() - interval '1 second'"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut conn = OpenTx::new(pool.acquire().await.unwrap());
        let settled = settle(&mut conn, &row, String::new())
            .await
            .expect("take over");
        assert!(matches!(settled, Settled::Ours));
        Postgres::finish(&mut conn, &table, None, None)
            .await
            .unwrap();
        conn.release();
        let (status, live): (Option<i16>, bool) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, expires_at > now() FROM {table}"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((status, live), (None, true));

        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&pool)
            .await
            .unwrap();
    }
}
