//! The SQL sandbox both SQL environments execute model-written queries in.
//!
//! Safety comes from several independent layers, so that no single mistake lets a query
//! change a database file:
//! 1. databases are opened `SQLITE_OPEN_READ_ONLY` through the URI
//!    `file:<path>?mode=ro&immutable=1` (no journal, WAL or lock files are created);
//! 2. `PRAGMA query_only = 1`, and `SQLITE_LIMIT_ATTACHED` is 0 (no `ATTACH`, which also
//!    stops `VACUUM INTO`); `SQLITE_LIMIT_LENGTH` caps one value at the result byte budget;
//! 3. an authorizer allows only reads, functions other than `load_extension`, recursive CTEs
//!    and introspection pragmas, and denies everything else (writes, DDL, `ATTACH`,
//!    transactions, pragma assignments);
//! 4. a prepared statement that is not `sqlite3_stmt_readonly` is refused;
//! 5. extension loading stays disabled (SQLite's default; rusqlite's `load_extension`
//!    feature is off).
//!
//! **Harmless connection state.** The reference opens a fresh `mode=ro` connection per
//! query, so it runs statements that change only that connection: `ATTACH ':memory:'`,
//! connection-level pragma assignments (`PRAGMA foreign_keys = ON`), `TEMP` tables, views
//! and triggers, `BEGIN`/`SAVEPOINT`. Layer 3 on a pooled connection refuses them, but notes
//! that it did; such a statement is then run once more on a *scratch* connection that is
//! never pooled and is closed afterwards, so no state leaks into later queries. A scratch
//! connection keeps layers 1, 3 (widened to exactly those statements), 5 and the deadline,
//! and differs in three ways: `query_only` is off (SQLite applies it to the temp schema
//! too), `temp_store = MEMORY` with the temp schema capped at the result byte budget (temp
//! tables, sorters and their journals never touch a file), and up to 10 attached databases,
//! each of which must be `':memory:'` or `''` (a private temporary database, in memory here).
//! Writes to `main`, `ATTACH` of any file path, `VACUUM`, `temp_store` other than `MEMORY`
//! and every pragma not on the connection-level list stay refused: these are deliberate
//! differences from the reference, which would create or read other files.
//! [`SandboxConfig::strict_read_only`] (off by default) refuses connection state too.
//!
//! Each query runs under a deadline enforced inside SQLite by a progress handler every
//! 1000 VM instructions (as the reference does), and its result is bounded in rows and
//! bytes. Connections are pooled per database path; a connection serves one query at a time.
//!
//! Results follow Python `sqlite3` semantics, which the reference rewards are written in:
//! values are `int`/`float`/`str`/`bytes`/`None`, text that is not UTF-8 is an error, a
//! string with a second statement after the first is an error ("You can only execute one
//! statement at a time."), an empty or comment-only string returns no rows, and result sets
//! compare as `frozenset`s of row tuples, where `1 == 1.0`.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rusqlite::hooks::{AuthAction, AuthContext, Authorization};
use rusqlite::limits::Limit;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};

/// How long a query may run, and how big its result may be.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxConfig {
    /// Default per-query deadline (the reference's 30 s).
    pub timeout: Duration,
    /// Most result rows a query may return; more is an execution failure.
    pub max_rows: usize,
    /// Most result bytes (text and blob lengths, 8 per number) a query may return.
    pub max_bytes: usize,
    /// Idle connections kept per database path.
    pub max_idle_per_db: usize,
    /// Refuse statements that change only the connection (`ATTACH ':memory:'`,
    /// connection-level pragma assignments, `TEMP` tables, transactions) instead of running
    /// them on a scratch connection as the reference would (see the module docs). Off by
    /// default: on, floe scores such statements as failures where the reference runs them.
    pub strict_read_only: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            max_rows: 1_000_000,
            max_bytes: 256 << 20,
            max_idle_per_db: 32,
            strict_read_only: false,
        }
    }
}

