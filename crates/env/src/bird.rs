//! The BIRD text-to-SQL benchmark converted into dataset rows with Arctic's prompt.
//!
//! BIRD ships `train.json` / `dev.json` (a list of `{question, evidence, SQL, db_id}`) next to
//! `train_databases/<db_id>/<db_id>.sqlite` / `dev_databases/...`, each database folder with
//! optional `database_description/<table>.csv` files. [`convert_bird`] turns one split into
//! [`Row`]s whose prompt is Arctic's text-to-SQL format ([`arctic_prompt`]): a system message,
//! then a user message with the engine, the schema ([`render_schema`]), the question and its
//! evidence, instructions and the expected output format. The ground truth is the gold SQL,
//! and `extra_info` carries `db_id` and `db_path`, so the `bird` environment can score answers
//! by execution.
//!
//! The schema renderer and the prompt are shared with the synthetic SQL task
//! ([`crate::synth_sql`]), so both read the same way to a model.

mod csv;
mod schema;

pub use schema::{render_schema, ColumnDescription, Descriptions, SchemaOptions};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Map, Value};

use crate::dataset::Row;
use crate::env::Message;

/// `data_source` of converted BIRD rows.
pub const DATA_SOURCE: &str = "bird";

/// A BIRD split, which names its question file and database folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BirdSplit {
    /// `train.json` and `train_databases/`.
    Train,
    /// `dev.json` and `dev_databases/`.
    Dev,
}

impl BirdSplit {
    /// `train` or `dev`.
    pub fn name(self) -> &'static str {
        match self {
            BirdSplit::Train => "train",
            BirdSplit::Dev => "dev",
        }
    }

    /// Arctic's schema annotations for this split: rich for training, clean for validation.
    pub fn schema_options(self) -> SchemaOptions {
        match self {
            BirdSplit::Train => SchemaOptions::bird_train(),
            BirdSplit::Dev => SchemaOptions::bird_dev(),
        }
    }
}

/// Errors converting BIRD; each names the file and, where it applies, the entry and key.
#[derive(Debug, thiserror::Error)]
pub enum BirdError {
    /// A file could not be read.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The question file is not valid JSON or not a list of objects.
    #[error("{}: {problem}", path.display())]
    Json {
        /// The question file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A question entry lacks a required key or has the wrong type.
    #[error("{}, entry {entry}: key `{key}` {problem}", path.display())]
    Entry {
        /// The question file.
        path: PathBuf,
        /// The entry's position in the list, from 0.
        entry: usize,
        /// The key.
        key: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// An entry's database file does not exist.
    #[error(
        "{}, entry {entry}: database `{db_id}` not found; expected {}",
        path.display(),
        expected.display()
    )]
    MissingDatabase {
        /// The question file.
        path: PathBuf,
        /// The entry's position in the list, from 0.
        entry: usize,
        /// The database id.
        db_id: String,
        /// Where its SQLite file should be.
        expected: PathBuf,
    },
    /// SQLite failed on a database while reading its schema.
    #[error("{}: {cause}", path.display())]
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// The underlying error.
        cause: rusqlite::Error,
    },
    /// A description CSV is malformed.
    #[error("{}, line {line}: {problem}", path.display())]
    Csv {
        /// The CSV file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong.
        problem: String,
    },
}

/// What [`convert_bird`] converts and how.
#[derive(Debug, Clone)]
pub struct BirdOptions {
    /// Which split.
    pub split: BirdSplit,
    /// Convert only the first this many questions.
    pub limit: Option<usize>,
    /// Schema annotations; `None` takes the split's ([`BirdSplit::schema_options`]).
    pub schema: Option<SchemaOptions>,
}

impl BirdOptions {
    /// All questions of `split`, with the split's schema annotations.
    pub fn new(split: BirdSplit) -> Self {
        Self {
            split,
            limit: None,
            schema: None,
        }
    }
}

/// The text of a question as Arctic's prompts show it: the question, then BIRD's evidence
/// (external knowledge) when there is any.
pub fn question_with_evidence(question: &str, evidence: &str) -> String {
    let evidence = evidence.trim();
    if evidence.is_empty() {
        question.trim().to_string()
    } else {
        format!("{}\n\nEvidence:\n{evidence}", question.trim())
    }
}

