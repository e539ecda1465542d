//! The quickstart example as a newcomer runs it: a charge, its replay, and
//! the same key with another amount refused, against the real binary.

use idem_tests::examples::{binary, free_port, start_until};
use tokio::process::Command;

#[tokio::test]
async fn the_quickstart_charges_once_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut command = Command::new(binary("quickstart"));
    command
        .current_dir(dir.path())
        .env("ADDR", addr.to_string())
        .env_remove("DATABASE_URL");
    let listening = |line: &str| line.contains("quickstart listening on").then_some(());
    let (_server, ()) = start_until(command, "the quickstart example", listening).await;
    let http = reqwest::Client::new();
    let charge = |amount: i64| {
        http.post(format!("http://{addr}/v1/charges"))
            .bearer_auth("acct_1")
            .header("Idempotency-Key", "order-42")
            .json(&serde_json::json!({ "amount": amount }))
            .send()
    };
    let first = charge(1250).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["location"], "/v1/charges/1");
    let first = first.text().await.unwrap();
    let again = charge(1250).await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first, "the replay is verbatim");
    let other = charge(1).await.unwrap();
    assert_eq!(other.status(), 422);
    // The database the example made in its working directory holds one charge.
    let pool = sqlx::SqlitePool::connect(&format!(
        "sqlite:{}",
        dir.path().join("quickstart.db").display()
    ))
    .await
    .unwrap();
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(charges, 1);
}
