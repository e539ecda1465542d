//! The engines the suite runs on, one file each. A missing server fails its
//! tests loudly; an engine whose cargo feature is off is not compiled.
//!
//! Each file refers to the service as `super::super::app`, so that the
//! hardening tests can include `postgres.rs` at the same depth.

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
