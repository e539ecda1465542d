//! Request bodies `idem` refuses before anything is claimed: over the
//! limit, slower than the body timeout, cut off before their end. Sent over
//! a raw connection, since no HTTP client sends them on purpose.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::app::{BODY_LIMIT, TestDb, percent_encode};
use crate::harness::{send, start_configured, unique};
use crate::suite::BODY;

/// The test service's body timeout.
const BODY_TIMEOUT: Duration = Duration::from_millis(300);

/// What the client does once it has sent part of the body.
#[derive(Clone, Copy, Debug)]
enum Then {
    /// Sends the rest, whatever the server says meanwhile.
    SendAll,
    /// Sends nothing more, and keeps the connection open.
    Stall,
    /// Closes its side of the connection.
    Close,
}

/// A response read off a raw connection.
#[derive(Debug)]
struct Raw {
    status: u16,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl Raw {
    /// The `code` member of a problem+json body.
    fn problem_code(&self) -> String {
        assert_eq!(
            self.content_type.as_deref(),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json: serde_json::Value =
            serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {self:?}"));
        json["code"].as_str().unwrap().to_owned()
    }
}

/// `POST /effects` for `caller` with `key`, announcing `length` bytes of
/// body and sending `sent` of them, then doing `then`; reads the whole
/// response (the head, then its `content-length` of body), within 20 s.
async fn raw_post(
    addr: SocketAddr,
    caller: &str,
    key: &str,
    length: usize,
    sent: usize,
    then: Then,
) -> Raw {
    let head = format!(
        "POST /effects HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         x-caller: {}\r\nidempotency-key: {key}\r\ncontent-length: {length}\r\n\r\n",
        percent_encode(caller.as_bytes())
    );
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = async move {
        // A write error means the server answered and closed: the answer
        // is what the test reads.
        let _ = async {
            write.write_all(head.as_bytes()).await?;
            write.write_all(&vec![b' '; sent]).await?;
            match then {
                Then::SendAll => write.write_all(&vec![b' '; length - sent]).await?,
                Then::Stall => {}
                Then::Close => write.shutdown().await?,
            }
            std::io::Result::Ok(())
        }
        .await;
        // The write half stays open (stalled) until the reader is done.
        std::future::pending::<()>().await;
    };
    let reader = async move {
        let mut response = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Some(raw) = parse(&response) {
                return raw;
            }
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => panic!(
                    "the connection ended mid-response: {:?}",
                    String::from_utf8_lossy(&response)
                ),
                Ok(n) => response.extend_from_slice(&buf[..n]),
            }
        }
    };
    let exchange = async {
        tokio::select! {
            raw = reader => raw,
            () = writer => unreachable!(),
        }
    };
    tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("the server neither answered nor closed in time")
}

/// A whole response in `bytes`, if they hold one yet.
fn parse(bytes: &[u8]) -> Option<Raw> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&bytes[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let mut length = 0;
    let mut content_type = None;
    for line in lines {
        let (name, value) = line.split_once(':')?;
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => length = value.trim().parse().ok()?,
            "content-type" => content_type = Some(value.trim().to_owned()),
            _ => {}
        }
    }
    let body = bytes.get(end + 4..end + 4 + length)?.to_vec();
    Some(Raw {
        status,
        content_type,
        body,
    })
}

/// With a key, a body over the limit is 413 `request_body_too_large`, one
/// slower than the body timeout 408 `request_body_timeout` (answered once
/// the timeout passed, not when the client gives up), one cut off before
/// its end 400 `request_body_unreadable`: each a problem, with nothing
/// claimed or run, so the key is then free for the whole request.
pub async fn refused_bodies_get_their_problem<DB: TestDb>() {
    let server =
        start_configured(DB::connect().await, |idem| idem.body_timeout(BODY_TIMEOUT)).await;
    let caller = unique("bodies");
    let over = BODY_LIMIT + 1024;
    let cases = [
        (
            "big",
            over,
            over,
            Then::SendAll,
            413,
            "request_body_too_large",
        ),
        ("slow", 40, 10, Then::Stall, 408, "request_body_timeout"),
        ("cut", 40, 10, Then::Close, 400, "request_body_unreadable"),
    ];
    for (key, length, sent, then, status, code) in cases {
        let started = Instant::now();
        let answer = raw_post(server.addr, &caller, key, length, sent, then).await;
        assert_eq!(answer.status, status, "{key}: {answer:?}");
        assert_eq!(answer.problem_code(), code, "{key}");
        if matches!(then, Then::Stall) {
            assert!(
                started.elapsed() >= BODY_TIMEOUT,
                "{key}: answered after {:?}, before the body timeout",
                started.elapsed()
            );
        }
    }
    assert_eq!(server.effects(&caller).await, 0, "no handler ran");
    assert_eq!(server.keys(&caller).await, 0, "no key was claimed");
    let client = server.client(&caller);
    for (key, ..) in cases {
        let whole = send(client.post("/effects", key, BODY)).await;
        assert_eq!(whole.status, StatusCode::CREATED, "{key}: {whole:?}");
        assert!(!whole.replayed(), "{key}: {whole:?}");
    }
}
