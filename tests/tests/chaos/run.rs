//! Exactly-once under chaos: a real HTTP client retries many logical
//! operations, each with its own key, while the harness SIGKILLs and
//! restarts the server process and the engine's proxy cuts its database
//! connections, at random and at COMMIT (before forwarding it, and after,
//! the answer withheld). Then every key's effects are counted. Every kind
//! of chaos must have happened on the wire, counted by the proxy and the
//! harness as it happened, not as it was asked for.

use idem_tests::hardening::{Answer, Client, Rng, Server, unique};
use idem_tests::proxied::{self, Proxied};
use idem_tests::proxy::{CutOnCommit, Proxy};

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::Idem;
use sqlx::Pool;
use sqlx::pool::PoolOptions;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{Notify, mpsc, watch};

/// Env var that names the engine of the child process's server (and
/// says it is one).
pub const CHILD_ENGINE: &str = "IDEM_CHAOS_CHILD_ENGINE";
/// Env var with the database URL (the proxy) the child's server uses.
const CHILD_DATABASE_URL: &str = "IDEM_CHAOS_CHILD_DATABASE_URL";

const OP_BODY: &str = r#"{"note":"chaos"}"#;

// ---------------------------------------------------------------- the server process

/// The server half of the chaos run, in a child process that the run
/// SIGKILLs: serves until killed. Without the database URL its parent
/// sets, it is no child of a run, and fails.
pub async fn serve_as_child<DB: Proxied>() {
    let url = std::env::var(CHILD_DATABASE_URL)
        .unwrap_or_else(|_| panic!("{CHILD_DATABASE_URL} is not set: run by the chaos run only"));
    // The proxy may cut the first connections too.
    let mut pool = None;
    for _ in 0..50 {
        let connecting = PoolOptions::<DB>::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(2))
            .connect(&url);
        match connecting.await {
            Ok(connected) => {
                pool = Some(connected);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let server = Server::start(Idem::new(pool.expect("connect through the proxy"))).await;
    println!("LISTENING {}", server.addr);
    std::future::pending::<()>().await;
}

/// One server process.
struct Child {
    process: tokio::process::Child,
}

impl Child {
    /// Starts server process number `generation` and waits until it
    /// listens. Each `EFFECT_WRITTEN` line it prints later sends its
    /// generation to `announced`.
    async fn spawn(
        engine: &str,
        database_url: &str,
        generation: u64,
        announced: mpsc::UnboundedSender<u64>,
    ) -> (Child, SocketAddr) {
        let mut process = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "chaos_child_server",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENGINE, engine)
            .env(CHILD_DATABASE_URL, database_url)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
        let listening = async {
            loop {
                let line = lines.next_line().await.unwrap();
                let line = line.expect("server process exited before listening");
                // libtest may print "test chaos_child_server ... " first.
                if let Some((_, addr)) = line.split_once("LISTENING ") {
                    break addr.trim().parse().unwrap();
                }
            }
        };
        let addr = tokio::time::timeout(Duration::from_secs(30), listening)
            .await
            .expect("server process listening within 30 s");
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("EFFECT_WRITTEN ") {
                    let _ = announced.send(generation);
                }
            }
        });
        (Child { process }, addr)
    }

    /// SIGKILL.
    async fn kill(mut self) {
        self.process.kill().await.unwrap();
    }
}

/// The server process of the moment, and its address for the clients
/// (`None` while it restarts).
struct Servers {
    engine: &'static str,
    url: String,
    child: Option<Child>,
    generation: u64,
    announced_tx: mpsc::UnboundedSender<u64>,
    addr: watch::Sender<Option<SocketAddr>>,
}

impl Servers {
    async fn start(engine: &'static str, url: String) -> (Servers, mpsc::UnboundedReceiver<u64>) {
        let (announced_tx, announced) = mpsc::unbounded_channel();
        let (child, addr) = Child::spawn(engine, &url, 0, announced_tx.clone()).await;
        let servers = Servers {
            engine,
            url,
            child: Some(child),
            generation: 0,
            announced_tx,
            addr: watch::Sender::new(Some(addr)),
        };
        (servers, announced)
    }

