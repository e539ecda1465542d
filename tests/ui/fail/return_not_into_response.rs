use axum::Router;
use axum::routing::post;
use idem::{Idem, Tx, idempotent};
use sqlx::Postgres;

struct Receipt;

#[idempotent(scope = "account")]
async fn create(account: String, _tx: Tx<Postgres>) -> Receipt {
    let _ = account;
    Receipt
}

fn main() {
    let _: Router<Idem<Postgres>> = Router::new().route("/", post(create));
}
