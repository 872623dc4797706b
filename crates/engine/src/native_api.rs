//! The wire types of floe's native HTTP API: one JSON route per [`Engine`] verb, served
//! by `floe serve` under [`NATIVE_PREFIX`] and driven by
//! `RemoteEngine` (feature `remote`) and the Python package in `python/`.
//!
//! Bodies are the trait's own types in JSON. Two rules keep a remote run's numbers equal
//! to a local run's: floats are printed shortest-round-trip and parsed exactly (serde_json's
//! `float_roundtrip`), and the floats a verb may legitimately return non-finite (a loss
//! or gradient norm of a step that is then skipped) travel as the strings `"NaN"`,
//! `"Infinity"` and `"-Infinity"` (protobuf's JSON convention), which plain JSON numbers
//! cannot hold.
//!
//! [`Engine`]: crate::Engine

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::policy::StepOutcome;
use crate::sampler::{Generation, SampleRequest};
use crate::verbs::{
    EngineInfo, ForwardBackwardOutput, Loss, SequenceGroup, TokenOutputs, TrainGroup, Weights,
};

/// Path prefix of every native route.
pub const NATIVE_PREFIX: &str = "/floe/v1";

/// `GET /floe/v1/info`: what the server offers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Always `floe`.
    pub server: String,
    /// The server's floe version.
    pub version: String,
    /// Names of the base models (`floe serve --model NAME=PATH`).
    pub models: Vec<String>,
}

/// Which weights a native engine starts from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelSpec {
    /// A base model the server offers, by name; its tokenizer files come back in the
    /// [`CreateEngineResponse`].
    BaseModel(String),
    /// An embedded model (`embedded:tiny`, `embedded:0.6B`, ...) over the client's
    /// tokenizer, with random weights from `seed`: what a local embedded run builds from
    /// the same tokenizer and `trainer.seed`.
    Embedded {
        /// The embedded `model.path`.
        #[serde(default = "embedded_tiny")]
        path: String,
        /// `tokenizer.json` and `tokenizer_config.json` by file name.
        tokenizer_files: BTreeMap<String, String>,
        /// Seed of the random weights.
        seed: u64,
    },
}

fn embedded_tiny() -> String {
    floe_model::embedded::EMBEDDED_TINY.to_string()
}

/// The engine settings a client chooses (they change results: a different micro-batch
/// budget packs differently and rounds differently). Absent fields keep the server's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSettings {
    /// Most tokens in one training or scoring micro-batch.
    pub max_tokens_per_microbatch: Option<usize>,
    /// Which layers' activations the backward recomputes: `true`, `false`, `"auto"` or
    /// a number of layers.
    pub recompute: Option<crate::memory_plan::Recompute>,
    /// KV-cache tokens the client's sampling wants (its concurrent samples times their
    /// longest sequence), so `recompute = "auto"` leaves room for them.
    pub kv_cache_tokens_wanted: Option<usize>,
    /// Seed of sampling requests that bring none.
    pub seed: Option<u64>,
}

/// `POST /floe/v1/engines`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateEngineRequest {
    /// The weights.
    pub model: ModelSpec,
    /// Settings that override the server's.
    #[serde(default)]
    pub settings: EngineSettings,
}

/// Answer of `POST /floe/v1/engines`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreateEngineResponse {
    /// The id that names the engine in every verb's path.
    pub engine_id: String,
    /// The engine's facts.
    pub info: EngineInfo,
    /// The model's tokenizer files (`tokenizer.json`, `tokenizer_config.json`, …) by
    /// file name, so the client encodes exactly as the server's model expects.
    pub tokenizer_files: BTreeMap<String, String>,
}

/// `POST /floe/v1/engines/{id}/sample`. The answer streams one [`SampleEvent`] per line
/// (newline-delimited JSON) as samples finish, ending with `done` or `error`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleBody {
    /// The prompts to sample.
    pub requests: Vec<SampleRequest>,
}

/// One line of a sample stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleEvent {
    /// A finished sample.
    Generation(Generation),
    /// Every sample finished; the last line of a good stream.
    Done {},
    /// Sampling failed; the last line of a failed stream.
    Error(String),
}

/// `POST /floe/v1/engines/{id}/forward`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardBody {
    /// The sequences to score.
    pub groups: Vec<SequenceGroup>,
    /// Which weights.
    pub weights: Weights,
    /// Sampling temperature of the log-probs.
    pub temperature: f32,
}

/// Answer of `forward`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForwardResponse {
    /// Per group, per response.
    pub outputs: Vec<Vec<TokenOutputs>>,
}

/// `POST /floe/v1/engines/{id}/forward_backward`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardBackwardBody {
    /// The mini-batch.
    pub groups: Vec<TrainGroup>,
    /// The loss.
    pub loss: Loss,
    /// Sampling temperature of the log-probs.
    pub temperature: f32,
}

/// Answer of `forward_backward` ([`ForwardBackwardOutput`] with non-finite floats kept).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardResponse {
    /// The loss of the call.
    #[serde(with = "float")]
    pub loss: f64,
    /// Loss diagnostics.
    #[serde(with = "float_map")]
    pub metrics: BTreeMap<String, f64>,
}

impl From<ForwardBackwardOutput> for ForwardBackwardResponse {
    fn from(out: ForwardBackwardOutput) -> Self {
        Self {
            loss: out.loss,
            metrics: out.metrics,
        }
    }
}

impl From<ForwardBackwardResponse> for ForwardBackwardOutput {
    fn from(out: ForwardBackwardResponse) -> Self {
        Self {
            loss: out.loss,
            metrics: out.metrics,
        }
    }
}

