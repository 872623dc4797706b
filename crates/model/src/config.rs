//! Model hyper-parameters, read from Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

/// The decoder families floe runs; they differ only in a few switches of [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// `Qwen3ForCausalLM`: RMSNorm on each query and key head, no qkv bias.
    Qwen3,
    /// `Qwen2ForCausalLM`: bias on the q, k and v projections.
    Qwen2,
    /// `LlamaForCausalLM`: neither.
    Llama,
}

/// RoPE frequency scaling of the `llama3` kind (`rope_scaling` in `config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// `factor`.
    pub factor: f32,
    /// `low_freq_factor`.
    pub low_freq_factor: f32,
    /// `high_freq_factor`.
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
}

/// Everything the model needs to know about its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Which family.
    pub architecture: Architecture,
    /// Rows of the embedding table.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Size of each head (Qwen3 sets it explicitly; otherwise hidden / heads).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Optional llama3-style RoPE scaling.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest sequence the model was trained for.
    pub max_position_embeddings: usize,
    /// The lm-head shares the embedding table.
    pub tie_word_embeddings: bool,
    /// Bias on q, k, v projections (Qwen2).
    pub attention_bias: bool,
    /// RMSNorm on each q and k head (Qwen3).
    pub qk_norm: bool,
    /// `bos_token_id`, where given.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (one or several).
    pub eos_token_ids: Vec<u32>,
}
