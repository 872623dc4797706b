//! Prompt datasets in the verl/SkyRL layout, read from and written to parquet or JSONL.
//!
//! A dataset row is one prompt plus what an environment needs to score completions of it:
//!
//! | column | type | meaning |
//! | --- | --- | --- |
//! | `prompt` | list of `{role, content}` | the chat messages given to the model (required) |
//! | `data_source` | string | where the row comes from; eval metrics are split by it |
//! | `env_class` | string, optional | which environment scores it (a null defers to the recipe) |
//! | `reward_spec` or `reward_model` | struct with `ground_truth` (any JSON) | the reference answer |
//! | `extra_info` | struct | passed to the environment, e.g. `db_path`, `db_id` |
//!
//! Every column but `prompt` and `env_class` is passed to the environment, as SkyRL does,
//! through [`Row::extras`]. Nested values
//! may be real parquet structs and lists (what pandas and pyarrow write for dicts and lists of
//! dicts) or JSON text in a string column (what some preprocessing scripts write); both are
//! read. [`write_rows`] writes the struct layout, which pandas, pyarrow, verl and SkyRL read
//! directly.
//!
//! A relative `extra_info.db_path` is resolved against the dataset file's folder when reading
//! and made relative to it again when writing, so a dataset folder can be moved as a whole.
//!
//! [`DataCursor`] walks a dataset in a seeded order, epoch after epoch, and serializes into a
//! checkpoint so a resumed run continues with exactly the rows it would have seen.

mod arrow_json;
mod rng;

pub(crate) use rng::SplitMix64;

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Component, Path, PathBuf};

use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::env::Message;

/// One prompt and everything its environment needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Chat messages given to the model.
    pub prompt: Vec<Message>,
    /// Origin of the row (`bird`, `gsm8k`, `synth_sql`, ...); metrics are split by it.
    pub data_source: String,
    /// The environment that scores this row; `None` defers to the recipe's default.
    pub env_class: Option<String>,
    /// The reference answer, from `reward_spec.ground_truth` or `reward_model.ground_truth`.
    pub ground_truth: Option<Value>,
    /// What the environment is built from, as in SkyRL: a JSON object holding every column of
    /// the row except `prompt` and `env_class` (`data_source`, `extra_info`, `reward_model`,
    /// any others). `reward_spec.ground_truth` always holds the ground truth when there is one,
    /// whichever key the file used, and `extra_info.db_path` is absolute.
    pub extras: Value,
    /// Position of the row in its file, counting from 0 (the rollout `uid`).
    pub index: usize,
}

impl Row {
    /// A row with the standard extras: `data_source`, `reward_spec` holding the ground truth,
    /// and `extra_info`. Give `extra_info.db_path` absolute; [`write_rows`] makes it relative.
    pub fn new(
        prompt: Vec<Message>,
        data_source: impl Into<String>,
        env_class: Option<String>,
        ground_truth: Option<Value>,
        extra_info: Map<String, Value>,
        index: usize,
    ) -> Self {
        let data_source = data_source.into();
        let mut extras = Map::new();
        extras.insert(DATA_SOURCE.into(), Value::String(data_source.clone()));
        if let Some(gt) = &ground_truth {
            extras.insert(REWARD_SPEC.into(), reward_spec(gt));
        }
        extras.insert(EXTRA_INFO.into(), Value::Object(extra_info));
        Self {
            prompt,
            data_source,
            env_class,
            ground_truth,
            extras: Value::Object(extras),
            index,
        }
    }

    /// The `extra_info` object (empty when the row has none).
    pub fn extra_info(&self) -> &Map<String, Value> {
        static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
        self.extras
            .get(EXTRA_INFO)
            .and_then(Value::as_object)
            .unwrap_or_else(|| EMPTY.get_or_init(Map::new))
    }

    /// `extra_info.db_path`, when the row has one.
    pub fn db_path(&self) -> Option<&str> {
        self.extra_info().get(DB_PATH).and_then(Value::as_str)
    }
}

fn reward_spec(ground_truth: &Value) -> Value {
    serde_json::json!({"method": "rule", GROUND_TRUTH: ground_truth})
}

