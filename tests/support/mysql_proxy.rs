//! A counting TCP proxy between a client (a sqlx pool) and MySQL/MariaDB,
//! for tests that must see the wire.
//!
//! It parses the client -> server half of the protocol framing: every
//! packet is a 3-byte little-endian payload length, a 1-byte sequence id and
//! the payload; a payload of `0xFFFFFF` bytes continues in the next packet
//! (whose sequence id goes on counting). A packet with sequence id 0 starts
//! a command (its first payload byte says which: `COM_QUERY`, `COM_PING`,
//! `COM_STMT_PREPARE`, `COM_STMT_EXECUTE`, ...); everything else the client
//! sends has a sequence id above 0: the login (`HandshakeResponse`, 1), an
//! auth switch's answers, a large packet's continuations, a `LOAD DATA
//! LOCAL` file. The server -> client half is copied through unparsed.
//!
//! A command the server answers is one round trip, unless the client sent
//! it before the server had answered anything since the last counted one:
//! then it rides on that round trip. The three commands the server never
//! answers (`COM_QUIT`, `COM_STMT_CLOSE`, `COM_STMT_SEND_LONG_DATA`) are
//! no round trip of their own, and the command after them is counted as
//! usual.
//!
//! Point the pool at [`MySqlProxy::addr`] with `ssl-mode=disabled`: over
//! TLS (or with protocol compression) the proxy cannot read the framing, so
//! a connection that asks for either is forwarded untouched and no longer
//! counted.
//!
//! ```ignore
//! let proxy = MySqlProxy::start("127.0.0.1:3306".parse()?).await;
//! let url = format!("mysql://root@{}/test?ssl-mode=disabled", proxy.addr());
//! let pool = MySqlPoolOptions::new().max_connections(1).connect(&url).await?;
//! proxy.reset();
//! sqlx::raw_sql("SELECT 1").execute(&pool).await?;
//! assert_eq!(proxy.round_trips(), 3); // ping, query, ping
//! ```
//!
//! Dropping the [`MySqlProxy`] stops it and drops its connections.

// Shared by test crates that may use only a part of it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A proxy on `127.0.0.1:<ephemeral>` in front of one MySQL/MariaDB server.
///
/// Counts round trips across all its connections. Stopped, with all its
/// connections, when dropped.
pub struct MySqlProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

struct Shared {
    upstream: SocketAddr,
    round_trips: AtomicU64,
    commands: AtomicU64,
    /// Connections open now.
    open: AtomicU64,
    /// Connections accepted since the last reset.
    accepted: AtomicU64,
    /// The commands of each round trip, while recording.
    log: Mutex<Option<Log>>,
    /// Bumped on drop: every connection stops forwarding and closes.
    generation: watch::Sender<u64>,
}

impl MySqlProxy {
    /// Starts a proxy to `upstream`, listening on `127.0.0.1:0`.
    pub async fn start(upstream: SocketAddr) -> MySqlProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy on loopback");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            upstream,
            round_trips: AtomicU64::new(0),
            commands: AtomicU64::new(0),
            open: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            log: Mutex::new(None),
            generation: watch::Sender::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        MySqlProxy {
            addr,
            shared,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Round trips since the start or the last [`reset`](MySqlProxy::reset):
    /// answered commands, those sent before the server answered the one
    /// before them counted with it.
    pub fn round_trips(&self) -> u64 {
        self.shared.round_trips.load(Ordering::SeqCst)
    }

    /// Commands forwarded (sequence id 0), answered or not.
    pub fn commands(&self) -> u64 {
        self.shared.commands.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn connections(&self) -> u64 {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// Connections accepted since the last reset: a pool that reconnects
    /// during a request shows here, not in the round trips (its login is
    /// no command).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Zeroes the counters (round trips, commands, accepted connections).
    pub fn reset(&self) {
        self.shared.round_trips.store(0, Ordering::SeqCst);
        self.shared.commands.store(0, Ordering::SeqCst);
        self.shared.accepted.store(0, Ordering::SeqCst);
    }

    /// Starts recording every command, grouped by round trip, dropping
    /// what was recorded before.
    pub fn record(&self) {
        *self.shared.log.lock().unwrap() = Some(Log::default());
    }

    /// The round trips recorded since [`record`](MySqlProxy::record), each
    /// as its commands: `QUERY <sql>`, `PREPARE <sql>`, `EXECUTE`, `PING`.
    pub fn recorded(&self) -> Vec<Vec<String>> {
        let log = self.shared.log.lock().unwrap();
        log.as_ref()
            .map(|log| log.round_trips.clone())
            .unwrap_or_default()
    }
}

impl Drop for MySqlProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared
            .generation
            .send_modify(|generation| *generation += 1);
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of file descriptors, say: back off rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.open.fetch_add(1, Ordering::SeqCst);
        // Subscribed at accept: the proxy's drop from now on reaches it.
        let cut = shared.generation.subscribe();
        tokio::spawn(serve(client, Arc::clone(&shared), cut));
    }
}

/// Counts a connection as open until it ends, however it ends.
struct Open<'a>(&'a Shared);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One client connection: both directions until either side closes or the
/// proxy stops. Dropping the four halves closes both sockets.
async fn serve(client: TcpStream, shared: Arc<Shared>, mut cut: watch::Receiver<u64>) {
    let _open = Open(&shared);
    let Ok(server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // Whether the server has answered since the client's last round trip.
    // The server speaks first (its greeting), so the first command counts.
    let answered = AtomicBool::new(true);
    tokio::select! {
        biased;
        _ = cut.changed() => {}
        _ = client_to_server(client_read, server_write, &shared, &answered) => {}
        _ = server_to_client(server_read, client_write, &answered) => {}
    }
}

/// Server -> client: copied through, noting that the server answered.
async fn server_to_client(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    answered: &AtomicBool,
) -> std::io::Result<()> {
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let read = from.read(&mut chunk).await?;
        if read == 0 {
            return Ok(());
        }
        // Before the client can see the answer and send again.
        answered.store(true, Ordering::SeqCst);
        to.write_all(&chunk[..read]).await?;
    }
}

