//! Where messages go: the [`Sink`] a relay delivers to, and the [`Message`]
//! it delivers.

use std::future::Future;

use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::backend::MessageRow;

/// A committed outbox message, as a [`Sink`] receives it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The message's id: stable across the request's retries and the
    /// relay's redeliveries. Deduplicate on it.
    pub id: String,
    /// The scope of the request that wrote it (empty for a request without
    /// a key). The relay keeps a scope's messages in order.
    pub scope: String,
    /// The topic it was written on.
    pub topic: String,
    /// Its payload: JSON, unless written with
    /// [`OutboxWriter::write_bytes`](super::OutboxWriter::write_bytes).
    pub payload: Bytes,
    /// How many deliveries of it failed before this one.
    pub attempts: u32,
}

impl Message {
    /// The payload, decoded from JSON.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    pub(super) fn from_row(row: MessageRow) -> Self {
        Self {
            id: row.id,
            scope: String::from_utf8_lossy(&row.scope).into_owned(),
            topic: row.topic,
            payload: Bytes::from(row.payload),
            attempts: row.attempts.unsigned_abs(),
        }
    }
}

/// Why a sink did not take a message: it is delivered again later.
pub type SinkError = Box<dyn std::error::Error + Send + Sync>;

/// Where a relay delivers messages: a broker, a webhook, an email sender.
///
/// `deliver` returns `Ok` only once the message is safely taken (a
/// broker's acknowledgement of the publish); an `Err`, or no answer
/// within the relay's delivery timeout, delivers the message again later.
/// A message may be delivered more than once (a relay that stopped between
/// delivering and marking): the receiving side deduplicates on
/// [`Message::id`].
pub trait Sink: Send + Sync + 'static {
    /// Delivers one message.
    fn deliver(&self, message: &Message) -> impl Future<Output = Result<(), SinkError>> + Send;
}

/// A [`Sink`] from an async function: see [`sink_fn`].
#[derive(Debug, Clone)]
pub struct FnSink<F>(F);

/// A [`Sink`] calling `deliver` with each message.
///
/// ```
/// # use idem_runtime as idem;
/// let sink = idem::outbox::sink_fn(async |message: idem::outbox::Message| {
///     println!("{}: {}", message.topic, String::from_utf8_lossy(&message.payload));
///     Ok(())
/// });
/// # let _ = sink;
/// ```
pub fn sink_fn<F, Fut>(deliver: F) -> FnSink<F>
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), SinkError>> + Send,
{
    FnSink(deliver)
}

impl<F, Fut> Sink for FnSink<F>
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), SinkError>> + Send,
{
    fn deliver(&self, message: &Message) -> impl Future<Output = Result<(), SinkError>> + Send {
        (self.0)(message.clone())
    }
}
