//! A fake payment provider, standalone: the downstream API to call with an
//! `Idempotency-Key`, misbehaving on demand (see `shared/fake_provider.rs`).
//!
//! ```text
//! PROVIDER_FAIL_FIRST=1 PROVIDER_DELAY_MS=200 cargo run --example provider
//! # 503 + Retry-After: 1 (the first call), then 201, then a replay:
//! curl -i -X POST localhost:3001/v1/payments -H 'Idempotency-Key: order-42' \
//!      -H 'Content-Type: application/json' -d '{"amount": 1250, "currency": "eur"}'
//! # The same key with another body: 422.
//! curl -i -X POST localhost:3001/v1/payments -H 'Idempotency-Key: order-42' \
//!      -H 'Content-Type: application/json' -d '{"amount": 9999, "currency": "eur"}'
//! # How many POSTs arrived, how many keys were charged.
//! curl -i localhost:3001/v1/stats
//!
//! PROVIDER_LOSE_ANSWERS=1 cargo run --example provider
//! # Charged (see /v1/stats), then "Empty reply from server": no status.
//! curl -i -X POST localhost:3001/v1/payments -H 'Idempotency-Key: order-43' \
//!      -H 'Content-Type: application/json' -d '{"amount": 1250, "currency": "eur"}'
//! ```
//!
//! Environment:
//! - `PROVIDER_ADDR`: where to listen, default `127.0.0.1:3001`.
//! - `PROVIDER_DELAY_MS`: every `POST` waits this long after recording its
//!   outcome, before answering (default 0): kill the caller meanwhile and the
//!   charge stays.
//! - `PROVIDER_FAIL_FIRST`: the first N `POST`s answer `503` (default 0).
//! - `PROVIDER_LOSE_ANSWERS`: `1`, every `POST /v1/payments` has its outcome
//!   decided (a new key charged and counted in `/v1/stats`, a known key
//!   replayed) and then its connection closed without an answer: the caller
//!   gets a connection error, never a status, as when a provider charged
//!   and its answer was lost. `0` (the default): answers are sent.
//! - `RUST_LOG`: log filter, default `info` (one line per call).

#[path = "shared/fake_provider.rs"]
mod fake_provider;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    if let Err(message) = run().await {
        eprintln!("provider: {message}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), String> {
    let settings = fake_provider::Settings::from_env()?;
    let addr = std::env::var("PROVIDER_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|error| format!("cannot listen on {addr} (PROVIDER_ADDR): {error}"))?;
    let local = listener
        .local_addr()
        .map_err(|error| format!("cannot read the listening address: {error}"))?;
    tracing::info!(
        delay_ms = settings.delay.as_millis(),
        fail_first = settings.fail_first,
        lose_answers = settings.lose_answers,
        "fake provider listening on http://{local}"
    );
    fake_provider::serve(listener, settings)
        .await
        .map_err(|error| format!("serving on {local} failed: {error}"))
}
