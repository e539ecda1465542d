//! A phased service with a database, tables and a provider process of its
//! own, served in this process or in a child process the test SIGKILLs,
//! and its client.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem::Idem;
use idem_tests::phased::{
    self, Boundaries, Boundary, ChildOptions, KeyRow, Payment, PaymentRow, PhasedDb, PhasedState,
    ProviderProcess, ServiceConfig,
};
use idem_tests::service::unique as name;
use idem_tests::unique::unique;
use reqwest::StatusCode;
use sqlx::Pool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::sync::mpsc;

pub use idem_tests::service::{Answer, send};

/// The payment every test makes.
pub const BODY: &str = r#"{"amount": 1250, "currency": "eur"}"#;
/// Another request under the same key.
pub const OTHER_BODY: &str = r#"{"amount": 9999, "currency": "eur"}"#;

/// One test's world: its tables (its database file, on SQLite), its
/// provider, its caller.
pub struct Fixture<DB: PhasedDb> {
    pub config: ServiceConfig,
    pub admin: Pool<DB>,
    pub provider: ProviderProcess,
    pub account: String,
    http: reqwest::Client,
}

impl<DB: PhasedDb> Fixture<DB> {
    /// With a provider that answers after `delay` and fails its first
    /// `fail_first` calls.
    pub async fn new(delay: Duration, fail_first: u64) -> Self {
        let provider = ProviderProcess::start(delay, fail_first).await;
        let config = ServiceConfig {
            database: DB::fresh_database(),
            keys: unique("phased_keys"),
            payments: unique("phased_payments"),
            provider: provider.url.clone(),
        };
        let admin = DB::open(&config.database, 1).await;
        Idem::new(admin.clone())
            .table(&config.keys)
            .expect("a plain table name")
            .migrate()
            .await
            .expect("migrate");
        DB::create_payments(&admin, &config.payments).await;
        Self {
            config,
            admin,
            provider,
            account: name("acct"),
            http: reqwest::Client::new(),
        }
    }

    /// The service in this process, pausing as `boundaries` say.
    pub async fn serve(&self, boundaries: Boundaries) -> InProcess<DB> {
        self.serve_configured(boundaries, |idem| idem).await
    }

    /// The same, its `Idem` configured by `configure`.
    pub async fn serve_configured(
        &self,
        boundaries: Boundaries,
        configure: impl FnOnce(Idem<DB>) -> Idem<DB>,
    ) -> InProcess<DB> {
        let mut state = phased::state::<DB>(&self.config, boundaries).await;
        state.idem = configure(state.idem);
        let (addr, task) = phased::serve(state.clone()).await;
        InProcess { addr, state, task }
    }

    /// The service in a child process.
    pub async fn child(&self, options: ChildOptions) -> ChildServer {
        ChildServer::spawn(self.config.child_env::<DB>(options)).await
    }

    /// `POST PATH` of [`BODY`] with `key`, to the service at `addr`.
    pub fn post(&self, addr: SocketAddr, key: &str) -> reqwest::RequestBuilder {
        self.post_to(addr, phased::PATH, key, BODY)
    }

    /// `POST path` of `body` with `key` for this fixture's account.
    pub fn post_to(
        &self,
        addr: SocketAddr,
        path: &str,
        key: &str,
        body: &str,
    ) -> reqwest::RequestBuilder {
        self.post_as(&self.account, addr, path, key, body)
    }

