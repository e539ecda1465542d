//! What operators see: every outcome has its `idem` span and its counter,
//! claims feed the latency histogram, and no raw scope or key is recorded.
//!
//! Each test runs the service on a current-thread runtime, so everything a
//! test causes happens on its own thread. Metrics go to a thread-local
//! recorder (`metrics::with_local_recorder`). Spans go to one global
//! subscriber that tags each record with its thread: a thread-local
//! subscriber (`with_default`) would race the other test's thread over
//! tracing's per-callsite interest cache and miss spans now and then.

use idem_tests::hardening;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use hardening::{Answer, Server, connect, send, unique};
use idem::metrics::{CLAIM_SECONDS, REQUESTS_TOTAL};
use idem::{Idem, redact};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

const BODY: &str = r#"{"note":"observed"}"#;

/// What one step of the scenario must have produced.
#[derive(Debug)]
struct Expect {
    outcome: &'static str,
    /// The raw scope; `None` where the span has no scope.
    scope: Option<String>,
    /// The raw key; `None` where the span has no key.
    key: Option<String>,
    /// The `outcome` label of the claim-latency sample, if a claim ran.
    claim: Option<&'static str>,
}

/// Drives one request per outcome, calling `after` once each finished.
/// Returns the raw scopes and keys it used.
async fn scenario(mut after: impl FnMut(Expect)) -> Vec<String> {
    let server = Server::start(Idem::new(connect(4).await)).await;
    let scope = unique("obs-scope");
    let client = server.client(&scope);
    let key = |n: u32| format!("obs-key-{n}-{}", hardening::nonce());
    let (k1, k2, k3, k4) = (key(1), key(2), key(3), key(4));
    let expect = |outcome, key: Option<&String>, claim| Expect {
        outcome,
        scope: Some(scope.clone()),
        key: key.cloned(),
        claim,
    };

    let first = send(client.post(&k1, BODY)).await;
    assert_eq!(first.status, 201);
    after(expect("claimed", Some(&k1), Some("claimed")));

    assert!(send(client.post(&k1, BODY)).await.replayed());
    after(expect("replayed", Some(&k1), Some("finished")));

    let reused = send(client.post(&k1, r#"{"note":"other"}"#)).await;
    assert_eq!(reused.status, 422);
    after(expect("reused", Some(&k1), Some("finished")));

    let hold = server.state.holds.get(&k2);
    let held = tokio::spawn(
        client
            .post(&k2, BODY)
            .header("x-test-mode", format!("hold:{k2}"))
            .send(),
    );
    hold.entered().await;
    assert_eq!(send(client.post(&k2, BODY)).await.status, 409);
    after(expect("in_use", Some(&k2), Some("in_use")));
    hold.release.notify_one();
    let held = Answer::of(held.await.unwrap().unwrap()).await.unwrap();
    assert_eq!(held.status, 201);
    after(expect("claimed", Some(&k2), Some("claimed")));

    let transient = send(client.post(&k3, BODY).header("x-test-mode", "status:503")).await;
    assert_eq!(transient.status, 503);
    after(expect("rolled_back", Some(&k3), Some("claimed")));

    let panicked = send(client.post(&k4, BODY).header("x-test-mode", "panic")).await;
    assert_eq!(panicked.status, 500);
    after(expect("rolled_back", Some(&k4), Some("claimed")));

    // Refused before the claim: the span has neither scope nor key.
    assert_eq!(send(client.post("", BODY)).await.status, 400);
    after(Expect {
        outcome: "rejected",
        scope: None,
        key: None,
        claim: None,
    });

    // Refused by the body extractor (not JSON), after the key was read:
    // still `rejected`, and no claim.
    let key5 = key(5);
    let not_json = send(client.post(&key5, "{not json")).await;
    assert_eq!(not_json.status, 400, "{not_json:?}");
    after(Expect {
        outcome: "rejected",
        scope: None,
        key: None,
        claim: None,
    });

    let unkeyed = send(
        client
            .bare("/effects/optional")
            .header("content-type", "application/json")
            .body(BODY),
    )
    .await;
    assert_eq!(unkeyed.status, 201);
    after(expect("unkeyed", None, None));

    let down = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .unwrap();
    let down = Server::start(Idem::new(down)).await;
    let unavailable = send(down.client(&scope).post(&k1, BODY)).await;
    assert_eq!(unavailable.status, 503);
    after(expect("store_unavailable", Some(&k1), Some("error")));

    vec![scope, k1, k2, k3, k4]
}

/// Runs `scenario` on a current-thread runtime, on this thread.
fn run_scenario(after: impl FnMut(Expect)) -> Vec<String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(scenario(after))
}

// ---------------------------------------------------------------- tracing

/// Every span and event, with its fields as text and its thread.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Captured>>);

#[derive(Default)]
struct Captured {
    spans: Vec<SpanRecord>,
    events: Vec<EventRecord>,
    /// Spans whose `outcome` was recorded, in order, not yet checked.
    finished: Vec<usize>,
}

struct SpanRecord {
    thread: ThreadId,
    name: &'static str,
    fields: BTreeMap<String, String>,
}

struct EventRecord {
    thread: ThreadId,
    target: String,
    fields: BTreeMap<String, String>,
}

/// The process-wide capture, installed once as the global subscriber.
fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(capture.clone()),
        )
        .expect("the only global subscriber of this test binary");
        capture
    })
}

