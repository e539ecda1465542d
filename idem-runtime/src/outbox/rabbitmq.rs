//! RabbitMQ as the outbox relay's [`Sink`] (feature `rabbitmq`), through
//! [lapin](https://docs.rs/lapin) on tokio.
//!
//! Each message is published persistent (delivery mode 2) and mandatory,
//! on a channel in confirm mode, with its id as the AMQP `message_id`
//! property, its topic in the [`TOPIC_HEADER`] header and its scope in
//! the [`SCOPE_HEADER`] header. It counts as delivered only once the
//! broker confirms it *and* did not return it: a publish no queue takes
//! (no queue, no binding) comes back, with mandatory, and is a failed
//! delivery that the relay retries, never a silent drop; a nack is a
//! failed delivery too. RabbitMQ does not deduplicate: a consumer reads
//! the id back with [`message_id`] and hands it to
//! [`Idem::consume`](crate::Idem::consume), which applies a redelivered
//! message once.
//!
//! The messages' queue is meant to be a durable quorum queue (replicated,
//! and it confirms a publish once a majority of its replicas have it):
//! [`declare_queue`] declares one.
//!
//! Without one of lapin's TLS features (which an application turns on
//! with its own `lapin` dependency), only `amqp://` URIs connect.

use std::fmt;

use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Queue};
use tokio::sync::Mutex;

use super::{Message, Sink, SinkError};

/// The header naming the message's scope on a published message (absent
/// for a message written by a request without a key).
pub const SCOPE_HEADER: &str = "Idem-Scope";

/// The header naming the message's topic on a published message.
pub const TOPIC_HEADER: &str = "Idem-Topic";

/// AMQP's delivery mode for a message the broker writes to disk.
const PERSISTENT: u8 = 2;

/// Publishes outbox messages to RabbitMQ, with publisher confirms and
/// mandatory routing.
///
/// Made with [`to_queue`](Self::to_queue) (every message into one queue,
/// through the default exchange) or [`to_exchange`](Self::to_exchange)
/// (each message on an exchange with its topic as the routing key). Until
/// a queue takes the messages (the queue, or a binding, missing), each
/// publish is returned by the broker and fails, and the relay retries it.
///
/// The sink keeps one connection and one confirm-mode channel, shared by
/// concurrent deliveries. When the broker closes the channel (publishing
/// to a missing exchange does) or the connection drops, the deliveries on
/// it fail and the next one opens a new channel, reconnecting first if
/// need be: a broken link costs retries, never a stuck sink. A connection
/// that dies silently is noticed by AMQP's heartbeat; until then its
/// deliveries time out in the relay.
///
/// ```no_run
/// # use idem_runtime as idem;
/// # async fn demo(idem: idem::Idem<sqlx::Postgres>) -> Result<(), Box<dyn std::error::Error>> {
/// use idem::outbox::rabbitmq::{RabbitMq, declare_queue};
///
/// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let connection =
///     lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
/// declare_queue(&connection.create_channel().await?, "charges").await?;
/// idem.relay(RabbitMq::to_queue(url, "charges").await?).spawn();
/// # Ok(()) }
/// ```
pub struct RabbitMq {
    /// Kept to reconnect; not shown by `Debug` (it may hold a password).
    uri: String,
    exchange: ShortString,
    /// The queue every message goes to; `None`: the message's topic is
    /// the routing key.
    queue: Option<ShortString>,
    link: Mutex<Link>,
}

/// The connection and the confirm-mode channel deliveries share.
#[derive(Default)]
struct Link {
    connection: Option<Connection>,
    channel: Option<Channel>,
    /// Counts the channels opened, so that a failed delivery drops the
    /// channel it used and not a newer one another delivery just opened.
    generation: u64,
}

impl RabbitMq {
    /// A sink publishing every message into `queue`, through the default
    /// exchange (the queue's name as the routing key). Connects to `uri`
    /// (`amqp://user:password@host:port/vhost`, the vhost URL-encoded:
    /// `%2f` for `/`) and opens its channel now, so a wrong URI or a
    /// broker that is down fails here.
    pub async fn to_queue(uri: &str, queue: &str) -> Result<Self, lapin::Error> {
        Self::connect(uri, "", Some(ShortString::try_new(queue).map_err(short)?)).await
    }

    /// A sink publishing each message on `exchange` (which must exist),
    /// its topic as the routing key: bind queues by topic. Connects as
    /// [`to_queue`](Self::to_queue) does.
    pub async fn to_exchange(uri: &str, exchange: &str) -> Result<Self, lapin::Error> {
        Self::connect(uri, exchange, None).await
    }

    async fn connect(
        uri: &str,
        exchange: &str,
        queue: Option<ShortString>,
    ) -> Result<Self, lapin::Error> {
        let sink = Self {
            uri: uri.to_owned(),
            exchange: ShortString::try_new(exchange).map_err(short)?,
            queue,
            link: Mutex::default(),
        };
        sink.channel().await?;
        Ok(sink)
    }

