//! A PostgreSQL cluster of the test's own under Patroni: a single-node
//! etcd, two PostgreSQL nodes each managed by its Patroni, and HAProxy in
//! front routing to whichever node is the leader. Every part on its own
//! loopback ports, in its own temporary directory, stopped when dropped.
//! Debian's `patroni`, `etcd-server` and `haproxy` packages (`.ci/run`
//! installs them) and PostgreSQL's server binaries.
//!
//! The router is HAProxy with an HTTP check on Patroni's REST API:
//! `GET /primary` answers 200 only on the node that holds the leader lock
//! and runs as primary. When the leader dies, Patroni promotes the replica
//! and HAProxy sees the answers change within its check interval: nothing
//! has to be re-pointed, and a node that stops being the leader has its
//! sessions cut (`on-marked-down shutdown-sessions`), so no client keeps
//! writing to a demoted node.
//!
//! Patroni and PostgreSQL refuse to run as root, so the nodes run as the
//! `postgres` user, in directories handed to that user.

use crate::postgres_user::{is_root, postgres_user};
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::Connection as _;

/// How long a fresh cluster may take to have a leader and a replica.
const STARTUP_LIMIT: Duration = Duration::from_secs(90);
/// How long a stopped part may take to exit before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(15);
/// Set, the cluster's directory (data, configuration and logs) stays
/// after the test.
const KEEP_VAR: &str = "IDEM_PATRONI_KEEP";
/// Between two looks at the cluster.
const POLL: Duration = Duration::from_millis(50);

/// How commits reach the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// Patroni's `synchronous_mode`: the leader acknowledges a commit once
    /// the replica has it, so a promoted replica has every acknowledged
    /// commit.
    Synchronous,
    /// Streaming without waiting: a commit is acknowledged before the
    /// replica has it, and a failover may lose the last ones.
    Asynchronous,
}

impl Replication {
    /// `sync_state` of the replica in the leader's `pg_stat_replication`.
    fn sync_state(self) -> &'static str {
        match self {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        }
    }
}

/// One PostgreSQL node and its Patroni.
struct Node {
    name: String,
    pg_port: u16,
    rest_port: u16,
    dir: PathBuf,
    patroni: Option<Child>,
}

impl Node {
    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("patroni.log")
    }

    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
            self.pg_port
        )
    }

    /// The postmaster's pid, from its data directory's `postmaster.pid`,
    /// when it is running.
    fn postmaster(&self) -> Option<i32> {
        let pid_file = std::fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?;
        let pid: i32 = pid_file.lines().next()?.trim().parse().ok()?;
        // The pid is ours only while its command line names our directory.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let data_dir = self.data_dir();
        String::from_utf8_lossy(&cmdline)
            .contains(data_dir.to_str()?)
            .then_some(pid)
    }
}

/// What [`Patroni::kill_leader`] did.
#[derive(Debug, Clone, Copy)]
pub struct Killed {
    /// The node that was the leader.
    pub node: usize,
    /// Its postmaster's pid.
    pub pid: i32,
    /// When the signal was sent.
    pub at: Instant,
}

/// A running cluster: etcd, two Patroni nodes and HAProxy.
pub struct Patroni {
    dir: tempfile::TempDir,
    etcd: Option<Child>,
    etcd_port: u16,
    nodes: Vec<Node>,
    haproxy: Option<Child>,
    router: SocketAddr,
    http: reqwest::Client,
}

