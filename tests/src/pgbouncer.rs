//! A PgBouncer of the test's own in transaction mode, in front of the test
//! PostgreSQL server: its own port, directory and configuration, stopped
//! when dropped. Debian's `pgbouncer` package (`.ci/run` installs it).
//!
//! PgBouncer refuses to run as root, so it runs as the `postgres` user,
//! in a directory handed to that user.

use crate::postgres_user::{is_root, postgres_user};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long PgBouncer may take to accept connections.
const STARTUP_LIMIT: Duration = Duration::from_secs(20);

/// A running PgBouncer (`pool_mode = transaction`).
pub struct PgBouncer {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server of `upstream` (a
    /// `postgres://` URL), with `pool_size` server connections for each of
    /// its databases (any database of that server); panics loudly when it cannot (no package, no server).
    pub fn start(upstream: &str, pool_size: u32) -> PgBouncer {
        Self::start_with(upstream, pool_size, "extra_float_digits")
    }

    /// As [`start`](Self::start), with PgBouncer's
    /// `ignore_startup_parameters` as given (`""`: as its package ships it,
    /// which refuses sqlx's default `extra_float_digits`).
    pub fn start_with(upstream: &str, pool_size: u32, ignored: &str) -> PgBouncer {
        let options: sqlx::postgres::PgConnectOptions =
            upstream.parse().expect("a postgres:// URL");
        let addr = crate::examples::free_port();
        let dir = tempfile::tempdir().expect("a directory for PgBouncer");
        let config = format!(
            "[databases]\n\
             * = host={host} port={port} user={user}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {listen}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             min_pool_size = 0\n\
             reserve_pool_size = 0\n\
             max_client_conn = 1000\n\
             ignore_startup_parameters = {ignored}\n\
             server_reset_query =\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            host = options.get_host(),
            port = options.get_port(),
            user = options.get_username(),
            listen = addr.port(),
            dir = dir.path().display(),
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), config).unwrap();
        std::fs::write(
            dir.path().join("users.txt"),
            format!("\"{}\" \"\"\n", options.get_username()),
        )
        .unwrap();
        let (uid, gid) = postgres_user("PgBouncer");
        for entry in ["", "pgbouncer.ini", "users.txt"] {
            std::os::unix::fs::chown(dir.path().join(entry), Some(uid), Some(gid)).unwrap();
        }
        let child = spawn(dir.path(), uid, gid);
        let mut bouncer = PgBouncer { child, addr, dir };
        bouncer.wait_until_listening();
        bouncer
    }

    /// The URL of the test database through PgBouncer.
    pub fn url(&self, upstream: &str) -> String {
        let options: sqlx::postgres::PgConnectOptions =
            upstream.parse().expect("a postgres:// URL");
        self.database_url(upstream, options.get_database().unwrap_or("postgres"))
    }

    /// The URL of `database` (any database of the upstream server) through
    /// PgBouncer.
    pub fn database_url(&self, upstream: &str, database: &str) -> String {
        let options: sqlx::postgres::PgConnectOptions =
            upstream.parse().expect("a postgres:// URL");
        format!(
            "postgres://{}@{}/{database}?sslmode=disable",
            options.get_username(),
            self.addr,
        )
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }

    fn wait_until_listening(&mut self) {
        let deadline = Instant::now() + STARTUP_LIMIT;
        loop {
            if std::net::TcpStream::connect(self.addr).is_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "pgbouncer exited ({status}) before listening:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer listening on {} within {STARTUP_LIMIT:?}:\n{}",
                self.addr,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(dir: &Path, uid: u32, gid: u32) -> Child {
    use std::os::unix::process::CommandExt as _;
    let mut command = Command::new("pgbouncer");
    command
        .arg(dir.join("pgbouncer.ini"))
        .stdin(Stdio::null())
        // Its log file has what it says.
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if is_root() {
        command.uid(uid).gid(gid);
    }
    command.spawn().unwrap_or_else(|error| {
        panic!(
            "pgbouncer is required for the transaction-pooler tests \
             (`apt-get install pgbouncer`; .ci/run installs it): {error}"
        )
    })
}
