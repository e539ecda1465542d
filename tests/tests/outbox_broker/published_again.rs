//! A message the relay publishes again after its mark was lost (as after
//! a relay that published and stopped before marking), later than any
//! duplicate window the broker keeps (NATS: the test stream's 100 ms;
//! RabbitMQ: none): the broker delivers it a second time, and the consumer
//! example, finding it in its record, applies it once.

use std::sync::Arc;
use std::time::Duration;

use idem_tests::examples::free_port;
use tokio::time::Instant;

use crate::harness::{
    ConsumerSettings, Deadline, Ledger, Printed, Store, TestBroker, assert_each_applied_once,
    charge, consumer, drained_and_consumed, service,
};

/// Charges, over two accounts.
const CHARGES: usize = 40;

/// The test stream's duplicate window on NATS.
const WINDOW: Duration = Duration::from_millis(100);

pub async fn a_message_published_again_after_its_mark_was_lost_is_applied_once<B: TestBroker>() {
    let deadline = Deadline::after(Duration::from_secs(120));
    let broker = B::create("outbox_again", WINDOW).await;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _service = service(dir.path(), addr, &broker, &broker.direct_url(), None).await;
    let store = Store::sqlite(dir.path()).await;
    let printed = Arc::new(Printed::default());
    let settings = ConsumerSettings {
        name: "ledger",
        ack_wait: Duration::from_secs(5),
        crash_after: None,
    };
    let _consumer = consumer(dir.path(), &broker, &settings, &printed).await;
    let ledger = Ledger::open(dir.path()).await;
    let http = reqwest::Client::new();

    for i in 0..CHARGES {
        let account = format!("acct_{}", i % 2);
        charge(&http, addr, &account, &format!("again-{i}"), 100).await;
    }
    drained_and_consumed(deadline, &store, &broker, settings.name, &printed).await;
    assert_eq!(printed.applied(), CHARGES as u64);
    assert_eq!(printed.duplicates(), 0, "one copy each so far");

    // Past the window since the last first copy was published (it was
    // applied, so published, by now): the scenario's premise, waited out.
    tokio::time::sleep_until(Instant::now() + WINDOW).await;
    let forgotten = store.forget_deliveries().await;
    assert_eq!(forgotten, CHARGES as u64, "every mark lost");

    drained_and_consumed(deadline, &store, &broker, settings.name, &printed).await;
    let again = assert_each_applied_once(&store, &broker, &ledger, &printed).await;
    assert_eq!(
        again, CHARGES,
        "each message published again and delivered a second time"
    );
    assert_eq!(printed.applied(), CHARGES as u64, "none applied twice");
    eprintln!(
        "published again: {CHARGES} messages delivered a second time past the broker's \
         duplicate window, each found applied"
    );
    broker.delete().await;
}
