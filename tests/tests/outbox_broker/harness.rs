//! What the broker tests share, from `idem_tests::outbox_flow`; here the
//! consumer example runs against the shared NATS server, its ledger in a
//! SQLite file of the test's directory.

use std::path::Path;
use std::sync::Arc;

use idem_tests::nats::{NATS_ADDR, TestStream};
use idem_tests::outbox_flow;
pub use idem_tests::outbox_flow::{
    ConsumerSettings, Deadline, Ledger, PgSchema, Printed, Store, assert_each_applied_once, charge,
    drained_and_consumed, service,
};
use tokio::process::Child;

/// The consumer example reading `stream` on the shared server, its ledger
/// in `dir`'s SQLite file, once it reads; its lines counted in `printed`.
pub async fn consumer(
    dir: &Path,
    stream: &TestStream,
    settings: &ConsumerSettings<'_>,
    printed: &Arc<Printed>,
) -> Child {
    let ledger = format!("sqlite:{}", dir.join("ledger.db").display());
    let nats = format!("nats://{NATS_ADDR}");
    outbox_flow::consumer(dir, &nats, &ledger, stream, settings, printed).await
}
