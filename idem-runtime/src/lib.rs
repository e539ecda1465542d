//! Runtime of [`idem`](https://docs.rs/idem): claim, replay and finish of
//! idempotent requests, and the stores they use.
//!
//! Depend on the `idem` facade crate rather than on this one; it re-exports
//! everything here together with the `#[idempotent]` attribute.

#![warn(missing_docs)]

mod backend;
mod error;
mod fingerprint;
mod idem;
mod key;
mod observe;
mod problem;
mod protocol;
mod recent;
mod response;
mod scope;
mod tx;

pub use backend::{Backend, Claim, ClaimOutcome, OpenTx};
pub use error::Error;
pub use fingerprint::{Fingerprint, canonicalize};
pub use idem::{DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TABLE, Idem};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, MAX_KEY_LEN, parse_key, parse_key_value};
pub use observe::{CLAIM_SECONDS, Outcome, REQUESTS_TOTAL, redact};
pub use problem::Problem;
pub use response::{
    CaptureError, DEFAULT_REPLAY_HEADERS, IDEMPOTENT_REPLAYED, StoredResponse, decode_headers,
    is_storable,
};
pub use scope::Scope;
pub use tx::Tx;

/// What `#[idempotent]` expands to. Not a public API: it changes without notice.
#[doc(hidden)]
pub mod __private {
    pub use crate::protocol::{Config, KeyMode, Prepared, prepare, run};
    pub use axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
    pub use axum::handler::Handler;
    pub use axum::response::{IntoResponse, Response};

    /// The future a generated handler returns.
    pub type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send>>;

    /// Splits a request for the parts extractors.
    pub fn into_parts(request: Request) -> (http::request::Parts, axum::body::Body) {
        request.into_parts()
    }
}
