//! The workspace's example binaries run as real processes, as a user runs
//! them: found beside the test binary, started with a clean environment of
//! their own, and awaited until they say they listen.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long an example may take to start listening.
const STARTUP_LIMIT: Duration = Duration::from_secs(30);

/// The example `name`, next to this test binary's directory:
/// `target/<profile>/examples/<name>`. Fails loudly when it is missing.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary has a path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binaries live in target/<profile>/deps")
        .join("examples")
        .join(name);
    assert!(
        path.is_file(),
        "the example {} is missing: build the examples first with `cargo build --examples` \
         (`cargo test --workspace` builds them too)",
        path.display()
    );
    path
}

/// `command` started, its stdout read until `found` recognises a line
/// (what it returns is returned), then drained in the background so the
/// process never blocks on a full pipe. Killed when the child is dropped.
pub async fn start_until<T>(
    command: Command,
    what: &str,
    found: impl FnMut(&str) -> Option<T>,
) -> (Child, T) {
    start_logged(command, what, found, None).await
}

/// As [`start_until`], every line of stdout also kept in `log`.
pub async fn start_logged<T>(
    mut command: Command,
    what: &str,
    mut found: impl FnMut(&str) -> Option<T>,
    log: Option<Arc<Mutex<Vec<String>>>>,
) -> (Child, T) {
    let mut child = command
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|error| panic!("{what} starts: {error}"));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let keep = move |line: &str| {
        if let Some(log) = &log {
            log.lock().unwrap().push(line.to_owned());
        }
    };
    let reading = async {
        while let Some(line) = lines.next_line().await.expect("the process's output") {
            keep(&line);
            if let Some(value) = found(&line) {
                return value;
            }
        }
        panic!("{what} exited before listening");
    };
    let value = tokio::time::timeout(STARTUP_LIMIT, reading)
        .await
        .unwrap_or_else(|_| panic!("{what} listening within {STARTUP_LIMIT:?}"));
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            keep(&line);
        }
    });
    (child, value)
}

/// This test binary again, running only its ignored test `test` (a
/// server the test starts in a child process, so it can be killed), with
/// `env` set (`Some`) or kept out (`None`); once it prints
/// `LISTENING <addr>` (after whatever the test harness prints first), the
/// child and that address.
pub async fn test_server(test: &str, env: &[(&str, Option<&str>)]) -> (Child, SocketAddr) {
    let mut command = Command::new(std::env::current_exe().expect("the test binary has a path"));
    command.args([
        test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let listening = |line: &str| {
        let (_, addr) = line.split_once("LISTENING ")?;
        Some(addr.trim().parse().expect("the child's address"))
    };
    start_until(command, test, listening).await
}

/// A free port on loopback, for a process started next to listen on.
///
/// Taken below the machine's ephemeral range, so that no outgoing
/// connection takes it between this check and the child's bind (a port
/// the kernel hands out for `:0` is one any `connect` may also get), and
/// never the same twice in one process; each process starts at a place
/// of its own in the range, so a test and its child processes pick apart.
/// The check binds the port, so no listener holds it now.
pub fn free_port() -> SocketAddr {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};

    const FIRST: u32 = 20_000;
    static RANGE: OnceLock<(u32, u32)> = OnceLock::new();
    static TAKEN: AtomicU32 = AtomicU32::new(0);
    let &(start, span) = RANGE.get_or_init(|| {
        // Linux's default ephemeral range starts at 32768.
        let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
            .unwrap_or(32_768);
        assert!(
            ephemeral > FIRST + 1_000,
            "the ephemeral port range starts at {ephemeral}, leaving no ports below it from \
             {FIRST}"
        );
        let span = ephemeral - FIRST;
        (std::process::id().wrapping_mul(7_919) % span, span)
    });
    for _ in 0..span {
        let n = (start + TAKEN.fetch_add(1, Ordering::SeqCst)) % span;
        let port = u16::try_from(FIRST + n).expect("a port below the ephemeral range");
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().unwrap();
        }
    }
    panic!("no free port on loopback from {FIRST} to the ephemeral range");
}

/// The `charges` example serving on `addr`, its data in `dir`'s SQLite
/// file, once it listens. `env` sets variables (`Some`) or keeps them
/// from the test's environment out (`None`).
pub async fn charges(dir: &Path, addr: SocketAddr, env: &[(&str, Option<&str>)]) -> Child {
    charges_logged(dir, addr, env, None).await
}

/// As [`charges`], every line it prints also kept in `log`.
pub async fn charges_logged(
    dir: &Path,
    addr: SocketAddr,
    env: &[(&str, Option<&str>)],
    log: impl Into<Option<Arc<Mutex<Vec<String>>>>>,
) -> Child {
    let mut command = Command::new(binary("charges"));
    command.current_dir(dir).env("ADDR", addr.to_string()).env(
        "DATABASE_URL",
        format!("sqlite:{}", dir.join("charges.db").display()),
    );
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let listening = |line: &str| line.contains("charges API listening on").then_some(());
    start_logged(command, "the charges example", listening, log.into())
        .await
        .0
}
