//! Recipes: the run configuration, loaded from TOML files plus dotted command-line overrides.
//!
//! Sections and key names follow SkyRL/verl (`trainer.train_batch_size`,
//! `generator.sampling_params.temperature`, `trainer.algorithm.use_kl_loss`, …) so a recipe
//! from those frameworks reads the same here. Struct defaults follow SkyRL's defaults where
//! floe has the same knob; laptop-sized values live in `recipes/embedded.toml`, not here.
//!
//! Loading layers, later wins: struct defaults, then each recipe file (or the embedded
//! recipe when none is given), then `key=value` overrides. Every layer is checked against the
//! schema before it is merged, so an unknown key is reported with the layer it came from and
//! the closest valid key.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use floe_engine::{Device, NgramSpec, Recompute};
use floe_env::dataset::Row;
use floe_env::synth_sql::Holdout;
use floe_rl::{AdvantageEstimator, LossReduction, RlError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::data::{reference_answer, row_database};

/// `[trainer.algorithm]`: advantage estimator, policy loss, KL and loss reduction, owned by
/// the RL math crate.
pub use floe_rl::AlgorithmConfig;

/// The embedded default recipe (`recipes/embedded.toml`): a tiny model on a synthetic SQL task,
/// SFT warm start then GRPO, sized for a 2-core laptop. `floe train` with no recipe runs it.
pub const EMBEDDED_RECIPE: &str = include_str!("../../../recipes/embedded.toml");

/// The name `floe` reports for the embedded recipe in errors.
const EMBEDDED_RECIPE_NAME: &str = "the embedded recipe (recipes/embedded.toml)";

/// File name of the effective config inside a run directory.
pub const EFFECTIVE_CONFIG_FILE: &str = "config.toml";

/// A full run configuration: one field per recipe section.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[data]`: where prompts come from.
    pub data: DataConfig,
    /// `[trainer]`: batch sizes, schedule of evals and checkpoints, optimiser, algorithm.
    pub trainer: TrainerConfig,
    /// `[generator]`: how completions are sampled.
    pub generator: GeneratorConfig,
    /// `[environment]`: which environment scores completions, and its options.
    pub environment: EnvironmentConfig,
    /// `[model]`: which weights to train.
    pub model: ModelSection,
    /// `[engine]`: where the model runs.
    pub engine: EngineConfig,
    /// `[sft]`: the optional supervised warm start before RL.
    pub sft: SftConfig,
}

/// `[data]`: training and validation prompts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Training prompt sources, concatenated in order: `.parquet`, `.jsonl` or `.json` files
    /// in the verl row format, or `synthetic:<task>` (e.g. `synthetic:sql`) for a generated task.
    pub train_data: Vec<String>,
    /// Validation prompt sources, same forms as `train_data`; empty disables eval.
    pub val_data: Vec<String>,
    /// Use at most this many training prompts (the prompt budget); unset uses them all.
    pub max_train_prompts: Option<usize>,
    /// Use at most this many validation prompts; unset uses them all.
    pub max_val_prompts: Option<usize>,
    /// Prompts a `synthetic:<task>` training source generates.
    pub synthetic_train_size: usize,
    /// Prompts a `synthetic:<task>` validation source generates.
    pub synthetic_val_size: usize,
    /// What `synthetic:sql`'s validation split holds out: `values` (every constant it
    /// names is absent from training) or `questions` (unseen combinations of seen values).
    pub synthetic_holdout: Holdout,
    /// Fraction of `synthetic:sql` training rows whose reference answer mistakes the
    /// question's deciding word (aggregate, sort direction, comparison) for another, as a
    /// confused teacher would; the reward's gold SQL stays right (0 to 1).
    pub synthetic_decision_confusion: f64,
    /// Fraction of `synthetic:sql` training rows whose reference answer also selects the
    /// column the question filters, sorts or joins on, which fails execution match, as a
    /// chatty teacher would (0 to 1).
    pub synthetic_extra_column: f64,
    /// Shuffle the training prompts each epoch (seeded by `trainer.seed`).
    pub shuffle: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            train_data: Vec::new(),
            val_data: Vec::new(),
            max_train_prompts: None,
            max_val_prompts: None,
            synthetic_train_size: 2000,
            synthetic_val_size: 200,
            synthetic_holdout: Holdout::Values,
            synthetic_decision_confusion: 0.0,
            synthetic_extra_column: 0.0,
            shuffle: true,
        }
    }
}

/// `[trainer]`: the RL loop's sizes and cadence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    /// Seed of every random choice: data order, sampling, synthetic data.
    pub seed: u64,
    /// Passes over the training prompts.
    pub epochs: usize,
    /// Stop after this many RL steps even if epochs remain; unset runs all epochs.
    pub max_training_steps: Option<u64>,
    /// Prompts per RL step (each sampled `generator.n_samples_per_prompt` times).
    pub train_batch_size: usize,
    /// Prompts per optimiser step; must divide `train_batch_size`.
    pub policy_mini_batch_size: usize,
    /// Sequences per forward/backward micro-batch (gradient accumulation unit).
    pub micro_train_batch_size_per_gpu: usize,
    /// Sequences per no-grad forward micro-batch (log-prob recomputation).
    pub micro_forward_batch_size_per_gpu: usize,
    /// Token budget per micro-batch, bin-packed; `-1` uses the sequence count
    /// `micro_train_batch_size_per_gpu` instead.
    pub max_tokens_per_microbatch: i64,
    /// Passes over each RL batch (PPO epochs).
    pub update_epochs_per_batch: usize,
    /// Longest prompt in tokens (chat template applied); longer prompts are dropped.
    pub max_prompt_length: usize,
    /// Evaluate every this many steps (and after the last); `-1` never does mid-run.
    pub eval_interval: i64,
    /// Evaluate once before the first step.
    pub eval_before_train: bool,
    /// Prompts per eval generation batch.
    pub eval_batch_size: usize,
    /// Checkpoint every this many steps (and after the last); `-1` only after the last.
    pub ckpt_interval: i64,
    /// Keep only the newest this many checkpoints; `-1` keeps all.
    pub max_ckpts_to_keep: i64,
    /// Where to resume from: `latest` (the newest checkpoint in `run_dir`, if any), `none`,
    /// or the path of a `global_step_N` checkpoint folder.
    pub resume: Resume,
    /// Directory for checkpoints, metrics, the effective config and the report.
    pub run_dir: PathBuf,
    /// Metric sinks besides `metrics.jsonl` (always written): `console`, `tensorboard`.
    #[serde(deserialize_with = "one_or_many")]
    pub logger: Vec<Logger>,
    /// `[trainer.policy]`: the trained model's optimiser.
    pub policy: PolicyConfig,
    /// `[trainer.algorithm]`: advantage estimator, policy loss, KL and loss reduction.
    pub algorithm: AlgorithmConfig,
    /// `[trainer.pipeline]`: whether the next batch's generation overlaps training.
    pub pipeline: PipelineConfig,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            seed: 42,
            epochs: 1,
            max_training_steps: None,
            train_batch_size: 1024,
            policy_mini_batch_size: 256,
            micro_train_batch_size_per_gpu: 1,
            micro_forward_batch_size_per_gpu: 1,
            max_tokens_per_microbatch: -1,
            update_epochs_per_batch: 1,
            max_prompt_length: 512,
            eval_interval: 5,
            eval_before_train: true,
            eval_batch_size: 1024,
            ckpt_interval: 10,
            max_ckpts_to_keep: -1,
            resume: Resume::Latest,
            run_dir: PathBuf::from("runs/floe"),
            logger: vec![Logger::Console, Logger::Tensorboard],
            policy: PolicyConfig::default(),
            algorithm: AlgorithmConfig::default(),
            pipeline: PipelineConfig::default(),
        }
    }
}

