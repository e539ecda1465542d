//! What the PostgreSQL and MySQL test proxies (`pg_proxy.rs`,
//! `mysql_proxy.rs`) share: [`Proxy`], the loopback listener with its
//! counters and controls (round trips, connections, cuts, refusals, the
//! log of commands), which each protocol's proxy derefs to, so a suite
//! drives either through it. The framing, and so what a command, a round
//! trip, a commit and a session id are on the wire, is each protocol's own.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// When a proxy's `set_cut_on_commit` drops a connection (each proxy says
/// which of its client's messages carry a commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutOnCommit {
    /// Never (the default).
    Off,
    /// Drop the connection instead of forwarding a message that contains
    /// `COMMIT`: the server never sees it, so the transaction rolls back
    /// when the server notices the connection is gone.
    BeforeForwarding,
    /// Forward a message that contains `COMMIT`, read the server's whole
    /// answer without passing it on, then drop the connection: whatever it
    /// committed has committed before the client sees the connection go,
    /// and the client cannot know.
    AfterForwarding,
}

impl CutOnCommit {
    /// The mode kept in an `AtomicU8`.
    fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::BeforeForwarding,
            2 => Self::AfterForwarding,
            _ => Self::Off,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            Self::Off => 0,
            Self::BeforeForwarding => 1,
            Self::AfterForwarding => 2,
        }
    }
}

/// The connections a proxy dropped, each counted as it happened on the
/// wire (not when a cut was asked for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cuts {
    /// Open connections that [`Proxy::cut_all`] dropped.
    pub all: u64,
    /// Connections dropped instead of forwarding a commit.
    pub before_commit: u64,
    /// Connections dropped after forwarding a commit, its answer withheld.
    pub after_commit: u64,
}

impl Cuts {
    /// The cuts at a commit of `mode`.
    pub fn at_commit(&self, mode: CutOnCommit) -> u64 {
        match mode {
            CutOnCommit::Off => 0,
            CutOnCommit::BeforeForwarding => self.before_commit,
            CutOnCommit::AfterForwarding => self.after_commit,
        }
    }
}

/// How long [`CutOnCommit::AfterForwarding`] waits for the end of the
/// server's answer before it drops the connection anyway.
const WITHHOLD_LIMIT: Duration = Duration::from_secs(10);

/// A proxy on `127.0.0.1:<ephemeral>` in front of one server, as far as
/// every protocol's proxy is the same: stopped, with all its connections,
/// when dropped.
pub struct Proxy {
    addr: SocketAddr,
    /// Bumped by `cut_all`; a connection opened under an older generation
    /// is dropped as soon as it sees a newer one.
    generation: Arc<watch::Sender<u64>>,
    accept: tokio::task::JoinHandle<()>,
    wire: Arc<Wire>,
}

/// The counters and controls a protocol's `serve` reads and writes.
pub(crate) struct Wire {
    pub(crate) upstream: SocketAddr,
    round_trips: AtomicU64,
    commands: AtomicU64,
    /// Connections open now.
    open: AtomicU64,
    /// Connections accepted (and not refused) since the last reset.
    accepted: AtomicU64,
    refuse: AtomicBool,
    /// A [`CutOnCommit`].
    cut_on_commit: AtomicU8,
    cuts: watch::Sender<Cuts>,
    /// The server session ids of the connections cut at a commit, in order
    /// (0 where the proxy did not see it).
    cut_sessions: Mutex<Vec<u32>>,
    /// The commands of each round trip, while recording.
    log: Mutex<Option<Log>>,
}

/// One connection's state, shared by its two directions.
pub(crate) struct Conn {
    /// Whether the server has answered since the client's last round trip.
    pub(crate) answered: AtomicBool,
    /// The server's id of the session, once the server named it.
    pub(crate) session: AtomicU32,
    /// Set before a commit is forwarded under
    /// [`CutOnCommit::AfterForwarding`]: from then on the server's bytes are
    /// its answer, read to the end and never forwarded.
    pub(crate) withhold: AtomicBool,
}

impl Default for Conn {
    fn default() -> Self {
        Conn {
            // The server speaks first (greeting, authentication), so the
            // client's first command counts.
            answered: AtomicBool::new(true),
            session: AtomicU32::new(0),
            withhold: AtomicBool::new(false),
        }
    }
}

/// How the client's half of a connection ended.
pub(crate) enum Ended {
    /// The client closed it, or the proxy cut it before a commit.
    Closed,
    /// A commit was forwarded; its answer is to be withheld.
    Withholding,
}