const PROMPT: &str = "prompt";
const DATA_SOURCE: &str = "data_source";
const ENV_CLASS: &str = "env_class";
const REWARD_SPEC: &str = "reward_spec";
const REWARD_MODEL: &str = "reward_model";
const EXTRA_INFO: &str = "extra_info";
const GROUND_TRUTH: &str = "ground_truth";
const DB_PATH: &str = "db_path";

/// Where in a file a row sits, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// A parquet row or an element of a JSON array, counting from 0.
    Row(usize),
    /// A JSONL line, counting from 1 like editors do.
    Line(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Row(row) => write!(f, "row {row}"),
            Location::Line(line) => write!(f, "line {line}"),
        }
    }
}

/// Errors reading or writing datasets; each names the file and, where it applies, the row and
/// key.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file could not be opened, read or written.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The extension is none of `.parquet`, `.jsonl` or `.json`.
    #[error("{}: unknown dataset format; expected a .parquet, .jsonl or .json file", path.display())]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The parquet reader or writer failed.
    #[error("{}: parquet: {cause}", path.display())]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        cause: parquet::errors::ParquetError,
    },
    /// Building Arrow arrays failed.
    #[error("{}: arrow: {cause}", path.display())]
    Arrow {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        cause: arrow::error::ArrowError,
    },
    /// A parquet column has a type with no JSON equivalent.
    #[error("{}: column `{column}` has type {data_type}, which floe cannot read", path.display())]
    UnsupportedColumn {
        /// The file.
        path: PathBuf,
        /// The column, dotted for nested fields.
        column: String,
        /// Its Arrow type.
        data_type: String,
    },
    /// A JSONL line or a JSON file is not valid JSON.
    #[error("{}, {at}: invalid JSON: {cause}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The line (JSONL) or the start of the file (JSON).
        at: Location,
        /// The parser's message.
        cause: serde_json::Error,
    },
    /// A row lacks a required key.
    #[error("{}, {at}: missing key `{key}`", path.display())]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The row.
        at: Location,
        /// The key, dotted for nested keys.
        key: String,
    },
    /// A key holds a value of the wrong shape.
    #[error("{}, {at}: key `{key}` {problem}", path.display())]
    InvalidValue {
        /// The file.
        path: PathBuf,
        /// The row.
        at: Location,
        /// The key, dotted and indexed for nested keys (`prompt[1].role`).
        key: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// Reads every row of a `.parquet`, `.jsonl` or `.json` (an array of objects) dataset.
pub fn load_rows(path: impl AsRef<Path>) -> Result<Vec<Row>, DatasetError> {
    let path = path.as_ref();
    let objects = match extension(path).as_deref() {
        Some("parquet") => read_parquet_objects(path)?,
        Some("jsonl") => read_jsonl_objects(path)?,
        Some("json") => read_json_array_objects(path)?,
        _ => {
            return Err(DatasetError::UnknownFormat {
                path: path.to_path_buf(),
            })
        }
    };
    let base_dir = absolute_dir_of(path)?;
    let fallback_source = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    objects
        .into_iter()
        .enumerate()
        .map(|(index, (at, object))| {
            let context = RowContext {
                path,
                at,
                base_dir: &base_dir,
                fallback_source: &fallback_source,
            };
            row_from_object(object, index, &context)
        })
        .collect()
}

/// Writes `rows` as `.parquet` or `.jsonl` (by extension) in the layout [`load_rows`] reads:
/// the ground truth goes to `reward_model.ground_truth`, the other extras to `extra_info`, and
/// an absolute `db_path` under the output folder is written relative to it.
pub fn write_rows(path: impl AsRef<Path>, rows: &[Row]) -> Result<(), DatasetError> {
    let path = path.as_ref();
    let base_dir = absolute_dir_of(path)?;
    let objects: Vec<Map<String, Value>> = rows
        .iter()
        .map(|row| row_to_object(row, &base_dir))
        .collect();
    match extension(path).as_deref() {
        Some("parquet") => write_parquet_objects(path, &objects),
        Some("jsonl") => write_jsonl_objects(path, &objects),
        _ => Err(DatasetError::UnknownFormat {
            path: path.to_path_buf(),
        }),
    }
}

/// Keeps the rows whose prompt costs at most `budget` tokens by `count_tokens`, in order, and
/// counts the others. Rows over budget are dropped, never truncated: a cut prompt asks a
/// different question.
pub fn filter_by_prompt_budget<E>(
    rows: Vec<Row>,
    budget: usize,
    count_tokens: impl Fn(&Row) -> Result<usize, E>,
) -> Result<(Vec<Row>, usize), E> {
    let mut kept = Vec::with_capacity(rows.len());
    let mut dropped = 0;
    for row in rows {
        if count_tokens(&row)? <= budget {
            kept.push(row);
        } else {
            dropped += 1;
        }
    }
    Ok((kept, dropped))
}

/// A resumable position in a seeded, epoch-by-epoch shuffle of a dataset.
///
/// Each epoch visits every row once, in an order fixed by `seed` and the epoch number. A batch
/// that reaches the end of an epoch continues into the next. Saving the cursor (it is serde)
/// and restoring it later yields the same batches as never having stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Number of rows in the dataset this cursor walks.
    pub len: usize,
    /// Seed of the shuffle.
    pub seed: u64,
    /// Current epoch, from 0.
    pub epoch: u64,
    /// Rows of the current epoch already handed out.
    pub position: usize,
}

