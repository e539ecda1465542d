//! The stored-response decoder on any bytes (a corrupt or hostile row): no
//! panic, and whatever decodes encodes back to something that decodes to
//! the same headers.
#![no_main]

use idem_runtime::__private::{StoredResponse, decode_headers};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (status, headers) = match data.split_first_chunk::<2>() {
        Some((status, rest)) => (i64::from(i16::from_be_bytes(*status)), rest),
        None => (0, data),
    };
    if let Some(decoded) = decode_headers(headers) {
        let response = StoredResponse {
            status: http::StatusCode::OK,
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
});