/// `[trainer.pipeline]`: how generation and training are scheduled
/// (`docs/ARCHITECTURE.md`, "The async pipeline").
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    /// `sync` or `one_step_off`.
    pub mode: PipelineMode,
    /// Samples more than this many policy versions (RL optimizer steps) older than the
    /// weights a mini-batch would train are dropped from it, and counted
    /// (`async/dropped_stale`); unset keeps every sample.
    pub max_staleness: Option<u64>,
}

/// `trainer.pipeline.mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PipelineMode {
    /// Sample, score, then train, one after the other; every sample is on-policy for the
    /// step's first optimizer step.
    #[default]
    Sync,
    /// Step k trains on the batch sampled during step k - 1, while the batch of step
    /// k + 1 is sampled with the same weights step k's forwards and backwards read: one
    /// step's optimizer steps stale.
    OneStepOff,
}

/// Where a run resumes from (`trainer.resume`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resume {
    /// The newest checkpoint in the run directory; a fresh start when there is none.
    Latest,
    /// Always start fresh.
    None,
    /// This checkpoint folder.
    Path(PathBuf),
}

impl Serialize for Resume {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Resume::Latest => serializer.serialize_str("latest"),
            Resume::None => serializer.serialize_str("none"),
            Resume::Path(path) => path.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Resume {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Ok(match text.as_str() {
            "latest" => Resume::Latest,
            "none" => Resume::None,
            _ => Resume::Path(PathBuf::from(text)),
        })
    }
}

/// A metric sink selected by `trainer.logger`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Logger {
    /// A progress line on the terminal.
    Console,
    /// TensorBoard event files under `<run_dir>/tensorboard/`.
    Tensorboard,
}

/// Accepts `logger = "tensorboard"` as well as `logger = ["console", "tensorboard"]`, as SkyRL does.
fn one_or_many<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Logger>, D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "expected `console`, `tensorboard` or a list of them"
    )]
    enum OneOrMany {
        One(Logger),
        Many(Vec<Logger>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(logger) => vec![logger],
        OneOrMany::Many(loggers) => loggers,
    })
}

/// `[trainer.policy]`: settings of the trained model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// `[trainer.policy.optimizer_config]`.
    pub optimizer_config: OptimizerConfig,
}

/// `[trainer.policy.optimizer_config]`: AdamW, learning-rate schedule and gradient clipping.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW `(beta1, beta2)`.
    pub betas: [f64; 2],
    /// AdamW epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient L2 norm to this; steps with a non-finite norm are skipped.
    pub max_grad_norm: f64,
    /// Learning-rate shape after warmup.
    pub scheduler: Scheduler,
    /// Optimiser steps of linear warmup from 0 to `lr`.
    pub num_warmup_steps: u64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            scheduler: Scheduler::Constant,
            num_warmup_steps: 0,
        }
    }
}

/// Learning-rate schedule after warmup, counted in optimiser steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scheduler {
    /// Hold `lr` (SkyRL's `constant_with_warmup`).
    #[serde(alias = "constant_with_warmup")]
    Constant,
    /// Decay linearly to 0 at the last step.
    Linear,
    /// Half-cosine decay to 0 at the last step.
    Cosine,
}

/// `[generator]`: sampling of training and eval completions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GeneratorConfig {
    /// Completions per training prompt (the GRPO group size).
    pub n_samples_per_prompt: usize,
    /// Model turns per trajectory (1 = single turn).
    pub max_turns: usize,
    /// Multi-turn: longest conversation so far, in tokens, before another turn is refused;
    /// unset allows `max_prompt_length + max_turns · max_generate_length`.
    pub max_input_length: Option<usize>,
    /// `[generator.sampling_params]`: training samples.
    pub sampling_params: RecipeSamplingParams,
    /// `[generator.eval_sampling_params]`: eval samples (greedy by default).
    pub eval_sampling_params: RecipeSamplingParams,
    /// Completions per eval prompt (`pass@k` uses k = this).
    pub eval_n_samples_per_prompt: usize,
    /// Score finished completions in worker threads while the rest are still generating.
    pub async_scoring: bool,
    /// DAPO overlong filtering (SkyRL's key): training responses whose last turn stopped
    /// at the length limit leave the loss; their rewards still count in their group's
    /// advantages.
    pub apply_overlong_filtering: bool,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        Self {
            n_samples_per_prompt: 5,
            max_turns: 1,
            max_input_length: None,
            sampling_params: RecipeSamplingParams::default(),
            eval_sampling_params: RecipeSamplingParams {
                temperature: 0.0,
                ..RecipeSamplingParams::default()
            },
            eval_n_samples_per_prompt: 1,
            async_scoring: true,
            apply_overlong_filtering: false,
        }
    }
}

/// `[generator.sampling_params]` and `[generator.eval_sampling_params]`: how one completion
/// is sampled, in the recipe's (SkyRL's) keys; [`crate::rollout::engine_sampling_params`]
/// turns it into the engine's [`floe_engine::SamplingParams`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecipeSamplingParams {
    /// Most new tokens per turn.
    pub max_generate_length: usize,
    /// Softmax temperature; 0 is greedy.
    pub temperature: f64,
    /// Nucleus sampling mass; 1 is off.
    pub top_p: f64,
    /// Keep only the k likeliest tokens; -1 is off.
    pub top_k: i64,
    /// Drop tokens below this fraction of the top token's probability; 0 is off.
    pub min_p: f64,
    /// Stop strings; the completion ends after the first one it produces (kept in the text).
    pub stop: Vec<String>,
    /// Log-probabilities returned per sampled token (1 = the chosen token's); 0 is none.
    pub logprobs: u32,
}

impl Default for RecipeSamplingParams {
    fn default() -> Self {
        Self {
            max_generate_length: 1024,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            stop: Vec::new(),
            logprobs: 1,
        }
    }
}

