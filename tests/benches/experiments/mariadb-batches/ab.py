"""MariaDB's CPU per request for the key table's batches, old and new.

Replays, on one connection and one request after another, the statements
a one-INSERT handler's request costs on MariaDB: `plain` (START
TRANSACTION, INSERT, COMMIT), `old` (idem's batches before 2026-12-06:
LAST_INSERT_ID and a check after the upsert, the lock wait set and
restored, a savepoint pair in the finish), `new` (today's: the upsert
fails on a live row, SET STATEMENT's lock wait, @@in_transaction checked
in the UPDATE), and `new` with either of the old halves back. Prints
mariadbd's CPU (utime + stime from /proc) per request, three runs each,
interleaved. Needs pymysql (`python3 -m venv v && v/bin/pip install
pymysql`); run as `v/bin/python ab.py 8000` on the machine MariaDB runs
on (root, empty password, database `test`). Its own tables `ab_keys`,
`ab_eff`, dropped at the end.
"""
import os, time, pymysql, sys
from pymysql.constants import CLIENT
pid = int(open('/proc/' + os.popen("pgrep -o mariadbd").read().strip() + '/stat').read().split()[0])
def cpu():
    f = open(f'/proc/{pid}/stat').read().split()
    return (int(f[13]) + int(f[14])) / os.sysconf('SC_CLK_TCK')
c = pymysql.connect(host='127.0.0.1', user='root', database='test', client_flag=CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS, autocommit=True)
cur = c.cursor()
cur.execute("DROP TABLE IF EXISTS ab_keys, ab_eff")
cur.execute("""CREATE TABLE ab_keys (scope VARBINARY(2048) NOT NULL, `key` VARBINARY(255) NOT NULL, fingerprint VARBINARY(32) NOT NULL,
 status SMALLINT NULL, headers LONGBLOB NULL, body LONGBLOB NULL, location LONGBLOB NULL, replay_until DATETIME(6) NULL,
 created_at DATETIME(6) NOT NULL, expires_at DATETIME(6) NOT NULL, PRIMARY KEY (scope, `key`), KEY e (expires_at), KEY r (replay_until)) ENGINE=InnoDB""")
cur.execute("CREATE TABLE ab_eff (id BIGINT AUTO_INCREMENT PRIMARY KEY, note VARCHAR(64))")
FP = "X'" + "ab"*32 + "'"
NOW = "UTC_TIMESTAMP(6)"
EXP = "expires_at <= UTC_TIMESTAMP(6)"
def upsert(first, prefix=""):
    return (f"{prefix}INSERT INTO ab_keys (scope, `key`, fingerprint, created_at, expires_at) VALUES (X'{{s}}', X'{{k}}', {FP}, {NOW}, {NOW} + INTERVAL 86400000000 MICROSECOND) "
            f"ON DUPLICATE KEY UPDATE fingerprint = {first}, status = IF({EXP}, NULL, status), headers = IF({EXP}, NULL, headers), body = IF({EXP}, NULL, body), "
            f"location = IF({EXP}, NULL, location), replay_until = IF({EXP}, NULL, replay_until), created_at = IF({EXP}, {NOW}, created_at), expires_at = IF({EXP}, {NOW} + INTERVAL 86400000000 MICROSECOND, expires_at)")
IDLE_SET = "@si = @@SESSION.idle_transaction_timeout, SESSION idle_transaction_timeout = 32"
RESTORE = "@r = 1, SESSION idle_transaction_timeout = CAST(COALESCE(@si, @@SESSION.idle_transaction_timeout) AS UNSIGNED)"
def update(check=""):
    return "UPDATE ab_keys SET status = 201" + check + ", headers = X'00', body = X'7b7d' WHERE scope = X'{s}' AND `key` = X'{k}' AND status IS NULL"
variants = {
 'old': (
   f"SET @s = @@SESSION.innodb_lock_wait_timeout, @c = LAST_INSERT_ID(1), SESSION innodb_lock_wait_timeout = 1, {IDLE_SET}; START TRANSACTION; "
   + upsert(f"IF(LAST_INSERT_ID({EXP}), {FP}, fingerprint)") + "; SET SESSION innodb_lock_wait_timeout = @s, @t = ~0 + (LAST_INSERT_ID() = 0)",
   "SAVEPOINT o; RELEASE SAVEPOINT o; " + update() + f"; SET @st = ~0 + (ROW_COUNT() <> 1), {RESTORE}; COMMIT AND CHAIN"),
 'new': (
   f"SET @s = @@SESSION.innodb_lock_wait_timeout, {IDLE_SET}; START TRANSACTION; "
   + upsert(f"IF(~0 + (NOT ({EXP})) > 0, {FP}, fingerprint)", "SET STATEMENT innodb_lock_wait_timeout = 1 FOR "),
   update(" + ('' REGEXP IF(@@in_transaction = 0, '(', '')) - 1") + f"; SET @st = ~0 + (ROW_COUNT() <> 1), {RESTORE}; COMMIT AND CHAIN"),
 'new_savepoint': (
   f"SET @s = @@SESSION.innodb_lock_wait_timeout, {IDLE_SET}; START TRANSACTION; "
   + upsert(f"IF(~0 + (NOT ({EXP})) > 0, {FP}, fingerprint)", "SET STATEMENT innodb_lock_wait_timeout = 1 FOR "),
   "SAVEPOINT o; RELEASE SAVEPOINT o; " + update() + f"; SET @st = ~0 + (ROW_COUNT() <> 1), {RESTORE}; COMMIT AND CHAIN"),
 'new_setrestore': (
   f"SET @s = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = 1, {IDLE_SET}; START TRANSACTION; "
   + upsert(f"IF(~0 + (NOT ({EXP})) > 0, {FP}, fingerprint)") + "; SET SESSION innodb_lock_wait_timeout = @s",
   update(" + ('' REGEXP IF(@@in_transaction = 0, '(', '')) - 1") + f"; SET @st = ~0 + (ROW_COUNT() <> 1), {RESTORE}; COMMIT AND CHAIN"),
 'plain': ("START TRANSACTION", "COMMIT"),
}
N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
def run(name, n, tag):
    claim, finish = variants[name]
    t0 = cpu()
    for i in range(n):
        s, k = (tag + name).encode().hex(), f"{i:08d}".encode().hex()
        cur.execute(claim.format(s=s, k=k))
        while cur.nextset(): pass
        cur.execute("INSERT INTO ab_eff (note) VALUES ('x')")
        cur.execute(finish.format(s=s, k=k))
        while cur.nextset(): pass
        if name != 'plain':
            cur.execute("ROLLBACK")
    return (cpu() - t0) / n * 1e6
order = ['plain', 'old', 'new', 'new_savepoint', 'new_setrestore']
res = {n: [] for n in order}
for r in range(3):
    for name in order:
        res[name].append(run(name, N, f"r{r}"))
for name in order:
    v = sorted(res[name])
    print(f"{name:16s} mariadbd CPU us/request: median {v[1]:.0f}  (runs {', '.join(f'{x:.0f}' for x in res[name])})")
cur.execute("DROP TABLE ab_keys, ab_eff")
