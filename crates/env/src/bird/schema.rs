//! Database schemas rendered as prompt text: `CREATE TABLE` DDL read from a SQLite file, with
//! the optional annotations of Arctic's text-to-SQL prompts (example values, BIRD column
//! descriptions, foreign-key lines, sample rows).

use std::collections::HashMap;
use std::fmt::Write as _;

use rusqlite::types::ValueRef;
use rusqlite::Connection;

/// How much of a database the schema text shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaOptions {
    /// Distinct example values listed in a comment after each column (0: none).
    pub example_values: usize,
    /// Rows shown per table as a markdown table after its DDL (0: none).
    pub sample_rows: usize,
    /// Whether a `-- Foreign keys: a -> t.b; ...` line follows each table that has any.
    pub foreign_key_lines: bool,
    /// Whether BIRD's column descriptions (name, description, value notes) join the
    /// example values in the column comments.
    pub descriptions: bool,
    /// Longest value shown, in characters; longer ones are cut and end in `...`.
    pub max_value_chars: usize,
    /// One line per table (`CREATE TABLE t (a INTEGER PRIMARY KEY, b TEXT REFERENCES u(id));`)
    /// and nothing else: for tiny models and short prompts. Ignores the other options.
    pub compact: bool,
}

impl SchemaOptions {
    /// Arctic's training prompts: 10 example values, 10 sample rows, descriptions and
    /// foreign-key lines.
    pub fn bird_train() -> Self {
        Self {
            example_values: 10,
            sample_rows: 10,
            foreign_key_lines: true,
            descriptions: true,
            max_value_chars: 60,
            compact: false,
        }
    }

    /// Arctic's validation prompts ("clean"): 3 example values and nothing else.
    pub fn bird_dev() -> Self {
        Self {
            example_values: 3,
            sample_rows: 0,
            foreign_key_lines: false,
            descriptions: false,
            max_value_chars: 60,
            compact: false,
        }
    }

    /// The one-line-per-table layout.
    pub fn compact() -> Self {
        Self {
            example_values: 0,
            sample_rows: 0,
            foreign_key_lines: false,
            descriptions: false,
            max_value_chars: 60,
            compact: true,
        }
    }
}

/// One row of a BIRD `database_description/<table>.csv` file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ColumnDescription {
    /// `column_name`: a readable name for the column.
    pub name: String,
    /// `column_description`.
    pub description: String,
    /// `value_description`: what the values mean.
    pub values: String,
}

/// Column descriptions of one database, looked up case-insensitively by table and column
/// (BIRD's file and column names do not always match the database's case).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptions {
    by_table: HashMap<String, HashMap<String, ColumnDescription>>,
}

impl Descriptions {
    /// Adds the description of `table.column`.
    pub fn insert(&mut self, table: &str, column: &str, description: ColumnDescription) {
        self.by_table
            .entry(table.to_lowercase())
            .or_default()
            .insert(column.trim().to_lowercase(), description);
    }

    /// The description of `table.column`, if the files give one.
    pub fn get(&self, table: &str, column: &str) -> Option<&ColumnDescription> {
        self.by_table
            .get(&table.to_lowercase())?
            .get(&column.to_lowercase())
    }

    /// Whether no column has a description.
    pub fn is_empty(&self) -> bool {
        self.by_table.is_empty()
    }
}

struct Column {
    name: String,
    data_type: String,
    primary_key_rank: i64,
}

struct ForeignKey {
    from: Vec<String>,
    table: String,
    /// Empty when the key refers to the parent's primary key implicitly.
    to: Vec<String>,
}