impl Proxy {
    /// Binds, and spawns `serve(client, wire)` for each connection accepted
    /// (closing it at once while refusing). `serve` is called at the accept
    /// itself, so what it counts there is counted before the client's
    /// connect returns; the connection is dropped when `serve` returns or
    /// [`cut_all`](Self::cut_all) is called.
    pub(crate) async fn start<S, F>(upstream: SocketAddr, serve: S) -> Proxy
    where
        S: Fn(TcpStream, Arc<Wire>) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy on loopback");
        let addr = listener.local_addr().expect("proxy address");
        let generation = Arc::new(watch::Sender::new(0));
        let wire = Arc::new(Wire {
            upstream,
            round_trips: AtomicU64::new(0),
            commands: AtomicU64::new(0),
            open: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            cut_on_commit: AtomicU8::new(CutOnCommit::Off.as_u8()),
            cuts: watch::Sender::new(Cuts::default()),
            cut_sessions: Mutex::new(Vec::new()),
            log: Mutex::new(None),
        });
        let accept = tokio::spawn({
            let (generation, wire) = (Arc::clone(&generation), Arc::clone(&wire));
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        // Out of file descriptors, say: back off rather
                        // than spin.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    // Subscribed at accept, before the refusal is read: a
                    // `cut_all` then `set_refuse` landing between the two
                    // still reaches this link.
                    let mut cut = generation.subscribe();
                    if wire.refuse.load(Ordering::SeqCst) {
                        // Closed as it arrives.
                        continue;
                    }
                    wire.accepted.fetch_add(1, Ordering::SeqCst);
                    wire.open.fetch_add(1, Ordering::SeqCst);
                    let open = Open(Arc::clone(&wire));
                    let cutting = {
                        let wire = Arc::clone(&wire);
                        // Counted before the connection is dropped, so
                        // before its client can notice.
                        async move {
                            let _ = cut.changed().await;
                            wire.cuts.send_modify(|cuts| cuts.all += 1);
                        }
                    };
                    let serving = serve(client, Arc::clone(&wire));
                    tokio::spawn(async move {
                        // Biased towards the cut: once `cut_all` returns,
                        // nothing more passes.
                        tokio::select! {
                            biased;
                            () = cutting => {}
                            () = serving => {}
                        }
                        drop(open);
                    });
                }
            }
        });
        Proxy {
            addr,
            generation,
            accept,
            wire,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Round trips since the start or the last [`reset`](Self::reset): the
    /// commands the server answers, those sent before it answered the one
    /// before them counted with it.
    pub fn round_trips(&self) -> u64 {
        self.wire.round_trips.load(Ordering::SeqCst)
    }

    /// Commands (messages) the client sent since the last reset, answered
    /// or not.
    pub fn commands(&self) -> u64 {
        self.wire.commands.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn connections(&self) -> u64 {
        self.wire.open.load(Ordering::SeqCst)
    }

    /// Connections accepted since the last reset: a pool that reconnects
    /// during a request shows here, not in the round trips (its login is
    /// no command).
    pub fn accepted(&self) -> u64 {
        self.wire.accepted.load(Ordering::SeqCst)
    }

    /// Zeroes the counters (round trips, commands, accepted connections);
    /// the cuts are kept.
    pub fn reset(&self) {
        self.wire.round_trips.store(0, Ordering::SeqCst);
        self.wire.commands.store(0, Ordering::SeqCst);
        self.wire.accepted.store(0, Ordering::SeqCst);
    }

    /// Starts recording every command, grouped by round trip, dropping
    /// what was recorded before.
    pub fn record(&self) {
        *self.wire.log.lock().unwrap() = Some(Log::default());
    }

    /// The round trips recorded since [`record`](Self::record), each as its
    /// commands, as the protocol's proxy describes them (`QUERY <sql>`
    /// on both, the ping as the protocol sends it).
    pub fn recorded(&self) -> Vec<Vec<String>> {
        let log = self.wire.log.lock().unwrap();
        log.as_ref()
            .map(|log| log.round_trips.clone())
            .unwrap_or_default()
    }

    /// Drops every open connection now, in both directions; nothing more
    /// is forwarded on them. New connections are accepted as usual.
    pub fn cut_all(&self) {
        self.generation.send_modify(|generation| *generation += 1);
    }

    /// Drops a connection when a client message that carries `COMMIT`
    /// passes, before forwarding it or after the server answered it. Stays
    /// in force, for every connection, until set to [`CutOnCommit::Off`].
    pub fn set_cut_on_commit(&self, mode: CutOnCommit) {
        self.wire
            .cut_on_commit
            .store(mode.as_u8(), Ordering::SeqCst);
    }

    /// While `true`, new connections are closed as soon as they arrive
    /// (open ones are left alone; see [`cut_all`](Self::cut_all)).
    pub fn set_refuse(&self, refuse: bool) {
        self.wire.refuse.store(refuse, Ordering::SeqCst);
    }

    /// The connections dropped so far.
    pub fn cuts(&self) -> Cuts {
        *self.wire.cuts.borrow()
    }

    /// [`cuts`](Self::cuts), to wait on.
    pub fn watch_cuts(&self) -> watch::Receiver<Cuts> {
        self.wire.cuts.subscribe()
    }

    /// The server's ids (PostgreSQL's backend pid, MySQL's
    /// `CONNECTION_ID()`) of the sessions cut at a commit so far, in order;
    /// 0 for one the proxy did not see the server name.
    pub fn cut_sessions(&self) -> Vec<u32> {
        self.wire.cut_sessions.lock().unwrap().clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
    }
}

/// Counts a connection as open until it ends, however it ends.
struct Open(Arc<Wire>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Wire {
    /// Whether (and how) to cut the connection at a client message that
    /// carries a commit (`carries_commit`), while a cut is set; a cut is
    /// counted here, with the session it cuts.
    pub(crate) fn cut_at(&self, carries_commit: bool, conn: &Conn) -> CutOnCommit {
        let mode = CutOnCommit::from_u8(self.cut_on_commit.load(Ordering::SeqCst));
        if !carries_commit || mode == CutOnCommit::Off {
            return CutOnCommit::Off;
        }
        let session = conn.session.load(Ordering::SeqCst);
        self.cut_sessions.lock().unwrap().push(session);
        self.cuts.send_modify(|cuts| match mode {
            CutOnCommit::BeforeForwarding => cuts.before_commit += 1,
            _ => cuts.after_commit += 1,
        });
        mode
    }

    /// Counts a command: a round trip if the server answers it (`answers`)
    /// and it follows an answer (`answered`), else it rides on the round
    /// trip of the commands around it. `describe` names it in the log.
    pub(crate) fn count(
        &self,
        answered: &AtomicBool,
        answers: bool,
        describe: impl FnOnce() -> String,
    ) {
        self.commands.fetch_add(1, Ordering::SeqCst);
        // A command without an answer leaves the flag to the next one.
        let after_answer = if answers {
            answered.swap(false, Ordering::SeqCst)
        } else {
            answered.load(Ordering::SeqCst)
        };
        if after_answer && answers {
            self.round_trips.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(log) = self.log.lock().unwrap().as_mut() {
            let joins = !after_answer || log.unanswered;
            match log.round_trips.last_mut() {
                Some(round_trip) if joins => round_trip.push(describe()),
                _ => log.round_trips.push(vec![describe()]),
            }
            if after_answer {
                log.unanswered = !answers;
            }
        }
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

/// Connects to the server for `client`: both sockets split, `(client read,
/// client write, server read, server write)`; `None` if the server cannot
/// be reached (the client is then dropped).
pub(crate) async fn connect(
    client: TcpStream,
    upstream: SocketAddr,
) -> Option<(OwnedReadHalf, OwnedWriteHalf, OwnedReadHalf, OwnedWriteHalf)> {
    let server = TcpStream::connect(upstream).await.ok()?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    Some((client_read, client_write, server_read, server_write))
}

/// What a protocol's framing made of the client's bytes not yet forwarded.
pub(crate) struct Forward {
    /// What goes on to the server now.
    pub(crate) forward: Vec<u8>,
    /// How many of the bytes it used (the rest waits for more).
    pub(crate) used: usize,
    /// From here on the bytes are opaque (TLS, compression): they pass
    /// untouched.
    pub(crate) opaque: bool,
    /// The connection ends once `forward` has gone (a cut at a commit).
    pub(crate) ended: Option<Ended>,
}

/// Client -> server: each read is framed by `frame` (with the bytes left
/// from before) and what it makes of them forwarded, until the client
/// closes or `frame` ends the connection.
pub(crate) async fn client_to_server(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut frame: impl FnMut(&[u8]) -> Forward,
) -> std::io::Result<Ended> {
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 16 * 1024];
    let mut opaque = false;
    loop {
        let read = from.read(&mut chunk).await?;
        if read == 0 {
            return Ok(Ended::Closed);
        }
        if opaque {
            to.write_all(&chunk[..read]).await?;
            continue;
        }
        buf.extend_from_slice(&chunk[..read]);
        let framed = frame(&buf);
        to.write_all(&framed.forward).await?;
        if let Some(ended) = framed.ended {
            to.flush().await?;
            return Ok(ended);
        }
        opaque = framed.opaque;
        buf.drain(..framed.used);
    }
}

/// Server -> client: copied through as read, noting that the server
/// answered. `read(bytes, withholding)` sees every byte first (the
/// protocol's framing: the session's id, the end of an answer) and says
/// whether the withheld answer is complete: once a commit's answer is
/// withheld, nothing more is forwarded, and this returns when it is.
pub(crate) async fn server_to_client(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    conn: &Conn,
    mut read: impl FnMut(&[u8], bool) -> bool,
) -> std::io::Result<()> {
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let got = from.read(&mut chunk).await?;
        if got == 0 {
            return Ok(());
        }
        let withholding = conn.withhold.load(Ordering::SeqCst);
        let complete = read(&chunk[..got], withholding);
        if withholding {
            if complete {
                return Ok(());
            }
            continue;
        }
        // Before the client can see the answer and send again.
        conn.answered.store(true, Ordering::SeqCst);
        to.write_all(&chunk[..got]).await?;
    }
}

/// Runs a connection's two directions until either ends; when the client's
/// ends in [`Ended::Withholding`], the server's goes on (not forwarding)
/// until the withheld answer is complete. Then both are dropped, which
/// closes both sockets.
pub(crate) async fn relay(
    client_to_server: impl Future<Output = std::io::Result<Ended>>,
    server_to_client: impl Future<Output = std::io::Result<()>>,
) {
    tokio::pin!(server_to_client);
    let withholding = tokio::select! {
        ended = client_to_server => matches!(ended, Ok(Ended::Withholding)),
        _ = &mut server_to_client => false,
    };
    if withholding {
        // The commit went on: its answer is read to the end (so it has run
        // its course on the server).
        let _ = tokio::time::timeout(WITHHOLD_LIMIT, server_to_client).await;
    }
}

/// Whether `haystack` has `word` (any case) between non-identifier bytes.
pub(crate) fn contains_word(haystack: &[u8], word: &[u8]) -> bool {
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    haystack
        .windows(word.len())
        .enumerate()
        .any(|(at, window)| {
            window.eq_ignore_ascii_case(word)
                && (at == 0 || !is_ident(haystack[at - 1]))
                && haystack
                    .get(at + word.len())
                    .is_none_or(|&after| !is_ident(after))
        })
}

/// A TCP proxy in front of a broker: the bytes pass untouched, the
/// broker's after [`set_latency`](BrokerProxy::set_latency). Cut and
/// refuse through [`Proxy`]'s controls, which it derefs to. Each broker's
/// proxy (`NatsProxy`, `AmqpProxy`) is this one with its URL.
pub struct BrokerProxy {
    proxy: Proxy,
    latency_ms: Arc<AtomicU64>,
}

impl std::ops::Deref for BrokerProxy {
    type Target = Proxy;

    fn deref(&self) -> &Proxy {
        &self.proxy
    }
}

impl BrokerProxy {
    /// A proxy to the broker at `upstream`.
    pub async fn start(upstream: SocketAddr) -> BrokerProxy {
        let latency_ms = Arc::new(AtomicU64::new(0));
        let proxy = Proxy::start(upstream, {
            let latency_ms = Arc::clone(&latency_ms);
            move |client, wire| serve_broker(client, wire, Arc::clone(&latency_ms))
        })
        .await;
        BrokerProxy { proxy, latency_ms }
    }

    /// Holds each chunk of the broker's bytes this long before passing it
    /// on (a slow broker: every publish's acknowledgement comes late).
    pub fn set_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.latency_ms.store(ms, Ordering::SeqCst);
    }

    /// The broker unreachable: open connections dropped, new ones closed
    /// as they arrive, until [`restore`](Self::restore).
    pub fn cut(&self) {
        self.set_refuse(true);
        self.cut_all();
    }

    /// The broker reachable again.
    pub fn restore(&self) {
        self.set_refuse(false);
    }
}

/// One broker connection: both directions, until either side closes (or
/// the proxy cuts it, by dropping this future).
async fn serve_broker(client: TcpStream, wire: Arc<Wire>, latency_ms: Arc<AtomicU64>) {
    let Some((mut client_read, mut client_write, mut server_read, mut server_write)) =
        connect(client, wire.upstream).await
    else {
        return;
    };
    let upstream = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    };
    let downstream = async {
        let mut buffer = vec![0; 64 * 1024];
        loop {
            let read = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            let latency = latency_ms.load(Ordering::SeqCst);
            if latency > 0 {
                tokio::time::sleep(Duration::from_millis(latency)).await;
            }
            if client_write.write_all(&buffer[..read]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}