/// `[environment]`: scoring of completions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvironmentConfig {
    /// Environment for rows without an `env_class` column (e.g. `text2sql`, `text2sql_multiturn`, `gsm8k`).
    pub env_class: Option<String>,
    /// Threads that run environment steps (SQL execution, scoring).
    pub max_env_workers: usize,
    /// `[environment.sql]`: options of the SQL environments.
    pub sql: SqlEnvConfig,
}

impl Default for EnvironmentConfig {
    fn default() -> Self {
        Self {
            env_class: None,
            max_env_workers: 32,
            sql: SqlEnvConfig::default(),
        }
    }
}

/// `[environment.sql]`: the SQL sandbox shared by the SQL environments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqlEnvConfig {
    /// Seconds a query may run before it is cancelled and scored as failed.
    pub timeout_s: f64,
    /// Rows of a query result shown to the model in a multi-turn observation.
    pub max_observation_rows: usize,
}

impl Default for SqlEnvConfig {
    fn default() -> Self {
        Self {
            timeout_s: 30.0,
            max_observation_rows: 50,
        }
    }
}

/// `[model]`: the weights to train, as a recipe names them (the model's shape is
/// [`floe_model::ModelConfig`]; the native API's choice of model is
/// [`floe_engine::native_api::ModelSpec`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// A Hugging Face model folder (`config.json`, `*.safetensors`, `tokenizer.json`), or
    /// `embedded:tiny` for the built-in tiny Qwen3-shape model, `embedded:small` for one
    /// twice as wide, `embedded:0.6B` (any Qwen3 preset shape) for a random model of that
    /// size over the embedded tokenizer.
    pub path: String,
    /// `[model.chat_template]`: options passed to the chat template.
    pub chat_template: ChatTemplateOptions,
    /// `[model.lora]`: train low-rank adapters on a frozen base instead of every weight.
    pub lora: LoraSection,
    /// Start a folder's shape (its `config.json`) from random normal(0, 0.02) weights
    /// instead of its safetensors: the real model's size before its weights are at hand.
    /// Its `tokenizer.json` is used when the folder has one, else the embedded tokenizer.
    pub random_weights: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: "embedded:tiny".into(),
            chat_template: ChatTemplateOptions::default(),
            lora: LoraSection::default(),
            random_weights: false,
        }
    }
}

impl ModelSection {
    /// Whether the run trains its own tokenizer on the task (saved in the run directory):
    /// an embedded model, or random weights of a folder that has no `tokenizer.json`.
    pub fn uses_embedded_tokenizer(&self) -> bool {
        floe_model::embedded::is_embedded(&self.path)
            || (self.random_weights
                && !std::path::Path::new(&self.path)
                    .join("tokenizer.json")
                    .is_file())
    }
}

/// `[model.lora]`: LoRA adapters (Tinker's and PEFT's meaning), on by a positive rank.
/// The base stays frozen in compute precision; checkpoints hold only the adapters, as
/// a PEFT folder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// Rank of every adapter; 0 trains the full weights.
    pub rank: usize,
    /// The low-rank term is multiplied by `alpha / rank`.
    pub alpha: f32,
    /// Target modules: adapters on the attention projections (q, k, v, o).
    pub train_attn: bool,
    /// Adapters on the MLP projections (gate, up, down).
    pub train_mlp: bool,
    /// An adapter on the lm-head.
    pub train_unembed: bool,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            rank: 0,
            alpha: floe_model::lora::DEFAULT_LORA_ALPHA,
            train_attn: true,
            train_mlp: true,
            train_unembed: true,
        }
    }
}

impl LoraSection {
    /// The adapters to train (their A matrices drawn from `seed`), or `None` for
    /// full-parameter training.
    pub fn adapters(&self, seed: u64) -> Option<floe_model::lora::LoraConfig> {
        (self.rank > 0).then_some(floe_model::lora::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            train_attn: self.train_attn,
            train_mlp: self.train_mlp,
            train_unembed: self.train_unembed,
            seed,
        })
    }
}

/// `[model.chat_template]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChatTemplateOptions {
    /// Qwen3 `enable_thinking`: let the model open a `<think>` block.
    pub enable_thinking: bool,
}

impl Default for ChatTemplateOptions {
    fn default() -> Self {
        Self {
            enable_thinking: true,
        }
    }
}

/// `[engine]`: the device that trains and samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// `cpu` or `cuda:N`.
    pub device: Device,
    /// Which layers' activations the backward recomputes instead of storing (less memory,
    /// a layer's forward more per recomputed layer, same results): `false` none, `true`
    /// all, `N` the first N, `"auto"` the fewest that leave the sampler's KV cache room
    /// for the run's concurrent samples at their longest (none on the CPU). `floe plan`
    /// prints the choice.
    pub recompute: Recompute,
    /// CPU threads; 0 uses every core.
    pub threads: usize,
    /// Fraction of device memory the engine may use (weights, optimiser, KV cache).
    #[serde(alias = "gpu_memory_utilization")]
    pub memory_fraction: f64,
    /// `http://host:port` of a `floe serve` whose engine runs the verbs instead of a
    /// local one (`device` and `threads` are then the server's); the API key comes from
    /// the `FLOE_API_KEY` environment variable.
    pub remote: Option<String>,
    /// With `remote`: how many times a run whose server lost its engine (it restarted,
    /// during a training verb or after one, before the next checkpoint) rewinds to its last
    /// checkpoint, as `trainer.resume=latest` would, and goes on. 0 stops the run with the
    /// error instead.
    pub max_remote_recoveries: u32,
    /// Keep the f32 master weights and AdamW moments in host memory (ZeRO-Offload's
    /// `offload_optimizer`): the device holds the weights in compute precision and the
    /// gradients, about 6 bytes a parameter instead of 18, at the cost of moving each
    /// step's gradients and weights over PCIe and updating on the CPU.
    pub offload_optimizer: bool,
    /// ZeRO stage across the ranks of a data-parallel run (`floe launch`, torchrun,
    /// Slurm): 0 keeps the whole optimizer state on every rank; 1 splits the f32 master
    /// weights and AdamW moments over the ranks (each holds 1/N, on the device or, with
    /// `offload_optimizer`, in host memory), and checkpoints are written in shards that
    /// resume at any world size; 2 splits the f32 gradients too (each rank keeps the
    /// summed gradient of its shard, reduced bucket by bucket during the backward, and
    /// about one layer's full gradients). With one rank nothing is split.
    pub zero_stage: u8,
    /// Speculative decoding with prompt-lookup drafts: a draft length (`4`: up to 4
    /// tokens, matching the last 3 down to 1 tokens) or a table `{ max_draft = 4,
    /// ngram_max = 3, ngram_min = 2 }`. The samples are the ones drawn without it; it
    /// saves model calls when outputs repeat their prompt. Unset: off.
    pub speculative_ngram: Option<NgramSpec>,
    /// Batch-invariant kernels on the log-prob path: a sampled token's log-prob equals,
    /// bit for bit, the one the training forward computes, so each step's old log-probs
    /// are the sampler's and their forward is skipped (`docs/exact-logprobs.md`). The CPU
    /// has them; CUDA refuses the run until it does.
    pub exact_logprobs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            recompute: Recompute::Auto,
            threads: 0,
            memory_fraction: 0.8,
            remote: None,
            max_remote_recoveries: 3,
            offload_optimizer: false,
            zero_stage: 0,
            speculative_ngram: None,
            exact_logprobs: false,
        }
    }
}

