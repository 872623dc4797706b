//! The KV-cached forward against the packed forward: prefill (chunked, mixed with other
//! sequences) then token-by-token decoding gives the same next-token distributions,
//! including for two sequences that share their prompt's cache blocks.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_backend::Backend;
use floe_model::batch::PackedBatch;
use floe_model::config::{Architecture, ModelConfig};
use floe_model::decode::CachedInput;
use floe_model::transformer::Transformer;

mod support;
use support::{random_weights, Rng};

type B = CpuBackend<f64>;

fn config(architecture: Architecture) -> ModelConfig {
    ModelConfig {
        tie_word_embeddings: architecture != Architecture::Qwen2,
        ..ModelConfig::test_shape(architecture)
    }
}

fn model(config: &ModelConfig, seed: u64) -> Transformer<B> {
    let weights = random_weights(config, seed);
    Transformer::from_host_weights(Arc::new(B::new()), config.clone(), &weights).unwrap()
}

/// One sequence as the sampler tracks it: its tokens, its block table and how many of
/// its positions are already cached.
struct Seq {
    tokens: Vec<u32>,
    table: Vec<u32>,
    cached: usize,
}

const BLOCK: usize = 4;
const MAX_BLOCKS: usize = 4;

/// Builds one cached call running `chunks[i]` more tokens of sequence `i` (0 to skip);
/// returns the input and, per logit row, `(sequence, position)`.
fn step(seqs: &mut [Seq], chunks: &[usize]) -> (CachedInput, Vec<(usize, usize)>) {
    let mut input = CachedInput {
        max_blocks: MAX_BLOCKS,
        block_tables: seqs.iter().flat_map(|s| s.table.clone()).collect(),
        ..Default::default()
    };
    let mut rows = Vec::new();
    for (i, (s, &n)) in seqs.iter_mut().zip(chunks).enumerate() {
        for pos in s.cached..s.cached + n {
            input.tokens.push(s.tokens[pos]);
            input.token_seq.push(i as u32);
            input.token_pos.push(pos as u32);
            input
                .slots
                .push(s.table[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32);
        }
        if n > 0 {
            input.logit_rows.push(input.tokens.len() as u32 - 1);
            rows.push((i, s.cached + n - 1));
        }
        s.cached += n;
    }
    (input, rows)
}

fn log_softmax(z: &[f64]) -> Vec<f64> {
    let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    z.iter().map(|x| x - lse).collect()
}

fn cached_decode_matches_forward(architecture: Architecture) {
    let config = config(architecture);
    let m = model(&config, 7);
    let mut rng = Rng::new(99);
    let prompt = rng.tokens(2 * BLOCK, 32);
    let with_prompt = |rest: Vec<u32>| prompt.iter().copied().chain(rest).collect::<Vec<u32>>();
    // A and B share the prompt's two blocks (3 and 7); C is unrelated.
    let mut seqs = vec![
        Seq {
            tokens: with_prompt(rng.tokens(5, 32)),
            table: vec![3, 7, 10, 2],
            cached: 0,
        },
        Seq {
            tokens: with_prompt(rng.tokens(4, 32)),
            table: vec![3, 7, 12, 5],
            cached: 2 * BLOCK,
        },
        Seq {
            tokens: rng.tokens(11, 32),
            table: vec![0, 9, 14, 15],
            cached: 0,
        },
    ];
    let mut cache = m.new_kv_cache(16, BLOCK).unwrap();
    let mut logits_at: BTreeMap<(usize, usize), Vec<f64>> = BTreeMap::new();
    let backend = m.backend().clone();
    let mut run = |seqs: &mut Vec<Seq>, chunks: &[usize]| {
        let (input, rows) = step(seqs, chunks);
        let logits = backend
            .download_f64(&m.forward_cached(&mut cache, &input).unwrap())
            .unwrap();
        assert_eq!(logits.len(), rows.len() * 32);
        for (row, key) in logits.chunks(32).zip(rows) {
            logits_at.insert(key, row.to_vec());
        }
    };
    // Prefill A's prompt (which B shares) together with a first chunk of C.
    run(&mut seqs, &[2 * BLOCK, 0, 6]);
    // Then decode: one token per live sequence per call, with C finishing its prefill in
    // a second chunk along the way.
    run(&mut seqs, &[1, 1, 3]);
    loop {
        let chunks: Vec<usize> = seqs
            .iter()
            .map(|s| usize::from(s.cached < s.tokens.len()))
            .collect();
        if chunks.iter().all(|&n| n == 0) {
            break;
        }
        run(&mut seqs, &chunks);
    }
    // B's distribution after the shared prompt is A's.
    logits_at.insert((1, 2 * BLOCK - 1), logits_at[&(0, 2 * BLOCK - 1)].clone());

    let mut checked = 0;
    for (i, s) in seqs.iter().enumerate() {
        let stats = m
            .forward(
                &PackedBatch::from_sequences(std::slice::from_ref(&s.tokens)).unwrap(),
                1.0,
            )
            .unwrap();
        for pos in 0..s.tokens.len() - 1 {
            let Some(z) = logits_at.get(&(i, pos)) else {
                continue;
            };
            let lp = log_softmax(z);
            let entropy: f64 = -lp.iter().map(|l| l.exp() * l).sum::<f64>();
            let want = stats.logprobs[pos];
            let got = lp[s.tokens[pos + 1] as usize];
            assert!(
                (got - want).abs() < 1e-9,
                "seq {i} pos {pos}: cached {got} vs forward {want}"
            );
            assert!(
                (entropy - stats.entropy[pos]).abs() < 1e-9,
                "seq {i} pos {pos}: entropy"
            );
            checked += 1;
        }
    }
    // A: positions 7..=11, B: 7..=10, C: 5, 8 and 9 (the last position scores nothing).
    assert_eq!(checked, 12);
}

#[test]
fn qwen3_cached_decode_matches_forward() {
    cached_decode_matches_forward(Architecture::Qwen3);
}

#[test]
fn qwen2_cached_decode_matches_forward() {
    cached_decode_matches_forward(Architecture::Qwen2);
}

#[test]
fn inconsistent_cached_inputs_are_errors() {
    let config = config(Architecture::Llama);
    let m = model(&config, 1);
    let mut cache = m.new_kv_cache(4, BLOCK).unwrap();
    assert_eq!(
        m.kv_cache_bytes_per_block(BLOCK),
        2 * 2 * BLOCK * 16 * std::mem::size_of::<f64>()
    );
    let good = CachedInput {
        tokens: vec![1, 2],
        token_seq: vec![0, 0],
        token_pos: vec![0, 1],
        slots: vec![8, 9],
        block_tables: vec![2, 3],
        max_blocks: 2,
        logit_rows: vec![1],
    };
    m.forward_cached(&mut cache, &good).unwrap();
    let bad_slot = CachedInput {
        slots: vec![8, 10],
        ..good.clone()
    };
    let err = m.forward_cached(&mut cache, &bad_slot).err().unwrap();
    assert!(err.to_string().contains("slots[1] = 10"), "{err}");
    let bad_block = CachedInput {
        block_tables: vec![2, 4],
        ..good.clone()
    };
    let err = m.forward_cached(&mut cache, &bad_block).err().unwrap();
    assert!(err.to_string().contains("block_tables[1] = 4"), "{err}");
    let bad_row = CachedInput {
        logit_rows: vec![2],
        ..good
    };
    assert!(m.forward_cached(&mut cache, &bad_row).is_err());
}
