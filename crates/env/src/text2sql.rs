//! The Arctic / BIRD text-to-SQL reward (`bird_reward.compute_score`) and its single-turn env.
//!
//! Scoring, exactly as the reference:
//! 1. **Extraction** from the text after the first `</think>` (or the whole response), first
//!    hit wins: the last ```` ```sql ```` block whose stripped text is longer than 6 characters;
//!    the last other fenced block containing `SELECT` (any case); a ```` ```json ```` block's
//!    `{"sql": ...}`; a raw `SELECT …` up to a blank line or the end. `<answer>` tags are not used.
//! 2. **Format**: SQL was extracted and the whole response has exactly one `<think>` and one
//!    `</think>`, in that order.
//! 3. **LIMIT rule**: unless the upper-cased query contains `LIMIT ` / `LIMIT\n` / `LIMIT\t`
//!    anywhere (a substring test, so a `LIMIT` in a subquery counts), trailing `;` are dropped
//!    and ` LIMIT 5000;` is appended; applied to predicted and gold SQL alike.
//! 4. **Execution** in the read-only [`Sandbox`] (30 s deadline); results are compared as sets
//!    of rows against each gold query (`alternative_answers` if non-empty, else the ground
//!    truth): equal → 1.0, different → 0.1, gold failed → 0.0; the best gold wins. A failed or
//!    timed-out prediction, no SQL, or no `db_path` scores 0.0.
//! 5. **Format bonus**: when the format is correct, `score = max(score, 0.1)`.
//!
//! Where the reference's prose leaves a detail open, this follows Arctic's own
//! `parse_response` (`` ```sql\s*(.*?)\s*``` ``, case-sensitive, so ```` ```sqlite ```` is
//! a prefix match), and the ```` ```json ```` step is reachable because step 2 skips `json`
//! fences. Execution follows Python `sqlite3` (see [`crate::sandbox`]). Known differences,
//! none reachable by a plain `SELECT`: the sandbox refuses writes, `ATTACH` and pragma
//! assignments outright (the reference's read-only connection refuses writes too, but could
//! `ATTACH` an existing file); results over 1 000 000 rows or 256 MiB fail; the SQLite
//! version is rusqlite's bundled one, not Python's.

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

/// Extracts the predicted SQL (step 1 of the module docs); `None` if there is none.
pub fn extract_sql(response: &str) -> Option<String> {
    static SQL_BLOCK: OnceLock<Regex> = OnceLock::new();
    static ANY_BLOCK: OnceLock<Regex> = OnceLock::new();
    static INFO_LINE: OnceLock<Regex> = OnceLock::new();
    static JSON_BLOCK: OnceLock<Regex> = OnceLock::new();
    static RAW_SELECT: OnceLock<Regex> = OnceLock::new();
    let text = answer_part(response);

    let sql_blocks = regex(&SQL_BLOCK, r"(?s)```sql\s*(.*?)\s*```");
    let sql = sql_blocks
        .captures_iter(text)
        .map(|c| c[1].trim().to_string())
        .filter(|block| block.chars().count() > 6)
        .last();
    if sql.is_some() {
        return sql;
    }

    // Other fences: drop the info string (`sqlite`, `SQL`, …); `json` fences are step 3.
    let any_block = regex(&ANY_BLOCK, r"(?s)```(.*?)```");
    let info_line = regex(&INFO_LINE, r"^[A-Za-z0-9_+.-]*[ \t]*\n");
    let generic = any_block
        .captures_iter(text)
        .filter_map(|c| {
            let body = c.get(1).expect("group 1 always participates").as_str();
            if body
                .get(..4)
                .is_some_and(|head| head.eq_ignore_ascii_case("json"))
            {
                return None;
            }
            let code = match info_line.find(body) {
                Some(m) => &body[m.end()..],
                None => body,
            };
            let code = code.trim();
            code.to_uppercase()
                .contains("SELECT")
                .then(|| code.to_string())
        })
        .last();
    if generic.is_some() {
        return generic;
    }

    let json_blocks = regex(&JSON_BLOCK, r"(?si)```json\s*(.*?)\s*```");
    let from_json = json_blocks
        .captures_iter(text)
        .filter_map(|c| {
            let parsed: Value = serde_json::from_str(&c[1]).ok()?;
            let sql = parsed.get("sql")?.as_str()?.trim();
            (!sql.is_empty()).then(|| sql.to_string())
        })
        .last();
    if from_json.is_some() {
        return from_json;
    }

    let raw = regex(&RAW_SELECT, r"(?si)\bSELECT\b.*?(?:\n\s*\n|\z)");
    raw.find(text)
        .map(|m| m.as_str().trim().to_string())
        .filter(|sql| !sql.is_empty())
}

/// Exactly one `<think>` and one `</think>`, the opening first (the tag part of the format check).
pub fn think_tags_ok(response: &str) -> bool {
    response.matches("<think>").count() == 1
        && response.matches("</think>").count() == 1
        && response.find("<think>") < response.find("</think>")
}

/// Applies the reference's LIMIT rule (step 3 of the module docs).
pub fn with_limit(sql: &str) -> String {
    let upper = sql.to_uppercase();
    if ["LIMIT ", "LIMIT\n", "LIMIT\t"]
        .iter()
        .any(|needle| upper.contains(needle))
    {
        sql.to_string()
    } else {
        format!("{} LIMIT 5000;", sql.trim_end().trim_end_matches(';'))
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
        let sql = extract_sql(case.response);
        let format_correct = sql.is_some() && think_tags_ok(case.response);
        let (Some(sql), Some(db)) = (sql, case.db_path) else {
            return Text2SqlScore {
                score: 0.0,
                format_correct,
                execution_success: false,
            };
        };
        let predicted = self
            .sandbox
            .query_with_timeout(db, &with_limit(&sql), self.timeout)
            .ok()
            .map(|result| result.into_set());
        let execution_success = predicted.is_some();
        let score = match &predicted {
            None => combine(format_correct, None, []),
            Some(predicted) => {
                let golds: Vec<&str> = if case.alternative_answers.is_empty() {
                    vec![case.ground_truth]
                } else {
                    case.alternative_answers
                        .iter()
                        .map(String::as_str)
                        .collect()
                };
                combine(
                    format_correct,
                    Some(predicted),
                    golds.into_iter().map(|gold| self.gold_result(db, gold)),
                )
            }
        };
        Text2SqlScore {
            score,
            format_correct,
            execution_success,
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
    /// `reward_spec.ground_truth`), `extra_info.db_path`, optional
    /// `extra_info.alternative_answers`.
    pub fn from_extras(reward: Arc<Text2SqlReward>, extras: &Value) -> Result<Self, EnvError> {
        let bad = |field, problem: &str| EnvError::BadExtras {
            env: TEXT2SQL,
            field,
            problem: problem.to_string(),
        };
        let ground_truth = json_path(extras, "reward_model.ground_truth")
            .or_else(|| json_path(extras, "reward_spec.ground_truth"))
            .ok_or_else(|| bad("reward_model.ground_truth", "is missing"))?
            .as_str()
            .ok_or_else(|| bad("reward_model.ground_truth", "is not a string"))?
            .to_string();
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
