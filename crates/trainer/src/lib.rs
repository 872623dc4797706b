//! The RL training loop: recipes and overrides, the loop itself, metrics and the report.

#![deny(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod embedded;
pub mod engine;
pub mod error;
pub mod eval;
pub mod local;
pub mod metrics;
pub mod native_api;
pub mod remote;
pub mod report;
pub mod rollout;
pub mod run;
pub mod sft;
pub mod tensorboard;

pub use config::Config;
pub use metrics::MetricsSink;
