//! A NATS cluster of a test's own: three `nats-server` processes with
//! JetStream, routed to each other, each listening on loopback ports
//! chosen free when the cluster starts and storing in a temporary
//! directory of its own. (Never the shared server on 4222.) A node is
//! killed with SIGKILL and restarted on its ports and its store; every
//! process is killed when the cluster is dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_nats::ServerAddr;
use async_nats::jetstream::response::Response;
use async_nats::jetstream::{self, stream};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::examples::free_port;

/// Where Debian's `nats-server` package puts the server.
pub const NATS_SERVER: &str = "/usr/sbin/nats-server";

/// How long a node may take to listen, the cluster to elect its
/// JetStream meta leader, or a stream a new leader.
const PATIENCE: Duration = Duration::from_secs(30);

/// One `nats-server` of the cluster.
struct Node {
    name: String,
    client: SocketAddr,
    route: SocketAddr,
    store: PathBuf,
    log: PathBuf,
    process: Option<Child>,
}

/// Three `nats-server` nodes with JetStream, clustered over routes.
pub struct NatsCluster {
    name: String,
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl NatsCluster {
    /// Starts the three nodes (named `<label>-1`, ...) and waits until
    /// each takes clients and the cluster has a JetStream meta leader.
    ///
    /// # Panics
    ///
    /// If `/usr/sbin/nats-server` is missing or the cluster is not ready
    /// within 30 s.
    pub async fn start(label: &str) -> NatsCluster {
        assert!(
            std::path::Path::new(NATS_SERVER).is_file(),
            "{NATS_SERVER} is missing: install Debian's nats-server package"
        );
        let dir = tempfile::tempdir().unwrap();
        let nodes = (1..=3)
            .map(|i| {
                let name = format!("{label}-{i}");
                Node {
                    client: free_port(),
                    route: free_port(),
                    store: dir.path().join(&name),
                    log: dir.path().join(format!("{name}.log")),
                    name,
                    process: None,
                }
            })
            .collect();
        let mut cluster = NatsCluster {
            name: crate::unique::unique(label),
            nodes,
            _dir: dir,
        };
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i);
        }
        for i in 0..cluster.nodes.len() {
            cluster.listening(i).await;
        }
        cluster.meta_leader().await;
        cluster
    }

    /// The nodes' server names.
    pub fn names(&self) -> Vec<String> {
        self.nodes.iter().map(|node| node.name.clone()).collect()
    }

    /// The URL of the node `name`'s client port.
    pub fn url(&self, name: &str) -> String {
        format!("nats://{}", self.nodes[self.index(name)].client)
    }

    /// A JetStream context on the cluster: its client knows every node
    /// and reconnects to whichever is up, for ever.
    pub async fn jetstream(&self) -> jetstream::Context {
        let servers: Vec<ServerAddr> = self
            .nodes
            .iter()
            .map(|node| format!("nats://{}", node.client).parse().unwrap())
            .collect();
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(servers)
            .await
            .unwrap_or_else(|error| panic!("connect to the NATS cluster: {error}"));
        let mut jetstream = jetstream::new(client);
        // A request to a group whose leader just died is not answered:
        // ask again soon rather than wait the default 5 s.
        jetstream.set_timeout(Duration::from_secs(2));
        jetstream
    }

    /// SIGKILLs the node `name` and reaps it.
    pub async fn kill(&mut self, name: &str) {
        let i = self.index(name);
        let mut process = self.nodes[i]
            .process
            .take()
            .unwrap_or_else(|| panic!("the NATS node {name} is not running"));
        process.kill().await.unwrap();
    }

    /// Starts the node `name` again, on its ports and its store, and
    /// waits until it takes clients.
    pub async fn restart(&mut self, name: &str) {
        let i = self.index(name);
        assert!(
            self.nodes[i].process.is_none(),
            "the NATS node {name} is running"
        );
        self.spawn(i);
        self.listening(i).await;
    }

    /// The server name of `stream`'s leader, once it has one that is not
    /// `not` (a node just killed), asked through `jetstream`.
    ///
    /// # Panics
    ///
    /// If the stream has none within 30 s.
    pub async fn stream_leader(
        &self,
        jetstream: &jetstream::Context,
        stream: &str,
        not: Option<&str>,
    ) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(cluster) = cluster_info(jetstream, stream).await
                && let Some(leader) = cluster.leader
                && Some(leader.as_str()) != not
            {
                return leader;
            }
            assert!(
                Instant::now() < deadline,
                "the stream {stream} has no leader (other than {not:?}) within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every node of `stream`'s group other than its leader
    /// is current (caught up with the leader), and returns the leader.
    ///
    /// # Panics
    ///
    /// If that takes longer than 30 s.
    pub async fn stream_current(&self, jetstream: &jetstream::Context, stream: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(cluster) = cluster_info(jetstream, stream).await
                && let Some(leader) = cluster.leader
                && cluster.replicas.len() + 1 == self.nodes.len()
                && cluster
                    .replicas
                    .iter()
                    .all(|peer| peer.current && !peer.offline)
            {
                return leader;
            }
            assert!(
                Instant::now() < deadline,
                "the stream {stream}'s replicas not all current within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|node| node.name == name)
            .unwrap_or_else(|| panic!("no NATS node {name} in the cluster"))
    }

    fn spawn(&mut self, i: usize) {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, node)| format!("nats://{}", node.route))
            .collect();
        let node = &self.nodes[i];
        let process = Command::new(NATS_SERVER)
            .args(["-a", "127.0.0.1", "-p", &node.client.port().to_string()])
            .args(["-n", &node.name, "-js", "-sd"])
            .arg(&node.store)
            .args(["--cluster_name", &self.name, "--cluster"])
            .arg(format!("nats://{}", node.route))
            .args(["--routes", &routes.join(",")])
            .arg("-l")
            .arg(&node.log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("{NATS_SERVER} starts: {error}"));
        self.nodes[i].process = Some(process);
    }

    /// Waits until node `i` accepts a TCP connection on its client port.
    async fn listening(&mut self, i: usize) {
        let deadline = Instant::now() + PATIENCE;
        let node = &mut self.nodes[i];
        loop {
            if tokio::net::TcpStream::connect(node.client).await.is_ok() {
                return;
            }
            if let Some(status) = node.process.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "the NATS node {} exited ({status}): {}",
                    node.name,
                    std::fs::read_to_string(&node.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the NATS node {} not listening on {} within {PATIENCE:?}",
                node.name,
                node.client
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `$JS.API.INFO` is answered without an error: the meta
    /// group has a leader, and JetStream takes requests. (Read as plain
    /// JSON: this client's account type wants fields nats-server 2.9
    /// does not send.)
    async fn meta_leader(&self) {
        let jetstream = self.jetstream().await;
        let deadline = Instant::now() + PATIENCE;
        loop {
            let answer: Result<Response<serde_json::Value>, _> =
                jetstream.request("INFO", &serde_json::json!({})).await;
            let error = match answer {
                Ok(Response::Ok(_)) => return,
                Ok(Response::Err { error }) => error.to_string(),
                Err(error) => error.to_string(),
            };
            assert!(
                Instant::now() < deadline,
                "the NATS cluster has no JetStream meta leader within {PATIENCE:?}: {error}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The stream's cluster (leader and replicas), if the stream answers.
async fn cluster_info(jetstream: &jetstream::Context, stream: &str) -> Option<stream::ClusterInfo> {
    let mut stream = jetstream.get_stream(stream).await.ok()?;
    stream.info().await.ok()?.cluster.clone()
}
