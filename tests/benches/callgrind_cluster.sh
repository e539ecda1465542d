# Sourced by the benchmarks that count a PostgreSQL backend's instructions
# (instructions.sh, experiments/floor/floor.sh), from the tests directory,
# with `work` (a fresh temporary directory), `pg_bin`, `port` and `label`
# set. Provides `as_owner`, a cleanup of everything started (trapped on
# exit), `build_bench` (sets `bench`, the throughput benchmark's binary,
# whose set-up creates the tables) and `start_cluster` (a cluster of its
# own in `$work/pg` under callgrind, every process's profile in `$work/cg`,
# the tables created; sets `url`), `backend_profile` and `backend_ir`.

# PostgreSQL refuses to run as root: the cluster belongs to `postgres` then.
as_owner() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/bash -c "$*"; else bash -c "$*"; fi; }

cluster_pid=
cleanup() {
  if [ -n "$cluster_pid" ]; then
    as_owner "'$pg_bin/pg_ctl' -D '$work/pg/data' -m immediate -w stop" >/dev/null 2>&1 || true
    wait "$cluster_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

build_bench() {
  echo "$label: building the benchmark" >&2
  cargo bench --bench throughput --no-run --message-format=json 2>/dev/null >"$work/build.json"
  bench=$(grep -o '"executable":"[^"]*throughput[^"]*"' "$work/build.json" | tail -1 | cut -d'"' -f4)
  [ -x "$bench" ] || { echo "$label: benchmark binary not found" >&2; exit 1; }
}

start_cluster() {
  mkdir -p "$work/pg" "$work/cg"
  [ "$(id -u)" = 0 ] && chown postgres "$work" "$work/pg" "$work/cg"
  as_owner "'$pg_bin/initdb' -D '$work/pg/data' -A trust -U postgres" >"$work/initdb.log" 2>&1
  as_owner "exec valgrind --tool=callgrind --trace-children=yes \
    --callgrind-out-file='$work/cg/pg.%p' '$pg_bin/postgres' -D '$work/pg/data' -p $port \
    -k '$work/pg' -c listen_addresses=127.0.0.1 -c fsync=on -c autovacuum=off" \
    >"$work/pg.log" 2>&1 &
  cluster_pid=$!
  for _ in $(seq 1 120); do
    "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$port" && break
    sleep 0.5
  done
  "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$port" || { echo "$label: cluster did not start" >&2; exit 1; }
  url="postgres://postgres@127.0.0.1:$port/postgres"
  IDEM_BENCH_ROLE=setup IDEM_BENCH_DATABASE_URL=$url "$bench"
}

# The profile of the busiest PostgreSQL backend among those not listed in
# $1 (the profiles before a run), as "instructions file".
backend_profile() {
  comm -13 <(echo "$1") <(ls "$work/cg" | grep '^pg\.' | sort) |
    while read -r file; do echo "$(awk '/^summary:/{print $2}' "$work/cg/$file") $file"; done |
    sort -n | tail -1
}

# Its instructions.
backend_ir() { backend_profile "$1" | cut -d' ' -f1; }
