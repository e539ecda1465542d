#!/usr/bin/env bash
# PostgreSQL's instructions per transaction for hand-written statement
# sequences, run by pgbench over the extended protocol with named prepared
# statements (`-M prepared`: parsed and planned once per connection, each
# statement's parameters bound): the floor a new key's statements could
# reach with bound parameters in any number of round trips, which sqlx 0.9
# cannot send beside `BEGIN` and `COMMIT` (see ../pipelining). Not part of
# `idem`; see README.md.
#
#   tests/benches/experiments/floor/floor.sh
#   FLOOR_SCRIPTS="plain floor" tests/benches/experiments/floor/floor.sh
#
# Starts its own cluster under callgrind (port FLOOR_PORT, default 55498),
# creates the benchmark's tables with the benchmark's own set-up (so the key
# table is `migrate()`'s), and runs each script for N1 and N2 transactions
# on one connection: per transaction = (count at N2 - count at N1) / (N2 -
# N1). Everything it starts, it stops.
set -euo pipefail
cd "$(dirname "$0")/../../.."

n1=${FLOOR_N1:-100}
n2=${FLOOR_N2:-500}
port=${FLOOR_PORT:-55498}
pg_bin=${FLOOR_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
scripts=${FLOOR_SCRIPTS:-plain plain_two_statements lock_only floor_unlocked floor floor_idem_bench_keys floor_floor_keys floor_floor_keys_expiry look_idem_bench_keys look_floor_keys today_unbounded today}

work=$(mktemp -d /tmp/idem-floor.XXXXXX)
label=floor
# shellcheck source=../../callgrind_cluster.sh
. benches/callgrind_cluster.sh
build_bench

# The scripts. `:k` is a fresh key per transaction; the key table's values
# are of the sizes a new key's claim and response have in the benchmark
# (32-byte fingerprint, a short JSON body).
mkdir -p "$work/scripts"
scope_of="convert_to('c' || (:k::bigint % 256), 'UTF8')"
key_of="convert_to('k-' || :k::text, 'UTF8')"
key_values="$scope_of, $key_of, sha256(convert_to(:k::text, 'UTF8'))"
body="convert_to('{\"id\":' || :k::text || ',\"amount\":1250,\"currency\":\"eur\"}', 'UTF8')"
charge="INSERT INTO bench_charges (account, amount, currency) VALUES ('c' || (:k::bigint % 256), 1250, 'eur') RETURNING id;"
write() { printf '\\set k random(1, 1000000000000000)\n%s\n' "$2" >"$work/scripts/$1.sql"; }
# The plain handler: its BEGIN, one INSERT, COMMIT.
write plain "BEGIN;
$charge
COMMIT;"
# What one more bound statement costs, whatever it is: the plain handler
# with a second (ledger) insert.
write plain_two_statements "BEGIN;
$charge
INSERT INTO bench_ledger (charge_id, account, amount) VALUES (:k, 'c1', 1250);
COMMIT;"
# The plain handler and the key's advisory lock alone.
write lock_only "BEGIN;
SELECT pg_try_advisory_xact_lock(:k);
$charge
COMMIT;"
# The issue's floor: the lock as the exclusion, the key's row inserted
# once, complete, at the finish.
write floor "BEGIN;
SELECT pg_try_advisory_xact_lock(:k);
$charge
INSERT INTO idem_bench_keys (scope, key, fingerprint, expires_at, status, headers, body)
  VALUES ($key_values, now() + interval '1 day', 201, '\\x'::bytea, $body);
COMMIT;"
# The same without the lock: the row's insert alone.
write floor_unlocked "BEGIN;
$charge
INSERT INTO idem_bench_keys (scope, key, fingerprint, expires_at, status, headers, body)
  VALUES ($key_values, now() + interval '1 day', 201, '\\x'::bytea, $body);
COMMIT;"
# Today's statements, bound instead of inlined: the orphan bound's
# setting (`today` only), the claim (lock and row), the handler, the
# response stored.
today_claim="INSERT INTO idem_bench_keys (scope, key, fingerprint, expires_at)
  SELECT $key_values, now() + interval '1 day'
  WHERE (CASE WHEN pg_try_advisory_xact_lock(:k) THEN 'true' ELSE 'held' END)::boolean;
$charge
UPDATE idem_bench_keys SET status = 201, headers = '\\x'::bytea, body = $body
  WHERE scope = $scope_of AND key = $key_of AND status IS NULL;
COMMIT;"
write today "BEGIN;
SET LOCAL idle_in_transaction_session_timeout = '32000ms';
$today_claim"
write today_unbounded "BEGIN;
$today_claim"
# The floor with the row's values constant but its key (a fingerprint and
# body as literals, parsed once at the statement's preparation): what the
# row's insert costs beyond computing the values.
const_values="$scope_of, $key_of, \
'\\x00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff'::bytea"
const_body="'\\x7b226964223a312c22616d6f756e74223a313235302c2263757272656e6379223a22657572227d'::bytea"
for table in idem_bench_keys floor_keys floor_keys_expiry; do
  write "floor_$table" "BEGIN;
SELECT pg_try_advisory_xact_lock(:k);
$charge
INSERT INTO $table (scope, key, fingerprint, expires_at, status, headers, body)
  VALUES ($const_values, now() + interval '1 day', 201, '\\x'::bytea, $const_body);
COMMIT;"
done
# The floor with the look at the key a claim needs before the handler runs
# (a finished row is replayed, not run again): the lock and the look in one
# statement.
for table in idem_bench_keys floor_keys; do
  write "look_$table" "BEGIN;
SELECT pg_try_advisory_xact_lock(:k), EXISTS (SELECT 1 FROM $table
  WHERE scope = $scope_of AND key = $key_of);
$charge
INSERT INTO $table (scope, key, fingerprint, expires_at, status, headers, body)
  VALUES ($const_values, now() + interval '1 day', 201, '\\x'::bytea, $const_body);
COMMIT;"
done
chmod -R a+rX "$work/scripts"

start_cluster

# Key tables of the floor's variants: the key table's primary key alone,
# then with the expiry index (`migrate()`'s has two partial indexes more).
"$pg_bin/psql" -q -h 127.0.0.1 -p "$port" -U postgres postgres -c "
  CREATE TABLE floor_keys (scope bytea NOT NULL, key bytea NOT NULL, fingerprint bytea NOT NULL,
    status smallint, headers bytea, body bytea, expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key));
  CREATE TABLE floor_keys_expiry (LIKE floor_keys INCLUDING ALL);
  CREATE INDEX ON floor_keys_expiry (expires_at);" >/dev/null

