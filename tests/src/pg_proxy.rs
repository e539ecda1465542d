//! A counting, cuttable TCP proxy between a client (a sqlx pool) and
//! PostgreSQL, for tests and benchmarks that must see the wire.
//!
//! It parses the frontend (client -> server) half of the protocol framing:
//! the untyped startup messages (`StartupMessage`, `SSLRequest`,
//! `GSSENCRequest`, `CancelRequest`: an `i32` length, then the body), then
//! typed messages (one type byte, an `i32` length that counts itself, the
//! body). Every `Query` (`'Q'`, simple protocol) and `Sync` (`'S'`, the end of
//! an extended-protocol exchange) forwarded to the server is one round trip:
//! the client waits for `ReadyForQuery` after each.
//!
//! Point the pool at `addr()` with `sslmode=disable`: over TLS the
//! proxy cannot read the framing, so a connection that negotiates TLS is
//! forwarded untouched and not counted.
//!
//! ```ignore
//! let proxy = PgProxy::start("127.0.0.1:5432".parse()?).await;
//! let url = format!("postgres://postgres@{}/test?sslmode=disable", proxy.addr());
//! let pool = PgPoolOptions::new().max_connections(1).connect(&url).await?;
//! proxy.reset();
//! sqlx::query("SELECT 1").execute(&pool).await?;
//! assert!(proxy.round_trips() >= 1);
//! ```
//!
//! Chaos controls, and the counters every proxy has, are [`Proxy`]'s
//! (which `PgProxy` derefs to). A commit is a `Query` or `Parse` message
//! whose SQL has the word `COMMIT`; cut after forwarding a `Parse`, the
//! connection goes once its `Sync` has gone on too. The backend half is
//! framed as far as a withheld answer needs (each `ReadyForQuery` ends the
//! answer to one `Query` or `Sync`) and to read the session's id (the
//! backend's pid, from `BackendKeyData`); it is copied through as read.

use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::TcpStream;

use crate::proxy::{
    Conn, Ended, Forward, Wire, client_to_server, connect, contains_word, relay, server_to_client,
};
pub use crate::proxy::{CutOnCommit, Proxy};

/// A proxy on `127.0.0.1:<ephemeral>` in front of one PostgreSQL server.
///
/// Counts round trips across all its connections: client `Query` and
/// `Sync` messages, where messages the client sends together, before any
/// answer, are one round trip (sqlx queues a rollback ahead of its ping).
/// Stopped, with all its connections, when dropped.
pub struct PgProxy {
    proxy: Proxy,
    shared: Arc<Shared>,
}

struct Shared {
    /// `Query` SQL containing the first text gets it replaced by the second.
    rewrite: Mutex<Option<(Vec<u8>, Vec<u8>)>>,
}

impl Deref for PgProxy {
    type Target = Proxy;

    fn deref(&self) -> &Proxy {
        &self.proxy
    }
}

impl PgProxy {
    /// Starts a proxy to `upstream`, listening on `127.0.0.1:0`.
    pub async fn start(upstream: SocketAddr) -> PgProxy {
        let shared = Arc::new(Shared {
            rewrite: Mutex::new(None),
        });
        let proxy = Proxy::start(upstream, {
            let shared = Arc::clone(&shared);
            move |client, wire| serve(client, wire, Arc::clone(&shared))
        })
        .await;
        PgProxy { proxy, shared }
    }

    /// From now on, a `Query` or `Parse` whose SQL contains `from` reaches
    /// the server with `from` replaced by `to` (to simulate what a test
    /// cannot make the server do, such as a pooler's session switch);
    /// `None` stops it.
    pub fn set_rewrite(&self, rewrite: Option<(&str, &str)>) {
        *self.shared.rewrite.lock().unwrap() =
            rewrite.map(|(from, to)| (from.as_bytes().to_vec(), to.as_bytes().to_vec()));
    }

    /// The SQL of the `Query` messages recorded since
    /// [`record`](Proxy::record) (as sent, before any rewrite).
    pub fn recorded_queries(&self) -> Vec<String> {
        self.recorded()
            .into_iter()
            .flatten()
            .filter_map(|command| command.strip_prefix("QUERY ").map(str::to_owned))
            .collect()
    }
}

