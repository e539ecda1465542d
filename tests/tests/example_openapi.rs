//! The `charges` example's OpenAPI document, against the real binary: it
//! is OpenAPI 3.1 (checked by openapi-spec-validator), it documents the
//! `Idempotency-Key` header and `idem`'s problem responses on each
//! idempotent route and on no other, and schemathesis, run against the
//! server with it, finds no failure.
//!
//! Both need Python 3 with `schemathesis` and `openapi-spec-validator` at
//! pinned versions: the tests make a virtual environment with them under
//! `target/` on first use (from PyPI; `python3` with its `venv` module is
//! all the machine needs), or use the interpreter `IDEM_TEST_PYTHON` names.
//! Missing, they fail, never skip.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use idem_tests::examples::{self, free_port};
use serde_json::Value;
use tokio::process::{Child, Command};

/// An idempotent route: its path, method, retention, tombstone and lease.
type Route = (
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
);

/// The routes `#[idempotent]` handlers serve, with their retention, their
/// tombstone (the charges') and, for the phased one, its lease.
const IDEMPOTENT: [Route; 2] = [
    ("/v1/charges", "post", "PT24H", Some("PT720H"), None),
    ("/v1/payments", "post", "PT24H", None, Some("PT5S")),
];

/// The problems every idempotent route documents: status, the codes its
/// `code` member takes, and whether it carries `Retry-After`.
const PROBLEMS: [(&str, &[&str], bool); 4] = [
    (
        "400",
        &["idempotency_key_missing", "idempotency_key_invalid"],
        false,
    ),
    ("409", &["idempotency_key_in_use"], true),
    ("422", &["idempotency_key_reused"], false),
    ("503", &["idempotency_store_unavailable"], true),
];

/// The pinned Python tools.
const TOOLS: [&str; 2] = ["schemathesis==4.32.5", "openapi-spec-validator==0.9.0"];

/// How long schemathesis may take: its examples are bounded, this bounds a hang.
const SCHEMATHESIS_LIMIT: Duration = Duration::from_secs(180);

/// How long making the virtual environment may take (a download of the
/// tools and their dependencies).
const BOOTSTRAP_LIMIT: Duration = Duration::from_secs(300);

/// The interpreter with the tools: `IDEM_TEST_PYTHON`, or the virtual
/// environment under `target/` (made on first use, by one test of this
/// binary while the other waits; a half-made one is never used: it is made
/// aside and renamed into place).
async fn python() -> PathBuf {
    static PYTHON: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    PYTHON
        .get_or_init(async || match std::env::var_os("IDEM_TEST_PYTHON") {
            Some(python) => PathBuf::from(python),
            None => tokio::time::timeout(BOOTSTRAP_LIMIT, virtual_environment())
                .await
                .unwrap_or_else(|_| {
                    panic!("the Python tools installed within {BOOTSTRAP_LIMIT:?}")
                }),
        })
        .await
        .clone()
}

