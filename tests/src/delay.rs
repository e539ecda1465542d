//! A TCP proxy on loopback that holds every chunk of bytes, each way, for
//! half a round-trip time before passing it on: a database (or Redis)
//! across a network, for the throughput benchmark, on a kernel without
//! `netem` (this machine's has no `sch_netem`).
//!
//! The delay is pipelined, as on a wire: chunks sent back to back arrive
//! back to back, one delay later, so it adds latency without capping
//! throughput. One thread serves every connection of a proxy: it waits on
//! `epoll` (mio) for input and for a `timerfd` armed at the next chunk's
//! time to leave, so chunks due together share a wake-up and the delay
//! keeps to tens of microseconds (tokio's timer, and `epoll_wait`'s own
//! timeout, round to the millisecond).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

/// The most one read takes in.
const CHUNK: usize = 64 * 1024;
/// Bytes a lane holds before it stops reading (as a full window stops a
/// sender); it reads again once half of them have left.
const CAP: usize = 1024 * 1024;
/// Chunks due within this of the earliest leave with it: one wake-up for
/// several, at a cost below the delay's own precision.
const TOGETHER: Duration = Duration::from_micros(10);

const LISTENER: Token = Token(0);
const TIMER: Token = Token(1);
const STOP: Token = Token(2);
/// Connection `i`'s client side is token `FIRST + 2i`, its server side
/// `FIRST + 2i + 1`.
const FIRST: usize = 3;

/// A listening delay proxy in front of one upstream; stops, and closes its
/// connections, when dropped.
pub struct Delay {
    addr: SocketAddr,
    stop: Waker,
    thread: Option<JoinHandle<()>>,
}

