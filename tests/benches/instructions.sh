#!/usr/bin/env bash
# Instructions per request, counted by callgrind: the benchmark's server
# process and the PostgreSQL backend serving it, per scenario. Unlike req/s
# and CPU time, these counts do not move with the machine's load or clock
# (PostgreSQL's to within a few hundred instructions; the server's within a
# few thousand, its allocator and hash maps seeded anew by each run), so
# an A/B of a change to the wrapper's Rust or SQL is a run or two of each.
#
#   tests/benches/instructions.sh            # baseline, idempotent, replay, two_phase
#   IDEM_IR_SCENARIOS=replay,read_floor tests/benches/instructions.sh  # and a replay's floor
#   IDEM_IR_SCENARIOS=idempotent IDEM_IR_STATEMENTS=3 tests/benches/instructions.sh
#   IDEM_BENCH_HASH_KEYS=1 tests/benches/instructions.sh  # scopes and keys hashed
#   IDEM_IR_SQL='DROP INDEX ...' tests/benches/instructions.sh  # a schema variant
#
# The benchmark's server inherits the environment, so its A/B switches
# apply: IDEM_BENCH_ENCRYPTION=1 (values sealed at rest), IDEM_BENCH_HASH_KEYS=1
# (scopes and keys stored hashed), run back to back with a run without.
#
# It starts its own PostgreSQL cluster under callgrind (a temporary directory,
# port IDEM_IR_PORT, default 55499; the machine's PostgreSQL 15 binaries and
# valgrind), creates the benchmark's tables there, and for each scenario runs
# the benchmark's server (pool of one connection) under callgrind twice,
# with N1 and N2 sequential requests over one keep-alive connection (curl).
# Per request = (count at N2 - count at N1) / (N2 - N1): start-up cancels out.
# IDEM_IR_SERVER names another build of the benchmark to measure (an A/B
# against another revision: `cargo bench --bench throughput --no-run` there).
# Takes about half a minute per scenario (two to three minutes for the
# default four, plus a release build the first time); everything it
# starts, it stops.
set -euo pipefail
cd "$(dirname "$0")/.."

scenarios=${IDEM_IR_SCENARIOS:-baseline,idempotent,replay,two_phase}
statements=${IDEM_IR_STATEMENTS:-1}
n1=${IDEM_IR_N1:-100}
n2=${IDEM_IR_N2:-500}
port=${IDEM_IR_PORT:-55499}
pg_bin=${IDEM_IR_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}

for tool in valgrind callgrind_annotate curl; do
  command -v "$tool" >/dev/null || { echo "instructions: $tool is required" >&2; exit 1; }
done

work=$(mktemp -d /tmp/idem-instructions.XXXXXX)
server_fifo=$work/stdin
label=instructions
# shellcheck source=callgrind_cluster.sh
. benches/callgrind_cluster.sh
build_bench
server_bin=${IDEM_IR_SERVER:-$bench}
start_cluster
# IDEM_IR_SQL: statements run once the tables exist (a diagnostic variant
# of the schema, such as an index dropped).
if [ -n "${IDEM_IR_SQL:-}" ]; then
  "$pg_bin/psql" -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres postgres -c "$IDEM_IR_SQL"
fi

# One server run of $2 requests of scenario $1: "server_ir backend_ir".
run() {
  local scenario=$1 n=$2 route=$1 before replaying=
  case $scenario in replay | read_floor) replaying=1 ;; esac
  [ "$scenario" = replay ] && route=idempotent
  before=$(ls "$work/cg" | grep '^pg\.' | sort)
  rm -f "$server_fifo" "$work/server.out" "$work"/cg/server.*
  mkfifo "$server_fifo"
  IDEM_BENCH_ROLE=server IDEM_BENCH_ENGINE=postgres IDEM_BENCH_DATABASE_URL=$url \
    IDEM_BENCH_POOL=1 IDEM_BENCH_SERVER_THREADS=1 \
    valgrind --tool=callgrind --callgrind-out-file="$work/cg/server.%p" "$server_bin" \
    <"$server_fifo" >"$work/server.out" 2>"$work/server.err" &
  local server_pid=$!
  exec 3>"$server_fifo"
  for _ in $(seq 1 240); do grep -q LISTENING "$work/server.out" 2>/dev/null && break; sleep 0.25; done
  local addr
  addr=$(awk '/LISTENING/{print $2}' "$work/server.out")
  [ -n "$addr" ] || { echo "instructions: the server did not start" >&2; cat "$work/server.err" >&2; exit 1; }
  local tag=$RANDOM$RANDOM args=() i key
  request() { # route account key
    args+=(-s -o /dev/null -w '%{http_code}\n' -X POST -H 'content-type: application/json'
      -H "x-account: $2" -H "idempotency-key: $3" -d '{"amount": 1250, "currency": "eur"}'
      "http://$addr/$statements/$1" --next)
  }
  # A replay run (and its floor, `read_floor`) first finishes the keys it
  # replays; both runs do, so the difference is replays alone.
  if [ -n "$replaying" ]; then
    for i in $(seq 0 15); do request idempotent c0 "r-$tag-$i"; done
  fi
  for i in $(seq 1 "$n"); do
    if [ -n "$replaying" ]; then
      request "$route" c0 "r-$tag-$((i % 16))"
    else
      request "$route" "c$((i % 256))" "k-$tag-$i"
    fi
  done
  unset 'args[${#args[@]}-1]' # the last --next
  curl "${args[@]}" >"$work/codes" || true
  exec 3>&-
  wait "$server_pid" || true
  local bad
  bad=$(grep -vc '^201$' "$work/codes" || true)
  [ "$bad" = 0 ] && [ "$(wc -l <"$work/codes")" -ge "$n" ] || {
    echo "instructions: $scenario: not every answer was 201" >&2
    sort "$work/codes" | uniq -c >&2
    exit 1
  }
  # The backend writes its counts when the server's connection closes.
  local backend=
  for _ in $(seq 1 120); do
    backend=$(backend_ir "$before")
    [ -n "$backend" ] && break
    sleep 0.5
  done
  # IDEM_IR_KEEP=<dir> keeps each run's profiles, for callgrind_annotate.
  if [ -n "${IDEM_IR_KEEP:-}" ]; then
    mkdir -p "$IDEM_IR_KEEP"
    cp "$work"/cg/server.* "$IDEM_IR_KEEP/server.$scenario.$n"
    cp "$work/cg/$(backend_profile "$before" | cut -d' ' -f2)" "$IDEM_IR_KEEP/postgres.$scenario.$n"
  fi
  echo "$(awk '/^summary:/{print $2}' "$work"/cg/server.*) $backend"
}

# A discarded run first: the set-up's backend has written its counts by the
# end of it, and the cluster's caches are as warm for N1 as for N2.
run baseline 10 >/dev/null
printf '%-12s %6s %16s %16s\n' scenario stmts "server instr/req" "postgres instr/req"
for scenario in ${scenarios//,/ }; do
  first=$(run "$scenario" "$n1")
  second=$(run "$scenario" "$n2")
  read -r s1 p1 <<<"$first"
  read -r s2 p2 <<<"$second"
  printf '%-12s %6s %16d %16d\n' "$scenario" "$statements" \
    $(( (s2 - s1) / (n2 - n1) )) $(( (p2 - p1) / (n2 - n1) ))
done
