//! The SQL text of PostgreSQL's claim, read, expiry and finish, written
//! straight into the one buffer each round trip sends.
//!
//! Every request builds two such texts (the claim riding on `BEGIN`, the
//! stored response on `COMMIT`), so they are written in place: the values
//! go in as hex literals as they are read, with no intermediate strings.

pub(crate) use crate::backend::fnv1a;
use std::fmt::Write as _;

use crate::backend::Claim;
use crate::backend::sql::push_hex;
use crate::backend::store::tombstone_assignments;
use crate::response::EncodedResponse;

/// One of `idem`'s statements on the key table, written once with `$n`
/// parameters: prepared per connection and run with `EXECUTE`, so the
/// server parses and plans it once per connection instead of per request
/// (that planning was most of the wrapper's database CPU).
pub(super) struct Statement {
    /// Tells this statement apart among a table's statements.
    suffix: &'static str,
    /// The parameter types, in order.
    types: &'static str,
    /// The text, `{table}` standing for the table.
    text: &'static str,
}

/// The claim: it succeeds when the key is ours, and fails with a unique
/// violation when another attempt finished it (after waiting for that
/// attempt's outcome, as long as the lock timeout lets it). It answers by
/// succeeding or failing, not by a row count, because it runs as sqlx's own
/// `BEGIN`, whose results sqlx does not hand back.
pub(super) const CLAIM: Statement = Statement {
    suffix: "claim",
    types: "bytea, bytea, bytea, bigint",
    text: "INSERT INTO {table} (scope, key, fingerprint, expires_at) \
           VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond')",
};

/// The claim of a server that offers advisory locks, when it does not
/// wait: the key's transaction-scoped advisory lock, then the row, in one
/// statement. A lock held by a concurrent attempt fails the statement
/// with `22P02` (the cast of a text no boolean reads, which names the
/// reason in the server's log), a statement that only our values reach.
/// Every claim on such a server takes the lock before its insert, so the
/// insert never meets an attempt in flight, and needs no lock timeout.
pub(super) const CLAIM_TRY: Statement = Statement {
    suffix: "claim_try",
    types: "bytea, bytea, bytea, bigint, bigint",
    text: "INSERT INTO {table} (scope, key, fingerprint, expires_at) \
           SELECT $1, $2, $3, now() + $4 * interval '1 millisecond' \
           WHERE (CASE WHEN pg_try_advisory_xact_lock($5) THEN 'true' \
           ELSE 'idem: key held by another attempt' END)::boolean",
};

pub(super) const SELECT: Statement = Statement {
    suffix: "select",
    types: "bytea, bytea",
    text: "SELECT status, fingerprint, headers, body, expires_at <= now() AS expired, \
           location, CASE WHEN replay_until <= now() THEN 1 ELSE 0 END AS past_ttl \
           FROM {table} WHERE scope = $1 AND key = $2",
};

/// A finished row whose response still replays, read outside the claim
/// (`Backend::peek`); run by sqlx, not among the `PREPARE`d statements.
/// A row replays until it expires and, with a tombstone, until its
/// `replay_until` (`least` passes over `NULL`); a row past either is left
/// to the claim. Only what a replay needs is selected: each output column
/// costs the server its setup on every execution.
pub(super) const PEEK: &str = "SELECT status, fingerprint, headers, body FROM {table} \
                    WHERE scope = $1 AND key = $2 AND status IS NOT NULL \
                    AND least(replay_until, expires_at) > now()";

/// Deletes the key's row if it has expired, in the transaction of the
/// claim that takes the key anew. Of two attempts doing so at once, the
/// second waits (up to `wait`) for the first's lock on the row; if the
/// first commits meanwhile, the second deletes nothing and its insert meets
/// the first's row, which it then reads.
pub(super) const EXPIRE: Statement = Statement {
    suffix: "expire",
    types: "bytea, bytea",
    text: "DELETE FROM {table} WHERE scope = $1 AND key = $2 AND expires_at <= now()",
};

/// Stores the response on the claim's row, which is unfinished: a
/// finished row in its place (another attempt's, or an expired one that a
/// handler's own `ROLLBACK` brought back) is spared, the update then
/// matches nothing, and the finish fails (see `Postgres::finish`).
pub(super) const FINISH: Statement = Statement {
    suffix: "finish",
    types: "bytea, bytea, smallint, bytea, bytea",
    text: "UPDATE {table} SET status = $3, headers = $4, body = $5 \
           WHERE scope = $1 AND key = $2 AND status IS NULL",
};

