#!/usr/bin/env bash
# What `#[idempotent]` costs to compile: generates a service crate with N
# handlers, each annotated (`Tx<Postgres>`, a scope extractor, a `Json`
# body, one statement) or the same handler written by hand on a plain sqlx
# transaction, and times the crate alone (its dependencies built first):
# `cargo check`, a debug build and a release build, best of two, with
# incremental compilation off, so each is a full compile of the crate.
# Prints one line per crate and the cost of one more handler (the slope
# between the smallest and the largest N).
#
#   tests/benches/compile_cost.sh                         # N = 50 and 200
#   IDEM_CC_N="20 100" IDEM_CC_PROFILES=check tests/benches/compile_cost.sh
#
# IDEM_CC_DIR: where the crates and their target dir go (default
# target/compile-cost). Needs no database: nothing runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${IDEM_CC_DIR:-$root/target/compile-cost}
sizes=${IDEM_CC_N:-50 200}
profiles=${IDEM_CC_PROFILES:-check,debug,release}
export CARGO_INCREMENTAL=0 CARGO_TARGET_DIR=$dir/target
mkdir -p "$dir"

# generate VARIANT N: writes $dir/VARIANT-N.
generate() {
  local variant=$1 n=$2 crate=$dir/$1-$2 i
  mkdir -p "$crate/src"
  cp "$root/Cargo.lock" "$crate/Cargo.lock"
  cat >"$crate/Cargo.toml" <<EOF
[package]
name = "cc_${variant}_$n"
version = "0.0.0"
edition = "2024"
publish = false

[workspace]

[dependencies]
idem = { path = "$root", default-features = false, features = ["postgres"] }
axum = { version = "0.8", features = ["json", "macros", "tokio", "http1"] }
sqlx = { version = "0.9", default-features = false, features = ["runtime-tokio", "postgres"] }
serde = { version = "1", features = ["derive"] }
tokio = { version = "1", features = ["full"] }
EOF
  {
    cat <<'EOF'
use std::borrow::Cow;

use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{Idem, Scope, Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres};

pub struct Account(String);

impl Scope for Account {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let bearer = parts.headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        match bearer.and_then(|v| v.strip_prefix("Bearer ")) {
            Some(account) => Ok(Account(account.to_owned())),
            None => Err(StatusCode::UNAUTHORIZED),
        }
    }
}

pub struct ApiError(sqlx::Error);

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        eprintln!("database error: {}", self.0);
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

#[derive(Clone, FromRef)]
pub struct AppState {
    idem: Idem<Postgres>,
    pool: PgPool,
}
EOF
    for ((i = 0; i < n; i++)); do
      cat <<EOF

#[derive(Deserialize)]
pub struct Req$i {
    amount: i64,
    currency: String,
}

#[derive(Serialize)]
pub struct Resp$i {
    rows: u64,
    amount: i64,
    currency: String,
}
EOF
      if [ "$variant" = annotated ]; then
        cat <<EOF

#[idempotent(scope = "account", ttl = "24h")]
async fn h$i(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(req): Json<Req$i>,
) -> Result<(StatusCode, Json<Resp$i>), ApiError> {
EOF
      else
        cat <<EOF

async fn h$i(
    account: Account,
    State(pool): State<PgPool>,
    Json(req): Json<Req$i>,
) -> Result<(StatusCode, Json<Resp$i>), ApiError> {
    let mut tx = pool.begin().await?;
EOF
      fi
      cat <<EOF
    let done = sqlx::query("INSERT INTO t$i (account, amount, currency) VALUES (\$1, \$2, \$3)")
        .bind(&account.0)
        .bind(req.amount)
        .bind(&req.currency)
        .execute(&mut *tx)
        .await?;
EOF
      [ "$variant" = plain ] && echo "    tx.commit().await?;"
      cat <<EOF
    let (amount, currency, rows) = (req.amount, req.currency, done.rows_affected());
    Ok((StatusCode::CREATED, Json(Resp$i { rows, amount, currency })))
}
EOF
    done
    printf '\npub fn router() -> Router<AppState> {\n    Router::new()\n'
    for ((i = 0; i < n; i++)); do printf '        .route("/h%d", post(h%d))\n' "$i" "$i"; done
    cat <<'EOF'
}

#[tokio::main]
async fn main() {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://localhost/x".into());
    let pool = PgPool::connect_lazy(&url).unwrap();
    let state = AppState { idem: Idem::new(pool.clone()), pool };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    axum::serve(listener, router().with_state(state)).await.unwrap();
}
EOF
  } >"$crate/src/main.rs"
}

# best CRATE CARGO-ARGS...: the faster of two full compiles of the crate, in s.
best() {
  local crate=$1 runs=() start end
  shift
  (cd "$crate" && cargo "$@" --quiet >/dev/null 2>&1) # dependencies, once
  for _ in 1 2; do
    touch "$crate/src/main.rs"
    start=$(date +%s%N)
    (cd "$crate" && cargo "$@" --quiet >/dev/null 2>&1)
    end=$(date +%s%N)
    runs+=($(((end - start) / 1000000)))
  done
  local min=$((runs[0] < runs[1] ? runs[0] : runs[1]))
  printf '%d.%03d' $((min / 1000)) $((min % 1000))
}

results=$dir/results.txt
: >"$results"
printf '%-16s %9s %9s %9s %14s\n' crate check_s debug_s release_s release_bytes
for variant in annotated plain; do
  for n in $sizes; do
    generate "$variant" "$n"
    crate=$dir/$variant-$n
    check=- debug=- release=- size=-
    case ",$profiles," in *,check,*) check=$(best "$crate" check) ;; esac
    case ",$profiles," in *,debug,*) debug=$(best "$crate" build) ;; esac
    case ",$profiles," in *,release,*)
      release=$(best "$crate" build --release)
      size=$(stat -c %s "$CARGO_TARGET_DIR/release/cc_${variant}_$n")
      ;;
    esac
    printf '%-16s %9s %9s %9s %14s\n' "$variant-$n" "$check" "$debug" "$release" "$size"
    echo "$variant $n $check $debug $release $size" >>"$results"
  done
done

# The cost of one more handler, between the smallest and the largest N.
awk '
  { key = $1; n = $2
    if (!(key in lo) || n < lo[key]) { lo[key] = n; for (i = 3; i <= 6; i++) a[key, i] = $i }
    if (!(key in hi) || n > hi[key]) { hi[key] = n; for (i = 3; i <= 6; i++) b[key, i] = $i } }
  END {
    printf "\none more handler (slope from N=%d to N=%d):\n", lo["annotated"], hi["annotated"]
    printf "%-10s %9s %9s %9s %14s\n", "", "check_s", "debug_s", "release_s", "release_bytes"
    for (k in lo) {
      line = sprintf("%-10s", k)
      for (i = 3; i <= 6; i++) {
        if (a[k, i] == "-" || hi[k] == lo[k]) { line = line sprintf(" %9s", "-"); continue }
        slope = (b[k, i] - a[k, i]) / (hi[k] - lo[k])
        line = line sprintf(i == 6 ? " %14.0f" : " %9.3f", slope)
      }
      print line
    }
  }' "$results"
echo "results: $results"
