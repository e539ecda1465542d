//! What the PostgreSQL and MySQL test proxies (`pg_proxy.rs`,
//! `mysql_proxy.rs`) share: the loopback listener that hands each accepted
//! connection to the proxy and can cut them all, the commit-cut modes, and
//! the search for `COMMIT` in a statement. The framing and the counting
//! are each protocol's own.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

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
    /// Forward a message that contains `COMMIT`, then drop the connection
    /// before the server's answer reaches the client: whatever it
    /// committed has committed, and the client cannot know.
    AfterForwarding,
}

impl CutOnCommit {
    /// The mode kept in an `AtomicU8`.
    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::BeforeForwarding,
            2 => Self::AfterForwarding,
            _ => Self::Off,
        }
    }

    pub(crate) fn as_u8(self) -> u8 {
        match self {
            Self::Off => 0,
            Self::BeforeForwarding => 1,
            Self::AfterForwarding => 2,
        }
    }
}

/// A listener on `127.0.0.1:<ephemeral>` whose accepted connections go to
/// the proxy's `serve`. Stopped, with all its connections, when dropped.
pub(crate) struct Listener {
    addr: SocketAddr,
    /// Bumped by `cut_all`; a connection opened under an older generation
    /// stops forwarding and closes as soon as it sees a newer one.
    generation: Arc<watch::Sender<u64>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// Binds, and spawns `serve(client, cut)` for each connection accepted:
    /// `cut` changes when [`cut_all`](Self::cut_all) is called. `serve` is
    /// called at the accept itself, so what it counts there is counted
    /// before the client's connect returns.
    pub(crate) async fn start<S, F>(serve: S) -> Listener
    where
        S: Fn(TcpStream, watch::Receiver<u64>) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy on loopback");
        let addr = listener.local_addr().expect("proxy address");
        let generation = Arc::new(watch::Sender::new(0));
        let accept = tokio::spawn({
            let generation = Arc::clone(&generation);
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        // Out of file descriptors, say: back off rather
                        // than spin.
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    };
                    // Subscribed at accept: a `cut_all` from now on reaches it.
                    tokio::spawn(serve(client, generation.subscribe()));
                }
            }
        });
        Listener {
            addr,
            generation,
            accept,
        }
    }

    /// Where clients connect.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every open connection now, in both directions; nothing more
    /// is forwarded on them. New connections are accepted as usual.
    pub(crate) fn cut_all(&self) {
        self.generation.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
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