impl DataCursor {
    /// A cursor at the start of epoch 0 of a dataset of `len` rows.
    pub fn new(len: usize, seed: u64) -> Self {
        Self {
            len,
            seed,
            epoch: 0,
            position: 0,
        }
    }

    /// The row order of `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        SplitMix64::new(self.seed, epoch).shuffle(&mut order);
        order
    }

    /// The indices of the next `n` rows, advancing the cursor. Empty for an empty dataset.
    pub fn next_batch(&mut self, n: usize) -> Vec<usize> {
        let mut batch = Vec::with_capacity(n);
        if self.len == 0 {
            return batch;
        }
        let mut order = self.epoch_order(self.epoch);
        while batch.len() < n {
            if self.position == self.len {
                self.epoch += 1;
                self.position = 0;
                order = self.epoch_order(self.epoch);
            }
            let take = (n - batch.len()).min(self.len - self.position);
            batch.extend_from_slice(&order[self.position..self.position + take]);
            self.position += take;
        }
        batch
    }
}

struct RowContext<'a> {
    path: &'a Path,
    at: Location,
    base_dir: &'a Path,
    fallback_source: &'a str,
}

impl RowContext<'_> {
    fn invalid(&self, key: impl Into<String>, problem: impl Into<String>) -> DatasetError {
        DatasetError::InvalidValue {
            path: self.path.to_path_buf(),
            at: self.at,
            key: key.into(),
            problem: problem.into(),
        }
    }

    fn missing(&self, key: impl Into<String>) -> DatasetError {
        DatasetError::MissingKey {
            path: self.path.to_path_buf(),
            at: self.at,
            key: key.into(),
        }
    }

    /// `value`, with JSON text decoded when the column stores nested data as a string.
    fn nested(&self, key: &str, value: Value) -> Result<Value, DatasetError> {
        match value {
            Value::String(text) => serde_json::from_str(&text).map_err(|err| {
                self.invalid(key, format!("is a string that is not valid JSON: {err}"))
            }),
            other => Ok(other),
        }
    }

    fn object(&self, key: &str, value: Value) -> Result<Map<String, Value>, DatasetError> {
        match self.nested(key, value)? {
            Value::Object(object) => Ok(object),
            Value::Null => Ok(Map::new()),
            other => Err(self.invalid(key, format!("must be an object, found {}", kind(&other)))),
        }
    }
}

