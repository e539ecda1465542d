//! The RFC 8785 canonicaliser on any bytes: no panic, canonical of
//! canonical is canonical, and the fingerprint of a JSON body is the
//! fingerprint of its canonical form.
#![no_main]

use http::{HeaderMap, HeaderValue, Method, header::CONTENT_TYPE};
use idem_runtime::__private::{Fingerprint, canonicalize};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(once) = canonicalize(data) else {
        return;
    };
    let twice = canonicalize(&once).expect("canonical JSON parses");
    assert_eq!(once, twice, "canonical form is not stable");
    let mut json = HeaderMap::new();
    json.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    assert_eq!(
        Fingerprint::of(&Method::POST, "/f", None, &json, data),
        Fingerprint::of(&Method::POST, "/f", None, &json, &once),
    );
});