/// The finish of a request that ran long against its `ttl`
/// (`OpenTx::outlived`): its expiry counts from the response. Rare, so not
/// prepared: the arguments are inlined.
const FINISH_LATE: Statement = Statement {
    suffix: "finish_late",
    types: "bytea, bytea, smallint, bytea, bytea, bigint",
    text: "UPDATE {table} SET status = $3, headers = $4, body = $5, \
           expires_at = clock_timestamp() + $6 * interval '1 millisecond' \
           WHERE scope = $1 AND key = $2 AND status IS NULL",
};

/// The key table's server-side functions, for claims behind a declared
/// transaction-mode pooler (see `functions.rs`). Their names carry a
/// revision, bumped whenever a body changes: an instance of the previous
/// release keeps calling its own during a rolling deploy.
///
/// The claim's: the orphan bound for the transaction (as the `SET LOCAL`
/// of [`ClaimRow::push_claim`]), the key's advisory lock tried (`22P02`
/// when held, as [`CLAIM_TRY`]), then the row's insert, the transaction's
/// first write, whose unique violation tells a taken key.
const CLAIM_FUNCTION: &str = "idem_claim_v1";
/// The finish's: [`FINISH`], answering the rows it updated.
const FINISH_FUNCTION: &str = "idem_finish_v1";
/// The replay's read: [`PEEK`].
const PEEK_FUNCTION: &str = "idem_peek_v1";

/// The schema-qualified names of a key table's functions.
pub(super) struct FunctionNames {
    pub(super) claim: String,
    pub(super) finish: String,
    pub(super) peek: String,
}

impl FunctionNames {
    pub(super) fn of(table: &str) -> Self {
        Self {
            claim: function_name(table, CLAIM_FUNCTION),
            finish: function_name(table, FINISH_FUNCTION),
            peek: function_name(table, PEEK_FUNCTION),
        }
    }

    /// Each function with the argument types its calls give it, for
    /// `to_regprocedure`.
    pub(super) fn procedures(&self) -> [String; 3] {
        [
            format!(
                "{}(bytea, bytea, bytea, bigint, bigint, bigint)",
                self.claim
            ),
            format!("{}(bytea, bytea, smallint, bytea, bytea)", self.finish),
            format!("{}(bytea, bytea)", self.peek),
        ]
    }
}

/// `table`'s function `function`, in the table's schema (named as its
/// indexes are, within 63 bytes).
fn function_name(table: &str, function: &str) -> String {
    super::qualified(table, &super::index_name(table, function))
}

/// Creates (or replaces) `table`'s functions, named `names`, in one
/// transaction under an advisory lock of their own: instances migrating at
/// once make them one after the other (concurrent `CREATE OR REPLACE
/// FUNCTION`s of one name can fail each other). The lock is of the
/// two-key kind, a space apart from the keys' one-key locks.
pub(super) fn functions_ddl(table: &str, names: &FunctionNames) -> String {
    let FunctionNames {
        claim,
        finish,
        peek,
    } = names;
    let lock = lock_id(table, "idem", "functions");
    let (high, low) = ((lock >> 32) as i32, lock as i32);
    format!(
        "SELECT pg_advisory_xact_lock({high}, {low});
        CREATE OR REPLACE FUNCTION {claim}(p_scope bytea, p_key bytea, p_fingerprint bytea,
            p_ttl_ms bigint, p_lock bigint, p_orphan_ms bigint) RETURNS void
        LANGUAGE plpgsql AS $idem$
        BEGIN
            PERFORM set_config('idle_in_transaction_session_timeout', p_orphan_ms::text, true);
            IF NOT pg_try_advisory_xact_lock(p_lock) THEN
                RAISE EXCEPTION 'idem: key held by another attempt' USING ERRCODE = '22P02';
            END IF;
            INSERT INTO {table} (scope, key, fingerprint, expires_at)
                VALUES (p_scope, p_key, p_fingerprint, now() + p_ttl_ms * interval '1 millisecond');
        END
        $idem$;
        CREATE OR REPLACE FUNCTION {finish}(p_scope bytea, p_key bytea, p_status smallint,
            p_headers bytea, p_body bytea) RETURNS integer
        LANGUAGE plpgsql AS $idem$
        DECLARE
            stored integer;
        BEGIN
            UPDATE {table} SET status = p_status, headers = p_headers, body = p_body
                WHERE scope = p_scope AND key = p_key AND status IS NULL;
            GET DIAGNOSTICS stored = ROW_COUNT;
            RETURN stored;
        END
        $idem$;
        CREATE OR REPLACE FUNCTION {peek}(p_scope bytea, p_key bytea)
            RETURNS TABLE (status smallint, fingerprint bytea, headers bytea, body bytea)
        LANGUAGE plpgsql STABLE AS $idem$
        BEGIN
            RETURN QUERY SELECT k.status, k.fingerprint, k.headers, k.body FROM {table} k
                WHERE k.scope = p_scope AND k.key = p_key AND k.status IS NOT NULL
                AND least(k.replay_until, k.expires_at) > now();
        END
        $idem$;"
    )
}