/// Answer of `optim_step` ([`StepOutcome`] with a non-finite norm kept); the body of
/// the request is [`crate::policy::OptimParams`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimStepResponse {
    /// Global gradient norm before clipping.
    #[serde(with = "float")]
    pub grad_norm: f64,
    /// True when the norm was not finite and no weight changed.
    pub skipped: bool,
    /// Optimizer steps taken so far.
    pub step: u64,
}

impl From<StepOutcome> for OptimStepResponse {
    fn from(out: StepOutcome) -> Self {
        Self {
            grad_norm: out.grad_norm,
            skipped: out.skipped,
            step: out.step,
        }
    }
}

impl From<OptimStepResponse> for StepOutcome {
    fn from(out: OptimStepResponse) -> Self {
        Self {
            grad_norm: out.grad_norm,
            skipped: out.skipped,
            step: out.step,
        }
    }
}

/// Answer of `sync_sampler_weights`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncResponse {
    /// How long the engine took, in seconds.
    pub seconds: f64,
}

/// Answer of `save_state`: the state stays on the server under this id (like Tinker's
/// `tinker://` checkpoints); the client keeps the id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SaveStateResponse {
    /// Names the saved state in `load_state`.
    pub state_id: String,
}

/// `POST /floe/v1/engines/{id}/load_state`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadStateBody {
    /// What `save_state` answered (from any engine of this server).
    pub state_id: String,
}

/// Answer of `export_hf`: the folder's files, fetched one by one from
/// `GET /floe/v1/exports/{export_id}/{name}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExportResponse {
    /// Names the export on the server.
    pub export_id: String,
    /// The files of the Hugging Face folder.
    pub files: Vec<ExportedFile>,
}

/// One file of an export.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExportedFile {
    /// File name (no folders).
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Serde for an `f64` that may be non-finite: a JSON number when finite, else `"NaN"`,
/// `"Infinity"` or `"-Infinity"`.
pub mod float {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `value`.
    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            serializer.serialize_f64(*value)
        } else {
            serializer.serialize_str(non_finite_text(*value))
        }
    }

    /// Reads a number or one of the three texts.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        Wire::deserialize(deserializer)?
            .value()
            .map_err(serde::de::Error::custom)
    }

    /// The text of a non-finite float.
    pub(super) fn non_finite_text(value: f64) -> &'static str {
        if value.is_nan() {
            "NaN"
        } else if value > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        }
    }

    /// A float as it arrives.
    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Wire {
        Number(f64),
        Text(String),
    }

    impl Wire {
        pub(super) fn value(self) -> Result<f64, String> {
            match self {
                Wire::Number(value) => Ok(value),
                Wire::Text(text) => match text.as_str() {
                    "NaN" => Ok(f64::NAN),
                    "Infinity" => Ok(f64::INFINITY),
                    "-Infinity" => Ok(f64::NEG_INFINITY),
                    _ => Err(format!(
                        "{text:?} is not a float; expected a number, \"NaN\", \"Infinity\" or \"-Infinity\""
                    )),
                },
            }
        }
    }
}

/// [`float`] for each value of a map.
pub mod float_map {
    use std::collections::BTreeMap;

    use serde::ser::SerializeMap;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::float::{non_finite_text, Wire};

    /// Writes `map`.
    pub fn serialize<S: Serializer>(
        map: &BTreeMap<String, f64>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let mut out = serializer.serialize_map(Some(map.len()))?;
        for (key, value) in map {
            if value.is_finite() {
                out.serialize_entry(key, value)?;
            } else {
                out.serialize_entry(key, non_finite_text(*value))?;
            }
        }
        out.end()
    }

    /// Reads a map of numbers or texts.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<String, f64>, D::Error> {
        BTreeMap::<String, Wire>::deserialize(deserializer)?
            .into_iter()
            .map(|(key, value)| Ok((key, value.value().map_err(serde::de::Error::custom)?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_floats_round_trip() {
        let out = ForwardBackwardResponse {
            loss: f64::NAN,
            metrics: BTreeMap::from([
                ("a".to_string(), f64::INFINITY),
                ("b".to_string(), f64::NEG_INFINITY),
                ("c".to_string(), 0.1 + 0.2),
            ]),
        };
        let text = serde_json::to_string(&out).unwrap();
        assert_eq!(
            text,
            r#"{"loss":"NaN","metrics":{"a":"Infinity","b":"-Infinity","c":0.30000000000000004}}"#
        );
        let back: ForwardBackwardResponse = serde_json::from_str(&text).unwrap();
        assert!(back.loss.is_nan());
        assert_eq!(back.metrics["a"], f64::INFINITY);
        assert_eq!(back.metrics["b"], f64::NEG_INFINITY);
        assert_eq!(back.metrics["c"].to_bits(), (0.1f64 + 0.2).to_bits());
    }

    #[test]
    fn floats_parse_exactly() {
        // 17-digit values that a fast, inexact parser rounds to a neighbour.
        let values: Vec<f64> = (1..2000)
            .map(|i| (i as f64).ln() * -1.2345678901234567e-3 + (i as f64).sqrt())
            .collect();
        let text = serde_json::to_string(&values).unwrap();
        let back: Vec<f64> = serde_json::from_str(&text).unwrap();
        for (a, b) in values.iter().zip(&back) {
            assert_eq!(a.to_bits(), b.to_bits(), "{a} came back as {b}");
        }
    }

    #[test]
    fn a_bad_float_text_is_named() {
        let err = serde_json::from_str::<OptimStepResponse>(
            r#"{"grad_norm":"lots","skipped":false,"step":1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("\"lots\" is not a float"), "{err}");
    }
}
