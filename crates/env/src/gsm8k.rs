//! GSM8K: single-turn math with a strict `#### <number>` answer (skyrl-gym's `gsm8k`).
//!
//! The answer is the first match of `#### ` followed by an optional `-` and a run of digits,
//! dots and commas; commas (and `$`) are removed. Reward 1.0 if it equals the ground truth
//! string exactly, else 0.0 (also 0.0 when nothing matches).

use std::sync::OnceLock;

use regex::Regex;
use serde_json::Value;

use crate::env::{json_path, Env, EnvError, StepOutput, GSM8K};

/// The strict answer: the first `#### <number>`, commas and `$` removed.
pub fn extract_answer(response: &str) -> Option<String> {
    static STRICT: OnceLock<Regex> = OnceLock::new();
    let strict = STRICT.get_or_init(|| Regex::new(r"#### (-?[0-9.,]+)").expect("valid regex"));
    let number = strict.captures(response)?.get(1)?.as_str();
    Some(number.replace([',', '$'], ""))
}

/// 1.0 if the strict answer equals `ground_truth` exactly, else 0.0.
pub fn compute_score(response: &str, ground_truth: &str) -> f64 {
    match extract_answer(response) {
        Some(answer) if answer == ground_truth => 1.0,
        _ => 0.0,
    }
}

/// The single-turn GSM8K env; the ground truth is `reward_spec.ground_truth`.
pub struct Gsm8kEnv {
    ground_truth: String,
    done: bool,
}

impl Gsm8kEnv {
    /// An env for one question.
    pub fn new(ground_truth: impl Into<String>) -> Self {
        Self {
            ground_truth: ground_truth.into(),
            done: false,
        }
    }

    /// Builds the env from a row; a numeric ground truth is taken as its JSON text.
    pub fn from_extras(extras: &Value) -> Result<Self, EnvError> {
        let truth = json_path(extras, "reward_spec.ground_truth").ok_or(EnvError::BadExtras {
            env: GSM8K,
            field: "reward_spec.ground_truth",
            problem: "is missing".into(),
        })?;
        match truth {
            Value::String(s) => Ok(Self::new(s.as_str())),
            Value::Number(n) => Ok(Self::new(n.to_string())),
            _ => Err(EnvError::BadExtras {
                env: GSM8K,
                field: "reward_spec.ground_truth",
                problem: "is not a string or number".into(),
            }),
        }
    }
}

impl Env for Gsm8kEnv {
    fn step(&mut self, action: &str) -> Result<StepOutput, EnvError> {
        if self.done {
            return Err(EnvError::StepAfterDone(GSM8K));
        }
        self.done = true;
        let reward = compute_score(action, &self.ground_truth);
        let metrics = [
            ("format_correct", extract_answer(action).is_some()),
            ("answer_accuracy", reward > 0.0),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), f64::from(u8::from(v))))
        .collect();
        Ok(StepOutput {
            observations: Vec::new(),
            reward,
            done: true,
            metrics,
        })
    }
}