fn row_from_object(
    mut object: Map<String, Value>,
    index: usize,
    cx: &RowContext<'_>,
) -> Result<Row, DatasetError> {
    let prompt = match object.remove(PROMPT) {
        None | Some(Value::Null) => return Err(cx.missing(PROMPT)),
        Some(value) => parse_prompt(cx.nested(PROMPT, value)?, cx)?,
    };
    let data_source = match object.remove(DATA_SOURCE) {
        None | Some(Value::Null) => cx.fallback_source.to_string(),
        Some(Value::String(s)) => s,
        Some(other) => {
            return Err(cx.invalid(
                DATA_SOURCE,
                format!("must be a string, found {}", kind(&other)),
            ))
        }
    };
    let env_class = match object.remove(ENV_CLASS) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(cx.invalid(
                ENV_CLASS,
                format!("must be a string or null, found {}", kind(&other)),
            ))
        }
    };
    let mut ground_truth = None;
    // SkyRL's `reward_spec` wins over verl's `reward_model` when a file has both.
    for key in [REWARD_MODEL, REWARD_SPEC] {
        if let Some(value) = object.remove(key).filter(|v| !v.is_null()) {
            let spec = cx.object(key, value)?;
            if let Some(gt) = spec.get(GROUND_TRUTH).filter(|gt| !gt.is_null()) {
                ground_truth = Some(gt.clone());
            }
            object.insert(key.to_string(), Value::Object(spec));
        }
    }
    if let Some(gt) = &ground_truth {
        match object.get_mut(REWARD_SPEC) {
            Some(Value::Object(spec)) => {
                spec.insert(GROUND_TRUTH.into(), gt.clone());
            }
            _ => {
                object.insert(REWARD_SPEC.into(), reward_spec(gt));
            }
        }
    }
    let mut extra_info = match object.remove(EXTRA_INFO) {
        Some(value) => cx.object(EXTRA_INFO, value)?,
        None => Map::new(),
    };
    match extra_info.get_mut(DB_PATH) {
        Some(Value::String(p)) => {
            *p = normalize(&cx.base_dir.join(p.as_str()))
                .to_string_lossy()
                .into_owned()
        }
        None | Some(Value::Null) => {}
        Some(other) => {
            return Err(cx.invalid(
                format!("{EXTRA_INFO}.{DB_PATH}"),
                format!("must be a string, found {}", kind(other)),
            ))
        }
    }
    object.insert(EXTRA_INFO.into(), Value::Object(extra_info));
    object.insert(DATA_SOURCE.into(), Value::String(data_source.clone()));
    Ok(Row {
        prompt,
        data_source,
        env_class,
        ground_truth,
        extras: Value::Object(object),
        index,
    })
}

fn parse_prompt(value: Value, cx: &RowContext<'_>) -> Result<Vec<Message>, DatasetError> {
    let Value::Array(items) = value else {
        return Err(cx.invalid(
            PROMPT,
            format!(
                "must be a list of {{role, content}} messages, found {}",
                kind(&value)
            ),
        ));
    };
    if items.is_empty() {
        return Err(cx.invalid(PROMPT, "is an empty list of messages"));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(mut message) = item else {
                return Err(cx.invalid(
                    format!("{PROMPT}[{i}]"),
                    format!("must be a {{role, content}} object, found {}", kind(&item)),
                ));
            };
            let mut text = |field: &str| match message.remove(field) {
                Some(Value::String(s)) => Ok(s),
                None | Some(Value::Null) => Err(cx.missing(format!("{PROMPT}[{i}].{field}"))),
                Some(other) => Err(cx.invalid(
                    format!("{PROMPT}[{i}].{field}"),
                    format!("must be a string, found {}", kind(&other)),
                )),
            };
            Ok(Message {
                role: text("role")?,
                content: text("content")?,
            })
        })
        .collect()
}

fn row_to_object(row: &Row, base_dir: &Path) -> Map<String, Value> {
    let mut extras = row.extras.as_object().cloned().unwrap_or_default();
    if let Some(Value::Object(extra_info)) = extras.get_mut(EXTRA_INFO) {
        if let Some(Value::String(db_path)) = extra_info.get_mut(DB_PATH) {
            *db_path = relative_to(Path::new(db_path.as_str()), base_dir)
                .to_string_lossy()
                .into_owned();
        }
    }
    let prompt = row
        .prompt
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let mut object = Map::new();
    object.insert(DATA_SOURCE.into(), Value::String(row.data_source.clone()));
    object.insert(PROMPT.into(), Value::Array(prompt));
    object.insert(
        ENV_CLASS.into(),
        row.env_class.clone().map_or(Value::Null, Value::String),
    );
    extras.remove(DATA_SOURCE);
    extras.remove(PROMPT);
    extras.remove(ENV_CLASS);
    object.extend(extras);
    object
}