const SYSTEM_PROMPT: &str = "You are a data science expert. You are given a database schema and \
a question about the data. Write one valid SQL query that answers the question.";

/// Arctic's text-to-SQL prompt: a system message and a user message with the sections
/// `Database Engine`, `Database Schema`, `Question`, `Instructions` and `Output Format`.
///
/// `question` already includes any evidence ([`question_with_evidence`]). `compact` shortens
/// the output-format section for tiny models; the sections and the answer format
/// (`<think>` reasoning, then a ```` ```sql ```` block inside `<answer>`) stay the same.
pub fn arctic_prompt(schema: &str, question: &str, compact: bool) -> Vec<Message> {
    let output_format = if compact {
        "Think inside <think> </think>, then put the SQL query in a ```sql code block inside \
         <answer> </answer>."
            .to_string()
    } else {
        "Write your step-by-step reasoning inside <think> </think> tags, then give the final \
         query inside <answer> </answer> tags as a single ```sql code block:\n\
         <think>\n(your reasoning, up to about 4K tokens)\n</think>\n\
         <answer>\n```sql\n(the SQL query, up to about 1K tokens)\n```\n</answer>"
            .to_string()
    };
    let user = format!(
        "Database Engine:\nSQLite\n\n\
         Database Schema:\n{schema}\n\
         This schema describes the database's tables, columns, primary keys, foreign keys and \
         the relationships between tables.\n\n\
         Question:\n{question}\n\n\
         Instructions:\n\
         - Select only the columns the question asks for.\n\
         - Return exactly the requested information, nothing missing and nothing extra.\n\
         - Think the problem through before writing the query.\n\n\
         Output Format:\n{output_format}"
    );
    vec![
        Message::new("system", SYSTEM_PROMPT),
        Message::new("user", user),
    ]
}

/// An assistant answer in the format [`arctic_prompt`] asks for (reasoning, then the query),
/// e.g. as a warm-start target.
pub fn arctic_answer(reasoning: &str, sql: &str) -> String {
    format!(
        "<think>\n{}\n</think>\n<answer>\n```sql\n{}\n```\n</answer>",
        reasoning.trim(),
        sql.trim()
    )
}

/// Opens a SQLite database read-only.
pub(crate) fn open_read_only(path: &Path) -> Result<Connection, rusqlite::Error> {
    Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
}

