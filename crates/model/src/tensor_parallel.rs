//! Tensor parallelism (Megatron's layout) for models whose weights do not fit one card:
//! each of N ranks holds 1/N of every layer's attention heads and MLP columns, and the
//! whole embedding, norms and lm-head.
//!
//! A rank's model is the same [`Transformer`] over a narrower shape ([`narrowed`]: 1/N of
//! the query and key/value heads and of the MLP's intermediate size) and the matching
//! slices of the weights ([`shard_weights`]): q/k/v and gate/up split by output rows
//! (column parallel), o_proj and down_proj by input columns (row parallel). A layer's
//! two row-parallel products are partial sums; after each, the ranks sum them
//! ([`Collective::all_reduce_sum`]), rank 0 adding the residual stream once. Every rank
//! then holds the same hidden states and logits, so ranks that sample with the same seeds
//! draw the same tokens and schedule the same steps without exchanging anything else.
//!
//! The key/value cache of a rank holds its own key/value heads: 1/N of the cache, the
//! point of the layout for long contexts.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use floe_backend::{Backend, Collective};

use crate::config::ModelConfig;
use crate::transformer::{BaseStorage, ModelError, Params, Result, Transformer, INIT_STD};
use crate::weights::{check_weights, tensor_specs, visit_model_dir, HostTensor, WeightsError};

/// How a tensor of the full model is cut over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// Every rank holds all of it.
    Whole,
    /// Rank r holds rows `r·rows/N ..` (dimension 0; a bias's elements).
    Rows,
    /// Rank r holds columns `r·cols/N ..` of every row (dimension 1).
    Columns,
}

