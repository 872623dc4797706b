//! The SQL sandbox: nothing a query does changes the database file, runaway queries stop
//! near their deadline, results are bounded, and values follow Python `sqlite3` semantics.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floe_env::sandbox::{Sandbox, SandboxConfig, SqlError, Value};
use sha2::{Digest, Sha256};

fn make_db(dir: &Path) -> PathBuf {
    let path = dir.join("shop.sqlite");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL);
         INSERT INTO item VALUES (1, 'apple', 1.5), (2, 'pear', 2.0), (3, 'fig', NULL);
         CREATE INDEX item_name ON item (name);
         CREATE TABLE n (x INTEGER);
         WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000)
         INSERT INTO n SELECT x FROM c;",
    )
    .unwrap();
    path
}

fn sha256(path: &Path) -> Vec<u8> {
    Sha256::digest(std::fs::read(path).unwrap()).to_vec()
}

fn sandbox() -> Sandbox {
    Sandbox::new(SandboxConfig::default())
}

#[test]
fn writes_file_attaches_file_pragmas_and_extensions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let before = sha256(&db);
    let files_before = std::fs::read_dir(dir.path()).unwrap().count();
    let sandbox = sandbox();
    let attacks = [
        "DROP TABLE item",
        "INSERT INTO item VALUES (9, 'x', 0)",
        "UPDATE item SET price = 0",
        "DELETE FROM item",
        "CREATE TABLE evil (x)",
        "CREATE TABLE main.evil (x)",
        "ALTER TABLE item ADD COLUMN y",
        "ATTACH 'x.db' AS x",
        "ATTACH ':MEMORY:' AS x",
        "ATTACH 'file:x.db?mode=rwc' AS x",
        "ATTACH ':mem' || 'ory:' AS x",
        &format!("ATTACH '{}' AS again", db.display()),
        "PRAGMA journal_mode=WAL",
        "PRAGMA user_version = 7",
        "PRAGMA temp_store = FILE",
        "PRAGMA soft_heap_limit = 1",
        "PRAGMA writable_schema = 1",
        "VACUUM",
        &format!("VACUUM INTO '{}'", dir.path().join("copy.db").display()),
        "REINDEX",
        "ANALYZE",
        "SELECT load_extension('libevil')",
        "CREATE TEMP TABLE t AS SELECT load_extension('libevil')",
        "CREATE TEMP TRIGGER tr AFTER INSERT ON temp.x BEGIN DELETE FROM main.item; END",
        "SELECT 1; DROP TABLE item",
        "SELECT 1; DELETE FROM item;",
    ];
    for attack in attacks {
        let outcome = sandbox.query(&db, attack);
        assert!(outcome.is_err(), "{attack:?} should fail, got {outcome:?}");
    }
    // The connection pool is still healthy and sees the original data.
    let rows = sandbox
        .query(&db, "SELECT count(*) FROM item")
        .unwrap()
        .rows;
    assert_eq!(rows, vec![vec![Value::Integer(3)]]);
    assert_eq!(sha256(&db), before, "database file changed");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        files_before,
        "a journal, WAL or copy file appeared"
    );
}

/// What the reference (a fresh `mode=ro` Python `sqlite3` connection per query) runs
/// without error, with the rows it returns.
const HARMLESS: &[(&str, &[i64])] = &[
    ("ATTACH ':memory:' AS m", &[]),
    ("ATTACH '' AS m", &[]),
    ("PRAGMA foreign_keys = ON", &[]),
    ("PRAGMA case_sensitive_like = 1", &[]),
    ("PRAGMA busy_timeout = 100", &[100]),
    ("PRAGMA threads = 2", &[2]),
    ("PRAGMA query_only = 0", &[]),
    ("PRAGMA temp_store = MEMORY", &[]),
    ("CREATE TEMP TABLE s AS SELECT * FROM item LIMIT 5000;", &[]),
    ("CREATE TEMP TABLE s (x)", &[]),
    ("CREATE TABLE temp.s (x)", &[]),
    ("CREATE TEMP VIEW v AS SELECT name FROM item", &[]),
    ("BEGIN", &[]),
    ("BEGIN IMMEDIATE", &[]),
    ("SAVEPOINT s", &[]),
    ("ANALYZE temp", &[]),
];