/// `[sft]`: supervised warm start on reference answers before RL.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    /// Run the warm start.
    pub enabled: bool,
    /// Passes over the SFT examples.
    pub epochs: usize,
    /// Peak learning rate of the warm start.
    pub lr: f64,
    /// Schedule of the learning rate after warmup, over all SFT optimiser steps.
    pub scheduler: Scheduler,
    /// Optimiser steps of linear warmup from 0 to `lr`.
    pub num_warmup_steps: usize,
    /// Examples per optimiser step.
    pub batch_size: usize,
    /// Warm-start on the reference answers of only the first this many training prompts:
    /// a small labelled set, while GRPO learns from every training prompt through its
    /// reward alone. Unset uses every reference answer.
    pub max_examples: Option<usize>,
    /// At most this many of the warm start's examples from each named database
    /// (`extra_info.db_id`), e.g. `{ shop = 16, school = 16 }`: labelled answers scarce for
    /// some databases, whose questions GRPO then learns from the execution reward alone.
    /// Rows of a database past its cap are skipped and `max_examples` fills up from the
    /// rows after them. Unset: no caps.
    pub max_examples_per_database: Option<BTreeMap<String, usize>>,
    /// Whether GRPO also draws the prompts whose reference answers the warm start learned.
    /// `false` leaves them out, so RL learns only from questions it was never shown an
    /// answer to, like the held-out ones.
    pub rl_on_examples: bool,
}

impl SftConfig {
    /// Which training rows the warm start learns from: of the rows with a reference answer
    /// (`extra_info.reference_answer`), the first `max_examples` (every one when unset),
    /// skipping the rows of a database (`extra_info.db_id`) once its
    /// `max_examples_per_database` cap is reached. Rows without an answer are never examples
    /// and count against no cap.
    pub fn example_mask<'a>(&self, rows: impl IntoIterator<Item = &'a Row>) -> Vec<bool> {
        let caps = self.max_examples_per_database.as_ref();
        let mut taken_per_database: HashMap<&str, usize> = HashMap::new();
        let mut taken = 0;
        rows.into_iter()
            .map(|row| {
                if reference_answer(row).is_none()
                    || self.max_examples.is_some_and(|max| taken >= max)
                {
                    return false;
                }
                if let Some(db) = row_database(row) {
                    if let Some(&cap) = caps.and_then(|caps| caps.get(db)) {
                        let count = taken_per_database.entry(db).or_default();
                        if *count >= cap {
                            return false;
                        }
                        *count += 1;
                    }
                }
                taken += 1;
                true
            })
            .collect()
    }
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            epochs: 1,
            lr: 1e-5,
            scheduler: Scheduler::Constant,
            num_warmup_steps: 0,
            batch_size: 8,
            max_examples: None,
            max_examples_per_database: None,
            rl_on_examples: true,
        }
    }
}

/// Why a config could not be loaded, validated or saved.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A recipe file could not be read, or the effective config could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A recipe is not valid TOML.
    #[error("{origin} is not valid TOML: {message}")]
    Syntax {
        /// Where the text came from.
        origin: Origin,
        /// The parser's message, with line and column.
        message: String,
    },
    /// An override is not of the form `KEY=VALUE`.
    #[error("override `{text}` ({origin}) is not KEY=VALUE (e.g. `trainer.train_batch_size=16`)")]
    OverrideSyntax {
        /// Which override.
        origin: Origin,
        /// Its text.
        text: String,
    },
    /// A key that is not in the schema.
    #[error("unknown key '{key}' ({origin}){}", suggestion_text(suggestion))]
    UnknownKey {
        /// The full dotted key.
        key: String,
        /// Where it was set.
        origin: Origin,
        /// The closest valid key, if one is close.
        suggestion: Option<String>,
    },
    /// A value of the wrong type or out of a closed set.
    #[error("bad value for '{key}' ({origin}): {message}")]
    BadValue {
        /// The full dotted key.
        key: String,
        /// Where it was set.
        origin: Origin,
        /// What was wrong and what was expected.
        message: String,
    },
    /// The config parsed but breaks one or more rules; each message names the key and the fix.
    #[error("invalid config:\n  - {}", .0.join("\n  - "))]
    Invalid(Vec<String>),
    /// The effective config could not be rendered as TOML.
    #[error("cannot write the effective config: {0}")]
    Render(String),
}

fn suggestion_text(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(key) => format!("; did you mean '{key}'?"),
        None => String::new(),
    }
}

/// Where a key's value came from, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A recipe file.
    File(PathBuf),
    /// The embedded default recipe.
    Embedded,
    /// The n-th (1-based) command-line override.
    Override(usize),
    /// Not set anywhere: the built-in default.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(path) => write!(f, "in {}", path.display()),
            Origin::Embedded => write!(f, "in {EMBEDDED_RECIPE_NAME}"),
            Origin::Override(index) => write!(f, "in override #{index}"),
            Origin::Default => f.write_str("from the built-in defaults"),
        }
    }
}

impl Config {
    /// Loads a recipe (the embedded one when `recipe` is `None`) and applies `KEY=VALUE`
    /// overrides such as `trainer.train_batch_size=16`. A recipe file is layered over the
    /// struct defaults, not over the embedded recipe. Does not validate; call
    /// [`Config::validate`] next.
    pub fn load(recipe: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
        match recipe {
            Some(path) => Config::load_files(&[path], overrides),
            None => {
                let mut builder = Builder::new();
                builder.merge_text(EMBEDDED_RECIPE, Origin::Embedded)?;
                builder.apply_overrides(overrides)?;
                builder.finish()
            }
        }
    }

    /// Loads several recipe files, each layered over the previous one, then the overrides.
    pub fn load_files(recipes: &[&Path], overrides: &[String]) -> Result<Config, ConfigError> {
        let mut builder = Builder::new();
        for path in recipes {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            builder.merge_text(&text, Origin::File(path.to_path_buf()))?;
        }
        builder.apply_overrides(overrides)?;
        builder.finish()
    }