/// The schema of the database behind `conn` as prompt text, tables in name order.
pub fn render_schema(
    conn: &Connection,
    options: &SchemaOptions,
    descriptions: Option<&Descriptions>,
) -> rusqlite::Result<String> {
    let mut tables: Vec<String> = conn
        .prepare(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
             ORDER BY name",
        )?
        .query_map([], |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    tables.sort();
    let mut out = String::new();
    for (i, table) in tables.iter().enumerate() {
        let columns = table_columns(conn, table)?;
        let foreign_keys = table_foreign_keys(conn, table)?;
        if options.compact {
            render_compact_table(&mut out, table, &columns, &foreign_keys);
            continue;
        }
        if i > 0 {
            out.push('\n');
        }
        render_table(
            &mut out,
            conn,
            table,
            &columns,
            &foreign_keys,
            options,
            descriptions,
        )?;
    }
    Ok(out.trim_end().to_string())
}

fn table_columns(conn: &Connection, table: &str) -> rusqlite::Result<Vec<Column>> {
    conn.prepare(&format!("PRAGMA table_info({})", quote_always(table)))?
        .query_map([], |row| {
            Ok(Column {
                name: row.get(1)?,
                data_type: row.get::<_, Option<String>>(2)?.unwrap_or_default(),
                primary_key_rank: row.get(5)?,
            })
        })?
        .collect()
}

fn table_foreign_keys(conn: &Connection, table: &str) -> rusqlite::Result<Vec<ForeignKey>> {
    let mut keys: Vec<(i64, ForeignKey)> = Vec::new();
    let mut stmt = conn.prepare(&format!("PRAGMA foreign_key_list({})", quote_always(table)))?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        let parent: String = row.get(2)?;
        let from: String = row.get(3)?;
        let to: Option<String> = row.get(4)?;
        match keys.iter_mut().find(|(k, _)| *k == id) {
            Some((_, key)) => {
                key.from.push(from);
                key.to.extend(to);
            }
            None => keys.push((
                id,
                ForeignKey {
                    from: vec![from],
                    table: parent,
                    to: to.into_iter().collect(),
                },
            )),
        }
    }
    // PRAGMA lists keys last-declared first; declaration order reads better.
    keys.sort_by_key(|(id, _)| std::cmp::Reverse(*id));
    Ok(keys.into_iter().map(|(_, key)| key).collect())
}

fn render_compact_table(
    out: &mut String,
    table: &str,
    columns: &[Column],
    foreign_keys: &[ForeignKey],
) {
    let composite_key = columns.iter().filter(|c| c.primary_key_rank > 0).count() > 1;
    let mut parts: Vec<String> = columns
        .iter()
        .map(|column| {
            let mut part = column_head(column, composite_key);
            if let Some(key) = foreign_keys
                .iter()
                .find(|k| k.from.len() == 1 && k.from[0] == column.name)
            {
                let _ = write!(part, " REFERENCES {}", quote(&key.table));
                if let [to] = key.to.as_slice() {
                    let _ = write!(part, "({})", quote(to));
                }
            }
            part
        })
        .collect();
    if composite_key {
        parts.push(primary_key_clause(columns));
    }
    for key in foreign_keys.iter().filter(|k| k.from.len() > 1) {
        parts.push(foreign_key_clause(key));
    }
    let _ = writeln!(out, "CREATE TABLE {} ({});", quote(table), parts.join(", "));
}