/// Why a query produced no result. Every variant counts as an execution failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SqlError {
    /// The database could not be opened.
    #[error("cannot open database {path}: {message}")]
    Open {
        /// The database path.
        path: PathBuf,
        /// SQLite's message.
        message: String,
    },
    /// SQLite rejected or failed the statement (syntax error, missing table, denied write…).
    #[error("{0}")]
    Sqlite(String),
    /// More than one statement was given (Python `sqlite3`'s rule).
    #[error("You can only execute one statement at a time.")]
    MultipleStatements,
    /// The statement would modify a database.
    #[error("statement is not read-only")]
    NotReadOnly,
    /// The deadline passed; SQLite interrupted the query.
    #[error("query interrupted after its {0:?} deadline")]
    Timeout(Duration),
    /// The result has more rows than allowed.
    #[error("result exceeds {0} rows")]
    TooManyRows(usize),
    /// The result has more bytes than allowed.
    #[error("result exceeds {0} bytes")]
    TooManyBytes(usize),
    /// A text value is not UTF-8 (Python raises on these).
    #[error("Could not decode to UTF-8 column '{0}'")]
    InvalidUtf8(String),
}

/// One result value, with Python's equality: an integer equals a float of the same exact
/// value (`1 == 1.0`) and they hash alike, so sets of rows compare as in Python.
#[derive(Debug, Clone)]
pub enum Value {
    /// SQL NULL (`None`).
    Null,
    /// INTEGER (`int`).
    Integer(i64),
    /// REAL (`float`).
    Real(f64),
    /// TEXT (`str`).
    Text(String),
    /// BLOB (`bytes`).
    Blob(Vec<u8>),
}

impl Value {
    /// The integer this float is exactly equal to, if any.
    fn real_as_integer(real: f64) -> Option<i64> {
        // 2^63 is exactly representable; every integral float in [-2^63, 2^63) fits i64.
        const TWO_63: f64 = 9_223_372_036_854_775_808.0;
        (real.fract() == 0.0 && (-TWO_63..TWO_63).contains(&real)).then_some(real as i64)
    }
}

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::Null, Value::Null) => true,
            (Value::Integer(a), Value::Integer(b)) => a == b,
            // SQLite never returns NaN (it stores NULL), so `==` is an equivalence here.
            (Value::Real(a), Value::Real(b)) => a == b,
            (Value::Integer(i), Value::Real(r)) | (Value::Real(r), Value::Integer(i)) => {
                Value::real_as_integer(*r) == Some(*i)
            }
            (Value::Text(a), Value::Text(b)) => a == b,
            (Value::Blob(a), Value::Blob(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Value {}

impl Hash for Value {
    fn hash<H: Hasher>(&self, state: &mut H) {
        match self {
            Value::Null => state.write_u8(0),
            Value::Integer(i) => {
                state.write_u8(1);
                i.hash(state);
            }
            Value::Real(r) => match Value::real_as_integer(*r) {
                // Hash integral floats as their integer so that `1 == 1.0` hash alike.
                Some(i) => {
                    state.write_u8(1);
                    i.hash(state);
                }
                None => {
                    state.write_u8(2);
                    r.to_bits().hash(state);
                }
            },
            Value::Text(s) => {
                state.write_u8(3);
                s.hash(state);
            }
            Value::Blob(b) => {
                state.write_u8(4);
                b.hash(state);
            }
        }
    }
}

impl std::fmt::Display for Value {
    /// Python's `str()` of the value (`None`, `1`, `1.0`, `abc`, `b'\x00'`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Null => f.write_str("None"),
            Value::Integer(i) => write!(f, "{i}"),
            Value::Real(r) => f.write_str(&python_float_repr(*r)),
            Value::Text(s) => f.write_str(s),
            Value::Blob(bytes) => {
                f.write_str("b'")?;
                for &b in bytes {
                    match b {
                        b'\\' => f.write_str("\\\\")?,
                        b'\'' => f.write_str("\\'")?,
                        b'\n' => f.write_str("\\n")?,
                        b'\r' => f.write_str("\\r")?,
                        b'\t' => f.write_str("\\t")?,
                        0x20..=0x7e => write!(f, "{}", b as char)?,
                        _ => write!(f, "\\x{b:02x}")?,
                    }
                }
                f.write_str("'")
            }
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integral values, exponent
/// form outside `[1e-4, 1e16)`.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let magnitude = x.abs();
    if magnitude != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        // Rust's `{:e}` gives `1.5e-7`; Python writes `1.5e-07`.
        let s = format!("{x:e}");
        let (mantissa, exponent) = s.split_once('e').expect("`{:e}` has an exponent");
        let exponent: i32 = exponent.parse().expect("exponent is an integer");
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.abs());
    }
    let s = format!("{x}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// A result as Python's `frozenset(cursor.fetchall())`.
pub type RowSet = HashSet<Vec<Value>>;

/// The rows of one query, in the order SQLite returned them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct QueryResult {
    /// Result column names.
    pub columns: Vec<String>,
    /// Result rows.
    pub rows: Vec<Vec<Value>>,
}

impl QueryResult {
    /// The rows as a set (order and duplicates ignored), as the rewards compare them.
    pub fn into_set(self) -> RowSet {
        self.rows.into_iter().collect()
    }
}

/// Which of the two kinds of connection (module docs) a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Pooled and shared: reads only, its state never changes.
    Pooled,
    /// Used for one statement that changes connection state, then closed.
    Scratch,
}

