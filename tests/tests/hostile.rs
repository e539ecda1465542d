//! Hostile input: huge and trickling bodies, bytes a header should not
//! hold, keys at the length limit, and a burst of distinct keys. Each gets
//! a clear answer, nothing is stored for what was refused, and the server
//! keeps serving.

use idem_tests::hardening;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use hardening::{
    BODY_LIMIT, Client, Server, connect, effects_in_scope, keys_in_scope, percent_encode, send,
    stored, unique,
};
use idem::Idem;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY: &str = r#"{"note":"hostile"}"#;

async fn server() -> Server {
    Server::start(Idem::new(connect(20).await)).await
}

/// The server still does its job: a fresh key gets a fresh 201.
async fn still_serving(client: &Client) {
    let key = unique("alive");
    let answer = send(client.post(&key, BODY)).await;
    assert_eq!(answer.status, 201, "the server stopped serving: {answer:?}");
    assert!(!answer.replayed());
}

/// Sends `head` and then `body` chunk by chunk over a raw connection, with
/// `pause` between chunks, while reading the response; returns the whole
/// response (status line, headers and `content-length` of body) once it
/// arrived, or what came before the server closed (the rest of the request
/// body need not be sent). Bounded by `limit`.
async fn raw_exchange(
    addr: SocketAddr,
    head: Vec<u8>,
    chunks: impl Iterator<Item = Vec<u8>>,
    pause: Duration,
    limit: Duration,
) -> String {
    raw_exchange_then(addr, head, chunks, pause, limit, false).await
}

/// [`raw_exchange`], closing the client's side of the connection once the
/// chunks are sent when `close`: a body cut off before its end.
async fn raw_exchange_then(
    addr: SocketAddr,
    head: Vec<u8>,
    chunks: impl Iterator<Item = Vec<u8>>,
    pause: Duration,
    limit: Duration,
    close: bool,
) -> String {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = async move {
        // A write error means the server closed the connection after
        // answering: the answer is what the test reads.
        let sent = async {
            write.write_all(&head).await?;
            for chunk in chunks {
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                write.write_all(&chunk).await?;
            }
            if close {
                write.shutdown().await?;
            }
            std::io::Result::Ok(())
        };
        let _ = sent.await;
        // Sent or cut: either way the reader decides.
        std::future::pending::<()>().await;
    };
    let reader = async move {
        let mut response = Vec::new();
        let mut buf = [0u8; 4096];
        while !whole_response(&response) {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => response.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&response).into_owned()
    };
    let exchange = async {
        tokio::select! {
            response = reader => response,
            () = writer => unreachable!(),
        }
    };
    tokio::time::timeout(limit, exchange)
        .await
        .expect("the server neither answered nor closed in time")
}

