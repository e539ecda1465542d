//! MySQL/MariaDB's statements. Every value is inlined as hex (`X'..'`)
//! or as an integer we formatted: no client-controlled character reaches SQL.

use super::{SAVED_IDLE, SAVED_LOCK_WAIT, fail_if};
use crate::backend::Claim;
use crate::backend::sql::push_hex;
use crate::backend::store::tombstone_assignments;
use crate::response::EncodedResponse;

/// The sweep's `DELETE`s of the locked `rows`, each at most about `limit`
/// bytes of text.
pub(super) fn delete_statements(
    table: &str,
    rows: &[(Vec<u8>, Vec<u8>)],
    limit: usize,
) -> Vec<String> {
    let head =
        format!("DELETE t FROM {table} AS t FORCE INDEX (PRIMARY) WHERE (t.scope, t.`key`) IN (");
    let tail = ") AND t.expires_at <= UTC_TIMESTAMP(6)";
    let mut statements = Vec::new();
    let mut statement = String::new();
    for (scope, key) in rows {
        if statement.is_empty() {
            statement.push_str(&head);
        } else {
            statement.push_str(", ");
        }
        statement.push_str("(X'");
        push_hex(&mut statement, scope);
        statement.push_str("', X'");
        push_hex(&mut statement, key);
        statement.push_str("')");
        if statement.len() >= limit {
            statement.push_str(tail);
            statements.push(std::mem::take(&mut statement));
        }
    }
    if !statement.is_empty() {
        statement.push_str(tail);
        statements.push(statement);
    }
    statements
}

/// The claim's round trip. An expired row is taken over inside the upsert:
/// MySQL applies the assignments left to right, so `expires_at` goes last
/// and every condition before it still sees the old expiry.
///
/// The upsert fails, with [`ER_DATA_OUT_OF_RANGE`](super::ER_DATA_OUT_OF_RANGE),
/// on a live row: its update clause's first assignment evaluates
/// [`fail_if`] on it. The update clause runs on the latest committed row,
/// under its lock, which the failed statement keeps. A live row is another
/// attempt's: finished, or unfinished because an earlier attempt committed
/// it (its handler's own `COMMIT`, or a statement that commits implicitly)
/// and then failed, with its effects in and no response. That key is in
/// use until it expires, as on every engine: running the handler again
/// could do its effects twice.
///
/// The lock wait is the claim's for the insert alone: on MariaDB by `SET
/// STATEMENT ... FOR` (three statements: the idle bound's `SET`, `START
/// TRANSACTION`, the upsert); on MySQL set before it and restored after it
/// (four).
pub(super) fn claim_sql(table: &str, claim: &Claim<'_>, mariadb: bool) -> String {
    let now = "UTC_TIMESTAMP(6)";
    let expires = format!("{now} + INTERVAL {} MICROSECOND", claim.ttl.as_micros());
    let expired = format!("expires_at <= {now}");
    let fingerprint = hex(claim.fingerprint.as_bytes());
    let wait = claim.wait;
    let lock_wait_secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    // A fraction of a second bounds the insert's time too (MariaDB only).
    let max_time = if wait.subsec_nanos() > 0 {
        format!(
            "max_statement_time = {}.{:06}",
            wait.as_secs(),
            wait.subsec_micros()
        )
    } else {
        String::new()
    };
    let (bound, restore) = if mariadb {
        let max_time = if max_time.is_empty() {
            max_time
        } else {
            format!(", {max_time}")
        };
        (
            format!("SET STATEMENT innodb_lock_wait_timeout = {lock_wait_secs}{max_time} FOR "),
            String::new(),
        )
    } else {
        let max_time = if max_time.is_empty() {
            max_time
        } else {
            format!("/*M!100300 SET STATEMENT {max_time} FOR */ ")
        };
        (
            max_time,
            format!("; SET SESSION innodb_lock_wait_timeout = {SAVED_LOCK_WAIT}"),
        )
    };
    let set_lock_wait = if mariadb {
        String::new()
    } else {
        format!(", SESSION innodb_lock_wait_timeout = {lock_wait_secs}")
    };
    // MariaDB ends a session left idle in a transaction (its client gone,
    // the socket half-open) after `idle_transaction_timeout`, releasing the
    // key; MySQL skips the executable comment and relies on `wait_timeout`.
    // The session's lock wait is saved on both, for a failed claim's reset.
    let orphan = claim.orphan_bound();
    let orphan_secs = orphan.as_secs() + u64::from(orphan.subsec_nanos() > 0);
    format!(
        "SET {SAVED_LOCK_WAIT} = @@SESSION.innodb_lock_wait_timeout{set_lock_wait} \
             /*M!100300 , {SAVED_IDLE} = @@SESSION.idle_transaction_timeout, \
             SESSION idle_transaction_timeout = {orphan_secs} */; \
         START TRANSACTION; \
         {bound}INSERT INTO {table} (scope, `key`, fingerprint, created_at, expires_at) \
             VALUES (X'{scope}', X'{key}', X'{fingerprint}', {now}, {expires}) \
             ON DUPLICATE KEY UPDATE \
             fingerprint = IF({live} > 0, X'{fingerprint}', fingerprint), \
             status = IF({expired}, NULL, status), \
             headers = IF({expired}, NULL, headers), \
             body = IF({expired}, NULL, body), \
             location = IF({expired}, NULL, location), \
             replay_until = IF({expired}, NULL, replay_until), \
             created_at = IF({expired}, {now}, created_at), \
             expires_at = IF({expired}, {expires}, expires_at){restore}",
        scope = hex(claim.scope.as_bytes()),
        key = hex(claim.key.as_bytes()),
        live = fail_if(&format!("NOT ({expired})")),
    )
}

/// The finish's `UPDATE` of the claim's row, which spares a finished row
/// (a concurrent retry's, claimed after this transaction was rolled back).
/// `late`: the expiry counts from now (see `OpenTx::outlived`); `check`,
/// an expression that is 0 or fails, is added to the status.
pub(super) fn store(
    table: &str,
    claim: &Claim<'_>,
    response: &EncodedResponse,
    late: bool,
    check: &str,
) -> String {
    let expiry = if response.tombstone.is_some() {
        tombstone_set(response)
    } else if late {
        format!(
            ", expires_at = UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND",
            claim.ttl.as_micros()
        )
    } else {
        String::new()
    };
    format!(
        "UPDATE {table} SET status = {}{}, headers = X'{}', body = X'{}'{expiry} \
         WHERE {} AND status IS NULL",
        response.status.as_u16(),
        if check.is_empty() {
            String::new()
        } else {
            format!(" + {check}")
        },
        hex(&response.headers),
        hex(&response.body),
        matches(claim),
    )
}

/// [`tombstone_assignments`] in MySQL's spelling.
pub(super) fn tombstone_set(response: &EncodedResponse) -> String {
    tombstone_assignments(
        response,
        |bytes| format!("X'{}'", hex(bytes)),
        |ms| {
            format!(
                "UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND",
                ms.saturating_mul(1000)
            )
        },
    )
}

pub(super) fn matches(claim: &Claim<'_>) -> String {
    format!(
        "scope = X'{}' AND `key` = X'{}'",
        hex(claim.scope.as_bytes()),
        hex(claim.key.as_bytes())
    )
}

/// The hex form used to inline binary values into simple-protocol SQL:
/// only `[0-9a-f]` reaches the statement, so nothing can inject.
pub(super) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}