/// Client -> server: framed and counted, whole packets forwarded as they
/// complete (a packet split across reads waits for its rest).
async fn client_to_server(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    answered: &AtomicBool,
) -> std::io::Result<()> {
    let mut framing = Framing::Login;
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let read = from.read(&mut chunk).await?;
        if read == 0 {
            return Ok(());
        }
        if framing == Framing::Opaque {
            to.write_all(&chunk[..read]).await?;
            continue;
        }
        buf.extend_from_slice(&chunk[..read]);
        let mut end = 0;
        while let Some(packet) = next_packet(&buf[end..]) {
            end += packet.len;
            match framing.next(&packet) {
                Seen::Command(command) => shared.count(command, packet.payload, answered),
                Seen::Other => {}
            }
            if framing == Framing::Opaque {
                // TLS or compression from here on: opaque bytes.
                end = buf.len();
                break;
            }
        }
        // Counted before forwarding: the server cannot answer first.
        to.write_all(&buf[..end]).await?;
        buf.drain(..end);
    }
}

/// Commands by round trip.
#[derive(Default)]
struct Log {
    round_trips: Vec<Vec<String>>,
    /// The last entry holds only unanswered commands sent after an answer:
    /// the next round trip's first command joins them.
    unanswered: bool,
}

impl Shared {
    /// Counts a command: a round trip unless the server never answers it,
    /// or it follows another that the server has not answered yet.
    fn count(&self, command: u8, payload: &[u8], answered: &AtomicBool) {
        self.commands.fetch_add(1, Ordering::SeqCst);
        let unanswered = NO_ANSWER.contains(&command);
        // An unanswered command leaves the flag to the next one.
        let after_answer = if unanswered {
            answered.load(Ordering::SeqCst)
        } else {
            answered.swap(false, Ordering::SeqCst)
        };
        if after_answer && !unanswered {
            self.round_trips.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(log) = self.log.lock().unwrap().as_mut() {
            let described = describe(command, payload);
            let joins = !after_answer || log.unanswered;
            match log.round_trips.last_mut() {
                Some(round_trip) if joins => round_trip.push(described),
                _ => log.round_trips.push(vec![described]),
            }
            if after_answer {
                log.unanswered = unanswered;
            }
        }
    }
}

/// One packet at the start of the buffer.
struct Packet<'a> {
    /// Header and payload.
    len: usize,
    seq: u8,
    payload: &'a [u8],
}

/// The first complete packet of `buf`; `None` while more bytes are needed.
fn next_packet(buf: &[u8]) -> Option<Packet<'_>> {
    let header = buf.get(..4)?;
    let payload_len =
        usize::from(header[0]) | usize::from(header[1]) << 8 | usize::from(header[2]) << 16;
    let payload = buf.get(4..4 + payload_len)?;
    Some(Packet {
        len: 4 + payload_len,
        seq: header[3],
        payload,
    })
}

/// Where the client is in its half of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Before the login packet (the client's first, sequence id 1).
    Login,
    /// Logged in (or logging in): sequence id 0 starts a command.
    Commands,
    /// TLS or compression: not parsed.
    Opaque,
}

enum Seen {
    /// A command, by its first payload byte.
    Command(u8),
    /// The login, an auth exchange, a continuation.
    Other,
}

/// `CLIENT_COMPRESS`: after the login, packets are wrapped in compressed
/// frames.
const CLIENT_COMPRESS: u32 = 0x20;
/// `CLIENT_SSL`: in a 32-byte `SSLRequest`, TLS follows.
const CLIENT_SSL: u32 = 0x800;
/// The payload of an `SSLRequest`: capabilities, max packet, charset,
/// filler.
const SSL_REQUEST_LEN: usize = 32;

