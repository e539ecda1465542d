//! A TCP proxy that can leave a database session half-open: it closes the
//! service's side of a connection and keeps the server's side open and
//! silent, as a NAT or load balancer that dropped its state does. The
//! server then sees an idle session (holding whatever it held) and the
//! service a dead socket.
//!
//! Cuts are armed ([`Cut`]) and happen on the wire; [`HalfOpenProxy::cuts`]
//! counts those that did.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::proxy::contains_word;

/// When the next cut happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// No cut armed.
    Off,
    /// Every open connection, now.
    Now,
    /// The connection whose service sends `COMMIT`, before it reaches the
    /// server.
    BeforeCommit,
    /// The connection of the server's next answer, before it reaches the
    /// service: the server has run the statement, the service never hears.
    NextAnswer,
}

/// The proxy on `127.0.0.1:<ephemeral>`, stopped when dropped. Sockets kept
/// open towards the server stay open until then.
pub struct HalfOpenProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    armed: watch::Sender<Cut>,
    cuts: AtomicUsize,
    /// The server's side of every cut connection, kept open and unread.
    kept: Mutex<Vec<TcpStream>>,
}

impl HalfOpenProxy {
    /// Listens and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> HalfOpenProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            armed: watch::channel(Cut::Off).0,
            cuts: AtomicUsize::new(0),
            kept: Mutex::new(Vec::new()),
        });
        let accepting = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let shared = accepting.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        forward(client, server, shared).await;
                    }
                });
            }
        });
        HalfOpenProxy { addr, shared, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Arms the next cut (one connection's, or all for [`Cut::Now`]).
    pub fn arm(&self, cut: Cut) {
        self.shared.armed.send_replace(cut);
    }

    /// How many connections were cut.
    pub fn cuts(&self) -> usize {
        self.shared.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for HalfOpenProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Shared {
    /// Keeps the server's side open and silent; the service's side is
    /// dropped by the caller.
    fn cut(&self, server: TcpStream) {
        self.kept.lock().unwrap().push(server);
        self.cuts.fetch_add(1, Ordering::SeqCst);
    }

    /// Takes the armed one-connection cut `cut`, if it is the armed one.
    fn take(&self, cut: Cut) -> bool {
        self.armed.send_if_modified(|armed| {
            let hit = *armed == cut;
            if hit {
                *armed = Cut::Off;
            }
            hit
        })
    }
}

async fn forward(mut client: TcpStream, mut server: TcpStream, shared: Arc<Shared>) {
    let mut armed = shared.armed.subscribe();
    let (mut up, mut down) = (vec![0; 64 * 1024], vec![0; 64 * 1024]);
    loop {
        tokio::select! {
            read = client.read(&mut up) => {
                let Ok(n @ 1..) = read else { return };
                if contains_word(&up[..n], b"COMMIT") && shared.take(Cut::BeforeCommit) {
                    return shared.cut(server);
                }
                if server.write_all(&up[..n]).await.is_err() {
                    return;
                }
            }
            read = server.read(&mut down) => {
                let Ok(n @ 1..) = read else { return };
                if shared.take(Cut::NextAnswer) {
                    return shared.cut(server);
                }
                if client.write_all(&down[..n]).await.is_err() {
                    return;
                }
            }
            changed = armed.changed() => {
                if changed.is_err() {
                    return;
                }
                if *armed.borrow_and_update() == Cut::Now {
                    return shared.cut(server);
                }
            }
        }
    }
}
