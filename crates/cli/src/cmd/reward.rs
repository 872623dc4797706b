//! `floe reward`: score a JSONL file of cases with a reward function, in parallel.
//!
//! Results are written one JSON object per line, in input order, to `--output` or stdout; a
//! summary (rows, mean score, rates, rows/s) goes to stderr.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use floe_env::sandbox::{Sandbox, SandboxConfig};
use floe_env::scoring::score_all;
use floe_env::text2sql::{Text2SqlCase, Text2SqlReward};
use serde_json::{json, Value};

/// Subcommands of `floe reward`.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Score text-to-SQL responses with the Arctic/BIRD reward (1.0 / 0.1 / 0.0).
    ///
    /// Input rows: {"id", "response", "gold_sql", "db_path", "alternative_answers"?}; a
    /// relative db_path is resolved against the input file's folder. A missing, null or
    /// empty gold_sql scores 0.0 (no format bonus), as the reference does; a missing or
    /// empty db_path scores 0.0 with format_correct false. Output rows:
    /// {"id", "score", "format_correct", "execution_success"}.
    Text2sql(Text2SqlArgs),
    /// Score GSM8K responses (strict `#### <number>`, exact match).
    ///
    /// Input rows: {"id", "response", "ground_truth"}. Output rows: {"id", "score"}.
    Gsm8k(Gsm8kArgs),
}

/// Flags of `floe reward text2sql`.
#[derive(clap::Args)]
pub struct Text2SqlArgs {
    /// JSONL file of cases.
    #[arg(long)]
    input: PathBuf,
    /// Where to write results (JSONL); stdout if absent.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Per-query deadline in seconds, for predicted and gold SQL alike.
    #[arg(long, default_value_t = 30.0)]
    timeout_s: f64,
    /// Scoring threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Refuse statements that change only the connection (ATTACH ':memory:', connection
    /// pragmas, TEMP tables), which the reference runs; they then score as failures.
    #[arg(long)]
    strict_read_only: bool,
}

/// Flags of `floe reward gsm8k`.
#[derive(clap::Args)]
pub struct Gsm8kArgs {
    /// JSONL file of cases.
    #[arg(long)]
    input: PathBuf,
    /// Where to write results (JSONL); stdout if absent.
    #[arg(long)]
    output: Option<PathBuf>,
}

/// Runs `floe reward`.
pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Text2sql(args) => text2sql(args),
        Command::Gsm8k(args) => gsm8k(args),
    }
}

/// One `floe reward text2sql` input row.
struct Text2SqlRow {
    id: Value,
    response: String,
    gold_sql: String,
    db_path: Option<PathBuf>,
    alternative_answers: Vec<String>,
}

impl Text2SqlRow {
    fn parse(row: &Value) -> Result<Self, String> {
        let alternative_answers = match row.get("alternative_answers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| item.as_str().map(String::from))
                .collect::<Option<_>>()
                .ok_or("alternative_answers must be a list of SQL strings")?,
            Some(_) => return Err("alternative_answers must be a list of SQL strings".into()),
        };
        let db_path = match row.get("db_path") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_str().ok_or("db_path must be a string")?)
                .filter(|path| !path.is_empty())
                .map(PathBuf::from),
        };
        // The reference's `ground_truth=None`: the row is scored (0.0), not rejected.
        let gold_sql = match row.get("gold_sql") {
            None | Some(Value::Null) => String::new(),
            Some(_) => required_string(row, "gold_sql")?,
        };
        Ok(Self {
            id: row.get("id").cloned().ok_or("missing key \"id\"")?,
            response: required_string(row, "response")?,
            gold_sql,
            db_path,
            alternative_answers,
        })
    }
}

fn required_string(row: &Value, key: &str) -> Result<String, String> {
    match row.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("key {key:?} must be a string")),
        None => Err(format!("missing key {key:?}")),
    }
}

