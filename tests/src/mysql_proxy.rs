//! A counting, cuttable TCP proxy between a client (a sqlx pool) and
//! MySQL/MariaDB, for tests that must see the wire.
//!
//! It parses the client -> server half of the protocol framing: every
//! packet is a 3-byte little-endian payload length, a 1-byte sequence id and
//! the payload; a payload of `0xFFFFFF` bytes continues in the next packet
//! (whose sequence id goes on counting). A packet with sequence id 0 starts
//! a command (its first payload byte says which: `COM_QUERY`, `COM_PING`,
//! `COM_STMT_PREPARE`, `COM_STMT_EXECUTE`, ...); everything else the client
//! sends has a sequence id above 0: the login (`HandshakeResponse`, 1), an
//! auth switch's answers, a large packet's continuations, a `LOAD DATA
//! LOCAL` file. The server -> client half is copied through unparsed,
//! but for the greeting's session id and a withheld answer (below).
//!
//! A command the server answers is one round trip, unless the client sent
//! it before the server had answered anything since the last counted one:
//! then it rides on that round trip. The three commands the server never
//! answers (`COM_QUIT`, `COM_STMT_CLOSE`, `COM_STMT_SEND_LONG_DATA`) are
//! no round trip of their own, and the command after them is counted as
//! usual.
//!
//! Point the pool at `addr()` with `ssl-mode=disabled`: over
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
//! Chaos controls, and the counters every proxy has, are [`Proxy`]'s
//! (which `MySqlProxy` derefs to). A commit is a `COM_QUERY` whose SQL
//! has the word `COMMIT`; the session a cut names is the server's
//! `CONNECTION_ID()`, from its greeting.

use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::net::TcpStream;

use crate::proxy::{
    Conn, Ended, Forward, Wire, client_to_server, connect, contains_word, relay, server_to_client,
};
pub use crate::proxy::{CutOnCommit, Proxy};

/// A proxy on `127.0.0.1:<ephemeral>` in front of one MySQL/MariaDB server.
///
/// Counts round trips across all its connections. Stopped, with all its
/// connections, when dropped.
pub struct MySqlProxy {
    proxy: Proxy,
}

impl Deref for MySqlProxy {
    type Target = Proxy;

    fn deref(&self) -> &Proxy {
        &self.proxy
    }
}

impl MySqlProxy {
    /// Starts a proxy to `upstream`, listening on `127.0.0.1:0`.
    pub async fn start(upstream: SocketAddr) -> MySqlProxy {
        let proxy = Proxy::start(upstream, serve).await;
        MySqlProxy { proxy }
    }
}

