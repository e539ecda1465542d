//! What operators see of phases: each phase's outcome, resumes and the
//! completer's runs, counted through the `metrics` facade.
//!
//! Run on a current-thread runtime under a thread-local recorder, so the
//! counts are this test's alone (the handler, its server and the completer
//! all run on the test's thread).

use std::collections::BTreeMap;
use std::time::Duration;

use idem::metrics::{COMPLETER_TOTAL, PHASES_TOTAL, REQUESTS_TOTAL, RESUMES_TOTAL};
use idem_tests::phased::{Boundaries, LEASE, PhasedDb};
use idem_tests::unique::unique;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use reqwest::StatusCode;

use crate::harness::{Fixture, retry_while_in_use, send};

/// Every counter with a value, as `name{label=value,...}`.
fn counters(snapshotter: &Snapshotter) -> BTreeMap<String, u64> {
    let mut found = BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let DebugValue::Counter(n) = value
            && n > 0
        {
            let key = key.key();
            let labels: Vec<String> = key
                .labels()
                .map(|label| format!("{}={}", label.key(), label.value()))
                .collect();
            found.insert(format!("{}{{{}}}", key.name(), labels.join(",")), n);
        }
    }
    found
}

/// A payment whose provider fails its first two calls: the client's
/// attempt fails at the provider (its pending row committed), the
/// completer's resumption fails there too, and the client's retry
/// resumes and succeeds. Every phase, resume and completer run is counted
/// once, as it happened.
pub fn phases_are_counted<DB: PhasedDb>() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let conflicts = metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(scenario::<DB>())
    });
    let phases = PHASES_TOTAL;
    let mut expected = BTreeMap::from([
        (format!("{phases}{{phase=pending,outcome=committed}}"), 1),
        (format!("{phases}{{phase=pending,outcome=skipped}}"), 2),
        (format!("{phases}{{phase=provider,outcome=failed}}"), 2),
        (format!("{phases}{{phase=provider,outcome=called}}"), 1),
        (format!("{RESUMES_TOTAL}{{}}"), 2),
        (format!("{COMPLETER_TOTAL}{{outcome=failed}}"), 1),
        (format!("{REQUESTS_TOTAL}{{outcome=rolled_back}}"), 2),
        (format!("{REQUESTS_TOTAL}{{outcome=claimed}}"), 1),
    ]);
    // A retry that came while the completer's failed attempt still held
    // the key (a busy machine) was answered 409, and counted so.
    if conflicts > 0 {
        expected.insert(
            format!("{REQUESTS_TOTAL}{{outcome=in_use}}"),
            conflicts as u64,
        );
    }
    assert_eq!(counters(&snapshotter), expected);
}

/// Returns the 409s the client's retry met before it was served.
async fn scenario<DB: PhasedDb>() -> usize {
    let fixture = Fixture::<DB>::new(Duration::ZERO, 2).await;
    let server = fixture.serve(Boundaries::none()).await;
    let key = unique("counted");
    let failed = send(fixture.post(server.addr, &key)).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY, "{failed:?}");

    let completer = server
        .state
        .idem
        .completer(DB::phased_router(server.state.clone()))
        .backoff(Duration::from_millis(1));
    let run = completer.run_once().await.expect("a completer pass");
    assert_eq!((run.resumed, run.completed), (1, 0), "{run:?}");

    let (paid, conflicts) = retry_while_in_use(|| fixture.post(server.addr, &key), LEASE).await;
    assert_eq!(paid.status, StatusCode::CREATED, "{paid:?}");
    assert!(!paid.replayed());
    drop(server);
    fixture.discard().await;
    conflicts
}
