//! JSON bodies of the Tinker routes the server answers. Unknown fields (the `type`
//! discriminators, SDK extras) are ignored, as the protocol asks.

use serde::Deserialize;
use serde_json::Value;

/// `create_session`.
#[derive(Debug, Deserialize)]
pub struct CreateSession {
    /// Free-form tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Free-form metadata.
    #[serde(default)]
    pub user_metadata: serde_json::Map<String, Value>,
}

/// `session_heartbeat`.
#[derive(Debug, Deserialize)]
pub struct SessionHeartbeat {
    /// The session.
    pub session_id: String,
}

/// `create_model`.
#[derive(Debug, Deserialize)]
pub struct CreateModel {
    /// The client's session.
    pub session_id: String,
    /// Per-session counter of created models.
    pub model_seq_id: u64,
    /// Name of a served base model.
    pub base_model: String,
    /// LoRA settings (see [`crate::convert::lora_config`]); absent for full-weight
    /// training.
    #[serde(default)]
    pub lora_config: Option<Value>,
    /// Free-form metadata.
    #[serde(default)]
    pub user_metadata: Option<Value>,
}

/// Requests addressed to a training model.
#[derive(Debug, Deserialize)]
pub struct ModelRequest {
    /// The training model.
    pub model_id: String,
}

/// `optim_step`.
#[derive(Debug, Deserialize)]
pub struct OptimStep {
    /// The training model.
    pub model_id: String,
    /// Position in the model's request order.
    pub seq_id: i64,
    /// AdamW hyper-parameters.
    pub adam_params: Option<AdamParams>,
    /// Other optimizers (`dimuon`): rejected.
    pub optimizer_params: Option<Value>,
}

/// Decoupled AdamW hyper-parameters, with the SDK's defaults.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub struct AdamParams {
    /// Learning rate.
    pub learning_rate: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip_norm: f64,
}

impl Default for AdamParams {
    fn default() -> Self {
        Self {
            learning_rate: 1e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-12,
            weight_decay: 0.0,
            grad_clip_norm: 0.0,
        }
    }
}

/// `save_weights` and `save_weights_for_sampler`.
#[derive(Debug, Deserialize)]
pub struct SaveWeights {
    /// The training model.
    pub model_id: String,
    /// Position in the model's request order.
    pub seq_id: i64,
    /// Checkpoint name; absent for an unnamed sampler snapshot.
    pub path: Option<String>,
    /// Per-session counter of sampling sessions (unnamed sampler snapshots).
    pub sampling_session_seq_id: Option<u64>,
    /// Replace an existing checkpoint of that name.
    #[serde(default)]
    pub overwrite: bool,
}

/// `load_weights`: create-via-load (`session_id`, `model_seq_id`) or the legacy form
/// (`model_id`, `seq_id`).
#[derive(Debug, Deserialize)]
pub struct LoadWeights {
    /// A `tinker://` path of saved weights.
    pub path: String,
    /// Also restore the AdamW moments.
    #[serde(default)]
    pub optimizer: bool,
    /// Create-via-load: the session.
    pub session_id: Option<String>,
    /// Create-via-load: per-session model counter.
    pub model_seq_id: Option<u64>,
    /// Legacy: the model to load into.
    pub model_id: Option<String>,
    /// Legacy: position in that model's request order.
    pub seq_id: Option<i64>,
    /// Create-via-load: free-form metadata of the new run.
    #[serde(default)]
    pub user_metadata: Option<Value>,
}

/// `create_sampling_session`.
#[derive(Debug, Deserialize)]
pub struct CreateSamplingSession {
    /// The client's session.
    pub session_id: String,
    /// Per-session counter of sampling sessions.
    pub sampling_session_seq_id: u64,
    /// Saved sampler weights to sample.
    pub model_path: Option<String>,
    /// A served base model to sample.
    pub base_model: Option<String>,
}