/// Columns in the order they are written: the standard ones first, then any others by name.
fn column_order(objects: &[Map<String, Value>]) -> Vec<String> {
    let standard = [
        DATA_SOURCE,
        PROMPT,
        ENV_CLASS,
        REWARD_SPEC,
        REWARD_MODEL,
        EXTRA_INFO,
    ];
    let mut others: Vec<&String> = objects
        .iter()
        .flat_map(|o| o.keys())
        .filter(|k| !standard.contains(&k.as_str()))
        .collect();
    others.sort();
    others.dedup();
    standard
        .iter()
        .filter(|k| objects.iter().any(|o| o.contains_key(**k)))
        .map(|k| k.to_string())
        .chain(others.into_iter().cloned())
        .collect()
}

/// A row as a JSON object, with where it sits in its file.
type LocatedObject = (Location, Map<String, Value>);

fn read_parquet_objects(path: &Path) -> Result<Vec<LocatedObject>, DatasetError> {
    // The parquet crate panics on some corrupt files (a division by zero while decoding a
    // mangled dictionary page; tests/fuzz.rs found it): such a file is bad input, so it
    // errs naming the file like any other decode failure.
    std::panic::catch_unwind(|| decode_parquet_objects(path)).unwrap_or_else(|panic| {
        Err(DatasetError::Parquet {
            path: path.to_path_buf(),
            cause: parquet::errors::ParquetError::General(format!(
                "the file is corrupt: the parquet reader failed with \"{}\"",
                crate::scoring::panic_message(panic.as_ref())
            )),
        })
    })
}

fn decode_parquet_objects(path: &Path) -> Result<Vec<LocatedObject>, DatasetError> {
    let parquet_err = |cause| DatasetError::Parquet {
        path: path.to_path_buf(),
        cause,
    };
    let file = File::open(path).map_err(|cause| io_err(path, cause))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(parquet_err)?
        .build()
        .map_err(parquet_err)?;
    let mut objects = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|cause| DatasetError::Arrow {
            path: path.to_path_buf(),
            cause,
        })?;
        let rows = arrow_json::batch_to_objects(&batch).map_err(|unsupported| {
            DatasetError::UnsupportedColumn {
                path: path.to_path_buf(),
                column: unsupported.column,
                data_type: unsupported.data_type,
            }
        })?;
        objects.extend(rows);
    }
    Ok(objects
        .into_iter()
        .enumerate()
        .map(|(i, o)| (Location::Row(i), o))
        .collect())
}

fn read_jsonl_objects(path: &Path) -> Result<Vec<LocatedObject>, DatasetError> {
    let file = File::open(path).map_err(|cause| io_err(path, cause))?;
    let mut objects = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let at = Location::Line(i + 1);
        let line = line.map_err(|cause| match cause.kind() {
            // The reader's own error names neither the line nor what is wrong with it.
            std::io::ErrorKind::InvalidData => DatasetError::InvalidValue {
                path: path.to_path_buf(),
                at,
                key: "(line)".into(),
                problem: "is not valid UTF-8 text".into(),
            },
            _ => io_err(path, cause),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(&line) {
            Ok(Value::Object(object)) => objects.push((at, object)),
            Ok(other) => {
                return Err(DatasetError::InvalidValue {
                    path: path.to_path_buf(),
                    at,
                    key: "(line)".into(),
                    problem: format!("must be a JSON object, found {}", kind(&other)),
                })
            }
            Err(cause) => {
                return Err(DatasetError::Json {
                    path: path.to_path_buf(),
                    at,
                    cause,
                })
            }
        }
    }
    Ok(objects)
}

fn read_json_array_objects(path: &Path) -> Result<Vec<LocatedObject>, DatasetError> {
    let file = File::open(path).map_err(|cause| io_err(path, cause))?;
    let value: Value =
        serde_json::from_reader(BufReader::new(file)).map_err(|cause| DatasetError::Json {
            path: path.to_path_buf(),
            at: Location::Line(1),
            cause,
        })?;
    let Value::Array(items) = value else {
        return Err(DatasetError::InvalidValue {
            path: path.to_path_buf(),
            at: Location::Row(0),
            key: "(file)".into(),
            problem: format!(
                "must be a JSON array of row objects, found {}",
                kind(&value)
            ),
        });
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::Object(object) => Ok((Location::Row(i), object)),
            other => Err(DatasetError::InvalidValue {
                path: path.to_path_buf(),
                at: Location::Row(i),
                key: "(row)".into(),
                problem: format!("must be a JSON object, found {}", kind(&other)),
            }),
        })
        .collect()
}