/// A connection and the authorizer's note that the statement being prepared asked for
/// connection state (refused on a pooled connection, allowed on a scratch one).
struct SandboxConnection {
    conn: Connection,
    asked_for_state: Arc<AtomicBool>,
}

/// Read-only, time- and size-bounded SQL execution over pooled SQLite connections.
/// `Sync`: share one behind an `Arc` across scoring threads.
pub struct Sandbox {
    config: SandboxConfig,
    idle: Mutex<HashMap<PathBuf, Vec<SandboxConnection>>>,
}

impl Sandbox {
    /// A sandbox with no open connections yet.
    pub fn new(config: SandboxConfig) -> Self {
        Self {
            config,
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// The limits this sandbox enforces.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Runs one statement against `db` under the default deadline.
    pub fn query(&self, db: &Path, sql: &str) -> Result<QueryResult, SqlError> {
        self.query_with_timeout(db, sql, self.config.timeout)
    }

    /// Runs one statement against `db`; SQLite interrupts it once `timeout` has passed.
    pub fn query_with_timeout(
        &self,
        db: &Path,
        sql: &str,
        timeout: Duration,
    ) -> Result<QueryResult, SqlError> {
        let deadline = Instant::now() + timeout;
        let mut pooled = self.checkout(db)?;
        let result = self.run(&mut pooled, sql, deadline, timeout);
        let asked_for_state = pooled.asked_for_state.load(Ordering::Relaxed);
        // A connection left inside a transaction would leak state into the next query.
        if pooled.conn.is_autocommit() {
            self.give_back(db, pooled);
        }
        if result.is_err() && asked_for_state && !self.config.strict_read_only {
            let mut scratch = open_connection(db, self.config.max_bytes, Mode::Scratch)?;
            // Dropped when this returns: its temp tables, attachments and pragmas go with it.
            return self.run(&mut scratch, sql, deadline, timeout);
        }
        result
    }

    fn run(
        &self,
        connection: &mut SandboxConnection,
        sql: &str,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<QueryResult, SqlError> {
        connection
            .conn
            .progress_handler(1000, Some(move || Instant::now() >= deadline))
            .map_err(sqlite_error)?;
        connection.asked_for_state.store(false, Ordering::Relaxed);
        let conn = &connection.conn;
        let interrupted = |err: rusqlite::Error| {
            let is_interrupt =
                err.sqlite_error_code() == Some(rusqlite::ErrorCode::OperationInterrupted);
            if is_interrupt && Instant::now() >= deadline {
                SqlError::Timeout(timeout)
            } else {
                sqlite_error(err)
            }
        };
        let mut stmt = match conn.prepare(sql) {
            Ok(stmt) => stmt,
            // Python's sqlite3 runs an empty or comment-only string and returns no rows.
            Err(rusqlite::Error::Empty) => return Ok(QueryResult::default()),
            Err(rusqlite::Error::MultipleStatement) => return Err(SqlError::MultipleStatements),
            Err(err) => return Err(interrupted(err)),
        };
        if has_second_statement(sql, stmt.expanded_sql().as_deref()) {
            return Err(SqlError::MultipleStatements);
        }
        // Only a scratch connection runs a writing statement, and only one whose every
        // non-read action the authorizer allowed as connection state (`VACUUM` asks the
        // authorizer nothing, so it stays refused here).
        let allowed_state = connection.asked_for_state.load(Ordering::Relaxed);
        if !stmt.readonly() && !allowed_state {
            return Err(SqlError::NotReadOnly);
        }
        let columns: Vec<String> = stmt.column_names().map(String::from).collect();
        let width = columns.len();
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        let mut raw = stmt.raw_query();
        while let Some(row) = raw.next().map_err(interrupted)? {
            if rows.len() == self.config.max_rows {
                return Err(SqlError::TooManyRows(self.config.max_rows));
            }
            let mut values = Vec::with_capacity(width);
            for (i, column) in columns.iter().enumerate() {
                let value = match row.get_ref(i).map_err(sqlite_error)? {
                    ValueRef::Null => Value::Null,
                    ValueRef::Integer(v) => Value::Integer(v),
                    ValueRef::Real(v) => Value::Real(v),
                    ValueRef::Text(t) => {
                        bytes += t.len();
                        Value::Text(
                            std::str::from_utf8(t)
                                .map_err(|_| SqlError::InvalidUtf8(column.clone()))?
                                .to_owned(),
                        )
                    }
                    ValueRef::Blob(b) => {
                        bytes += b.len();
                        Value::Blob(b.to_vec())
                    }
                };
                bytes += 8;
                values.push(value);
            }
            if bytes > self.config.max_bytes {
                return Err(SqlError::TooManyBytes(self.config.max_bytes));
            }
            rows.push(values);
        }
        Ok(QueryResult { columns, rows })
    }

    fn checkout(&self, db: &Path) -> Result<SandboxConnection, SqlError> {
        let pooled = self
            .idle
            .lock()
            .expect("sandbox pool lock poisoned")
            .get_mut(db)
            .and_then(Vec::pop);
        match pooled {
            Some(conn) => Ok(conn),
            None => open_connection(db, self.config.max_bytes, Mode::Pooled),
        }
    }

    fn give_back(&self, db: &Path, conn: SandboxConnection) {
        let mut idle = self.idle.lock().expect("sandbox pool lock poisoned");
        let conns = idle.entry(db.to_path_buf()).or_default();
        if conns.len() < self.config.max_idle_per_db {
            conns.push(conn);
        }
    }
}

/// SQLite's own message (what Python's `str(e)` shows), without rusqlite's decorations.
fn sqlite_error(err: rusqlite::Error) -> SqlError {
    match err {
        rusqlite::Error::SqliteFailure(_, Some(message))
        | rusqlite::Error::SqlInputError { msg: message, .. } => SqlError::Sqlite(message),
        other => SqlError::Sqlite(other.to_string()),
    }
}

/// Opens `db` read-only and immutable with every sandbox layer of `mode` installed.
fn open_connection(db: &Path, max_bytes: usize, mode: Mode) -> Result<SandboxConnection, SqlError> {
    let open_error = |err: rusqlite::Error| SqlError::Open {
        path: db.to_path_buf(),
        message: err.to_string(),
    };
    let uri = format!(
        "file:{}?mode=ro&immutable=1",
        uri_escape(&db.to_string_lossy())
    );
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let mut conn = Connection::open_with_flags(uri, flags).map_err(open_error)?;
    match mode {
        Mode::Pooled => {
            conn.pragma_update(None, "query_only", 1)
                .map_err(open_error)?;
            conn.set_limit(Limit::SQLITE_LIMIT_ATTACHED, 0)
                .map_err(open_error)?;
        }
        Mode::Scratch => {
            // Temp tables, their indexes, sorters and statement journals stay in memory,
            // and the temp schema may not outgrow the result budget.
            conn.pragma_update(None, "temp_store", "MEMORY")
                .map_err(open_error)?;
            let pages = i64::try_from(max_bytes / 4096).unwrap_or(i64::MAX).max(1);
            conn.pragma_update(Some("temp"), "max_page_count", pages)
                .map_err(open_error)?;
            conn.set_limit(Limit::SQLITE_LIMIT_ATTACHED, SCRATCH_MAX_ATTACHED)
                .map_err(open_error)?;
        }
    }
    // One value may not exceed the result budget: `randomblob(1e9)` would otherwise
    // allocate a gigabyte inside a single VM instruction, out of the deadline's reach.
    let max_value = i32::try_from(max_bytes).unwrap_or(i32::MAX);
    conn.set_limit(Limit::SQLITE_LIMIT_LENGTH, max_value)
        .map_err(open_error)?;
    let asked_for_state = Arc::new(AtomicBool::new(false));
    let note = asked_for_state.clone();
    conn.authorizer(Some(move |ctx: AuthContext<'_>| match classify(&ctx) {
        Class::Read => Authorization::Allow,
        Class::ConnectionState => {
            note.store(true, Ordering::Relaxed);
            match mode {
                Mode::Pooled => Authorization::Deny,
                Mode::Scratch => Authorization::Allow,
            }
        }
        Class::Forbidden => Authorization::Deny,
    }))
    .map_err(open_error)?;
    Ok(SandboxConnection {
        conn,
        asked_for_state,
    })
}

/// Databases a scratch connection may attach: SQLite's default `SQLITE_MAX_ATTACHED`, as
/// in Python's `sqlite3`.
const SCRATCH_MAX_ATTACHED: i32 = 10;

/// Pragmas that only read, and may take an argument (a table or index name).
const READ_PRAGMAS_WITH_ARGUMENT: &[&str] = &[
    "table_info",
    "table_xinfo",
    "table_list",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "foreign_key_check",
    "integrity_check",
    "quick_check",
];

/// Pragmas whose assignment changes only the connection that runs it (never a file, the
/// process, or where temporary data is kept).
const CONNECTION_PRAGMAS: &[&str] = &[
    "analysis_limit",
    "automatic_index",
    "busy_timeout",
    "cache_size",
    "cache_spill",
    "case_sensitive_like",
    "cell_size_check",
    "count_changes",
    "defer_foreign_keys",
    "empty_result_callbacks",
    "foreign_keys",
    "full_column_names",
    "ignore_check_constraints",
    "legacy_alter_table",
    "query_only",
    "recursive_triggers",
    "reverse_unordered_selects",
    "secure_delete",
    "short_column_names",
    "synchronous",
    "threads",
    "trusted_schema",
];

/// What the authorizer makes of one action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Reads: allowed everywhere.
    Read,
    /// Changes only the connection: allowed on a scratch connection.
    ConnectionState,
    /// Refused everywhere.
    Forbidden,
}

fn classify(ctx: &AuthContext<'_>) -> Class {
    let in_temp = ctx.database_name == Some("temp");
    match ctx.action {
        AuthAction::Select | AuthAction::Read { .. } | AuthAction::Recursive => Class::Read,
        AuthAction::Function { function_name } => {
            if function_name.eq_ignore_ascii_case("load_extension") {
                Class::Forbidden
            } else {
                Class::Read
            }
        }
        AuthAction::Pragma {
            pragma_name,
            pragma_value,
        } => classify_pragma(pragma_name, pragma_value),
        AuthAction::CreateTempTable { .. }
        | AuthAction::CreateTempIndex { .. }
        | AuthAction::CreateTempView { .. }
        | AuthAction::CreateTempTrigger { .. }
        | AuthAction::DropTempTable { .. }
        | AuthAction::DropTempIndex { .. }
        | AuthAction::DropTempView { .. }
        | AuthAction::DropTempTrigger { .. }
        | AuthAction::Transaction { .. }
        | AuthAction::Savepoint { .. }
        | AuthAction::Detach { .. } => Class::ConnectionState,
        // Anything else in the temp schema (`CREATE TABLE temp.t`, rows of temp tables and
        // of `sqlite_temp_master` itself, `ANALYZE temp`): it lives and dies in memory.
        _ if in_temp => Class::ConnectionState,
        // `''` is a private temporary database, which `temp_store = MEMORY` keeps in memory.
        // A filename that is not a literal reaches the authorizer as `Unknown`.
        AuthAction::Attach { filename } if filename == ":memory:" || filename.is_empty() => {
            Class::ConnectionState
        }
        _ => Class::Forbidden,
    }
}

fn classify_pragma(name: &str, value: Option<&str>) -> Class {
    let name = name.to_ascii_lowercase();
    match value {
        None => Class::Read,
        Some(_) if READ_PRAGMAS_WITH_ARGUMENT.contains(&name.as_str()) => Class::Read,
        Some(_) if CONNECTION_PRAGMAS.contains(&name.as_str()) => Class::ConnectionState,
        // Temporary data must stay in memory: only the value the scratch connection has.
        Some(value)
            if name == "temp_store"
                && (value.eq_ignore_ascii_case("memory") || value.trim() == "2") =>
        {
            Class::ConnectionState
        }
        Some(_) => Class::Forbidden,
    }
}

/// Escapes the characters that end or change a URI path component.
fn uri_escape(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        match c {
            '%' => out.push_str("%25"),
            '?' => out.push_str("%3f"),
            '#' => out.push_str("%23"),
            _ => out.push(c),
        }
    }
    out
}

