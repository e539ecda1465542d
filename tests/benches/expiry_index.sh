#!/usr/bin/env bash
# What the key table's expiry index buys the sweep and costs the claim, on
# PostgreSQL, for each variant of that index:
#
#   btree    today's: btree (expires_at), as `migrate` creates it
#   brin     BRIN (expires_at), default pages_per_range
#   none     no index on expires_at
#   partial  btree (expires_at) WHERE status IS NOT NULL: the one kind of
#            partial index a sweep of finished rows could use; shown to be
#            left unused by the runtime's sweep (its WHERE does not imply
#            the predicate) and to cost the finish its HOT update
#
# For each, a key table exactly like `migrate`'s (with its lease index) is
# filled with IDEM_EI_EXPIRED expired rows, then IDEM_EI_LIVE live ones, in
# the order a service writes them (oldest first; one row in 50 an
# unfinished claim, the rest with a stored response), and VACUUM ANALYZEd:
#
#   ordered  one TTL (24 h): the expired rows are the table's first half;
#   mixed    per-handler TTLs (1 h, 23 h, 7 days) interleaved, so expired
#            and live rows share pages all through the table (the number
#            expired comes out near, not at, IDEM_EI_EXPIRED).
#
# Then the runtime's sweep (its DELETE, batches of 1,000, each its own
# transaction) runs until a batch deletes nothing: total time, batches, the
# slowest batch, and the last, empty, batch; and once more after a VACUUM
# ANALYZE ("idle": what every sweeper tick costs when nothing has expired).
# The batches run in a procedure, timed by the server: no round trips
# counted.
#
# On the swept ordered tables, the claim path then runs under pgbench
# (IDEM_EI_CLIENTS clients, IDEM_EI_SECONDS seconds, prepared statements,
# fresh random keys): BEGIN, the claim's INSERT, the stored response's
# UPDATE, COMMIT. Twice over: `finish`, the runtime's usual UPDATE (status, headers, body), and
# `finish_late`, the UPDATE of a request that outlived its TTL, which sets
# expires_at again. Runs alternate between the variants (IDEM_EI_RUNS
# rounds), so a burst of other load hits all alike. Beside tps, which
# moves with the machine's load, two counts that do not: HOT, the share of
# the UPDATEs that stayed heap-only, and the index buffers a claim touches
# (pg_statio: all the table's indexes, and the expiry index alone); and
# the WAL written per claim (the whole server's: run nothing else on it).
# Last, a VACUUM ANALYZE and an idle sweep on the tables the claims grew
# ("idle after claims": new claims land in the space the sweep freed,
# which BRIN's old summaries still call expired).
#
#   tests/benches/expiry_index.sh
#   IDEM_EI_VARIANTS="btree brin" IDEM_EI_LAYOUTS=mixed IDEM_EI_RUNS=1 tests/benches/expiry_index.sh
#   IDEM_EI_SWEEP=unordered IDEM_EI_RUNS=0 tests/benches/expiry_index.sh   # the old sweep, sweep only
#
# IDEM_TEST_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/test)
# names the server. Everything lives in schema IDEM_EI_SCHEMA (default
# idem_expiry_index), dropped at the end; about 200 MB per variant while
# it runs. Takes six to seven minutes with the defaults.
set -euo pipefail

url=${IDEM_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
schema=${IDEM_EI_SCHEMA:-idem_expiry_index}
variants=${IDEM_EI_VARIANTS:-btree brin none partial}
layouts=${IDEM_EI_LAYOUTS:-ordered mixed}
expired=${IDEM_EI_EXPIRED:-200000}
live=${IDEM_EI_LIVE:-200000}
clients=${IDEM_EI_CLIENTS:-8}
seconds=${IDEM_EI_SECONDS:-10}
runs=${IDEM_EI_RUNS:-3}
# The runtime's: `Idem::spawn_sweeper` sweeps in batches of 1,000.
batch=1000
# IDEM_EI_SWEEP=unordered: the sweep as it was before 2026-12-03, its
# subquery without the runtime's ORDER BY expires_at, for comparison.
case ${IDEM_EI_SWEEP:-runtime} in
  runtime|oldest_first) order='ORDER BY expires_at ' ;;
  unordered) order= ;;
  *) echo "expiry_index: IDEM_EI_SWEEP is runtime or unordered" >&2; exit 1 ;;