/// The replay's read through [`PEEK_FUNCTION`], its values inlined.
pub(super) fn peek_call(table: &str, scope: &[u8], key: &[u8]) -> String {
    let mut out = String::with_capacity(64 + 2 * (scope.len() + key.len()));
    out.push_str("SELECT * FROM ");
    push_call(
        &mut out,
        &function_name(table, PEEK_FUNCTION),
        &[Arg::Bytes(scope), Arg::Bytes(key)],
    );
    out
}

/// Appends `function(args)`, the arguments as literals.
fn push_call(out: &mut String, function: &str, args: &[Arg<'_>]) {
    out.push_str(function);
    push_args(out, args);
}

/// Appends `(args)`, the arguments as literals.
fn push_args(out: &mut String, args: &[Arg<'_>]) {
    out.push('(');
    for (index, arg) in args.iter().enumerate() {
        if index > 0 {
            out.push_str(", ");
        }
        arg.push(out);
    }
    out.push(')');
}

/// Changes whenever a statement's text or answer changes (2: the claim
/// answers with its row count, not the row; 3: the claim fails on a taken
/// key, and an expired row is deleted rather than taken over in place; 4:
/// the finish spares a finished row; 5: the read tells a tombstone).
const STATEMENTS_REVISION: &str = "5:";

/// One argument of a statement, written into its text as a literal.
#[derive(Clone, Copy)]
pub(super) enum Arg<'a> {
    Bytes(&'a [u8]),
    /// Text, sent as its UTF-8 bytes in hex and converted by the server:
    /// no character of it reaches the statement as such.
    Text(&'a str),
    Int(u128),
    Signed(i64),
    /// A `smallint`, typed as one (a function's parameter resolves only
    /// from its own type).
    Small(i16),
    Null,
}

impl Arg<'_> {
    fn push(self, out: &mut String) {
        match self {
            Arg::Bytes(bytes) => push_bytea(out, bytes),
            Arg::Text(text) => {
                out.push_str("convert_from(");
                push_bytea(out, text.as_bytes());
                out.push_str(", 'UTF8')");
            }
            Arg::Int(int) => write!(out, "{int}").expect("writing to a String"),
            Arg::Signed(int) => write!(out, "{int}").expect("writing to a String"),
            Arg::Small(int) => write!(out, "{int}::smallint").expect("writing to a String"),
            Arg::Null => out.push_str("NULL"),
        }
    }
}

/// `text` with every `$n` replaced by `args[n - 1]` as a literal: a
/// statement for the simple query protocol, which names nothing in the
/// session (no prepared statement), so any server connection of a
/// transaction-mode pooler runs it alike, in or out of a transaction. A
/// `$n` beyond `args` stays as written (the server then refuses it).
pub(super) fn inline(text: &str, args: &[Arg<'_>]) -> String {
    let mut out = String::with_capacity(text.len() + 64);
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - at - 1);
        let arg = rest[at + 1..at + 1 + digits]
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|index| args.get(index));
        match arg {
            Some(arg) => arg.push(&mut out),
            None => out.push_str(&rest[at..at + 1 + digits]),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// The statements of one key table, named after it: `Idem`s on different
/// tables can share a pool without their statements colliding, and the
/// names keep clear of sqlx's own (`sqlx_s_*`).
#[derive(Clone, Copy)]
pub(super) struct Statements<'t> {
    table: &'t str,
    hash: u64,
}

impl<'t> Statements<'t> {
    const PORTABLE: [Statement; 4] = [CLAIM, SELECT, EXPIRE, FINISH];
    const ADVISORY: [Statement; 5] = [CLAIM, SELECT, EXPIRE, FINISH, CLAIM_TRY];

    pub(super) fn new(table: &'t str) -> Self {
        Self::at_revision(STATEMENTS_REVISION, table)
    }

    /// The statements as revision `revision` of this code names them.
    pub(super) fn at_revision(revision: &str, table: &'t str) -> Self {
        // A stable name for any table name, within PostgreSQL's 63-byte
        // identifiers. The revision is hashed in too: a session kept across
        // a deploy (a session-mode pooler) may still hold an older statement
        // under the old name, and must not run it as if it were the new one.
        let hash = fnv1a(revision.bytes().chain(table.bytes()));
        Self { table, hash }
    }

    /// The statements a connection prepares: with the advisory claim
    /// ([`CLAIM_TRY`]) where the server offers advisory locks (one without
    /// could not prepare it).
    fn all(advisory: bool) -> &'static [Statement] {
        if advisory {
            &Self::ADVISORY
        } else {
            &Self::PORTABLE
        }
    }

    /// `idem_<16 hex digits>_<suffix>`.
    fn push_name(&self, out: &mut String, statement: &Statement) {
        out.push_str("idem_");
        push_hex(out, &self.hash.to_be_bytes());
        out.push('_');
        out.push_str(statement.suffix);
    }

    pub(super) fn name(&self, statement: &Statement) -> String {
        let mut name = String::with_capacity(32);
        self.push_name(&mut name, statement);
        name
    }

    pub(super) fn names(&self, advisory: bool) -> Vec<String> {
        Self::all(advisory)
            .iter()
            .map(|statement| self.name(statement))
            .collect()
    }

    fn text(&self, statement: &Statement) -> String {
        statement.text.replace("{table}", self.table)
    }

    /// `PREPARE`s for the statements not among `present`.
    pub(super) fn prepare_missing(&self, present: &[String], advisory: bool) -> String {
        Self::all(advisory)
            .iter()
            .filter(|statement| !present.contains(&self.name(statement)))
            .map(|statement| {
                format!(
                    "PREPARE {} ({}) AS {}; ",
                    self.name(statement),
                    statement.types,
                    self.text(statement)
                )
            })
            .collect()
    }

    /// Appends `statement` run with `args`: through its prepared statement,
    /// or with the arguments in place of `$n`.
    fn push_run(&self, out: &mut String, statement: &Statement, prepared: bool, args: &[Arg<'_>]) {
        if prepared {
            out.push_str("EXECUTE ");
            self.push_name(out, statement);
            push_args(out, args);
            return;
        }
        out.push_str(&inline(&self.text(statement), args));
    }
}

/// The statements of one claim, written from its values as they are needed.
pub(super) struct ClaimRow<'c> {
    pub(super) statements: Statements<'c>,
    /// Through prepared statements (`EXECUTE`), or inlined.
    pub(super) prepared: bool,
    /// Inlined, a claim without a wait and the finish call the table's
    /// functions ([`FunctionNames`]), which the server found.
    pub(super) functions: bool,
    /// The name the key's advisory lock is hashed under
    /// (`advisory::lock_table`), where the claim takes one.
    pub(super) lock_table: Option<std::sync::Arc<str>>,
    /// How long the claim may still wait for a concurrent attempt.
    wait: std::time::Duration,
    /// Borrowed, not copied: the row is moved down every future of the
    /// claim, so its size counts several times in each request's.
    claim: &'c Claim<'c>,
}

impl<'c> ClaimRow<'c> {
    /// The claim's statements; with the key's advisory lock if
    /// `claim.advisory` (which the caller leaves set only for a server
    /// that offers advisory locks).
    pub(super) fn new(table: &'c str, claim: &'c Claim<'c>) -> Self {
        Self {
            statements: Statements::new(table),
            prepared: !claim.pooled,
            functions: false,
            lock_table: None,
            wait: claim.wait,
            claim,
        }
    }

    /// The key table.
    pub(super) fn table(&self) -> &'c str {
        self.statements.table
    }

    /// The names of the statements this claim's connection prepares.
    pub(super) fn names(&self) -> Vec<String> {
        self.statements.names(self.claim.advisory)
    }

    /// `PREPARE`s for this claim's statements not among `present`.
    pub(super) fn prepare_missing(&self, present: &[String]) -> String {
        self.statements
            .prepare_missing(present, self.claim.advisory)
    }

    /// Whether the claim takes the key's advisory lock.
    pub(super) fn takes_lock(&self) -> bool {
        self.claim.advisory
    }

    /// Whether a concurrent attempt fails this claim at once, by its
    /// advisory lock, rather than after a lock timeout.
    pub(super) fn tries_lock(&self) -> bool {
        self.claim.advisory && self.wait.is_zero()
    }

    /// The key's advisory lock, if the claim takes one (hashed when a
    /// claim's text is written, not for the finish's).
    fn lock(&self) -> Option<i64> {
        let table = self.lock_table.as_deref().unwrap_or(self.statements.table);
        self.claim
            .advisory
            .then(|| lock_id(table, self.claim.scope, self.claim.key))
    }

    fn row_args(&self) -> [Arg<'_>; 4] {
        [
            Arg::Bytes(self.claim.scope.as_bytes()),
            Arg::Bytes(self.claim.key.as_bytes()),
            Arg::Bytes(self.claim.fingerprint.as_bytes()),
            Arg::Int(self.claim.ttl.as_millis()),
        ]
    }

    /// How long the claim may wait for a concurrent attempt.
    pub(super) fn wait(&self) -> std::time::Duration {
        self.wait
    }

    /// See [`Claim::orphan_bound`].
    pub(super) fn orphan_bound(&self) -> std::time::Duration {
        self.claim.orphan_bound()
    }

    /// Claims without waiting for the key's holder from now on.
    pub(super) fn skip_wait(&mut self) {
        self.wait = std::time::Duration::ZERO;
    }

    /// A buffer for one round trip's text, sized for the key's values.
    fn buffer(&self, extra: usize) -> String {
        let values = self.claim.scope.len() + self.claim.key.len() + 32;
        String::with_capacity(256 + 2 * values + extra)
    }

    /// Opens the transaction and claims the key (deleting the key's expired
    /// row first, if `expired`).
    ///
    /// With an advisory lock and no wait, a fresh key's claim tries the
    /// lock: a concurrent attempt holds it, or this claim's insert meets no
    /// row in flight (see [`CLAIM_TRY`]), so no timeout is set. Otherwise
    /// the claim runs under its lock timeout (taking the key's advisory
    /// lock first, if it takes one), then puts the timeout back to its
    /// configured default: the handler's own statements and the final
    /// commit must not inherit a timeout of a millisecond.
    ///
    /// The delete of an expired row runs in the claim's transaction, after
    /// the lock and under the timeout: the row may be locked by what holds
    /// no advisory lock (the sweeper, an administrator). (A statement written ahead of
    /// `BEGIN` in the same round trip would join the transaction anyway,
    /// PostgreSQL including it retroactively, but without the timeout: a
    /// duplicate meeting a takeover's lock on the old row waited for the
    /// takeover's whole handler instead of `wait`.)
    ///
    /// `SET LOCAL` is a utility statement, nothing to plan, so this costs
    /// little (less than `set_config`: docs/design.md), but PostgreSQL walks
    /// every setting at the end of a transaction that changed one. The
    /// default is what `postgresql.conf`, the role, the database or the
    /// connection's startup options say; a plain session `SET lock_timeout`
    /// does not reach into `idem`'s transactions.
    fn push_claim(&self, out: &mut String, expired: bool) {
        // A session whose client vanished with the claim open (a half-open
        // connection) is ended by the server this long after its last
        // statement, releasing the key: the handler's deadline and a margin.
        let orphan = self.claim.orphan_bound().as_millis();
        out.push_str("BEGIN; ");
        let tries = self.tries_lock();
        // Hashed once: SHA-256 is most of what a claim's text costs to write.
        let lock = self.lock();
        if let Some(lock) = lock.filter(|_| tries && !expired && self.calls()) {
            let [scope, key, fingerprint, ttl] = self.row_args();
            let args = [
                scope,
                key,
                fingerprint,
                ttl,
                Arg::Signed(lock),
                Arg::Int(orphan),
            ];
            out.push_str("SELECT ");
            push_call(
                out,
                &function_name(self.statements.table, CLAIM_FUNCTION),
                &args,
            );
            out.push(';');
            return;
        }
        let timed = !tries || expired;
        if timed {
            // `lock_timeout = 0` means "wait forever" in PostgreSQL, so
            // `wait = 0` becomes the smallest positive timeout instead.
            let timeout = self.wait.as_millis().max(1);
            write!(out, "SET LOCAL lock_timeout = '{timeout}ms'; ").expect("writing to a String");
        }
        write!(
            out,
            "SET LOCAL idle_in_transaction_session_timeout = '{orphan}ms'; "
        )
        .expect("writing to a String");
        match lock {
            Some(lock) if tries && !expired => {
                let [scope, key, fingerprint, ttl] = self.row_args();
                let args = [scope, key, fingerprint, ttl, Arg::Signed(lock)];
                self.statements
                    .push_run(out, &CLAIM_TRY, self.prepared, &args);
                out.push(';');
                return;
            }
            Some(lock) if tries => write!(
                out,
                "SELECT (CASE WHEN pg_try_advisory_xact_lock({lock}) THEN 'true' \
                 ELSE 'idem: key held by another attempt' END)::boolean; "
            ),
            Some(lock) => write!(out, "SELECT pg_advisory_xact_lock({lock}); "),
            None => Ok(()),
        }
        .expect("writing to a String");
        if expired {
            self.statements
                .push_run(out, &EXPIRE, self.prepared, &self.key_args());
            out.push_str("; ");
        }
        self.statements
            .push_run(out, &CLAIM, self.prepared, &self.row_args());
        if timed {
            out.push_str("; SET LOCAL lock_timeout TO DEFAULT;");
        } else {
            out.push(';');
        }
    }

    /// Runs `prelude` (a new connection's `PREPARE`s, or nothing), opens
    /// the transaction and claims the key: it fails if the key is taken.
    pub(super) fn begin_and_insert(&self, prelude: &str) -> String {
        let mut out = self.buffer(prelude.len());
        out.push_str(prelude);
        self.push_claim(&mut out, false);
        out
    }

    /// As [`begin_and_insert`](Self::begin_and_insert), deleting the key's
    /// expired row first.
    pub(super) fn expire_and_insert(&self) -> String {
        let mut out = self.buffer(0);
        self.push_claim(&mut out, true);
        out
    }

    /// Ends the failed claim's transaction and reads the row that made it
    /// fail, in one round trip; the read has a snapshot of its own, so it
    /// sees the row that committed while the claim waited.
    pub(super) fn end_and_select(&self) -> String {
        let mut out = self.buffer(0);
        out.push_str("ROLLBACK; ");
        self.statements
            .push_run(&mut out, &SELECT, self.prepared, &self.key_args());
        out
    }

    fn key_args(&self) -> [Arg<'_>; 2] {
        [
            Arg::Bytes(self.claim.scope.as_bytes()),
            Arg::Bytes(self.claim.key.as_bytes()),
        ]
    }

    /// Whether this claim's statements are calls of the table's functions.
    pub(super) fn calls(&self) -> bool {
        self.functions && !self.prepared
    }

    /// Whether [`finish_and_commit`](Self::finish_and_commit) calls the
    /// finish's function, which answers with a row (`stored`: the rows it
    /// updated) rather than a row count.
    pub(super) fn finish_calls(&self, response: &EncodedResponse, late: bool) -> bool {
        self.calls() && response.tombstone.is_none() && !late
    }

    /// Stores `response` on the row and commits, in one round trip; `late`,
    /// the expiry counts from now (see `OpenTx::outlived`).
    pub(super) fn finish_and_commit(&self, response: &EncodedResponse, late: bool) -> String {
        let headers = &response.headers;
        let mut out = self.buffer(2 * (headers.len() + response.body.len()));
        let args = [
            Arg::Bytes(self.claim.scope.as_bytes()),
            Arg::Bytes(self.claim.key.as_bytes()),
            Arg::Int(response.status.as_u16().into()),
            Arg::Bytes(headers),
            Arg::Bytes(&response.body),
            Arg::Int(self.claim.ttl.as_millis()),
        ];
        if response.tombstone.is_some() {
            // A tombstone's times count from the response: never prepared,
            // as its assignments differ from the finish's.
            let text = self.statements.text(&FINISH).replacen(
                " WHERE",
                &format!("{} WHERE", tombstone_set(response)),
                1,
            );
            out.push_str(&inline(&text, &args[..5]));
        } else if late {
            self.statements
                .push_run(&mut out, &FINISH_LATE, false, &args);
        } else if self.finish_calls(response, late) {
            // An HTTP status is at most 999.
            let status = i16::try_from(response.status.as_u16()).unwrap_or(i16::MAX);
            out.push_str("SELECT ");
            push_call(
                &mut out,
                &function_name(self.statements.table, FINISH_FUNCTION),
                &[args[0], args[1], Arg::Small(status), args[3], args[4]],
            );
            out.push_str(" AS stored");
        } else {
            self.statements
                .push_run(&mut out, &FINISH, self.prepared, &args[..5]);
        }
        // The empty transaction after the commit stands for the one sqlx
        // still counts (its depth), until sqlx's own rollback of it rides
        // on the pool's return ping: see `Postgres::finish`.
        out.push_str("; COMMIT; BEGIN");
        out
    }
}

