//! A real browser for the operator page's tests: headless Chromium driven
//! over its DevTools protocol (JSON messages on a WebSocket), with what the
//! tests need and no more: open a page, navigate, type, click, evaluate,
//! wait for a condition, read cookies, take a screenshot.
//!
//! Chromium is the Debian package `chromium` (`cargo xtask setup` installs
//! it), or the binary `$CHROMIUM` names. A missing browser fails the test
//! loudly: never a silent skip.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

/// How long a command or a wait may take.
const PATIENCE: Duration = Duration::from_secs(30);

type Waiting = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, Value>>>>>;

/// A headless Chromium, killed (and its profile deleted) when dropped.
pub struct Browser {
    cdp: Cdp,
    _child: Child,
    _profile: tempfile::TempDir,
}

/// The DevTools connection: commands out, their answers matched by id.
#[derive(Clone)]
struct Cdp {
    out: mpsc::UnboundedSender<Message>,
    waiting: Waiting,
    next: Arc<AtomicU64>,
}

impl Cdp {
    /// Connects to the browser's DevTools at `url`: one task writes the
    /// commands, one reads the answers and hands each to its caller.
    async fn connect(url: &str) -> Cdp {
        let (socket, _) = tokio_tungstenite::connect_async(url)
            .await
            .expect("the DevTools WebSocket");
        let (mut sink, mut stream) = socket.split();
        let (out, mut outgoing) = mpsc::unbounded_channel::<Message>();
        tokio::spawn(async move {
            while let Some(message) = outgoing.recv().await {
                if sink.send(message).await.is_err() {
                    break;
                }
            }
        });
        let waiting: Waiting = Arc::default();
        let answers = Arc::clone(&waiting);
        tokio::spawn(async move {
            while let Some(Ok(message)) = stream.next().await {
                let Message::Text(text) = message else {
                    continue;
                };
                let message: Value = serde_json::from_str(&text).expect("DevTools JSON");
                // Events (no id) are not needed: waits poll the page.
                let Some(id) = message["id"].as_u64() else {
                    continue;
                };
                if let Some(tx) = answers.lock().unwrap().remove(&id) {
                    let answer = match message.get("error") {
                        Some(error) => Err(error.clone()),
                        None => Ok(message["result"].clone()),
                    };
                    let _ = tx.send(answer);
                }
            }
            // Dropping the senders tells every waiting call.
            answers.lock().unwrap().clear();
        });
        Cdp {
            out,
            waiting,
            next: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Sends `method` with `params` (to the page of `session`, if any) and
    /// returns its result; a protocol error panics with its message.
    async fn call(&self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut command = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            command["sessionId"] = json!(session);
        }
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().unwrap().insert(id, tx);
        self.out
            .send(Message::text(command.to_string()))
            .expect("the DevTools connection is open");
        match tokio::time::timeout(PATIENCE, rx).await {
            Ok(Ok(Ok(result))) => result,
            Ok(Ok(Err(error))) => panic!("{method}: {error}"),
            Ok(Err(_)) => panic!("{method}: the browser closed its DevTools connection"),
            Err(_) => panic!("{method}: no answer within {PATIENCE:?}"),
        }
    }
}

impl Browser {
    /// Starts Chromium headless, with a fresh profile, and connects.
    pub async fn start() -> Browser {
        let program = std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".to_owned());
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(&program)
            .args([
                "--headless",
                // The tests run as root in a container: no user namespace
                // sandbox there, and a small /dev/shm.
                "--no-sandbox",
                "--disable-dev-shm-usage",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--remote-debugging-port=0",
                "--window-size=1280,900",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "the operator page's tests need Chromium: `{program}` does not start \
                     ({error}). Install the Debian package `chromium` (`cargo xtask setup` \
                     does), or name the binary in $CHROMIUM."
                )
            });
        // It says where its DevTools listen on stderr, once ready.
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let find = async {
            while let Some(line) = lines.next_line().await.expect("chromium's stderr") {
                if let Some((_, url)) = line.split_once("DevTools listening on ") {
                    return url.trim().to_owned();
                }
            }
            panic!("chromium exited before listening for DevTools");
        };
        let url = tokio::time::timeout(PATIENCE, find)
            .await
            .expect("chromium listening for DevTools within 30 s");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Browser {
            cdp: Cdp::connect(&url).await,
            _child: child,
            _profile: profile,
        }
    }

