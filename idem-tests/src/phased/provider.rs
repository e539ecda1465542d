//! The payment provider of the phased service: the `provider` example (a
//! fake provider that honours `Idempotency-Key`) run as a real process,
//! and the client the handler calls it with.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::{NewPayment, PayError};

/// How long the provider may take to start listening.
const STARTUP_LIMIT: Duration = Duration::from_secs(30);

/// The handler's client of the provider.
#[derive(Clone)]
pub struct ProviderApi {
    http: reqwest::Client,
    url: String,
}

/// What the provider answered a charge.
#[derive(Debug, Serialize, Deserialize)]
pub struct Charge {
    pub id: String,
}

impl ProviderApi {
    pub fn new(url: &str) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        Self {
            http,
            url: url.trim_end_matches('/').to_owned(),
        }
    }

    /// Charges `new` with `key`: the provider charges a key once.
    pub async fn charge(&self, key: &str, new: &NewPayment) -> Result<Charge, PayError> {
        let response = self
            .http
            .post(format!("{}/v1/payments", self.url))
            .header("Idempotency-Key", key)
            .json(&serde_json::json!({"amount": new.amount, "currency": new.currency}))
            .send()
            .await
            .map_err(|error| PayError::Provider(error.to_string()))?;
        if !response.status().is_success() {
            return Err(PayError::Provider(format!(
                "answered {}",
                response.status()
            )));
        }
        response
            .json()
            .await
            .map_err(|error| PayError::Provider(error.to_string()))
    }
}

/// The provider's `GET /v1/stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct ProviderStats {
    /// `POST`s so far, whatever their outcome.
    pub calls: u64,
    /// Keys charged.
    pub charges: u64,
}

/// The `provider` example in a process of its own, killed when dropped.
pub struct ProviderProcess {
    /// Its base URL.
    pub url: String,
    http: reqwest::Client,
    _child: Child,
}

/// The example binary, `target/<profile>/examples/provider`, found from
/// this test binary (`target/<profile>/deps/<test>`).
fn binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary has a path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binaries live in target/<profile>/deps");
    let path = profile_dir.join("examples").join("provider");
    assert!(
        path.is_file(),
        "the fake payment provider {} is missing: build the examples first with \
         `cargo build --examples` (`cargo test --workspace` builds them too)",
        path.display()
    );
    path
}

impl ProviderProcess {
    /// Starts a provider that answers each `POST` after `delay` (its charge
    /// recorded first) and answers the first `fail_first` with 503.
    pub async fn start(delay: Duration, fail_first: u64) -> Self {
        let mut child = Command::new(binary())
            .env("PROVIDER_ADDR", "127.0.0.1:0")
            .env("PROVIDER_DELAY_MS", delay.as_millis().to_string())
            .env("PROVIDER_FAIL_FIRST", fail_first.to_string())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the provider example starts");
        // It logs "fake provider listening on http://ADDR ..." once bound;
        // then its output is drained, so it never blocks on a full pipe.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let listening = async {
            while let Some(line) = lines.next_line().await.expect("the provider's output") {
                if let Some((_, rest)) = line.split_once("listening on http://") {
                    let addr: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                        .collect();
                    return Some(addr);
                }
            }
            None
        };
        let addr = tokio::time::timeout(STARTUP_LIMIT, listening)
            .await
            .expect("the provider listening within 30 s")
            .expect("the provider exited before listening");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            url: format!("http://{addr}"),
            http: reqwest::Client::new(),
            _child: child,
        }
    }

    /// Its calls and charges so far.
    pub async fn stats(&self) -> ProviderStats {
        self.http
            .get(format!("{}/v1/stats", self.url))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("the provider's stats")
            .json()
            .await
            .expect("the provider's stats as JSON")
    }

    /// Returns the stats once `done` holds of them, polling for up to 30 s.
    pub async fn until(&self, what: &str, done: impl Fn(&ProviderStats) -> bool) -> ProviderStats {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let stats = self.stats().await;
            if done(&stats) {
                return stats;
            }
            assert!(
                Instant::now() < deadline,
                "the provider never saw {what}: {stats:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
