//! Run-unique names for the tables and scopes of the proxy-based suites.

use std::sync::atomic::{AtomicU64, Ordering};

/// A name no other run or test uses (tests run in parallel, and again),
/// short enough for MySQL's 64-character identifiers.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{prefix}_{}_{nanos:x}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
