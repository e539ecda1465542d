use idem::idempotent;

#[idempotent(scope = "account")]
struct Create;

fn main() {
    let _ = Create;
}