/// Where a span's record lives in `Captured::spans`.
struct SpanIndex(usize);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S> Layer<S> for Capture
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut captured = self.0.lock().unwrap();
        captured.spans.push(SpanRecord {
            thread: std::thread::current().id(),
            name: attrs.metadata().name(),
            fields,
        });
        let index = captured.spans.len() - 1;
        ctx.span(id)
            .unwrap()
            .extensions_mut()
            .insert(SpanIndex(index));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let index = span.extensions().get::<SpanIndex>().unwrap().0;
        let mut captured = self.0.lock().unwrap();
        values.record(&mut Fields(&mut captured.spans[index].fields));
        if values.contains(&span.metadata().fields().field("outcome").unwrap()) {
            captured.finished.push(index);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().events.push(EventRecord {
            thread: std::thread::current().id(),
            target: event.metadata().target().to_owned(),
            fields,
        });
    }
}

#[test]
fn every_outcome_has_its_span_and_no_raw_identifier_is_recorded() {
    let capture = capture();
    let me = std::thread::current().id();
    let mut checked = 0;
    let used = run_scenario(|expect| {
        let mut captured = capture.0.lock().unwrap();
        let (finished, others) = std::mem::take(&mut captured.finished)
            .into_iter()
            .partition::<Vec<usize>, _>(|&i| captured.spans[i].thread == me);
        captured.finished = others;
        assert_eq!(
            finished.len(),
            1,
            "one span finished per request: {expect:?}"
        );
        let span = &captured.spans[finished[0]];
        assert_eq!(span.name, "idem");
        assert_eq!(span.fields["outcome"], expect.outcome, "{expect:?}");
        let scope = expect.scope.as_deref();
        assert_eq!(
            span.fields.get("scope").cloned(),
            scope.map(|s| redact(&[s])),
            "{expect:?}"
        );
        assert_eq!(
            span.fields.get("key").cloned(),
            expect.key.as_deref().map(|k| redact(&[scope.unwrap(), k])),
            "{expect:?}"
        );
        checked += 1;
    });
    assert_eq!(checked, 11);

    // Nothing recorded anywhere holds a raw scope or key; idem's own
    // records do not hold their hex form either.
    let captured = capture.0.lock().unwrap();
    let finished_events = captured
        .events
        .iter()
        .filter(|e| {
            e.thread == me
                && e.fields.get("message").map(String::as_str)
                    == Some("idempotent request finished")
        })
        .count();
    assert_eq!(finished_events, 11, "one closing event per request");
    let records = captured.spans.iter().map(|s| ("span", &s.fields)).chain(
        captured
            .events
            .iter()
            .map(|e| (e.target.as_str(), &e.fields)),
    );
    let mut sqlx_shows_hex = false;
    for (target, fields) in records {
        for (name, value) in fields {
            for raw in &used {
                assert!(
                    !value.contains(raw.as_str()),
                    "{target}: field {name} holds the raw identifier {raw:?}: {value}"
                );
                let hex: String = raw.bytes().map(|b| format!("{b:02x}")).collect();
                if value.contains(&hex) {
                    // sqlx logs each statement at DEBUG, values inlined.
                    assert!(
                        target.starts_with("sqlx"),
                        "{target}: {name} holds {raw:?} in hex"
                    );
                    sqlx_shows_hex = true;
                }
            }
        }
    }
    if sqlx_shows_hex {
        eprintln!(
            "note: sqlx's statement log (target sqlx::query, DEBUG) shows scopes and keys \
             hex-encoded in idem's claim statements"
        );
    }
}

// ---------------------------------------------------------------- metrics

/// Counter values and histogram samples, by `(name, outcome label)`.
fn take(snapshotter: &Snapshotter) -> (HashMap<String, u64>, HashMap<String, Vec<f64>>) {
    let mut counters = HashMap::new();
    let mut histograms = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let outcome = key
            .labels()
            .find(|l| l.key() == "outcome")
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        match (key.name(), value) {
            (REQUESTS_TOTAL, DebugValue::Counter(n)) if n > 0 => {
                counters.insert(outcome, n);
            }
            (CLAIM_SECONDS, DebugValue::Histogram(samples)) if !samples.is_empty() => {
                histograms.insert(outcome, samples.into_iter().map(|s| s.0).collect());
            }
            _ => {}
        }
    }
    (counters, histograms)
}

#[test]
fn every_outcome_is_counted_and_every_claim_timed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut claims: HashMap<String, usize> = HashMap::new();
    let mut steps = 0;
    metrics::with_local_recorder(&recorder, || {
        run_scenario(|expect| {
            // Snapshots drain the counters: each one holds one request.
            let (counters, histograms) = take(&snapshotter);
            assert_eq!(
                counters,
                HashMap::from([(expect.outcome.to_owned(), 1)]),
                "{expect:?}"
            );
            for (outcome, samples) in histograms {
                for seconds in &samples {
                    assert!((0.0..30.0).contains(seconds), "{outcome}: {seconds}");
                }
                *claims.entry(outcome).or_default() += samples.len();
            }
            if let Some(claim) = expect.claim {
                *claims.entry(format!("expected {claim}")).or_default() += 1;
            }
            steps += 1;
        });
    });
    assert_eq!(steps, 11);
    // The held request's claim was timed before the duplicate's, so the
    // samples are compared in total.
    for outcome in ["claimed", "finished", "in_use", "error"] {
        assert_eq!(
            claims.get(outcome),
            claims.get(&format!("expected {outcome}")),
            "{outcome}: {claims:?}"
        );
    }
    assert_eq!(claims["claimed"], 4);
}
