//! The Arctic / BIRD text-to-SQL reward (`bird_reward.compute_score`) and its single-turn env.
//!
//! Scoring, exactly as the reference (Python `re`, `json`, `sqlite3`):
//! 1. **Extraction** from the text after the first `</think>` (or the whole response), first
//!    hit wins:
//!    - the last ```` ```sql ```` block whose stripped text is longer than 6 characters
//!      (case-sensitive prefix match, so ```` ```sqlite ```` yields `ite\nSELECT …`);
//!    - the last fenced block (fences paired left to right) containing `SELECT` in any case
//!      and longer than 6 characters, **info string included**: ```` ```SQL ````,
//!      ```` ```postgresql ```` and ```` ```json ```` blocks yield `SQL\nSELECT …`, which
//!      fails to run;
//!    - the first ```` ```json ```` block, from its last `{` to its first `}`, with `\n` and
//!      `\'` unescaped, parsed leniently (raw newlines inside strings are accepted, `\"`
//!      is decoded): its `sql` value, unstripped (reached only when no block was found
//!      above, e.g. a JSON block whose fence closes a code block before it);
//!    - the first `SELECT` (any case, even inside a word) followed by whitespace and at
//!      least one character, up to the first `\n\n` or the end. A lone `SELECT` is no SQL.
//!
//!    `<answer>` tags are not used. Whitespace is Python's (`\s`, `strip()`).
//! 2. **Format**: SQL was extracted and the whole response has exactly one `<think>` and one
//!    `</think>`, in that order.
//! 3. **LIMIT rule**: unless the upper-cased query contains `LIMIT ` / `LIMIT\n` / `LIMIT\t`
//!    anywhere (a substring test, so a `LIMIT` in a subquery counts), trailing whitespace and
//!    `;` are dropped and ` LIMIT 5000;` is appended; applied to predicted and gold SQL alike.
//! 4. **Gold**: the stripped non-empty `alternative_answers` if that list is non-empty (the
//!    ground truth is then ignored, even when no alternative survives), else the ground truth
//!    if non-empty. **No gold: 0.0 with no format bonus**, `execution_success` false (the
//!    prediction is not run), `format_correct` as computed.
//! 5. **Execution** in the read-only [`Sandbox`] (30 s deadline); results are compared as sets
//!    of rows against each gold query: equal → 1.0, different → 0.1, gold failed → 0.0; the
//!    best gold wins. A failed or timed-out prediction scores 0.0.
//! 6. **Format bonus**: when the format is correct, `score = max(score, 0.1)`.
//!
//! No `db_path` (absent or empty), or no SQL: 0.0 with `format_correct` false.
//!
//! Execution follows Python `sqlite3` (see [`crate::sandbox`]), including statements the
//! reference runs harmlessly on its fresh per-query connection (`ATTACH ':memory:'`,
//! connection-level pragmas, `TEMP` tables), which run on a scratch connection with nothing
//! written to any file. Deliberate differences, for safety: `ATTACH` of a file path,
//! `VACUUM`, pragmas that are not connection-level, and writes to the database fail (the
//! reference could attach and create files); results over 1 000 000 rows or 256 MiB fail;
//! [`crate::sandbox::SandboxConfig::strict_read_only`] (off by default) refuses connection
//! state as well. Other known differences: a non-string `sql` value in the JSON block
//! yields no SQL here where the reference raises; `NaN`/`Infinity` in that JSON block
//! fail to parse here; the SQLite version is rusqlite's bundled one, not Python's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::env::{json_path, Env, EnvError, StepOutput, TEXT2SQL};
use crate::sandbox::{RowSet, Sandbox, SqlError};

/// Score for a prediction whose result equals a gold result.
pub const SCORE_CORRECT: f64 = 1.0;
/// Score for a prediction that runs but differs, and the floor for a well-formatted answer.
pub const SCORE_EXECUTES: f64 = 0.1;
/// Per-query deadline of the reference.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The reward's three outputs, as `compute_score` returns them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Text2SqlScore {
    /// 1.0, 0.1 or 0.0.
    pub score: f64,
    /// SQL was extracted and the think tags are well formed.
    pub format_correct: bool,
    /// The predicted SQL ran without error within the deadline.
    pub execution_success: bool,
}

/// One case to score.
#[derive(Debug, Clone, Copy)]
pub struct Text2SqlCase<'a> {
    /// The model's full response.
    pub response: &'a str,
    /// The gold SQL (`reward_model.ground_truth`).
    pub ground_truth: &'a str,
    /// Further gold queries (`extra_info.alternative_answers`); used instead of the ground
    /// truth when non-empty.
    pub alternative_answers: &'a [String],
    /// The SQLite file (`extra_info.db_path`).
    pub db_path: Option<&'a Path>,
}