    /// The same, for `account`.
    pub fn post_as(
        &self,
        account: &str,
        addr: SocketAddr,
        path: &str,
        key: &str,
        body: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .post(format!("http://{addr}{path}"))
            .header("authorization", format!("Bearer {account}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .timeout(Duration::from_secs(30))
    }

    /// The account's payments.
    pub async fn payments(&self) -> Vec<PaymentRow> {
        DB::payments(&self.admin, &self.config.payments, &self.account).await
    }

    /// The row of the account's `key`.
    pub async fn key_row(&self, key: &str) -> Option<KeyRow> {
        DB::key_row(&self.admin, &self.config.keys, &self.account, key).await
    }

    /// Returns the row of `key` once it holds a response (within 30 s).
    pub async fn until_finished(&self, key: &str) -> KeyRow {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let row = self.key_row(key).await;
            if let Some(
                row @ KeyRow {
                    status: Some(_), ..
                },
            ) = row
            {
                return row;
            }
            assert!(
                Instant::now() < deadline,
                "key {key} unfinished after 30 s: {row:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Asserts that the account made exactly one payment, the one `answer`
    /// (a 201) describes, succeeded with the provider's first charge and
    /// written by the attempt that answered; returns it.
    pub async fn assert_one_payment(&self, answer: &Answer, context: &str) -> Payment {
        assert_eq!(answer.status, StatusCode::CREATED, "{context}: {answer:?}");
        let payment: Payment = serde_json::from_slice(&answer.body)
            .unwrap_or_else(|_| panic!("{context}: not a payment: {answer:?}"));
        let expected = PaymentRow {
            id: payment.id,
            amount: 1250,
            currency: "eur".into(),
            status: "succeeded".into(),
            provider_id: Some("pay_1".into()),
            finished_by: Some(payment.attempt.clone()),
        };
        assert_eq!(self.payments().await, [expected], "{context}");
        assert_eq!(payment.provider_id, "pay_1", "{context}");
        payment
    }

    /// Drops the tables (and the database file) and stops the provider.
    pub async fn discard(self) {
        for table in [&self.config.keys, &self.config.payments] {
            DB::drop_table(&self.admin, table).await;
        }
        self.admin.close().await;
        DB::remove_database(&self.config.database);
    }
}

/// The service in this process, stopped when dropped.
pub struct InProcess<DB: PhasedDb> {
    pub addr: SocketAddr,
    pub state: PhasedState<DB>,
    task: tokio::task::JoinHandle<()>,
}

impl<DB: PhasedDb> Drop for InProcess<DB> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends `request()` until it is answered other than 409, waiting as each
/// 409's `Retry-After` says (which must be there, and no longer than
/// `lease`), for up to 30 s; returns the answer and the 409s before it.
pub async fn retry_while_in_use(
    request: impl Fn() -> reqwest::RequestBuilder,
    lease: Duration,
) -> (Answer, usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut conflicts = 0;
    loop {
        let answer = send(request()).await;
        if answer.status != StatusCode::CONFLICT {
            return (answer, conflicts);
        }
        conflicts += 1;
        assert_eq!(answer.problem_code(), "idempotency_key_in_use");
        let wait = retry_after(&answer);
        assert!(
            wait <= lease.as_secs_f64().ceil() as u64,
            "Retry-After {wait} s is longer than the lease: {answer:?}"
        );
        assert!(
            Instant::now() < deadline,
            "still 409 after 30 s: {answer:?}"
        );
        tokio::time::sleep(Duration::from_secs(wait)).await;
    }
}

/// A 409's `Retry-After`, in whole seconds (at least one).
pub fn retry_after(answer: &Answer) -> u64 {
    let wait: u64 = answer
        .header("retry-after")
        .unwrap_or_else(|| panic!("a 409 without Retry-After: {answer:?}"))
        .parse()
        .expect("Retry-After in seconds");
    assert!(wait >= 1, "Retry-After 0 invites a busy loop: {answer:?}");
    wait
}

/// The service in a child process: the test binary run again, its
/// `phased_child_server` test serving until killed.
pub struct ChildServer {
    pub addr: SocketAddr,
    process: Child,
    boundaries: mpsc::UnboundedReceiver<Boundary>,
    seen: Vec<Boundary>,
}

impl ChildServer {
    async fn spawn(env: Vec<(&'static str, String)>) -> Self {
        let mut process = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "phased_child_server",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .envs(env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
        let listening = async {
            loop {
                let line = lines.next_line().await.unwrap();
                let line = line.expect("the child server exited before listening");
                // libtest may print "test phased_child_server ... " first.
                if let Some((_, addr)) = line.split_once("LISTENING ") {
                    break addr.trim().parse().unwrap();
                }
            }
        };
        let addr = tokio::time::timeout(Duration::from_secs(30), listening)
            .await
            .expect("the child server listening within 30 s");
        let (tx, boundaries) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some((_, name)) = line.split_once("BOUNDARY ") {
                    let boundary = Boundary::parse(name.trim()).expect("a boundary's name");
                    let _ = tx.send(boundary);
                }
            }
        });
        Self {
            addr,
            process,
            boundaries,
            seen: Vec::new(),
        }
    }

    /// Returns once a request of this process has announced `boundary`
    /// (within 30 s).
    pub async fn until_boundary(&mut self, boundary: Boundary) {
        let reached = async {
            while let Some(seen) = self.boundaries.recv().await {
                self.seen.push(seen);
                if seen == boundary {
                    return;
                }
            }
            panic!(
                "the child server exited before `{boundary}`: saw {:?}",
                self.seen
            );
        };
        tokio::time::timeout(Duration::from_secs(30), reached)
            .await
            .unwrap_or_else(|_| panic!("no `{boundary}` within 30 s: saw {:?}", self.seen));
    }

    /// SIGKILLs the process; returns every boundary it announced.
    pub async fn kill(mut self) -> Vec<Boundary> {
        self.process.kill().await.unwrap();
        while let Some(seen) = self.boundaries.recv().await {
            self.seen.push(seen);
        }
        self.seen
    }
}
