//! A counting, cuttable TCP proxy between a client (a sqlx pool) and
//! PostgreSQL, for tests and benchmarks that must see the wire.
//!
//! It parses the frontend (client -> server) half of the protocol framing:
//! the untyped startup messages (`StartupMessage`, `SSLRequest`,
//! `GSSENCRequest`, `CancelRequest`: an `i32` length, then the body), then
//! typed messages (one type byte, an `i32` length that counts itself, the
//! body). Every `Query` (`'Q'`, simple protocol) and `Sync` (`'S'`, the end of
//! an extended-protocol exchange) forwarded to the server is one round trip:
//! the client waits for `ReadyForQuery` after each. The backend half is copied
//! through unparsed.
//!
//! Point the pool at [`PgProxy::addr`] with `sslmode=disable`: over TLS the
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
//! Chaos controls: [`PgProxy::cut_all`] drops every open connection,
//! [`PgProxy::set_cut_on_commit`] drops a connection at its commit (before
//! or after the server sees it), [`PgProxy::set_refuse`] closes new
//! connections as they arrive. Dropping the [`PgProxy`] stops it and drops
//! its connections.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;

pub use crate::proxy::CutOnCommit;
use crate::proxy::{Listener, contains_word};

/// A proxy on `127.0.0.1:<ephemeral>` in front of one PostgreSQL server.
///
/// Counts round trips across all its connections: client `Query` and
/// `Sync` messages, where messages the client sends together, before any
/// answer, are one round trip (sqlx queues a rollback ahead of its ping). Stopped, with all its connections, when dropped.
pub struct PgProxy {
    listener: Listener,
    shared: Arc<Shared>,
}

struct Shared {
    upstream: SocketAddr,
    queries: AtomicU64,
    syncs: AtomicU64,
    round_trips: AtomicU64,
    connections: AtomicU64,
    cut_on_commit: AtomicU8,
    refuse: AtomicBool,
    /// `Query` SQL containing the first text gets it replaced by the second.
    rewrite: Mutex<Option<(Vec<u8>, Vec<u8>)>>,
    /// Every `Query` message's SQL, while `Some`.
    log: Mutex<Option<Vec<String>>>,
}

impl PgProxy {
    /// Starts a proxy to `upstream`, listening on `127.0.0.1:0`.
    pub async fn start(upstream: SocketAddr) -> PgProxy {
        let shared = Arc::new(Shared {
            upstream,
            queries: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            round_trips: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            cut_on_commit: AtomicU8::new(CutOnCommit::Off.as_u8()),
            refuse: AtomicBool::new(false),
            rewrite: Mutex::new(None),
            log: Mutex::new(None),
        });
        let listener = Listener::start({
            let shared = Arc::clone(&shared);
            move |client, cut| {
                let shared = Arc::clone(&shared);
                let refused = shared.refuse.load(Ordering::SeqCst);
                if !refused {
                    shared.connections.fetch_add(1, Ordering::SeqCst);
                }
                async move {
                    // A refused connection is closed as it arrives.
                    if !refused {
                        serve(client, shared, cut).await;
                    }
                }
            }
        })
        .await;
        PgProxy { listener, shared }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.listener.addr()
    }

    /// Round trips forwarded since the start or the last [`reset`]: client
    /// `Query` and `Sync` messages, those sent before the server answered
    /// the one before them counted with it.
    ///
    /// [`reset`]: PgProxy::reset
    pub fn round_trips(&self) -> u64 {
        self.shared.round_trips.load(Ordering::SeqCst)
    }

    /// Simple-protocol `Query` messages forwarded.
    pub fn queries(&self) -> u64 {
        self.shared.queries.load(Ordering::SeqCst)
    }

    /// Extended-protocol `Sync` messages forwarded (sqlx's ping is one too).
    pub fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::SeqCst)
    }

    /// Connections accepted (and not refused): a pool that reconnects
    /// during a request shows here, not in [`round_trips`](PgProxy::round_trips).
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Zeroes the counters (round trips and connections).
    pub fn reset(&self) {
        self.shared.queries.store(0, Ordering::SeqCst);
        self.shared.syncs.store(0, Ordering::SeqCst);
        self.shared.round_trips.store(0, Ordering::SeqCst);
        self.shared.connections.store(0, Ordering::SeqCst);
    }

    /// Drops every open connection now, in both directions; nothing more
    /// is forwarded on them. New connections are accepted as usual.
    pub fn cut_all(&self) {
        self.listener.cut_all();
    }

    /// Drops a connection when a client `Query` or `Parse` message whose
    /// SQL contains the word `COMMIT` passes, before or after forwarding it.
    /// Stays in force until set to [`CutOnCommit::Off`].
    pub fn set_cut_on_commit(&self, mode: CutOnCommit) {
        self.shared
            .cut_on_commit
            .store(mode.as_u8(), Ordering::SeqCst);
    }

    /// From now on, a `Query` or `Parse` whose SQL contains `from` reaches
    /// the server with `from` replaced by `to` (to simulate what a test
    /// cannot make the server do, such as a pooler's session switch);
    /// `None` stops it.
    pub fn set_rewrite(&self, rewrite: Option<(&str, &str)>) {
        *self.shared.rewrite.lock().unwrap() =
            rewrite.map(|(from, to)| (from.as_bytes().to_vec(), to.as_bytes().to_vec()));
    }

    /// Starts recording the SQL of every `Query` message (as sent, before
    /// any rewrite), dropping what was recorded before.
    pub fn record_queries(&self) {
        *self.shared.log.lock().unwrap() = Some(Vec::new());
    }

    /// The `Query` SQL recorded since [`record_queries`](PgProxy::record_queries).
    pub fn recorded_queries(&self) -> Vec<String> {
        self.shared.log.lock().unwrap().clone().unwrap_or_default()
    }

    /// While `true`, new connections are closed as soon as they arrive
    /// (open ones are left alone; see [`cut_all`](PgProxy::cut_all)).
    pub fn set_refuse(&self, refuse: bool) {
        self.shared.refuse.store(refuse, Ordering::SeqCst);
    }
}

