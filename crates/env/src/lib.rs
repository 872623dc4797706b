//! Environments that score a model's completions, the SQL sandbox they share, datasets and
//! synthetic task generators.

#![deny(missing_docs)]

pub mod bird;
pub mod dataset;
pub mod env;
pub mod gsm8k;
pub mod multiturn_sql;
pub mod sandbox;
pub mod scoring;
pub mod synth_math;
pub mod synth_sql;
pub mod text2sql;
