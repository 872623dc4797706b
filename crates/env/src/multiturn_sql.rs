//! SkyRL-SQL: the multi-turn text-to-SQL env (`text2sql_multiturn`; `text2sql` in skyrl-gym), and its reward.
//!
//! Each turn the model thinks, and either explores with one `<sql>…</sql>` query or answers
//! with `<solution>…</solution>`. A query is run in the [`Sandbox`] (5 s deadline) and
//! answered with
//! `\n\n<observation>{table | error}\n<reminder>You have N turns left to complete the task.</reminder></observation>\n\n`
//! where the table is the distinct result rows (cut to 50 rows if its text exceeds 9000
//! characters). The episode ends on a turn containing both `<solution>` and `</solution>`, or
//! when `max_turns` (default 5) turns were taken. Intermediate rewards are 0.
//!
//! The final reward is computed on the concatenation of every assistant turn and observation:
//! −1 if the format is wrong (see [`extract_solution`]), else 1 if the solution's result set
//! equals the gold result set (30 s deadline each, no LIMIT added), else 0.
//!
//! Differences from the reference: the observation table lists distinct rows in the order
//! SQLite returned them (the reference prints a `frozenset`, whose order is Python's hash
//! order) with pandas-like right-aligned columns; text after `</sql>` in a turn is ignored
//! rather than asserted against (generation should stop on `</sql>` and `</solution>`); and
//! writes fail in the read-only sandbox instead of being rolled back.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use regex::Regex;
use serde_json::Value;

use crate::env::{json_path, Env, EnvError, Message, StepOutput, TEXT2SQL_MULTITURN};
use crate::sandbox::{QueryResult, Sandbox, SqlError, Value as SqlValue};

/// Reward for a badly formatted final trajectory.
pub const REWARD_BAD_FORMAT: f64 = -1.0;
/// Deadline of an exploratory `<sql>` query.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(5);
/// Deadline of each query of the final comparison.
pub const FINAL_TIMEOUT: Duration = Duration::from_secs(30);
/// Turns allowed when the row does not say.
pub const DEFAULT_MAX_TURNS: usize = 5;
/// Observation tables longer than this many characters are cut to [`TRUNCATED_ROWS`] rows.
pub const MAX_OBSERVATION_CHARS: usize = 9000;
/// Rows kept in a cut observation table.
pub const TRUNCATED_ROWS: usize = 50;

