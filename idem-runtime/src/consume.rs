//! Idempotent consumers: a message's id recorded in the same transaction
//! as its effect, so a redelivered message is acknowledged without a
//! second effect.

use sqlx::Connection;

use crate::backend::Backend;
use crate::backend::MAX_MESSAGE_ID_LEN;
use crate::error::Error;
use crate::idem::Idem;
use crate::observe;
use crate::scope::check_scope;

/// What [`Idem::consume`] did with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumed<T> {
    /// The message was new: its effect and its record committed together;
    /// the effect's result.
    Applied(T),
    /// The message was processed before (and recorded within the
    /// retention): nothing ran. Acknowledge it.
    Duplicate,
}

/// Why [`Idem::consume`] did not record a message: nothing of its effect
/// committed, so it should be redelivered (not acknowledged).
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError<E> {
    /// The effect returned an error; its transaction rolled back.
    #[error("the message's effect failed")]
    Apply(#[source] E),
    /// The store failed (or the id or scope is invalid): the effect may
    /// not have run, and did not commit, unless the commit itself was lost
    /// on its way back, in which case a redelivery is a [`Consumed::Duplicate`].
    #[error(transparent)]
    Store(#[from] Error),
}

impl<E> From<sqlx::Error> for ConsumeError<E> {
    fn from(error: sqlx::Error) -> Self {
        Self::Store(error.into())
    }
}

impl<DB: Backend> Idem<DB> {
    /// Processes message `id` once within `scope` (the consumer's name, or
    /// a tenant's): `apply` runs in a transaction that first records
    /// `(scope, id)`, and its writes commit with that record or not at
    /// all. A message recorded before is not applied again
    /// ([`Consumed::Duplicate`]: acknowledge it); two deliveries of one
    /// message at the same moment wait for each other in the database.
    /// An `Err` from `apply` rolls back and records nothing: don't
    /// acknowledge the message, and the broker redelivers it.
    ///
    /// Records are kept for [`consumed_retention`](Self::consumed_retention)
    /// (run [`migrate_outbox`](Self::migrate_outbox) once to make their
    /// table, and [`spawn_consumed_sweeper`](Self::spawn_consumed_sweeper)
    /// to delete old ones).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// use idem::{Consumed, Idem};
    ///
    /// # async fn demo(idem: Idem<sqlx::Postgres>, id: &str, amount: i64) -> Result<(), Box<dyn std::error::Error>> {
    /// let done = idem
    ///     .consume("ledger", id, async |tx| {
    ///         sqlx::query("INSERT INTO ledger (amount) VALUES ($1)")
    ///             .bind(amount)
    ///             .execute(&mut *tx)
    ///             .await
    ///     })
    ///     .await?;
    /// match done {
    ///     Consumed::Applied(_) => println!("applied {id}"),
    ///     Consumed::Duplicate => println!("{id} was applied before"),
    /// }
    /// // Either way, acknowledge the message now.
    /// # Ok(()) }
    /// ```
    pub async fn consume<T, E, F>(
        &self,
        scope: &str,
        id: &str,
        apply: F,
    ) -> Result<Consumed<T>, ConsumeError<E>>
    where
        F: AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    {
        check_scope(scope)?;
        if id.is_empty() || id.len() > MAX_MESSAGE_ID_LEN {
            return Err(Error::InvalidMessage {
                what: "message id",
                len: id.len(),
                max: MAX_MESSAGE_ID_LEN,
            }
            .into());
        }
        let tables = &self.inner().messages;
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        if !DB::record_consumed(&mut tx, &tables.consumed, scope, id, tables.retention).await? {
            tx.rollback().await?;
            observe::consumed("duplicate");
            return Ok(Consumed::Duplicate);
        }
        match apply(&mut tx).await {
            Ok(value) => {
                tx.commit().await?;
                observe::consumed("applied");
                Ok(Consumed::Applied(value))
            }
            Err(error) => {
                // Dropping the transaction rolls it back; an explicit
                // rollback that fails leaves the connection closed.
                let _ = tx.rollback().await;
                observe::consumed("failed");
                Err(ConsumeError::Apply(error))
            }
        }
    }

    /// Deletes up to `batch` records of processed messages past their
    /// retention; returns how many went.
    pub async fn sweep_consumed(&self, batch: u32) -> Result<u64, Error> {
        Ok(DB::sweep_consumed(self.pool(), self.consumed_table_name(), batch).await?)
    }
}