#[test]
fn harmless_connection_statements_run_and_leave_the_file_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let before = std::fs::read(&db).unwrap();
    let sandbox = sandbox();
    for &(sql, want) in HARMLESS {
        let got = sandbox
            .query(&db, sql)
            .unwrap_or_else(|err| panic!("{sql:?} should run, got {err}"));
        let want: Vec<Vec<Value>> = want.iter().map(|&v| vec![Value::Integer(v)]).collect();
        assert_eq!(got.rows, want, "{sql:?}");
    }
    assert_eq!(std::fs::read(&db).unwrap(), before, "database file changed");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        ["shop.sqlite"],
        "a journal, WAL or attached file appeared"
    );
}

#[test]
fn connection_state_never_reaches_a_pooled_connection() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let sandbox = Sandbox::new(SandboxConfig {
        max_idle_per_db: 1,
        ..SandboxConfig::default()
    });
    let count = |sql: &str| sandbox.query(&db, sql).map(|r| r.rows);
    sandbox
        .query(&db, "PRAGMA case_sensitive_like = 1")
        .unwrap();
    assert_eq!(
        count("SELECT count(*) FROM item WHERE name LIKE 'APPLE'").unwrap(),
        vec![vec![Value::Integer(1)]],
        "LIKE is still case-insensitive"
    );
    sandbox.query(&db, "CREATE TEMP TABLE s (x)").unwrap();
    assert!(
        count("SELECT * FROM temp.s").is_err(),
        "the temp table is gone"
    );
    sandbox.query(&db, "ATTACH ':memory:' AS m").unwrap();
    assert!(
        count("SELECT * FROM m.sqlite_master").is_err(),
        "m is detached"
    );
    sandbox.query(&db, "BEGIN").unwrap();
    assert!(count("COMMIT").is_err(), "no transaction is open");
}

#[test]
fn strict_read_only_refuses_connection_state() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let strict = Sandbox::new(SandboxConfig {
        strict_read_only: true,
        ..SandboxConfig::default()
    });
    for &(sql, _) in HARMLESS {
        assert!(strict.query(&db, sql).is_err(), "{sql:?} should be refused");
    }
    assert!(strict.query(&db, "PRAGMA table_info(item)").is_ok());
}

/// A temp table lives in memory and may not outgrow the result byte budget.
#[test]
fn temp_tables_are_bounded_by_the_byte_budget() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let small = Sandbox::new(SandboxConfig {
        max_bytes: 64 << 10,
        ..SandboxConfig::default()
    });
    let outcome = small.query(
        &db,
        "CREATE TEMP TABLE big AS SELECT printf('%.1000c', 'x') FROM n",
    );
    assert!(
        matches!(&outcome, Err(SqlError::Sqlite(m)) if m.contains("full")),
        "{outcome:?}"
    );
}

#[test]
fn introspection_still_works() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let sandbox = sandbox();
    let info = sandbox.query(&db, "PRAGMA table_info(item)").unwrap();
    assert_eq!(info.rows.len(), 3);
    let tables = sandbox
        .query(
            &db,
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
        )
        .unwrap();
    assert_eq!(
        tables.rows,
        vec![
            vec![Value::Text("item".into())],
            vec![Value::Text("n".into())]
        ]
    );
}

fn assert_stops_near_deadline(sql: &str) {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let sandbox = sandbox();
    let deadline = Duration::from_secs(1);
    let start = Instant::now();
    let outcome = sandbox.query_with_timeout(&db, sql, deadline);
    let elapsed = start.elapsed();
    assert_eq!(outcome, Err(SqlError::Timeout(deadline)));
    assert!(
        elapsed < deadline.mul_f64(1.5),
        "{sql:?} ran {elapsed:?}, more than 1.5x the deadline"
    );
    // The interrupted connection is reusable.
    let rows = sandbox.query(&db, "SELECT 1").unwrap().rows;
    assert_eq!(rows, vec![vec![Value::Integer(1)]]);
}

#[test]
fn endless_recursive_cte_stops_at_the_deadline() {
    assert_stops_near_deadline(
        "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r",
    );
}

