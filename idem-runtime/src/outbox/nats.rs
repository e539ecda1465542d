//! NATS JetStream as the outbox relay's [`Sink`] (feature `nats`).
//!
//! Each message is published on its topic (behind an optional subject
//! prefix) with its id as `Nats-Msg-Id`, and counts as delivered once the
//! stream acknowledges it: JetStream then also drops a second publish of
//! the same id within the stream's duplicate window. A consumer reads the
//! id back with [`message_id`] and hands it to
//! [`Idem::consume`](crate::Idem::consume).

use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::PublishMessage;

use super::{Message, Sink, SinkError};

/// The header naming the message's scope on a published message.
pub const SCOPE_HEADER: &str = "Idem-Scope";

/// Publishes outbox messages to NATS JetStream.
///
/// The stream must exist and take the subjects (`<prefix><topic>`);
/// until it does, publishes fail and the relay retries them.
///
/// ```no_run
/// # use idem_runtime as idem;
/// # async fn demo(idem: idem::Idem<sqlx::Postgres>) -> Result<(), Box<dyn std::error::Error>> {
/// let client = async_nats::connect("127.0.0.1:4222").await?;
/// let jetstream = async_nats::jetstream::new(client);
/// jetstream
///     .get_or_create_stream(async_nats::jetstream::stream::Config {
///         name: "CHARGES".into(),
///         subjects: vec!["charge.>".into()],
///         ..Default::default()
///     })
///     .await?;
/// idem.relay(idem::outbox::nats::JetStream::new(jetstream)).spawn();
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JetStream {
    context: Context,
    prefix: String,
}

impl JetStream {
    /// A sink publishing through `context`, on each message's topic.
    pub fn new(context: Context) -> Self {
        Self {
            context,
            prefix: String::new(),
        }
    }

    /// Publishes on `<prefix><topic>` instead.
    pub fn subject_prefix(mut self, prefix: &str) -> Self {
        prefix.clone_into(&mut self.prefix);
        self
    }
}

impl Sink for JetStream {
    async fn deliver(&self, message: &Message) -> Result<(), SinkError> {
        let subject = format!("{}{}", self.prefix, message.topic);
        let mut publish = PublishMessage::build()
            .payload(message.payload.clone())
            .message_id(&message.id);
        if !message.scope.is_empty() {
            publish = publish.header(SCOPE_HEADER, message.scope.as_str());
        }
        // The first await sends, the second waits for the stream's ack.
        self.context.send_publish(subject, publish).await?.await?;
        Ok(())
    }
}

/// The outbox message id of a message read from JetStream (its
/// `Nats-Msg-Id`), if it has one.
pub fn message_id(message: &async_nats::Message) -> Option<&str> {
    message
        .headers
        .as_ref()?
        .get(async_nats::header::NATS_MESSAGE_ID)
        .map(|value| value.as_str())
}
