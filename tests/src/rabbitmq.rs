//! RabbitMQ for the outbox's RabbitMQ tests: the local broker (a test that
//! cannot reach it fails, it never skips), a queue of a test's own (its
//! name unique to the run, so tests run in parallel and again; deleted at
//! the test's end, and by the broker an hour after its last use should a
//! failed test leave it behind), and a TCP proxy in front of the broker
//! that cuts and refuses connections.

use std::ops::Deref;
use std::time::Duration;

use idem::outbox::rabbitmq::declare_queue_with;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};

use crate::proxy::BrokerProxy;

/// Where the tests' RabbitMQ listens.
const AMQP_ADDR: &str = "127.0.0.1:5672";

/// Where the tests' RabbitMQ listens (started by `.ci/run`), as a URI.
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How long a test's queue outlives its last use: a failed test's queue
/// does not pile up.
const QUEUE_EXPIRES: Duration = Duration::from_secs(3600);

/// A connection to the local broker.
///
/// # Panics
///
/// If the broker does not answer within 10 s: the RabbitMQ tests need it.
pub async fn connect() -> Connection {
    let connecting = Connection::connect(AMQP_URL, ConnectionProperties::default());
    let outcome = tokio::time::timeout(Duration::from_secs(10), connecting).await;
    match outcome {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => not_reachable(&error),
        Err(_) => not_reachable(&"no answer within 10 s"),
    }
}

fn not_reachable(error: &dyn std::fmt::Display) -> ! {
    panic!(
        "RabbitMQ is not reachable at {AMQP_URL}: {error}; start it as .ci/run does \
         (rabbitmq-server -detached)"
    )
}

/// A quorum queue of one test's own, on its own connection.
pub struct TestQueue {
    /// The queue's name.
    pub name: String,
    connection: Connection,
    channel: Channel,
}

impl TestQueue {
    /// A name unique to this run, after `label`; the queue is not declared
    /// until [`declare`](Self::declare).
    pub async fn named(label: &str) -> TestQueue {
        let connection = connect().await;
        let channel = connection.create_channel().await.unwrap();
        TestQueue {
            name: crate::unique::unique(label),
            connection,
            channel,
        }
    }

    /// Declares a durable quorum queue unique to this run, after `label`.
    pub async fn create(label: &str) -> TestQueue {
        let queue = Self::named(label).await;
        queue.declare().await;
        queue
    }

    /// Declares the queue (durable, quorum, expiring unused) as
    /// `idem::outbox::rabbitmq::declare_queue` does.
    pub async fn declare(&self) {
        let mut arguments = FieldTable::default();
        let expires = i64::try_from(QUEUE_EXPIRES.as_millis()).unwrap();
        arguments.insert("x-expires".into(), AMQPValue::LongLongInt(expires));
        declare_queue_with(&self.channel, &self.name, arguments)
            .await
            .unwrap_or_else(|error| panic!("declaring queue {}: {error}", self.name));
    }

    /// The connection the queue was declared on (to consume, to bind).
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The channel the queue was declared on.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// How many messages wait in the queue, not delivered to a consumer
    /// (delivered and unacknowledged ones do not count).
    pub async fn ready(&self) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let queue = self
            .channel
            .queue_declare(self.name.as_str().into(), passive, FieldTable::default())
            .await
            .unwrap_or_else(|error| panic!("queue {} is there: {error}", self.name));
        queue.message_count()
    }

    /// Deletes the queue and closes the connection (at a test's end).
    pub async fn delete(self) {
        self.channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap_or_else(|error| panic!("deleting queue {}: {error}", self.name));
        let _ = self.connection.close(200, "OK".into()).await;
    }
}

/// A [`BrokerProxy`] in front of the tests' RabbitMQ, cuts, refusals and latency
/// through it (it derefs to it).
pub struct AmqpProxy(BrokerProxy);

impl Deref for AmqpProxy {
    type Target = BrokerProxy;

    fn deref(&self) -> &BrokerProxy {
        &self.0
    }
}

impl AmqpProxy {
    /// A proxy to the tests' RabbitMQ.
    pub async fn start() -> AmqpProxy {
        AmqpProxy(BrokerProxy::start(AMQP_ADDR.parse().unwrap()).await)
    }

    /// The URI an AMQP client connects to, as [`AMQP_URL`] but through the
    /// proxy.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr())
    }
}
