//! [`StoredRequest`]: a phased request as kept for the completer, beside
//! the stored response ([`crate::response`]).

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Uri, header};

/// A phased request as kept for the completer: the method, the URI (path
/// and query), the content type and the body. Never the other headers:
/// credentials (`Authorization`, `Cookie`) are not kept.
#[derive(Debug)]
pub(crate) struct StoredRequest {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) content_type: Option<HeaderValue>,
    pub(crate) body: Bytes,
}

/// The encoding's version, its first byte.
const REQUEST_VERSION: u8 = 1;

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

    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
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
        assert!(StoredRequest::decode(&[2]).is_none());
    }
}