impl Patroni {
    /// Starts etcd, two nodes and HAProxy, and waits until one node leads,
    /// the other replicates as `replication` says, and HAProxy routes to
    /// the leader. Panics loudly when a part is missing or does not come up.
    pub async fn start(replication: Replication) -> Patroni {
        let dir = tempfile::tempdir().expect("a directory for the cluster");
        let (uid, gid) = postgres_user("Patroni");
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
        let port = || crate::examples::free_port().port();
        let mut cluster = Patroni {
            etcd: None,
            etcd_port: port(),
            nodes: Vec::new(),
            haproxy: None,
            router: crate::examples::free_port(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
            dir,
        };
        cluster.start_etcd(port()).await;
        let bin_dir = postgres_bin_dir();
        for index in 0..2 {
            let node = Node {
                name: format!("node{index}"),
                pg_port: port(),
                rest_port: port(),
                dir: cluster.dir.path().join(format!("node{index}")),
                patroni: None,
            };
            std::fs::create_dir(&node.dir).unwrap();
            let config = patroni_config(&node, cluster.etcd_port, &bin_dir, replication);
            std::fs::write(node.dir.join("patroni.yml"), config).unwrap();
            for entry in ["", "patroni.yml"] {
                std::os::unix::fs::chown(node.dir.join(entry), Some(uid), Some(gid)).unwrap();
            }
            cluster.nodes.push(node);
        }
        // One after the other: the first bootstraps the cluster, the second
        // then copies it rather than racing it for the initialisation.
        cluster.spawn_patroni(0, uid, gid);
        cluster
            .wait_until("the first node leads", STARTUP_LIMIT, async |cluster| {
                cluster.leader().await == Some(0)
            })
            .await;
        cluster.spawn_patroni(1, uid, gid);
        cluster.start_haproxy();
        cluster.wait_ready(replication, STARTUP_LIMIT).await;
        cluster
    }

    /// The URL of the `postgres` database through HAProxy: always the
    /// leader's.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@{}/postgres?sslmode=disable",
            self.router
        )
    }

    /// The URL of node `index` itself.
    pub fn node_url(&self, index: usize) -> String {
        self.nodes[index].url()
    }

    /// The node that holds the leader lock and runs, as Patroni's REST API
    /// reports it.
    pub async fn leader(&self) -> Option<usize> {
        let members = self.members().await?;
        let name = members.iter().find_map(|member| {
            (member["role"] == "leader" && member["state"] == "running")
                .then(|| member["name"].as_str().unwrap_or_default().to_owned())
        })?;
        self.nodes.iter().position(|node| node.name == name)
    }

    /// Waits until a node leads, the other replicates in `replication`'s
    /// mode (the leader's `pg_stat_replication` says so) and HAProxy routes
    /// to the leader; returns the leader. Panics, with the logs, after
    /// `limit`.
    pub async fn wait_ready(&self, replication: Replication, limit: Duration) -> usize {
        let what = format!("a leader and a {replication:?} replica, routed to");
        self.wait_until(&what, limit, async |cluster| {
            cluster.ready(replication).await.is_some()
        })
        .await;
        self.ready(replication)
            .await
            .expect("the cluster stays ready between two looks")
    }

    async fn ready(&self, replication: Replication) -> Option<usize> {
        // Patroni's own view first: it fails over only to a member its
        // `/sync` key names (synchronous mode), which it writes after
        // PostgreSQL already reports the standby as `sync`.
        let role = match replication {
            Replication::Synchronous => "sync_standby",
            Replication::Asynchronous => "replica",
        };
        let members = self.members().await?;
        let replica_ready = members.iter().any(|member| {
            member["role"] == role
                && matches!(member["state"].as_str(), Some("running" | "streaming"))
        });
        if !replica_ready {
            return None;
        }
        let leader = self.leader().await?;
        let mut conn = connect(&self.nodes[leader].url()).await?;
        let replicas: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_replication
             WHERE state = 'streaming' AND sync_state = $1",
        )
        .bind(replication.sync_state())
        .fetch_one(&mut conn)
        .await
        .ok()?;
        let _ = conn.close().await;
        (replicas == 1 && self.routed_to().await == Some(leader)).then_some(leader)
    }

    /// The node a new connection through HAProxy reaches, when it reaches
    /// a primary.
    pub async fn routed_to(&self) -> Option<usize> {
        let mut conn = connect(&self.url()).await?;
        let (port, recovering): (i32, bool) =
            sqlx::query_as("SELECT inet_server_port(), pg_is_in_recovery()")
                .fetch_one(&mut conn)
                .await
                .ok()?;
        let _ = conn.close().await;
        if recovering {
            return None;
        }
        self.nodes
            .iter()
            .position(|node| i32::from(node.pg_port) == port)
    }

    /// Waits until a node other than `old` leads and HAProxy routes to it;
    /// returns it. Panics, with the logs, after `limit`.
    pub async fn wait_new_leader(&self, old: usize, limit: Duration) -> usize {
        self.wait_until("a new leader, routed to", limit, async |cluster| {
            matches!(cluster.leader().await, Some(leader) if leader != old)
                && cluster
                    .routed_to()
                    .await
                    .is_some_and(|routed| routed != old)
        })
        .await;
        self.leader().await.expect("a leader")
    }

    /// SIGKILLs the leader's postmaster (its pid from the data directory's
    /// `postmaster.pid`); its Patroni lives on and sees it gone.
    pub async fn kill_leader(&self) -> Killed {
        let node = self.leader().await.unwrap_or_else(|| {
            panic!("a leader to kill:\n{}", self.logs());
        });
        let pid = self.nodes[node]
            .postmaster()
            .unwrap_or_else(|| panic!("the leader's postmaster.pid:\n{}", self.logs()));
        // SAFETY: `kill` has no memory preconditions; the pid was checked
        // to be this node's postmaster just above.
        let sent = unsafe { libc::kill(pid, libc::SIGKILL) };
        let at = Instant::now();
        assert_eq!(
            sent,
            0,
            "SIGKILL to the postmaster {pid}: {}",
            std::io::Error::last_os_error()
        );
        Killed { node, pid, at }
    }

    /// Switches the cluster's replication (`synchronous_mode` in Patroni's
    /// dynamic configuration) and waits until the leader replicates so.
    pub async fn set_replication(&self, replication: Replication, limit: Duration) -> usize {
        let patch = serde_json::json!({
            "synchronous_mode": replication == Replication::Synchronous,
        });
        let node = &self.nodes[self.leader().await.expect("a leader")];
        let answer = self
            .http
            .patch(format!("http://127.0.0.1:{}/config", node.rest_port))
            .json(&patch)
            .send()
            .await
            .expect("Patroni's REST API");
        assert!(
            answer.status().is_success(),
            "PATCH /config: {}",
            answer.status()
        );
        self.wait_ready(replication, limit).await
    }

    /// The last lines of every part's log.
    pub fn logs(&self) -> String {
        let mut logs = String::new();
        let mut add = |name: &str, path: &Path| {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            // Patroni says "no action" every loop: the rest tells.
            let lines: Vec<&str> = text
                .lines()
                .filter(|line| !line.contains("INFO: no action."))
                .collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            logs.push_str(&format!(
                "--- {name} ({})\n{}\n",
                path.display(),
                tail.join("\n")
            ));
        };
        add("etcd", &self.dir.path().join("etcd.log"));
        for node in &self.nodes {
            add(&node.name, &node.log_path());
        }
        add("haproxy", &self.dir.path().join("haproxy.log"));
        logs
    }

    async fn members(&self) -> Option<Vec<Value>> {
        for node in &self.nodes {
            let url = format!("http://127.0.0.1:{}/cluster", node.rest_port);
            let Ok(answer) = self.http.get(url).send().await else {
                continue;
            };
            if let Ok(cluster) = answer.json::<Value>().await
                && let Some(members) = cluster["members"].as_array()
            {
                return Some(members.clone());
            }
        }
        None
    }

    async fn wait_until(
        &self,
        what: &str,
        limit: Duration,
        mut done: impl AsyncFnMut(&Patroni) -> bool,
    ) {
        let deadline = Instant::now() + limit;
        loop {
            if done(self).await {
                return;
            }
            self.check_running();
            assert!(
                Instant::now() < deadline,
                "{what} within {limit:?}:\n{}",
                self.logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Panics when a part has exited.
    fn check_running(&self) {
        let mut parts = vec![("etcd", &self.etcd), ("haproxy", &self.haproxy)];
        parts.extend(
            self.nodes
                .iter()
                .map(|node| (node.name.as_str(), &node.patroni)),
        );
        for (name, child) in parts {
            if let Some(child) = child {
                assert!(alive(child.id()), "{name} exited:\n{}", self.logs());
            }
        }
    }

    async fn start_etcd(&mut self, peer_port: u16) {
        let dir = self.dir.path();
        let client = format!("http://127.0.0.1:{}", self.etcd_port);
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new("etcd")
            .arg("--name=idem")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=idem={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "etcd is required for the failover test \
                     (`apt-get install etcd-server`; .ci/run installs it): {error}"
                )
            });
        self.etcd = Some(child);
        let health = format!("{client}/health");
        self.wait_until("etcd healthy", STARTUP_LIMIT, async |cluster| match cluster
            .http
            .get(&health)
            .send()
            .await
        {
            Ok(answer) => answer
                .json::<Value>()
                .await
                .is_ok_and(|health| health["health"] == "true"),
            Err(_) => false,
        })
        .await;
    }

    fn spawn_patroni(&mut self, index: usize, uid: u32, gid: u32) {
        use std::os::unix::process::CommandExt as _;
        let node = &mut self.nodes[index];
        let log = File::create(node.log_path()).unwrap();
        let mut command = Command::new("patroni");
        command
            .arg(node.dir.join("patroni.yml"))
            .env("HOME", &node.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if is_root() {
            command.uid(uid).gid(gid);
        }
        let child = command.spawn().unwrap_or_else(|error| {
            panic!(
                "patroni is required for the failover test \
                 (`apt-get install patroni`; .ci/run installs it): {error}"
            )
        });
        node.patroni = Some(child);
    }

    fn start_haproxy(&mut self) {
        let dir = self.dir.path();
        let mut config = format!(
            "global\n\
             \x20   maxconn 2000\n\
             defaults\n\
             \x20   mode tcp\n\
             \x20   timeout connect 1s\n\
             \x20   timeout client 30m\n\
             \x20   timeout server 30m\n\
             \x20   timeout check 1s\n\
             listen postgres\n\
             \x20   bind {router}\n\
             \x20   option httpchk OPTIONS /primary\n\
             \x20   http-check expect status 200\n\
             \x20   default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions\n",
            router = self.router,
        );
        for node in &self.nodes {
            config.push_str(&format!(
                "    server {} 127.0.0.1:{} check port {}\n",
                node.name, node.pg_port, node.rest_port
            ));
        }
        std::fs::write(dir.join("haproxy.cfg"), config).unwrap();
        let log = File::create(dir.join("haproxy.log")).unwrap();
        let child = Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(dir.join("haproxy.cfg"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "haproxy is required for the failover test \
                     (`apt-get install haproxy`; .ci/run installs it): {error}"
                )
            });
        self.haproxy = Some(child);
    }
}

