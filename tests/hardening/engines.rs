//! The conformance suite's PostgreSQL engine, at the same depth as there,
//! so that it finds the service as `super::super::app`.

#[path = "../conformance/engines/postgres.rs"]
pub mod postgres;
