//! PostgreSQL: the claim rides on the transaction's `BEGIN`, the stored
//! response on its `COMMIT`, so a first attempt costs no extra round trip.
//!
//! sqlx has no pipelining, but the simple query protocol runs several
//! statements in one round trip. Those statements cannot take bind
//! parameters, so every value is inlined as hex (`decode('..', 'hex')`) or
//! as an integer we formatted: no client-controlled character reaches SQL.
//! Only statements PostgreSQL, CockroachDB and YugabyteDB all run are used.

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Column, Pool, Postgres, Row};

use super::{Backend, Claim, ClaimOutcome, OpenTx, hex};
use crate::Error;
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

impl super::sealed::Sealed for Postgres {}

const LOCK_NOT_AVAILABLE: &str = "55P03";
const UNIQUE_VIOLATION: &str = "23505";
const DUPLICATE_TABLE: &str = "42P07";
const SERIALIZATION_FAILURE: &str = "40001";
const DEADLOCK_DETECTED: &str = "40P01";

/// How many times a claim re-reads a row that vanished (swept) or was taken
/// over between two statements before giving up with a store error.
const CLAIM_ATTEMPTS: usize = 3;

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
        let first = format!("BEGIN; {} {}", row.insert(), row.select());
        let mut attempt = 1;
        loop {
            let mut conn = OpenTx::new(pool.acquire().await?);
            let error = match settle(&mut conn, &row, first.clone()).await {
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
            if has_code(&error, &[LOCK_NOT_AVAILABLE]) {
                // A timeout this short can also be a brief wait on another
                // lock (extending the table, say) rather than a duplicate:
                // look once more before telling a fresh key it is in use.
                if attempt == 1 && claim.wait < SHORT_WAIT {
                    attempt += 1;
                    continue;
                }
                return Ok(ClaimOutcome::InUse);
            }
            // CockroachDB and YugabyteDB ask clients to retry these; the
            // claim has done nothing yet, so retrying it is always safe.
            if attempt < CLAIM_ATTEMPTS
                && has_code(&error, &[SERIALIZATION_FAILURE, DEADLOCK_DETECTED])
            {
                attempt += 1;
                continue;
            }
            return Err(error);
        }
    }

    async fn begin(pool: &Pool<Self>) -> Result<OpenTx<Self>, sqlx::Error> {
        let mut conn = OpenTx::new(pool.acquire().await?);
        sqlx::raw_sql("BEGIN").execute(&mut **conn).await?;
        Ok(conn)
    }

    async fn finish(
        conn: &mut PoolConnection<Self>,
        table: &str,
        claim: Option<&Claim<'_>>,
        response: Option<&StoredResponse>,
    ) -> Result<(), sqlx::Error> {
        let sql = match (claim, response) {
            (Some(claim), Some(response)) => format!(
                "UPDATE {table} SET status = {}, headers = decode('{}', 'hex'), body = decode('{}', 'hex') WHERE {}; COMMIT",
                response.status.as_u16(),
                hex(&response.encode_headers()),
                hex(&response.body),
                ClaimRow::new(table, claim).matches(),
            ),
            _ => "COMMIT".to_owned(),
        };
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut **conn)
            .await?;
        Ok(())
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

/// Below this `wait`, a lock timeout during the claim is retried once.
const SHORT_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Runs the claim statements until the row is ours or finished by another
/// attempt. An expired row is taken over with an `UPDATE` that re-checks
/// expiry under the row lock, so of two concurrent takeovers one wins and
/// the other sees its committed result.
async fn settle(
    conn: &mut PoolConnection<Postgres>,
    row: &ClaimRow,
    first: String,
) -> Result<Settled, sqlx::Error> {
    let mut sql = first;
    for _ in 0..CLAIM_ATTEMPTS {
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut **conn)
            .await?;
        let claim_row = rows.iter().find(|row| has_column(row, "expired"));
        sql = match claim_row.map(read_row).transpose()? {
            // Swept between the insert and the select: insert again.
            None => format!("{} {}", row.insert(), row.select()),
            Some(Found::Expired) => {
                let taken = sqlx::raw_sql(AssertSqlSafe(row.take_over()))
                    .fetch_all(&mut **conn)
                    .await?;
                if taken.iter().any(|row| has_column(row, "taken")) {
                    return Ok(Settled::Ours);
                }
                row.select()
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

/// The row of one claim, with its values already in hex.
struct ClaimRow {
    table: String,
    scope: String,
    key: String,
    fingerprint: String,
    ttl_ms: u128,
    lock_timeout_ms: u128,
}

impl ClaimRow {
    fn new(table: &str, claim: &Claim<'_>) -> Self {
        Self {
            table: table.to_owned(),
            scope: hex(claim.scope.as_bytes()),
            key: hex(claim.key.as_bytes()),
            fingerprint: hex(claim.fingerprint.as_bytes()),
            ttl_ms: claim.ttl.as_millis(),
            lock_timeout_ms: lock_timeout_ms(claim),
        }
    }

    fn matches(&self) -> String {
        format!(
            "scope = decode('{}', 'hex') AND key = decode('{}', 'hex')",
            self.scope, self.key
        )
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
        self.bounded(&format!(
            "INSERT INTO {} (scope, key, fingerprint, expires_at) VALUES \
             (decode('{}', 'hex'), decode('{}', 'hex'), decode('{}', 'hex'), now() + interval '{} milliseconds') \
             ON CONFLICT (scope, key) DO NOTHING",
            self.table, self.scope, self.key, self.fingerprint, self.ttl_ms
        ))
    }

    fn take_over(&self) -> String {
        self.bounded(&format!(
            "UPDATE {} SET fingerprint = decode('{}', 'hex'), status = NULL, headers = NULL, body = NULL, \
             created_at = now(), expires_at = now() + interval '{} milliseconds' \
             WHERE {} AND expires_at <= now() RETURNING true AS taken",
            self.table,
            self.fingerprint,
            self.ttl_ms,
            self.matches()
        ))
    }

    fn select(&self) -> String {
        format!(
            "SELECT status, fingerprint, headers, body, expires_at <= now() AS expired FROM {} WHERE {};",
            self.table,
            self.matches()
        )
    }
}

fn has_column(row: &PgRow, name: &str) -> bool {
    row.columns().iter().any(|column| column.name() == name)
}

fn has_code(error: &sqlx::Error, codes: &[&str]) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|code| codes.contains(&&*code)))
}