    /// Checks the rules that tie keys together; reports every broken rule at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check_sizes(&mut problems);
        self.check_algorithm(&mut problems);
        self.check_sampling(&mut problems);
        self.check_schedule(&mut problems);
        self.check_optimizer(&mut problems);
        self.check_engine(&mut problems);
        self.check_pipeline(&mut problems);
        if let Some(context) = self.model_context_length(&mut problems) {
            self.check_context(context, &mut problems);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// Checks that a prompt plus its completion fit in a model context of `context_length`
    /// tokens. [`Config::validate`] does this itself for Hugging Face folders; call this for
    /// models whose context is only known once built (`embedded:*`).
    pub fn validate_context_length(&self, context_length: usize) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check_context(context_length, &mut problems);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// Writes the full effective config (every key that has a value, defaults included; TOML
    /// cannot spell an unset option) to `<run_dir>/config.toml`, creating `run_dir` if
    /// needed; returns the file's path. Loading that file gives back the same config.
    pub fn save_effective(&self, run_dir: &Path) -> Result<PathBuf, ConfigError> {
        let io_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ConfigError::Io { path, source }
        };
        std::fs::create_dir_all(run_dir).map_err(io_error(run_dir))?;
        let body =
            toml::to_string_pretty(self).map_err(|err| ConfigError::Render(err.to_string()))?;
        let text = format!(
            "# Effective floe config of this run: the recipe, its overrides and every default.\n\
             # Pass this file as the recipe to repeat the run.\n\n{body}"
        );
        let path = run_dir.join(EFFECTIVE_CONFIG_FILE);
        std::fs::write(&path, text).map_err(io_error(&path))?;
        Ok(path)
    }

    fn check_sizes(&self, problems: &mut Vec<String>) {
        let t = &self.trainer;
        let g = &self.generator;
        let positive = [
            ("trainer.epochs", t.epochs),
            ("trainer.train_batch_size", t.train_batch_size),
            ("trainer.policy_mini_batch_size", t.policy_mini_batch_size),
            (
                "trainer.micro_train_batch_size_per_gpu",
                t.micro_train_batch_size_per_gpu,
            ),
            (
                "trainer.micro_forward_batch_size_per_gpu",
                t.micro_forward_batch_size_per_gpu,
            ),
            ("trainer.update_epochs_per_batch", t.update_epochs_per_batch),
            ("trainer.max_prompt_length", t.max_prompt_length),
            ("trainer.eval_batch_size", t.eval_batch_size),
            ("generator.n_samples_per_prompt", g.n_samples_per_prompt),
            ("generator.max_turns", g.max_turns),
            (
                "generator.eval_n_samples_per_prompt",
                g.eval_n_samples_per_prompt,
            ),
            (
                "generator.sampling_params.max_generate_length",
                g.sampling_params.max_generate_length,
            ),
            (
                "generator.eval_sampling_params.max_generate_length",
                g.eval_sampling_params.max_generate_length,
            ),
            (
                "environment.max_env_workers",
                self.environment.max_env_workers,
            ),
        ];
        for (key, value) in positive {
            if value == 0 {
                problems.push(format!("{key} is 0; it must be at least 1"));
            }
        }
        if self.data.train_data.is_empty() {
            problems.push(
                "data.train_data is empty; list prompt files (e.g. train_data = [\"data/train.parquet\"]) \
                 or a synthetic task (train_data = [\"synthetic:sql\"])"
                    .into(),
            );
        }
        for (key, fraction) in [
            (
                "data.synthetic_decision_confusion",
                self.data.synthetic_decision_confusion,
            ),
            (
                "data.synthetic_extra_column",
                self.data.synthetic_extra_column,
            ),
        ] {
            if !(0.0..=1.0).contains(&fraction) {
                problems.push(format!(
                    "{key} is {fraction}; it is a fraction of rows, from 0 to 1"
                ));
            }
        }
        if self.sft.enabled {
            for (key, value) in [
                ("sft.epochs", self.sft.epochs),
                ("sft.batch_size", self.sft.batch_size),
            ] {
                if value == 0 {
                    problems.push(format!(
                        "{key} is 0 with sft.enabled = true; set it to at least 1"
                    ));
                }
            }
            if !(self.sft.lr.is_finite() && self.sft.lr > 0.0) {
                problems.push(format!(
                    "sft.lr is {}; it must be a positive number",
                    self.sft.lr
                ));
            }
        }
        let (train, mini) = (t.train_batch_size, t.policy_mini_batch_size);
        if train > 0 && mini > 0 && train % mini != 0 {
            problems.push(format!(
                "trainer.train_batch_size ({train}) is not a multiple of trainer.policy_mini_batch_size \
                 ({mini}); each optimiser step takes one mini-batch of prompts, so pick a divisor such \
                 as {}",
                nearest_divisors(train, mini)
            ));
        }
        if mini > train && train > 0 {
            problems.push(format!(
                "trainer.policy_mini_batch_size ({mini}) is larger than trainer.train_batch_size ({train})"
            ));
        }
        let micro = t.micro_train_batch_size_per_gpu;
        let mini_sequences = mini.checked_mul(g.n_samples_per_prompt);
        if mini_sequences.is_none() {
            problems.push(format!(
                "trainer.policy_mini_batch_size × generator.n_samples_per_prompt ({mini} × {}) \
                 overflows; use sizes that fit in memory",
                g.n_samples_per_prompt
            ));
        }
        let mini_sequences = mini_sequences.unwrap_or(0);
        if t.max_tokens_per_microbatch == -1
            && micro > 0
            && mini_sequences > 0
            && mini_sequences % micro != 0
        {
            problems.push(format!(
                "trainer.policy_mini_batch_size × generator.n_samples_per_prompt ({mini} × {} = \
                 {mini_sequences} sequences) is not a multiple of trainer.micro_train_batch_size_per_gpu \
                 ({micro}); pick a micro-batch size that divides it, such as {}",
                g.n_samples_per_prompt,
                nearest_divisors(mini_sequences, micro)
            ));
        }
        if t.max_tokens_per_microbatch == 0 || t.max_tokens_per_microbatch < -1 {
            problems.push(format!(
                "trainer.max_tokens_per_microbatch is {}; use a positive token budget, or -1 to \
                 micro-batch by trainer.micro_train_batch_size_per_gpu",
                t.max_tokens_per_microbatch
            ));
        }
        if let Some(max_input) = g.max_input_length {
            if max_input < t.max_prompt_length {
                problems.push(format!(
                    "generator.max_input_length ({max_input}) is below trainer.max_prompt_length ({}); \
                     the first turn would not fit",
                    t.max_prompt_length
                ));
            }
        }
    }