fn render_table(
    out: &mut String,
    conn: &Connection,
    table: &str,
    columns: &[Column],
    foreign_keys: &[ForeignKey],
    options: &SchemaOptions,
    descriptions: Option<&Descriptions>,
) -> rusqlite::Result<()> {
    let composite_key = columns.iter().filter(|c| c.primary_key_rank > 0).count() > 1;
    let mut lines: Vec<(String, String)> = Vec::new();
    for column in columns {
        let mut notes = Vec::new();
        if options.example_values > 0 {
            let examples = example_values(conn, table, &column.name, options)?;
            if !examples.is_empty() {
                notes.push(format!("example: [{}]", examples.join(", ")));
            }
        }
        if options.descriptions {
            if let Some(d) = descriptions.and_then(|d| d.get(table, &column.name)) {
                let name = one_line(&d.name);
                if !name.is_empty() && !name.eq_ignore_ascii_case(&column.name) {
                    notes.push(format!("name: {name}"));
                }
                for (label, text) in [("desc", &d.description), ("values", &d.values)] {
                    let text = one_line(text);
                    if !text.is_empty() {
                        notes.push(format!("{label}: {text}"));
                    }
                }
            }
        }
        lines.push((column_head(column, composite_key), notes.join(" | ")));
    }
    if composite_key {
        lines.push((primary_key_clause(columns), String::new()));
    }
    for key in foreign_keys {
        lines.push((foreign_key_clause(key), String::new()));
    }
    let _ = writeln!(out, "CREATE TABLE {} (", quote(table));
    let last = lines.len().saturating_sub(1);
    for (i, (definition, note)) in lines.iter().enumerate() {
        let comma = if i < last { "," } else { "" };
        if note.is_empty() {
            let _ = writeln!(out, "  {definition}{comma}");
        } else {
            let _ = writeln!(out, "  {definition}{comma} -- {note}");
        }
    }
    out.push_str(");\n");
    if options.foreign_key_lines && !foreign_keys.is_empty() {
        let links: Vec<String> = foreign_keys
            .iter()
            .flat_map(|key| {
                key.from.iter().enumerate().map(move |(i, from)| {
                    let to = key.to.get(i).map_or("", String::as_str);
                    if to.is_empty() {
                        format!("{} -> {}", quote(from), quote(&key.table))
                    } else {
                        format!("{} -> {}.{}", quote(from), quote(&key.table), quote(to))
                    }
                })
            })
            .collect();
        let _ = writeln!(out, "-- Foreign keys: {}", links.join("; "));
    }
    if options.sample_rows > 0 {
        render_sample_rows(out, conn, table, columns, options)?;
    }
    Ok(())
}

fn column_head(column: &Column, composite_key: bool) -> String {
    let mut head = quote(&column.name);
    if !column.data_type.is_empty() {
        head.push(' ');
        head.push_str(&column.data_type);
    }
    if column.primary_key_rank > 0 && !composite_key {
        head.push_str(" PRIMARY KEY");
    }
    head
}

fn primary_key_clause(columns: &[Column]) -> String {
    let mut keyed: Vec<&Column> = columns.iter().filter(|c| c.primary_key_rank > 0).collect();
    keyed.sort_by_key(|c| c.primary_key_rank);
    let names: Vec<String> = keyed.iter().map(|c| quote(&c.name)).collect();
    format!("PRIMARY KEY ({})", names.join(", "))
}

fn foreign_key_clause(key: &ForeignKey) -> String {
    let from: Vec<String> = key.from.iter().map(|c| quote(c)).collect();
    let mut clause = format!(
        "FOREIGN KEY ({}) REFERENCES {}",
        from.join(", "),
        quote(&key.table)
    );
    if !key.to.is_empty() {
        let to: Vec<String> = key.to.iter().map(|c| quote(c)).collect();
        let _ = write!(clause, " ({})", to.join(", "));
    }
    clause
}

fn example_values(
    conn: &Connection,
    table: &str,
    column: &str,
    options: &SchemaOptions,
) -> rusqlite::Result<Vec<String>> {
    let column = quote_always(column);
    let sql = format!(
        "SELECT DISTINCT {column} FROM {} WHERE {column} IS NOT NULL LIMIT {}",
        quote_always(table),
        options.example_values
    );
    let mut stmt = conn.prepare(&sql)?;
    let mut rows = stmt.query([])?;
    let mut values = Vec::new();
    while let Some(row) = rows.next()? {
        if let Some(value) = sql_literal(row.get_ref(0)?, options.max_value_chars) {
            values.push(value);
        }
    }
    Ok(values)
}

