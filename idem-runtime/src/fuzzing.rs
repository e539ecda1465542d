//! Entry points of the fuzz targets in `fuzz/`, for what stays inside the
//! crate: each takes the fuzzer's bytes and panics where a property fails.
//! Built only with `--cfg fuzzing` (cargo-fuzz sets it) and in this
//! crate's own tests, which run the same checks on proptest's inputs. Not
//! an API.

use http::StatusCode;

use crate::response::{StoredResponse, decode_headers};

/// The stored-response decoder on any bytes (a corrupt or hostile row):
/// no panic, whatever decodes encodes back to something that decodes to
/// the same headers, and a decoded status is the one stored. The first two
/// bytes, if there are two, are the status (as a signed `i16`, so that
/// negative statuses come up too), the rest the headers, and all of `data`
/// the body.
pub fn stored_response(data: &[u8]) {
    let (status, headers) = match data.split_first_chunk::<2>() {
        Some((status, rest)) => (i64::from(i16::from_be_bytes(*status)), rest),
        None => (0, data),
    };
    if let Some(decoded) = decode_headers(headers) {
        let response = StoredResponse {
            status: StatusCode::OK,
            headers: decoded,
            body: Default::default(),
        };
        assert_eq!(
            decode_headers(&response.encode_headers()).as_ref(),
            Some(&response.headers)
        );
    }
    if let Some(response) = StoredResponse::decode(status, headers, data.to_vec()) {
        assert_eq!(i64::from(response.status.as_u16()), status);
        let again = StoredResponse::decode(status, &response.encode_headers(), data.to_vec());
        assert_eq!(again.as_ref(), Some(&response));
    }
}
