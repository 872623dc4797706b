//! The trainer's error: each variant says which part of a run failed (the engine, the
//! config, the data, the environments, the outputs, a file).

use std::path::PathBuf;

use floe_engine::remote::RemoteError;

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The local engine (device, model, weights, sampler, a request, saved state) failed.
    #[error(transparent)]
    Engine(#[from] floe_engine::Error),
    /// The algorithm configuration cannot be used.
    #[error(transparent)]
    Algorithm(#[from] floe_rl::RlError),
    /// The tokenizer could not be loaded or saved.
    #[error(transparent)]
    Tokenizer(#[from] floe_model::tokenizer::TokenizerError),
    /// The run's config is invalid or could not be saved.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Metrics could not be written.
    #[error(transparent)]
    Metrics(#[from] crate::outputs::metrics::MetricsError),
    /// The report could not be written.
    #[error(transparent)]
    Report(#[from] crate::outputs::report::ReportError),
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
    /// The ranks of a data-parallel run cannot run together or exchange; the message
    /// says why.
    #[error("data parallel: {0}")]
    DataParallel(String),
    /// The model `model.path` names is missing, unknown or unreadable; the message names
    /// it.
    #[error("model: {0}")]
    Model(String),
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

impl Error {
    /// Wraps an engine error with the verb that failed.
    pub fn verb<X: std::error::Error + Send + Sync + 'static>(
        verb: &'static str,
    ) -> impl FnOnce(X) -> Error {
        move |err| Error::EngineVerb {
            verb,
            source: Box::new(err),
        }
    }
}

impl Error {
    /// Whether a remote engine's server lost the engine: it no longer holds it
    /// ([`RemoteError::EngineLost`]) or it went away while a verb ran (the request cut
    /// off). Rewinding to the last checkpoint loads the engine's state anew and recovers.
    pub fn lost_remote_engine(&self) -> bool {
        let Error::EngineVerb { source, .. } = self else {
            return false;
        };
        matches!(
            source.downcast_ref::<RemoteError>(),
            Some(RemoteError::EngineLost { .. } | RemoteError::Transport { .. })
        )
    }
}

/// Result of trainer operations.
pub type Result<T> = std::result::Result<T, Error>;
