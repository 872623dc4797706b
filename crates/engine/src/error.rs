//! The engine's error: what failed underneath (device, model, weights, sampler) or which
//! file of a saved state is missing or damaged.

use std::path::PathBuf;

/// Why an engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A backend op rejected its arguments or the device failed.
    #[error(transparent)]
    Backend(#[from] floe_backend::Error),
    /// The model rejected its input or failed.
    #[error(transparent)]
    Model(#[from] floe_model::transformer::ModelError),
    /// Weights could not be read or written.
    #[error(transparent)]
    Weights(#[from] floe_model::weights::WeightsError),
    /// Sampling failed.
    #[error(transparent)]
    Sample(#[from] crate::sampler::SampleError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A saved file exists but does not hold what it should.
    #[error("{path}: {msg}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
}

/// Result of engine operations.
pub type Result<T> = std::result::Result<T, Error>;