fn regex(cell: &'static OnceLock<Regex>, pattern: &str) -> &'static Regex {
    cell.get_or_init(|| Regex::new(pattern).expect("static regex is valid"))
}

/// The text the SQL is extracted from: after the first `</think>`, else all of it.
fn answer_part(response: &str) -> &str {
    match response.split_once("</think>") {
        Some((_, after)) => after,
        None => response,
    }
}

/// Python's `\s` and `str.isspace()` also count the separators U+001C–U+001F, which Rust's
/// `\s` and `char::is_whitespace` do not.
const PY_SPACE: &str = r"[\s\x1C-\x1F]";

fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1C'..='\x1F').contains(&c)
}

/// Python's `str.strip()`.
fn py_strip(text: &str) -> &str {
    text.trim_matches(is_py_space)
}

/// Extracts the predicted SQL (step 1 of the module docs); `None` if there is none.
pub fn extract_sql(response: &str) -> Option<String> {
    let text = answer_part(response);
    sql_fence(text)
        .or_else(|| generic_fence(text))
        .or_else(|| json_fence(text))
        .or_else(|| raw_select(text))
}

/// The last ```` ```sql ```` block longer than 6 characters once stripped. Case-sensitive
/// and a prefix match: ```` ```sqlite ```` yields `ite` and what follows.
fn sql_fence(text: &str) -> Option<String> {
    static SQL_BLOCK: OnceLock<Regex> = OnceLock::new();
    let blocks = regex(
        &SQL_BLOCK,
        &format!(r"(?s)```sql{PY_SPACE}*(.*?){PY_SPACE}*```"),
    );
    let found: Vec<_> = blocks
        .captures_iter(text)
        .map(|c| c[1].to_string())
        .collect();
    found
        .iter()
        .rev()
        .map(|block| py_strip(block))
        .find(|block| block.chars().count() > 6)
        .map(str::to_string)
}

/// The last fenced block (fences paired left to right) containing `SELECT` in any case and
/// longer than 6 characters. The info string stays in: ```` ```SQL ````, ```` ```postgresql ````
/// and ```` ```json ```` blocks yield `SQL\nSELECT …`, which then fails to run.
fn generic_fence(text: &str) -> Option<String> {
    static ANY_BLOCK: OnceLock<Regex> = OnceLock::new();
    let blocks = regex(
        &ANY_BLOCK,
        &format!(r"(?s)```{PY_SPACE}*(.*?){PY_SPACE}*```"),
    );
    let found: Vec<_> = blocks
        .captures_iter(text)
        .map(|c| c[1].to_string())
        .collect();
    found
        .iter()
        .rev()
        .map(|block| py_strip(block))
        .find(|block| block.to_uppercase().contains("SELECT") && block.chars().count() > 6)
        .map(str::to_string)
}

/// The `sql` value of the first ```` ```json ```` block, read as the reference reads it:
/// from the block's last `{` to its first `}` (so nested objects are not found), with `\n`
/// and `\'` unescaped first, parsed as `json.loads(strict=False)`. The value is returned as
/// it is, unstripped; a value that is not a non-empty string yields nothing (the reference
/// raises on a non-string one).
fn json_fence(text: &str) -> Option<String> {
    static JSON_BLOCK: OnceLock<Regex> = OnceLock::new();
    let block = regex(&JSON_BLOCK, &format!(r"(?s)```{PY_SPACE}*json(.*?)```"));
    let body = block.captures(text)?.get(1)?.as_str();
    let (left, right) = (body.rfind('{')?, body.find('}')?);
    let object = body.get(left..=right).unwrap_or("");
    let unescaped = object.replace("\\n", "\n").replace("\\'", "'");
    let parsed: Value = python_json_loads(&unescaped)?;
    match parsed.get("sql")? {
        Value::String(sql) if !sql.is_empty() => Some(sql.clone()),
        _ => None,
    }
}