fn text2sql(args: Text2SqlArgs) -> Result<()> {
    if !(args.timeout_s > 0.0 && args.timeout_s.is_finite()) {
        bail!(
            "--timeout-s must be a positive number of seconds, got {}",
            args.timeout_s
        );
    }
    let mut rows = read_jsonl(&args.input, Text2SqlRow::parse)?;
    let base = args.input.parent().unwrap_or(Path::new(""));
    for row in &mut rows {
        if let Some(path) = row.db_path.as_mut().filter(|p| p.is_relative()) {
            *path = base.join(&*path);
        }
    }
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let sandbox = Arc::new(Sandbox::new(SandboxConfig {
        timeout,
        strict_read_only: args.strict_read_only,
        ..SandboxConfig::default()
    }));
    let reward = Text2SqlReward::new(sandbox, timeout);
    let start = Instant::now();
    let scores = score_all(&rows, args.threads, |row| {
        reward.score(&Text2SqlCase {
            response: &row.response,
            ground_truth: &row.gold_sql,
            alternative_answers: &row.alternative_answers,
            db_path: row.db_path.as_deref(),
        })
    })?;
    let elapsed = start.elapsed();
    let outputs = rows.iter().zip(&scores).map(|(row, s)| {
        json_line(&[
            ("id", row.id.clone()),
            ("score", json!(s.score)),
            ("format_correct", json!(s.format_correct)),
            ("execution_success", json!(s.execution_success)),
        ])
    });
    write_jsonl(args.output.as_deref(), outputs)?;
    let n = scores.len().max(1) as f64;
    let rate = |count: usize| count as f64 / n;
    eprintln!(
        "{} rows  mean score {:.4}  format {:.4}  execution {:.4}  {:.1} rows/s",
        scores.len(),
        scores.iter().map(|s| s.score).sum::<f64>() / n,
        rate(scores.iter().filter(|s| s.format_correct).count()),
        rate(scores.iter().filter(|s| s.execution_success).count()),
        scores.len() as f64 / elapsed.as_secs_f64().max(1e-9),
    );
    Ok(())
}

/// One `floe reward gsm8k` input row.
struct Gsm8kRow {
    id: Value,
    response: String,
    ground_truth: String,
}

impl Gsm8kRow {
    fn parse(row: &Value) -> Result<Self, String> {
        let ground_truth = match row.get("ground_truth") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(_) => return Err("ground_truth must be a string or number".into()),
            None => return Err("missing key \"ground_truth\"".into()),
        };
        Ok(Self {
            id: row.get("id").cloned().ok_or("missing key \"id\"")?,
            response: required_string(row, "response")?,
            ground_truth,
        })
    }
}

fn gsm8k(args: Gsm8kArgs) -> Result<()> {
    let rows = read_jsonl(&args.input, Gsm8kRow::parse)?;
    let start = Instant::now();
    let scores: Vec<f64> = rows
        .iter()
        .map(|row| floe_env::gsm8k::compute_score(&row.response, &row.ground_truth))
        .collect();
    let elapsed = start.elapsed();
    write_jsonl(
        args.output.as_deref(),
        rows.iter()
            .zip(&scores)
            .map(|(row, &score)| json_line(&[("id", row.id.clone()), ("score", json!(score))])),
    )?;
    let n = scores.len().max(1) as f64;
    eprintln!(
        "{} rows  mean score {:.4}  {:.1} rows/s",
        scores.len(),
        scores.iter().sum::<f64>() / n,
        scores.len() as f64 / elapsed.as_secs_f64().max(1e-9),
    );
    Ok(())
}

/// Reads one JSON object per non-blank line; an error names the file and line.
fn read_jsonl<T>(path: &Path, parse: impl Fn(&Value) -> Result<T, String>) -> Result<Vec<T>> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: malformed JSON", path.display(), i + 1))?;
        match parse(&value) {
            Ok(row) => rows.push(row),
            Err(problem) => bail!("{}:{}: {problem}", path.display(), i + 1),
        }
    }
    Ok(rows)
}

/// One JSON object with its keys in the given order (`json!` would sort them).
fn json_line(fields: &[(&str, Value)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(key, value)| format!("{}:{value}", Value::from(*key)))
        .collect();
    format!("{{{}}}\n", body.join(","))
}

/// Writes the lines to `output` or stdout; a closed stdout (`| head`) ends output quietly.
fn write_jsonl(output: Option<&Path>, mut lines: impl Iterator<Item = String>) -> Result<()> {
    let sink: Box<dyn Write> = match output {
        Some(path) => Box::new(
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut writer = BufWriter::new(sink);
    let written = lines
        .try_for_each(|line| writer.write_all(line.as_bytes()))
        .and_then(|()| writer.flush());
    match written {
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.with_context(|| match output {
            Some(path) => format!("cannot write {}", path.display()),
            None => "cannot write to stdout".to_string(),
        }),
    }
}
