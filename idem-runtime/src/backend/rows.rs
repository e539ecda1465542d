//! The key table's rows decoded once for every engine: each engine's
//! statements name their columns (or aliases) as these readers expect,
//! with the types every engine decodes alike.

use sqlx::{ColumnIndex, Decode, Row, Type};

use super::admin::KeyRow;
use super::outbox_store::{FailingRow, MessageRow};
use super::phased::{Abandoned, Holder, Unclaimed};
use super::store::{StoreError, decode_finished};
use crate::fingerprint::Fingerprint;
use crate::resolve::ResolutionRecord;
use crate::response::EncodedResponse;

/// An engine's row, read by column name into the types `idem`'s tables
/// hold, each decoded as every engine decodes it. Every engine's row is
/// one; the readers below need nothing else of it.
pub(crate) trait Columns {
    /// Bytes (a scope, a key, a fingerprint, a payload).
    fn bytes(&self, name: &str) -> Result<Vec<u8>, sqlx::Error>;
    /// Bytes or `NULL` (a response's parts, a recovery point, a request).
    fn bytes_or_null(&self, name: &str) -> Result<Option<Vec<u8>>, sqlx::Error>;
    /// Text (a message's id and topic).
    fn text(&self, name: &str) -> Result<String, sqlx::Error>;
    /// Text or `NULL` (a delivery's error, who resolved a key and why).
    fn text_or_null(&self, name: &str) -> Result<Option<String>, sqlx::Error>;
    /// A 64-bit integer (a time in milliseconds, a token, a sequence number).
    fn int(&self, name: &str) -> Result<i64, sqlx::Error>;
    /// A 64-bit integer or `NULL`.
    fn int_or_null(&self, name: &str) -> Result<Option<i64>, sqlx::Error>;
    /// A 32-bit count.
    fn count(&self, name: &str) -> Result<i32, sqlx::Error>;
    /// A 32-bit count or `NULL`.
    fn count_or_null(&self, name: &str) -> Result<Option<i32>, sqlx::Error>;
    /// A 16-bit status, maybe `NULL`.
    fn status_or_null(&self, name: &str) -> Result<Option<i16>, sqlx::Error>;
}

impl<R: Row> Columns for R
where
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i16: Decode<'r, R::Database> + Type<R::Database>,
{
    fn bytes(&self, name: &str) -> Result<Vec<u8>, sqlx::Error> {
        self.try_get(name)
    }

    fn bytes_or_null(&self, name: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        self.try_get(name)
    }

    fn text(&self, name: &str) -> Result<String, sqlx::Error> {
        self.try_get(name)
    }

    fn text_or_null(&self, name: &str) -> Result<Option<String>, sqlx::Error> {
        self.try_get(name)
    }

    fn int(&self, name: &str) -> Result<i64, sqlx::Error> {
        self.try_get(name)
    }

    fn int_or_null(&self, name: &str) -> Result<Option<i64>, sqlx::Error> {
        self.try_get(name)
    }

    fn count(&self, name: &str) -> Result<i32, sqlx::Error> {
        self.try_get(name)
    }

    fn count_or_null(&self, name: &str) -> Result<Option<i32>, sqlx::Error> {
        self.try_get(name)
    }

    fn status_or_null(&self, name: &str) -> Result<Option<i16>, sqlx::Error> {
        self.try_get(name)
    }
}

/// A key's row for the operators' reads, its times aliased `created_ms`,
/// `expires_ms`, `lease_until_ms` and `now_ms` (epoch milliseconds).
pub(crate) fn key_row(row: &impl Columns) -> Result<KeyRow, sqlx::Error> {
    Ok(KeyRow {
        scope: row.bytes("scope")?,
        key: row.bytes("key")?,
        fingerprint: row.bytes("fingerprint")?,
        status: row.status_or_null("status")?.map(i64::from),
        created_ms: row.int("created_ms")?,
        expires_ms: row.int("expires_ms")?,
        lease_until_ms: row.int_or_null("lease_until_ms")?,
        replay_until_ms: row.int_or_null("replay_until_ms")?,
        now_ms: row.int("now_ms")?,
        recovery: row.bytes_or_null("recovery")?,
        request: row.bytes_or_null("request")?,
        attempts: row.count_or_null("attempts")?.unwrap_or(0),
        uncertainty: row.bytes_or_null("uncertainty")?,
        unreadable: false,
    })
}

/// A key's resolution: `resolved_ms`, `outcome`, `status`, `by_name`,
/// `note`.
pub(crate) fn resolution_row(row: &impl Columns) -> Result<ResolutionRecord, sqlx::Error> {
    let at = u64::try_from(row.int("resolved_ms")?).unwrap_or(0);
    Ok(ResolutionRecord {
        at: std::time::UNIX_EPOCH + std::time::Duration::from_millis(at),
        outcome: row.text("outcome")?,
        status: row
            .status_or_null("status")?
            .and_then(|status| u16::try_from(status).ok()),
        by: row.text_or_null("by_name")?,
        note: row.text_or_null("note")?,
    })
}

