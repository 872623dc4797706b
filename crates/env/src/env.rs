//! The environment API: the [`Env`] trait, the chat [`Message`], the [`Registry`] that maps
//! `env_class` names to constructors, and metric aggregation.
//!
//! An environment is small (as in skyrl-gym): it is built from one dataset row's extras,
//! may rewrite the prompt in [`Env::init`], and answers each model turn in [`Env::step`] with
//! observations (empty when done), a reward and per-step metrics. Scoring lives in pure
//! functions next to each environment (`text2sql`, `multiturn_sql`, `gsm8k`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::sandbox::Sandbox;

/// One chat message, OpenAI style (`{"role": ..., "content": ...}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `user` message (how environments return observations).
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
}

/// What [`Env::step`] returns for one model turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutput {
    /// Messages to append to the conversation before the next turn; empty when `done`.
    pub observations: Vec<Message>,
    /// The reward for this turn (outcome envs put the whole reward on the last turn).
    pub reward: f64,
    /// Whether the episode is over.
    pub done: bool,
    /// Numeric per-step metrics (e.g. `format_correct`, `execution_success`), averaged per
    /// env by [`aggregate_metrics`].
    pub metrics: BTreeMap<String, f64>,
}

/// Errors from building or stepping an environment.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// No environment is registered under this id.
    #[error("unknown env_class {id:?}; known: {known}")]
    UnknownEnv {
        /// The id asked for.
        id: String,
        /// Comma-separated registered ids.
        known: String,
    },
    /// An id was registered twice.
    #[error("env_class {0:?} is already registered")]
    AlreadyRegistered(String),
    /// The row's extras lack a field the environment needs, or it has the wrong type.
    #[error("env {env:?}: extras field {field} {problem}")]
    BadExtras {
        /// The environment id.
        env: &'static str,
        /// Dotted path of the field (e.g. `reward_spec.ground_truth`).
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// `step` was called after the episode ended.
    #[error("env {0:?}: step called after the episode was done")]
    StepAfterDone(&'static str),
}

/// A (possibly multi-turn) text environment. Built once per trajectory; `Send` so that
/// trajectories can be stepped on worker threads.
pub trait Env: Send {
    /// Returns the first prompt for the model, possibly rewritten. The default returns the
    /// dataset prompt unchanged.
    fn init(&mut self, prompt: &[Message]) -> Result<Vec<Message>, EnvError> {
        Ok(prompt.to_vec())
    }

    /// Consumes one model turn (the raw generated text) and answers it.
    fn step(&mut self, action: &str) -> Result<StepOutput, EnvError>;
}

/// Shared resources the built-in environments need.
#[derive(Clone)]
pub struct BuiltinConfig {
    /// The SQL sandbox both SQL environments execute in (connection pools are shared).
    pub sandbox: Arc<Sandbox>,
    /// Root folder of the multi-turn SQL databases (SkyRL's `environment.skyrl_gym.text2sql.db_path`):
    /// a row with `db_id` and `data` resolves to `<root>/<data subdir>/<db_id>/<db_id>.sqlite`.
    pub sql_db_root: Option<PathBuf>,
}

impl Default for BuiltinConfig {
    fn default() -> Self {
        Self {
            sandbox: Arc::new(Sandbox::new(Default::default())),
            sql_db_root: None,
        }
    }
}

/// Builds an environment from one row's extras (every dataset column other than `prompt`).
pub type EnvConstructor = Arc<dyn Fn(&Value) -> Result<Box<dyn Env>, EnvError> + Send + Sync>;

/// Maps `env_class` ids to constructors.
#[derive(Clone, Default)]
pub struct Registry {
    constructors: BTreeMap<String, EnvConstructor>,
}

/// Registry id of the single-turn Arctic/BIRD text-to-SQL env ([`crate::text2sql`]).
pub const TEXT2SQL: &str = "text2sql";
/// Alias of [`TEXT2SQL`], the name Arctic's recipes use.
pub const BIRD: &str = "bird";
/// Registry id of the multi-turn SkyRL-SQL env ([`crate::multiturn_sql`]).
pub const TEXT2SQL_MULTITURN: &str = "text2sql_multiturn";
/// Registry id of the GSM8K env ([`crate::gsm8k`]).
pub const GSM8K: &str = "gsm8k";

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry with `text2sql` (single-turn Arctic/BIRD reward; aliases `bird`,
    /// `bird_sql`), `text2sql_multiturn` (SkyRL-SQL) and `gsm8k`, sharing a default sandbox.
    pub fn with_builtins() -> Self {
        Self::with_builtins_config(BuiltinConfig::default())
    }

    /// Like [`Registry::with_builtins`] with explicit shared resources.
    pub fn with_builtins_config(config: BuiltinConfig) -> Self {
        let mut registry = Self::new();
        let reward = Arc::new(crate::text2sql::Text2SqlReward::new(
            config.sandbox.clone(),
            crate::text2sql::DEFAULT_TIMEOUT,
        ));
        let bird: EnvConstructor = Arc::new(move |extras| {
            Ok(Box::new(crate::text2sql::Text2SqlEnv::from_extras(
                reward.clone(),
                extras,
            )?))
        });
        let multiturn: EnvConstructor = Arc::new(move |extras| {
            Ok(Box::new(
                crate::multiturn_sql::MultiTurnSqlEnv::from_extras(
                    config.sandbox.clone(),
                    config.sql_db_root.as_deref(),
                    extras,
                )?,
            ))
        });
        let gsm8k: EnvConstructor =
            Arc::new(|extras| Ok(Box::new(crate::gsm8k::Gsm8kEnv::from_extras(extras)?)));
        for (id, constructor) in [
            (TEXT2SQL, bird.clone()),
            (BIRD, bird.clone()),
            ("bird_sql", bird),
            (TEXT2SQL_MULTITURN, multiturn),
            (GSM8K, gsm8k),
        ] {
            registry
                .register(id, constructor)
                .expect("built-in ids are distinct");
        }
        registry
    }

    /// Registers `constructor` under `id`; an id can be registered once.
    pub fn register(&mut self, id: &str, constructor: EnvConstructor) -> Result<(), EnvError> {
        if self.constructors.contains_key(id) {
            return Err(EnvError::AlreadyRegistered(id.to_string()));
        }
        self.constructors.insert(id.to_string(), constructor);
        Ok(())
    }

    /// Builds the environment `id` from a row's extras.
    pub fn make(&self, id: &str, extras: &Value) -> Result<Box<dyn Env>, EnvError> {
        let constructor = self
            .constructors
            .get(id)
            .ok_or_else(|| EnvError::UnknownEnv {
                id: id.to_string(),
                known: self.ids().collect::<Vec<_>>().join(", "),
            })?;
        constructor(extras)
    }

    /// Builds the environment a row asks for: its `env_class` if present and not null, else
    /// `default_id` (SkyRL's `environment.env_class`).
    pub fn make_for_row(
        &self,
        env_class: Option<&str>,
        default_id: &str,
        extras: &Value,
    ) -> Result<Box<dyn Env>, EnvError> {
        self.make(env_class.unwrap_or(default_id), extras)
    }

    /// Registered ids, sorted.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.constructors.keys().map(String::as_str)
    }
}

