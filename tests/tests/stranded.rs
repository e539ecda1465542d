//! A handler that commits its transaction itself and then fails leaves its
//! key held without a response (409 until it expires, since running it
//! again could double its effects). That is logged at error level with the
//! hashed scope and key, on every engine; a plain failure is not.

use std::sync::{Mutex, OnceLock};

use idem::{Idem, redact};
use idem_tests::service::{AppState, Holds, TestDb, send, unique};
use reqwest::StatusCode;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

const BODY: &str = r#"{"note":"stranded"}"#;

/// Every error event of the process, its fields written `name=value`.
fn errors() -> &'static Mutex<Vec<String>> {
    static ERRORS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        tracing_subscriber::registry().with(Errors).init();
    });
    ERRORS.get_or_init(Mutex::default)
}

struct Errors;

impl<S: tracing::Subscriber> Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            errors().lock().unwrap().push(fields.0);
        }
    }
}

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0 += &format!("{}={value:?} ", field.name());
    }
}

async fn committed_then_failed_is_logged<DB: TestDb>() {
    let errors = errors();
    let state = AppState {
        idem: Idem::new(DB::connect().await),
        holds: Holds::default(),
    };
    let (addr, server) = idem_tests::service::serve(state).await;
    let scope = unique("stranded");
    let http = reqwest::Client::new();
    let post = |key: &str, mode: &str| {
        http.post(format!("http://{addr}/effects"))
            .header("x-caller", &scope)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .header("x-test-mode", mode)
            .body(BODY)
    };
    let mentions = |key: &str| {
        let (scope, key) = (redact(&[&scope]), redact(&[&scope, key]));
        errors
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains(&scope) && line.contains(&key))
            .cloned()
            .collect::<Vec<_>>()
    };

    let plain = send(post("plain", "error:500")).await;
    assert_eq!(plain.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(mentions("plain").is_empty(), "{:?}", mentions("plain"));

    let stranded = send(post("early", "raw-commit-then-error:500")).await;
    assert_eq!(stranded.status, StatusCode::INTERNAL_SERVER_ERROR);
    let logged = mentions("early");
    assert_eq!(logged.len(), 1, "{}: {logged:?}", DB::ENGINE);
    assert!(
        logged[0].contains("committed its transaction itself"),
        "{logged:?}"
    );
    assert!(
        !errors
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.contains(&scope)),
        "a raw scope was logged"
    );
    // What the log warns of: the key is held.
    let retry = send(post("early", "")).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    server.abort();
}

macro_rules! stranded {
    ($($engine:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $engine() {
                committed_then_failed_is_logged::<$db>().await;
            }
        )*
    };
}

stranded! {
    postgres: sqlx::Postgres, feature = "postgres";
    sqlite: sqlx::Sqlite, feature = "sqlite";
    mysql: sqlx::MySql, feature = "mysql";
}
