//! The engine: owns a device and weights; packed train steps and the sampler.
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

#![deny(missing_docs)]

pub mod kv_blocks;
pub mod packing;
pub mod sampler;
pub mod stop;

pub use kv_blocks::{BlockManager, BlockTable, OutOfBlocks};
pub use packing::{
    pack_rollouts, MicroBatch, PackingConfig, PackingError, PackingMode, Response, ResponseRows,
    RolloutGroup, TokenRef,
};
pub use sampler::{
    sample_seed, CachedInput, CachedModel, Detokenizer, Generation, SampleError, SampleRequest,
    Sampler, SamplerConfig, SamplerStats, SamplingParams,
};
pub use stop::{Stop, StopConditions, StopReason};
