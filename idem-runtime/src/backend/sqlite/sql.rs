//! SQLite's statements. Values are bound, not inlined: a "round trip" to
//! SQLite is a hop to the connection's worker thread.

use crate::backend::rows::tombstone_columns;
use crate::backend::sql::push_hex;
use crate::backend::store::tombstone_assignments;
use crate::response::EncodedResponse;

/// [`tombstone_assignments`] in SQLite's spelling: times are the
/// process's clock in epoch milliseconds, as every time this engine keeps.
pub(super) fn tombstone_set(response: &EncodedResponse) -> String {
    let now = super::now_ms();
    tombstone_assignments(
        response,
        |bytes| {
            let mut literal = String::from("X'");
            push_hex(&mut literal, bytes);
            literal.push('\'');
            literal
        },
        |ms| now.saturating_add(ms).to_string(),
    )
}

/// The statements of one table. Parameters are numbered: sqlx binds `?N`
/// by number across all statements of a query.
pub(super) struct Sql {
    pub(super) claim: String,
    pub(super) replay: String,
}

impl Sql {
    pub(super) fn new(table: &str) -> Self {
        let columns = "status, fingerprint, headers, body";
        let (claim_tombstone, replay_tombstone) =
            (tombstone_columns("?4"), tombstone_columns("?3"));
        let row = "scope = ?1 AND \"key\" = ?2";
        Self {
            // The upsert takes an expired row over; an unexpired one is
            // left alone and read back, with whether the upsert wrote
            // (`changes()`). We hold the write lock, so nothing can happen
            // between the two statements.
            claim: format!(
                "INSERT INTO {table} (scope, \"key\", fingerprint, created_at, expires_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT (scope, \"key\") DO UPDATE SET fingerprint = excluded.fingerprint, \
                 status = NULL, headers = NULL, body = NULL, \
                 created_at = excluded.created_at, expires_at = excluded.expires_at, \
                 lease_token = NULL, lease_until = NULL, recovery = NULL, request = NULL, \
                 attempts = NULL, location = NULL, replay_until = NULL \
                 WHERE expires_at <= ?4; \
                 SELECT {columns}, {claim_tombstone}, changes() AS claimed FROM {table} WHERE {row}"
            ),
            replay: format!(
                "SELECT {columns}, {replay_tombstone} FROM {table} \
                 WHERE {row} AND status IS NOT NULL AND expires_at > ?3"
            ),
        }
    }

    /// The finish's `UPDATE` of the claim's unfinished row; `late`, it also
    /// sets the expiry (`?6`) anew (see `OpenTx::outlived`), and a
    /// tombstone's response its [`tombstone_set`] instead.
    pub(super) fn finish(table: &str, late: bool, response: &EncodedResponse) -> String {
        let expiry = match response.tombstone {
            Some(_) => tombstone_set(response),
            None if late => ", expires_at = ?6".to_owned(),
            None => String::new(),
        };
        format!(
            "UPDATE {table} SET status = ?1, headers = ?2, body = ?3{expiry} \
             WHERE scope = ?4 AND \"key\" = ?5 AND status IS NULL"
        )
    }
}
