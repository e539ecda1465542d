#!/usr/bin/env bash
# Every fuzz target for a fixed time (FUZZ_SECONDS each, 30 by default), on
# the stable toolchain: cargo-fuzz's nightly-only flags (-Zsanitizer=address
# and the like) are let through by RUSTC_BOOTSTRAP=1. Installs cargo-fuzz
# if it is missing. Fails on the first crash, leak, or input slower than
# FUZZ_INPUT_SECONDS (10 by default); libFuzzer saves the input under
# fuzz/artifacts/<target>/ and prints how to replay it.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-30}
input_seconds=${FUZZ_INPUT_SECONDS:-10}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked --version 0.13.2
fi

cargo fuzz build
for target in $(cargo fuzz list); do
  echo "fuzz: $target for ${seconds} s"
  cargo fuzz run "$target" -- \
    -max_total_time="$seconds" -timeout="$input_seconds" -print_final_stats=1
done
