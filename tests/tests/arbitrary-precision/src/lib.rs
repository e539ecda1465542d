//! Nothing to build: the checks are in `tests/`.
