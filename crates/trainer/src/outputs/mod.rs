//! What a run writes for people to read beside its checkpoints: per-step metrics in
//! `metrics.jsonl` (the source of truth), the same scalars as TensorBoard events, and the
//! HTML report rebuilt from them.

pub mod metrics;
pub mod report;
pub mod tensorboard;