/// `asample`.
#[derive(Debug, Deserialize)]
pub struct Sample {
    /// The sampling session.
    pub sampling_session_id: Option<String>,
    /// Per-sampling-client counter.
    #[serde(default)]
    pub seq_id: u64,
    /// Samples to draw.
    #[serde(default = "one")]
    pub num_samples: usize,
    /// The prompt.
    pub prompt: ModelInput,
    /// How to sample.
    pub sampling_params: TinkerSamplingParams,
    /// Also return each prompt token's log-prob.
    #[serde(default)]
    pub prompt_logprobs: bool,
    /// Top-k prompt log-probs: not supported yet.
    #[serde(default)]
    pub topk_prompt_logprobs: u64,
    /// The most likely tokens (up to 20) and their log-probs at each sampled position.
    #[serde(default)]
    pub topk_sample_logprobs: u64,
    /// Alternative prompt tokens: not supported yet.
    #[serde(default)]
    pub prompt_alt_tokens_k: u64,
    /// Sample a base model directly (no sampling session).
    pub base_model: Option<String>,
    /// Sample saved sampler weights directly (no sampling session).
    pub model_path: Option<String>,
}

fn one() -> usize {
    1
}

/// A prompt as chunks.
#[derive(Debug, Deserialize)]
pub struct ModelInput {
    /// The chunks, concatenated.
    pub chunks: Vec<JsonChunk>,
}

/// A JSON chunk; only `encoded_text` is served.
#[derive(Debug, Deserialize)]
pub struct JsonChunk {
    /// `encoded_text`, `image`, ...
    #[serde(rename = "type", default = "encoded_text")]
    pub kind: String,
    /// Token ids of an `encoded_text` chunk.
    #[serde(default)]
    pub tokens: Vec<i64>,
}

fn encoded_text() -> String {
    "encoded_text".into()
}

/// Tinker's `SamplingParams` as the SDK sends them (the wire type; the routes turn it into
/// the engine's [`floe_engine::SamplingParams`]).
#[derive(Debug, Deserialize)]
pub struct TinkerSamplingParams {
    /// Most tokens to generate.
    pub max_tokens: Option<usize>,
    /// Seed of the samples.
    pub seed: Option<u64>,
    /// Softmax temperature.
    #[serde(default = "one_f32")]
    pub temperature: f32,
    /// Top-k; -1 disables.
    #[serde(default = "minus_one")]
    pub top_k: i32,
    /// Nucleus threshold.
    #[serde(default = "one_f32")]
    pub top_p: f32,
    /// A string, strings or token ids; absent stops on EOS, `[]` never stops.
    pub stop: Option<Stop>,
}

fn one_f32() -> f32 {
    1.0
}

fn minus_one() -> i32 {
    -1
}

/// The forms of `stop`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    Text(String),
    /// Stop token ids.
    Tokens(Vec<u32>),
    /// Stop strings.
    Texts(Vec<String>),
}

/// `retrieve_future`.
#[derive(Debug, Deserialize)]
pub struct RetrieveFuture {
    /// The future.
    pub request_id: String,
    /// A finished result may be answered with its size first (`complete_metadata`), so
    /// the SDK reserves memory for it before fetching it.
    #[serde(default)]
    pub allow_metadata_only: bool,
}

/// `retrieve_futures`: long-polls a sampling client's completion log.
#[derive(Debug, Deserialize)]
pub struct RetrieveFutures {
    /// Whose completions.
    pub target: FuturesTarget,
    /// Completions up to this cursor were seen (0: none).
    #[serde(default)]
    pub prev_cursor: u64,
    /// Longest wait in seconds (0 answers at once; absent means the long-poll time).
    pub timeout: Option<f64>,
}

/// The target of [`RetrieveFutures`].
#[derive(Debug, Deserialize)]
pub struct FuturesTarget {
    /// Only `sampling_session`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The sampling session.
    pub sampling_session_id: String,
    /// A cloned sampling client's number (its `seq_id`s count from this times 10⁹).
    #[serde(default)]
    pub cloned_sampler_id: u64,
}

/// `cancel_future`.
#[derive(Debug, Deserialize)]
pub struct CancelFuture {
    /// The future to cancel.
    pub request_id: String,
}

/// `weights_info`.
#[derive(Debug, Deserialize)]
pub struct WeightsInfo {
    /// A `tinker://` path of saved weights.
    pub tinker_path: String,
}

/// Query of the listing routes (`training_runs`, `checkpoints`).
#[derive(Debug, Deserialize)]
pub struct Page {
    /// Most items to return.
    pub limit: Option<usize>,
    /// Items to skip.
    #[serde(default)]
    pub offset: usize,
}
