//! Sending one [`Intent`] with plain reqwest: every attempt keyed, retried
//! by the policy, the answer read in full and typed.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use rand::{Rng, SeedableRng, rngs::StdRng};
use reqwest::{Client, IntoUrl, Method, Request, RequestBuilder};

use crate::clock::Clock;
use crate::error::{Error, LastAttempt, Problem};
use crate::intent::Intent;
use crate::policy::RetryPolicy;
use crate::retry::{Attempt, Flow, Next, Outcome, Retrier, Tried};
use crate::rules::{self, IDEMPOTENCY_KEY, Verdict};

/// A `reqwest::Client` that sends each [`Intent`] until it has an answer.
///
/// Every attempt carries the intent's `Idempotency-Key`. Connection
/// failures, timeouts, 409 `idempotency_key_in_use`, 429, 502, 503 and 504
/// are retried, after `Retry-After` if the answer has one and a jittered
/// backoff otherwise (see [`RetryPolicy`]); every other answer ends the
/// operation, and so does an uncertain outcome whatever its status
/// ([`Error::Uncertain`]). A replay (`Idempotent-Replayed: true`) is the operation's
/// answer like any other and comes back as [`Sent::replayed`].
///
/// ```no_run
/// use idem_client::{IdemClient, Intent};
///
/// # async fn demo() -> Result<(), idem_client::Error> {
/// let client = IdemClient::new(reqwest::Client::new());
/// let intent = Intent::new(); // once per operation, outside any loop
/// let request = client
///     .post("http://127.0.0.1:3000/v1/charges")
///     .bearer_auth("acct_1")
///     .json(&serde_json::json!({"amount": 4200, "currency": "eur"}));
/// let sent = client.send(&intent, request).await?;
/// println!("{} (replayed: {})", sent.status, sent.replayed);
/// # Ok(()) }
/// ```
///
/// Clones share the connection pool, the randomness and the hook.
#[derive(Clone)]
pub struct IdemClient {
    client: Client,
    retrier: Retrier,
    not_found_is_done: bool,
}