impl Drop for Patroni {
    fn drop(&mut self) {
        if std::env::var_os(KEEP_VAR).is_some() {
            self.dir.disable_cleanup(true);
            eprintln!(
                "{KEEP_VAR}: the cluster's directory stays at {}",
                self.dir.path().display()
            );
        }
        stop(&mut self.haproxy, libc::SIGKILL);
        // Each Patroni stops its PostgreSQL on SIGTERM: all at once.
        for node in &self.nodes {
            if let Some(child) = &node.patroni {
                // SAFETY: `kill` has no memory preconditions; the child is
                // not yet reaped, so its pid is still its own.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            }
        }
        for node in &mut self.nodes {
            stop(&mut node.patroni, libc::SIGTERM);
            // A postmaster its Patroni left behind (Patroni killed).
            if let Some(pid) = node.postmaster() {
                // SAFETY: as above; `postmaster` checked the pid is ours.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        stop(&mut self.etcd, libc::SIGTERM);
    }
}

/// Sends `signal`, waits up to [`STOP_LIMIT`], then SIGKILLs and reaps.
fn stop(child: &mut Option<Child>, signal: i32) {
    let Some(mut child) = child.take() else {
        return;
    };
    // SAFETY: `kill` has no memory preconditions; the child is not yet
    // reaped, so its pid is still its own.
    unsafe { libc::kill(child.id() as i32, signal) };
    let deadline = Instant::now() + STOP_LIMIT;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Whether process `pid` runs: it exists and is no zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command's closing parenthesis.
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

async fn connect(url: &str) -> Option<sqlx::PgConnection> {
    let connecting = sqlx::PgConnection::connect(url);
    tokio::time::timeout(Duration::from_secs(2), connecting)
        .await
        .ok()?
        .ok()
}

/// Patroni's configuration of `node`: small timings so a failover takes
/// seconds, failover rather than a restart when the primary crashes
/// (`primary_start_timeout: 0`), `pg_rewind` (or a fresh copy) for a
/// former primary to rejoin, and trust on loopback.
fn patroni_config(node: &Node, etcd_port: u16, bin_dir: &Path, replication: Replication) -> String {
    let synchronous = replication == Replication::Synchronous;
    format!(
        "scope: idem-failover
name: {name}
log:
  level: INFO
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  hosts: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    primary_start_timeout: 0
    synchronous_mode: {synchronous}
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_log_hints: 'on'
        max_connections: 100
  initdb:
    - encoding: UTF8
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
  parameters:
    unix_socket_directories: {dir}
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
",
        name = node.name,
        rest = node.rest_port,
        pg = node.pg_port,
        data = node.data_dir().display(),
        dir = node.dir.display(),
        bin = bin_dir.display(),
    )
}

/// PostgreSQL's server binaries: 15's when installed (Debian's layout),
/// else the newest.
fn postgres_bin_dir() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let preferred = root.join("15/bin");
    if preferred.join("postgres").exists() {
        return preferred;
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("postgres").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .expect("PostgreSQL's server binaries under /usr/lib/postgresql/<version>/bin")
}
