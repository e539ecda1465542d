//! Writing messages in the transaction whose commit makes them exist.

use std::marker::PhantomData;
use std::sync::Arc;

use serde::Serialize;

use crate::backend::{Backend, NewMessage, Phased};
use crate::error::Error;
use crate::phases::Phases;
use crate::tx::Tx;

use crate::wake::Written;

/// The longest topic the outbox takes, in bytes.
pub const MAX_TOPIC_LEN: usize = 255;

/// Writes outbox messages in a transaction: the request's ([`Tx::outbox`])
/// or a phase's ([`Phases::outbox`]).
///
/// A message's id (256 random bits, in hex) is minted when it is written.
/// A message is written only by the commit that records its request's
/// response or its phase's result, so no retry writes it again, and the
/// relay and the broker redeliver it under the same id. (An id derived
/// from the key would collide once the key expired or was forgotten and
/// the same key came back.)
///
/// A phase's commit ([`Phases::local`], or the last phase's with the
/// response) wakes this process's relays when the writer wrote in it; a
/// message written on another connection waits for the relays' poll.
pub struct OutboxWriter<DB> {
    table: Arc<str>,
    scope: String,
    written: Written,
    /// The engine whose connections it writes through, so that a phase's
    /// `tx` is taken as it is, without naming the engine.
    engine: PhantomData<fn() -> DB>,
}

impl<DB> std::fmt::Debug for OutboxWriter<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxWriter")
            .field("table", &self.table)
            .field("scope", &self.scope)
            .finish()
    }
}

impl<DB: Backend> OutboxWriter<DB> {
    /// Writes a message with `payload` as JSON on `topic`, in the
    /// transaction `conn` is in; returns its id. It is delivered only if
    /// that transaction commits.
    pub async fn write(
        &self,
        conn: &mut DB::Connection,
        topic: &str,
        payload: &impl Serialize,
    ) -> Result<String, Error> {
        let payload = serde_json::to_vec(payload).map_err(Error::Payload)?;
        self.write_bytes(conn, topic, &payload).await
    }

    /// [`write`](Self::write) with a payload already in bytes.
    pub async fn write_bytes(
        &self,
        conn: &mut DB::Connection,
        topic: &str,
        payload: &[u8],
    ) -> Result<String, Error> {
        let id = enqueue::<DB>(conn, &self.table, &self.scope, topic, payload).await?;
        self.written.mark();
        Ok(id)
    }
}

/// Writes a message of `scope` on `topic` in the transaction `conn` is in,
/// under a new id, and returns the id.
async fn enqueue<DB: Backend>(
    conn: &mut DB::Connection,
    table: &str,
    scope: &str,
    topic: &str,
    payload: &[u8],
) -> Result<String, Error> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN {
        return Err(Error::InvalidMessage {
            what: "topic",
            len: topic.len(),
            max: MAX_TOPIC_LEN,
        });
    }
    let id = hex::encode(rand::random::<[u8; 32]>());
    let message = NewMessage {
        id: &id,
        scope,
        topic,
        payload,
    };
    DB::enqueue(conn, table, &message).await?;
    Ok(id)
}

impl<DB: Backend> Tx<DB> {
    /// Writes a message with `payload` as JSON on `topic` in the request's
    /// transaction, and returns its id: the message exists if and only if
    /// the handler's writes commit, so a rolled-back attempt sends nothing
    /// and a replay (which does not run the handler) sends nothing again.
    /// A relay ([`Idem::relay`](crate::Idem::relay)) delivers it after the
    /// commit, woken by it.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn demo(mut tx: idem::Tx<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// let id = tx
    ///     .outbox("email.receipt", &serde_json::json!({ "to": "a@example.com" }))
    ///     .await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn outbox(&mut self, topic: &str, payload: &impl Serialize) -> Result<String, Error> {
        let payload = serde_json::to_vec(payload).map_err(Error::Payload)?;
        let (conn, table, scope) = self.outbox_parts();
        let id = enqueue::<DB>(conn, table, scope, topic, &payload).await?;
        self.wrote_outbox();
        Ok(id)
    }
}

impl<DB: Backend + Phased> Phases<DB> {
    /// A writer of outbox messages for a phase: pass it the phase's
    /// connection, and its messages commit with the phase (and are not
    /// written again when a later attempt skips the phase).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[derive(Debug)] struct ApiError;
    /// # impl From<idem::PhaseError> for ApiError { fn from(_: idem::PhaseError) -> Self { ApiError } }
    /// # impl From<idem::Error> for ApiError { fn from(_: idem::Error) -> Self { ApiError } }
    /// # async fn demo(mut phases: idem::Phases<sqlx::Postgres>) -> Result<(), ApiError> {
    /// let outbox = phases.outbox();
    /// phases
    ///     .local("record", async |tx| -> Result<(), ApiError> {
    ///         outbox
    ///             .write(tx, "charge.created", &serde_json::json!({ "amount": 100 }))
    ///             .await?;
    ///         Ok(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn outbox(&self) -> OutboxWriter<DB> {
        let (table, scope, written) = self.outbox_parts();
        OutboxWriter {
            table,
            scope,
            written,
            engine: PhantomData,
        }
    }
}