/// An abandoned key of the completer's list: `scope`, `key`,
/// `lease_token`, `attempts` and `request`.
pub(crate) fn abandoned(row: &impl Columns) -> Result<Abandoned, sqlx::Error> {
    let text = |column| {
        row.bytes(column)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
    };
    let attempts = row.count_or_null("attempts")?.unwrap_or(0);
    Ok(Abandoned {
        holder: Holder {
            scope: text("scope")?,
            key: text("key")?,
            token: row.int("lease_token")?,
        },
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        recovery: row.bytes_or_null("recovery")?,
        request: row.bytes_or_null("request")?,
    })
}

/// A key's row a phased claim did not take: `status`, `fingerprint`,
/// `headers`, `body`, `lease_token`, the lease's `remaining_ms` (`NULL`
/// without a lease), `attempts` and `recovery`.
pub(crate) fn unclaimed(row: &impl Columns) -> Result<Unclaimed, sqlx::Error> {
    Ok(Unclaimed {
        status: row.status_or_null("status")?.map(i64::from),
        fingerprint: row.bytes("fingerprint")?,
        headers: row.bytes_or_null("headers")?,
        body: row.bytes_or_null("body")?,
        token: row.int_or_null("lease_token")?,
        remaining_ms: row.int_or_null("remaining_ms")?.unwrap_or(0),
        attempts: row.count_or_null("attempts")?.unwrap_or(0).into(),
        recovery: row.bytes_or_null("recovery")?,
        tombstone: tombstone(row)?,
    })
}

/// A leased message, as every engine's lease returns
/// [`MESSAGE_COLUMNS`](super::outbox_store::MESSAGE_COLUMNS).
pub(crate) fn message_row(row: &impl Columns) -> Result<MessageRow, sqlx::Error> {
    Ok(MessageRow {
        seq: row.int("seq")?,
        id: row.text("id")?,
        scope: row.bytes("scope")?,
        topic: row.text("topic")?,
        payload: row.bytes("payload")?,
        attempts: row.count("attempts")?,
    })
}

/// A failing scope's head, as every engine's
/// [`failing_sql`](super::outbox_store::failing_sql) returns it.
pub(crate) fn failing_row(row: &impl Columns) -> Result<FailingRow, sqlx::Error> {
    Ok(FailingRow {
        scope: row.bytes("scope")?,
        pending: row.int("pending")?,
        attempts: row.count("attempts")?,
        last_error: row.text_or_null("last_error")?,
        next_attempt_ms: row.int("next_ms")?,
    })
}

/// A key's row as a claim or a replay reads it: its fingerprint and stored
/// response once `status` is set (`headers` and `body` with it, and
/// [`tombstone_columns`]); `None` while unfinished.
pub(crate) fn finished_row(
    row: &impl Columns,
) -> Result<Option<(Fingerprint, EncodedResponse)>, StoreError> {
    stored_row(row, || tombstone(row))
}

/// A row read only while its response replays (its replay's end is in the
/// read's condition): [`finished_row`] without [`tombstone_columns`].
pub(crate) fn replayable_row(
    row: &impl Columns,
) -> Result<Option<(Fingerprint, EncodedResponse)>, StoreError> {
    stored_row(row, || Ok(None))
}

fn stored_row(
    row: &impl Columns,
    tombstone: impl FnOnce() -> Result<Option<Option<Vec<u8>>>, sqlx::Error>,
) -> Result<Option<(Fingerprint, EncodedResponse)>, StoreError> {
    let Some(status) = row.status_or_null("status").map_err(StoreError::Database)? else {
        return Ok(None);
    };
    let read = || -> Result<_, sqlx::Error> {
        Ok((
            row.bytes("fingerprint")?,
            row.bytes_or_null("headers")?,
            row.bytes_or_null("body")?,
            tombstone()?,
        ))
    };
    let (fingerprint, headers, body, tombstone) = read().map_err(StoreError::Database)?;
    decode_finished(status.into(), &fingerprint, headers, body, tombstone).map(Some)
}

/// What every read of a finished row selects besides its response, for a
/// handler's tombstone, `now` being the engine's clock: `past_ttl` (1 once
/// the row's replay has ended, else 0 or `NULL`) and `location`.
pub(crate) fn tombstone_columns(now: &str) -> String {
    format!("location, CASE WHEN replay_until <= {now} THEN 1 ELSE 0 END AS past_ttl")
}

/// A row's [`tombstone_columns`]: `Some(location)` once its replay ended.
pub(crate) fn tombstone(row: &impl Columns) -> Result<Option<Option<Vec<u8>>>, sqlx::Error> {
    if row.count_or_null("past_ttl")?.unwrap_or(0) == 0 {
        return Ok(None);
    }
    row.bytes_or_null("location").map(Some)
}
