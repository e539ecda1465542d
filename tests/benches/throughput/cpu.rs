//! Where the CPU goes: this process (the load generator), the server
//! process, and the database serving it (PostgreSQL's backends of the
//! server's pool, or the whole `mariadbd`), from `/proc`. On a machine whose
//! cores are all busy, throughput is cores / CPU per request, so these
//! figures say which part of a request limits it.

use serde::Serialize;

/// Linux's `USER_HZ`: the unit of the times in `/proc/<pid>/stat`.
const TICKS_PER_SEC: f64 = 100.0;

/// CPU seconds used so far, and the machine's idle time.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    client: f64,
    server: f64,
    database: f64,
    idle: f64,
}

/// CPU per request over a window, in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct PerRequest {
    pub client_us: f64,
    pub server_us: f64,
    /// The database's processes (see [`sample`]).
    pub database_us: f64,
    /// Share of the machine's CPU time left idle in the window.
    pub idle_share: f64,
}

impl PerRequest {
    /// Load generator, server and database together.
    pub fn total_us(&self) -> f64 {
        self.client_us + self.server_us + self.database_us
    }
}

/// Samples CPU: this process, the server process, and the database's
/// processes `backends`: PostgreSQL's backends serving the server's pool
/// (other sessions on the same PostgreSQL, such as other test suites, are
/// not counted), or the one `mariadbd` (everything it serves).
pub fn sample(server: Option<u32>, backends: &[u32]) -> Sample {
    let cpu = process_secs;
    Sample {
        client: stat("/proc/self/stat".as_ref()).map_or(0.0, |(_, secs)| secs),
        server: server.map_or(0.0, cpu),
        database: backends.iter().copied().map(cpu).sum(),
        idle: idle_secs(),
    }
}

impl Sample {
    /// From `self` to `later`, over `requests` requests in `wall` seconds.
    pub fn per_request(&self, later: &Sample, requests: u64, wall: f64) -> PerRequest {
        let per = |a: f64, b: f64| (b - a) * 1e6 / requests.max(1) as f64;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        PerRequest {
            client_us: per(self.client, later.client),
            server_us: per(self.server, later.server),
            database_us: per(self.database, later.database),
            idle_share: ((later.idle - self.idle) / (wall * cores)).clamp(0.0, 1.0),
        }
    }
}

/// A process's CPU seconds so far (0 once it is gone).
pub fn process_secs(pid: u32) -> f64 {
    stat(format!("/proc/{pid}/stat").as_ref()).map_or(0.0, |(_, secs)| secs)
}

/// A process's command name and CPU seconds (user + system).
fn stat(path: &std::path::Path) -> Option<(String, f64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    // After the command: state is field 3; utime and stime are 14 and 15.
    let fields: Vec<&str> = text[close + 2..].split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((comm, (utime + stime) / TICKS_PER_SEC))
}

/// The machine's idle seconds (all cores) from `/proc/stat`.
fn idle_secs() -> f64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|text| {
            let cpu = text.lines().next()?;
            // cpu user nice system idle iowait ...
            let idle: f64 = cpu.split_whitespace().nth(4)?.parse().ok()?;
            Some(idle / TICKS_PER_SEC)
        })
        .unwrap_or(0.0)
}

/// The local MariaDB (or MySQL) server's process, if one runs here.
pub fn mariadb_pid() -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            matches!(comm.trim(), "mariadbd" | "mysqld").then_some(pid)
        })
}