/// `json.loads(text, strict=False)` for the inputs [`json_fence`] sees: control characters
/// inside strings (raw newlines, tabs) are accepted, which `serde_json` rejects, so they
/// are escaped before parsing. Differences left: `NaN`, `Infinity` and out-of-range
/// numbers, which Python accepts, fail here.
fn python_json_loads(text: &str) -> Option<Value> {
    let mut escaped = String::with_capacity(text.len());
    let (mut in_string, mut after_backslash) = (false, false);
    for c in text.chars() {
        if in_string && !after_backslash && c < ' ' {
            escaped.push_str(&format!("\\u{:04x}", u32::from(c)));
            continue;
        }
        escaped.push(c);
        if after_backslash {
            after_backslash = false;
        } else if in_string && c == '\\' {
            after_backslash = true;
        } else if c == '"' {
            in_string = !in_string;
        }
    }
    serde_json::from_str(&escaped).ok()
}

/// The first `SELECT`, any case and even inside a word, followed by whitespace and at least
/// one character, up to the first blank line (`\n\n` exactly) or the end of the text.
fn raw_select(text: &str) -> Option<String> {
    static RAW_SELECT: OnceLock<Regex> = OnceLock::new();
    // Python's `$` without MULTILINE also matches before a final newline.
    let raw = regex(
        &RAW_SELECT,
        &format!(r"(?si)(SELECT{PY_SPACE}+.+?)(?:\n\n|\n\z|\z)"),
    );
    let found = raw.captures(text)?.get(1)?.as_str();
    Some(py_strip(found).to_string())
}

/// Exactly one `<think>` and one `</think>`, the opening first (the tag part of the format check).
pub fn think_tags_ok(response: &str) -> bool {
    response.matches("<think>").count() == 1
        && response.matches("</think>").count() == 1
        && response.find("<think>") < response.find("</think>")
}

/// Applies the reference's LIMIT rule (step 3 of the module docs); an empty query is left
/// empty.
pub fn with_limit(sql: &str) -> String {
    let upper = sql.to_uppercase();
    if sql.is_empty()
        || ["LIMIT ", "LIMIT\n", "LIMIT\t"]
            .iter()
            .any(|needle| upper.contains(needle))
    {
        sql.to_string()
    } else {
        let body = sql
            .trim_end_matches(is_py_space)
            .trim_end_matches(';')
            .trim_end_matches(is_py_space);
        format!("{body} LIMIT 5000;")
    }
}

/// Combines execution outcomes into the score (steps 4–5 of the module docs): `predicted` is
/// the prediction's result (`None` if it failed), `golds` each gold query's (`None` if it
/// failed).
pub fn combine(
    format_correct: bool,
    predicted: Option<&RowSet>,
    golds: impl IntoIterator<Item = Option<Arc<RowSet>>>,
) -> f64 {
    let score = match predicted {
        None => 0.0,
        Some(predicted) => golds
            .into_iter()
            .map(|gold| match gold {
                Some(gold) if *gold == *predicted => SCORE_CORRECT,
                Some(_) => SCORE_EXECUTES,
                None => 0.0,
            })
            .fold(0.0, f64::max),
    };
    if format_correct {
        score.max(SCORE_EXECUTES)
    } else {
        score
    }
}

/// The gold queries, as the reference picks them: the stripped non-empty alternative
/// answers when the list is non-empty (even if none survive: the ground truth is then not
/// used), else the ground truth when it is non-empty.
fn gold_queries<'a>(case: &Text2SqlCase<'a>) -> Vec<&'a str> {
    if case.alternative_answers.is_empty() {
        return [case.ground_truth]
            .into_iter()
            .filter(|gold| !gold.is_empty())
            .collect();
    }
    case.alternative_answers
        .iter()
        .map(|gold| py_strip(gold))
        .filter(|gold| !gold.is_empty())
        .collect()
}

/// Computes the reward over a shared [`Sandbox`], caching gold results (the same gold query
/// is scored once per sample of a group; databases are immutable, so its result is too).
pub struct Text2SqlReward {
    sandbox: Arc<Sandbox>,
    timeout: Duration,
    gold_cache: Mutex<GoldCache>,
}

/// Gold results by (database, gold SQL); `None` for a gold query that failed.
type GoldCache = HashMap<(PathBuf, String), Option<Arc<RowSet>>>;

/// Gold results kept before the cache is emptied.
const GOLD_CACHE_ENTRIES: usize = 16_384;

impl Text2SqlReward {
    /// A reward executing in `sandbox` with the per-query `timeout`.
    pub fn new(sandbox: Arc<Sandbox>, timeout: Duration) -> Self {
        Self {
            sandbox,
            timeout,
            gold_cache: Mutex::new(HashMap::new()),
        }
    }