    /// The shared channel (and its generation), opened, with its
    /// connection if that is gone too, when the last one closed.
    async fn channel(&self) -> Result<(Channel, u64), lapin::Error> {
        // Held while connecting: concurrent deliveries wait for one new
        // channel rather than each opening its own.
        let mut link = self.link.lock().await;
        if let Some(channel) = &link.channel
            && channel.status().connected()
        {
            return Ok((channel.clone(), link.generation));
        }
        link.channel = None;
        if !link
            .connection
            .as_ref()
            .is_some_and(|connection| connection.status().connected())
        {
            link.connection = None;
            let properties =
                ConnectionProperties::default().with_connection_name("idem outbox relay".into());
            link.connection = Some(Connection::connect(&self.uri, properties).await?);
        }
        let Some(connection) = &link.connection else {
            unreachable!("connected just above");
        };
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        link.generation += 1;
        link.channel = Some(channel.clone());
        Ok((channel, link.generation))
    }

    /// Drops the channel of `generation` after an error on it, so that
    /// the next delivery opens a new one even if lapin still calls it
    /// connected.
    async fn forget(&self, generation: u64) {
        let mut link = self.link.lock().await;
        if link.generation == generation {
            link.channel = None;
        }
    }
}

impl fmt::Debug for RabbitMq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMq")
            .field("exchange", &self.exchange)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl Sink for RabbitMq {
    async fn deliver(&self, message: &Message) -> Result<(), SinkError> {
        let routing_key = match &self.queue {
            Some(queue) => queue.clone(),
            None => ShortString::try_new(message.topic.as_str())?,
        };
        let mut headers = FieldTable::default();
        headers.insert(
            TOPIC_HEADER.into(),
            AMQPValue::LongString(message.topic.as_str().into()),
        );
        if !message.scope.is_empty() {
            headers.insert(
                SCOPE_HEADER.into(),
                AMQPValue::LongString(message.scope.as_str().into()),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(ShortString::try_new(message.id.as_str())?)
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers);
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let (channel, generation) = self.channel().await?;
        // The first await sends, the second waits for the broker's confirm.
        let confirmed = match channel
            .basic_publish(
                self.exchange.clone(),
                routing_key.clone(),
                options,
                &message.payload,
                properties,
            )
            .await
        {
            Ok(confirm) => confirm.await,
            Err(error) => Err(error),
        };
        match confirmed {
            Ok(Confirmation::Ack(None)) => Ok(()),
            // With mandatory, a message no queue took comes back before
            // its ack: it went nowhere.
            Ok(Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned))) => {
                Err(format!(
                    "returned by the broker, unroutable on exchange {:?} with routing key {:?}: \
                     {} {}",
                    self.exchange.as_str(),
                    routing_key.as_str(),
                    returned.reply_code,
                    returned.reply_text
                )
                .into())
            }
            Ok(Confirmation::Nack(None)) => Err("the broker refused the message (a nack)".into()),
            // Cannot happen on a confirm-mode channel; never a success.
            Ok(Confirmation::NotRequested) => {
                Err("the channel is not in confirm mode: no confirm".into())
            }
            Err(error) => {
                self.forget(generation).await;
                Err(error.into())
            }
        }
    }
}

/// Declares `queue` durable and of type quorum (`x-queue-type: quorum`),
/// the queue [`RabbitMq`] is meant to fill. Declaring an existing queue
/// with the same settings does nothing; with different ones the broker
/// refuses (and closes `channel`).
pub async fn declare_queue(channel: &Channel, queue: &str) -> Result<Queue, lapin::Error> {
    declare_queue_with(channel, queue, FieldTable::default()).await
}

/// [`declare_queue`] with more of the queue's arguments, such as
/// `x-expires` (the queue is deleted after that many milliseconds unused)
/// or `x-delivery-limit`.
pub async fn declare_queue_with(
    channel: &Channel,
    queue: &str,
    mut arguments: FieldTable,
) -> Result<Queue, lapin::Error> {
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let queue = ShortString::try_new(queue).map_err(short)?;
    channel.queue_declare(queue, options, arguments).await
}

/// The outbox message id of a message read from RabbitMQ (its AMQP
/// `message_id`), if it has one.
pub fn message_id(delivery: &Delivery) -> Option<&str> {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(ShortString::as_str)
}

/// The scope of the request that wrote a message read from RabbitMQ (its
/// [`SCOPE_HEADER`]), if it has one.
pub fn scope(delivery: &Delivery) -> Option<&str> {
    header(delivery, SCOPE_HEADER)
}

/// The outbox topic of a message read from RabbitMQ (its
/// [`TOPIC_HEADER`]), if it has one.
pub fn topic(delivery: &Delivery) -> Option<&str> {
    header(delivery, TOPIC_HEADER)
}

fn header<'a>(delivery: &'a Delivery, name: &str) -> Option<&'a str> {
    match delivery.properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(value) => std::str::from_utf8(value.as_bytes()).ok(),
        AMQPValue::ShortString(value) => Some(value.as_str()),
        _ => None,
    }
}

/// A name longer than AMQP's 255-byte short strings, as lapin's error
/// (an invalid input: lapin has no kind of its own for it).
fn short(error: lapin::types::ShortStringError) -> lapin::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, error).into()
}