/// The cut of the tensor `name` (a [`tensor_specs`] name).
fn cut_of(name: &str) -> Cut {
    const ROWS: [&str; 8] = [
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.weight",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    ];
    const COLUMNS: [&str; 2] = ["self_attn.o_proj.weight", "mlp.down_proj.weight"];
    if ROWS.iter().any(|suffix| name.ends_with(suffix)) {
        Cut::Rows
    } else if COLUMNS.iter().any(|suffix| name.ends_with(suffix)) {
        Cut::Columns
    } else {
        Cut::Whole
    }
}

/// The shape one of `ranks` ranks holds of `config`: 1/N of its query heads, key/value
/// heads and intermediate size. Fails, naming the count, when one does not divide.
pub fn narrowed(config: &ModelConfig, ranks: usize) -> Result<ModelConfig> {
    if ranks == 0 {
        return Err(ModelError::Input("tensor parallelism over 0 ranks".into()));
    }
    let split = |what: &str, n: usize| {
        if n % ranks == 0 {
            Ok(n / ranks)
        } else {
            Err(ModelError::Input(format!(
                "tensor parallelism over {ranks} ranks: the model's {what} ({n}) do not \
                 split evenly; use a number of ranks that divides it"
            )))
        }
    };
    Ok(ModelConfig {
        num_attention_heads: split("query heads", config.num_attention_heads)?,
        num_key_value_heads: split("key/value heads", config.num_key_value_heads)?,
        intermediate_size: split("MLP intermediate features", config.intermediate_size)?,
        ..config.clone()
    })
}

/// Rank `rank`'s slices of the full model's `weights` (named and shaped as
/// [`tensor_specs`] of `config`), named and shaped for [`narrowed`]`(config, ranks)`.
pub fn shard_weights(
    config: &ModelConfig,
    weights: &BTreeMap<String, HostTensor>,
    rank: usize,
    ranks: usize,
) -> Result<BTreeMap<String, HostTensor>> {
    check_rank(config, rank, ranks)?;
    check_weights(config, weights)?;
    Ok(tensor_specs(config)
        .into_iter()
        .map(|(name, _)| {
            let slice = slice(&name, &weights[&name], rank, ranks);
            (name, slice)
        })
        .collect())
}

fn check_rank(config: &ModelConfig, rank: usize, ranks: usize) -> Result<()> {
    narrowed(config, ranks)?;
    if rank >= ranks {
        return Err(ModelError::Input(format!(
            "tensor parallelism: rank {rank} of {ranks}"
        )));
    }
    Ok(())
}

/// Rank `rank`'s slice of the full tensor `name` (of its [`tensor_specs`] shape, whose
/// cut dimension `ranks` divides: [`narrowed`] checked).
fn slice(name: &str, full: &HostTensor, rank: usize, ranks: usize) -> HostTensor {
    match (cut_of(name), full.shape.as_slice()) {
        (Cut::Rows, [rows, rest @ ..]) => {
            let row_len: usize = rest.iter().product();
            let take = rows / ranks;
            HostTensor {
                shape: [&[take], rest].concat(),
                data: full.data[rank * take * row_len..][..take * row_len].to_vec(),
            }
        }
        (Cut::Columns, &[rows, cols]) => {
            let take = cols / ranks;
            HostTensor {
                shape: vec![rows, take],
                data: full
                    .data
                    .chunks_exact(cols)
                    .flat_map(|row| &row[rank * take..][..take])
                    .copied()
                    .collect(),
            }
        }
        _ => full.clone(),
    }
}

/// Rank `collective.rank()`'s part of the model `config` with the full `weights`, over
/// `collective`'s ranks (module docs). It runs forwards and KV-cached steps (sampling,
/// scoring); training it is not supported.
pub fn model<B: Backend>(
    backend: Arc<B>,
    config: &ModelConfig,
    weights: &BTreeMap<String, HostTensor>,
    collective: Arc<dyn Collective<B>>,
) -> Result<Transformer<B>> {
    let (rank, ranks) = (collective.rank(), collective.world_size());
    let shard = shard_weights(config, weights, rank, ranks)?;
    frozen(backend, narrowed(config, ranks)?, &shard, collective)
}

/// The narrowed model over `shard`, its weights in compute precision only (it never
/// trains: bf16 on a GPU, half the bytes of masters).
fn frozen<B: Backend>(
    backend: Arc<B>,
    narrow: ModelConfig,
    shard: &BTreeMap<String, HostTensor>,
    collective: Arc<dyn Collective<B>>,
) -> Result<Transformer<B>> {
    let mut model =
        Transformer::from_host_weights_stored(backend, narrow, shard, BaseStorage::ComputeOnly)?;
    model.tensor_parallel = Some(collective);
    Ok(model)
}

/// Rank `collective.rank()`'s part of [`Transformer::new_random`]`(config, seed)`: the
/// same values, each slice drawn on the device from its place in the random stream, so a
/// benchmark of a model too large for one card needs no host copy of it and the ranks
/// together compute what one model with those weights would.
pub fn new_random<B: Backend>(
    backend: Arc<B>,
    config: &ModelConfig,
    seed: u64,
    collective: Arc<dyn Collective<B>>,
) -> Result<Transformer<B>> {
    let (rank, ranks) = (collective.rank(), collective.world_size());
    check_rank(config, rank, ranks)?;
    let narrow = narrowed(config, ranks)?;
    let kind = BaseStorage::ComputeOnly.kind();
    let b = &*backend;
    // Where each tensor of the full model starts in the stream (norms and biases draw
    // nothing, as in `new_random`).
    let mut drawn = 0;
    let mut starts = BTreeMap::new();
    for (name, shape) in tensor_specs(config) {
        starts.insert(name.clone(), (drawn, shape.clone()));
        if !name.ends_with("norm.weight") && !name.ends_with(".bias") {
            drawn += shape.iter().product::<usize>() as u64;
        }
    }
    let params = Params::build(&narrow, |name, shape| {
        let n: usize = shape.iter().product();
        if name.ends_with("norm.weight") {
            return Ok(b.upload(&vec![1.0; n], kind)?);
        }
        let mut buf = b.zeros(n, kind)?;
        if name.ends_with(".bias") {
            return Ok(buf);
        }
        let (first, full) = &starts[name];
        match (cut_of(name), full.as_slice()) {
            (Cut::Columns, &[rows, cols]) => {
                // Each row's slice is its own stretch of the stream.
                let take = cols / ranks;
                let mut row = b.zeros(take, kind)?;
                for r in 0..rows {
                    let at = first + (r * cols + rank * take) as u64;
                    b.fill_normal(&mut row, seed, at, INIT_STD)?;
                    b.copy_range(&mut buf, r * take, &row, 0, take)?;
                }
            }
            (Cut::Rows, _) => b.fill_normal(&mut buf, seed, first + (rank * n) as u64, INIT_STD)?,
            _ => b.fill_normal(&mut buf, seed, *first, INIT_STD)?,
        }
        Ok(buf)
    })?;
    let mut model = Transformer::with_params(
        Arc::clone(&backend),
        narrow,
        params,
        BaseStorage::ComputeOnly,
    )?;
    model.tensor_parallel = Some(collective);
    Ok(model)
}

/// [`model`] from a Hugging Face folder, read one tensor at a time and cut as it comes:
/// a rank's host memory holds its slices and one whole tensor, not the model (Qwen3-32B
/// is 131 GB in f32).
pub fn load_dir<B: Backend>(
    backend: Arc<B>,
    dir: impl AsRef<Path>,
    collective: Arc<dyn Collective<B>>,
) -> Result<Transformer<B>> {
    let (rank, ranks) = (collective.rank(), collective.world_size());
    let config =
        ModelConfig::from_hf_file(dir.as_ref().join("config.json")).map_err(WeightsError::from)?;
    check_rank(&config, rank, ranks)?;
    let mut shard = BTreeMap::new();
    visit_model_dir(dir, true, &mut |name, tensor| -> Result<()> {
        let slice = slice(&name, &tensor, rank, ranks);
        shard.insert(name, slice);
        Ok(())
    })?;
    frozen(backend, narrowed(&config, ranks)?, &shard, collective)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;

    #[test]
    fn slices_put_back_together_give_the_full_tensors() {
        let config = ModelConfig {
            attention_bias: true,
            ..ModelConfig::test_shape(Architecture::Qwen2)
        };
        let weights: BTreeMap<String, HostTensor> = tensor_specs(&config)
            .into_iter()
            .enumerate()
            .map(|(t, (name, shape))| {
                let n: usize = shape.iter().product();
                let data = (0..n).map(|i| (t * 10_000 + i) as f32).collect();
                (name, HostTensor { shape, data })
            })
            .collect();
        let ranks = 2;
        let shards: Vec<_> = (0..ranks)
            .map(|r| shard_weights(&config, &weights, r, ranks).unwrap())
            .collect();
        let narrow = narrowed(&config, ranks).unwrap();
        for (name, shape) in tensor_specs(&narrow) {
            let full = &weights[&name];
            let parts: Vec<&HostTensor> = shards.iter().map(|s| &s[&name]).collect();
            assert!(parts.iter().all(|p| p.shape == shape), "{name}");
            let joined: Vec<f32> = match cut_of(&name) {
                Cut::Whole => {
                    assert!(parts.iter().all(|p| p.data == full.data), "{name}");
                    continue;
                }
                Cut::Rows => parts.iter().flat_map(|p| p.data.clone()).collect(),
                Cut::Columns => {
                    let cols = shape[1];
                    (0..shape[0])
                        .flat_map(|row| {
                            parts
                                .iter()
                                .flat_map(move |p| p.data[row * cols..][..cols].to_vec())
                        })
                        .collect()
                }
            };
            assert_eq!(joined, full.data, "{name}");
        }
        // Every bias and projection is cut, the norms and embeddings are not.
        let cut = |name: &str| cut_of(&format!("model.layers.0.{name}"));
        assert_eq!(cut("self_attn.k_proj.bias"), Cut::Rows);
        assert_eq!(cut("mlp.down_proj.weight"), Cut::Columns);
        assert_eq!(cut("self_attn.q_norm.weight"), Cut::Whole);
        assert_eq!(cut_of("lm_head.weight"), Cut::Whole);
    }

    #[test]
    fn a_count_that_does_not_divide_is_named() {
        let config = ModelConfig::test_shape(Architecture::Qwen3);
        let err = narrowed(&config, 4).unwrap_err().to_string();
        assert!(err.contains("key/value heads (2)"), "{err}");
        assert_eq!(narrowed(&config, 2).unwrap().num_key_value_heads, 1);
    }
}