    /// SIGKILLs the current process and starts the next one.
    async fn restart(&mut self) {
        self.addr.send_replace(None);
        if let Some(old) = self.child.take() {
            old.kill().await;
        }
        self.generation += 1;
        let (child, addr) = Child::spawn(
            self.engine,
            &self.url,
            self.generation,
            self.announced_tx.clone(),
        )
        .await;
        self.child = Some(child);
        self.addr.send_replace(Some(addr));
    }

    async fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            child.kill().await;
        }
    }
}

// ---------------------------------------------------------------- the clients

/// What the clients of one run share.
struct Run {
    http: reqwest::Client,
    scope: String,
    stop: AtomicBool,
    tally: Tally,
    rng: Mutex<Rng>,
}

#[derive(Default)]
struct Tally {
    attempts: AtomicU64,
    conflicts: AtomicU64,
    unavailable: AtomicU64,
    server_errors: AtomicU64,
    transport_errors: AtomicU64,
}

impl Run {
    fn rng(&self, lo: u64, hi: u64) -> u64 {
        self.rng.lock().unwrap().range(lo, hi)
    }
}

/// The longest the server may keep a session whose client vanished
/// holding a key: the route's deadline (the default 30 s) and 2 s.
const ORPHAN_BOUND_SECS: u64 = 32;

/// Whether a 409 or 503 says when to retry as it should: in 1 s, or, where
/// the claim's connection was lost under it (its claim may have reached
/// the server and hold the key in a session now orphaned), once the server
/// has ended that session, within the orphan bound.
fn retry_after_as_expected(answer: &Answer) -> bool {
    match answer.header("retry-after") {
        Some("1") => true,
        Some(secs) => {
            answer.status == 503
                && answer.problem_code() == "idempotency_store_unavailable"
                && secs
                    .parse::<u64>()
                    .is_ok_and(|secs| (1..=ORPHAN_BOUND_SECS).contains(&secs))
        }
        None => false,
    }
}

/// How one logical operation ended during the chaos.
struct Outcome {
    key: String,
    /// The answer the client accepted as success (201, first or replayed).
    success: Option<Answer>,
    /// Answers a correct server never gives this client (400, 422, a 409
    /// or 503 without Retry-After, ...).
    unexpected: Vec<String>,
}

/// Starts `concurrency` clients that take operations `0..operations` in
/// turn and retry each until it succeeds or the run stops.
fn start_clients(
    run: &Arc<Run>,
    operations: usize,
    concurrency: usize,
    addr: &watch::Receiver<Option<SocketAddr>>,
) -> tokio::task::JoinHandle<Vec<Outcome>> {
    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, run, mut addr) = (next.clone(), run.clone(), addr.clone());
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= operations {
                        return outcomes;
                    }
                    // Every tenth operation's first attempt stops right
                    // after its write, for a kill mid-transaction.
                    let announce = i % 10 == 3;
                    outcomes.push(operate(&run, format!("op-{i}"), &mut addr, announce).await);
                }
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut outcomes = Vec::new();
        for client in clients {
            outcomes.extend(client.await.unwrap());
        }
        outcomes
    })
}

