//! The engine: owns a device and weights; packed train steps and the sampler.

#![deny(missing_docs)]
