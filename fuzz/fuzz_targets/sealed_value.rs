//! The sealed-value envelope (encryption at rest) on any bytes: a corrupt
//! or hostile row never panics its decoder and never opens without the
//! key. The checks live next to the envelope, in
//! `idem-runtime/src/fuzzing.rs` (built with `--cfg fuzzing`, which
//! cargo-fuzz sets): the envelope is not a public API.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| idem_runtime::fuzzing::sealed_value(data));
