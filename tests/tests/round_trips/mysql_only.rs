//! What only the MySQL proxy's framing shows: against a fake server the
//! test drives, how packets make commands and commands round trips.

use idem_tests::mysql_proxy::MySqlProxy;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Reads until `upstream` has `want` bytes from the proxy.
async fn receive(upstream: &mut tokio::net::TcpStream, want: usize) -> Vec<u8> {
    let mut got = vec![0; want];
    tokio::time::timeout(Duration::from_secs(10), upstream.read_exact(&mut got))
        .await
        .expect("the proxy forwards")
        .expect("read");
    got
}

fn packet(seq: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len().to_le_bytes();
    let mut packet = vec![len[0], len[1], len[2], seq];
    packet.extend_from_slice(payload);
    packet
}

/// Against a fake server the test drives: the login and an auth exchange
/// are no command; commands sent before the server answers are one round
/// trip, whether written together or a packet split across writes; a
/// command the server never answers (`COM_STMT_CLOSE`) is no round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_frames_packets_and_joins_unanswered_commands() {
    let fake = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = MySqlProxy::start(fake.local_addr().unwrap()).await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    let (mut server, _) = fake.accept().await.unwrap();
    let mut greeting = [0u8; 1];
    // The server's greeting, then the login and an auth switch answer.
    server.write_all(b"g").await.unwrap();
    client.read_exact(&mut greeting).await.unwrap();
    let mut login = 0x000a_a20d_u32.to_le_bytes().to_vec();
    login.resize(40, 0);
    let login = [packet(1, &login), packet(3, b"auth")].concat();
    client.write_all(&login).await.unwrap();
    receive(&mut server, login.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (0, 0));
    server.write_all(b"k").await.unwrap();
    client.read_exact(&mut greeting).await.unwrap();

    proxy.record();
    // Two commands in one write, a third split across two writes, before
    // any answer: one round trip.
    let query = packet(0, b"\x03ROLLBACK");
    let ping = packet(0, b"\x0e");
    client
        .write_all(&[query.clone(), ping[..2].to_vec()].concat())
        .await
        .unwrap();
    receive(&mut server, query.len()).await;
    client.write_all(&ping[2..]).await.unwrap();
    receive(&mut server, ping.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (2, 1));
    client.write_all(&query).await.unwrap();
    receive(&mut server, query.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (3, 1));

    // Answered: the next command is a round trip of its own; one the server
    // never answers is not, and leaves the next one its own.
    server.write_all(b"ok").await.unwrap();
    let mut answer = [0u8; 2];
    client.read_exact(&mut answer).await.unwrap();
    let close = packet(0, b"\x19\x01\x00\x00\x00");
    let sent = [close.clone(), ping.clone()].concat();
    client.write_all(&sent).await.unwrap();
    receive(&mut server, sent.len()).await;
    assert_eq!((proxy.commands(), proxy.round_trips()), (5, 2));
    assert_eq!(
        proxy.recorded(),
        [
            vec!["QUERY ROLLBACK", "PING", "QUERY ROLLBACK"],
            vec!["CLOSE", "PING"]
        ]
    );

    assert_eq!(proxy.connections(), 1);
    drop(proxy);
    // Stopped: the proxy closes both sides.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), server.read_to_end(&mut rest))
        .await
        .expect("the proxy closes the server side");
    assert!(closed.is_ok() && rest.is_empty());
}