/// One client connection: both directions until either side closes, or
/// a withheld answer is complete.
async fn serve(client: TcpStream, wire: Arc<Wire>, shared: Arc<Shared>) {
    let Some((client_read, client_write, server_read, server_write)) =
        connect(client, wire.upstream).await
    else {
        return;
    };
    let conn = Conn::default();
    // `Query` and `Sync` messages forwarded whose `ReadyForQuery` has not
    // come back yet.
    let pending = AtomicI64::new(0);
    let mut frontend = Frontend::default();
    let mut replies = Replies::default();
    relay(
        client_to_server(client_read, server_write, |buf| {
            frontend.frame(buf, &wire, &shared, &conn, &pending)
        }),
        // A withheld answer is complete once every pending `ReadyForQuery`
        // has come.
        server_to_client(server_read, client_write, &conn, |bytes, _| {
            let ready = replies.feed(bytes, &conn);
            pending.fetch_sub(ready, Ordering::SeqCst) - ready <= 0
        }),
    )
    .await;
}

/// The client's half of a connection: framed, counted, and cut at a
/// commit when asked.
#[derive(Default)]
struct Frontend {
    framing: Framing,
    /// A `Parse` of a commit was forwarded under `AfterForwarding`: the
    /// connection goes with the next `Sync`.
    cut_at_sync: bool,
}

impl Frontend {
    /// Whole messages go on in one write, up to a cut point.
    fn frame(
        &mut self,
        buf: &[u8],
        wire: &Wire,
        shared: &Shared,
        conn: &Conn,
        pending: &AtomicI64,
    ) -> Forward {
        let mut end = 0;
        let mut out = Vec::with_capacity(buf.len());
        let framed = |forward, used, ended| Forward {
            forward,
            used,
            opaque: false,
            ended,
        };
        while let Some(message) = self.framing.next(&buf[end..]) {
            let raw = &buf[end..end + message.len];
            end += message.len;
            let Message::Typed(kind, body) = message.kind else {
                out.extend_from_slice(raw);
                continue;
            };
            let cut = wire.cut_at(carries_commit(kind, body), conn);
            if cut == CutOnCommit::BeforeForwarding {
                return framed(out, end, Some(Ended::Closed));
            }
            self.cut_at_sync |= cut == CutOnCommit::AfterForwarding && kind == b'P';
            let answered = matches!(kind, b'Q' | b'S');
            let withhold = (cut == CutOnCommit::AfterForwarding && kind == b'Q')
                || (self.cut_at_sync && kind == b'S');
            if answered {
                // Before the server can answer it.
                pending.fetch_add(1, Ordering::SeqCst);
            }
            if withhold {
                // Before forwarding: no byte of the answer slips through.
                conn.withhold.store(true, Ordering::SeqCst);
            }
            wire.count(&conn.answered, answered, || describe(kind, body));
            // A `Query` is its SQL; a `Parse`, a name, its SQL and types:
            // either way the SQL is in the body, and re-framed after.
            match matches!(kind, b'Q' | b'P')
                .then(|| shared.rewritten(body))
                .flatten()
            {
                Some(body) => out.extend(typed(kind, &body)),
                None => out.extend_from_slice(raw),
            }
            if withhold {
                return framed(out, end, Some(Ended::Withholding));
            }
        }
        if self.framing == Framing::Opaque {
            // TLS started: everything from here on is opaque bytes.
            out.extend_from_slice(&buf[end..]);
            return Forward {
                forward: out,
                used: buf.len(),
                opaque: true,
                ended: None,
            };
        }
        framed(out, end, None)
    }
}

/// A client message as the log shows it.
fn describe(kind: u8, body: &[u8]) -> String {
    let sql = |sql: &[u8]| {
        let sql = sql.strip_suffix(b"\0").unwrap_or(sql);
        String::from_utf8_lossy(sql).into_owned()
    };
    match kind {
        b'Q' => format!("QUERY {}", sql(body)),
        b'P' => match body.split(|&b| b == 0).next().unwrap_or_default() {
            [] => format!("PARSE {}", sql(parsed_sql(body))),
            name => format!(
                "PARSE NAMED {} {}",
                String::from_utf8_lossy(name),
                sql(parsed_sql(body))
            ),
        },
        b'B' => "BIND".to_owned(),
        b'D' => "DESCRIBE".to_owned(),
        b'E' => "EXECUTE".to_owned(),
        b'S' => "SYNC".to_owned(),
        b'C' => "CLOSE".to_owned(),
        b'H' => "FLUSH".to_owned(),
        b'X' => "TERMINATE".to_owned(),
        other => format!("MESSAGE {}", other as char),
    }
}

/// The SQL of a `Parse` message: statement name, NUL, the SQL, NUL,
/// parameter types.
fn parsed_sql(body: &[u8]) -> &[u8] {
    body.splitn(3, |&b| b == 0).nth(1).unwrap_or_default()
}