/// The advisory lock of `(table, scope, key)`: the first 64 bits of their
/// SHA-256 (each length-prefixed), stable across processes and versions,
/// and not a hash a caller can aim at another caller's key with. `table`
/// is the name the locks are taken under (`advisory::lock_table`).
pub(super) fn lock_id(table: &str, scope: &str, key: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for part in [table, scope, key] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// [`tombstone_assignments`] in PostgreSQL's spelling.
pub(super) fn tombstone_set(response: &EncodedResponse) -> String {
    tombstone_assignments(response, bytea, |ms| {
        format!("clock_timestamp() + {ms} * interval '1 millisecond'")
    })
}

/// `bytes` as a `bytea` literal ([`push_bytea`]).
pub(super) fn bytea(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2 + 6);
    push_bytea(&mut out, bytes);
    out
}

/// Appends a `bytea` value as an SQL literal in hex input form. An escape
/// string (`E'\\x..'`) reads the same whatever `standard_conforming_strings`
/// says, and, unlike `decode(..)`, costs the server no function call to
/// resolve and fold per argument. Only `[0-9a-f]` comes from the value, so
/// nothing can inject.
pub(super) fn push_bytea(out: &mut String, bytes: &[u8]) {
    out.push_str("E'\\\\x");
    push_hex(out, bytes);
    out.push('\'');
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::StatusCode;

    use super::*;
    use crate::fingerprint::Fingerprint;

    fn claim() -> Claim<'static> {
        Claim {
            scope: "a",
            key: "b",
            fingerprint: Fingerprint::from_bytes(&[0xab; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            tombstone_ms: None,
            wait: Duration::ZERO,
            timeout_ms: 30_000,
            advisory: false,
            pooled: false,
        }
    }

    /// `$n` is the whole number after the sign (`$1` never matches inside
    /// `$10`); text goes as hex bytes the server converts; a `$n` without
    /// an argument, or a lone `$`, stays as written.
    #[test]
    fn inline_replaces_each_parameter_by_its_literal() {
        let args: Vec<Arg<'_>> = (0..10)
            .map(Arg::Int)
            .chain([Arg::Text("it's"), Arg::Bytes(&[0, 0xff]), Arg::Signed(-5)])
            .collect();
        assert_eq!(
            inline(
                "SELECT $11, $1, $10, $12 WHERE a = $13 AND b = $14 AND c = '$'",
                &args
            ),
            r"SELECT convert_from(E'\\x69742773', 'UTF8'), 0, 9, E'\\x00ff' WHERE a = -5 AND b = $14 AND c = '$'"
        );
        assert_eq!(inline("no parameters", &[]), "no parameters");
    }

    #[test]
    fn inlined_statements_put_every_argument_in_place() {
        let claim = claim();
        let mut row = ClaimRow::new("keys", &claim);
        row.prepared = false;
        let response = EncodedResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: "{}".into(),
            tombstone: None,
        };
        let finish = row.finish_and_commit(&response, false);
        assert_eq!(
            finish,
            r"UPDATE keys SET status = 201, headers = E'\\x', body = E'\\x7b7d' WHERE scope = E'\\x61' AND key = E'\\x62' AND status IS NULL; COMMIT; BEGIN"
        );
        // A late finish counts the expiry from its own time, and is always
        // inlined.
        let late = ClaimRow::new("keys", &claim).finish_and_commit(&response, true);
        assert!(
            late.starts_with(
                r"UPDATE keys SET status = 201, headers = E'\\x', body = E'\\x7b7d', expires_at = clock_timestamp() + 60000 * interval '1 millisecond' WHERE scope = E'\\x61'"
            ),
            "{late}"
        );
        let insert = row.begin_and_insert("");
        assert!(!insert.contains('$'), "{insert}");
        let values = format!(
            r"VALUES (E'\\x61', E'\\x62', E'\\x{}', now() + 60000 * interval",
            "ab".repeat(32)
        );
        assert!(insert.contains(&values), "{insert}");
        // `wait = 0` is the smallest timeout, never 0 (which waits forever).
        assert!(insert.starts_with(
            "BEGIN; SET LOCAL lock_timeout = '1ms'; \
             SET LOCAL idle_in_transaction_session_timeout = '32000ms'; INSERT INTO keys"
        ));
        assert!(insert.ends_with("; SET LOCAL lock_timeout TO DEFAULT;"));
    }

    #[test]
    fn prepared_statements_are_executed_by_name() {
        let claim = claim();
        let row = ClaimRow::new("keys", &claim);
        let name = row.statements.name(&SELECT);
        assert_eq!(
            row.end_and_select(),
            format!(r"ROLLBACK; EXECUTE {name}(E'\\x61', E'\\x62')")
        );
        // The expired row's delete is in the transaction, under the timeout.
        let expire = row.expire_and_insert();
        assert!(expire.starts_with(&format!(
            "BEGIN; SET LOCAL lock_timeout = '1ms'; \
             SET LOCAL idle_in_transaction_session_timeout = '32000ms'; \
             EXECUTE {}(E'\\\\x61', E'\\\\x62'); EXECUTE {}(",
            row.statements.name(&EXPIRE),
            row.statements.name(&CLAIM)
        )));
        // Tables get their own statements, within PostgreSQL's identifiers.
        assert_ne!(
            Statements::new("a.keys").name(&CLAIM),
            Statements::new("b.keys").name(&CLAIM)
        );
        assert!(row.statements.name(&EXPIRE).len() <= 63);
        assert_eq!(
            Statements {
                table: "t",
                hash: 0xab,
            }
            .name(&CLAIM),
            "idem_00000000000000ab_claim"
        );
        assert_eq!(row.names().len(), 4);
        let advisory = Claim {
            advisory: true,
            pooled: false,
            ..claim
        };
        assert_eq!(ClaimRow::new("keys", &advisory).names().len(), 5);
    }

    #[test]
    fn an_advisory_claim_tries_the_keys_lock_without_a_timeout() {
        let claim = Claim {
            advisory: true,
            pooled: false,
            ..claim()
        };
        let row = ClaimRow::new("keys", &claim);
        let lock = lock_id("keys", "a", "b");
        let insert = row.begin_and_insert("");
        assert_eq!(
            insert,
            format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = '32000ms'; \
                 EXECUTE {}(E'\\\\x61', E'\\\\x62', E'\\\\x{}', 60000, {lock});",
                row.statements.name(&CLAIM_TRY),
                "ab".repeat(32)
            )
        );
        // An expired row is deleted after the lock is taken, under the
        // timeout: the sweeper may hold it.
        let expire = row.expire_and_insert();
        let locked = expire
            .find(&format!("pg_try_advisory_xact_lock({lock})"))
            .expect("the lock");
        assert!(locked < expire.find("EXECUTE").unwrap(), "{expire}");
        assert!(
            expire.starts_with("BEGIN; SET LOCAL lock_timeout = '1ms'; "),
            "{expire}"
        );
        // A claim that waits waits for the lock, under its timeout.
        let waiting = Claim {
            wait: Duration::from_millis(250),
            ..claim
        };
        let waits = ClaimRow::new("keys", &waiting).begin_and_insert("");
        assert!(
            waits.starts_with("BEGIN; SET LOCAL lock_timeout = '250ms'; "),
            "{waits}"
        );
        assert!(
            waits.contains(&format!("SELECT pg_advisory_xact_lock({lock}); EXECUTE ")),
            "{waits}"
        );
        assert!(waits.ends_with("; SET LOCAL lock_timeout TO DEFAULT;"));
        // The lock is the key's: another table, scope or key has another.
        assert_ne!(lock, lock_id("keys", "ab", ""));
        assert_ne!(lock, lock_id("other", "a", "b"));
    }
}