/// Averages step metrics per key; a key's mean is over the maps that contain it.
pub fn aggregate_metrics<'a>(
    metrics: impl IntoIterator<Item = &'a BTreeMap<String, f64>>,
) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for map in metrics {
        for (key, value) in map {
            let entry = sums.entry(key.clone()).or_insert((0.0, 0));
            entry.0 += value;
            entry.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(key, (sum, count))| (key, sum / count as f64))
        .collect()
}

/// Averages step metrics per env and key, named `environment/<env>/<key>` for logging.
pub fn aggregate_metrics_by_env<'a>(
    metrics: impl IntoIterator<Item = (&'a str, &'a BTreeMap<String, f64>)>,
) -> BTreeMap<String, f64> {
    let mut per_env: BTreeMap<&str, Vec<&BTreeMap<String, f64>>> = BTreeMap::new();
    for (env, map) in metrics {
        per_env.entry(env).or_default().push(map);
    }
    let mut out = BTreeMap::new();
    for (env, maps) in per_env {
        for (key, mean) in aggregate_metrics(maps) {
            out.insert(format!("environment/{env}/{key}"), mean);
        }
    }
    out
}

/// Reads a string at a dotted path of a JSON object (`"reward_spec.ground_truth"`).
pub(crate) fn json_path<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(value, |v, key| v.get(key))
        .filter(|v| !v.is_null())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;

    impl Env for Echo {
        fn step(&mut self, action: &str) -> Result<StepOutput, EnvError> {
            Ok(StepOutput {
                observations: vec![Message::user(action)],
                ..StepOutput::default()
            })
        }
    }

    #[test]
    fn registry_registers_makes_and_lists_known_ids() {
        let mut registry = Registry::with_builtins();
        let echo: EnvConstructor = Arc::new(|_| Ok(Box::new(Echo)));
        registry.register("echo", echo.clone()).unwrap();
        assert!(matches!(
            registry.register("echo", echo),
            Err(EnvError::AlreadyRegistered(_))
        ));
        let mut env = registry.make_for_row(None, "echo", &Value::Null).unwrap();
        let prompt = [Message::user("hi")];
        assert_eq!(env.init(&prompt).unwrap(), prompt);
        assert_eq!(
            env.step("x").unwrap().observations,
            vec![Message::user("x")]
        );
        let err = registry
            .make("nope", &Value::Null)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            err,
            "unknown env_class \"nope\"; known: bird, bird_sql, echo, gsm8k, text2sql, text2sql_multiturn"
        );
    }

    #[test]
    fn metrics_average_per_key_and_env() {
        let a = BTreeMap::from([("acc".to_string(), 1.0), ("len".to_string(), 4.0)]);
        let b = BTreeMap::from([("acc".to_string(), 0.0)]);
        let mean = aggregate_metrics([&a, &b]);
        assert_eq!(mean["acc"], 0.5);
        assert_eq!(mean["len"], 4.0);
        let by_env = aggregate_metrics_by_env([("gsm8k", &a), ("bird", &b), ("gsm8k", &b)]);
        assert_eq!(by_env["environment/gsm8k/acc"], 0.5);
        assert_eq!(by_env["environment/bird/acc"], 0.0);
        assert_eq!(by_env["environment/gsm8k/len"], 4.0);
    }
}
