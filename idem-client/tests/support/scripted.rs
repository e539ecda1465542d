//! A real HTTP server on 127.0.0.1:0 that answers each request with the next
//! reply of its script and records what it received.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// One scripted answer.
#[derive(Clone)]
pub enum Reply {
    /// This status, headers and body.
    Answer {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Never answer (until the client goes away).
    Hang,
}

impl Reply {
    /// A plain answer.
    pub fn status(status: u16) -> Self {
        Self::Answer {
            status,
            headers: Vec::new(),
            body: format!("status {status}"),
        }
    }

    /// A `201` with a JSON body.
    pub fn created(body: &str) -> Self {
        Self::Answer {
            status: 201,
            headers: vec![("content-type", "application/json".into())],
            body: body.into(),
        }
    }

    /// An `idem` problem+json answer with this code.
    pub fn problem(status: u16, code: &str) -> Self {
        Self::Answer {
            status,
            headers: vec![("content-type", "application/problem+json".into())],
            body: format!(
                r#"{{"type":"about:blank","title":"scripted","status":{status},"code":"{code}"}}"#
            ),
        }
    }

    /// An `idem` problem+json answer with this code and what it says of the
    /// operation: `operation_state` and `safe_new_key` (true only for
    /// `not_started`), as every `idem` problem carries them.
    pub fn idem_problem(status: u16, code: &str, state: &str) -> Self {
        let safe = state == "not_started";
        Self::Answer {
            status,
            headers: vec![("content-type", "application/problem+json".into())],
            body: format!(
                r#"{{"type":"about:blank","title":"scripted","status":{status},"code":"{code}","operation_state":"{state}","safe_new_key":{safe}}}"#
            ),
        }
    }

    /// Adds a header.
    pub fn with(mut self, name: &'static str, value: impl Into<String>) -> Self {
        if let Self::Answer { headers, .. } = &mut self {
            headers.push((name, value.into()));
        }
        self
    }

    /// Marks the answer as a replay.
    pub fn replayed(self) -> Self {
        self.with("idempotent-replayed", "true")
    }
}

/// What the server received.
#[derive(Debug, Clone)]
pub struct Received {
    /// Every `Idempotency-Key` header value, in order.
    pub keys: Vec<String>,
    pub body: Bytes,
}

#[derive(Clone)]
struct Script {
    replies: Arc<Vec<Reply>>,
    received: Arc<Mutex<Vec<Received>>>,
}

/// The running server; it stops when dropped.
pub struct Scripted {
    pub url: String,
    received: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Scripted {
    /// Serves `replies`, one per request, then 500 "script exhausted".
    pub async fn start(replies: Vec<Reply>) -> Self {
        let script = Script {
            replies: Arc::new(replies),
            received: Arc::default(),
        };
        let received = script.received.clone();
        let app = axum::Router::new().fallback(answer).with_state(script);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            received,
            task,
        }
    }

    /// The requests received so far.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(State(script): State<Script>, headers: HeaderMap, body: Bytes) -> Response {
    let keys = headers
        .get_all("idempotency-key")
        .iter()
        .map(|value| value.to_str().unwrap().to_owned())
        .collect();
    let index = {
        let mut received = script.received.lock().unwrap();
        received.push(Received { keys, body });
        received.len() - 1
    };
    match script.replies.get(index) {
        Some(Reply::Answer {
            status,
            headers,
            body,
        }) => {
            let mut response =
                (StatusCode::from_u16(*status).unwrap(), body.clone()).into_response();
            for (name, value) in headers {
                response.headers_mut().insert(
                    HeaderName::from_static(name),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            response
        }
        Some(Reply::Hang) => std::future::pending().await,
        None => (StatusCode::INTERNAL_SERVER_ERROR, "script exhausted").into_response(),
    }
}