impl IdemClient {
    /// Sends through `client`, with the default [`RetryPolicy`], the
    /// [`TokioClock`](crate::TokioClock) and randomness seeded by the OS.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            retrier: Retrier::new(),
            not_found_is_done: false,
        }
    }

    /// Retries by `policy`.
    pub fn with_policy(mut self, policy: RetryPolicy) -> Self {
        self.retrier.policy = policy;
        self
    }

    /// Takes the time and waits through `clock`, such as a
    /// [`ManualClock`](crate::ManualClock) in tests.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.retrier.clock = Arc::new(clock);
        self
    }

    /// Draws the backoff jitter from `rng`.
    pub fn with_rng<R: Rng + Send + 'static>(mut self, rng: R) -> Self {
        self.retrier.set_rng(rng);
        self
    }

    /// Draws the backoff jitter from a generator seeded with `seed`, so the
    /// waits repeat from run to run.
    pub fn with_seed(self, seed: u64) -> Self {
        self.with_rng(StdRng::seed_from_u64(seed))
    }

    /// Calls `hook` after every attempt, with what it got and the wait that
    /// follows.
    pub fn on_attempt(mut self, hook: impl Fn(&Attempt) + Send + Sync + 'static) -> Self {
        self.retrier.set_hook(Arc::new(hook));
        self
    }

    /// Whether a `DELETE` whose retry is answered 404 counts as done
    /// (default: `false`, a 404 is [`Error::Rejected`] like any other 4xx).
    ///
    /// A `DELETE` endpoint that is not `#[idempotent]` (or whose key expired)
    /// answers a retry with 404 when the earlier attempt deleted the
    /// resource and its answer was lost. With this on, such a 404 is `Ok`,
    /// with [`Sent::already_gone`] set (and [`Sent::status`] 404), when all
    /// of these hold:
    ///
    /// - the request's method is `DELETE` (other methods are untouched);
    /// - it is not the first attempt of this [`send`](Self::send), and an
    ///   earlier attempt may have reached the server: it timed out, lost
    ///   its connection or its answer, or got an answer that was retried
    ///   (409, 429, 502, 503, 504). A connection that could not even be
    ///   made sent nothing, so it does not count;
    /// - the 404 is not a replay: a replayed 404 is the stored answer of
    ///   the attempt that ran first, which found nothing to delete.
    ///
    /// A 404 on the first attempt stays an error: nothing this operation
    /// sent could have deleted the resource. A caller that resumes an
    /// intent it may have sent before a restart knows more than the sender
    /// does, and can treat that [`Error::Rejected`] 404 as done itself.
    ///
    /// It is the sender's setting, beside the retry policy, rather than the
    /// [`Intent`]'s, because it says how to read the server's answers, as
    /// the policy does, and an intent is only a key: it is stored, restored
    /// and derived as a plain string.
    ///
    /// ```no_run
    /// use idem_client::{IdemClient, Intent};
    ///
    /// # async fn demo() -> Result<(), idem_client::Error> {
    /// let client = IdemClient::new(reqwest::Client::new()).not_found_is_done(true);
    /// let intent = Intent::new();
    /// let request = client
    ///     .delete("http://127.0.0.1:3000/v1/cards/card_7")
    ///     .bearer_auth("acct_1");
    /// let sent = client.send(&intent, request).await?;
    /// if sent.already_gone {
    ///     // An earlier attempt deleted it and its answer was lost.
    ///     assert_eq!(sent.status, 404);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn not_found_is_done(mut self, yes: bool) -> Self {
        self.not_found_is_done = yes;
        self
    }

    /// The `reqwest::Client` it sends through.
    pub fn inner(&self) -> &Client {
        &self.client
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.retrier.policy
    }

    /// Starts a request on the inner client.
    pub fn request<U: IntoUrl>(&self, method: Method, url: U) -> RequestBuilder {
        self.client.request(method, url)
    }

    /// Starts a `POST` on the inner client.
    pub fn post<U: IntoUrl>(&self, url: U) -> RequestBuilder {
        self.client.post(url)
    }

    /// Starts a `DELETE` on the inner client.
    pub fn delete<U: IntoUrl>(&self, url: U) -> RequestBuilder {
        self.client.delete(url)
    }

    /// Sends `request` for `intent` until it has an answer, and reads it.
    ///
    /// `request` is a [`RequestBuilder`] (sent with the client that made it)
    /// or a [`Request`] (sent with the inner client). Its body must be bytes,
    /// not a stream, so it can be sent again: a stream fails with
    /// [`Error::NotCloneable`] before anything is sent. An `Idempotency-Key`
    /// header already on the request is replaced by the intent's.
    ///
    /// Answers below 400 are `Ok` (and, with
    /// [`not_found_is_done`](Self::not_found_is_done), a `DELETE`'s 404 on a
    /// retry); see [`Error`] for the rest.
    pub async fn send(&self, intent: &Intent, request: impl Sendable) -> Result<Sent, Error> {
        let (client, request) = request.into_parts(&self.client);
        let request = request.map_err(Error::Transport)?;
        if request.try_clone().is_none() {
            return Err(Error::NotCloneable);
        }
        let clock = &*self.retrier.clock;
        let deleting = self.not_found_is_done && request.method() == Method::DELETE;
        let mut run = self.retrier.start();
        let result = loop {
            let gone_is_done = deleting && run.may_have_reached_server();
            let tried = attempt(
                &client,
                &request,
                intent,
                run.timeout(),
                clock,
                gone_is_done,
            )
            .await;
            match run.after(tried).await {
                Flow::Stop(value) => break Ok(value),
                Flow::Again => {}
                Flow::Exhausted(exhausted) => break Err(exhausted),
            }
        };
        let attempts = run.into_log();
        match result {
            Ok(Ok(answer)) => Ok(Sent {
                status: answer.status,
                headers: answer.headers,
                body: answer.body,
                replayed: answer.replayed,
                already_gone: answer.already_gone,
                attempts,
            }),
            Ok(Err(error)) => Err(error),
            Err(exhausted) => Err(Error::BudgetExhausted {
                attempts: exhausted.attempts,
                last: exhausted.last,
            }),
        }
    }
}

impl fmt::Debug for IdemClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdemClient")
            .field("client", &self.client)
            .field("policy", &self.retrier.policy)
            .field("not_found_is_done", &self.not_found_is_done)
            .finish_non_exhaustive()
    }
}

/// A request [`IdemClient::send`] takes: a [`RequestBuilder`] or a
/// [`Request`].
pub trait Sendable: sealed::Sealed {
    /// The client to send with and the request.
    #[doc(hidden)]
    fn into_parts(self, default: &Client) -> (Client, reqwest::Result<Request>);
}

impl Sendable for RequestBuilder {
    fn into_parts(self, _: &Client) -> (Client, reqwest::Result<Request>) {
        self.build_split()
    }
}