const COM_QUIT: u8 = 0x01;
const COM_QUERY: u8 = 0x03;
const COM_PING: u8 = 0x0e;
const COM_STMT_PREPARE: u8 = 0x16;
const COM_STMT_EXECUTE: u8 = 0x17;
const COM_STMT_SEND_LONG_DATA: u8 = 0x18;
const COM_STMT_CLOSE: u8 = 0x19;
const COM_STMT_RESET: u8 = 0x1a;
const COM_RESET_CONNECTION: u8 = 0x1f;
/// Commands the server sends nothing back for.
const NO_ANSWER: [u8; 3] = [COM_QUIT, COM_STMT_SEND_LONG_DATA, COM_STMT_CLOSE];

impl Framing {
    /// What `packet` is, advancing the state.
    fn next(&mut self, packet: &Packet<'_>) -> Seen {
        match self {
            Self::Opaque => Seen::Other,
            Self::Login => {
                *self = Self::Commands;
                let capabilities = packet
                    .payload
                    .get(..4)
                    .map_or(0, |bytes| u32::from_le_bytes(bytes.try_into().unwrap()));
                let tls = capabilities & CLIENT_SSL != 0 && packet.payload.len() == SSL_REQUEST_LEN;
                if tls || capabilities & CLIENT_COMPRESS != 0 {
                    *self = Self::Opaque;
                }
                Seen::Other
            }
            Self::Commands => match (packet.seq, packet.payload.first()) {
                (0, Some(&command)) => Seen::Command(command),
                _ => Seen::Other,
            },
        }
    }
}

/// A command as the log shows it.
fn describe(command: u8, payload: &[u8]) -> String {
    let sql = || {
        let sql = String::from_utf8_lossy(&payload[1..]);
        sql.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    match command {
        COM_QUERY => format!("QUERY {}", sql()),
        COM_STMT_PREPARE => format!("PREPARE {}", sql()),
        COM_STMT_EXECUTE => "EXECUTE".to_owned(),
        COM_STMT_CLOSE => "CLOSE".to_owned(),
        COM_STMT_RESET => "RESET".to_owned(),
        COM_STMT_SEND_LONG_DATA => "LONG DATA".to_owned(),
        COM_PING => "PING".to_owned(),
        COM_QUIT => "QUIT".to_owned(),
        COM_RESET_CONNECTION => "RESET CONNECTION".to_owned(),
        other => format!("COMMAND 0x{other:02x}"),
    }
}

#[cfg(test)]
mod framing_tests {
    #[allow(unused_imports)]
    use super::*;

    fn packet(seq: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len().to_le_bytes();
        let mut packet = vec![len[0], len[1], len[2], seq];
        packet.extend_from_slice(payload);
        packet
    }

    /// The kinds the framing sees in `stream`, and the bytes it used.
    fn kinds(framing: &mut Framing, stream: &[u8]) -> (Vec<Option<u8>>, usize) {
        let mut kinds = Vec::new();
        let mut at = 0;
        while let Some(packet) = next_packet(&stream[at..]) {
            at += packet.len;
            kinds.push(match framing.next(&packet) {
                Seen::Command(command) => Some(command),
                Seen::Other => None,
            });
        }
        (kinds, at)
    }

    #[test]
    fn commands_are_sequence_zero_after_the_login() {
        let mut stream = packet(1, &[0x0d, 0xa2, 0x0a, 0x00, 0, 0, 0, 1, 33, 0]);
        stream.extend(packet(3, b"auth switch answer"));
        stream.extend(packet(0, b"\x03SELECT 1"));
        stream.extend(packet(0, b"\x0e"));
        stream.extend(packet(1, b"continuation"));
        let mut framing = Framing::Login;
        let (seen, used) = kinds(&mut framing, &stream);
        assert_eq!(seen, [None, None, Some(COM_QUERY), Some(COM_PING), None]);
        assert_eq!(used, stream.len());
    }

    #[test]
    fn a_split_packet_waits_for_its_rest() {
        let whole = packet(0, b"\x03SELECT 1");
        for cut in 0..whole.len() {
            assert!(next_packet(&whole[..cut]).is_none(), "cut at {cut}");
        }
        let packet = next_packet(&whole).unwrap();
        assert_eq!((packet.len, packet.seq), (whole.len(), 0));
        assert_eq!(packet.payload, b"\x03SELECT 1");
    }

    #[test]
    fn tls_and_compression_are_opaque() {
        let mut ssl_request = (CLIENT_SSL | 0x0200).to_le_bytes().to_vec();
        ssl_request.resize(SSL_REQUEST_LEN, 0);
        let mut framing = Framing::Login;
        kinds(&mut framing, &packet(1, &ssl_request));
        assert_eq!(framing, Framing::Opaque);

        let mut login = CLIENT_COMPRESS.to_le_bytes().to_vec();
        login.resize(40, 0);
        let mut framing = Framing::Login;
        kinds(&mut framing, &packet(1, &login));
        assert_eq!(framing, Framing::Opaque);
    }
}
