//! What sits between a service and its database, as far as `idem`'s
//! statements care.

/// How the service's connections reach the database
/// ([`Idem::pooler`](crate::Idem::pooler)).
///
/// Behind a transaction-mode pooler (PgBouncer's `pool_mode = transaction`,
/// and poolers that work alike) each transaction may run on another
/// server session, so nothing may outlive a transaction: no prepared
/// statement kept by name, no session `SET`, `LISTEN` or session advisory
/// lock. Most of `idem`'s statements are written so on every setting; this
/// one only decides whether the claim, the finish and the replay's read on
/// PostgreSQL may keep their prepared statements in the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Pooler {
    /// Each connection is one database session for its whole life: a
    /// direct connection, or a pooler in session mode (the default). The
    /// claim and finish on PostgreSQL run as statements the session
    /// prepares once.
    #[default]
    Session,
    /// A pooler that hands each transaction any server session. Every
    /// statement of `idem`'s is sent whole, its values inlined, with the
    /// simple query protocol: parsed per request, which costs PostgreSQL
    /// more work than a prepared statement (docs/engines.md), and works
    /// on any session. On PostgreSQL the claim, the finish and the
    /// replay's read call functions `Idem::migrate` makes, where it made
    /// them, which keep their plans in each server session.
    Transaction,
}
