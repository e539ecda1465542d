//! What `idem`'s integration tests and benchmarks share: the service under
//! test and its engines, the hardening harness, the protocol-aware proxies
//! and the callers. Not published; a dev-only crate of the workspace.

pub mod account;
pub mod browser;
pub mod chart;
pub mod delay;
pub mod engines;
pub mod examples;
pub mod half_open;
#[cfg(feature = "postgres")]
pub mod hardening;
#[cfg(feature = "mysql")]
pub mod mysql_proxy;
pub mod nats;
pub mod nats_cluster;
#[cfg(feature = "postgres")]
pub mod outbox_flow;
#[cfg(feature = "postgres")]
pub mod patroni;
pub mod peer;
pub mod pg_proxy;
#[cfg(feature = "postgres")]
pub mod pgbouncer;
pub mod phased;
pub mod postgres_user;
pub mod proxied;
pub mod proxy;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
pub mod round_trip_service;
pub mod service;
pub mod stats;
pub mod unique;
