//! The payment provider of the phased service: the `provider` example (a
//! fake provider that honours `Idempotency-Key`) run as a real process,
//! and the client the handler calls it with.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use super::{NewPayment, PayError};

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

impl ProviderProcess {
    /// Starts a provider that answers each `POST` after `delay` (its charge
    /// recorded first) and answers the first `fail_first` with 503.
    pub async fn start(delay: Duration, fail_first: u64) -> Self {
        Self::with_env(&[
            ("PROVIDER_DELAY_MS", &delay.as_millis().to_string()),
            ("PROVIDER_FAIL_FIRST", &fail_first.to_string()),
        ])
        .await
    }

    /// Starts a provider that charges each `POST` (a key once) and then
    /// closes its connection without an answer (`PROVIDER_LOSE_ANSWERS=1`).
    pub async fn losing_answers() -> Self {
        Self::with_env(&[("PROVIDER_LOSE_ANSWERS", "1")]).await
    }

    /// Starts the example with `env` set, on a port of its choosing.
    async fn with_env(env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(crate::examples::binary("provider"));
        command.env("PROVIDER_ADDR", "127.0.0.1:0");
        for (name, value) in env {
            command.env(name, value);
        }
        // It logs "fake provider listening on http://ADDR ..." once bound.
        let listening = |line: &str| {
            let (_, rest) = line.split_once("listening on http://")?;
            let addr: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                .collect();
            Some(addr)
        };
        let (child, addr) =
            crate::examples::start_until(command, "the provider example", listening).await;
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
