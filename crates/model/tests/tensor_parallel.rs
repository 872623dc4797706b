//! Tensor parallelism on the CPU: ranks as threads over the in-process collective, each
//! with its slice of the weights, give the full model's log-probs and KV-cached logits
//! (up to the order of the partial sums), the same bits on every rank.

use std::sync::Arc;
use std::time::Duration;

use floe_backend::cpu::CpuBackend;
use floe_backend::{Backend, Collective, InProcessCollective};
use floe_model::batch::PackedBatch;
use floe_model::config::{Architecture, ModelConfig};
use floe_model::decode::CachedInput;
use floe_model::tensor_parallel;
use floe_model::transformer::Transformer;
use floe_model::weights::{save_model_dir, SaveDType};

mod support;
use support::{random_weights, Rng};

type B = CpuBackend<f64>;

const BLOCK: usize = 4;

/// What a model computes for the test's inputs: the packed forward's log-probs and
/// entropies of two sequences, then the logits of a prefill and four decode steps of
/// one sequence through a KV cache.
fn outputs(m: &Transformer<B>, tokens: &[Vec<u32>]) -> Vec<Vec<f64>> {
    let stats = m
        .forward(&PackedBatch::from_sequences(tokens).unwrap(), 1.0)
        .unwrap();
    let mut out = vec![stats.logprobs, stats.entropy];
    let mut cache = m.new_kv_cache(8, BLOCK).unwrap();
    let seq = &tokens[0];
    let table = vec![5u32, 2, 7];
    let mut cached = 0;
    for n in [5, 1, 1, 1, 1] {
        let positions = cached..cached + n;
        let input = CachedInput {
            tokens: seq[positions.clone()].to_vec(),
            token_seq: vec![0; n],
            token_pos: positions.clone().map(|p| p as u32).collect(),
            slots: positions
                .map(|p| table[p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32)
                .collect(),
            block_tables: table.clone(),
            max_blocks: table.len(),
            logit_rows: vec![n as u32 - 1],
        };
        let logits = m.forward_cached(&mut cache, &input).unwrap();
        out.push(m.backend().download_f64(&logits).unwrap());
        cached += n;
    }
    out
}

fn tensor_parallel_matches_one_model(architecture: Architecture, ranks: usize) {
    let config = ModelConfig {
        attention_bias: architecture == Architecture::Qwen2,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        intermediate_size: 32,
        ..ModelConfig::test_shape(architecture)
    };
    let weights = random_weights(&config, 3);
    let mut rng = Rng::new(11);
    let tokens = vec![rng.tokens(9, 32), rng.tokens(6, 32)];
    let one = Transformer::from_host_weights(Arc::new(B::new()), config.clone(), &weights).unwrap();
    let want = outputs(&one, &tokens);
    let cache_bytes = one.kv_cache_bytes_per_block(BLOCK);

    // The ranks cut the weights in memory, or read their slices from a folder.
    let folder = tempfile::tempdir().unwrap();
    save_model_dir(folder.path(), &config, &weights, SaveDType::F32).unwrap();
    let got = on_ranks(ranks, cache_bytes, &tokens, |backend, collective| {
        tensor_parallel::model(backend, &config, &weights, collective)
    });
    let read = on_ranks(ranks, cache_bytes, &tokens, |backend, collective| {
        tensor_parallel::load_dir(backend, folder.path(), collective)
    });
    assert_eq!(read, got, "read from the folder");
    close(&got, &want, ranks);

    // Random weights drawn slice by slice are the one model's random weights.
    let one = Transformer::new_random(Arc::new(B::new()), config.clone(), 17).unwrap();
    let random = on_ranks(ranks, cache_bytes, &tokens, |backend, collective| {
        tensor_parallel::new_random(backend, &config, 17, collective)
    });
    close(&random, &outputs(&one, &tokens), ranks);
}

/// Each rank's outputs (as a thread of an in-process group, its model from `make`) after
/// checking that every rank computed the same bits and cached 1/N of the keys and values.
fn on_ranks(
    ranks: usize,
    one_model_cache_bytes: usize,
    tokens: &[Vec<u32>],
    make: impl Fn(Arc<B>, Arc<dyn Collective<B>>) -> floe_model::transformer::Result<Transformer<B>>
        + Sync,
) -> Vec<Vec<f64>> {
    let group = InProcessCollective::<f64>::group(ranks, Duration::from_secs(60));
    let got: Vec<(Vec<Vec<f64>>, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|collective| {
                let make = &make;
                s.spawn(move || {
                    let m = make(Arc::new(B::new()), Arc::new(collective)).unwrap();
                    (outputs(&m, tokens), m.kv_cache_bytes_per_block(BLOCK))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (outputs, cache_bytes)) in got.iter().enumerate() {
        assert_eq!(*cache_bytes * ranks, one_model_cache_bytes, "rank {rank}");
        assert_eq!(outputs, &got[0].0, "rank {rank} differs from rank 0");
    }
    got.into_iter().next().unwrap().0
}

/// Whether the ranks' outputs are the one model's, up to the order of the sums.
fn close(got: &[Vec<f64>], want: &[Vec<f64>], ranks: usize) {
    for (i, (got, want)) in got.iter().zip(want).enumerate() {
        assert_eq!(got.len(), want.len(), "output {i}");
        for (j, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() < 1e-10,
                "output {i} [{j}]: {ranks} ranks {g}, one model {w}"
            );
        }
    }
}

#[test]
fn qwen3_on_two_and_four_ranks_matches_one_model() {
    tensor_parallel_matches_one_model(Architecture::Qwen3, 2);
    tensor_parallel_matches_one_model(Architecture::Qwen3, 4);
}

#[test]
fn qwen2_with_biases_on_two_ranks_matches_one_model() {
    tensor_parallel_matches_one_model(Architecture::Qwen2, 2);
}

#[test]
fn a_tensor_parallel_model_refuses_to_train() {
    let config = ModelConfig::test_shape(Architecture::Qwen3);
    let weights = random_weights(&config, 5);
    let collective = InProcessCollective::<f64>::group(1, Duration::from_secs(5))
        .pop()
        .unwrap();
    let mut m = tensor_parallel::model(Arc::new(B::new()), &config, &weights, Arc::new(collective))
        .unwrap();
    let batch = PackedBatch::from_sequences(&[vec![1, 2, 3]]).unwrap();
    let err = m
        .forward_backward(&batch, 1.0, &mut |stats| {
            Ok((
                vec![0.0; stats.logprobs.len()],
                vec![0.0; stats.logprobs.len()],
            ))
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not train"), "{err}");
}