async fn virtual_environment() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary has a path");
    // target/<profile>/deps/<this binary>
    let target = exe
        .ancestors()
        .nth(3)
        .expect("test binaries live in target/<profile>/deps");
    let name = format!(
        "idem-test-python-{}",
        TOOLS.join("-").replace(['=', '.'], "_")
    );
    let venv = target.join(&name);
    let interpreter = venv.join("bin/python");
    if interpreter.is_file() {
        return interpreter;
    }
    let making = target.join(format!("{name}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&making);
    run(
        "python3 -m venv",
        Command::new("python3").args(["-m", "venv"]).arg(&making),
    )
    .await;
    let pip = making.join("bin/pip");
    run(
        "pip install",
        Command::new(&pip)
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(TOOLS),
    )
    .await;
    // Another process may have made it meanwhile: theirs stands.
    if std::fs::rename(&making, &venv).is_err() {
        let _ = std::fs::remove_dir_all(&making);
    }
    assert!(
        interpreter.is_file(),
        "no interpreter at {}",
        interpreter.display()
    );
    interpreter
}

/// Runs `command` (`what`, for the failure's message); a loud failure if
/// it cannot run or fails.
async fn run(what: &str, command: &mut Command) {
    let output = command
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|error| panic!("{what} could not run ({error}): these tests need python3"));
    assert!(
        output.status.success(),
        "{what} failed (these tests install {TOOLS:?} from PyPI):\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Python, with the modules these tests need: a loud failure otherwise.
async fn require_python_modules() {
    let python = python().await;
    let mut check = Command::new(&python);
    check.args([
        "-c",
        "import schemathesis, openapi_spec_validator; print(schemathesis.__version__)",
    ]);
    run(&format!("{} with the tools", python.display()), &mut check).await;
}

/// The example serving on a free port (with its operators' routes on, so
/// the document can be seen to leave them out), and its base URL.
async fn charges(dir: &Path) -> (Child, String) {
    let addr = free_port();
    let env = [
        ("PROVIDER_URL", None),
        ("ADMIN_TOKEN", Some("openapi-test")),
    ];
    (
        examples::charges(dir, addr, &env).await,
        format!("http://{addr}"),
    )
}

async fn document(base: &str) -> Value {
    let response = reqwest::get(format!("{base}/openapi.json")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    response.json().await.unwrap()
}

/// Every operation of the document: (path, method, operation).
fn operations(document: &Value) -> Vec<(&str, &str, &Value)> {
    let paths = document["paths"].as_object().expect("paths");
    let mut found = Vec::new();
    for (path, item) in paths {
        for (method, operation) in item.as_object().unwrap() {
            if [
                "get", "put", "post", "delete", "patch", "head", "options", "trace",
            ]
            .contains(&method.as_str())
            {
                found.push((path.as_str(), method.as_str(), operation));
            }
        }
    }
    found
}

fn key_parameter(operation: &Value) -> Option<&Value> {
    operation["parameters"].as_array()?.iter().find(|p| {
        p["in"] == "header"
            && p["name"]
                .as_str()
                .is_some_and(|name| name.eq_ignore_ascii_case("idempotency-key"))
    })
}

/// The codes a documented problem response's schema allows.
fn codes(response: &Value) -> Vec<&str> {
    let schema = &response["content"]["application/problem+json"]["schema"];
    let parts = schema["allOf"].as_array().expect("the problem schema");
    parts
        .iter()
        .filter_map(|part| part["properties"]["code"]["enum"].as_array())
        .flatten()
        .map(|code| code.as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_is_openapi_3_1_and_documents_the_idempotent_routes() {
    require_python_modules().await;
    let dir = tempfile::tempdir().unwrap();
    let (_server, base) = charges(dir.path()).await;
    let document = document(&base).await;

    let version = document["openapi"].as_str().expect("an `openapi` version");
    assert!(version.starts_with("3.1."), "{version}");
    validate(&document, dir.path()).await;

    let problem = &document["components"]["schemas"]["IdempotencyProblem"];
    for member in ["type", "title", "status", "code"] {
        assert!(
            problem["required"]
                .as_array()
                .unwrap()
                .contains(&member.into()),
            "{problem}"
        );
    }

    let operations = operations(&document);
    for (path, method, retention, tombstone, lease) in IDEMPOTENT {
        let operation = &document["paths"][path][method];
        let key = key_parameter(operation)
            .unwrap_or_else(|| panic!("{method} {path} documents the key: {operation}"));
        assert_eq!(key["required"], true, "{key}");
        assert_eq!(key["schema"]["type"], "string", "{key}");
        assert!(key["schema"]["pattern"].is_string(), "{key}");
        assert!(
            key["description"].as_str().unwrap().contains("255"),
            "{key}"
        );

        let responses = &operation["responses"];
        for (status, expected, retry_after) in PROBLEMS {
            let response = &responses[status];
            let documented = codes(response);
            for code in expected {
                assert!(documented.contains(code), "{path} {status}: {documented:?}");
            }
            assert_eq!(
                response["headers"]["Retry-After"].is_object(),
                retry_after,
                "{path} {status}: {response}"
            );
        }
        // The handler's own 400 and 422 (axum's JSON rejections) are kept
        // beside idem's problems.
        assert!(responses["422"]["content"]["text/plain"].is_object());
        assert!(responses["201"]["headers"]["Idempotent-Replayed"].is_object());
        assert!(responses["201"]["headers"]["Location"].is_object());

        let policy = &operation["x-idempotency"];
        assert_eq!(policy["retention"], retention, "{policy}");
        assert_eq!(policy["required"], true, "{policy}");
        assert_eq!(policy["replayHeader"], "Idempotent-Replayed", "{policy}");
        assert_eq!(policy["lease"].as_str(), lease, "{policy}");
        assert_eq!(policy["tombstone"].as_str(), tombstone, "{policy}");
        let expired = codes(&responses["409"]).contains(&"idempotency_key_expired");
        assert_eq!(expired, tombstone.is_some(), "{path}: {}", responses["409"]);
        let description = operation["description"].as_str().unwrap();
        assert!(description.contains("**Idempotent.**"), "{description}");
        assert!(description.contains("24 hours"), "{description}");
    }

    // Every other route is documented, without any of it.
    let others: Vec<_> = operations
        .iter()
        .filter(|(path, method, _)| !IDEMPOTENT.iter().any(|(p, m, ..)| p == path && m == method))
        .collect();
    let mut names: Vec<_> = others.iter().map(|(p, m, _)| format!("{m} {p}")).collect();
    names.sort();
    assert_eq!(names, ["get /v1/charges/{id}", "get /v1/payments/{id}"]);
    for (path, method, operation) in others {
        assert!(key_parameter(operation).is_none(), "{method} {path}");
        assert!(operation.get("x-idempotency").is_none(), "{method} {path}");
        let text = operation.to_string();
        assert!(!text.contains("problem+json"), "{method} {path}: {text}");
        assert!(
            !text.contains("Idempotent-Replayed"),
            "{method} {path}: {text}"
        );
    }
    // The operators' routes (on in this server) are not the public API's.
    assert!(
        !document["paths"]
            .as_object()
            .unwrap()
            .keys()
            .any(|path| path.starts_with("/admin")),
        "{}",
        document["paths"]
    );
}

/// openapi-spec-validator's OpenAPI 3.1 validator accepts the document.
async fn validate(document: &Value, dir: &Path) {
    let file = dir.join("openapi.json");
    std::fs::write(&file, document.to_string()).unwrap();
    let script = "import json, sys\n\
                  from openapi_spec_validator import OpenAPIV31SpecValidator\n\
                  OpenAPIV31SpecValidator(json.load(open(sys.argv[1]))).validate()\n\
                  print('valid')";
    let output = Command::new(python().await)
        .args(["-c", script])
        .arg(&file)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "the document is not valid OpenAPI 3.1:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_failure() {
    require_python_modules().await;
    let dir = tempfile::tempdir().unwrap();
    let (_server, base) = charges(dir.path()).await;
    let hooks = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis");
    let seed = std::env::var("IDEM_SCHEMATHESIS_SEED").unwrap_or_else(|_| "27".into());
    let script = "import sys\n\
                  from schemathesis.cli import schemathesis\n\
                  sys.argv[0] = 'schemathesis'\n\
                  schemathesis()";
    let mut command = Command::new(python().await);
    command
        .args(["-c", script, "run"])
        .arg(format!("{base}/openapi.json"))
        .args([
            "--header",
            "Authorization: Bearer acct_schemathesis",
            "--max-examples",
            "30",
            "--seed",
            &seed,
            "--request-timeout",
            "10",
            "--generation-database",
            "none",
            "--no-color",
            // The example's bearer token is the account's name: no bearer
            // is an invalid credential, so this check cannot hold.
            "--exclude-checks",
            "ignored_auth",
        ])
        .env("SCHEMATHESIS_HOOKS", "hooks")
        .env("PYTHONPATH", &hooks)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(SCHEMATHESIS_LIMIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("schemathesis finished within {SCHEMATHESIS_LIMIT:?}"))
        .expect("schemathesis runs");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures (seed {seed}):\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // It did test every operation, and some of them at length.
    assert!(report.contains("Tested: 4"), "{report}");
    assert!(report.contains("No issues found"), "{report}");
}
