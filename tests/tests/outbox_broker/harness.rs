//! What the broker tests share, from `idem_tests::outbox_flow`, and the
//! broker they run on: [`TestBroker`], NATS JetStream ([`Nats`], a stream
//! of the test's own) or RabbitMQ ([`RabbitMq`], a queue of the test's
//! own). The consumer example runs against the broker directly, its
//! ledger in a SQLite file of the test's directory; the charges example's
//! relay through the broker's [`LinkProxy`] when a test needs to slow or
//! cut it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idem_tests::nats::{NATS_ADDR, NatsProxy, TestStream};
use idem_tests::outbox_flow;
pub use idem_tests::outbox_flow::{
    ConsumerSettings, Deadline, Ledger, PgSchema, Printed, Store, charge,
};
use idem_tests::proxy::BrokerProxy;
use tokio::process::Child;

/// A TCP proxy between the examples and the broker: slows the broker's
/// answers, cuts the link.
pub trait LinkProxy: Send + Sync {
    async fn start() -> Self;
    /// The URL the examples connect to, through the proxy.
    fn url(&self) -> String;
    /// Each chunk of the broker's bytes held this long.
    fn set_latency(&self, latency: Duration);
    /// The broker unreachable: connections dropped and refused.
    fn cut(&self);
    /// The broker reachable again.
    fn restore(&self);
}

impl LinkProxy for NatsProxy {
    async fn start() -> Self {
        NatsProxy::start().await
    }

    fn url(&self) -> String {
        NatsProxy::url(self)
    }

    fn set_latency(&self, latency: Duration) {
        BrokerProxy::set_latency(self, latency);
    }

    fn cut(&self) {
        BrokerProxy::cut(self);
    }

    fn restore(&self) {
        BrokerProxy::restore(self);
    }
}

/// The broker a scenario runs on: where the charge events go, as the
/// examples' variables name it, and what the test reads of it.
pub trait TestBroker: Sized + Send + Sync {
    type Proxy: LinkProxy;

    /// A destination of the test's own, named after `label`. NATS keeps
    /// duplicates apart for `dedupe` (short: a message published again
    /// after a crash or a cut lands in the stream again, for the consumer
    /// to find applied); RabbitMQ has no such window.
    async fn create(label: &str, dedupe: Duration) -> Self;

    /// The examples' variables to reach it at `url` (the broker's or a
    /// proxy's).
    fn env(&self, url: &str) -> Vec<(&'static str, String)>;

    /// The broker's own URL, no proxy between.
    fn direct_url(&self) -> String;

    /// How many copies the broker holds, none consumed yet (read before
    /// any consumer runs).
    async fn held(&self) -> u64;

    /// Publishes `messages` (`(id, payload)`) as the relay does, with the
    /// outbox id where the consumer reads it; returns once the broker
    /// confirmed each.
    async fn publish(&self, messages: &[(String, Vec<u8>)]);

    /// Waits until the consumer example (its durable consumer `consumer`)
    /// has handled and acknowledged every copy the broker holds, its
    /// lines read into `printed`.
    async fn settle(&self, deadline: Deadline, consumer: &str, printed: &Printed);

    /// Checks the broker's side once settled: every outbox message
    /// (`outbox`) reached it, and nothing else. Returns how many copies
    /// beyond the first it delivered (the relay's redeliveries).
    async fn copies_beyond_first(&self, outbox: &HashSet<String>, printed: &Printed) -> usize;

    /// Removes the destination (at the test's end).
    async fn delete(self);
}

/// NATS JetStream on 127.0.0.1:4222: a stream of the test's own.
pub struct Nats(TestStream);

impl TestBroker for Nats {
    type Proxy = NatsProxy;

    async fn create(label: &str, dedupe: Duration) -> Self {
        Nats(TestStream::create(label, dedupe).await)
    }

    fn env(&self, url: &str) -> Vec<(&'static str, String)> {
        let mut env = vec![("BROKER", "nats".to_owned()), ("NATS_URL", url.to_owned())];
        env.extend(self.0.env());
        env
    }

    fn direct_url(&self) -> String {
        format!("nats://{NATS_ADDR}")
    }

    async fn held(&self) -> u64 {
        self.0.state().await.messages
    }

    async fn publish(&self, messages: &[(String, Vec<u8>)]) {
        use async_nats::jetstream::message::PublishMessage;
        // On the topic, with the id, as the relay publishes.
        let subject = format!("{}charge.created", self.0.prefix);
        let mut acks = Vec::new();
        for (id, payload) in messages {
            let publish = PublishMessage::build()
                .payload(payload.clone().into())
                .message_id(id);
            let ack = self.0.jetstream().send_publish(subject.clone(), publish);
            acks.push(ack.await.unwrap());
        }
        for ack in acks {
            ack.await.expect("the stream takes the message");
        }
    }

    async fn settle(&self, deadline: Deadline, consumer: &str, printed: &Printed) {
        deadline
            .until("every message consumed and acknowledged", || async {
                let backlog = self.0.consumer_backlog(consumer).await;
                let copies = self.0.state().await.messages;
                (backlog == (0, 0) && printed.total() >= copies).then_some(())
            })
            .await;
    }

