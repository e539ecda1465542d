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

/// The sealed-value envelope on any bytes (a corrupt or hostile row): its
/// decoder never panics, and what it takes apart is what the bytes hold;
/// no bytes open as a sealed value without the key (only plain ones are
/// read as they are); a value sealed from the bytes opens back to them,
/// for its own row and column only; and a stored response made of the
/// bytes opens or is refused, without a panic.
pub fn sealed_value(data: &[u8]) {
    use std::sync::LazyLock;

    use crate::response::EncodedResponse;
    use crate::seal::{Column, Envelope, KeyRing, Row, Sealer, is_sealed};

    static RING: LazyLock<KeyRing> = LazyLock::new(|| {
        KeyRing::new("old", [7; 32])
            .and_then(|ring| ring.with_key("new", [9; 32]))
            .expect("a valid ring")
    });
    let row = Row {
        table: "idem_keys",
        scope: "acct_1",
        key: "order-42",
    };
    if let Some(envelope) = Envelope::parse(data) {
        assert_eq!(envelope.header, &data[..3 + envelope.key_id.len()]);
        assert_eq!(
            envelope.header.len() + 12 + envelope.sealed.len(),
            data.len()
        );
        assert!(envelope.sealed.len() >= 16);
    }
    for column in [
        Column::Headers,
        Column::Body,
        Column::Request,
        Column::Recovery,
    ] {
        match RING.open(row, column, data) {
            Ok(opened) => assert!(!is_sealed(data) && *opened == *data),
            Err(_) => assert!(is_sealed(data)),
        }
    }
    let sealed = RING.seal(row, Column::Recovery, data);
    assert_eq!(
        *RING.open(row, Column::Recovery, &sealed).expect("opens"),
        *data
    );
    assert!(RING.open(row, Column::Request, &sealed).is_err());
    let other = Row {
        key: "order-43",
        ..row
    };
    assert!(RING.open(other, Column::Recovery, &sealed).is_err());
    let (headers, body) = data.split_at(data.len() / 2);
    let response = EncodedResponse {
        status: StatusCode::OK,
        headers: headers.to_vec(),
        body: body.to_vec().into(),
        tombstone: None,
    };
    let sealer = Sealer {
        ring: Some(&RING),
        table: row.table,
    };
    let _ = response.open(&sealer, row.scope, row.key);
}