/// Retries one operation with its key until it succeeds or the run stops.
async fn operate(
    run: &Run,
    key: String,
    addr: &mut watch::Receiver<Option<SocketAddr>>,
    announce: bool,
) -> Outcome {
    let tally = &run.tally;
    let mut unexpected = Vec::new();
    let mut first = true;
    while !run.stop.load(Ordering::SeqCst) {
        let Some(current) = *addr.borrow_and_update() else {
            // Between a kill and the restart: wait for the new address.
            let _ = tokio::time::timeout(Duration::from_millis(500), addr.changed()).await;
            continue;
        };
        let mode = match announce && first {
            true => "announce".to_owned(),
            false => format!("delay:{}", run.rng(0, 40)),
        };
        first = false;
        tally.attempts.fetch_add(1, Ordering::Relaxed);
        let request = Client::with(run.http.clone(), current, &run.scope)
            .post(&key, OP_BODY)
            .header("x-test-mode", mode)
            .timeout(Duration::from_secs(3));
        let answer = match request.send().await {
            Ok(response) => Answer::of(response).await,
            Err(error) => Err(error),
        };
        let backoff = Duration::from_millis(run.rng(5, 60));
        let Ok(answer) = answer else {
            tally.transport_errors.fetch_add(1, Ordering::Relaxed);
            // Killed or cut: a restart announces its new address.
            let _ = tokio::time::timeout(backoff, addr.changed()).await;
            continue;
        };
        let counter = match answer.status.as_u16() {
            201 => {
                return Outcome {
                    key,
                    success: Some(answer),
                    unexpected,
                };
            }
            409 => &tally.conflicts,
            503 => &tally.unavailable,
            // The handler's own insert failed on a cut connection.
            500 => &tally.server_errors,
            _ => {
                unexpected.push(format!("{answer:?}"));
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if answer.status != 500 && !retry_after_as_expected(&answer) {
            unexpected.push(format!("no Retry-After: {answer:?}"));
        }
        tokio::time::sleep(backoff).await;
    }
    Outcome {
        key,
        success: None,
        unexpected,
    }
}

// ---------------------------------------------------------------- the chaos

/// What the harness did; what the proxy cut, it counts itself
/// ([`Proxy::cuts`]).
#[derive(Default, Debug)]
struct Chaos {
    /// Server processes SIGKILLed.
    kills: u64,
    /// Of those, processes killed while a handler's written effect waited
    /// uncommitted.
    kills_mid_transaction: u64,
    /// Calls of `cut_all`.
    cut_alls: u64,
    /// Windows in which the proxy cut at each commit.
    commit_windows: u64,
}

/// Kills, restarts and cuts at random until the clients are done, and
/// kills every process that announces a written effect. After `budget`
/// it stops the clients. The first four events are one of each kind, so
/// that every run has them all.
async fn unleash(
    servers: &mut Servers,
    announced: &mut mpsc::UnboundedReceiver<u64>,
    proxy: &Proxy,
    run: &Run,
    clients_done: &Notify,
    budget: Duration,
) -> Chaos {
    let started = Instant::now();
    let mut chaos = Chaos::default();
    let mut events = 0;
    // The random schedule keeps its own clock, so announcements (which
    // come often) never starve it.
    let mut next_chaos = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = clients_done.notified() => return chaos,
            Some(announcer) = announced.recv() => {
                // A handler wrote its effect and waits: kill it there
                // (unless a random kill already took its process).
                if announcer == servers.generation {
                    servers.restart().await;
                    chaos.kills += 1;
                    chaos.kills_mid_transaction += 1;
                }
                continue;
            }
            () = tokio::time::sleep_until(next_chaos) => {}
        }
        next_chaos = tokio::time::Instant::now() + Duration::from_millis(run.rng(30, 200));
        if started.elapsed() > budget {
            run.stop.store(true, Ordering::SeqCst);
            continue;
        }
        let roll = match events {
            0 => 0,
            1 => 35,
            2 => 60,
            3 => 80,
            _ => run.rng(0, 100),
        };
        events += 1;
        match roll {
            0..35 => {
                servers.restart().await;
                chaos.kills += 1;
            }
            35..60 => {
                proxy.cut_all();
                chaos.cut_alls += 1;
            }
            roll => {
                let mode = match roll < 80 {
                    true => CutOnCommit::BeforeForwarding,
                    false => CutOnCommit::AfterForwarding,
                };
                let open = Duration::from_millis(run.rng(20, 120));
                cut_commits(proxy, mode, open).await;
                chaos.commit_windows += 1;
            }
        }
    }
}

/// Cuts at every commit, in `mode`, for `open` and until one was cut (for
/// at most two seconds more: every client may be between attempts).
async fn cut_commits(proxy: &Proxy, mode: CutOnCommit, open: Duration) {
    let mut cuts = proxy.watch_cuts();
    let before = cuts.borrow_and_update().at_commit(mode);
    proxy.set_cut_on_commit(mode);
    tokio::time::sleep(open).await;
    let one_more = cuts.wait_for(|cuts| cuts.at_commit(mode) > before);
    let _ = tokio::time::timeout(Duration::from_secs(2), one_more).await;
    proxy.set_cut_on_commit(CutOnCommit::Off);
}

// ---------------------------------------------------------------- the verdict

#[derive(Default)]
struct Verdict {
    succeeded: usize,
    replayed: usize,
    settled: usize,
    duplicates: usize,
    failures: Vec<String>,
}

