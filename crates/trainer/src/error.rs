//! The trainer's error: each variant says which part failed (the engine, the packing of a
//! batch, the algorithm config, a request that cannot be served, a file).

use std::path::PathBuf;

/// Why a trainer or engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device could not be opened (e.g. `cuda:0` in a build without CUDA).
    #[error("device `{device}`: {source}")]
    Device {
        /// The device as configured.
        device: String,
        /// What the backend said.
        source: floe_backend::Error,
    },
    /// The engine (device, model, weights, sampler, saved state) failed.
    #[error(transparent)]
    Engine(#[from] floe_engine::Error),
    /// Training ran out of device memory; the message says which settings free some.
    #[error(
        "{source}; training micro-batches hold up to {tokens} tokens (recompute {recompute}) \
         beside a sampler KV cache of {kv_cache_gib:.1} GiB: lower \
         trainer.micro_train_batch_size_per_gpu or set trainer.max_tokens_per_microbatch, set \
         engine.recompute = true, or lower engine.memory_fraction"
    )]
    TrainingOutOfMemory {
        /// The device's refusal.
        source: Box<floe_engine::Error>,
        /// The micro-batch token budget.
        tokens: usize,
        /// Whether activations were recomputed.
        recompute: bool,
        /// The KV cache's size.
        kv_cache_gib: f64,
    },
    /// A batch could not be packed into micro-batches.
    #[error("packing: {0}")]
    Packing(#[from] floe_engine::PackingError),
    /// The algorithm configuration cannot be used.
    #[error(transparent)]
    Algorithm(#[from] floe_rl::RlError),
    /// A request to the engine is malformed; the message names the group, response and field.
    #[error("invalid engine request: {0}")]
    InvalidRequest(String),
    /// `forward` asked for the reference weights before `freeze_reference`.
    #[error("no reference model: call freeze_reference before forward with Weights::Reference")]
    NoReference,
    /// The tokenizer could not be loaded or saved.
    #[error(transparent)]
    Tokenizer(#[from] floe_model::tokenizer::TokenizerError),
    /// The run's config is invalid or could not be saved.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Metrics could not be written.
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    /// The report could not be written.
    #[error(transparent)]
    Report(#[from] crate::report::ReportError),
    /// A dataset could not be read or written.
    #[error(transparent)]
    Dataset(#[from] floe_env::dataset::DatasetError),
    /// The synthetic SQL task could not be generated.
    #[error(transparent)]
    SynthSql(#[from] floe_env::synth_sql::SynthSqlError),
    /// An environment could not be built or stepped.
    #[error(transparent)]
    Env(#[from] floe_env::env::EnvError),
    /// The scoring pool failed or a scoring job panicked.
    #[error(transparent)]
    Scoring(#[from] floe_env::scoring::ScoringError),
    /// The chat template could not be compiled or rendered.
    #[error(transparent)]
    Template(#[from] floe_model::chat_template::TemplateError),
    /// An engine verb failed, through whichever engine the loop drives.
    #[error("engine {verb}: {source}")]
    EngineVerb {
        /// The verb (`sample`, `forward`, `forward_backward`, …).
        verb: &'static str,
        /// The engine's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Prompts or examples are missing or malformed; the message names the source.
    #[error("data: {0}")]
    Data(String),
    /// A checkpoint folder is missing or does not hold what it should.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint folder or file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl From<floe_model::transformer::ModelError> for Error {
    fn from(err: floe_model::transformer::ModelError) -> Self {
        Error::Engine(err.into())
    }
}

impl From<floe_model::weights::WeightsError> for Error {
    fn from(err: floe_model::weights::WeightsError) -> Self {
        Error::Engine(err.into())
    }
}

impl From<floe_engine::SampleError> for Error {
    fn from(err: floe_engine::SampleError) -> Self {
        Error::Engine(err.into())
    }
}

impl From<floe_backend::Error> for Error {
    fn from(err: floe_backend::Error) -> Self {
        Error::Engine(err.into())
    }
}

/// Result of trainer operations.
pub type Result<T> = std::result::Result<T, Error>;
