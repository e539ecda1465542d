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
/// Whether the key is this claim's is what the upsert did, kept in the
/// session's `LAST_INSERT_ID()`: set to 1 before it, left so by an insert
/// (the table has no `AUTO_INCREMENT` column), and set by the update
/// clause's first assignment to whether the row it found had expired. The
/// update clause runs on the latest committed row, under its lock, so no
/// read of the row follows. A live row the upsert left alone is another
/// attempt's: finished, or unfinished because an earlier attempt committed
/// it (its handler's own `COMMIT`, or a statement that commits implicitly)
/// and then failed, with its effects in and no response. That key is in
/// use until it expires, as on every engine: running the handler again
/// could do its effects twice. (The row count cannot tell: sqlx's
/// connections count a row found unchanged as one, like a row inserted.)
pub(super) fn claim_sql(table: &str, claim: &Claim<'_>) -> String {
    let now = "UTC_TIMESTAMP(6)";
    let expires = format!("{now} + INTERVAL {} MICROSECOND", claim.ttl.as_micros());
    let expired = format!("expires_at <= {now}");
    let fingerprint = hex(claim.fingerprint.as_bytes());
    let wait = claim.wait;
    let lock_wait_secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let bounded = if wait.subsec_nanos() > 0 {
        format!(
            "/*M!100300 SET STATEMENT max_statement_time = {}.{:06} FOR */ ",
            wait.as_secs(),
            wait.subsec_micros()
        )
    } else {
        String::new()
    };
    // MariaDB ends a session left idle in a transaction (its client gone,
    // the socket half-open) after `idle_transaction_timeout`, releasing the
    // key; MySQL skips the executable comment and relies on `wait_timeout`.
    let bound = claim.orphan_bound();
    let orphan_secs = bound.as_secs() + u64::from(bound.subsec_nanos() > 0);
    format!(
        "SET {SAVED_LOCK_WAIT} = @@SESSION.innodb_lock_wait_timeout, \
             @idem_claim = LAST_INSERT_ID(1), SESSION innodb_lock_wait_timeout = {lock_wait_secs} \
             /*M!100300 , {SAVED_IDLE} = @@SESSION.idle_transaction_timeout, \
             SESSION idle_transaction_timeout = {orphan_secs} */; \
         START TRANSACTION; \
         {bounded}INSERT INTO {table} (scope, `key`, fingerprint, created_at, expires_at) \
             VALUES (X'{scope}', X'{key}', X'{fingerprint}', {now}, {expires}) \
             ON DUPLICATE KEY UPDATE \
             fingerprint = IF(LAST_INSERT_ID({expired}), X'{fingerprint}', fingerprint), \
             status = IF({expired}, NULL, status), \
             headers = IF({expired}, NULL, headers), \
             body = IF({expired}, NULL, body), \
             location = IF({expired}, NULL, location), \
             replay_until = IF({expired}, NULL, replay_until), \
             created_at = IF({expired}, {now}, created_at), \
             expires_at = IF({expired}, {expires}, expires_at); \
         SET SESSION innodb_lock_wait_timeout = {SAVED_LOCK_WAIT}, @idem_taken = {taken}",
        scope = hex(claim.scope.as_bytes()),
        key = hex(claim.key.as_bytes()),
        taken = fail_if("LAST_INSERT_ID() = 0"),
    )
}

/// The finish's `UPDATE` of the claim's row, which spares a finished row
/// (a concurrent retry's, claimed after this transaction was rolled back).
/// `late`: the expiry counts from now (see `OpenTx::outlived`).
pub(super) fn store(
    table: &str,
    claim: &Claim<'_>,
    response: &EncodedResponse,
    late: bool,
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
        "UPDATE {table} SET status = {}, headers = X'{}', body = X'{}'{expiry} \
         WHERE {} AND status IS NULL",
        response.status.as_u16(),
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
