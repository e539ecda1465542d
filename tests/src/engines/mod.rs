//! The engines the suite runs on, one file each. A missing server fails its
//! tests loudly; an engine whose cargo feature is off is not compiled.

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