/// Whether anything other than whitespace and comments follows the first statement: the
/// check Python's `sqlite3` makes (a stray second `;` counts as a second statement there).
fn has_second_statement(sql: &str, first_statement: Option<&str>) -> bool {
    let Some(first) = first_statement else {
        return false;
    };
    let Some(tail) = sql.strip_prefix(first) else {
        return false;
    };
    let mut rest = tail.as_bytes();
    loop {
        match rest {
            [] => return false,
            [b' ' | b'\t' | b'\n' | b'\r' | 0x0c, more @ ..] => rest = more,
            [b'-', b'-', more @ ..] => match more.iter().position(|&b| b == b'\n') {
                Some(end) => rest = &more[end + 1..],
                None => return false,
            },
            [b'/', b'*', more @ ..] => match more.windows(2).position(|w| w == b"*/") {
                Some(end) => rest = &more[end + 2..],
                None => return false,
            },
            _ => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_statement_detection_matches_python() {
        let first = Some("select 1;");
        assert!(!has_second_statement("select 1;", first));
        assert!(!has_second_statement("select 1; -- x", first));
        assert!(!has_second_statement("select 1; /* a */\n", first));
        assert!(has_second_statement("select 1;;", first));
        assert!(has_second_statement("select 1; select 2", first));
    }

    #[test]
    fn float_repr_matches_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(python_float_repr(-2.5), "-2.5");
    }
}