/// Whether `bytes` hold a response's head and its `content-length` of body.
fn whole_response(bytes: &[u8]) -> bool {
    let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&bytes[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map_or(0, |value| value.trim().parse().unwrap_or(0));
    bytes.len() >= end + 4 + length
}

/// The `code` member of the problem+json body of a raw response.
fn problem_code(response: &str) -> String {
    assert!(
        response
            .to_ascii_lowercase()
            .contains("content-type: application/problem+json"),
        "{response}"
    );
    let (_, body) = response.split_once("\r\n\r\n").expect("a whole response");
    let json: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {response}"));
    json["code"].as_str().unwrap().to_owned()
}

fn head(scope: &str, key: &[u8], framing: &str) -> Vec<u8> {
    let mut head = format!(
        "POST /effects HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         x-caller: {}\r\n{framing}\r\nidempotency-key: ",
        percent_encode(scope.as_bytes())
    )
    .into_bytes();
    head.extend_from_slice(key);
    head.extend_from_slice(b"\r\n\r\n");
    head
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_bodies_are_413_and_nothing_is_kept() {
    const TEN_MB: usize = 10 * 1024 * 1024;
    let server = server().await;
    let scope = unique("hostile-big");
    let client = server.client(&scope);
    let big = format!(r#"{{"note":"{}"}}"#, "a".repeat(TEN_MB));

    // With a Content-Length. The server answers as soon as the limit is
    // passed and closes the connection, so the client must read while it
    // writes (as curl does; reqwest stops at the write error instead and
    // reports a broken pipe, losing the 413).
    let chunks = big.into_bytes();
    let response = raw_exchange(
        server.addr,
        head(
            &scope,
            b"big-1",
            &format!("content-length: {}", chunks.len()),
        ),
        chunks
            .chunks(256 * 1024)
            .map(<[u8]>::to_vec)
            .collect::<Vec<_>>()
            .into_iter(),
        Duration::ZERO,
        Duration::from_secs(20),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert_eq!(problem_code(&response), "request_body_too_large");
    still_serving(&client).await;

    // Chunked, with no length announced: the limit still holds.
    let response = raw_exchange(
        server.addr,
        head(&scope, b"big-2", "transfer-encoding: chunked"),
        chunks
            .chunks(256 * 1024)
            .map(|c| {
                let mut chunk = format!("{:x}\r\n", c.len()).into_bytes();
                chunk.extend_from_slice(c);
                chunk.extend_from_slice(b"\r\n");
                chunk
            })
            .chain(std::iter::once(b"0\r\n\r\n".to_vec()))
            .collect::<Vec<_>>()
            .into_iter(),
        Duration::ZERO,
        Duration::from_secs(20),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert_eq!(problem_code(&response), "request_body_too_large");

    // Just over the limit is refused as surely as far over it.
    let over = format!(r#"{{"note":"{}"}}"#, "a".repeat(BODY_LIMIT));
    let answer = send(client.post("big-3", &over)).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(answer.problem_code(), "request_body_too_large");

    still_serving(&client).await;
    for key in ["big-1", "big-2", "big-3"] {
        assert_eq!(stored(server.pool(), &scope, key).await, None, "{key}");
    }
    assert_eq!(
        keys_in_scope(server.pool(), &scope).await,
        2,
        "only the two live checks"
    );
    assert_eq!(effects_in_scope(server.pool(), &scope).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickling_bodies_are_408_within_the_body_timeout() {
    const TIMEOUT: Duration = Duration::from_secs(1);
    const SLOW_CLIENTS: usize = 8;
    let pool = connect(20).await;
    let server = Server::start(Idem::new(pool).body_timeout(TIMEOUT)).await;
    let scope = unique("hostile-slow");
    let client = server.client(&scope);

    // Each slow client announces 40 bytes and sends one every 250 ms: the
    // whole body would take 10 s, ten times the timeout.
    let body = br#"{"note":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}"#;
    assert_eq!(body.len(), 40);
    let started = Instant::now();
    let slow = (0..SLOW_CLIENTS).map(|i| {
        let scope = scope.clone();
        let addr = server.addr;
        tokio::spawn(async move {
            let key = format!("slow-{i}");
            let response = raw_exchange(
                addr,
                head(&scope, key.as_bytes(), "content-length: 40"),
                body.iter().map(|&b| vec![b]),
                Duration::from_millis(250),
                Duration::from_secs(12),
            )
            .await;
            (response, started.elapsed())
        })
    });
    let slow: Vec<_> = slow.collect();
    // Meanwhile the server answers everyone else at once.
    let fast = Instant::now();
    still_serving(&client).await;
    assert!(
        fast.elapsed() < TIMEOUT,
        "a normal request waited {:?} behind slow bodies",
        fast.elapsed()
    );
    for task in slow {
        let (response, elapsed) = task.await.unwrap();
        assert!(response.starts_with("HTTP/1.1 408"), "{response}");
        assert_eq!(problem_code(&response), "request_body_timeout");
        assert!(
            elapsed >= TIMEOUT && elapsed < Duration::from_secs(3),
            "answered after {elapsed:?}: the timeout, not the body, must decide"
        );
    }
    for i in 0..SLOW_CLIENTS {
        assert_eq!(
            stored(server.pool(), &scope, &format!("slow-{i}")).await,
            None
        );
    }
    still_serving(&client).await;
    assert_eq!(keys_in_scope(server.pool(), &scope).await, 2);
}

/// A body that ends before its announced length, or a chunked body whose
/// last chunk never comes, is 400 `request_body_unreadable`: nothing is
/// claimed or run, and the key is then free for the whole request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_cut_off_before_their_end_are_400_unreadable() {
    let server = server().await;
    let scope = unique("hostile-cut");
    let client = server.client(&scope);
    let cut = |key: &'static [u8], framing: &'static str, sent: &'static [u8]| {
        raw_exchange_then(
            server.addr,
            head(&scope, key, framing),
            std::iter::once(sent.to_vec()),
            Duration::ZERO,
            Duration::from_secs(10),
            true,
        )
    };
    for response in [
        cut(b"cut-1", "content-length: 40", br#"{"note":"#).await,
        cut(
            b"cut-2",
            "transfer-encoding: chunked",
            b"9\r\n{\"note\":\"\r\n",
        )
        .await,
    ] {
        assert!(response.starts_with("HTTP/1.1 400"), "{response}");
        assert_eq!(problem_code(&response), "request_body_unreadable");
    }
    assert_eq!(keys_in_scope(server.pool(), &scope).await, 0);
    assert_eq!(effects_in_scope(server.pool(), &scope).await, 0);
    for key in ["cut-1", "cut-2"] {
        let whole = send(client.post(key, BODY)).await;
        assert_eq!(whole.status, 201, "{key}: {whole:?}");
        assert!(!whole.replayed(), "{key}: {whole:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_bytes_that_are_not_utf8_get_a_clear_4xx() {
    use reqwest::header::HeaderValue;
    let server = server().await;
    let scope = unique("hostile-bytes");
    let client = server.client(&scope);
    let bad_key = |value: &[u8]| {
        client
            .bare("/effects")
            .header("content-type", "application/json")
            .header("idempotency-key", HeaderValue::from_bytes(value).unwrap())
            .body(BODY)
    };

    for value in [
        &b"\xff\xfe"[..],
        b"k\x80",
        "ключ".as_bytes(),
        b"\"\xc3\x28\"",
    ] {
        let answer = send(bad_key(value)).await;
        assert_eq!(answer.status, 400, "{value:?}: {answer:?}");
        assert_eq!(answer.problem_code(), "idempotency_key_invalid");
    }
    // A content type that is not UTF-8: the JSON extractor refuses it
    // before anything is claimed.
    let answer = send(
        client
            .bare("/effects")
            .header(
                "content-type",
                HeaderValue::from_bytes(b"application/\xffjson").unwrap(),
            )
            .header("idempotency-key", "ct")
            .body(BODY),
    )
    .await;
    assert_eq!(answer.status, 415, "{answer:?}");
    // A scope header that is not UTF-8: the scope extractor's own 401.
    let raw_scope = client
        .http
        .post(format!("{}/effects", client.base))
        .header("x-caller", HeaderValue::from_bytes(b"\xff\xff").unwrap())
        .header("content-type", "application/json")
        .header("idempotency-key", "scope")
        .body(BODY);
    let answer = send(raw_scope).await;
    assert_eq!(answer.status, 401, "{answer:?}");

    // Bytes no client library sends: NUL, and a bare CR inside the key.
    for key in [&b"a\0b"[..], b"a\rb"] {
        let response = raw_exchange(
            server.addr,
            head(&scope, key, "content-length: 18"),
            std::iter::once(BODY.as_bytes().to_vec()),
            Duration::ZERO,
            Duration::from_secs(5),
        )
        .await;
        assert!(response.starts_with("HTTP/1.1 4"), "{key:?}: {response:?}");
    }

    assert_eq!(keys_in_scope(server.pool(), &scope).await, 0);
    assert_eq!(effects_in_scope(server.pool(), &scope).await, 0);
    still_serving(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_255_characters_pass_and_256_fail() {
    let server = server().await;
    let scope = unique("hostile-len");
    let client = server.client(&scope);
    let at_limit = "k".repeat(255);
    let over = "k".repeat(256);

    let first = send(client.post(&at_limit, BODY)).await;
    assert_eq!(first.status, 201, "{first:?}");
    // The quoted spelling is 257 bytes on the wire and the same key.
    let quoted = send(client.post(&format!("\"{at_limit}\""), BODY)).await;
    assert!(quoted.replayed(), "{quoted:?}");
    assert_eq!(quoted.body, first.body);

    for spelling in [over.clone(), format!("\"{over}\""), "k".repeat(8192)] {
        let answer = send(client.post(&spelling, BODY)).await;
        assert_eq!(answer.status, 400, "{} chars: {answer:?}", spelling.len());
        assert_eq!(answer.problem_code(), "idempotency_key_invalid");
    }
    assert_eq!(keys_in_scope(server.pool(), &scope).await, 1);
    assert_eq!(effects_in_scope(server.pool(), &scope).await, 1);
    still_serving(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_keys_in_a_burst_are_ten_thousand_effects() {
    const KEYS: usize = 10_000;
    const IN_FLIGHT: usize = 64;
    let server = server().await;
    let scope = unique("hostile-burst");
    let client = Client::with(
        reqwest::Client::builder()
            .pool_max_idle_per_host(IN_FLIGHT)
            .timeout(hardening::REQUEST_TIMEOUT)
            .build()
            .unwrap(),
        server.addr,
        &scope,
    );
    let started = Instant::now();
    let statuses: Vec<u16> = futures::stream::iter(0..KEYS)
        .map(|i| {
            let client = client.clone();
            async move {
                let response = client.post(&format!("burst-{i}"), BODY).send().await;
                response
                    .expect("every request is answered")
                    .status()
                    .as_u16()
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let elapsed = started.elapsed();
    assert_eq!(statuses.len(), KEYS);
    let created = statuses.iter().filter(|&&s| s == 201).count();
    let server_errors: Vec<u16> = statuses.iter().copied().filter(|s| *s >= 500).collect();
    assert!(server_errors.is_empty(), "5xx answers: {server_errors:?}");
    assert_eq!(created, KEYS, "every distinct key is a first attempt");
    assert_eq!(effects_in_scope(server.pool(), &scope).await, KEYS as i64);
    assert_eq!(keys_in_scope(server.pool(), &scope).await, KEYS as i64);
    eprintln!(
        "burst: {KEYS} keys, {IN_FLIGHT} in flight, {elapsed:?} ({:.0} req/s)",
        KEYS as f64 / elapsed.as_secs_f64()
    );
}