esac
pgbench=${IDEM_EI_PGBENCH:-$(command -v pgbench || ls -d /usr/lib/postgresql/*/bin/pgbench 2>/dev/null | sort -V | tail -1 || true)}
[ -x "$pgbench" ] || { echo "expiry_index: pgbench not found (IDEM_EI_PGBENCH)" >&2; exit 1; }
[[ $schema =~ ^[a-z_][a-z0-9_]*$ ]] || { echo "expiry_index: bad schema name $schema" >&2; exit 1; }

sql() { psql -X -q -v ON_ERROR_STOP=1 -At "$url" "$@"; }
say() { echo "expiry_index: $*" >&2; }
work=$(mktemp -d /tmp/idem-expiry-index.XXXXXX)
cleanup() {
  sql -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

say "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
sql <<EOF
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS $schema CASCADE;
CREATE SCHEMA $schema;
CREATE TABLE $schema.sweep_log (
    label text, batch int, deleted bigint, ms double precision, at timestamptz DEFAULT clock_timestamp()
);
CREATE TABLE $schema.facts (label text, fact text, value text);
CREATE TABLE $schema.claims (
    variant text, flavour text, round int, tps double precision, load text,
    -- Deltas of the table's statistics over the run.
    xacts bigint, updates bigint, hot bigint, index_blocks bigint, expiry_blocks bigint,
    wal numeric
);

-- The runtime's sweep (Postgres::sweep), a batch per transaction, until a
-- batch deletes nothing (or after MOST batches); each batch timed. A first
-- run of the statement with LIMIT 0 warms the session's caches, as a
-- pooled connection's are.
CREATE PROCEDURE $schema.sweep(tbl text, label text, batch int, most int DEFAULT 1000000)
LANGUAGE plpgsql AS \$\$
DECLARE
    deleted bigint;
    started timestamptz;
    statement text := 'DELETE FROM %s WHERE (scope, key) IN '
        '(SELECT scope, key FROM %s WHERE expires_at < now() $order'
        'LIMIT %s FOR UPDATE SKIP LOCKED) '
        'AND expires_at < now()';
BEGIN
    EXECUTE format(statement, tbl, tbl, 0);
    FOR i IN 1..most LOOP
        started := clock_timestamp();
        EXECUTE format(statement, tbl, tbl, batch);
        GET DIAGNOSTICS deleted = ROW_COUNT;
        INSERT INTO $schema.sweep_log (label, batch, deleted, ms)
        VALUES (label, i, deleted, extract(epoch FROM clock_timestamp() - started) * 1000);
        COMMIT;
        EXIT WHEN deleted = 0;
    END LOOP;
END \$\$;
EOF

# The key table of `migrate`, with the variant's expiry index.
create_table() {
  local table=$1 name=$2 variant=$3 index
  case $variant in
    btree) index="CREATE INDEX ${name}_expires_at_idx ON $table (expires_at);" ;;
    brin) index="CREATE INDEX ${name}_expires_at_idx ON $table USING brin (expires_at);" ;;
    none) index= ;;
    partial) index="CREATE INDEX ${name}_expires_at_idx ON $table (expires_at) WHERE status IS NOT NULL;" ;;
    *) say "unknown variant $variant"; exit 1 ;;
  esac
  sql <<EOF
CREATE TABLE $table (
    scope bytea NOT NULL,
    key bytea NOT NULL,
    fingerprint bytea NOT NULL,
    status smallint,
    headers bytea,
    body bytea,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    lease_token bigint,
    lease_until timestamptz,
    recovery bytea,
    request bytea,
    attempts integer,
    PRIMARY KEY (scope, key)
);
$index
CREATE INDEX ${name}_lease_idx ON $table (lease_until) WHERE lease_until IS NOT NULL;
EOF
}

# Fills `table` in insert order. Values derive from the row's number, so
# every variant gets the same rows; `t0` is the fill's now().
fill() {
  local table=$1 layout=$2 created ttl
  case $layout in
    ordered)
      # Expired: created 49 h to 25 h ago; live: 23 h ago to now. TTL 24 h:
      # an hour's margin either side of now, so nothing expires mid-run.
      created="CASE WHEN i <= $expired
                    THEN t0 - interval '49 hours' + (i - 1) * (interval '24 hours' / $expired)
                    ELSE t0 - interval '23 hours' + (i - $expired - 1) * (interval '22 hours' / $live) END"
      ttl="interval '24 hours'" ;;
    mixed)
      # 47 hours of claims; three handlers in ten have a 1 h TTL, four 23 h,
      # three 7 days.
      created="t0 - interval '48 hours' + (i - 1) * (interval '47 hours' / ($expired + $live))"
      ttl="CASE WHEN i % 10 < 3 THEN interval '1 hour'
                WHEN i % 10 < 7 THEN interval '23 hours'
                ELSE interval '7 days' END" ;;
    *) say "unknown layout $layout"; exit 1 ;;
  esac
  sql <<EOF
INSERT INTO $table (scope, key, fingerprint, status, headers, body, created_at, expires_at)
SELECT scope, key, sha256(key),
       CASE WHEN finished THEN 201 END,
       CASE WHEN finished THEN convert_to('content-type' || chr(10) || 'application/json' || chr(10)
            || 'location' || chr(10) || '/payments/' || i, 'UTF8') END,
       CASE WHEN finished THEN convert_to(format(
            '{"id":"%s","status":"accepted","amount":%s,"currency":"EUR","reference":"%s"}',
            h, i % 100000, repeat(substr(h, 1, 16), 6)), 'UTF8') END,
       created, created + ttl
FROM (
    SELECT i, t0, h, i % 50 <> 0 AS finished,
           convert_to('tenant-' || (hashint8(i) & 1023), 'UTF8') AS scope,
           convert_to(substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4)
               || '-' || substr(h, 17, 4) || '-' || substr(h, 21, 12), 'UTF8') AS key,
           $created AS created, $ttl AS ttl
    FROM generate_series(1, $expired + $live) AS i,
         LATERAL (SELECT md5(i::text) AS h, now() AS t0) AS v
    ORDER BY i
) AS rows;
EOF
  sql -c "VACUUM ANALYZE $table"
}

# The plan of the sweep's row scan, as EXPLAIN names it.
sweep_plan() {
  sql -c "EXPLAIN (COSTS OFF) DELETE FROM $1 WHERE (scope, key) IN
            (SELECT scope, key FROM $1 WHERE expires_at < now() $order LIMIT $batch FOR UPDATE SKIP LOCKED)
            AND expires_at < now()" |
    grep -oE '(Seq Scan|Bitmap Heap Scan|Index Only Scan|Index Scan)( using [a-z_0-9]+)? on [a-z_0-9.]+' |
    grep -v '_pkey' | head -1 | sed -e "s/ on [a-z_0-9.]*$//" -e 's/ using [a-z_0-9]*_expires_at_idx/ (expiry idx)/'
}

# The table's updates, HOT updates, and buffers its indexes and its expiry
# index were read from (hit or read), so far.
counters() {
  sql -c "SELECT t.n_tup_upd, t.n_tup_hot_upd, io.idx_blks_hit + io.idx_blks_read,
                 coalesce((SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes
                           WHERE indexrelid = to_regclass('$1_expires_at_idx')), 0)
          FROM pg_stat_user_tables t JOIN pg_statio_user_tables io USING (relid)
          WHERE relid = '$1'::regclass" | tr '|' ' '
}

fact() { sql -c "INSERT INTO $schema.facts VALUES ('$1', '$2', \$\$$3\$\$)"; }

# --- The sweep, per layout and variant ----------------------------------------
for layout in $layouts; do
  for variant in $variants; do
    name=${layout}_$variant
    table=$schema.$name
    say "$name: filling $((expired + live)) rows"
    create_table "$table" "$name" "$variant"
    fill "$table" "$layout"
    fact "$name" index_size "$(sql -c "SELECT coalesce(pg_size_pretty(pg_relation_size(to_regclass('$schema.${name}_expires_at_idx'))), '-')")"
    fact "$name" table_size "$(sql -c "SELECT pg_size_pretty(pg_relation_size('$table'))")"
    fact "$name" expired "$(sql -c "SELECT count(*) FROM $table WHERE expires_at < now()")"
    fact "$name" plan "$(sweep_plan "$table")"
    say "$name: sweeping"
    sql -c "CALL $schema.sweep('$table', '$name', $batch)"
    # As autovacuum would, before the next tick.
    sql -c "VACUUM ANALYZE $table"
    fact "$name" idle_plan "$(sweep_plan "$table")"
    sql -c "CALL $schema.sweep('$table', '$name idle', $batch)"
    if [ "$layout" != ordered ]; then
      sql -c "DROP TABLE $table"
    fi
  done
done

# --- The claim path, on the swept ordered tables ------------------------------
if [[ " $layouts " == *" ordered "* ]]; then
  for variant in $variants; do
    table=$schema.ordered_$variant
    for flavour in finish finish_late; do
      late=
      [ "$flavour" = finish_late ] && late=", expires_at = clock_timestamp() + 86400000 * interval '1 millisecond'"
      # The runtime's CLAIM and FINISH (or FINISH_LATE) statements, as
      # `sql.rs` writes them; scope, key and fingerprint as the fill's.
      cat >"$work/$variant-$flavour.sql" <<EOF
\set k1 random(1, 9223372036854775806)
\set k2 random(1, 9223372036854775806)
\set tenant random(0, 1023)
BEGIN;
INSERT INTO $table (scope, key, fingerprint, expires_at) VALUES (convert_to('tenant-' || :tenant::int, 'UTF8'), convert_to(lpad(to_hex(:k1::bigint), 16, '0') || '-' || lpad(to_hex(:k2::bigint), 16, '0'), 'UTF8'), sha256(convert_to(:k1::bigint || ':' || :k2::bigint, 'UTF8')), now() + 86400000 * interval '1 millisecond');
UPDATE $table SET status = 201, headers = convert_to('content-type' || chr(10) || 'application/json' || chr(10) || 'location' || chr(10) || '/payments/' || :k1::bigint, 'UTF8'), body = convert_to('{"id":"' || :k1::bigint || '","status":"accepted","amount":4200,"currency":"EUR","reference":"' || repeat(to_hex(:k2::bigint), 6) || '"}', 'UTF8')$late WHERE scope = convert_to('tenant-' || :tenant::int, 'UTF8') AND key = convert_to(lpad(to_hex(:k1::bigint), 16, '0') || '-' || lpad(to_hex(:k2::bigint), 16, '0'), 'UTF8') AND status IS NULL;
COMMIT;
EOF
    done
  done
  for round in $(seq 1 "$runs"); do
    for variant in $variants; do
      table=$schema.ordered_$variant
      for flavour in finish finish_late; do
        load=$(cut -d' ' -f1 /proc/loadavg)
        before=$(counters "$table")
        wal0=$(sql -c "SELECT pg_current_wal_insert_lsn()")
        out=$("$pgbench" -n -M prepared -c "$clients" -j 2 -T "$seconds" -f "$work/$variant-$flavour.sql" "$url" 2>&1) ||
          { echo "$out" >&2; exit 1; }
        tps=$(echo "$out" | sed -n 's/^tps = \([0-9.]*\) .*/\1/p' | head -1)
        xacts=$(echo "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')
        # pgbench's sessions report their statistics as they end.
        sleep 1
        after=$(counters "$table")
        wal=$(sql -c "SELECT pg_current_wal_insert_lsn() - '$wal0'")
        read -r u0 h0 i0 e0 <<<"$before"
        read -r u1 h1 i1 e1 <<<"$after"
        say "ordered_$variant $flavour round $round: $tps tps (load $load)"
        sql -c "INSERT INTO $schema.claims VALUES ('$variant', '$flavour', $round, $tps, '$load',
                $xacts, $((u1 - u0)), $((h1 - h0)), $((i1 - i0)), $((e1 - e0)), $wal)"
      done
    done
  done
  for variant in $variants; do
    table=$schema.ordered_$variant
    sql -c "VACUUM ANALYZE $table"
    fact "ordered_$variant" after_plan "$(sweep_plan "$table")"
    sql -c "CALL $schema.sweep('$table', 'ordered_$variant after claims', $batch)"
  done
fi

# --- The report -----------------------------------------------------------------
say "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "Sweep (${IDEM_EI_SWEEP:-runtime}): $expired expired + $live live rows, batches of $batch (server-side time)"
psql -X -q "$url" <<EOF
SELECT split_part(f.label, '_', 1) AS layout, split_part(f.label, '_', 2) AS variant,
       max(value) FILTER (WHERE fact = 'index_size') AS "index",
       max(value) FILTER (WHERE fact = 'table_size') AS "table",
       max(value) FILTER (WHERE fact = 'plan') AS "sweep scan",
       s.batches, s.deleted,
       round(s.total_ms::numeric / 1000, 2) AS "total s",
       round(s.max_ms::numeric, 1) AS "max batch ms",
       round(s.p50_ms::numeric, 2) AS "p50 batch ms",
       round(s.last_ms::numeric, 1) AS "empty batch ms",
       round(i.ms::numeric, 2) AS "idle ms",
       max(value) FILTER (WHERE fact = 'idle_plan') AS "idle scan",
       round(a.ms::numeric, 2) AS "idle after claims ms",
       max(value) FILTER (WHERE fact = 'after_plan') AS "scan after claims"
FROM $schema.facts f
JOIN (SELECT label, count(*) AS batches, sum(deleted) AS deleted, sum(ms) AS total_ms,
             max(ms) AS max_ms, percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50_ms,
             (array_agg(ms ORDER BY batch DESC))[1] AS last_ms
      FROM $schema.sweep_log GROUP BY label) s ON s.label = f.label
LEFT JOIN $schema.sweep_log i ON i.label = f.label || ' idle' AND i.batch = 1
LEFT JOIN $schema.sweep_log a ON a.label = f.label || ' after claims' AND a.batch = 1
GROUP BY f.label, s.batches, s.deleted, s.total_ms, s.max_ms, s.p50_ms, s.last_ms, i.ms, a.ms
ORDER BY array_position(string_to_array('$layouts', ' '), split_part(f.label, '_', 1)), array_position(string_to_array('$variants', ' '), split_part(f.label, '_', 2));
EOF
if [[ " $layouts " == *" ordered "* ]]; then
  echo "Claim + stored response: $clients clients, ${seconds} s per run, $runs round(s); tps per run"
  psql -X -q "$url" <<EOF
SELECT variant, flavour, string_agg(round(tps)::text, ' / ' ORDER BY round) AS "tps by run",
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY tps)) AS "median tps",
       round(100.0 * sum(hot) / nullif(sum(updates), 0), 1) AS "HOT %",
       round(sum(index_blocks)::numeric / sum(xacts), 1) AS "index buffers/claim",
       round(sum(expiry_blocks)::numeric / sum(xacts), 1) AS "expiry idx buffers/claim",
       round(sum(wal) / sum(xacts)) AS "WAL B/claim",
       string_agg(load, ' ' ORDER BY round) AS "load avg"
FROM $schema.claims GROUP BY variant, flavour
ORDER BY flavour, array_position(string_to_array('$variants', ' '), variant);
EOF
fi
