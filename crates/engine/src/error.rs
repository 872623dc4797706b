//! The engine's error: what failed underneath (device, model, weights, sampler), which
//! request the engine refused, or which file of a saved state is missing or damaged.

use std::path::PathBuf;

/// Why an engine operation failed.
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
    /// Training ran out of device memory; the message says which settings free some.
    #[error(
        "{source}; training micro-batches hold up to {tokens} tokens (recomputing \
         {recomputed_layers} of {num_layers} layers) beside a sampler KV cache of \
         {kv_cache_gib:.1} GiB: lower \
         trainer.micro_train_batch_size_per_gpu or set trainer.max_tokens_per_microbatch, set \
         engine.recompute = true, or lower engine.memory_fraction"
    )]
    TrainingOutOfMemory {
        /// The device's refusal.
        source: Box<Error>,
        /// The micro-batch token budget.
        tokens: usize,
        /// Layers whose activations the backward recomputed.
        recomputed_layers: usize,
        /// The model's layers.
        num_layers: usize,
        /// The KV cache's size.
        kv_cache_gib: f64,
    },
    /// The run's memory plan does not fit the device; the message names the knobs.
    #[error(transparent)]
    Plan(#[from] crate::memory_plan::PlanError),
    /// A model's `config.json` could not be read.
    #[error(transparent)]
    Config(#[from] floe_model::config::ConfigError),
    /// A batch could not be packed into micro-batches.
    #[error("packing: {0}")]
    Packing(#[from] crate::packing::PackingError),
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
    /// The ranks of a data-parallel job could not meet (`floe_dist::rendezvous`).
    #[error("joining the data-parallel group: {0}")]
    Rendezvous(#[from] floe_dist::RendezvousError),
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
    /// Whether the request, not the engine, was at fault (an HTTP 400 rather than a 500).
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            Error::InvalidRequest(_)
                | Error::NoReference
                | Error::Algorithm(_)
                | Error::Packing(_)
                | Error::Sample(crate::sampler::SampleError::InvalidRequest { .. })
        )
    }

    /// Whether the device ran out of memory, in the backend or under the model.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::TrainingOutOfMemory { .. } => true,
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
