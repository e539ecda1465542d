//! The RFC 8785 canonicaliser on any bytes: no panic, canonical of
//! canonical is canonical, the fingerprint of a JSON body is the
//! fingerprint of its canonical form, and that fingerprint, which hashes
//! the form as it is written, is the hash of `canonicalize`'s bytes.
#![no_main]

use http::{HeaderMap, HeaderValue, Method, header::CONTENT_TYPE};
use idem_runtime::Fingerprint;
use idem_runtime::canonical::canonicalize;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

/// The fingerprint of `POST /f` with a JSON body whose canonical form is
/// `canonical`, hashed whole.
fn framed(canonical: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"idem-fingerprint-v1");
    for part in [&b"POST"[..], b"/f"] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.update([0]);
    hasher.update(b"json");
    hasher.update((canonical.len() as u64).to_be_bytes());
    hasher.update(canonical);
    hasher.finalize().into()
}

fuzz_target!(|data: &[u8]| {
    let Ok(once) = canonicalize(data) else {
        return;
    };
    let twice = canonicalize(&once).expect("canonical JSON parses");
    assert_eq!(once, twice, "canonical form is not stable");
    let mut json = HeaderMap::new();
    json.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let fingerprint = Fingerprint::of(&Method::POST, "/f", None, &json, data);
    assert_eq!(
        fingerprint,
        Fingerprint::of(&Method::POST, "/f", None, &json, &once),
    );
    assert_eq!(fingerprint.as_bytes(), &framed(&once));
});
