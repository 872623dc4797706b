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

impl Error {
    /// Whether the device ran out of memory, in the backend or under the model.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Backend(e) | Error::Model(floe_model::transformer::ModelError::Backend(e)) => {
                e.is_out_of_memory()
            }
            _ => false,
        }
    }
}

/// Result of engine operations.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_seen_under_the_model() {
        let oom = || floe_backend::Error::OutOfMemory {
            what: "a buffer".into(),
            requested: 2,
            free: 1,
        };
        assert!(Error::Backend(oom()).is_out_of_memory());
        assert!(
            Error::Model(floe_model::transformer::ModelError::Backend(oom())).is_out_of_memory()
        );
        assert!(
            !Error::Backend(floe_backend::Error::Cuda("launch failed".into())).is_out_of_memory()
        );
    }
}