impl Shared {
    /// A message body with the rewrite applied, if it applies.
    fn rewritten(&self, body: &[u8]) -> Option<Vec<u8>> {
        let rewrite = self.rewrite.lock().unwrap();
        let (from, to) = rewrite.as_ref()?;
        let at = body.windows(from.len()).position(|window| window == from)?;
        let mut rewritten = body[..at].to_vec();
        rewritten.extend_from_slice(to);
        rewritten.extend_from_slice(&body[at + from.len()..]);
        Some(rewritten)
    }
}

/// A typed message: its kind, its length, its body.
fn typed(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut message = vec![kind];
    message.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
    message.extend_from_slice(body);
    message
}

/// Where the client is in the frontend protocol.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Framing {
    /// Untyped messages until the `StartupMessage`.
    #[default]
    Startup,
    /// After an encryption request: the next bytes are either another
    /// untyped message (the server said no) or a TLS handshake.
    AfterEncryptionRequest,
    /// Typed messages.
    Typed,
    /// TLS: not parsed.
    Opaque,
}

struct Framed<'a> {
    len: usize,
    kind: Message<'a>,
}

enum Message<'a> {
    Untyped,
    Typed(u8, &'a [u8]),
}

const SSL_REQUEST: i32 = 80_877_103;
const GSSENC_REQUEST: i32 = 80_877_104;
/// The first byte of a TLS record (handshake).
const TLS_HANDSHAKE: u8 = 0x16;

impl Framing {
    /// The next complete message at the start of `buf`, advancing the state;
    /// `None` while more bytes are needed.
    fn next<'a>(&mut self, buf: &'a [u8]) -> Option<Framed<'a>> {
        match self {
            Self::Opaque => None,
            Self::AfterEncryptionRequest if buf.first() == Some(&TLS_HANDSHAKE) => {
                *self = Self::Opaque;
                None
            }
            Self::Startup | Self::AfterEncryptionRequest => {
                let len = read_len(buf.get(..4)?)?;
                let code = i32::from_be_bytes(buf.get(4..8)?.try_into().ok()?);
                if buf.len() < len {
                    return None;
                }
                *self = match code {
                    SSL_REQUEST | GSSENC_REQUEST => Self::AfterEncryptionRequest,
                    // Protocol 3.x: a StartupMessage. A CancelRequest ends
                    // the connection, so the state does not matter.
                    _ => Self::Typed,
                };
                Some(Framed {
                    len,
                    kind: Message::Untyped,
                })
            }
            Self::Typed => {
                let kind = *buf.first()?;
                let len = 1 + read_len(buf.get(1..5)?)?;
                let body = buf.get(5..len)?;
                Some(Framed {
                    len,
                    kind: Message::Typed(kind, body),
                })
            }
        }
    }
}

/// The server's half of the framing, as far as the proxy reads it: the
/// session's id (`BackendKeyData`) and the `ReadyForQuery` messages that
/// end the answers to the client's `Query` and `Sync` messages.
#[derive(Default)]
struct Replies {
    buf: Vec<u8>,
    state: Replying,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Replying {
    /// Before the first typed message: the one-byte answers to encryption
    /// requests (`N` refused; `S`, `G`: TLS or GSSAPI follows).
    #[default]
    Start,
    /// Authentication and startup, until the first `ReadyForQuery` (which
    /// answers no client message).
    Startup,
    /// Answers to the client's messages.
    Answering,
    /// Encrypted, or not what we think it is: not parsed.
    Opaque,
}

impl Replies {
    /// Takes the next bytes from the server; returns how many
    /// `ReadyForQuery` messages answering the client they completed, and
    /// notes the session's id in `conn`.
    fn feed(&mut self, bytes: &[u8], conn: &Conn) -> i64 {
        if self.state == Replying::Opaque {
            return 0;
        }
        self.buf.extend_from_slice(bytes);
        let mut at = 0;
        let mut ready = 0;
        while let Some(&kind) = self.buf.get(at) {
            if self.state == Replying::Start {
                match kind {
                    b'N' => at += 1,
                    b'S' | b'G' => self.state = Replying::Opaque,
                    _ => self.state = Replying::Startup,
                }
                continue;
            }
            let Some(len) = self.buf.get(at + 1..at + 5).map(read_len) else {
                break;
            };
            let Some(len) = len else {
                self.state = Replying::Opaque;
                break;
            };
            let Some(body) = self.buf.get(at + 5..at + 1 + len) else {
                break;
            };
            match (kind, self.state) {
                (b'K', _) => {
                    let pid = body
                        .get(..4)
                        .map(|pid| u32::from_be_bytes(pid.try_into().unwrap()));
                    conn.session.store(pid.unwrap_or(0), Ordering::SeqCst);
                }
                (b'Z', Replying::Startup) => self.state = Replying::Answering,
                (b'Z', _) => ready += 1,
                _ => {}
            }
            at += 1 + len;
        }
        if self.state == Replying::Opaque {
            self.buf = Vec::new();
        } else {
            self.buf.drain(..at);
        }
        ready
    }
}

/// A message length (it counts its own four bytes). A nonsense length
/// means the stream is not what we think it is: stop parsing.
fn read_len(bytes: &[u8]) -> Option<usize> {
    let len = i32::from_be_bytes(bytes.try_into().ok()?);
    usize::try_from(len).ok().filter(|&len| len >= 4)
}

/// Whether a `Query` or `Parse` message's SQL contains the word `COMMIT`.
fn carries_commit(kind: u8, body: &[u8]) -> bool {
    let sql = match kind {
        b'Q' => body,
        b'P' => parsed_sql(body),
        _ => return false,
    };
    contains_word(sql, b"commit")
}

#[cfg(test)]
mod framing_tests {
    // A bench that includes this file compiles `cfg(test)` without its tests.
    #[allow(unused_imports)]
    use super::*;

