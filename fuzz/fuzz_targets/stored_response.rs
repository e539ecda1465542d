//! The stored-response decoder on any bytes (a corrupt or hostile row): no
//! panic, and whatever decodes encodes back to something that decodes to
//! the same headers. The checks live next to the decoder, in
//! `idem-runtime/src/fuzzing.rs` (built with `--cfg fuzzing`, which
//! cargo-fuzz sets): the encoding is not a public API.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| idem_runtime::fuzzing::stored_response(data));
