//! The `postgres` user, for the servers tests start that refuse to run as
//! root (PostgreSQL, Patroni, PgBouncer).

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: `geteuid` has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The `postgres` user's uid and gid when this process is root (`what`
/// names the server that refuses root, for the failure's message); this
/// process's own otherwise.
pub fn postgres_user(what: &str) -> (u32, u32) {
    if !is_root() {
        // SAFETY: neither call has preconditions.
        return unsafe { (libc::geteuid(), libc::getegid()) };
    }
    let name = c"postgres";
    // SAFETY: `name` is NUL-terminated; the entry is read at once, before
    // any other call could reuse its static buffer.
    let entry = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(
        !entry.is_null(),
        "{what} refuses to run as root, and there is no `postgres` user to run it as"
    );
    // SAFETY: checked non-null above.
    unsafe { ((*entry).pw_uid, (*entry).pw_gid) }
}
