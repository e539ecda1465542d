//! The consumer killed mid-message, again and again: it aborts right after
//! a message's effect commits, before its acknowledgement, and the broker
//! delivers the message again to the next run. Over 1,000 messages, each
//! is applied exactly once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use idem_tests::nats::TestStream;

use crate::harness::{ConsumerSettings, Deadline, Ledger, Printed, consumer};

const MESSAGES: usize = 1_000;

/// Each run aborts after applying this many (in turn): from a crash at
/// its first message to one after a few pull batches.
const CRASH_AFTER: [u32; 8] = [1, 17, 41, 5, 64, 23, 2, 97];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_after_its_effect_applies_each_message_once() {
    let deadline = Deadline::after(Duration::from_secs(180));
    let stream = TestStream::create("outbox_consumer_kill", Duration::from_secs(120)).await;
    let dir = tempfile::tempdir().unwrap();

    // Published as the relay publishes: on the topic, with the id.
    let subject = format!("{}charge.created", stream.prefix);
    let mut published = HashSet::new();
    let mut acks = Vec::new();
    for i in 0..MESSAGES {
        let id = format!("{}-{i}", stream.name);
        let payload = serde_json::json!({
            "charge_id": i, "account": format!("acct_{}", i % 5), "amount": 100 + i,
            "currency": "eur",
        });
        let publish = PublishMessage::build()
            .payload(serde_json::to_vec(&payload).unwrap().into())
            .message_id(&id);
        acks.push(
            stream
                .jetstream()
                .send_publish(subject.clone(), publish)
                .await
                .unwrap(),
        );
        published.insert(id);
    }
    for ack in acks {
        ack.await.expect("the stream takes the message");
    }
    assert_eq!(stream.state().await.messages, MESSAGES as u64);

    let printed = Arc::new(Printed::default());
    let mut crashes = 0;
    let ledger = loop {
        let settings = ConsumerSettings {
            name: "ledger",
            ack_wait: Duration::from_millis(500),
            crash_after: Some(CRASH_AFTER[crashes % CRASH_AFTER.len()]),
        };
        let mut run = consumer(dir.path(), &stream, &settings, &printed).await;
        let ledger = Ledger::open(dir.path()).await;
        let done = deadline.until("every message applied and acknowledged", || async {
            let backlog = stream.consumer_backlog(settings.name).await;
            let rows = ledger.rows().await;
            (backlog == (0, 0) && rows == MESSAGES as u64).then_some(())
        });
        tokio::select! {
            status = run.wait() => {
                let status = status.unwrap();
                assert!(!status.success(), "a run ends only by its abort: {status}");
                crashes += 1;
            }
            () = done => break ledger,
        }
    };

    let (messages, _) = ledger.entries().await;
    let twice: Vec<_> = messages.iter().filter(|(_, count)| **count > 1).collect();
    assert!(twice.is_empty(), "messages applied twice: {twice:?}");
    let applied: HashSet<String> = messages.into_keys().collect();
    assert_eq!(applied, published, "the ledger has every published message");
    assert_eq!(printed.applied(), MESSAGES as u64);
    assert!(crashes >= 10, "the consumer crashed {crashes} times");
    assert!(
        printed.duplicates() >= crashes as u64,
        "each crash's message delivered again and found applied: {} duplicates, {crashes} \
         crashes",
        printed.duplicates()
    );
    eprintln!(
        "consumer: {MESSAGES} messages applied once each over {} runs, {crashes} aborted \
         between commit and ack; {} redeliveries found applied",
        crashes + 1,
        printed.duplicates()
    );
    stream.delete().await;
}