    /// A new tab, at `about:blank`.
    pub async fn page(&self) -> Page {
        let target = self
            .cdp
            .call(None, "Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let attached = self
            .cdp
            .call(
                None,
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await;
        let page = Page {
            cdp: self.cdp.clone(),
            session: attached["sessionId"].as_str().unwrap().to_owned(),
        };
        page.call("Page.enable", json!({})).await;
        page.call("Runtime.enable", json!({})).await;
        page.call("Network.enable", json!({})).await;
        page
    }
}

/// One tab of the browser.
pub struct Page {
    cdp: Cdp,
    session: String,
}

impl Page {
    /// A DevTools command on this tab.
    pub async fn call(&self, method: &str, params: Value) -> Value {
        self.cdp.call(Some(&self.session), method, params).await
    }

    /// Goes to `url` and waits for the document it loads.
    pub async fn goto(&self, url: &str) {
        let navigated = self.call("Page.navigate", json!({"url": url})).await;
        if let Some(error) = navigated.get("errorText") {
            panic!("navigating to {url}: {error}");
        }
        self.loaded().await;
    }

    /// Waits until the tab holds a complete document.
    pub async fn loaded(&self) {
        self.wait_for("a loaded document", "document.readyState === 'complete'")
            .await;
    }

    /// The value of the JavaScript `expression` (awaited if a promise);
    /// `Err` with the exception's text if it threw.
    pub async fn try_eval(&self, expression: &str) -> Result<Value, String> {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        match result.get("exceptionDetails") {
            Some(details) => Err(details.to_string()),
            None => Ok(result["result"]["value"].clone()),
        }
    }

    /// The value of `expression`; panics if it throws.
    pub async fn eval(&self, expression: &str) -> Value {
        self.try_eval(expression)
            .await
            .unwrap_or_else(|error| panic!("{expression}: {error}"))
    }

    /// Polls `expression` until it is truthy (a navigation in between is
    /// waited out), and returns its value; panics after 30 s with `what`.
    pub async fn wait_for(&self, what: &str, expression: &str) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let last = match self.try_eval(expression).await {
                Ok(value) if truthy(&value) => return value,
                Ok(value) => value.to_string(),
                Err(error) => error,
            };
            assert!(
                Instant::now() < deadline,
                "the page never showed {what} (`{expression}` was {last}); it is at {}",
                self.try_eval("location.href").await.unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Types `text` into the element `selector` finds, as a keyboard would
    /// (focus, then text input).
    pub async fn type_into(&self, selector: &str, text: &str) {
        let selector_js = serde_json::to_string(selector).unwrap();
        self.eval(&format!(
            "(() => {{ const e = document.querySelector({selector_js}); e.focus(); \
             if ('value' in e) e.value = ''; return true; }})()"
        ))
        .await;
        self.call("Input.insertText", json!({"text": text})).await;
    }

    /// Clicks the element `selector` finds, with the mouse, at its centre.
    pub async fn click(&self, selector: &str) {
        let selector_js = serde_json::to_string(selector).unwrap();
        let rect = self
            .eval(&format!(
                "(() => {{ const e = document.querySelector({selector_js}); \
                 e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect(); \
                 return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
            ))
            .await;
        let (x, y) = (rect[0].as_f64().unwrap(), rect[1].as_f64().unwrap());
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}),
            )
            .await;
        }
    }

    /// Presses Enter in the focused element (a form's implicit submission).
    pub async fn press_enter(&self) {
        for kind in ["keyDown", "keyUp"] {
            self.call(
                "Input.dispatchKeyEvent",
                json!({"type": kind, "key": "Enter", "code": "Enter",
                       "windowsVirtualKeyCode": 13, "text": "\r"}),
            )
            .await;
        }
    }

    /// The browser's cookies for `url`, HttpOnly ones included.
    pub async fn cookies(&self, url: &str) -> Vec<Value> {
        let cookies = self
            .call("Network.getCookies", json!({"urls": [url]}))
            .await;
        cookies["cookies"].as_array().cloned().unwrap_or_default()
    }

    /// Lays the page out for a `width` x `height` CSS-pixel screen (`mobile`:
    /// a phone's, with its viewport meta honoured).
    pub async fn screen(&self, width: u32, height: u32, mobile: bool) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}),
        )
        .await;
    }

    /// A PNG of the whole page, saved at `path` (its folder created).
    pub async fn screenshot(&self, path: &Path) {
        let metrics = self.call("Page.getLayoutMetrics", json!({})).await;
        let size = &metrics["cssContentSize"];
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({"format": "png", "captureBeyondViewport": true, "clip": {
                    "x": 0, "y": 0, "scale": 1,
                    "width": size["width"], "height": size["height"],
                }}),
            )
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("base64 screenshot");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}