/// One client connection: both directions until either side closes or the
/// proxy cuts it. Dropping the four halves closes both sockets.
async fn serve(client: TcpStream, shared: Arc<Shared>, mut cut: watch::Receiver<u64>) {
    let Ok(server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // Whether the server has answered since the client's last round trip.
    let answered = AtomicBool::new(true);
    // Biased towards the cut: once `cut_all` returns, nothing more passes.
    tokio::select! {
        biased;
        _ = cut.changed() => {}
        _ = frontend(client_read, server_write, &shared, &answered) => {}
        _ = backend(server_read, client_write, &answered) => {}
    }
}

/// Server -> client: copied through, noting that the server answered.
async fn backend(
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

/// Client -> server: framed, counted, and cut at a commit when asked.
async fn frontend(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    answered: &AtomicBool,
) -> std::io::Result<()> {
    let mut framing = Framing::Startup;
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
        // Whole messages go on in one write, up to a cut point.
        let mut end = 0;
        let mut out = Vec::with_capacity(buf.len());
        while let Some(message) = framing.next(&buf[end..]) {
            let raw = &buf[end..end + message.len];
            end += message.len;
            let Message::Typed(kind, body) = message.kind else {
                out.extend_from_slice(raw);
                continue;
            };
            let cut = CutOnCommit::from_u8(shared.cut_on_commit.load(Ordering::SeqCst));
            if cut != CutOnCommit::Off && carries_commit(kind, body) {
                if cut == CutOnCommit::AfterForwarding {
                    count(shared, kind, answered);
                    out.extend_from_slice(raw);
                }
                to.write_all(&out).await?;
                to.flush().await?;
                return Ok(());
            }
            count(shared, kind, answered);
            if kind == b'Q' {
                shared.record(body);
            }
            // A `Query` is its SQL; a `Parse`, a name, its SQL and types:
            // either way the SQL is in the body, and re-framed after.
            match matches!(kind, b'Q' | b'P')
                .then(|| shared.rewritten(body))
                .flatten()
            {
                Some(body) => out.extend(typed(kind, &body)),
                None => out.extend_from_slice(raw),
            }
        }
        if framing == Framing::Opaque {
            // TLS started: everything from here on is opaque bytes.
            out.extend_from_slice(&buf[end..]);
            end = buf.len();
        }
        to.write_all(&out).await?;
        buf.drain(..end);
    }
}

impl Shared {
    /// Records a `Query` body's SQL, while recording.
    fn record(&self, body: &[u8]) {
        if let Some(log) = self.log.lock().unwrap().as_mut() {
            let sql = body.strip_suffix(b"\0").unwrap_or(body);
            log.push(String::from_utf8_lossy(sql).into_owned());
        }
    }

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

/// Counts a client message: a `Query` or `Sync` is a round trip unless it
/// follows another that the server has not answered yet.
fn count(shared: &Shared, kind: u8, answered: &AtomicBool) {
    match kind {
        b'Q' => shared.queries.fetch_add(1, Ordering::SeqCst),
        b'S' => shared.syncs.fetch_add(1, Ordering::SeqCst),
        _ => return,
    };
    if answered.swap(false, Ordering::SeqCst) {
        shared.round_trips.fetch_add(1, Ordering::SeqCst);
    }
}

/// Where the client is in the frontend protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Untyped messages until the `StartupMessage`.
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
        // Parse: statement name, NUL, the SQL, NUL, parameter types.
        b'P' => body.splitn(3, |&b| b == 0).nth(1).unwrap_or_default(),
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
    fn finds_commit_as_a_word_only() {
        assert!(carries_commit(b'Q', b"COMMIT\0"));
        assert!(carries_commit(b'Q', b"UPDATE t SET a = 1; commit\0"));
        assert!(carries_commit(b'P', b"s1\0COMMIT\0\0\0"));
        assert!(!carries_commit(b'Q', b"INSERT INTO commits VALUES (1)\0"));
        assert!(!carries_commit(b'B', b"COMMIT"));
    }
}