    async fn copies_beyond_first(&self, outbox: &HashSet<String>, printed: &Printed) -> usize {
        let in_stream = self.0.message_ids().await;
        for id in outbox {
            assert!(
                in_stream.contains_key(id),
                "message {id} never reached the stream"
            );
        }
        assert_eq!(
            in_stream.len(),
            outbox.len(),
            "the stream holds nothing but the outbox's messages"
        );
        let again = in_stream.values().map(|count| *count as usize - 1).sum();
        assert_eq!(
            printed.duplicates(),
            again as u64,
            "each copy in the stream found applied"
        );
        again
    }

    async fn delete(self) {
        self.0.delete().await;
    }
}

#[cfg(feature = "rabbitmq")]
pub use self::rabbitmq::RabbitMq;

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use idem_tests::rabbitmq::{AMQP_URL, AmqpProxy, TestQueue, connect};
    use lapin::BasicProperties;
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
    use lapin::types::ShortString;

    use super::{BrokerProxy, Deadline, LinkProxy, Printed, TestBroker};

    impl LinkProxy for AmqpProxy {
        async fn start() -> Self {
            AmqpProxy::start().await
        }

        fn url(&self) -> String {
            AmqpProxy::url(self)
        }

        fn set_latency(&self, latency: Duration) {
            BrokerProxy::set_latency(self, latency);
        }

        fn cut(&self) {
            BrokerProxy::cut(self);
        }

        fn restore(&self) {
            BrokerProxy::restore(self);
        }
    }

    /// RabbitMQ on 127.0.0.1:5672: a queue of the test's own, declared as
    /// the examples declare it (durable, quorum, no other argument: a
    /// declaration with any other is refused), so it is deleted at the
    /// test's end, or, should the test fail first, when it is dropped.
    pub struct RabbitMq {
        queue: Option<TestQueue>,
        /// The fences [`settle`](TestBroker::settle) published.
        fences: AtomicU64,
    }

    impl RabbitMq {
        fn queue(&self) -> &TestQueue {
            self.queue
                .as_ref()
                .expect("the queue is there until deleted")
        }
    }

    impl TestBroker for RabbitMq {
        type Proxy = AmqpProxy;

        async fn create(label: &str, _dedupe: Duration) -> Self {
            let queue = TestQueue::named(label).await;
            idem::outbox::rabbitmq::declare_queue(queue.channel(), &queue.name)
                .await
                .unwrap_or_else(|error| panic!("declaring queue {}: {error}", queue.name));
            RabbitMq {
                queue: Some(queue),
                fences: AtomicU64::new(0),
            }
        }

        fn env(&self, url: &str) -> Vec<(&'static str, String)> {
            vec![
                ("BROKER", "rabbitmq".to_owned()),
                ("AMQP_URL", url.to_owned()),
                ("AMQP_QUEUE", self.queue().name.clone()),
            ]
        }

        fn direct_url(&self) -> String {
            AMQP_URL.to_owned()
        }

        async fn held(&self) -> u64 {
            self.queue().ready().await.into()
        }

        async fn publish(&self, messages: &[(String, Vec<u8>)]) {
            let queue = self.queue();
            let channel = queue.connection().create_channel().await.unwrap();
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            let mut confirms = Vec::new();
            for (id, payload) in messages {
                // Persistent, with the id, as the relay publishes.
                let properties = BasicProperties::default()
                    .with_message_id(ShortString::from(id.as_str()))
                    .with_delivery_mode(2);
                let options = BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                };
                let confirm = channel
                    .basic_publish(
                        "".into(),
                        queue.name.as_str().into(),
                        options,
                        payload,
                        properties,
                    )
                    .await
                    .unwrap();
                confirms.push(confirm);
            }
            for confirm in confirms {
                let confirmation = confirm.await.expect("the broker confirms");
                assert!(
                    confirmation.is_ack() && confirmation.take_message().is_none(),
                    "the queue takes the message"
                );
            }
            let _ = channel.close(200, "published".into()).await;
        }

        /// No count of acknowledged messages over AMQP: a fence (a message
        /// the consumer drops as unreadable) goes in behind every copy the
        /// broker holds, and the consumer, taking one at a time and
        /// acknowledging each before the next, has handled them all once
        /// it drops the fence. A fence is counted once the queue confirms
        /// it: a settle cancelled mid-publish (its consumer run aborted)
        /// leaves no fence counted that the queue may not hold.
        async fn settle(&self, deadline: Deadline, _consumer: &str, printed: &Printed) {
            let id = format!("fence-{}", self.fences.load(Ordering::SeqCst) + 1);
            self.publish(&[(id, b"a fence, not a charge".to_vec())])
                .await;
            let fence = self.fences.fetch_add(1, Ordering::SeqCst) + 1;
            deadline
                .until("every message consumed and acknowledged", || async {
                    (printed.dropped() >= fence && self.queue().ready().await == 0).then_some(())
                })
                .await;
        }

