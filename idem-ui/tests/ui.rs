//! Compile-time checks of `#[idempotent]`: every misuse is a clear error on
//! the offending token (`tests/ui/fail`), every valid use compiles and
//! routes (`tests/ui/pass`).
//!
//! Regenerate the expected output after a deliberate change with
//! `TRYBUILD=overwrite cargo test -p idem-ui --test ui`, then review
//! `git diff idem-ui/tests/ui`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
