//! [`StoredRequest`]: a phased request as kept for the completer, beside
//! the stored response ([`crate::response`]).

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Uri, header};

/// A phased request as kept for the completer: the method, the URI (path
/// and query), the content type and the body, and where the key table
/// keeps hashed scopes and keys, the caller's clear scope and key. Never
/// the other headers: credentials (`Authorization`, `Cookie`) are not
/// kept.
#[derive(Debug)]
pub(crate) struct StoredRequest {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) content_type: Option<HeaderValue>,
    pub(crate) body: Bytes,
    /// The clear scope and key, kept with a request whose row has them
    /// hashed ([`Idem::hash_keys`](crate::Idem::hash_keys)).
    pub(crate) caller: Option<(String, String)>,
}

/// The encoding's version, its first byte.
const REQUEST_VERSION: u8 = 1;
/// The version of a request that names its caller.
const CALLER_VERSION: u8 = 2;

impl StoredRequest {
    /// `[1][method len: u8][method][uri len: u32][uri][type len: u16][type][body]`.
    pub(crate) fn encode(method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> Vec<u8> {
        let method = method.as_str().as_bytes();
        let uri = uri
            .path_and_query()
            .map_or("/", |path_and_query| path_and_query.as_str())
            .as_bytes();
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .map_or(&[][..], HeaderValue::as_bytes);
        let mut out =
            Vec::with_capacity(8 + method.len() + uri.len() + content_type.len() + body.len());
        out.push(REQUEST_VERSION);
        // Methods are short tokens and URIs and content types are bounded
        // by hyper's header limits, far below these widths.
        out.push(u8::try_from(method.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(&method[..method.len().min(255)]);
        let uri_len = u32::try_from(uri.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&uri_len.to_be_bytes());
        out.extend_from_slice(&uri[..uri_len as usize]);
        let type_len = u16::try_from(content_type.len()).unwrap_or(0);
        out.extend_from_slice(&type_len.to_be_bytes());
        out.extend_from_slice(&content_type[..usize::from(type_len)]);
        out.extend_from_slice(body);
        out
    }

    /// `encoded` (an [`encode`](Self::encode)d request) naming its
    /// caller: `[2][scope len: u32][scope][key len: u8][key]` before it.
    pub(crate) fn with_caller(encoded: &[u8], scope: &str, key: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(6 + scope.len() + key.len() + encoded.len());
        out.push(CALLER_VERSION);
        // A key is at most 255 bytes (`MAX_KEY_LEN`); a scope far below
        // 4 GiB.
        let scope_len = u32::try_from(scope.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&scope_len.to_be_bytes());
        out.extend_from_slice(&scope.as_bytes()[..scope_len as usize]);
        let key_len = u8::try_from(key.len()).unwrap_or(u8::MAX);
        out.push(key_len);
        out.extend_from_slice(&key.as_bytes()[..usize::from(key_len)]);
        out.extend_from_slice(encoded);
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version == CALLER_VERSION {
            let (scope_len, rest) = rest.split_first_chunk::<4>()?;
            let (scope, rest) = rest.split_at_checked(u32::from_be_bytes(*scope_len) as usize)?;
            let (&key_len, rest) = rest.split_first()?;
            let (key, rest) = rest.split_at_checked(usize::from(key_len))?;
            let caller = (
                String::from_utf8(scope.to_vec()).ok()?,
                String::from_utf8(key.to_vec()).ok()?,
            );
            let request = Self::decode(rest).filter(|request| request.caller.is_none())?;
            return Some(Self {
                caller: Some(caller),
                ..request
            });
        }
        if version != REQUEST_VERSION {
            return None;
        }
        let (&method_len, rest) = rest.split_first()?;
        let (method, rest) = rest.split_at_checked(usize::from(method_len))?;
        let (uri_len, rest) = rest.split_first_chunk::<4>()?;
        let (uri, rest) = rest.split_at_checked(u32::from_be_bytes(*uri_len) as usize)?;
        let (type_len, rest) = rest.split_first_chunk::<2>()?;
        let (content_type, body) =
            rest.split_at_checked(usize::from(u16::from_be_bytes(*type_len)))?;
        Some(Self {
            method: Method::from_bytes(method).ok()?,
            uri: Uri::try_from(uri).ok()?,
            content_type: match content_type {
                [] => None,
                value => Some(HeaderValue::from_bytes(value).ok()?),
            },
            body: Bytes::copy_from_slice(body),
            caller: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_request_reads_back_without_credentials() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer secret"),
        );
        headers.insert(header::COOKIE, HeaderValue::from_static("session=secret"));
        let uri: Uri = "http://example.com/v1/payments?x=1".parse().unwrap();
        let bytes = StoredRequest::encode(&Method::POST, &uri, &headers, b"{\"amount\":1}");
        assert!(!bytes.windows(6).any(|window| window == b"secret"));
        let request = StoredRequest::decode(&bytes).unwrap();
        assert_eq!(request.method, Method::POST);
        assert_eq!(request.uri, "/v1/payments?x=1");
        assert_eq!(request.content_type.unwrap(), "application/json");
        assert_eq!(&request.body[..], b"{\"amount\":1}");

        let bare =
            StoredRequest::encode(&Method::PUT, &"/a".parse().unwrap(), &HeaderMap::new(), b"");
        let request = StoredRequest::decode(&bare).unwrap();
        assert_eq!((request.method, request.content_type), (Method::PUT, None));
        for cut in 0..bytes.len() - 12 {
            // Any truncation before the body is refused, never misread.
            assert!(StoredRequest::decode(&bytes[..cut]).is_none(), "{cut}");
        }
        assert!(StoredRequest::decode(&[3]).is_none());
        assert!(StoredRequest::decode(&bytes).unwrap().caller.is_none());
    }

    /// A request may name its caller, in front of its encoding; a request
    /// naming two, or cut short, is refused.
    #[test]
    fn a_stored_request_may_name_its_caller() {
        let plain = StoredRequest::encode(
            &Method::POST,
            &"/v1/payments".parse().unwrap(),
            &HeaderMap::new(),
            b"{}",
        );
        let named = StoredRequest::with_caller(&plain, "acct_1", "order-42");
        let request = StoredRequest::decode(&named).unwrap();
        assert_eq!(
            request.caller,
            Some(("acct_1".to_owned(), "order-42".to_owned()))
        );
        assert_eq!(
            (request.uri, &request.body[..]),
            ("/v1/payments".parse().unwrap(), &b"{}"[..])
        );
        let empty = StoredRequest::decode(&StoredRequest::with_caller(&plain, "", "k")).unwrap();
        assert_eq!(empty.caller, Some((String::new(), "k".to_owned())));
        for cut in 0..named.len() - plain.len() + 12 {
            assert!(StoredRequest::decode(&named[..cut]).is_none(), "{cut}");
        }
        let twice = StoredRequest::with_caller(&named, "acct_2", "k");
        assert!(StoredRequest::decode(&twice).is_none());
    }
}