    fn check_algorithm(&self, problems: &mut Vec<String>) {
        let a = &self.trainer.algorithm;
        let before = problems.len();
        if a.use_kl_loss && a.use_kl_in_reward {
            problems.push(
                "trainer.algorithm.use_kl_loss and trainer.algorithm.use_kl_in_reward are both \
                 true; the KL penalty goes either into the loss or into the reward, so set one of \
                 them to false"
                    .into(),
            );
        }
        if a.loss_reduction == LossReduction::SeqMeanTokenSumNorm && a.max_seq_len.is_none() {
            problems.push(
                "trainer.algorithm.loss_reduction = \"seq_mean_token_sum_norm\" divides by a \
                 constant length; set trainer.algorithm.max_seq_len (e.g. to max_prompt_length + \
                 max_generate_length)"
                    .into(),
            );
        }
        if a.max_seq_len == Some(0) {
            problems.push("trainer.algorithm.max_seq_len is 0; it must be at least 1".into());
        }
        self.check_dapo(problems);
        // The rl crate's own rules (clip ranges, off-policy bounds, …); it stops at the first
        // broken one, so it runs only when the rules above, which it repeats, all hold.
        if problems.len() == before {
            if let Err(err) = a.validate() {
                let message = match err {
                    RlError::Config(message) | RlError::Input(message) => message,
                };
                problems.push(format!("trainer.algorithm: {message}"));
            }
        }
    }

    /// DAPO's dynamic sampling and overlong buffer (the rl crate repeats some of these).
    fn check_dapo(&self, problems: &mut Vec<String>) {
        let a = &self.trainer.algorithm;
        let dynamic = &a.dynamic_sampling;
        if dynamic.kind.is_some() {
            if dynamic.max_sample_batches == 0 {
                problems.push(
                    "trainer.algorithm.dynamic_sampling.max_sample_batches is 0; it is the most \
                     batches of prompts a step samples (the first included), so at least 1"
                        .into(),
                );
            }
            let ratio = dynamic.min_replace_ratio;
            if !(0.0..1.0).contains(&ratio) {
                problems.push(format!(
                    "trainer.algorithm.dynamic_sampling.min_replace_ratio is {ratio}; it must \
                     be in [0, 1) (the share of groups with a learning signal above which \
                     `replace` fills the others' places)"
                ));
            }
            if self.generator.n_samples_per_prompt == 1 {
                problems.push(
                    "trainer.algorithm.dynamic_sampling.type is set with \
                     generator.n_samples_per_prompt = 1: a group of one sample never has \
                     differing rewards, so every group would be dropped; use at least 2 samples"
                        .into(),
                );
            }
        }
        let buffer = &a.overlong_buffer;
        let max_generate = self.generator.sampling_params.max_generate_length;
        if buffer.len > max_generate {
            problems.push(format!(
                "trainer.algorithm.overlong_buffer.len ({}) is longer than \
                 generator.sampling_params.max_generate_length ({max_generate}); the penalty \
                 grows over the last len tokens before that limit, so pick at most {max_generate}",
                buffer.len
            ));
        }
        if !(buffer.penalty_factor.is_finite() && buffer.penalty_factor >= 0.0) {
            problems.push(format!(
                "trainer.algorithm.overlong_buffer.penalty_factor is {}; it must be a finite \
                 number >= 0 (the reward lost at the length limit)",
                buffer.penalty_factor
            ));
        }
    }

    fn check_sampling(&self, problems: &mut Vec<String>) {
        let sections = [
            ("generator.sampling_params", &self.generator.sampling_params),
            (
                "generator.eval_sampling_params",
                &self.generator.eval_sampling_params,
            ),
        ];
        for (section, params) in sections {
            if !(params.temperature.is_finite() && params.temperature >= 0.0) {
                problems.push(format!(
                    "{section}.temperature is {}; use 0 (greedy) or a positive number",
                    params.temperature
                ));
            }
            if !(params.top_p > 0.0 && params.top_p <= 1.0) {
                problems.push(format!(
                    "{section}.top_p is {}; it must be in (0, 1] (1 turns it off)",
                    params.top_p
                ));
            }
            if params.top_k == 0 || params.top_k < -1 {
                problems.push(format!(
                    "{section}.top_k is {}; use a positive count, or -1 to turn it off",
                    params.top_k
                ));
            }
            if !(0.0..=1.0).contains(&params.min_p) {
                problems.push(format!(
                    "{section}.min_p is {}; it must be in [0, 1] (0 turns it off)",
                    params.min_p
                ));
            }
            if params.stop.iter().any(String::is_empty) {
                problems.push(format!(
                    "{section}.stop contains an empty string; remove it"
                ));
            }
        }
        if self.generator.n_samples_per_prompt == 1
            && self.trainer.algorithm.advantage_estimator == AdvantageEstimator::Grpo
        {
            problems.push(
                "generator.n_samples_per_prompt is 1, so every GRPO group has one sample and zero \
                 advantage; use at least 2"
                    .into(),
            );
        }
    }

    fn check_schedule(&self, problems: &mut Vec<String>) {
        let t = &self.trainer;
        let intervals = [
            (
                "trainer.eval_interval",
                t.eval_interval,
                "-1 to evaluate only at the end",
            ),
            (
                "trainer.ckpt_interval",
                t.ckpt_interval,
                "-1 to checkpoint only at the end",
            ),
            (
                "trainer.max_ckpts_to_keep",
                t.max_ckpts_to_keep,
                "-1 to keep every checkpoint",
            ),
        ];
        for (key, value, off) in intervals {
            if value == 0 || value < -1 {
                problems.push(format!("{key} is {value}; use a positive number, or {off}"));
            }
        }
        if t.max_training_steps == Some(0) {
            problems.push("trainer.max_training_steps is 0; remove it to run every epoch, or set it to at least 1".into());
        }
        if let Resume::Path(path) = &t.resume {
            if path.as_os_str().is_empty() {
                problems.push(
                    "trainer.resume is empty; use \"latest\", \"none\" or a checkpoint folder"
                        .into(),
                );
            }
        }
    }

    fn check_optimizer(&self, problems: &mut Vec<String>) {
        let o = &self.trainer.policy.optimizer_config;
        let key = "trainer.policy.optimizer_config";
        if !(o.lr.is_finite() && o.lr > 0.0) {
            problems.push(format!(
                "{key}.lr is {}; it must be a positive number",
                o.lr
            ));
        }
        for (index, beta) in o.betas.iter().enumerate() {
            if !(0.0..1.0).contains(beta) {
                problems.push(format!(
                    "{key}.betas[{index}] is {beta}; it must be in [0, 1)"
                ));
            }
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            problems.push(format!(
                "{key}.eps is {}; it must be a small positive number (e.g. 1e-8)",
                o.eps
            ));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            problems.push(format!(
                "{key}.weight_decay is {}; it must be 0 or positive",
                o.weight_decay
            ));
        }
        if !(o.max_grad_norm.is_finite() && o.max_grad_norm > 0.0) {
            problems.push(format!(
                "{key}.max_grad_norm is {}; it must be a positive number",
                o.max_grad_norm
            ));
        }
    }

