//! Responses worth remembering: capture, storage encoding and replay.

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode, header};
use http_body_util::{BodyExt, Limited};

use crate::seal::{Column, OpenError, Sealer, is_sealed};

/// Header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Headers replayed by default, besides those a user adds.
pub const DEFAULT_REPLAY_HEADERS: &[HeaderName] = &[
    header::CACHE_CONTROL,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::CONTENT_TYPE,
    header::ETAG,
    header::EXPIRES,
    header::LAST_MODIFIED,
    header::LINK,
    header::LOCATION,
    header::VARY,
];

/// Headers that describe one connection or one client, never a result.
pub(crate) fn is_forbidden(name: &HeaderName) -> bool {
    const FORBIDDEN: &[HeaderName] = &[
        header::SET_COOKIE,
        header::CONNECTION,
        header::CONTENT_LENGTH,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ];
    FORBIDDEN.contains(name)
        || name == "keep-alive"
        || name == "proxy-connection"
        || name == "set-cookie2"
}

/// Whether a response may be stored: a transient answer (5xx, 408, 429)
/// must stay retryable, so it is never stored.
pub fn is_storable(status: StatusCode) -> bool {
    !(status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS)
}

/// A response as stored for replay: status, allow-listed headers, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status of the attempt that did the work.
    pub status: StatusCode,
    /// The allow-listed headers, in their original order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, verbatim.
    pub body: Bytes,
}

/// A response as the key table keeps it: its status, and its headers and
/// body as their columns hold them ([encoded](StoredResponse::encode_headers),
/// and sealed where the store encrypts). What the engines write and read;
/// the protocol makes one ([`StoredResponse::seal`]) and opens it
/// ([`EncodedResponse::open`]), so no engine knows of encryption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedResponse {
    /// The status, never sealed.
    pub status: StatusCode,
    /// The `headers` column.
    pub headers: Vec<u8>,
    /// The `body` column.
    pub body: Bytes,
    /// What a handler with `tombstone` keeps past its `ttl`: set on the
    /// write of such a handler's response, `None` on every read. Boxed:
    /// the response waits in every request's future for its commit.
    pub tombstone: Option<Box<TombstoneWrite>>,
}

/// The tombstone a response's write sets up: how long it is replayed, how
/// long its key is kept, and its `Location` (the `location` column: sealed
/// where the store encrypts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TombstoneWrite {
    /// How long after the write the response is replayed (`ttl`).
    pub replay: std::time::Duration,
    /// How long after the write the key is kept (`tombstone`).
    pub keep: std::time::Duration,
    /// The `Location` header of the response, if it had one.
    pub location: Option<Vec<u8>>,
}

/// The size of `headers` as [`StoredResponse::encode_headers`] writes them.
fn encoded_len(headers: &[(HeaderName, HeaderValue)]) -> usize {
    headers
        .iter()
        .map(|(name, value)| 6 + name.as_str().len() + value.len())
        .sum()
}

/// Why a response could not be captured.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The body and the replayed headers, as stored, are larger than the
    /// stored-response cap.
    #[error("response exceeds the stored-response cap of {limit} bytes")]
    TooLarge {
        /// The cap in bytes.
        limit: usize,
    },
    /// The body stream failed.
    #[error("response body failed while buffering")]
    Body(#[source] axum::Error),
}

impl StoredResponse {
    /// Buffers a handler's response, keeping at most `limit` bytes: the
    /// body and the allow-listed headers as [stored](Self::encode_headers).
    ///
    /// Returns the stored form and the original's parts (every header, its
    /// extensions), so the first client, and the middleware on the way to
    /// it, get exactly what the handler produced.
    pub async fn capture(
        response: Response,
        allow: &[HeaderName],
        limit: usize,
    ) -> Result<(Self, http::response::Parts), CaptureError> {
        let (parts, body) = response.into_parts();
        let headers: Vec<_> = parts
            .headers
            .iter()
            .filter(|(name, _)| allow.contains(name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        // The cap is on what is kept: the replayed headers count too.
        let room = limit
            .checked_sub(encoded_len(&headers))
            .ok_or(CaptureError::TooLarge { limit })?;
        let body = match Limited::new(body, room).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) => {
                return Err(match error.downcast::<http_body_util::LengthLimitError>() {
                    Ok(_) => CaptureError::TooLarge { limit },
                    Err(error) => CaptureError::Body(axum::Error::new(error)),
                });
            }
        };
        let stored = Self {
            status: parts.status,
            headers,
            body,
        };
        Ok((stored, parts))
    }

