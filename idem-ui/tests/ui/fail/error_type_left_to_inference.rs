// An error type left to inference where a sqlx error converts into it (a
// phase's closure that never says its error type, a helper generic over
// it): rustc lists every `From<sqlx::Error>` impl it knows of, and none may
// be a type of idem's internals, which a user cannot name. (A closure
// spells its own path in rustc's help, so the case is a generic function:
// the list of candidates is the same.) The fix is to name the type.

use idem as _;

fn insert<E: From<sqlx::Error>>(done: Result<i64, sqlx::Error>) -> Result<i64, E> {
    Ok(done?)
}

fn main() {
    let _ = insert(Ok(1));
}
