//! The Qwen3 model family (Qwen2 and Llama by configuration): weights in and out of
//! Hugging Face safetensors, forward and hand-written backward layer by layer, KV-cached
//! decoding, tokenizer and chat template.

#![deny(missing_docs)]

pub mod batch;
pub mod chat_template;
pub mod config;
pub mod decode;
pub mod embedded;
pub mod lora;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use config::{Architecture, ModelConfig};
