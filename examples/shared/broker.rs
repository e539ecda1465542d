//! The broker side that the charges example (its outbox relay) and the
//! consumer share: which broker, where it is, and where the charge events
//! go.
//!
//! - `BROKER`: `nats` (the default) or `rabbitmq`.
//!
//! NATS JetStream:
//! - `NATS_URL`: one server, or a cluster's servers separated by commas
//!   (`nats://127.0.0.1:4222,nats://127.0.0.1:4223`).
//! - `NATS_STREAM`: the stream's name, default `CHARGES`.
//! - `NATS_STREAM_REPLICAS`: the copies the cluster keeps of a stream this
//!   example creates, default 1 (an existing stream is left as it is).
//! - `NATS_SUBJECT_PREFIX`: put before every topic, default none: the
//!   stream takes `<prefix>charge.>`. (The tests give each run its own.)
//!
//! RabbitMQ:
//! - `AMQP_URL`: default `amqp://guest:guest@127.0.0.1:5672/%2f`.
//! - `AMQP_QUEUE`: the durable quorum queue the charge events go to,
//!   default `charges` (declared by whichever side starts first).

use std::time::Duration;

use async_nats::jetstream::{self, stream};

/// Which broker `BROKER` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// NATS JetStream: [`Broker`].
    Nats,
    /// RabbitMQ: [`Amqp`].
    RabbitMq,
}

/// `BROKER`: `nats` unless set.
pub fn which() -> Result<Which, String> {
    match std::env::var("BROKER").ok().as_deref() {
        None | Some("" | "nats") => Ok(Which::Nats),
        Some("rabbitmq") => Ok(Which::RabbitMq),
        Some(other) => Err(format!("BROKER={other:?}: `nats` or `rabbitmq`")),
    }
}

/// RabbitMQ and the queue of charge events.
#[derive(Debug, Clone)]
pub struct Amqp {
    /// The broker's URL.
    pub url: String,
    /// The queue's name.
    pub queue: String,
}

impl Amqp {
    /// `AMQP_URL` and `AMQP_QUEUE`, or their defaults.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
        Self {
            url: var("AMQP_URL").unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            queue: var("AMQP_QUEUE").unwrap_or_else(|| "charges".into()),
        }
    }

    /// A connection on which the queue exists (declared if missing);
    /// asked again every second until the broker answers, so a broker
    /// that is down delays the messages, never the process's start.
    pub async fn connect(&self) -> lapin::Connection {
        loop {
            match self.try_connect().await {
                Ok(connection) => return connection,
                Err(error) => {
                    tracing::warn!(%error, queue = %self.queue, "RabbitMQ not ready; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    async fn try_connect(&self) -> Result<lapin::Connection, lapin::Error> {
        let properties = lapin::ConnectionProperties::default();
        let connection = lapin::Connection::connect(&self.url, properties).await?;
        let channel = connection.create_channel().await?;
        idem::outbox::rabbitmq::declare_queue(&channel, &self.queue).await?;
        channel.close(200, "declared".into()).await?;
        Ok(connection)
    }
}

/// The broker and the stream of charge events.
pub struct Broker {
    url: String,
    /// The stream's name.
    pub stream: String,
    /// The copies of the stream, if this example creates it.
    replicas: usize,
    /// What goes before each topic to make its subject.
    pub prefix: String,
}

impl Broker {
    /// The broker at `url`, the stream and the prefix from the environment.
    pub fn from_env(url: String) -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
        Self {
            url,
            stream: var("NATS_STREAM").unwrap_or_else(|| "CHARGES".into()),
            replicas: var("NATS_STREAM_REPLICAS")
                .map(|replicas| {
                    replicas.parse().unwrap_or_else(|_| {
                        panic!("NATS_STREAM_REPLICAS={replicas:?}: a number of copies, 1 to 5")
                    })
                })
                .unwrap_or(1),
            prefix: var("NATS_SUBJECT_PREFIX").unwrap_or_default(),
        }
    }

    /// The subject a message on `topic` is published on.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}{topic}", self.prefix)
    }

    /// A JetStream context on the broker. It connects in the background
    /// and reconnects for ever, so a broker that is down (now or later)
    /// delays deliveries and never the process.
    pub async fn connect(&self) -> Result<jetstream::Context, Box<dyn std::error::Error>> {
        let servers = self
            .url
            .split(',')
            .map(|url| url.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| format!("NATS_URL={:?}: {error}", self.url))?;
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connect(servers)
            .await?;
        Ok(jetstream::new(client))
    }

    /// The stream, created if it is missing; asked again every second
    /// until the broker answers.
    pub async fn stream(&self, jetstream: &jetstream::Context) -> stream::Stream {
        let config = stream::Config {
            name: self.stream.clone(),
            subjects: vec![self.subject("charge.>")],
            num_replicas: self.replicas,
            ..Default::default()
        };
        loop {
            match jetstream.get_or_create_stream(config.clone()).await {
                Ok(stream) => return stream,
                Err(error) => {
                    tracing::warn!(
                        %error, url = %self.url, stream = %self.stream,
                        "NATS stream not ready; retrying"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}
