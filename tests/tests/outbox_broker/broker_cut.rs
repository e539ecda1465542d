//! The broker unreachable for a while (a proxy between the relay and the
//! broker cuts every connection and refuses new ones, then lets them
//! through again), the charges service's store SQLite: its requests answer
//! as promptly as before, the relay retries, and afterwards every message
//! is delivered and applied once, in order.

use std::sync::Arc;
use std::time::Duration;

use idem_tests::examples::free_port;

use crate::harness::{
    ConsumerSettings, Deadline, Ledger, LinkProxy, Printed, Store, TestBroker,
    assert_each_applied_once, charge, consumer, drained_and_consumed, service,
};

/// Charges before the cut, and during it.
const BEFORE: usize = 20;
const DURING: usize = 100;

/// The slowest a request may answer during the cut. A request waiting on
/// the broker would take the relay's delivery timeout (3 s) or more.
const PROMPT: Duration = Duration::from_secs(2);

pub async fn broker_unreachable_for_a_while_loses_nothing_and_slows_nothing<B: TestBroker>() {
    let deadline = Deadline::after(Duration::from_secs(120));
    let broker = B::create("outbox_broker_cut", Duration::from_millis(100)).await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = B::Proxy::start().await;
    let addr = free_port();
    let _service = service(dir.path(), addr, &broker, &proxy.url(), None).await;
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

    // The whole way works: written, published, applied.
    let mut before = Vec::new();
    for i in 0..BEFORE {
        let account = format!("acct_{}", i % 2);
        before.push(
            charge(&http, addr, &account, &format!("cut-before-{i}"), 100)
                .await
                .1,
        );
    }
    deadline
        .until("the first charges applied", || async {
            (ledger.rows().await == BEFORE as u64).then_some(())
        })
        .await;

    proxy.cut();
    let mut during = Vec::new();
    for i in 0..DURING {
        let account = format!("acct_{}", i % 2);
        during.push(
            charge(&http, addr, &account, &format!("cut-during-{i}"), 200)
                .await
                .1,
        );
    }
    // Held cut until the relay has failed on a message twice: it tried,
    // backed off, and tried again.
    deadline
        .until("the relay retrying through the cut", || async {
            let outbox = store.outbox().await;
            outbox.iter().any(|row| row.attempts >= 2).then_some(())
        })
        .await;
    let waiting = store.pending().await;
    assert!(
        waiting > 0,
        "messages wait for the broker while it is unreachable"
    );
    proxy.restore();

    let slowest = *during.iter().max().unwrap();
    assert!(
        slowest < PROMPT,
        "requests answered promptly while the broker was unreachable: the slowest took \
         {slowest:?} (before the cut: {:?} at most)",
        before.iter().max().unwrap()
    );

    drained_and_consumed(deadline, &store, &broker, settings.name, &printed).await;
    let again = assert_each_applied_once(&store, &broker, &ledger, &printed).await;
    assert_eq!(printed.applied(), (BEFORE + DURING) as u64);
    eprintln!(
        "broker cut: {DURING} requests answered in {:?} at most ({:?} before the cut), \
         {waiting} messages waited, {again} published twice",
        slowest,
        before.iter().max().unwrap()
    );
    broker.delete().await;
}
