//! A diagnostic scenario, not run by default (`IDEM_BENCH_SCENARIOS=optimistic`):
//! the optimistic claim, the cheapest design with a key row that the
//! instruction counts found, written by hand so its throughput can be read
//! next to the others'. It is outside DESIGN.md's contract, which is why
//! `idem` does not do it.
//!
//! The key row is written once, complete, in the round trip that commits:
//! `BEGIN` carries a read of the key (a finished key is answered without
//! running the handler), the handler's statements follow, and the last
//! round trip is `INSERT` of the row with its response, then `COMMIT`.
//! Nothing marks the key while the handler runs, so a duplicate that
//! arrives meanwhile runs the handler as well; the unique index then
//! refuses one of the two inserts, and that transaction rolls back with
//! all its writes, so there is still one effect. The contract says such a
//! duplicate does not run the handler (409, or a wait of `wait`), and that
//! is the difference. The insert raises on conflict instead of `DO
//! NOTHING` because `COMMIT` follows it in the same round trip: it must not
//! commit the handler's writes without the response.
//!
//! The row goes to `bench_optimistic_keys`, a table `idem` migrated (the
//! same columns and indexes as the wrapper's), through statements prepared
//! once per connection, with arguments inlined as hex, as the wrapper runs
//! its own. What a real mode would also need and this sketch lacks:
//! taking over an expired row (answered here with a 500, which the
//! benchmark never meets), and a hint to answer replays without a
//! transaction.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use idem::Fingerprint;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};

use crate::app::{Account, ApiError, created, read_request, work};

/// The key table of this scenario.
pub const TABLE: &str = "bench_optimistic_keys";

const PROBE: &str = "bench_optimistic_probe";
const STORE: &str = "bench_optimistic_store";
/// The keys' lifetime, as the wrapper's default.
const TTL_MS: u64 = 24 * 60 * 60 * 1000;

fn prepare() -> String {
    format!(
        "PREPARE {PROBE} (bytea, bytea) AS \
           SELECT status, fingerprint, headers, body, expires_at <= now() AS expired \
           FROM {TABLE} WHERE scope = $1 AND key = $2; \
         PREPARE {STORE} (bytea, bytea, bytea, smallint, bytea, bytea, bigint) AS \
           INSERT INTO {TABLE} (scope, key, fingerprint, status, headers, body, expires_at) \
           VALUES ($1, $2, $3, $4, $5, $6, now() + $7 * interval '1 millisecond')"
    )
}

/// `optimistic`: see the module documentation.
pub async fn optimistic(
    account: Account,
    Path(statements): Path<u32>,
    State(pool): State<PgPool>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (key, fingerprint, new) = match read_request(&method, &uri, &headers, &body) {
        Ok(read) => read,
        Err(refusal) => return Ok(refusal.into_response()),
    };
    let scope = bytea(account.0.as_bytes());
    let key = bytea(key.as_bytes());
    let mut conn = pool.acquire().await?;

    // 1: open the transaction and look for the key.
    let probe = format!("BEGIN; EXECUTE {PROBE}({scope}, {key})");
    let found = match sqlx::raw_sql(AssertSqlSafe(probe.clone()))
        .fetch_all(&mut *conn)
        .await
    {
        // A new connection: prepare the statements, then look again.
        Err(error) if has_code(&error, "26000") => {
            let prepare = format!("ROLLBACK; {}; {probe}", prepare());
            sqlx::raw_sql(AssertSqlSafe(prepare))
                .fetch_all(&mut *conn)
                .await?
        }
        found => found?,
    };
    if let Some(row) = found.first() {
        rollback(&mut conn).await;
        return answer(row, &fingerprint);
    }

    // 2: the handler's statements.
    let charge = match work::<Postgres>(&mut conn, &account.0, &new, statements).await {
        Ok(charge) => charge,
        Err(error) => {
            rollback(&mut conn).await;
            return Err(error.into());
        }
    };

    // 3: the complete row, and the commit.
    let (parts, response_body) = created(charge).into_parts();
    let location = parts
        .headers
        .get(header::LOCATION)
        .map_or(&b""[..], HeaderValue::as_bytes);
    let stored = axum::body::to_bytes(response_body, usize::MAX)
        .await
        .expect("an in-memory body");
    let store = format!(
        "EXECUTE {STORE}({scope}, {key}, {}, {}, {}, {}, {TTL_MS}); COMMIT",
        bytea(fingerprint.as_bytes()),
        parts.status.as_u16(),
        bytea(location),
        bytea(&stored),
    );
    match sqlx::raw_sql(AssertSqlSafe(store))
        .execute(&mut *conn)
        .await
    {
        Ok(_) => Ok(Response::from_parts(parts, stored.into())),
        // A duplicate committed first: this attempt's writes roll back, and
        // it answers with the response that committed.
        Err(error) if has_code(&error, "23505") => {
            rollback(&mut conn).await;
            let row = sqlx::raw_sql(AssertSqlSafe(format!("EXECUTE {PROBE}({scope}, {key})")))
                .fetch_one(&mut *conn)
                .await?;
            answer(&row, &fingerprint)
        }
        Err(error) => {
            rollback(&mut conn).await;
            Err(error.into())
        }
    }
}

/// A taken key: its stored response, replayed, if the request matches it;
/// 422 if it does not.
fn answer(row: &PgRow, fingerprint: &Fingerprint) -> Result<Response, ApiError> {
    if row.try_get::<bool, _>("expired")? {
        return Ok((
            StatusCode::INTERNAL_SERVER_ERROR,
            "expired key: not taken over by this diagnostic",
        )
            .into_response());
    }
    if row.try_get::<Vec<u8>, _>("fingerprint")? != fingerprint.as_bytes() {
        return Ok(StatusCode::UNPROCESSABLE_ENTITY.into_response());
    }
    let status = row.try_get::<i16, _>("status")?;
    let location = row.try_get::<Vec<u8>, _>("headers")?;
    let mut response = (
        StatusCode::from_u16(status as u16).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [(header::CONTENT_TYPE, "application/json")],
        row.try_get::<Vec<u8>, _>("body")?,
    )
        .into_response();
    let headers = response.headers_mut();
    if let Ok(location) = HeaderValue::from_bytes(&location) {
        headers.insert(header::LOCATION, location);
    }
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    Ok(response)
}

/// Ends the transaction; a connection that cannot is closed, not pooled.
async fn rollback(conn: &mut PoolConnection<Postgres>) {
    if sqlx::raw_sql("ROLLBACK")
        .execute(&mut **conn)
        .await
        .is_err()
    {
        conn.close_on_drop();
    }
}

/// `bytes` as a `bytea` literal in hex form: only `[0-9a-f]` comes from
/// the value, so nothing can inject.
fn bytea(bytes: &[u8]) -> String {
    const PREFIX: &[u8] = b"E'\\\\x";
    let digits = PREFIX.len()..PREFIX.len() + 2 * bytes.len();
    let mut literal = Vec::with_capacity(digits.end + 1);
    literal.extend_from_slice(PREFIX);
    literal.resize(digits.end, 0);
    // `encode_to_slice`, not `encode`, which collects a `String` one `char`
    // at a time: that cost this handler 14k instructions a request.
    hex::encode_to_slice(bytes, &mut literal[digits]).expect("two digits a byte");
    literal.push(b'\'');
    String::from_utf8(literal).expect("ASCII")
}

fn has_code(error: &sqlx::Error, code: &str) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some(code))
}