fn write_parquet_objects(path: &Path, objects: &[Map<String, Value>]) -> Result<(), DatasetError> {
    let columns = column_order(objects);
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
    let batch =
        arrow_json::objects_to_batch(objects, &columns).map_err(|cause| DatasetError::Arrow {
            path: path.to_path_buf(),
            cause,
        })?;
    let parquet_err = |cause| DatasetError::Parquet {
        path: path.to_path_buf(),
        cause,
    };
    let file = File::create(path).map_err(|cause| io_err(path, cause))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut writer =
        ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(parquet_err)?;
    writer.write(&batch).map_err(parquet_err)?;
    writer.close().map_err(parquet_err)?;
    Ok(())
}

fn write_jsonl_objects(path: &Path, objects: &[Map<String, Value>]) -> Result<(), DatasetError> {
    let file = File::create(path).map_err(|cause| io_err(path, cause))?;
    let mut out = BufWriter::new(file);
    for object in objects {
        serde_json::to_writer(&mut out, object).map_err(|cause| io_err(path, cause.into()))?;
        out.write_all(b"\n").map_err(|cause| io_err(path, cause))?;
    }
    out.flush().map_err(|cause| io_err(path, cause))
}

fn io_err(path: &Path, cause: std::io::Error) -> DatasetError {
    DatasetError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

fn extension(path: &Path) -> Option<String> {
    path.extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The absolute folder holding `file`.
fn absolute_dir_of(file: &Path) -> Result<PathBuf, DatasetError> {
    let absolute = std::path::absolute(file).map_err(|cause| io_err(file, cause))?;
    Ok(normalize(absolute.parent().unwrap_or(Path::new("/"))))
}

/// `path` with `.` and `..` components resolved lexically (symlinks are left alone).
pub(crate) fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// `path` relative to the folder `base` when both are absolute paths on the same root, else
/// `path` unchanged.
pub(crate) fn relative_to(path: &Path, base: &Path) -> PathBuf {
    if !path.is_absolute() || !base.is_absolute() {
        return path.to_path_buf();
    }
    let path = normalize(path);
    let base = normalize(base);
    let path_parts: Vec<Component> = path.components().collect();
    let base_parts: Vec<Component> = base.components().collect();
    // Different prefixes (Windows drives) have no relative path between them.
    if path_parts.first() != base_parts.first() {
        return path;
    }
    let common = path_parts
        .iter()
        .zip(&base_parts)
        .take_while(|(a, b)| a == b)
        .count();
    let mut relative = PathBuf::new();
    for _ in common..base_parts.len() {
        relative.push("..");
    }
    for part in &path_parts[common..] {
        relative.push(part);
    }
    relative
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_between_folders() {
        assert_eq!(
            relative_to(Path::new("/a/b/c.sqlite"), Path::new("/a/b")),
            PathBuf::from("c.sqlite")
        );
        assert_eq!(
            relative_to(Path::new("/a/x/c.sqlite"), Path::new("/a/b/d")),
            PathBuf::from("../../x/c.sqlite")
        );
        assert_eq!(
            relative_to(Path::new("rel/c.sqlite"), Path::new("/a")),
            PathBuf::from("rel/c.sqlite")
        );
        assert_eq!(normalize(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
    }
}