fn render_sample_rows(
    out: &mut String,
    conn: &Connection,
    table: &str,
    columns: &[Column],
    options: &SchemaOptions,
) -> rusqlite::Result<()> {
    let sql = format!(
        "SELECT * FROM {} LIMIT {}",
        quote_always(table),
        options.sample_rows
    );
    let mut stmt = conn.prepare(&sql)?;
    let width = stmt.column_count();
    let mut rows = stmt.query([])?;
    let mut body = String::new();
    while let Some(row) = rows.next()? {
        let cells: Vec<String> = (0..width)
            .map(|i| {
                row.get_ref(i)
                    .map(|v| cell_text(v, options.max_value_chars))
            })
            .collect::<rusqlite::Result<_>>()?;
        let _ = writeln!(body, "| {} |", cells.join(" | "));
    }
    if body.is_empty() {
        return Ok(());
    }
    let header: Vec<String> = columns.iter().map(|c| escape_cell(&c.name)).collect();
    let _ = writeln!(out, "-- Sample rows from {}:", quote_always(table));
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(out, "|{}", " --- |".repeat(columns.len()));
    out.push_str(&body);
    Ok(())
}

/// A value as a SQL literal (`'text'`, `12`, `3.5`), cut to `max_chars`; `None` for NULL and
/// blobs, which make poor examples.
fn sql_literal(value: ValueRef<'_>, max_chars: usize) -> Option<String> {
    match value {
        ValueRef::Null | ValueRef::Blob(_) => None,
        ValueRef::Integer(i) => Some(i.to_string()),
        ValueRef::Real(r) => Some(real_text(r)),
        ValueRef::Text(bytes) => {
            let text = one_line(&String::from_utf8_lossy(bytes));
            Some(format!("'{}'", cut(&text, max_chars).replace('\'', "''")))
        }
    }
}

fn cell_text(value: ValueRef<'_>, max_chars: usize) -> String {
    match value {
        ValueRef::Null => "NULL".to_string(),
        ValueRef::Blob(_) => "<blob>".to_string(),
        ValueRef::Integer(i) => i.to_string(),
        ValueRef::Real(r) => real_text(r),
        ValueRef::Text(bytes) => {
            escape_cell(&cut(&one_line(&String::from_utf8_lossy(bytes)), max_chars))
        }
    }
}

/// A REAL as SQLite prints it: whole numbers keep their `.0`.
fn real_text(r: f64) -> String {
    if r.is_finite() && r.fract() == 0.0 && r.abs() < 1e15 {
        format!("{r:.1}")
    } else {
        r.to_string()
    }
}

fn escape_cell(text: &str) -> String {
    text.replace('|', "\\|")
}

fn cut(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

/// Text with runs of whitespace (newlines included) collapsed to single spaces.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// SQL keywords that need quoting as identifiers.
const KEYWORDS: &[&str] = &[
    "abort",
    "add",
    "all",
    "alter",
    "and",
    "as",
    "asc",
    "between",
    "by",
    "case",
    "check",
    "collate",
    "column",
    "constraint",
    "create",
    "cross",
    "current",
    "default",
    "delete",
    "desc",
    "distinct",
    "drop",
    "else",
    "end",
    "except",
    "exists",
    "from",
    "full",
    "group",
    "having",
    "in",
    "index",
    "inner",
    "insert",
    "intersect",
    "into",
    "is",
    "join",
    "key",
    "left",
    "like",
    "limit",
    "natural",
    "not",
    "null",
    "of",
    "offset",
    "on",
    "or",
    "order",
    "outer",
    "primary",
    "references",
    "right",
    "select",
    "set",
    "table",
    "then",
    "to",
    "union",
    "unique",
    "update",
    "using",
    "values",
    "when",
    "where",
    "with",
];

/// `name` as an identifier: bare when it is a plain word, double-quoted otherwise.
pub(crate) fn quote(name: &str) -> String {
    let plain = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !KEYWORDS.contains(&name.to_ascii_lowercase().as_str());
    if plain {
        name.to_string()
    } else {
        quote_always(name)
    }
}

fn quote_always(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