# The number of profiles written so far.
profiles() { ls "$work/cg" | wc -l; }

# Waits until no profile has been added for 3 s: every process that has
# exited has written its own.
settle() {
  local settled=0 last=-1 now
  while [ "$settled" -lt 12 ]; do
    now=$(profiles)
    if [ "$now" = "$last" ]; then settled=$((settled + 1)); else settled=0; fi
    last=$now
    sleep 0.25
  done
}
settle

# One pgbench run of $2 transactions of script $1: its backend's count
# (written when the connection closes, so once the profiles settle).
run() {
  local before
  before=$(ls "$work/cg" | grep '^pg\.' | sort)
  "$pg_bin/pgbench" -n -M prepared -c 1 -t "$2" -h 127.0.0.1 -p "$port" -U postgres \
    -f "$work/scripts/$1.sql" postgres >"$work/pgbench.out" 2>&1 ||
    { cat "$work/pgbench.out" >&2; exit 1; }
  grep -q "actually processed: $2/$2" "$work/pgbench.out" ||
    { cat "$work/pgbench.out" >&2; exit 1; }
  settle
  backend_ir "$before"
}

run plain 10 >/dev/null
printf '%-22s %18s\n' script "postgres instr/tx"
for script in $scripts; do
  a=$(run "$script" "$n1")
  b=$(run "$script" "$n2")
  printf '%-22s %18d\n' "$script" $(( (b - a) / (n2 - n1) ))
done
