//! The RL training loop: recipes and overrides, the loop itself, metrics and the report.

#![deny(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod eval;
pub mod eval_checkpoint;
pub mod outputs;
pub mod ranks;
pub mod remote;
pub mod rollout;
pub mod run;
pub mod setup;
pub mod sft;

pub use config::Config;
pub use outputs::metrics::MetricsSink;
