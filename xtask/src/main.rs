//! `cargo xtask test [ARGS...]`: makes a machine of the project's kind
//! ready for the tests, then runs `cargo test --workspace --all-features
//! ARGS...`.
//!
//! Ready means: the Debian packages some tests start servers from are
//! installed (PgBouncer, Patroni, etcd, HAProxy), and the browser the
//! operator page's test drives (Chromium), and the shared services
//! the tests connect to answer (PostgreSQL, MariaDB, NATS with JetStream,
//! Redis, RabbitMQ), each started with its documented command when it is
//! down. The Python tools of the OpenAPI tests are set up by those tests
//! themselves, in a virtual environment under `target/`. Nothing is
//! skipped: a step that fails stops here, and a test whose server is still
//! missing fails loudly.

use std::net::{SocketAddr, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// The Debian packages whose servers the tests start themselves, each on
/// ports and in directories of its own; and Chromium, which
/// `tests/operator_page.rs` runs headless.
const PACKAGES: &[&str] = &["pgbouncer", "patroni", "etcd-server", "haproxy", "chromium"];

/// A shared service: how to tell it answers, and how to start it.
struct Service {
    name: &'static str,
    up: fn() -> bool,
    start: &'static [&'static str],
    /// How long it may take to answer once started.
    patience: Duration,
}

const SERVICES: &[Service] = &[
    Service {
        name: "PostgreSQL",
        up: || quiet(&["pg_isready", "-h", "127.0.0.1", "-p", "5432"]),
        start: &[
            "sh",
            "-c",
            "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
        ],
        patience: Duration::from_secs(60),
    },
    Service {
        name: "MariaDB",
        up: || {
            quiet(&[
                "mariadb-admin",
                "ping",
                "-h",
                "127.0.0.1",
                "-u",
                "root",
                "--silent",
            ])
        },
        start: &[
            "start-stop-daemon",
            "--start",
            "--oknodo",
            "--background",
            "--exec",
            "/usr/sbin/mariadbd",
        ],
        patience: Duration::from_secs(60),
    },
    Service {
        name: "NATS",
        up: || listens(4222),
        start: &[
            "start-stop-daemon",
            "--start",
            "--oknodo",
            "--background",
            "--exec",
            "/usr/sbin/nats-server",
            "--",
            "-a",
            "127.0.0.1",
            "-p",
            "4222",
            "-js",
            "-sd",
            "/var/lib/nats-server",
            "-l",
            "/var/log/nats-server.log",
        ],
        patience: Duration::from_secs(60),
    },
    Service {
        name: "Redis",
        up: || quiet(&["redis-cli", "-h", "127.0.0.1", "ping"]),
        start: &[
            "redis-server",
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "-::1",
            "--port",
            "6379",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            "/var/lib/redis",
            "--logfile",
            "/var/log/redis/ci.log",
        ],
        patience: Duration::from_secs(60),
    },
    Service {
        name: "RabbitMQ",
        up: || listens(5672),
        start: &["rabbitmq-server", "-detached"],
        // The Erlang VM and the broker's boot take a while.
        patience: Duration::from_secs(180),
    },
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => match prepare() {
            Ok(()) => cargo_test(&args[1..]),
            Err(error) => {
                eprintln!("xtask: {error}");
                ExitCode::FAILURE
            }
        },
        Some("setup") => match prepare() {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("xtask: {error}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!(
                "usage: cargo xtask test [ARGS...]   set up what the tests need, then \
                 `cargo test --workspace --all-features ARGS...`\n       \
                 cargo xtask setup             only the setup"
            );
            ExitCode::from(2)
        }
    }
}

/// Installs the missing packages and starts the services that are down.
fn prepare() -> Result<(), String> {
    install(PACKAGES)?;
    for service in SERVICES {
        ensure(service)?;
    }
    Ok(())
}

fn install(packages: &[&str]) -> Result<(), String> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|package| !installed(package))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    let apt = |args: &[&str]| -> Result<(), String> {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .map_err(|error| format!("apt-get: {error}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!(
                "`apt-get {}` failed ({status}); install {} by hand (as root)",
                args.join(" "),
                missing.join(" ")
            ))
        }
    };
    apt(&["update", "-qq"])?;
    let mut install = vec!["install", "-y", "-qq"];
    install.extend(&missing);
    apt(&install)
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|output| {
            String::from_utf8_lossy(&output.stdout).contains("install ok installed")
        })
}

fn ensure(service: &Service) -> Result<(), String> {
    if (service.up)() {
        return Ok(());
    }
    eprintln!("xtask: starting {}", service.name);
    let (program, args) = service.start.split_first().expect("a command");
    // A start that reports failure may still have raced one already
    // starting: whether the service answers decides.
    let started = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .status();
    if let Err(error) = started {
        return Err(format!("starting {}: {program}: {error}", service.name));
    }
    let deadline = Instant::now() + service.patience;
    while Instant::now() < deadline {
        if (service.up)() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Err(format!(
        "{} did not come up within {:?} (started with `{}`)",
        service.name,
        service.patience,
        service.start.join(" ")
    ))
}

/// Whether `command` runs and succeeds, its output discarded.
fn quiet(command: &[&str]) -> bool {
    Command::new(command[0])
        .args(&command[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Whether something accepts connections on loopback at `port`.
fn listens(port: u16) -> bool {
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&address, Duration::from_secs(1)).is_ok()
}

/// How long `cargo test` may run, building included, before it counts
/// as hung: the suite takes about a quarter of it on this project's
/// machine. `IDEM_TEST_DEADLINE_MINUTES` changes it.
const DEADLINE_MINUTES: u64 = 60;

/// Runs the tests; past the deadline they are killed and the run fails,
/// naming the cause, instead of outwaiting CI. Without a terminal (CI) the
/// tests run in a process group of their own, so the kill reaches the test
/// binary and the servers it started too; at a terminal they stay in its
/// group, where Ctrl-C reaches them.
fn cargo_test(args: &[String]) -> ExitCode {
    use std::io::IsTerminal as _;
    use std::os::unix::process::CommandExt as _;

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let minutes = std::env::var("IDEM_TEST_DEADLINE_MINUTES")
        .ok()
        .and_then(|minutes| minutes.parse().ok())
        .unwrap_or(DEADLINE_MINUTES);
    let grouped = !std::io::stdin().is_terminal();
    let mut command = Command::new(cargo);
    command
        .args(["test", "--workspace", "--all-features"])
        .args(args);
    if grouped {
        command.process_group(0);
    }
    let child = command.spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(error) => {
            eprintln!("xtask: cargo test: {error}");
            return ExitCode::FAILURE;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(minutes * 60);
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return ExitCode::SUCCESS,
            Ok(Some(status)) => {
                return ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1));
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_secs(1)),
            Ok(None) => {
                eprintln!(
                    "xtask: cargo test still ran after {minutes} min: a test hangs (the last \
                     \"has been running for over 60 seconds\" above names it); killed"
                );
                if grouped {
                    let group = format!("-{}", child.id());
                    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
                } else {
                    let _ = child.kill();
                }
                let _ = child.wait();
                return ExitCode::FAILURE;
            }
            Err(error) => {
                eprintln!("xtask: cargo test: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
}