/// Reads the BIRD column descriptions under `dir` (a database's `database_description`
/// folder): one `<table>.csv` per table, headed `original_column_name, column_name,
/// column_description, data_format, value_description`. A missing folder means no
/// descriptions.
pub fn load_descriptions(dir: &Path) -> Result<Descriptions, BirdError> {
    let mut descriptions = Descriptions::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(descriptions),
        Err(cause) => {
            return Err(BirdError::Io {
                path: dir.to_path_buf(),
                cause,
            })
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")))
        .collect();
    files.sort();
    for path in files {
        let table = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(&path).map_err(|cause| BirdError::Io {
            path: path.clone(),
            cause,
        })?;
        let records = csv::parse(&csv::decode(&bytes)).map_err(|line| BirdError::Csv {
            path: path.clone(),
            line,
            problem: "a quoted field is never closed".into(),
        })?;
        let mut records = records.into_iter();
        let Some((_, header)) = records.next() else {
            continue;
        };
        let position = |name: &str| {
            header
                .iter()
                .position(|h| h.trim().eq_ignore_ascii_case(name))
        };
        let Some(original) = position("original_column_name") else {
            return Err(BirdError::Csv {
                path,
                line: 1,
                problem: "the header has no `original_column_name` column".into(),
            });
        };
        let (name, description, values) = (
            position("column_name"),
            position("column_description"),
            position("value_description"),
        );
        for (_, record) in records {
            let field = |i: Option<usize>| {
                i.and_then(|i| record.get(i))
                    .map_or(String::new(), |s| s.trim().to_string())
            };
            let column = field(Some(original));
            if column.is_empty() {
                continue;
            }
            descriptions.insert(
                &table,
                &column,
                ColumnDescription {
                    name: field(name),
                    description: field(description),
                    values: field(values),
                },
            );
        }
    }
    Ok(descriptions)
}

/// Converts one split of the BIRD release in `bird_dir` into dataset rows, in file order.
///
/// Each row's prompt is [`arctic_prompt`] over the split's schema rendering; `data_source` is
/// `bird`, `env_class` is the single-turn BIRD environment, the ground truth is the gold SQL,
/// and `extras` hold `db_id`, `db_path` (absolute), `question`, `evidence`, `split` and
/// `index` (BIRD's `question_id` when present, else the entry's position).
pub fn convert_bird(bird_dir: &Path, options: &BirdOptions) -> Result<Vec<Row>, BirdError> {
    let split = options.split.name();
    let questions_path = bird_dir.join(format!("{split}.json"));
    let databases_dir =
        std::path::absolute(bird_dir.join(format!("{split}_databases"))).map_err(|cause| {
            BirdError::Io {
                path: bird_dir.to_path_buf(),
                cause,
            }
        })?;
    let text = std::fs::read_to_string(&questions_path).map_err(|cause| BirdError::Io {
        path: questions_path.clone(),
        cause,
    })?;
    let entries: Vec<Value> = match serde_json::from_str(&text) {
        Ok(Value::Array(entries)) => entries,
        Ok(_) => {
            return Err(BirdError::Json {
                path: questions_path,
                problem: "expected a JSON list of question objects".into(),
            })
        }
        Err(err) => {
            return Err(BirdError::Json {
                path: questions_path,
                problem: format!("invalid JSON: {err}"),
            })
        }
    };
    let schema_options = options
        .schema
        .clone()
        .unwrap_or_else(|| options.split.schema_options());
    let mut schemas: HashMap<String, String> = HashMap::new();
    let limit = options.limit.unwrap_or(usize::MAX);
    let mut rows = Vec::new();
    for (entry, value) in entries.iter().enumerate().take(limit) {
        let field = |key: &'static str, required: bool| -> Result<String, BirdError> {
            let problem = |p: &str| BirdError::Entry {
                path: questions_path.clone(),
                entry,
                key,
                problem: p.to_string(),
            };
            match value.get(key) {
                Some(Value::String(s)) => Ok(s.clone()),
                None | Some(Value::Null) if !required => Ok(String::new()),
                None | Some(Value::Null) => Err(problem("is missing")),
                Some(_) => Err(problem("must be a string")),
            }
        };
        if !value.is_object() {
            return Err(BirdError::Json {
                path: questions_path,
                problem: format!("entry {entry} is not a JSON object"),
            });
        }
        let question = field("question", true)?;
        let evidence = field("evidence", false)?;
        let gold_sql = field("SQL", true)?;
        let db_id = field("db_id", true)?;
        let db_path = databases_dir.join(&db_id).join(format!("{db_id}.sqlite"));
        if !schemas.contains_key(&db_id) {
            if !db_path.is_file() {
                return Err(BirdError::MissingDatabase {
                    path: questions_path,
                    entry,
                    db_id,
                    expected: db_path,
                });
            }
            let descriptions = if schema_options.descriptions {
                load_descriptions(&databases_dir.join(&db_id).join("database_description"))?
            } else {
                Descriptions::default()
            };
            let sqlite_err = |cause| BirdError::Sqlite {
                path: db_path.clone(),
                cause,
            };
            let conn = open_read_only(&db_path).map_err(sqlite_err)?;
            let schema =
                render_schema(&conn, &schema_options, Some(&descriptions)).map_err(sqlite_err)?;
            schemas.insert(db_id.clone(), schema);
        }
        let prompt = arctic_prompt(
            &schemas[&db_id],
            &question_with_evidence(&question, &evidence),
            false,
        );
        let index = value
            .get("question_id")
            .filter(|v| v.is_u64())
            .cloned()
            .unwrap_or_else(|| json!(entry));
        let mut extras = Map::new();
        extras.insert("db_id".into(), json!(db_id));
        extras.insert(
            "db_path".into(),
            json!(db_path.to_string_lossy().into_owned()),
        );
        extras.insert("question".into(), json!(question));
        extras.insert("evidence".into(), json!(evidence));
        extras.insert("split".into(), json!(split));
        extras.insert("index".into(), index);
        rows.push(Row::new(
            prompt,
            DATA_SOURCE,
            Some(crate::env::TEXT2SQL.to_string()),
            Some(json!(gold_sql)),
            extras,
            rows.len(),
        ));
    }
    Ok(rows)
}
