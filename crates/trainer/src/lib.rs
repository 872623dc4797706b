//! The RL training loop: recipes and overrides, the loop itself, metrics and the report.

#![deny(missing_docs)]

pub mod config;
pub mod engine;
pub mod error;
pub mod local;
pub mod metrics;
pub mod report;
pub mod tensorboard;

pub use config::Config;
pub use metrics::MetricsSink;
