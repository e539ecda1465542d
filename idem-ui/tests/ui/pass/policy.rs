//! Every handler publishes its policy, as its arguments set it, through
//! `idem::IdempotentHandler` (read with `idem::Policy::of`), for
//! documentation such as `idem::openapi`.
#![deny(warnings, clippy::all)]

// The shared caller and application state.
use idem_ui as support;

use std::time::Duration;

use axum::extract::Json;
use idem::{IdempotentHandler, Phases, Policy, Tx, idempotent};
use sqlx::Postgres;
use support::Account;

#[idempotent(scope = "account")]
async fn defaults(account: Account, mut tx: Tx<Postgres>) -> &'static str {
    let _ = (account, &mut tx);
    "created"
}

#[idempotent(
    scope = "account",
    ttl = "7d",
    key = "optional",
    wait = "2s",
    timeout = "10s",
    fingerprint(exclude = ["/client_ts", "/trace/id"])
)]
async fn every_argument(account: Account, mut tx: Tx<Postgres>, Json(n): Json<i64>) -> String {
    let _ = (account, &mut tx);
    n.to_string()
}

#[idempotent(scope = "account", lease = "5s")]
async fn phased(account: Account, phases: Phases<Postgres>) -> &'static str {
    let _ = (account, phases);
    "paid"
}

fn main() {
    let policy = Policy::of(defaults);
    assert!(policy.key_required());
    assert_eq!(policy.ttl(), Duration::from_secs(24 * 60 * 60));
    assert_eq!(policy.wait(), Duration::ZERO);
    assert_eq!(policy.timeout(), Duration::from_secs(30));
    assert_eq!(policy.lease(), None);
    assert!(policy.excluded().is_empty());

    let policy = <every_argument as IdempotentHandler>::POLICY;
    assert!(!policy.key_required());
    assert_eq!(policy.ttl(), Duration::from_secs(7 * 24 * 60 * 60));
    assert_eq!(policy.wait(), Duration::from_secs(2));
    assert_eq!(policy.timeout(), Duration::from_secs(10));
    assert_eq!(policy.excluded(), ["/client_ts", "/trace/id"]);

    let policy = Policy::of(phased);
    assert_eq!(policy.lease(), Some(Duration::from_secs(5)));
    assert!(policy.key_required());
}
