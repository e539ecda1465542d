//! The real `charges` example binary, on a free loopback port with a fresh
//! SQLite file, killed when dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long the server may take to migrate and listen.
const STARTUP_LIMIT: Duration = Duration::from_secs(30);

/// The account every test charges.
pub const ACCOUNT: &str = "acct_1";

/// A running `charges` server.
pub struct Charges {
    pub addr: SocketAddr,
    pub url: String,
    // Dropped in this order: the process is killed, then its files go.
    _child: Child,
    _dir: tempfile::TempDir,
}

/// The example binary, next to this test binary's directory:
/// `target/<profile>/examples/charges`.
fn binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary has a path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binaries live in target/<profile>/deps");
    let path = profile_dir.join("examples").join("charges");
    assert!(
        path.is_file(),
        "the example server {} is missing: build it first with \
         `cargo build --example charges` (`cargo test --workspace` builds it too)",
        path.display()
    );
    path
}

impl Charges {
    /// Starts the server; its handler waits `delay` after each insert.
    pub async fn start(delay: Duration) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let addr = free_port();
        let database = format!("sqlite:{}", dir.path().join("charges.db").display());
        let mut child = Command::new(binary())
            .current_dir(dir.path())
            .env("ADDR", addr.to_string())
            .env("DATABASE_URL", database)
            .env("CHARGE_DELAY_MS", delay.as_millis().to_string())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the charges example starts");

        // It logs "listening" once migrated and bound: wait for that line,
        // then keep draining its output so it never blocks on a full pipe.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = async {
            while let Some(line) = lines.next_line().await.expect("the server's output") {
                if line.contains("listening on") {
                    return true;
                }
            }
            false
        };
        let ready = tokio::time::timeout(STARTUP_LIMIT, ready).await;
        assert!(
            matches!(ready, Ok(true)),
            "the charges example did not start listening on {addr}"
        );
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

        Self {
            addr,
            url: format!("http://{addr}"),
            _child: child,
            _dir: dir,
        }
    }

    /// The charges the account has, read from the server itself (ids are
    /// dense from 1 in a fresh database, so the first missing id ends them).
    pub async fn charges(&self) -> Vec<serde_json::Value> {
        let client = reqwest::Client::new();
        let mut found = Vec::new();
        for id in 1.. {
            let response = client
                .get(format!("{}/v1/charges/{id}", self.url))
                .bearer_auth(ACCOUNT)
                .send()
                .await
                .expect("the server answers");
            if response.status() == reqwest::StatusCode::NOT_FOUND {
                return found;
            }
            assert!(response.status().is_success(), "{}", response.status());
            found.push(response.json().await.expect("a charge"));
        }
        unreachable!()
    }
}

fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}
