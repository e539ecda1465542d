//! The crate's error type.

/// What can go wrong outside a request: configuring [`Idem`](crate::Idem),
/// migrating its table, sweeping expired keys, or talking to the store.
///
/// Errors keep their cause as their [`source`](std::error::Error::source),
/// not in their display: a reporter that walks the chain (anyhow's `{:#}`,
/// `tracing`'s error fields, your own loop over `source()`) reaches the
/// driver's message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key store rejected a statement or could not be reached.
    #[error("idempotency key store error")]
    Database(#[from] sqlx::Error),
    /// A table name given to [`Idem::table`](crate::Idem::table) is not a plain SQL identifier.
    #[error(
        "invalid table name {0:?}: use ASCII letters, digits and `_`, optionally `schema.table`, at most 63 characters each"
    )]
    InvalidTableName(String),
    /// A header given to [`Idem::replay_headers`](crate::Idem::replay_headers) may never be replayed.
    #[error("header {0:?} may not be replayed (hop-by-hop, Set-Cookie or Content-Length)")]
    ForbiddenReplayHeader(String),
    /// A header given to [`Idem::replay_header`](crate::Idem::replay_header)
    /// cannot mark replays: hop-by-hop, `Set-Cookie`, `Content-Length`, or
    /// one of the replayed headers.
    #[error(
        "header {0:?} cannot mark replays (hop-by-hop, Set-Cookie, Content-Length, or a replayed header)"
    )]
    InvalidReplayMarker(String),
    /// The base given to
    /// [`Idem::problem_type_base`](crate::Idem::problem_type_base) is not an
    /// absolute URI.
    #[error(
        "problem type base {0:?} is not an absolute URI (e.g. https://docs.example.com/errors/)"
    )]
    InvalidProblemTypeBase(String),
    /// A payload given to the outbox did not serialise to JSON.
    #[error("outbox payload did not serialise")]
    Payload(#[source] serde_json::Error),
    /// A message id or scope given to [`Idem::consume`](crate::Idem::consume),
    /// or a topic given to the outbox, is empty or longer than the store takes.
    #[error("{what} is {len} bytes; the store takes 1 to {max}")]
    InvalidMessage {
        /// Which value: `message id`, `scope` or `topic`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The most the store takes.
        max: usize,
    },
    /// A [`Resolution`](crate::Resolution) given to
    /// [`Idem::resolve`](crate::Idem::resolve) cannot be stored: its status
    /// is not one `idem` replays, or its body did not serialise.
    #[error("invalid resolution: {0}")]
    InvalidResolution(String),
}