    #[test]
    fn splits_startup_then_typed_messages() {
        let mut stream = Vec::new();
        stream.extend_from_slice(&8i32.to_be_bytes());
        stream.extend_from_slice(&SSL_REQUEST.to_be_bytes());
        stream.extend_from_slice(&9i32.to_be_bytes());
        stream.extend_from_slice(&196_608i32.to_be_bytes());
        stream.push(0);
        stream.extend(typed(b'Q', b"BEGIN\0"));
        stream.extend(typed(b'S', b""));
        let mut framing = Framing::Startup;
        let mut kinds = Vec::new();
        let mut at = 0;
        while let Some(message) = framing.next(&stream[at..]) {
            kinds.push(match message.kind {
                Message::Untyped => b'-',
                Message::Typed(kind, _) => kind,
            });
            at += message.len;
        }
        assert_eq!(kinds, b"--QS");
        assert_eq!(at, stream.len());
        // A partial message waits for more bytes.
        let partial = typed(b'Q', b"SELECT 1\0");
        assert!(Framing::Typed.next(&partial[..7]).is_none());
    }

    #[test]
    fn tls_after_an_encryption_request_is_opaque() {
        let mut framing = Framing::AfterEncryptionRequest;
        assert!(framing.next(&[TLS_HANDSHAKE, 3, 1]).is_none());
        assert_eq!(framing, Framing::Opaque);
    }

    #[test]
    fn replies_name_the_session_and_count_ready_for_query() {
        let conn = Conn::default();
        let mut replies = Replies::default();
        let mut key_data = 4242u32.to_be_bytes().to_vec();
        key_data.extend_from_slice(&[0, 0, 0, 7]);
        // Refused encryption, authentication ok, key data, ready: startup.
        let mut startup = vec![b'N'];
        startup.extend(typed(b'R', &[0, 0, 0, 0]));
        startup.extend(typed(b'K', &key_data));
        startup.extend(typed(b'Z', b"I"));
        assert_eq!(
            replies.feed(&startup, &conn),
            0,
            "startup's ready answers nothing"
        );
        assert_eq!(conn.session.load(Ordering::SeqCst), 4242);
        // Two answers, the second split across reads.
        let mut answers = typed(b'C', b"COMMIT\0");
        answers.extend(typed(b'Z', b"I"));
        answers.extend(typed(b'Z', b"I"));
        let (first, rest) = answers.split_at(answers.len() - 3);
        assert_eq!(replies.feed(first, &conn), 1);
        assert_eq!(replies.feed(rest, &conn), 1);
        // TLS accepted: nothing more is read.
        let mut tls = Replies::default();
        assert_eq!(tls.feed(&[b'S', b'Z', 0, 0, 0, 5, b'I'], &conn), 0);
    }

    #[test]
    fn finds_commit_as_a_word_only() {
        assert!(carries_commit(b'Q', b"COMMIT\0"));
        assert!(carries_commit(b'Q', b"UPDATE t SET a = 1; commit\0"));
        assert!(carries_commit(b'P', b"s1\0COMMIT\0\0\0"));
        assert!(!carries_commit(b'Q', b"INSERT INTO commits VALUES (1)\0"));
        assert!(!carries_commit(b'B', b"COMMIT"));
    }
}