    /// Scores one case.
    pub fn score(&self, case: &Text2SqlCase<'_>) -> Text2SqlScore {
        let nothing = |format_correct| Text2SqlScore {
            score: 0.0,
            format_correct,
            execution_success: false,
        };
        // No database: nothing is checked, not even the format.
        let Some(db) = case.db_path.filter(|db| !db.as_os_str().is_empty()) else {
            return nothing(false);
        };
        let Some(sql) = extract_sql(case.response) else {
            return nothing(false);
        };
        let format_correct = think_tags_ok(case.response);
        let golds = gold_queries(case);
        // No gold: 0.0, and the prediction is not run, so no format bonus either.
        if golds.is_empty() {
            return nothing(format_correct);
        }
        let predicted = self
            .sandbox
            .query_with_timeout(db, &with_limit(&sql), self.timeout)
            .ok()
            .map(|result| result.into_set());
        let score = combine(
            format_correct,
            predicted.as_ref(),
            predicted
                .is_some()
                .then(|| golds.iter().map(|gold| self.gold_result(db, gold)))
                .into_iter()
                .flatten(),
        );
        Text2SqlScore {
            score,
            format_correct,
            execution_success: predicted.is_some(),
        }
    }

    fn gold_result(&self, db: &Path, gold: &str) -> Option<Arc<RowSet>> {
        let key = (db.to_path_buf(), gold.to_string());
        if let Some(hit) = self.lock_cache().get(&key) {
            return hit.clone();
        }
        let outcome = self
            .sandbox
            .query_with_timeout(db, &with_limit(gold), self.timeout);
        let result = outcome
            .as_ref()
            .ok()
            .map(|r| Arc::new(r.clone().into_set()));
        // A timeout may be load, not the query; only deterministic outcomes are cached.
        if !matches!(outcome, Err(SqlError::Timeout(_))) {
            let mut cache = self.lock_cache();
            if cache.len() >= GOLD_CACHE_ENTRIES {
                cache.clear();
            }
            cache.insert(key, result.clone());
        }
        result
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, GoldCache> {
        self.gold_cache.lock().expect("gold cache lock poisoned")
    }
}

/// The single-turn text-to-SQL env (`text2sql`, alias `bird`): one answer, scored by
/// [`Text2SqlReward`].
pub struct Text2SqlEnv {
    reward: Arc<Text2SqlReward>,
    ground_truth: String,
    alternative_answers: Vec<String>,
    db_path: Option<PathBuf>,
    done: bool,
}

impl Text2SqlEnv {
    /// Builds the env from a verl-style row: gold SQL in `reward_model.ground_truth` (or
    /// `reward_spec.ground_truth`; missing or null scores 0.0), `extra_info.db_path`,
    /// optional `extra_info.alternative_answers`.
    pub fn from_extras(reward: Arc<Text2SqlReward>, extras: &Value) -> Result<Self, EnvError> {
        let bad = |field, problem: &str| EnvError::BadExtras {
            env: TEXT2SQL,
            field,
            problem: problem.to_string(),
        };
        // A missing or null gold is the reference's `ground_truth=None`: every answer scores
        // 0.0 (see `gold_queries`), which is not a malformed row.
        let ground_truth = match json_path(extras, "reward_model.ground_truth")
            .or_else(|| json_path(extras, "reward_spec.ground_truth"))
        {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(gold)) => gold.clone(),
            Some(_) => return Err(bad("reward_model.ground_truth", "is not a string")),
        };
        let db_path = match json_path(extras, "extra_info.db_path") {
            None => None,
            Some(v) => {
                Some(PathBuf::from(v.as_str().ok_or_else(|| {
                    bad("extra_info.db_path", "is not a string")
                })?))
            }
        };
        let alternative_answers = match json_path(extras, "extra_info.alternative_answers") {
            None => Vec::new(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                bad(
                    "extra_info.alternative_answers",
                    "is not a list of SQL strings",
                )
            })?,
        };
        Ok(Self {
            reward,
            ground_truth,
            alternative_answers,
            db_path,
            done: false,
        })
    }
}

impl Env for Text2SqlEnv {
    fn step(&mut self, action: &str) -> Result<StepOutput, EnvError> {
        if self.done {
            return Err(EnvError::StepAfterDone(TEXT2SQL));
        }
        self.done = true;
        let result = self.reward.score(&Text2SqlCase {
            response: action,
            ground_truth: &self.ground_truth,
            alternative_answers: &self.alternative_answers,
            db_path: self.db_path.as_deref(),
        });
        let metrics = [
            ("format_correct", result.format_correct),
            ("execution_success", result.execution_success),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), f64::from(u8::from(v))))
        .collect();
        Ok(StepOutput {
            observations: Vec::new(),
            reward: result.score,
            done: true,
            metrics,
        })
    }
}
