//! Test data shared by the model's integration tests.

use std::collections::BTreeMap;

use floe_model::config::ModelConfig;
use floe_model::weights::{tensor_specs, HostTensor};
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::SplitMix64;

/// Deterministic test data: splitmix64 seeded with `seed`.
pub struct Rng(SplitMix64);

#[allow(dead_code)] // each test binary uses a different subset
impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::seed_from_u64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` token ids below `vocab`.
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}

/// The small Qwen3 shape of the CUDA model tests: head_dim 32 (a size the CUDA kernels
/// take), two query heads per kv head, tied embeddings.
#[allow(dead_code)] // each test binary uses a different subset
pub fn cuda_test_config() -> floe_model::config::ModelConfig {
    use floe_model::config::{Architecture, ModelConfig};
    ModelConfig {
        architecture: Architecture::Qwen3,
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 256,
        tie_word_embeddings: true,
        attention_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// Tensors of `specs` drawn from `rng`: large enough that attention and softmax are far
/// from uniform, norms near (not at) 1 so their gradients are exercised too.
#[allow(dead_code)] // each test binary uses a different subset
pub fn random_tensors(
    specs: Vec<(String, Vec<usize>)>,
    rng: &mut Rng,
) -> BTreeMap<String, HostTensor> {
    specs
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = (0..n)
                .map(|_| {
                    let u = rng.uniform();
                    (if name.ends_with("norm.weight") {
                        1.0 + 0.3 * u
                    } else if name.ends_with(".bias") {
                        0.2 * u
                    } else {
                        0.4 * u
                    }) as f32
                })
                .collect();
            (name, HostTensor { shape, data })
        })
        .collect()
}

/// [`random_tensors`] for every weight of `config`, from `seed`.
#[allow(dead_code)] // each test binary uses a different subset
pub fn random_weights(config: &ModelConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    random_tensors(tensor_specs(config), &mut Rng::new(seed))
}
