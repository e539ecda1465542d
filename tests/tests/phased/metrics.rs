//! What operators see of phases: each phase's outcome, resumes and the
//! completer's runs, counted through the `metrics` facade.
//!
//! Run on a current-thread runtime under a thread-local recorder, so the
//! counts are this test's alone (the handler, its server and the completer
//! all run on the test's thread).

use std::collections::BTreeMap;
use std::time::Duration;

use idem::metrics::{
    COMPLETER_TOTAL, PHASES_TOTAL, REQUESTS_TOTAL, RESOLVED_TOTAL, RESUMES_TOTAL, UNCERTAIN_KEYS,
    UNCERTAIN_TOTAL,
};
use idem::{Resolution, Resolved};
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

/// One snapshot: the value of gauge `name` labelled `table=table`, if
/// set, with the counters added to `counted` (a snapshot drains them).
fn gauge(
    snapshotter: &Snapshotter,
    name: &str,
    table: &str,
    counted: &mut BTreeMap<String, u64>,
) -> Option<f64> {
    let mut found = None;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        match value {
            DebugValue::Gauge(value)
                if key.name() == name && labels == [format!("table={table}")] =>
            {
                found = Some(value.0);
            }
            DebugValue::Counter(n) if n > 0 => {
                let name = format!("{}{{{}}}", key.name(), labels.join(","));
                *counted.entry(name).or_default() += n;
            }
            _ => {}
        }
    }
    found
}

/// A key whose provider never answers well, given one attempt: the
/// completer's resumption fails, its next pass makes the key uncertain
/// (counted, and the gauge of the table's uncertain keys says 1), and an
/// operator's resolution is counted and brings the gauge back to 0.
pub fn uncertainty_is_counted<DB: PhasedDb>() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let gauges = metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(uncertain_then_resolved::<DB>(&snapshotter))
    });
    let (gauges, counted) = gauges;
    assert_eq!(gauges, (Some(1.0), Some(0.0)), "the table's uncertain keys");
    for (name, count) in [
        (format!("{UNCERTAIN_TOTAL}{{reason=attempts_exhausted}}"), 1),
        (format!("{COMPLETER_TOTAL}{{outcome=uncertain}}"), 1),
        (format!("{RESOLVED_TOTAL}{{outcome=not_started}}"), 1),
    ] {
        assert_eq!(counted.get(&name), Some(&count), "{name}: {counted:?}");
    }
}

/// The gauge after the pass that made the key uncertain, and after the
/// pass that followed its resolution; the counters by then.
async fn uncertain_then_resolved<DB: PhasedDb>(
    snapshotter: &Snapshotter,
) -> ((Option<f64>, Option<f64>), BTreeMap<String, u64>) {
    let mut counted = BTreeMap::new();
    let fixture = Fixture::<DB>::new(Duration::ZERO, 1_000).await;
    let server = fixture
        .serve_configured(Boundaries::none(), |idem| idem.max_attempts(1))
        .await;
    let key = unique("uncertain");
    let failed = send(fixture.post(server.addr, &key)).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY, "{failed:?}");
    let idem = &server.state.idem;
    let completer = idem
        .completer(DB::phased_router(server.state.clone()))
        .backoff(Duration::ZERO);
    let run = completer.run_once().await.expect("a completer pass");
    assert_eq!((run.resumed, run.uncertain), (1, 0), "{run:?}");
    let run = completer.run_once().await.expect("a completer pass");
    assert_eq!((run.resumed, run.uncertain), (0, 1), "{run:?}");
    let table = &fixture.config.keys;
    let before = gauge(snapshotter, UNCERTAIN_KEYS, table, &mut counted);
    let resolved = idem.resolve(&fixture.account, &key, Resolution::not_started());
    assert_eq!(resolved.await.unwrap(), Resolved::Resolved);
    completer.run_once().await.expect("a completer pass");
    let after = gauge(snapshotter, UNCERTAIN_KEYS, table, &mut counted);
    drop(server);
    fixture.discard().await;
    ((before, after), counted)
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
