//! The RL training loop: recipes and overrides, the loop itself, metrics and the report.

#![deny(missing_docs)]
