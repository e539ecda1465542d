// The shared caller and application state.
use idem_ui as support;

use idem::{Tx, idempotent};
use sqlx::Postgres;
use support::Account;

struct Charges;

impl Charges {
    #[idempotent(scope = "account")]
    async fn create(&self, account: Account, mut tx: Tx<Postgres>) -> &'static str {
        let _ = (account, &mut tx);
        "created"
    }
}

fn main() {
    let _ = Charges;
}