        async fn copies_beyond_first(&self, _outbox: &HashSet<String>, printed: &Printed) -> usize {
            // The queue kept none of what the consumer acknowledged: what
            // it handled is what the queue held. The ledger's check (one
            // row per outbox message) is the caller's.
            assert_eq!(self.queue().ready().await, 0, "nothing left in the queue");
            usize::try_from(printed.duplicates()).unwrap()
        }

        async fn delete(mut self) {
            let queue = self.queue.take().unwrap();
            queue.delete().await;
        }
    }

    impl Drop for RabbitMq {
        /// A failed test's queue: deleted from a thread of its own (the
        /// test's runtime may be unwinding), on a connection of its own.
        fn drop(&mut self) {
            let Some(queue) = self.queue.take() else {
                return;
            };
            let name = queue.name.clone();
            drop(queue);
            let deleting = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async {
                    let connection = connect().await;
                    let channel = connection.create_channel().await.unwrap();
                    let deleted = channel
                        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                        .await;
                    if let Err(error) = deleted {
                        eprintln!("deleting the left-behind queue {name}: {error}");
                    }
                    let _ = connection.close(200, "OK".into()).await;
                });
            });
            let _ = deleting.join();
        }
    }
}

/// The charges example on `addr`, its relay publishing to `broker` at
/// `url`; its store `database_url` (default: `dir`'s SQLite file).
pub async fn service<B: TestBroker>(
    dir: &Path,
    addr: SocketAddr,
    broker: &B,
    url: &str,
    database_url: Option<&str>,
) -> Child {
    outbox_flow::service_on(dir, addr, &broker.env(url), database_url).await
}

/// The consumer example reading `broker` directly, its ledger in `dir`'s
/// SQLite file, once it reads; its lines counted in `printed`.
pub async fn consumer<B: TestBroker>(
    dir: &Path,
    broker: &B,
    settings: &ConsumerSettings<'_>,
    printed: &Arc<Printed>,
) -> Child {
    let ledger = format!("sqlite:{}", dir.join("ledger.db").display());
    let env = broker.env(&broker.direct_url());
    outbox_flow::consumer_on(dir, &env, &ledger, settings, printed).await
}

/// Waits until the outbox has delivered every message and the consumer
/// `consumer` has handled and acknowledged every copy the broker holds.
pub async fn drained_and_consumed<B: TestBroker>(
    deadline: Deadline,
    store: &Store,
    broker: &B,
    consumer: &str,
    printed: &Printed,
) {
    deadline
        .until("the outbox delivered", || async {
            (store.pending().await == 0).then_some(())
        })
        .await;
    broker.settle(deadline, consumer, printed).await;
}

/// Every message ends applied exactly once and in its scope's order: the
/// service's committed charges, its outbox, the broker and the ledger
/// agree. Returns how many copies beyond the first the broker delivered
/// (the relay's redeliveries), each of which the consumer found applied.
pub async fn assert_each_applied_once<B: TestBroker>(
    store: &Store,
    broker: &B,
    ledger: &Ledger,
    printed: &Printed,
) -> usize {
    let charges = store.charges().await;
    let outbox = store.outbox().await;
    assert_eq!(
        outbox.len(),
        charges.len(),
        "one outbox message per committed charge"
    );
    assert!(
        outbox.iter().all(|row| row.delivered),
        "every message marked delivered"
    );
    let ids: HashSet<String> = outbox.iter().map(|row| row.id.clone()).collect();
    let again = broker.copies_beyond_first(&ids, printed).await;

    let (messages, charged) = ledger.entries().await;
    let twice: Vec<_> = messages.iter().filter(|(_, count)| **count > 1).collect();
    assert!(twice.is_empty(), "messages applied twice: {twice:?}");
    let applied: HashSet<String> = messages.into_keys().collect();
    assert_eq!(applied, ids, "the ledger has every outbox message");
    let mut applied: Vec<i64> = charged.keys().copied().collect();
    applied.sort_unstable();
    assert_eq!(applied, charges, "the ledger has each committed charge");
    assert_eq!(printed.applied(), outbox.len() as u64, "each applied once");
    assert_eq!(
        printed.duplicates(),
        again as u64,
        "each copy found applied"
    );
    assert_scope_order(store, ledger).await;
    again
}

/// Each scope's messages applied in the order they were written.
async fn assert_scope_order(store: &Store, ledger: &Ledger) {
    let order: HashMap<String, usize> = ledger
        .applied_order()
        .await
        .into_iter()
        .enumerate()
        .map(|(at, id)| (id, at))
        .collect();
    for (scope, written) in store.scopes().await {
        let mut applied = written.clone();
        applied.sort_by_key(|id| order[id]);
        assert_eq!(
            applied, written,
            "scope {scope}'s messages applied in the order written"
        );
    }
}

/// The accounts whose charges (`charge_id` counting up, the order they
/// were published in) were not applied in that order: the account, and
/// the order applied.
pub async fn accounts_out_of_order(ledger: &Ledger) -> Vec<(String, Vec<i64>)> {
    let mut out_of_order: Vec<_> = ledger
        .charges_by_account()
        .await
        .into_iter()
        .filter(|(_, charges)| !charges.is_sorted())
        .collect();
    out_of_order.sort();
    out_of_order
}