    fn check_pipeline(&self, problems: &mut Vec<String>) {
        let t = &self.trainer;
        if t.pipeline.mode != PipelineMode::OneStepOff {
            return;
        }
        if t.algorithm.off_policy_correction.is_enabled()
            && self.generator.sampling_params.logprobs == 0
        {
            problems.push(
                "trainer.algorithm.off_policy_correction is set with trainer.pipeline.mode = \
                 \"one_step_off\" but generator.sampling_params.logprobs = 0: the correction \
                 weighs stale samples by the sampler's log-probs (the behaviour policy), so set \
                 generator.sampling_params.logprobs = 1"
                    .into(),
            );
        }
        if let Some(max) = t.pipeline.max_staleness {
            // A one-step-off batch is a whole step's optimizer steps old at its first
            // mini-batch.
            let steps_per_batch = floe_rl::optim::num_optimizer_steps(
                1,
                t.train_batch_size as u64,
                t.policy_mini_batch_size as u64,
                t.update_epochs_per_batch as u64,
            );
            if max < steps_per_batch {
                problems.push(format!(
                    "trainer.pipeline.max_staleness is {max}, but with trainer.pipeline.mode = \
                     \"one_step_off\" every batch is {steps_per_batch} policy versions old when \
                     it starts training (train_batch_size / policy_mini_batch_size × \
                     update_epochs_per_batch optimizer steps), so every sample would be \
                     dropped; allow at least {steps_per_batch}"
                ));
            }
        }
    }

    fn check_engine(&self, problems: &mut Vec<String>) {
        if let Some(problem) = self
            .engine
            .speculative_ngram
            .as_ref()
            .and_then(NgramSpec::problem)
        {
            problems.push(format!("engine.speculative_ngram.{problem}"));
        }
        if self.engine.exact_logprobs && self.engine.remote.is_some() {
            problems.push(
                "engine.exact_logprobs with engine.remote: the server's engine chooses its \
                 kernels; leave exact_logprobs to the server's own settings"
                    .into(),
            );
        }
        if self.engine.zero_stage > 2 {
            problems.push(format!(
                "engine.zero_stage is {}; 0 (the optimizer state on every rank), 1 (split \
                 over the ranks) and 2 (the gradients split too) exist, stage 3 is planned",
                self.engine.zero_stage
            ));
        } else if self.engine.zero_stage >= 1 && self.model.lora.rank > 0 {
            problems.push(format!(
                "engine.zero_stage = {} with model.lora.rank > 0: adapters' optimizer state \
                 and gradients are small and stay whole; leave zero_stage at 0",
                self.engine.zero_stage
            ));
        }
        let fraction = self.engine.memory_fraction;
        if !(fraction > 0.0 && fraction <= 1.0) {
            problems.push(format!(
                "engine.memory_fraction is {fraction}; it must be in (0, 1]"
            ));
        }
        if !(self.environment.sql.timeout_s.is_finite() && self.environment.sql.timeout_s > 0.0) {
            problems.push(format!(
                "environment.sql.timeout_s is {}; it must be a positive number of seconds",
                self.environment.sql.timeout_s
            ));
        }
        let lora = &self.model.lora;
        if lora.rank > 0 {
            if !(lora.alpha.is_finite() && lora.alpha > 0.0) {
                problems.push(format!(
                    "model.lora.alpha is {}; it must be positive",
                    lora.alpha
                ));
            }
            if !(lora.train_attn || lora.train_mlp || lora.train_unembed) {
                problems.push(
                    "model.lora.train_attn, train_mlp and train_unembed are all false: with \
                     model.lora.rank > 0 nothing would train"
                        .into(),
                );
            }
        }
    }

    /// The model's context length when `model.path` is a Hugging Face folder; `None` for
    /// embedded models and folders that do not exist yet (reported when the model loads).
    fn model_context_length(&self, problems: &mut Vec<String>) -> Option<usize> {
        if self.model.path.starts_with("embedded:") {
            return None;
        }
        let config_path = Path::new(&self.model.path).join("config.json");
        let text = std::fs::read_to_string(&config_path).ok()?;
        let json: serde_json::Value = match serde_json::from_str(&text) {
            Ok(json) => json,
            Err(err) => {
                problems.push(format!(
                    "{} is not valid JSON: {err}",
                    config_path.display()
                ));
                return None;
            }
        };
        match json
            .get("max_position_embeddings")
            .and_then(serde_json::Value::as_u64)
        {
            Some(context) => Some(context as usize),
            None => {
                problems.push(format!(
                    "{} has no integer `max_position_embeddings`; is model.path a Hugging Face model folder?",
                    config_path.display()
                ));
                None
            }
        }
    }

    fn check_context(&self, context_length: usize, problems: &mut Vec<String>) {
        let prompt = self.trainer.max_prompt_length;
        let generate = self
            .generator
            .sampling_params
            .max_generate_length
            .max(self.generator.eval_sampling_params.max_generate_length);
        if prompt + generate > context_length {
            problems.push(format!(
                "trainer.max_prompt_length + max_generate_length ({prompt} + {generate} = {}) exceeds \
                 the model's context of {context_length} tokens ({}); shorten one of them",
                prompt + generate,
                self.model.path
            ));
        }
        if let Some(max_input) = self.generator.max_input_length {
            if max_input + self.generator.sampling_params.max_generate_length > context_length {
                problems.push(format!(
                    "generator.max_input_length + generator.sampling_params.max_generate_length \
                     ({max_input} + {}) exceeds the model's context of {context_length} tokens",
                    self.generator.sampling_params.max_generate_length
                ));
            }
        }
    }
}

/// The divisors of `total` closest to `wanted`, for "pick a divisor such as …" hints. The
/// search looks at most [`DIVISOR_SEARCH`] numbers each way, so a huge prime `total` cannot
/// stall validation; `1` always divides.
fn nearest_divisors(total: usize, wanted: usize) -> String {
    const DIVISOR_SEARCH: usize = 100_000;
    let below = (1..=wanted.min(total))
        .rev()
        .take(DIVISOR_SEARCH)
        .find(|d| total % d == 0);
    let above = (wanted..=total)
        .take(DIVISOR_SEARCH)
        .find(|d| total % d == 0);
    match (below, above) {
        (Some(b), Some(a)) if a != b => format!("{b} or {a}"),
        (Some(d), _) | (None, Some(d)) => d.to_string(),
        (None, None) => "1".into(),
    }
}

/// The valid dotted keys, read off the serialised defaults so the schema cannot drift from the
/// structs. A key whose default is unset (`null`) may hold a table the defaults do not show,
/// so nothing below it is rejected here; serde still checks its contents.
struct Schema {
    /// Every key: sections (`trainer.policy`) and values (`trainer.seed`).
    keys: BTreeMap<String, KeyKind>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyKind {
    Section,
    Value,
    Unset,
}

impl Schema {
    fn new() -> Schema {
        let defaults =
            serde_json::to_value(Config::default()).expect("the default config serialises to JSON");
        let mut keys = BTreeMap::new();
        fn walk(prefix: &str, value: &serde_json::Value, keys: &mut BTreeMap<String, KeyKind>) {
            if let serde_json::Value::Object(map) = value {
                for (name, child) in map {
                    let key = if prefix.is_empty() {
                        name.clone()
                    } else {
                        format!("{prefix}.{name}")
                    };
                    let kind = match child {
                        serde_json::Value::Object(_) => KeyKind::Section,
                        serde_json::Value::Null => KeyKind::Unset,
                        _ => KeyKind::Value,
                    };
                    keys.insert(key.clone(), kind);
                    walk(&key, child, keys);
                }
            }
        }
        walk("", &defaults, &mut keys);
        Schema { keys }
    }