impl Verdict {
    /// Exactly one effect for every operation the client saw succeed, at
    /// most one for the rest; every success is the stored answer.
    async fn judge<DB: Proxied>(&mut self, direct: &Pool<DB>, scope: &str, outcomes: &[Outcome]) {
        for outcome in outcomes {
            let key = &outcome.key;
            self.failures
                .extend(outcome.unexpected.iter().map(|u| format!("{key}: {u}")));
            let found = DB::effects(direct, scope, key).await;
            self.duplicates += found.len().saturating_sub(1);
            match &outcome.success {
                Some(answer) if found.len() == 1 => {
                    self.succeeded += 1;
                    self.replayed += usize::from(answer.replayed());
                    self.check_stored(direct, scope, key, answer, &found[0].1)
                        .await;
                }
                Some(_) => self
                    .failures
                    .push(format!("{key}: succeeded with {} effects", found.len())),
                None if found.len() > 1 => {
                    self.failures
                        .push(format!("{key}: {} effects", found.len()));
                }
                None => {}
            }
        }
    }

    /// With a fresh server and no chaos, every interrupted operation
    /// completes exactly once, and every success replays what its client got.
    async fn settle<DB: Proxied>(
        &mut self,
        calm: &Client,
        direct: &Pool<DB>,
        outcomes: &[Outcome],
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let send = |key: &str| {
            let request = calm.post(key, OP_BODY).timeout(Duration::from_secs(5));
            async move { Answer::of(request.send().await?).await }
        };
        for outcome in outcomes.iter().filter(|o| o.success.is_none()) {
            let key = &outcome.key;
            let answer = loop {
                let answer = send(key).await;
                if matches!(&answer, Ok(a) if a.status == 201) || Instant::now() > deadline {
                    break answer;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let answer = match answer {
                Ok(answer) if answer.status == 201 => answer,
                other => {
                    self.failures
                        .push(format!("{key}: does not settle: {other:?}"));
                    continue;
                }
            };
            let found = DB::effects(direct, &calm.scope, key).await;
            if found.len() != 1 {
                self.failures
                    .push(format!("{key}: settled with {} effects", found.len()));
                continue;
            }
            self.check_stored(direct, &calm.scope, key, &answer, &found[0].1)
                .await;
            self.settled += 1;
        }
        for outcome in outcomes {
            let Some(first) = &outcome.success else {
                continue;
            };
            match send(&outcome.key).await {
                Ok(again) if again.replayed() && again.body == first.body => {}
                again => self
                    .failures
                    .push(format!("{}: replay differs: {again:?}", outcome.key)),
            }
        }
    }

    /// The stored row is the answer the client holds, and that answer
    /// reports the effect that committed (its `nonce`).
    async fn check_stored<DB: Proxied>(
        &mut self,
        direct: &Pool<DB>,
        scope: &str,
        key: &str,
        answer: &Answer,
        nonce: &str,
    ) {
        match DB::stored(direct, scope, key).await {
            Some((Some(201), body)) if body == answer.body => {}
            other => self.failures.push(format!(
                "{key}: stored {other:?}, the client holds {answer:?}"
            )),
        }
        if answer.effect().nonce != nonce {
            self.failures.push(format!(
                "{key}: the answer reports an effect that did not commit"
            ));
        }
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------- the run

/// `cargo test --test chaos exactly_once` runs the short form on every
/// engine (300 operations, a few seconds each). A longer run, with the
/// totals printed: `IDEM_CHAOS_OPS=5000 cargo test --test chaos
/// postgres::exactly_once -- --nocapture` (`IDEM_CHAOS_CLIENTS` sets the
/// concurrency, 12 by default; `IDEM_SEED=<n>` replays the random schedule
/// of a printed run).
pub async fn exactly_once_under_kills_and_cut_connections<DB: Proxied>() {
    let operations = env_usize("IDEM_CHAOS_OPS", 300);
    let concurrency = env_usize("IDEM_CHAOS_CLIENTS", 12);
    // Bounded whatever happens: the chaos stops, then a calm pass settles.
    let budget = Duration::from_secs(30) + Duration::from_millis(100) * operations as u32;
    let direct = DB::pool(4).await;
    let proxy = proxied::start_proxy::<DB>().await;
    let scope = unique("chaos");
    let run = Arc::new(Run {
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(concurrency)
            .build()
            .unwrap(),
        scope: scope.clone(),
        stop: AtomicBool::new(false),
        tally: Tally::default(),
        rng: Mutex::new(Rng::from_env(&format!("{} chaos", DB::ENGINE))),
    });

    let url = proxied::url_via::<DB>(proxy.addr());
    let (mut servers, mut announced) = Servers::start(DB::ENGINE, url).await;
    let started = Instant::now();
    let clients = start_clients(&run, operations, concurrency, &servers.addr.subscribe());
    let clients_done = Arc::new(Notify::new());
    let outcomes = tokio::spawn({
        let clients_done = clients_done.clone();
        async move {
            let outcomes = clients.await.unwrap();
            clients_done.notify_one();
            outcomes
        }
    });
    let chaos = unleash(
        &mut servers,
        &mut announced,
        &proxy,
        &run,
        &clients_done,
        budget,
    )
    .await;
    let outcomes = outcomes.await.unwrap();
    let chaos_time = started.elapsed();
    proxy.set_cut_on_commit(CutOnCommit::Off);
    let cuts = proxy.cuts();

    let mut verdict = Verdict::default();
    verdict.judge(&direct, &scope, &outcomes).await;
    // A fresh process: no handler left parked by an announcement.
    servers.restart().await;
    let calm = Client::new(servers.addr.borrow().expect("a server is up"), &scope);
    verdict.settle(&calm, &direct, &outcomes).await;
    servers.stop().await;
    let orphans = DB::orphans(&direct, &scope).await;
    let effects = DB::count_effects(&direct, &scope).await;
    let duplicates_in_the_end = DB::duplicates(&direct, &scope).await;

    let tally = &run.tally;
    // Straight to the process's stderr, past libtest's capture: the totals
    // show in every run's log, passing or not.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "{} chaos totals: operations={operations} succeeded_during_chaos={} (replayed={}) \
         settled_after={} attempts={} kills={} (mid_transaction={}) cut_alls={} \
         (connections_cut={}) commit_windows={} (commits_cut_before={} \
         commits_cut_after={}) answers_409={} answers_503={} answers_500={} \
         transport_errors={} effects={effects} duplicates={} \
         duplicates_after_settling={duplicates_in_the_end} orphans={orphans:?} \
         chaos_time={chaos_time:.1?}",
        DB::ENGINE,
        verdict.succeeded,
        verdict.replayed,
        verdict.settled,
        tally.attempts.load(Ordering::Relaxed),
        chaos.kills,
        chaos.kills_mid_transaction,
        chaos.cut_alls,
        cuts.all,
        chaos.commit_windows,
        cuts.before_commit,
        cuts.after_commit,
        tally.conflicts.load(Ordering::Relaxed),
        tally.unavailable.load(Ordering::Relaxed),
        tally.server_errors.load(Ordering::Relaxed),
        tally.transport_errors.load(Ordering::Relaxed),
        verdict.duplicates,
    );
    verdict.failures.truncate(40);
    assert!(
        verdict.failures.is_empty(),
        "failures (first 40):\n{}",
        verdict.failures.join("\n")
    );
    assert_eq!(
        (verdict.duplicates, duplicates_in_the_end),
        (0, 0),
        "duplicate effects"
    );
    assert_eq!(effects, operations as i64, "one effect per operation");
    assert_eq!(
        orphans,
        (0, 0, 0),
        "(effects without a stored response, stored responses without an effect, open claims)"
    );
    // Each kind of chaos happened, as counted where it happened: a run
    // that never got to one proves nothing about it.
    assert!(chaos.kills > 0, "no kill happened: {chaos:?}");
    assert!(
        chaos.kills_mid_transaction > 0,
        "no process was killed with an effect written: {chaos:?}"
    );
    assert!(
        cuts.all > 0,
        "cut_all cut no connection: {cuts:?}, {chaos:?}"
    );
    assert!(
        cuts.before_commit > 0,
        "no commit was cut before the server saw it: {cuts:?}, {chaos:?}"
    );
    assert!(
        cuts.after_commit > 0,
        "no commit was cut after the server answered it: {cuts:?}, {chaos:?}"
    );
}