impl Delay {
    /// Listens on an ephemeral loopback port; each connection accepted
    /// opens one to `upstream`, and every chunk crossing it either way
    /// waits `rtt / 2`.
    pub fn start(upstream: SocketAddr, rtt: Duration) -> io::Result<Delay> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let mut listener = TcpListener::from_std(listener);
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let stop = Waker::new(poll.registry(), STOP)?;
        let timer = Timer::new()?;
        poll.registry().register(
            &mut SourceFd(&timer.fd.as_raw_fd()),
            TIMER,
            Interest::READABLE,
        )?;
        let mut relay = Relay {
            poll,
            listener,
            timer,
            upstream,
            one_way: rtt / 2,
            connections: Vec::new(),
        };
        let thread = thread::Builder::new().name("delay".into()).spawn(move || {
            if let Err(error) = relay.run() {
                tracing::warn!(%error, "delay proxy stopped");
            }
        })?;
        Ok(Delay {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        let _ = self.stop.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A `timerfd`: readable once the time it was armed for has come.
struct Timer {
    fd: OwnedFd,
}

impl Timer {
    fn new() -> io::Result<Timer> {
        // SAFETY: no pointers; a valid fd or -1 comes back.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd that nothing else owns.
        Ok(Timer {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Arms the timer `after` from now (at least 1 ns: zero disarms).
    fn arm(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: a valid fd and itimerspec; the old value is not asked for.
        let armed =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if armed < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Clears a firing (the count it reads is not needed).
    fn clear(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into an 8-byte buffer.
        unsafe {
            libc::read(self.fd.as_raw_fd(), count.as_mut_ptr().cast(), count.len());
        }
    }
}

/// One direction of a connection: chunks read from one side, each waiting
/// for its time to leave to the other.
#[derive(Default)]
struct Lane {
    queue: VecDeque<(Instant, Vec<u8>)>,
    /// How much of the front chunk has been written already.
    written: usize,
    /// The reading side has ended: once the queue drains, half-close.
    ended: bool,
    /// Half-closed.
    closed: bool,
    /// The receiving socket would block: wait for it to be writable.
    blocked: bool,
    /// Bytes in `queue`.
    bytes: usize,
    /// Stopped reading at `CAP`: the readable edge it left is not seen
    /// again, so the lane reads on its own once it drains.
    paused: bool,
}

struct Connection {
    /// `[client, server]`.
    sides: [TcpStream; 2],
    /// `lanes[0]`: client to server; `lanes[1]`: server to client.
    lanes: [Lane; 2],
}

struct Relay {
    poll: Poll,
    listener: TcpListener,
    timer: Timer,
    upstream: SocketAddr,
    one_way: Duration,
    /// A slot per connection ever accepted (`None` once it is gone), so
    /// that tokens stay stable.
    connections: Vec<Option<Connection>>,
}

impl Relay {
    fn run(&mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(256);
        let mut buffer = vec![0; CHUNK];
        loop {
            match self.poll.poll(&mut events, None) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
            for event in events.iter() {
                match event.token() {
                    STOP => return Ok(()),
                    LISTENER => self.accept(),
                    TIMER => self.timer.clear(),
                    Token(token) => {
                        let (index, side) = ((token - FIRST) / 2, (token - FIRST) % 2);
                        if event.is_writable()
                            && let Some(Some(connection)) = self.connections.get_mut(index)
                        {
                            // The lane that writes to this side.
                            connection.lanes[1 - side].blocked = false;
                        }
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.read(index, side, &mut buffer);
                        }
                    }
                }
            }
            for (index, side) in self.flush_all() {
                self.read(index, side, &mut buffer);
            }
            let next = self
                .connections
                .iter()
                .flatten()
                .flat_map(|connection| &connection.lanes)
                .filter(|lane| !lane.blocked)
                .filter_map(|lane| lane.queue.front().map(|(due, _)| *due))
                .min();
            if let Some(due) = next {
                self.timer
                    .arm(due.saturating_duration_since(Instant::now()))?;
            }
        }
    }

    /// Accepts every waiting client. A client whose upstream connection
    /// fails is dropped alone (it sees its connection end); an accept
    /// error other than "would block" is logged, and the next client's
    /// arrival tries again.
    fn accept(&mut self) {
        loop {
            let client = match self.listener.accept() {
                Ok((client, _)) => client,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    tracing::warn!(%error, "delay proxy: accept failed");
                    return;
                }
            };
            let index = self.connections.len();
            match self.connect(client, index) {
                Ok(connection) => self.connections.push(Some(connection)),
                Err(error) => tracing::warn!(%error, "delay proxy: cannot relay a client"),
            }
        }
    }

    /// Opens `client`'s upstream connection (blocking: the upstream is on
    /// loopback) and registers both sides under `index`'s tokens.
    fn connect(&self, client: TcpStream, index: usize) -> io::Result<Connection> {
        let server = std::net::TcpStream::connect(self.upstream)?;
        server.set_nonblocking(true)?;
        let mut sides = [client, TcpStream::from_std(server)];
        for (side, stream) in sides.iter_mut().enumerate() {
            stream.set_nodelay(true)?;
            self.poll.registry().register(
                stream,
                Token(FIRST + 2 * index + side),
                Interest::READABLE | Interest::WRITABLE,
            )?;
        }
        Ok(Connection {
            sides,
            lanes: Default::default(),
        })
    }

    /// Reads all that side `side` of connection `index` has, into the lane
    /// leaving from it (edge-triggered: until it would block), or until
    /// the lane holds `CAP` bytes.
    fn read(&mut self, index: usize, side: usize, buffer: &mut [u8]) {
        let one_way = self.one_way;
        let Some(Some(connection)) = self.connections.get_mut(index) else {
            return;
        };
        let lane = &mut connection.lanes[side];
        if lane.ended {
            return;
        }
        lane.paused = false;
        loop {
            if lane.bytes >= CAP {
                lane.paused = true;
                return;
            }
            match connection.sides[side].read(buffer) {
                Ok(0) => {
                    lane.ended = true;
                    return;
                }
                Ok(n) => {
                    lane.bytes += n;
                    lane.queue
                        .push_back((Instant::now() + one_way, buffer[..n].to_vec()));
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    // Reset: the connection is over both ways.
                    self.close(index);
                    return;
                }
            }
        }
    }

    /// Writes every chunk that is due (or nearly), on every connection, as
    /// far as the sockets take them; closes connections done both ways.
    /// Returns the paused lanes that have drained enough to read again, as
    /// `(connection, side read from)`.
    fn flush_all(&mut self) -> Vec<(usize, usize)> {
        let until = Instant::now() + TOGETHER;
        let mut resume = Vec::new();
        for index in 0..self.connections.len() {
            let Some(Some(connection)) = self.connections.get_mut(index) else {
                continue;
            };
            let mut failed = false;
            for from in 0..2 {
                let lane = &mut connection.lanes[from];
                let to = &mut connection.sides[1 - from];
                while let Some((due, chunk)) = lane.queue.front().filter(|_| !lane.blocked) {
                    if *due > until {
                        break;
                    }
                    match to.write(&chunk[lane.written..]) {
                        // A socket that takes nothing will take nothing more.
                        Ok(0) => {
                            failed = true;
                            break;
                        }
                        Ok(n) if lane.written + n == chunk.len() => {
                            lane.bytes -= chunk.len();
                            lane.queue.pop_front();
                            lane.written = 0;
                        }
                        Ok(n) => lane.written += n,
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                            lane.blocked = true;
                            break;
                        }
                        Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => {
                            failed = true;
                            break;
                        }
                    }
                }
                if lane.ended && lane.queue.is_empty() && !lane.closed {
                    let _ = to.shutdown(Shutdown::Write);
                    lane.closed = true;
                }
                if lane.paused && lane.bytes < CAP / 2 {
                    resume.push((index, from));
                }
            }
            let done = connection.lanes.iter().all(|lane| lane.closed);
            if failed || done {
                self.close(index);
            }
        }
        resume
    }

    fn close(&mut self, index: usize) {
        if let Some(mut connection) = self.connections[index].take() {
            for side in &mut connection.sides {
                let _ = self.poll.registry().deregister(side);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// An echo server on loopback: every connection gets back what it sends.
    fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                thread::spawn(move || {
                    let mut back = stream.try_clone().unwrap();
                    io::copy(&mut stream, &mut back).ok();
                });
            }
        });
        addr
    }

    fn read_exactly(stream: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut got = vec![0; n];
        stream.read_exact(&mut got).unwrap();
        got
    }

    /// A client of the proxy at `addr`, each write sent at once.
    fn client(addr: SocketAddr) -> TcpStream {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
    }

    #[test]
    fn a_round_trip_takes_at_least_the_delay() {
        let rtt = Duration::from_millis(20);
        let delay = Delay::start(echo(), rtt).unwrap();
        let mut stream = client(delay.addr());
        for _ in 0..3 {
            let started = Instant::now();
            stream.write_all(b"ping").unwrap();
            assert_eq!(read_exactly(&mut stream, 4), b"ping");
            assert!(started.elapsed() >= rtt, "{:?}", started.elapsed());
        }
    }

    #[test]
    fn chunks_back_to_back_share_one_delay_and_keep_their_order() {
        let rtt = Duration::from_millis(40);
        let delay = Delay::start(echo(), rtt).unwrap();
        let mut stream = client(delay.addr());
        let messages = 50;
        let started = Instant::now();
        let mut sent = Vec::new();
        for i in 0..messages {
            let message = format!("message {i:04};");
            stream.write_all(message.as_bytes()).unwrap();
            sent.extend_from_slice(message.as_bytes());
        }
        assert_eq!(read_exactly(&mut stream, sent.len()), sent);
        let elapsed = started.elapsed();
        // One at a time, they would take `messages` round trips (2 s).
        assert!(
            elapsed >= rtt && elapsed < rtt * (messages / 5),
            "{elapsed:?}"
        );
    }

    #[test]
    fn a_large_payload_crosses_intact_both_ways() {
        let delay = Delay::start(echo(), Duration::from_millis(2)).unwrap();
        let mut stream = client(delay.addr());
        let payload: Vec<u8> = (0..2_000_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let mut stream = stream.try_clone().unwrap();
            let payload = payload.clone();
            thread::spawn(move || stream.write_all(&payload).unwrap())
        };
        assert_eq!(read_exactly(&mut stream, payload.len()), payload);
        writer.join().unwrap();
    }

    #[test]
    fn connections_at_once_each_get_their_own_bytes() {
        let rtt = Duration::from_millis(4);
        let delay = Delay::start(echo(), rtt).unwrap();
        let addr = delay.addr();
        let clients: Vec<_> = (0..16)
            .map(|n| {
                thread::spawn(move || {
                    let mut stream = client(addr);
                    for round in 0..10 {
                        let message = format!("client {n:02} round {round}");
                        let started = Instant::now();
                        stream.write_all(message.as_bytes()).unwrap();
                        assert_eq!(read_exactly(&mut stream, message.len()), message.as_bytes());
                        assert!(started.elapsed() >= rtt);
                    }
                })
            })
            .collect();
        for client in clients {
            client.join().unwrap();
        }
    }

    #[test]
    fn a_receiver_that_does_not_read_holds_the_sender_back() {
        // An upstream that accepts and never reads.
        let sink = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = sink.local_addr().unwrap();
        let held = thread::spawn(move || sink.accept().unwrap());
        let delay = Delay::start(upstream, Duration::from_millis(2)).unwrap();
        let mut stream = client(delay.addr());
        stream
            .set_write_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        // Far more than the socket buffers and the proxy's cap hold
        // together: without back-pressure the proxy would take it all.
        let block = vec![7u8; 1024 * 1024];
        let mut sent = 0;
        let stalled = (0..64).any(|_| match stream.write(&block) {
            Ok(n) => {
                sent += n;
                false
            }
            Err(error) => matches!(
                error.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        });
        assert!(stalled, "all {sent} bytes taken");
        drop(held);
    }

    #[test]
    fn dropping_the_proxy_ends_its_connections() {
        let delay = Delay::start(echo(), Duration::from_millis(2)).unwrap();
        let mut stream = client(delay.addr());
        stream.write_all(b"x").unwrap();
        assert_eq!(read_exactly(&mut stream, 1), b"x");
        drop(delay);
        let mut rest = Vec::new();
        // Ends (EOF or reset) instead of hanging.
        let _ = stream.read_to_end(&mut rest);
        assert!(rest.is_empty());
    }
}
