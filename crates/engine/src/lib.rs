//! The engine: owns a device and the weights on it, and serves the verbs that train and
//! sample them.
//!
//! # The verbs
//!
//! - [`verbs`]: the [`Engine`] trait (sample, forward, forward_backward, optim_step,
//!   save/load, export) and every type on its boundary. Callers (the RL loop in
//!   `floe-trainer`, the HTTP server in `floe-server`) hold an engine and nothing below it.
//! - [`local`]: [`LocalEngine`], the verbs in this process over one backend, and
//!   [`AnyLocalEngine`], which opens the [`Device`] a caller names (CPU or CUDA).
//! - [`native_api`]: the JSON wire types of floe's native HTTP API, one route per verb;
//!   `remote` (feature `remote`): `RemoteEngine`, the verbs sent over that API to
//!   `floe serve`.
//! - [`policy`]: the weights under training and their AdamW state, on the device or in
//!   host memory.
//! - [`memory_plan`]: what the device and host will hold, checked before anything is
//!   allocated.
//!
//! # Batching and sampling machinery
//!
//! - [`kv_blocks`]: the paged KV cache's [`BlockManager`]: a fixed pool of blocks with
//!   reference counts, per-sequence [`BlockTable`]s and the slot mapping; a request's
//!   samples share their prompt's full blocks.
//! - [`sampler`]: continuous batching. [`Sampler::submit`] queues [`SampleRequest`]s;
//!   [`Sampler::step`] runs one model call mixing decodes and chunked prefills under a
//!   token budget and hands each finished [`Generation`] to a callback;
//!   [`Sampler::run`] steps until idle; [`Sampler::generate`] is the blocking form that
//!   returns samples in request order. Models plug in through [`CachedModel`].
//! - [`stop`]: stop token ids and stop strings ([`StopReason`]).
//! - [`packing`]: rollouts to training micro-batches under a token budget, with the
//!   prompt shared once per group ([`pack_rollouts`]), and the map from packed rows back
//!   to (sample, token).
//!
//! Sampling a group and packing it for training:
//!
//! ```
//! use std::sync::Arc;
//!
//! use floe_backend::cpu::CpuBackend;
//! use floe_engine::{
//!     pack_rollouts, PackingConfig, PackingMode, Response, RolloutGroup, SampleRequest,
//!     Sampler, SamplerConfig, SamplingParams,
//! };
//! use floe_model::{transformer::Transformer, ModelConfig};
//!
//! let mut config = ModelConfig::preset("small")?;
//! config.vocab_size = 512;
//! let model = Transformer::new_random(Arc::new(CpuBackend::<f32>::new()), config, 0)?;
//! let mut sampler = Sampler::new(&model, SamplerConfig { num_blocks: 16, ..Default::default() })?;
//! let request = SampleRequest {
//!     id: 0,
//!     prompt: vec![1, 2, 3],
//!     n: 4,
//!     params: SamplingParams { max_new_tokens: 8, seed: Some(7), ..Default::default() },
//! };
//! let generations = sampler.generate(&model, vec![request.clone()])?;
//!
//! // One group: the prompt once, shared by its four responses.
//! let group = RolloutGroup {
//!     prompt: request.prompt,
//!     responses: generations
//!         .iter()
//!         .map(|g| Response {
//!             tokens: g.tokens.clone(),
//!             targets: None,
//!             weights: vec![1.0; g.tokens.len()],
//!         })
//!         .collect(),
//! };
//! let packing = PackingConfig { max_tokens_per_microbatch: 4096, mode: PackingMode::Shared };
//! let micro = &pack_rollouts(&[group], packing)?[0];
//! let stats = model.forward(&micro.batch, 1.0)?;
//! // The trainer's log-prob of every sampled token is the sampler's.
//! micro.for_each_scored_row(|row, token| {
//!     let sampled = generations[token.response as usize].logprobs[token.token as usize];
//!     assert!((stats.logprobs[row] - f64::from(sampled)).abs() < 1e-3);
//! });
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod admission;
mod data_parallel;
mod device;
mod error;
pub mod kv_blocks;
pub mod local;
pub mod memory_plan;
pub mod native_api;
pub mod packing;
pub mod policy;
#[cfg(feature = "remote")]
pub mod remote;
pub mod sampler;
mod sharded;
pub mod speculative;
pub mod stop;
pub mod verbs;

pub use data_parallel::RankExchange;
pub use device::Device;
pub use error::{Error, Result};
pub use kv_blocks::{BlockManager, BlockTable, OutOfBlocks};
pub use local::{
    saved_model_dir, saved_weights_source, AdapterSource, AnyLocalEngine, DataParallelGroup,
    LocalEngine, LocalEngineOptions, ModelSource, SharedBase,
};
pub use memory_plan::{Knob, KnobNames, MemoryPlan, PlanError, PlanInputs, Recompute};
pub use packing::{
    pack_rollouts, MicroBatch, PackingConfig, PackingError, PackingMode, Response, ResponseRows,
    RolloutGroup, TokenRef,
};
pub use sampler::{
    sample_seed, CachedInput, CachedModel, Detokenizer, Generation, RequestIntake, SampleError,
    SampleEvent, SampleFeed, SampleFlow, SampleProgress, SampleRequest, Sampler, SamplerConfig,
    SamplerStats, SamplingParams,
};
pub use speculative::NgramSpec;
pub use stop::{Stop, StopConditions, StopReason};
pub use verbs::{
    one_after_the_other, Engine, EngineInfo, ForwardBackwardOutput, Loss, SamplingSide,
    SequenceGroup, TokenOutputs, TrainGroup, TrainResponse, TrainingSide, Weights,
};
