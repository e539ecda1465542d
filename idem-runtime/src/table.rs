//! Table names: what `idem` accepts as one (a plain identifier, optionally
//! `schema.table`, so a name can be written into SQL as it is), and where
//! the outbox's tables go beside the key table.

use std::sync::Arc;
use std::time::Duration;

use crate::wake::Wake;

/// Whether `name` is a plain identifier, optionally `schema.table`, each
/// part within PostgreSQL's 63 bytes: safe to write into SQL unquoted.
pub(crate) fn is_table_name(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    parts.len() <= 2
        && parts.iter().all(|part| {
            let mut chars = part.chars();
            part.len() <= 63
                && chars
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// The names of the outbox and consumed-messages tables: beside the key
/// table (`<table>_outbox`, `<table>_consumed`) unless set.
#[derive(Debug, Clone)]
pub(crate) struct Tables {
    pub(crate) outbox: Arc<str>,
    pub(crate) consumed: Arc<str>,
    explicit_outbox: bool,
    explicit_consumed: bool,
    pub(crate) retention: Duration,
    /// Wakes this process's relays after a commit that wrote messages;
    /// shared by the `Idem`s configured from one another, so a relay made
    /// from any of them hears every commit.
    pub(crate) wake: Arc<Wake>,
}

/// How long a processed message's record is kept by default.
pub const DEFAULT_CONSUMED_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

impl Tables {
    pub(crate) fn beside(table: &str) -> Self {
        Self {
            outbox: beside(table, "outbox").into(),
            consumed: beside(table, "consumed").into(),
            explicit_outbox: false,
            explicit_consumed: false,
            retention: DEFAULT_CONSUMED_RETENTION,
            wake: Arc::new(Wake::new()),
        }
    }

    /// The outbox is `name`, whatever the key table is named.
    pub(crate) fn name_outbox(&mut self, name: Arc<str>) {
        self.outbox = name;
        self.explicit_outbox = true;
    }

    /// The consumed-messages table is `name`, whatever the key table is
    /// named.
    pub(crate) fn name_consumed(&mut self, name: Arc<str>) {
        self.consumed = name;
        self.explicit_consumed = true;
    }

    /// The key table is now `table`: names not set follow it.
    pub(crate) fn follow(&mut self, table: &str) {
        if !self.explicit_outbox {
            self.outbox = beside(table, "outbox").into();
        }
        if !self.explicit_consumed {
            self.consumed = beside(table, "consumed").into();
        }
    }
}

/// The table of the key table's resolutions (`<table>_resolutions`): one
/// row per decision an operator made on an uncertain key, kept after the
/// key itself is gone.
pub(crate) fn resolutions_table(table: &str) -> String {
    beside(table, "resolutions")
}

/// `<table>_<suffix>`, in `table`'s schema; within 63 characters (a longer
/// name is shortened with a hash of the whole).
fn beside(table: &str, suffix: &str) -> String {
    let (schema, name) = match table.rsplit_once('.') {
        Some((schema, name)) => (Some(schema), name),
        None => (None, table),
    };
    let mut own = format!("{name}_{suffix}");
    if own.len() > 63 {
        own = format!(
            "idem_{:016x}_{suffix}",
            crate::backend::fnv1a(table.bytes())
        );
    }
    match schema {
        Some(schema) => format!("{schema}.{own}"),
        None => own,
    }
}
