//! NATS JetStream for the outbox's broker tests: the local server (a test
//! that cannot reach it fails, it never skips), a stream of a test's own
//! (its name and subjects unique to the run, so tests run in parallel and
//! again), and a TCP proxy in front of the server that cuts, refuses and
//! slows connections.

use std::collections::HashMap;
use std::ops::Deref;
use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::proxy::BrokerProxy;

/// Where the tests' NATS server listens (started by `.ci/run`).
pub const NATS_ADDR: &str = "127.0.0.1:4222";

/// A JetStream context on the local server.
///
/// # Panics
///
/// If the server does not answer: the broker tests need it.
pub async fn jetstream() -> jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(NATS_ADDR)
        .await
        .unwrap_or_else(|error| {
            panic!(
                "NATS (JetStream) is not reachable at {NATS_ADDR}: {error}; start it as .ci/run \
                 does (nats-server -a 127.0.0.1 -p 4222 -js)"
            )
        });
    jetstream::new(client)
}

/// A stream of one test's own: `<NAME>` taking `<prefix>charge.>`, as the
/// examples' `NATS_STREAM` and `NATS_SUBJECT_PREFIX` name it.
pub struct TestStream {
    /// The stream's name.
    pub name: String,
    /// The subjects' prefix, ending in `.`.
    pub prefix: String,
    jetstream: jetstream::Context,
}

impl TestStream {
    /// Creates a stream unique to this run, named after `label`. Its
    /// duplicate window is short (`dedupe`), so that a message published
    /// again after a crash or a cut lands in the stream a second time and
    /// the consumer has to find it a duplicate itself. Its messages expire
    /// after an hour, should a failed test leave it behind.
    pub async fn create(label: &str, dedupe: Duration) -> TestStream {
        Self::create_on(jetstream().await, label, dedupe, 1, Duration::ZERO).await
    }

    /// As [`create`](Self::create), through `jetstream` (a server or a
    /// cluster of the test's own), kept on `replicas` servers; asked again
    /// every 250 ms for up to `patience` while the server refuses (a
    /// cluster still electing its leaders or meeting its peers).
    pub async fn create_on(
        jetstream: jetstream::Context,
        label: &str,
        dedupe: Duration,
        replicas: usize,
        patience: Duration,
    ) -> TestStream {
        let name = crate::unique::unique(label).to_uppercase();
        let prefix = format!("{}.", name.to_lowercase());
        let config = stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}charge.>")],
            duplicate_window: dedupe,
            max_age: Duration::from_secs(3600),
            num_replicas: replicas,
            ..Default::default()
        };
        let until = tokio::time::Instant::now() + patience;
        loop {
            match jetstream.create_stream(config.clone()).await {
                Ok(_) => break,
                Err(error) if tokio::time::Instant::now() >= until => {
                    panic!("create the NATS stream {name}: {error}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
        TestStream {
            name,
            prefix,
            jetstream,
        }
    }

    /// The environment the examples read to use this stream.
    pub fn env(&self) -> [(&'static str, String); 2] {
        [
            ("NATS_STREAM", self.name.clone()),
            ("NATS_SUBJECT_PREFIX", self.prefix.clone()),
        ]
    }

    /// The context the stream was made with.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// The stream's state now.
    pub async fn state(&self) -> stream::State {
        let mut stream = self.jetstream.get_stream(&self.name).await.unwrap();
        stream.info().await.unwrap().state.clone()
    }

    /// How many times each `Nats-Msg-Id` is in the stream.
    pub async fn message_ids(&self) -> HashMap<String, u32> {
        let stream = self.jetstream.get_stream(&self.name).await.unwrap();
        let last = self.state().await.last_sequence;
        let mut ids = HashMap::new();
        for sequence in 1..=last {
            let message = stream
                .get_raw_message(sequence)
                .await
                .unwrap_or_else(|error| panic!("stream message {sequence}: {error}"));
            let id = message
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|id| id.as_str().to_owned())
                .unwrap_or_else(|| panic!("stream message {sequence} has no Nats-Msg-Id"));
            *ids.entry(id).or_default() += 1;
        }
        ids
    }

    /// The durable consumer `name`'s acknowledged-or-not counts:
    /// `(waiting to be delivered, delivered and not acknowledged)`.
    pub async fn consumer_backlog(&self, name: &str) -> (u64, usize) {
        let stream = self.jetstream.get_stream(&self.name).await.unwrap();
        let mut consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(name).await.unwrap();
        let info = consumer.info().await.unwrap();
        (info.num_pending, info.num_ack_pending)
    }

    /// Deletes the stream (at a test's end).
    pub async fn delete(self) {
        self.jetstream.delete_stream(&self.name).await.unwrap();
    }
}

/// A [`BrokerProxy`] in front of the tests' NATS server, cuts, refusals and latency
/// through it (it derefs to it).
pub struct NatsProxy(BrokerProxy);

impl Deref for NatsProxy {
    type Target = BrokerProxy;

    fn deref(&self) -> &BrokerProxy {
        &self.0
    }
}

impl NatsProxy {
    /// A proxy to the tests' NATS server.
    pub async fn start() -> NatsProxy {
        NatsProxy(BrokerProxy::start(NATS_ADDR.parse().unwrap()).await)
    }

    /// The URL a NATS client connects to.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr())
    }
}