/// One client connection: both directions until either side closes, or a
/// withheld answer is complete.
async fn serve(client: TcpStream, wire: Arc<Wire>) {
    let Some((client_read, client_write, server_read, server_write)) =
        connect(client, wire.upstream).await
    else {
        return;
    };
    let conn = Conn::default();
    // The capabilities of the client's login packet.
    let login_capabilities = AtomicU32::new(0);
    let mut framing = Framing::Login;
    // The greeting's bytes, until its packet is complete.
    let mut greeting = Some(Vec::new());
    // The end of a withheld answer.
    let mut withheld: Option<AnswerEnd> = None;
    relay(
        client_to_server(client_read, server_write, |buf| {
            framing.frame(buf, &wire, &conn, &login_capabilities)
        }),
        // The greeting names the session; a withheld answer is read to its
        // end.
        server_to_client(server_read, client_write, &conn, |bytes, withholding| {
            if let Some(greeting_bytes) = greeting.as_mut() {
                greeting_bytes.extend_from_slice(bytes);
                if let Some(packet) = next_packet(greeting_bytes) {
                    let session = session_id(packet.payload).unwrap_or(0);
                    conn.session.store(session, Ordering::SeqCst);
                    greeting = None;
                }
            }
            if !withholding {
                return false;
            }
            let answer = withheld.get_or_insert_with(|| {
                let capabilities = login_capabilities.load(Ordering::SeqCst);
                AnswerEnd::new(capabilities & CLIENT_DEPRECATE_EOF != 0)
            });
            answer.feed(bytes)
        }),
    )
    .await;
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
                let capabilities = capabilities(packet.payload);
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

impl Framing {
    /// Whole packets go on as they complete (a packet split across reads
    /// waits for its rest), counted before they go (the server cannot
    /// answer first), up to a cut at a commit.
    fn frame(
        &mut self,
        buf: &[u8],
        wire: &Wire,
        conn: &Conn,
        login_capabilities: &AtomicU32,
    ) -> Forward {
        let framed = |used: usize, ended| Forward {
            forward: buf[..used].to_vec(),
            used,
            opaque: false,
            ended,
        };
        let mut end = 0;
        while let Some(packet) = next_packet(&buf[end..]) {
            let start = end;
            end += packet.len;
            if *self == Framing::Login {
                login_capabilities.store(capabilities(packet.payload), Ordering::SeqCst);
            }
            if let Seen::Command(command) = self.next(&packet) {
                let commits =
                    command == COM_QUERY && contains_word(&packet.payload[1..], b"commit");
                let cut = wire.cut_at(commits, conn);
                if cut == CutOnCommit::BeforeForwarding {
                    return framed(start, Some(Ended::Closed));
                }
                if cut == CutOnCommit::AfterForwarding {
                    // Before forwarding: no byte of the answer slips through.
                    conn.withhold.store(true, Ordering::SeqCst);
                }
                let answers = !NO_ANSWER.contains(&command);
                wire.count(&conn.answered, answers, || {
                    describe(command, packet.payload)
                });
                if cut == CutOnCommit::AfterForwarding {
                    return framed(end, Some(Ended::Withholding));
                }
            }
            if *self == Framing::Opaque {
                // TLS or compression from here on: opaque bytes.
                return Forward {
                    opaque: true,
                    ..framed(buf.len(), None)
                };
            }
        }
        framed(end, None)
    }
}

/// The capability flags a login packet (or `SSLRequest`) starts with.
fn capabilities(payload: &[u8]) -> u32 {
    payload
        .get(..4)
        .map_or(0, |bytes| u32::from_le_bytes(bytes.try_into().unwrap()))
}

/// The connection id in the server's greeting (`HandshakeV10`: protocol
/// version 10, the server version up to a NUL, then the id), which the
/// session's `CONNECTION_ID()` returns.
fn session_id(greeting: &[u8]) -> Option<u32> {
    let (&10, rest) = greeting.split_first()? else {
        return None;
    };
    let nul = rest.iter().position(|&byte| byte == 0)?;
    let id = rest.get(nul + 1..nul + 5)?;
    Some(u32::from_le_bytes(id.try_into().unwrap()))
}

/// `CLIENT_DEPRECATE_EOF`: result sets end with an OK packet (header
/// `0xFE`) instead of EOF packets, and no EOF follows the columns.
const CLIENT_DEPRECATE_EOF: u32 = 1 << 24;
/// In an OK or EOF packet's status: another result of the same command
/// follows.
const SERVER_MORE_RESULTS_EXISTS: u16 = 0x0008;

/// Finds the end of the server's answer to one text command: its results
/// (a multi-statement batch has one per statement), each an OK packet, an
/// ERR packet (which ends the batch) or a result set, the last without
/// `SERVER_MORE_RESULTS_EXISTS`.
struct AnswerEnd {
    deprecate_eof: bool,
    buf: Vec<u8>,
    expect: Expect,
}

/// The next packet of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A result's first packet: OK, ERR, or a result set's column count.
    Result,
    /// Column definitions still to come.
    Columns(u64),
    /// The EOF after the columns (without `CLIENT_DEPRECATE_EOF`).
    ColumnsEof,
    /// Rows, until the EOF (or OK) that ends the set.
    Rows,
    /// The answer is complete.
    Done,
}

impl AnswerEnd {
    fn new(deprecate_eof: bool) -> AnswerEnd {
        AnswerEnd {
            deprecate_eof,
            buf: Vec::new(),
            expect: Expect::Result,
        }
    }

    /// Takes the next bytes of the answer; `true` once it is complete.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        self.buf.extend_from_slice(bytes);
        let mut at = 0;
        while self.expect != Expect::Done
            && let Some(packet) = next_packet(&self.buf[at..])
        {
            at += packet.len;
            self.expect = self.expect.after(packet.payload, self.deprecate_eof);
        }
        self.buf.drain(..at);
        self.expect == Expect::Done
    }
}

impl Expect {
    /// What comes after `payload`.
    fn after(self, payload: &[u8], deprecate_eof: bool) -> Expect {
        let more = |status: Option<u16>| match status {
            Some(status) if status & SERVER_MORE_RESULTS_EXISTS != 0 => Expect::Result,
            _ => Expect::Done,
        };
        match self {
            Expect::Result => match payload.first() {
                Some(0x00) => more(ok_status(payload)),
                // ERR (the batch stops), `LOCAL INFILE` (not for us), empty.
                Some(0xFF | 0xFB) | None => Expect::Done,
                Some(_) => match lenenc(payload) {
                    Some((0, _)) | None => Expect::Done,
                    Some((columns, _)) => Expect::Columns(columns),
                },
            },
            Expect::Columns(1) if deprecate_eof => Expect::Rows,
            Expect::Columns(1) => Expect::ColumnsEof,
            Expect::Columns(left) => Expect::Columns(left - 1),
            Expect::ColumnsEof => Expect::Rows,
            Expect::Rows => match payload.first() {
                Some(0xFF) => Expect::Done,
                // EOF: header, warnings, status.
                Some(0xFE) if !deprecate_eof && payload.len() < 9 => more(
                    payload
                        .get(3..5)
                        .map(|bytes| u16::from_le_bytes(bytes.try_into().unwrap())),
                ),
                // An OK packet with the EOF header (a row starting with
                // `0xFE` has an 8-byte length, so is longer).
                Some(0xFE) if deprecate_eof && payload.len() < 0xFF_FFFF => {
                    more(ok_status(payload))
                }
                _ => Expect::Rows,
            },
            Expect::Done => Expect::Done,
        }
    }
}