    /// Checks every key of `table` (rooted at `prefix`) against the schema.
    fn check(&self, prefix: &str, table: &toml::Table, origin: &Origin) -> Result<(), ConfigError> {
        for (name, value) in table {
            let key = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            match self.keys.get(&key) {
                None => {
                    // Name the full key the user wrote (`wandb.project`, not `wandb`), which
                    // also gives the suggestion more to match on.
                    let key = first_leaf(key, value);
                    return Err(ConfigError::UnknownKey {
                        suggestion: self.closest(&key),
                        key,
                        origin: origin.clone(),
                    });
                }
                Some(KeyKind::Section) => {
                    if let toml::Value::Table(child) = value {
                        self.check(&key, child, origin)?;
                    }
                }
                Some(KeyKind::Value | KeyKind::Unset) => {}
            }
        }
        Ok(())
    }

    /// The valid key closest to an unknown one: a near miss of the whole dotted path first
    /// (`trainer.train_batchsize`), else the same or a near-miss name in another section
    /// (`trainer.temperature` → `generator.sampling_params.temperature`).
    fn closest(&self, key: &str) -> Option<String> {
        let leaf = key.rsplit('.').next().unwrap_or(key);
        let by_path = self
            .keys
            .keys()
            .map(|candidate| (strsim::levenshtein(key, candidate), candidate))
            .min_by_key(|(distance, candidate)| (*distance, candidate.len()));
        if let Some((distance, candidate)) = by_path {
            if distance <= (key.len() / 5).max(2) {
                return Some(candidate.clone());
            }
        }
        self.keys
            .keys()
            .map(|candidate| {
                let candidate_leaf = candidate.rsplit('.').next().unwrap_or(candidate);
                (strsim::levenshtein(leaf, candidate_leaf), candidate)
            })
            .filter(|(distance, _)| *distance <= (leaf.len() / 5).max(1))
            .min_by_key(|(distance, candidate)| (*distance, candidate.len()))
            .map(|(_, candidate)| candidate.clone())
    }
}

/// The dotted key of the first value inside `value` (`key` itself when it is not a table).
fn first_leaf(key: String, value: &toml::Value) -> String {
    match value {
        toml::Value::Table(table) => match table.iter().next() {
            Some((name, child)) => first_leaf(format!("{key}.{name}"), child),
            None => key,
        },
        _ => key,
    }
}

/// Accumulates layers into one TOML table, remembering which layer set each key.
struct Builder {
    schema: Schema,
    merged: toml::Table,
    origins: HashMap<String, Origin>,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            schema: Schema::new(),
            merged: toml::Table::new(),
            origins: HashMap::new(),
        }
    }

    fn merge_text(&mut self, text: &str, origin: Origin) -> Result<(), ConfigError> {
        let table: toml::Table =
            text.parse()
                .map_err(|err: toml::de::Error| ConfigError::Syntax {
                    origin: origin.clone(),
                    message: err.to_string(),
                })?;
        self.schema.check("", &table, &origin)?;
        merge_table(&mut self.merged, table, "", &origin, &mut self.origins);
        Ok(())
    }

    fn apply_overrides(&mut self, overrides: &[String]) -> Result<(), ConfigError> {
        for (index, text) in overrides.iter().enumerate() {
            let origin = Origin::Override(index + 1);
            let (key, raw_value) = match text.split_once('=') {
                Some((key, value)) if !key.trim().is_empty() => (key.trim(), value.trim()),
                _ => {
                    return Err(ConfigError::OverrideSyntax {
                        origin,
                        text: text.clone(),
                    })
                }
            };
            let value = parse_override_value(raw_value);
            // Build the nested table `a.b.c = value` and merge it like a one-key recipe layer.
            let mut layer = toml::Table::new();
            let mut segments: Vec<&str> = key.split('.').map(str::trim).collect();
            let last = segments.pop().expect("split yields at least one segment");
            if last.is_empty() || segments.iter().any(|segment| segment.is_empty()) {
                return Err(ConfigError::OverrideSyntax {
                    origin,
                    text: text.clone(),
                });
            }
            let mut cursor = &mut layer;
            for segment in segments {
                cursor = cursor
                    .entry(segment.to_string())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                    .as_table_mut()
                    .expect("freshly inserted table");
            }
            cursor.insert(last.to_string(), value);
            self.schema.check("", &layer, &origin)?;
            merge_table(&mut self.merged, layer, "", &origin, &mut self.origins);
        }
        Ok(())
    }

    fn finish(self) -> Result<Config, ConfigError> {
        let value = toml::Value::Table(self.merged);
        serde_path_to_error::deserialize(value).map_err(|err| {
            let key = err.path().to_string();
            let origin = origin_of(&self.origins, &key);
            // `message()` leaves out the key toml appends; the error names it already.
            let mut message = err.into_inner().message().to_string();
            if message.ends_with("expected a sequence") {
                message.push_str(" (write a list as [\"a\", \"b\"])");
            }
            ConfigError::BadValue {
                key,
                origin,
                message,
            }
        })
    }
}

/// Parses an override's value as a TOML value (`16`, `1e-6`, `true`, `["a", "b"]`, `"text"`);
/// anything else is taken as a bare string, so `model.path=/data/qwen` needs no quotes.
fn parse_override_value(raw: &str) -> toml::Value {
    format!("value = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut table| table.remove("value"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

/// Merges `layer` into `base`: tables merge key by key, anything else replaces.
fn merge_table(
    base: &mut toml::Table,
    layer: toml::Table,
    prefix: &str,
    origin: &Origin,
    origins: &mut HashMap<String, Origin>,
) {
    for (name, value) in layer {
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match (base.get_mut(&name), value) {
            (Some(toml::Value::Table(existing)), toml::Value::Table(child)) => {
                merge_table(existing, child, &key, origin, origins);
            }
            (_, value) => {
                origins.retain(|existing, _| !existing.starts_with(&format!("{key}.")));
                origins.insert(key, origin.clone());
                base.insert(name, value);
            }
        }
    }
}

/// The layer that set `key`, or the nearest enclosing key (`stop[1]` is set with `stop`).
fn origin_of(origins: &HashMap<String, Origin>, key: &str) -> Origin {
    let mut candidate = key.split('[').next().unwrap_or(key);
    loop {
        if let Some(origin) = origins.get(candidate) {
            return origin.clone();
        }
        match candidate.rsplit_once('.') {
            Some((parent, _)) => candidate = parent,
            None => return Origin::Default,
        }
    }
}