fn regex(cell: &'static OnceLock<Regex>, pattern: &str) -> &'static Regex {
    cell.get_or_init(|| Regex::new(pattern).expect("static regex is valid"))
}

/// The reference's format check on the whole trajectory text; returns the solution SQL
/// (stripped) if the format is valid:
/// - exactly one `<solution>`, and exactly one `</solution>` after it;
/// - no `<think>`, `<sql>` or `<observation>` tag (open or close, any case) in the solution;
/// - at least one `<think>…</think>`;
/// - every `</observation>` before the solution is followed (after whitespace) by `<think>`.
pub fn extract_solution(trajectory: &str) -> Option<&str> {
    static TAG_IN_SOLUTION: OnceLock<Regex> = OnceLock::new();
    static THINK: OnceLock<Regex> = OnceLock::new();
    static OBSERVATION_END: OnceLock<Regex> = OnceLock::new();
    if trajectory.matches("<solution>").count() != 1 {
        return None;
    }
    let (before, tail) = trajectory.split_once("<solution>")?;
    if tail.matches("</solution>").count() != 1 {
        return None;
    }
    let (solution, _) = tail.split_once("</solution>")?;
    if regex(&TAG_IN_SOLUTION, r"(?i)</?(think|sql|observation)\b").is_match(solution) {
        return None;
    }
    if !regex(&THINK, r"(?s)<think>.*?</think>").is_match(trajectory) {
        return None;
    }
    for end in regex(&OBSERVATION_END, r"(?i)</observation>").find_iter(before) {
        let rest = before[end.end()..].trim_start();
        let starts_with_think = rest
            .get(..7)
            .is_some_and(|head| head.eq_ignore_ascii_case("<think>"));
        if !starts_with_think {
            return None;
        }
    }
    Some(solution.trim())
}

/// The final reward of a trajectory: −1 bad format, 1 same result set as the gold, else 0.
pub fn compute_score(sandbox: &Sandbox, trajectory: &str, gold_sql: &str, db: &Path) -> f64 {
    let Some(predicted_sql) = extract_solution(trajectory) else {
        return REWARD_BAD_FORMAT;
    };
    let run = |sql: &str| {
        sandbox
            .query_with_timeout(db, sql, FINAL_TIMEOUT)
            .ok()
            .map(QueryResult::into_set)
    };
    match (run(predicted_sql), run(gold_sql)) {
        (Some(predicted), Some(gold)) if predicted == gold => 1.0,
        _ => 0.0,
    }
}

/// The first `<sql>…</sql>` of a turn, unstripped.
pub fn parse_sql_action(action: &str) -> Option<&str> {
    static SQL: OnceLock<Regex> = OnceLock::new();
    regex(&SQL, r"(?s)<sql>(.*?)</sql>")
        .captures(action)
        .map(|c| c.get(1).expect("group 1 always participates").as_str())
}

/// Renders distinct result rows as a right-aligned text table with numbered columns (how
/// pandas prints the reference's `DataFrame(frozenset(rows))`, rows in first-seen order).
pub fn render_table(rows: &[Vec<SqlValue>]) -> String {
    if rows.is_empty() {
        return "Empty DataFrame\nColumns: []\nIndex: []".to_string();
    }
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| row.iter().map(ToString::to_string).collect())
        .collect();
    let widths: Vec<usize> = (0..width)
        .map(|col| {
            cells
                .iter()
                .filter_map(|row| row.get(col))
                .map(|c| c.chars().count())
                .chain(std::iter::once(col.to_string().len()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |values: Vec<String>| {
        values
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:>w$}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut lines = vec![line((0..width).map(|c| c.to_string()).collect())];
    lines.extend(cells.into_iter().map(line));
    lines.join("\n")
}

/// The observation text for one exploratory query (or for a turn without `<sql>`).
pub fn tool_observation(
    sandbox: &Sandbox,
    db: &Path,
    sql: Option<&str>,
    turns_left: i64,
) -> String {
    let reminder =
        format!("<reminder>You have {turns_left} turns left to complete the task.</reminder>");
    let body = match sql {
        None => "Your previous action is invalid. Follow the format of outputting thinking \
                 process and sql tool, and try again."
            .to_string(),
        Some(sql) => match sandbox.query_with_timeout(db, sql, TOOL_TIMEOUT) {
            Ok(result) => {
                let mut seen = HashSet::new();
                let distinct: Vec<Vec<SqlValue>> = result
                    .rows
                    .into_iter()
                    .filter(|row| seen.insert(row.clone()))
                    .collect();
                let table = render_table(&distinct);
                if table.chars().count() > MAX_OBSERVATION_CHARS {
                    let head = &distinct[..distinct.len().min(TRUNCATED_ROWS)];
                    format!(
                        "Truncated to 50 lines since returned response too long: {}",
                        render_table(head)
                    )
                } else {
                    table
                }
            }
            Err(SqlError::Timeout(_)) => format!("SQL Timeout:\n{sql}"),
            Err(err) => format!("Error executing SQL: {err}, db file: {}", db.display()),
        },
    };
    format!("\n\n<observation>{body}\n{reminder}</observation>\n\n")
}

/// Where a dataset's databases live under the SQL root.
fn dataset_subdir(data: &str) -> Option<&'static str> {
    match data {
        "synsql" => Some("SynSQL-2.5M/databases"),
        "spider" => Some("spider/database"),
        "bird" => Some("bird/train/train_databases"),
        _ => None,
    }
}

/// The multi-turn SkyRL-SQL env.
pub struct MultiTurnSqlEnv {
    sandbox: Arc<Sandbox>,
    db_file: PathBuf,
    gold_sql: String,
    max_turns: usize,
    turns: usize,
    /// Every assistant turn and observation, in order (the reward reads their concatenation).
    history: Vec<String>,
    done: bool,
}

impl MultiTurnSqlEnv {
    /// An env over an explicit database file.
    pub fn new(
        sandbox: Arc<Sandbox>,
        db_file: PathBuf,
        gold_sql: String,
        max_turns: usize,
    ) -> Self {
        Self {
            sandbox,
            db_file,
            gold_sql,
            max_turns,
            turns: 0,
            history: Vec::new(),
            done: false,
        }
    }

    /// Builds the env from a SkyRL-SQL row: `reward_spec.ground_truth`, optional `max_turns`,
    /// and either `db_path` / `extra_info.db_path` (a SQLite file) or `db_id` plus `data`
    /// (`synsql`, `spider`, `bird`) resolved under `db_root`. The file must exist.
    pub fn from_extras(
        sandbox: Arc<Sandbox>,
        db_root: Option<&Path>,
        extras: &Value,
    ) -> Result<Self, EnvError> {
        let bad = |field, problem: String| EnvError::BadExtras {
            env: TEXT2SQL_MULTITURN,
            field,
            problem,
        };
        let string = |field: &'static str| -> Result<Option<&str>, EnvError> {
            match json_path(extras, field) {
                None => Ok(None),
                Some(v) => v
                    .as_str()
                    .map(Some)
                    .ok_or_else(|| bad(field, "is not a string".into())),
            }
        };
        let gold_sql = string("reward_spec.ground_truth")?
            .ok_or_else(|| bad("reward_spec.ground_truth", "is missing".into()))?
            .to_string();
        let max_turns = match json_path(extras, "max_turns") {
            None => DEFAULT_MAX_TURNS,
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad("max_turns", "is not a positive integer".into()))?
                as usize,
        };
        let explicit = match string("db_path")? {
            Some(path) => Some(path),
            None => string("extra_info.db_path")?,
        };
        let db_file = match explicit {
            Some(path) => PathBuf::from(path),
            None => {
                let db_id = string("db_id")?.ok_or_else(|| bad("db_id", "is missing".into()))?;
                let data = string("data")?.ok_or_else(|| bad("data", "is missing".into()))?;
                let subdir = dataset_subdir(data).ok_or_else(|| {
                    bad(
                        "data",
                        format!("{data:?} is not one of synsql, spider, bird"),
                    )
                })?;
                let root = db_root.ok_or_else(|| {
                    bad(
                        "db_id",
                        "needs a database root (BuiltinConfig::sql_db_root)".into(),
                    )
                })?;
                root.join(subdir)
                    .join(db_id)
                    .join(format!("{db_id}.sqlite"))
            }
        };
        if !db_file.is_file() {
            return Err(bad(
                "db_path",
                format!("database file not found at {}", db_file.display()),
            ));
        }
        Ok(Self::new(sandbox, db_file, gold_sql, max_turns))
    }

    /// Turns taken so far.
    pub fn turns(&self) -> usize {
        self.turns
    }
}

impl Env for MultiTurnSqlEnv {
    fn step(&mut self, action: &str) -> Result<StepOutput, EnvError> {
        if self.done {
            return Err(EnvError::StepAfterDone(TEXT2SQL_MULTITURN));
        }
        self.turns += 1;
        self.history.push(action.to_string());
        let done = self.turns >= self.max_turns
            || (action.contains("<solution>") && action.contains("</solution>"));
        if done {
            self.done = true;
            let trajectory = self.history.concat();
            let reward = compute_score(&self.sandbox, &trajectory, &self.gold_sql, &self.db_file);
            let metrics = BTreeMap::from([
                (
                    "format_correct".to_string(),
                    f64::from(u8::from(reward != REWARD_BAD_FORMAT)),
                ),
                ("turns".to_string(), self.turns as f64),
            ]);
            return Ok(StepOutput {
                observations: Vec::new(),
                reward,
                done: true,
                metrics,
            });
        }
        let turns_left = self.max_turns as i64 - self.turns as i64;
        let observation = tool_observation(
            &self.sandbox,
            &self.db_file,
            parse_sql_action(action),
            turns_left,
        );
        self.history.push(observation.clone());
        Ok(StepOutput {
            observations: vec![Message::user(observation)],
            reward: 0.0,
            done: false,
            metrics: BTreeMap::new(),
        })
    }
}
