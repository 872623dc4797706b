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
use std::sync::Mutex;
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
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            max_rows: 1_000_000,
            max_bytes: 256 << 20,
            max_idle_per_db: 32,
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

/// Read-only, time- and size-bounded SQL execution over pooled SQLite connections.
/// `Sync`: share one behind an `Arc` across scoring threads.
pub struct Sandbox {
    config: SandboxConfig,
    idle: Mutex<HashMap<PathBuf, Vec<Connection>>>,
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
        let mut conn = self.checkout(db)?;
        let deadline = Instant::now() + timeout;
        conn.progress_handler(1000, Some(move || Instant::now() >= deadline))
            .map_err(sqlite_error)?;
        let result = self.run(&conn, sql, deadline, timeout);
        // A connection left inside a transaction would leak state into the next query.
        if conn.is_autocommit() {
            self.give_back(db, conn);
        }
        result
    }

    fn run(
        &self,
        conn: &Connection,
        sql: &str,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<QueryResult, SqlError> {
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
        if !stmt.readonly() {
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

    fn checkout(&self, db: &Path) -> Result<Connection, SqlError> {
        let pooled = self
            .idle
            .lock()
            .expect("sandbox pool lock poisoned")
            .get_mut(db)
            .and_then(Vec::pop);
        match pooled {
            Some(conn) => Ok(conn),
            None => open_read_only(db, self.config.max_bytes),
        }
    }

    fn give_back(&self, db: &Path, conn: Connection) {
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

/// Opens `db` read-only and immutable with every sandbox layer installed.
fn open_read_only(db: &Path, max_bytes: usize) -> Result<Connection, SqlError> {
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
    conn.pragma_update(None, "query_only", 1)
        .map_err(open_error)?;
    conn.set_limit(Limit::SQLITE_LIMIT_ATTACHED, 0)
        .map_err(open_error)?;
    // One value may not exceed the result budget: `randomblob(1e9)` would otherwise
    // allocate a gigabyte inside a single VM instruction, out of the deadline's reach.
    let max_value = i32::try_from(max_bytes).unwrap_or(i32::MAX);
    conn.set_limit(Limit::SQLITE_LIMIT_LENGTH, max_value)
        .map_err(open_error)?;
    conn.authorizer(Some(authorize)).map_err(open_error)?;
    Ok(conn)
}

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

fn authorize(ctx: AuthContext<'_>) -> Authorization {
    match ctx.action {
        AuthAction::Select | AuthAction::Read { .. } | AuthAction::Recursive => {
            Authorization::Allow
        }
        AuthAction::Function { function_name } => {
            if function_name.eq_ignore_ascii_case("load_extension") {
                Authorization::Deny
            } else {
                Authorization::Allow
            }
        }
        AuthAction::Pragma {
            pragma_name,
            pragma_value,
        } => {
            let name = pragma_name.to_ascii_lowercase();
            if pragma_value.is_none() || READ_PRAGMAS_WITH_ARGUMENT.contains(&name.as_str()) {
                Authorization::Allow
            } else {
                Authorization::Deny
            }
        }
        _ => Authorization::Deny,
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