/// An OK packet's status flags: after the header, the affected rows and
/// the last insert id (length-encoded integers).
fn ok_status(payload: &[u8]) -> Option<u16> {
    let mut at = 1;
    for _ in 0..2 {
        at += lenenc(payload.get(at..)?)?.1;
    }
    let status = payload.get(at..at + 2)?;
    Some(u16::from_le_bytes(status.try_into().unwrap()))
}

/// A length-encoded integer at the start of `bytes`, and its size.
fn lenenc(bytes: &[u8]) -> Option<(u64, usize)> {
    let size = match *bytes.first()? {
        small @ 0..=0xFA => return Some((u64::from(small), 1)),
        0xFC => 2,
        0xFD => 3,
        0xFE => 8,
        _ => return None,
    };
    let mut value = [0u8; 8];
    value[..size].copy_from_slice(bytes.get(1..1 + size)?);
    Some((u64::from_le_bytes(value), 1 + size))
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

    /// An OK packet: header, affected rows, insert id, status, warnings.
    fn ok(header: u8, status: u16) -> Vec<u8> {
        let mut ok = vec![header, 1, 0xFC, 0x10, 0x27];
        ok.extend_from_slice(&status.to_le_bytes());
        ok.extend_from_slice(&[0, 0]);
        ok
    }

    #[test]
    fn a_batch_answer_ends_with_its_last_result() {
        let more = SERVER_MORE_RESULTS_EXISTS | 0x0002;
        // Three OKs, the last without "more results", fed byte by byte.
        let answer = [
            packet(1, &ok(0, more)),
            packet(2, &ok(0, more)),
            packet(3, &ok(0, 2)),
        ]
        .concat();
        let mut end = AnswerEnd::new(true);
        for (at, byte) in answer.iter().enumerate() {
            assert_eq!(end.feed(&[*byte]), at + 1 == answer.len(), "at byte {at}");
        }
        // An ERR stops the batch, whatever came before.
        let mut end = AnswerEnd::new(true);
        assert!(!end.feed(&packet(1, &ok(0, more))));
        assert!(end.feed(&packet(2, b"\xff\x98\x04#42000oops")));
    }

    #[test]
    fn a_result_set_ends_after_its_rows() {
        let more = SERVER_MORE_RESULTS_EXISTS;
        for deprecate_eof in [true, false] {
            let mut answer = vec![packet(1, b"\x01"), packet(2, b"column definition")];
            if !deprecate_eof {
                answer.push(packet(3, &[0xFE, 0, 0, 0x02, 0]));
            }
            // A row whose first byte is 0x00, another of 0xFB (NULL).
            answer.push(packet(4, b"\x00"));
            answer.push(packet(5, b"\xfb"));
            let end_of_set = |status: u16| match deprecate_eof {
                true => ok(0xFE, status),
                false => [vec![0xFE, 0, 0], status.to_le_bytes().to_vec()].concat(),
            };
            answer.push(packet(6, &end_of_set(more)));
            let mut end = AnswerEnd::new(deprecate_eof);
            assert!(!end.feed(&answer.concat()), "deprecate_eof {deprecate_eof}");
            assert!(
                end.feed(&packet(7, &ok(0, 0))),
                "deprecate_eof {deprecate_eof}"
            );

            let mut end = AnswerEnd::new(deprecate_eof);
            answer.pop();
            answer.push(packet(6, &end_of_set(0)));
            assert!(end.feed(&answer.concat()), "deprecate_eof {deprecate_eof}");
        }
    }

    #[test]
    fn the_greeting_names_the_session_and_commit_is_a_word() {
        let mut greeting = b"\x0a10.11.19-MariaDB\x00".to_vec();
        greeting.extend_from_slice(&4242u32.to_le_bytes());
        greeting.extend_from_slice(b"salt");
        assert_eq!(session_id(&greeting), Some(4242));
        assert_eq!(session_id(b"\xff\x10\x04Too many connections"), None);

        for sql in ["COMMIT", "x; commit; START TRANSACTION", "Commit;"] {
            assert!(contains_word(sql.as_bytes(), b"commit"), "{sql}");
        }
        for sql in ["SELECT committed", "SET @commit_x = 1", "START TRANSACTION"] {
            assert!(!contains_word(sql.as_bytes(), b"commit"), "{sql}");
        }
    }
}
