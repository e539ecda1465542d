//! A TCP proxy on loopback that holds every chunk of bytes, each way, for
//! half a round-trip time before passing it on: a database (or Redis)
//! across a network, for the throughput benchmark, on a kernel without
//! `netem` (this machine's has no `sch_netem`).
//!
//! The delay is pipelined, as on a wire: chunks sent back to back arrive
//! back to back, one delay later, so it adds latency without capping
//! throughput. Each connection has two threads, one per direction, which
//! stamp each chunk with the instant it may leave and send it then.
//! Threads rather than tokio tasks because tokio's timer rounds up to the
//! millisecond; `ppoll` with the thread's timer slack at 1 ns keeps a
//! 250 µs hop within tens of microseconds. The cost is two wake-ups per
//! chunk, no spinning.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Stack of each pump thread: it holds its buffer on the heap and little else.
const STACK: usize = 128 * 1024;
/// The most one read takes in.
const CHUNK: usize = 64 * 1024;

/// A listening delay proxy in front of one upstream; stops, and drops its
/// connections, when dropped.
pub struct Delay {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl Delay {
    /// Listens on an ephemeral loopback port; each connection accepted
    /// opens one to `upstream`, and every chunk crossing it either way
    /// waits `rtt / 2`.
    pub fn start(upstream: SocketAddr, rtt: Duration) -> io::Result<Delay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let one_way = rtt / 2;
        let accept = {
            let stopping = stopping.clone();
            let streams = streams.clone();
            thread::Builder::new()
                .name("delay-accept".into())
                .spawn(move || {
                    for client in listener.incoming() {
                        if stopping.load(Ordering::Acquire) {
                            break;
                        }
                        // A failed accept or upstream connect drops this
                        // client alone; the caller sees its connection end.
                        let Ok(client) = client else { continue };
                        let Ok(server) = TcpStream::connect(upstream) else {
                            continue;
                        };
                        if let Err(error) = join(client, server, one_way, &streams) {
                            tracing::warn!(%error, "delay proxy: cannot relay a connection");
                        }
                    }
                })?
        };
        Ok(Delay {
            addr,
            stopping,
            streams,
            accept: Some(accept),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // Wakes the accept loop, which then sees `stopping`.
        let _ = TcpStream::connect(self.addr);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        // Ends every pump: their reads return and their writes fail.
        for stream in self.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// Relays `client` and `server` both ways, each chunk held `one_way`.
fn join(
    client: TcpStream,
    server: TcpStream,
    one_way: Duration,
    streams: &Mutex<Vec<TcpStream>>,
) -> io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    streams
        .lock()
        .unwrap()
        .extend([client.try_clone()?, server.try_clone()?]);
    pump(client.try_clone()?, server.try_clone()?, one_way)?;
    pump(server, client, one_way)
}

/// Moves bytes from `from` to `to` on a thread of its own, each chunk
/// leaving `delay` after it was read; on end of input, half-closes `to`.
/// One thread waits for both events, input and the next chunk's time to
/// leave (`ppoll`, whose timeout is in nanoseconds), so a chunk costs two
/// wake-ups and no hand-over between threads.
fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) -> io::Result<()> {
    thread::Builder::new()
        .name("delay-pump".into())
        .stack_size(STACK)
        .spawn(move || {
            precise_sleeps();
            let mut buffer = vec![0; CHUNK];
            let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
            let mut open = true;
            loop {
                let now = Instant::now();
                while queue.front().is_some_and(|(due, _)| *due <= now) {
                    let (_, chunk) = queue.pop_front().expect("a chunk");
                    // Blocking: a receiver that does not read holds us back,
                    // as a full window does on a wire.
                    if to.write_all(&chunk).is_err() {
                        return;
                    }
                }
                let next = queue
                    .front()
                    .map(|(due, _)| due.saturating_duration_since(Instant::now()));
                if !open {
                    match next {
                        Some(wait) => thread::sleep(wait),
                        None => break,
                    }
                    continue;
                }
                if readable(&from, next) {
                    // Readable: this read returns what has arrived at once.
                    match from.read(&mut buffer) {
                        Ok(0) | Err(_) => open = false,
                        Ok(n) => queue.push_back((Instant::now() + delay, buffer[..n].to_vec())),
                    }
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        })?;
    Ok(())
}

/// Waits until `stream` has input (or its end), or `timeout` passes
/// (`None`: no limit); whether it has.
fn readable(stream: &TcpStream, timeout: Option<Duration>) -> bool {
    let mut poll = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timespec = timeout.map(|wait| libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(wait.subsec_nanos() as i32),
    });
    let limit = timespec.as_ref().map_or(std::ptr::null(), |timespec| {
        timespec as *const libc::timespec
    });
    // SAFETY: one valid pollfd, a timespec that outlives the call (or null
    // for none), and no signal mask.
    let ready = unsafe { libc::ppoll(&mut poll, 1, limit, std::ptr::null()) };
    // Errors (EINTR) count as not ready: the loop asks again.
    ready > 0 && poll.revents != 0
}

/// Sets this thread's timer slack to 1 ns (Linux lets a sleep overrun by
/// 50 µs by default, a fifth of a 0.5 ms round trip).
fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and affects only
    // the calling thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_round_trip_takes_at_least_the_delay() {
        let rtt = Duration::from_millis(20);
        let delay = Delay::start(echo(), rtt).unwrap();
        let mut stream = TcpStream::connect(delay.addr()).unwrap();
        stream.set_nodelay(true).unwrap();
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
        let mut stream = TcpStream::connect(delay.addr()).unwrap();
        stream.set_nodelay(true).unwrap();
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
        let mut stream = TcpStream::connect(delay.addr()).unwrap();
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
    fn dropping_the_proxy_ends_its_connections() {
        let delay = Delay::start(echo(), Duration::from_millis(2)).unwrap();
        let mut stream = TcpStream::connect(delay.addr()).unwrap();
        stream.write_all(b"x").unwrap();
        assert_eq!(read_exactly(&mut stream, 1), b"x");
        drop(delay);
        let mut rest = Vec::new();
        // Ends (EOF or reset) instead of hanging.
        let _ = stream.read_to_end(&mut rest);
        assert!(rest.is_empty());
    }
}