#[test]
fn four_way_cross_join_stops_at_the_deadline() {
    assert_stops_near_deadline("SELECT count(*) FROM n a, n b, n c, n d");
}

#[test]
fn results_are_bounded_in_rows_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let by_rows = Sandbox::new(SandboxConfig {
        max_rows: 10,
        ..SandboxConfig::default()
    });
    assert_eq!(
        by_rows.query(&db, "SELECT x FROM n").unwrap_err(),
        SqlError::TooManyRows(10)
    );
    assert_eq!(
        by_rows
            .query(&db, "SELECT x FROM n LIMIT 10")
            .unwrap()
            .rows
            .len(),
        10
    );
    let by_bytes = Sandbox::new(SandboxConfig {
        max_bytes: 1000,
        ..SandboxConfig::default()
    });
    assert_eq!(
        by_bytes
            .query(&db, "SELECT printf('%.500c', 'x') FROM n")
            .unwrap_err(),
        SqlError::TooManyBytes(1000)
    );
    // A single oversized value is refused inside SQLite, before it is allocated.
    assert!(matches!(
        by_bytes.query(&db, "SELECT length(randomblob(5000))"),
        Err(SqlError::Sqlite(message)) if message.contains("too big")
    ));
}

#[test]
fn values_compare_like_python() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let sandbox = sandbox();
    let set = |sql: &str| sandbox.query(&db, sql).unwrap().into_set();
    // 1 == 1.0 in Python, and they hash alike inside a frozenset.
    assert_eq!(set("SELECT 1, 'a'"), set("SELECT 1.0, 'a'"));
    assert_ne!(set("SELECT 1"), set("SELECT 1.5"));
    assert_ne!(set("SELECT '1'"), set("SELECT 1"));
    assert_ne!(set("SELECT x'61'"), set("SELECT 'a'"));
    assert_eq!(set("SELECT NULL"), set("SELECT NULL"));
    // 2^53 + 1 is not equal to the nearest float.
    assert_ne!(
        set("SELECT 9007199254740993"),
        set("SELECT 9007199254740993.0")
    );
    // Order and duplicates do not matter; column order does.
    assert_eq!(
        set("SELECT name FROM item ORDER BY id"),
        set("SELECT name FROM item UNION ALL SELECT name FROM item ORDER BY name DESC")
    );
    assert_ne!(
        set("SELECT id, name FROM item"),
        set("SELECT name, id FROM item")
    );
}

#[test]
fn statement_rules_follow_python_sqlite3() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let sandbox = sandbox();
    assert!(sandbox.query(&db, "SELECT 1;").is_ok());
    assert!(sandbox.query(&db, "SELECT 1; -- done").is_ok());
    assert_eq!(
        sandbox.query(&db, "SELECT 1;;").unwrap_err(),
        SqlError::MultipleStatements
    );
    assert_eq!(
        sandbox.query(&db, "SELECT 1; SELECT 2").unwrap_err(),
        SqlError::MultipleStatements
    );
    assert!(sandbox
        .query(&db, "-- nothing LIMIT 5000;")
        .unwrap()
        .rows
        .is_empty());
    assert!(matches!(
        sandbox.query(&db, "SELECT CAST(x'ff' AS TEXT)"),
        Err(SqlError::InvalidUtf8(_))
    ));
    assert!(matches!(
        sandbox.query(&db, "SELECT nope FROM item"),
        Err(SqlError::Sqlite(message)) if message.contains("no such column")
    ));
    assert!(matches!(
        sandbox.query(&dir.path().join("missing.sqlite"), "SELECT 1"),
        Err(SqlError::Open { .. })
    ));
}

#[test]
fn pooled_connections_serve_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let sandbox = Arc::new(sandbox());
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let sandbox = sandbox.clone();
            let db = db.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let k = (t * 50 + i) % 1000 + 1;
                    let rows = sandbox
                        .query(&db, &format!("SELECT x * 2 FROM n WHERE x = {k}"))
                        .unwrap()
                        .rows;
                    assert_eq!(rows, vec![vec![Value::Integer(2 * k as i64)]]);
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}