impl Sendable for Request {
    fn into_parts(self, default: &Client) -> (Client, reqwest::Result<Request>) {
        (default.clone(), Ok(self))
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for reqwest::RequestBuilder {}
    impl Sealed for reqwest::Request {}
}

/// The answer to an operation, read in full.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Sent {
    /// Its status: below 400, or 404 when [`already_gone`](Self::already_gone).
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
    /// Whether it was a replay of an earlier attempt's answer
    /// (`Idempotent-Replayed: true`): the operation was done once, by an
    /// attempt whose answer was lost or by another sender of this intent.
    pub replayed: bool,
    /// Whether this is a `DELETE`'s 404 counted as done by
    /// [`IdemClient::not_found_is_done`]: an earlier attempt may have
    /// deleted the resource and lost its answer, so the body is the 404's,
    /// not the deletion's. `false` for every real success.
    pub already_gone: bool,
    /// Every attempt made, in order; the last one got this answer.
    pub attempts: Vec<Attempt>,
}

impl Sent {
    /// The body as JSON.
    ///
    /// ```
    /// # fn demo(sent: idem_client::Sent) -> Result<(), serde_json::Error> {
    /// #[derive(serde::Deserialize)]
    /// struct Charge { id: i64 }
    /// let charge: Charge = sent.json()?;
    /// # Ok(()) }
    /// ```
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.body)
    }
}

/// A final answer, before the attempt log joins it.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    replayed: bool,
    already_gone: bool,
}

/// One attempt: send a keyed copy of `request`, read the whole answer,
/// judge it. With `gone_is_done`, a 404 that is not a replay is the
/// operation's answer, [`Sent::already_gone`].
async fn attempt(
    client: &Client,
    request: &Request,
    intent: &Intent,
    timeout: Option<Duration>,
    clock: &dyn Clock,
    gone_is_done: bool,
) -> Tried<Result<Answer, Error>, LastAttempt> {
    let mut request = request
        .try_clone()
        .expect("send checked the request clones before the first attempt");
    request
        .headers_mut()
        .insert(IDEMPOTENCY_KEY, intent.header_value());
    if let Some(timeout) = timeout {
        let current = request.timeout_mut();
        *current = Some(current.map_or(timeout, |t| t.min(timeout)));
    }
    let response = match client.execute(request).await {
        Ok(response) => response,
        Err(error) if rules::transport_retryable(&error) => return no_answer(error),
        Err(error) => {
            return stop(Outcome::transport(&error), Err(Error::Transport(error)));
        }
    };
    let status = response.status();
    let headers = response.headers().clone();
    // Any failure to read the answer is retried: the server committed or
    // not, and the key makes the retry safe either way.
    let body = match response.bytes().await {
        Ok(body) => body,
        Err(error) => return no_answer(error),
    };
    let replayed = rules::replayed(&headers);
    let problem = rules::is_problem(&headers)
        .then(|| Problem::parse(&body))
        .flatten();
    let outcome = Outcome::Status(status);
    let result = match rules::verdict(status, replayed, problem.as_ref()) {
        Verdict::Success => Ok(Answer {
            status,
            headers,
            body,
            replayed,
            already_gone: false,
        }),
        Verdict::Rejected if gone_is_done && status == StatusCode::NOT_FOUND && !replayed => {
            Ok(Answer {
                status,
                headers,
                body,
                replayed,
                already_gone: true,
            })
        }
        Verdict::Retry => {
            return Tried {
                outcome,
                replayed,
                next: Next::Retry {
                    retry_after: rules::retry_after(&headers, clock.wall()),
                    last: LastAttempt::Status { status, problem },
                },
            };
        }
        Verdict::KeyReused => Err(Error::KeyReused {
            problem: problem.unwrap_or_default(),
        }),
        // Judged by its problem, so `problem` is there.
        Verdict::Uncertain => Err(Error::Uncertain {
            status,
            problem: problem.unwrap_or_default(),
        }),
        Verdict::Rejected => Err(Error::Rejected {
            status,
            problem,
            body,
        }),
        Verdict::ServerError => Err(Error::ServerError {
            status,
            problem,
            body,
        }),
    };
    Tried {
        outcome,
        replayed,
        next: Next::Stop(result),
    }
}

fn stop<T, L>(outcome: Outcome, value: T) -> Tried<T, L> {
    Tried {
        outcome,
        replayed: false,
        next: Next::Stop(value),
    }
}

fn no_answer<T>(error: reqwest::Error) -> Tried<T, LastAttempt> {
    Tried {
        outcome: Outcome::transport(&error),
        replayed: false,
        next: Next::Retry {
            retry_after: None,
            last: LastAttempt::Transport(error),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Callers spawn sends on multi-threaded runtimes.
    #[allow(dead_code)]
    fn a_send_is_send(client: &IdemClient, intent: &Intent, request: RequestBuilder) {
        fn assert_send<T: Send>(_: T) {}
        assert_send(client.send(intent, request));
    }
}