    /// The response for a retry: the stored one plus `<marker>: true`
    /// ([`IDEMPOTENT_REPLAYED`] unless the service chose another name). Only
    /// the stored headers still on `allow` go out: a header an operator took
    /// off the allow-list stops being replayed at once, not when the rows
    /// stored with it expire.
    pub fn replay(self, allow: &[HeaderName], marker: &HeaderName) -> Response {
        let mut response = Response::new(Body::from(self.body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            if allow.contains(&name) {
                headers.append(name, value);
            }
        }
        headers.insert(marker.clone(), HeaderValue::from_static("true"));
        response
    }

    /// The response for the first attempt: the body just captured, in the
    /// handler's own parts (status, every header, extensions).
    pub(crate) fn into_original(self, parts: http::response::Parts) -> Response {
        Response::from_parts(parts, Body::from(self.body))
    }

    /// Encodes the headers for storage: per header, a big-endian u16 name
    /// length, the name, a u32 value length, the value.
    pub fn encode_headers(&self) -> Vec<u8> {
        encode_headers(&self.headers)
    }

    /// The response as `scope`'s `key` keeps it in `sealer`'s table: its
    /// headers encoded, and both columns sealed where the store encrypts.
    pub(crate) fn seal(&self, sealer: &Sealer<'_>, scope: &str, key: &str) -> EncodedResponse {
        let headers = self.encode_headers();
        if sealer.ring.is_none() {
            return EncodedResponse {
                status: self.status,
                headers,
                body: self.body.clone(),
                tombstone: None,
            };
        }
        let seal = |column, plain: &[u8]| sealer.seal(scope, key, column, plain).into_owned();
        EncodedResponse {
            status: self.status,
            headers: seal(Column::Headers, &headers),
            body: seal(Column::Body, &self.body).into(),
            tombstone: None,
        }
    }

    /// Rebuilds a stored response; `None` if any part is corrupt.
    #[cfg(any(fuzzing, test))]
    pub fn decode(status: i64, headers: &[u8], body: Vec<u8>) -> Option<Self> {
        let status = u16::try_from(status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())?;
        Some(Self {
            status,
            headers: decode_headers(headers)?,
            body: Bytes::from(body),
        })
    }
}

impl EncodedResponse {
    /// The stored response `scope`'s `key` kept: opened where sealed (the
    /// headers column says whether the pair is: sealed headers are never
    /// empty and begin with the envelope's mark, plain ones never do), and
    /// decoded. The error names the column that did not open or decode.
    pub(crate) fn open(
        self,
        sealer: &Sealer<'_>,
        scope: &str,
        key: &str,
    ) -> Result<StoredResponse, (Column, OpenError)> {
        let sealed = is_sealed(&self.headers);
        let headers = sealer
            .open(scope, key, Column::Headers, &self.headers)
            .map_err(|error| (Column::Headers, error))?;
        let headers = decode_headers(&headers).ok_or((Column::Headers, OpenError::Malformed))?;
        // A plain body is whatever the handler answered, its first byte
        // included: only a body stored beside sealed headers is sealed.
        let body = if sealed {
            let opened = sealer
                .open(scope, key, Column::Body, &self.body)
                .map_err(|error| (Column::Body, error))?;
            Bytes::from(opened.into_owned())
        } else {
            self.body
        };
        Ok(StoredResponse {
            status: self.status,
            headers,
            body,
        })
    }
}

/// `headers` as the headers column keeps them (see
/// [`StoredResponse::encode_headers`]): a tombstone's `Location` too.
pub(crate) fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(headers));
    for (name, value) in headers {
        out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// Inverse of [`StoredResponse::encode_headers`]; `None` if the bytes are
/// not headers it wrote (a corrupt or hostile row).
pub(crate) fn decode_headers(mut input: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
    let mut headers = Vec::new();
    while !input.is_empty() {
        let name_len = u16::from_be_bytes(take(&mut input, 2)?.try_into().ok()?) as usize;
        let name = HeaderName::from_bytes(take(&mut input, name_len)?).ok()?;
        let value_len = u32::from_be_bytes(take(&mut input, 4)?.try_into().ok()?) as usize;
        let value = HeaderValue::from_bytes(take(&mut input, value_len)?).ok()?;
        headers.push((name, value));
    }
    Some(headers)
}

fn take<'a>(input: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if input.len() < n {
        return None;
    }
    let (head, rest) = input.split_at(n);
    *input = rest;
    Some(head)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    #[tokio::test]
    async fn capture_keeps_allow_listed_headers_and_replays_verbatim() {
        let original = (
            StatusCode::CREATED,
            [
                (header::LOCATION, "/v1/charges/7"),
                (header::SET_COOKIE, "session=secret"),
                (header::ETAG, "\"v1\""),
            ],
            "{\"id\":7}",
        )
            .into_response();
        let (stored, all) = StoredResponse::capture(original, DEFAULT_REPLAY_HEADERS, 1024)
            .await
            .unwrap();
        assert!(all.headers.contains_key(header::SET_COOKIE));
        assert_eq!(stored.status, StatusCode::CREATED);
        assert!(stored.headers.iter().all(|(n, _)| n != header::SET_COOKIE));
        let decoded =
            StoredResponse::decode(201, &stored.encode_headers(), stored.body.to_vec()).unwrap();
        assert_eq!(decoded, stored);
        let replay = decoded
            .clone()
            .replay(DEFAULT_REPLAY_HEADERS, &IDEMPOTENT_REPLAYED);
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()[header::LOCATION], "/v1/charges/7");
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(!replay.headers().contains_key(header::SET_COOKIE));
        // A header taken off the allow-list since is not replayed.
        let narrowed = decoded.replay(&[header::ETAG], &IDEMPOTENT_REPLAYED);
        assert!(!narrowed.headers().contains_key(header::LOCATION));
        assert_eq!(narrowed.headers()[header::ETAG], "\"v1\"");
        let body = replay.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{\"id\":7}");
    }

    /// The first attempt's answer is the handler's own, bar the buffered
    /// body: what it put in the extensions still reaches the middleware
    /// (an error kept there for a logging layer, say).
    #[tokio::test]
    async fn the_first_answer_keeps_the_handlers_parts() {
        #[derive(Clone, Debug, PartialEq)]
        struct Logged(&'static str);
        let mut original = (StatusCode::CONFLICT, "{}").into_response();
        original.extensions_mut().insert(Logged("card declined"));
        *original.version_mut() = http::Version::HTTP_2;
        let (stored, parts) = StoredResponse::capture(original, DEFAULT_REPLAY_HEADERS, 1024)
            .await
            .unwrap();
        let first = stored.into_original(parts);
        assert_eq!(first.status(), StatusCode::CONFLICT);
        assert_eq!(first.version(), http::Version::HTTP_2);
        assert_eq!(
            first.extensions().get::<Logged>(),
            Some(&Logged("card declined"))
        );
        let body = first.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{}");
    }

    #[tokio::test]
    async fn capture_refuses_bodies_over_the_cap() {
        let response = vec![0u8; 2048].into_response();
        let error = StoredResponse::capture(response, DEFAULT_REPLAY_HEADERS, 1024)
            .await
            .unwrap_err();
        assert!(matches!(error, CaptureError::TooLarge { limit: 1024 }));
    }

    #[tokio::test]
    async fn replayed_headers_count_toward_the_cap() {
        let response = || {
            let location = format!("/v1/charges/{}", "7".repeat(40));
            ([(header::LOCATION, location)], "0123456789").into_response()
        };
        // 10 body bytes; Content-Type and Location take 6 + 12 + 25 and
        // 6 + 8 + 52 stored bytes (`text/plain; charset=utf-8` is 25).
        let stored = 10 + (6 + 12 + 25) + (6 + 8 + 52);
        let (kept, _) = StoredResponse::capture(response(), DEFAULT_REPLAY_HEADERS, stored)
            .await
            .unwrap();
        assert_eq!(kept.body.len() + kept.encode_headers().len(), stored);
        for limit in [stored - 1, 20] {
            let error = StoredResponse::capture(response(), DEFAULT_REPLAY_HEADERS, limit)
                .await
                .unwrap_err();
            assert!(matches!(error, CaptureError::TooLarge { limit: l } if l == limit));
        }
    }

    #[test]
    fn decode_rejects_corruption() {
        assert!(decode_headers(&[0, 5, b'a']).is_none());
        assert!(decode_headers(&[0, 1, b' ', 0, 0, 0, 0]).is_none());
        assert!(StoredResponse::decode(99, &[], vec![]).is_none());
        assert!(StoredResponse::decode(70000, &[], vec![]).is_none());
        assert_eq!(decode_headers(&[]), Some(vec![]));
    }

    #[test]
    fn transient_statuses_are_not_storable() {
        for code in [500, 502, 503, 504, 408, 429] {
            assert!(!is_storable(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [200, 201, 202, 204, 400, 402, 404, 409, 422] {
            assert!(is_storable(StatusCode::from_u16(code).unwrap()), "{code}");
        }
    }

    /// Property tests of the storage encoding (`PROPTEST_CASES` cases, 256
    /// unless set); `fuzz/`'s `stored_response` target runs
    /// [`crate::fuzzing::stored_response`] with coverage guidance.
    mod properties {
        use proptest::prelude::*;
        use proptest::test_runner::Config;

        use super::*;

        /// Proptest's default reads `PROPTEST_CASES`.
        fn config() -> Config {
            Config {
                // A failure prints its minimal case; nothing is written to the tree.
                failure_persistence: None,
                ..Config::default()
            }
        }

        fn header_name() -> impl Strategy<Value = HeaderName> {
            prop_oneof![
                prop::sample::select(DEFAULT_REPLAY_HEADERS.to_vec()),
                "[a-z][a-z0-9!#$%&'*+.^_`|~-]{0,30}"
                    .prop_map(|n| HeaderName::from_bytes(n.as_bytes()).unwrap()),
            ]
        }

        /// Every byte `HeaderValue` accepts: visible ASCII, space, tab, obs-text.
        fn header_value() -> impl Strategy<Value = HeaderValue> {
            let byte = prop_oneof![0x20u8..=0x7e, Just(b'\t'), 0x80u8..=0xff];
            prop::collection::vec(byte, 0..40).prop_map(|v| HeaderValue::from_bytes(&v).unwrap())
        }

        fn stored_response() -> impl Strategy<Value = StoredResponse> {
            (
                100u16..=999,
                prop::collection::vec((header_name(), header_value()), 0..8),
                prop::collection::vec(any::<u8>(), 0..256),
            )
                .prop_map(|(status, headers, body)| StoredResponse {
                    status: StatusCode::from_u16(status).unwrap(),
                    headers,
                    body: body.into(),
                })
        }

        /// Any bytes, or mostly well-framed ones, so the decoder gets past
        /// the lengths: an encoding with one byte changed, or cut short.
        fn encoded_or_not() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..256),
                stored_response().prop_flat_map(|r| {
                    let encoded = r.encode_headers();
                    let len = encoded.len();
                    (Just(encoded), 0..=len, any::<u8>()).prop_map(|(mut e, at, b)| {
                        if at < e.len() {
                            e[at] = b
                        } else {
                            e.truncate(at)
                        }
                        e
                    })
                }),
            ]
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn stored_responses_round_trip(response in stored_response()) {
                let encoded = response.encode_headers();
                prop_assert_eq!(decode_headers(&encoded), Some(response.headers.clone()));
                let decoded = StoredResponse::decode(
                    response.status.as_u16().into(),
                    &encoded,
                    response.body.to_vec(),
                );
                prop_assert_eq!(decoded, Some(response));
            }

            #[test]
            fn decoding_never_panics_and_what_decodes_re_encodes(
                bytes in encoded_or_not(),
                status in any::<i64>(),
            ) {
                if let Some(headers) = decode_headers(&bytes) {
                    let again = StoredResponse { status: StatusCode::OK, headers, body: Default::default() };
                    prop_assert_eq!(decode_headers(&again.encode_headers()), Some(again.headers));
                }
                let decoded = StoredResponse::decode(status, &bytes, vec![1, 2, 3]);
                if let Some(decoded) = decoded {
                    prop_assert!((100..=999).contains(&status));
                    prop_assert_eq!(i64::from(decoded.status.as_u16()), status);
                }
            }

            /// The fuzz target's checks, on a status and such bytes.
            #[test]
            fn the_fuzz_checks_hold(status in any::<[u8; 2]>(), bytes in encoded_or_not()) {
                crate::fuzzing::stored_response(&[&status[..], &bytes].concat());
            }
        }
    }
}
