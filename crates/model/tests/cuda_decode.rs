//! Graphed decode steps on the CUDA backend against the same steps launched eagerly:
//! identical logits where the batch needs no padding, bf16-close where it does, and the
//! graphs captured once and then replayed. Skipped, with a note, without
//! `--features floe-backend/cuda` or a GPU.

use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_backend::cuda::CudaBackend;
use floe_backend::Backend;
use floe_model::config::ModelConfig;
use floe_model::decode::CachedInput;
use floe_model::lora::LoraConfig;
use floe_model::transformer::Transformer;

mod support;

/// Long enough for the shared prompt and the decoded tokens.
fn config() -> ModelConfig {
    ModelConfig {
        max_position_embeddings: 1024,
        ..support::cuda_test_config()
    }
}

const BLOCK: usize = 16;
/// Shared prompt: 18 blocks, past the cascade's 256-key minimum.
const PROMPT: usize = 18 * BLOCK;

/// The prompt's prefill (a run, so eager), for the sequence whose table is `table`.
fn prefill(table: &[u32]) -> CachedInput {
    let n = PROMPT;
    CachedInput {
        tokens: (0..n).map(|i| (i * 37 % 251) as u32).collect(),
        token_seq: vec![0; n],
        token_pos: (0..n as u32).collect(),
        slots: (0..n)
            .map(|p| table[p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32)
            .collect(),
        block_tables: table.to_vec(),
        max_blocks: table.len(),
        logit_rows: vec![n as u32 - 1],
    }
}

/// One decode token for each of `seqs` at position `pos`.
fn decode(tables: &[Vec<u32>], seqs: &[usize], pos: usize) -> CachedInput {
    let mut input = CachedInput {
        max_blocks: tables[0].len(),
        ..CachedInput::default()
    };
    for (row, &s) in seqs.iter().enumerate() {
        let table = &tables[s];
        input.block_tables.extend(table);
        input.tokens.push(((pos * 13 + s * 29) % 256) as u32);
        input.token_seq.push(row as u32);
        input.token_pos.push(pos as u32);
        input
            .slots
            .push(table[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32);
        input.logit_rows.push(row as u32);
    }
    input
}

#[test]
fn graphed_decode_matches_eager_decode() {
    graphed_matches_eager(false);
}

/// LoRA's low-rank products live in the decode scratch, so adapted models graph too.
#[test]
fn graphed_lora_decode_matches_eager_decode() {
    graphed_matches_eager(true);
}

fn graphed_matches_eager(lora: bool) {
    let (on, off) = match (CudaBackend::new(0), CudaBackend::new(0)) {
        (Ok(mut on), Ok(mut off)) => {
            on.set_graphs(true);
            off.set_graphs(false);
            (Arc::new(on), Arc::new(off))
        }
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("skipping the CUDA decode-graph test: {e}");
            return;
        }
    };
    let cpu = Transformer::new_random(Arc::new(CpuBackend::<f32>::new()), config(), 11).unwrap();
    let weights = cpu.to_host_weights().unwrap();
    let adapt = |m: Transformer<CudaBackend>| match lora {
        true => m.with_lora(LoraConfig::new(8)).unwrap(),
        false => m,
    };
    let graphed = adapt(Transformer::from_host_weights(on.clone(), config(), &weights).unwrap());
    let eager = adapt(Transformer::from_host_weights(off.clone(), config(), &weights).unwrap());
    let mut caches = [
        graphed.new_kv_cache(64, BLOCK).unwrap(),
        eager.new_kv_cache(64, BLOCK).unwrap(),
    ];
    // Eight samples of one prompt: its 18 blocks shared, two blocks of their own each.
    let tables: Vec<Vec<u32>> = (0..8u32)
        .map(|s| (0..18).chain([18 + 2 * s, 19 + 2 * s]).collect())
        .collect();
    let logits = |caches: &mut [_; 2], input: &CachedInput| {
        let mut run = |i: usize| {
            let (m, backend) = if i == 0 {
                (&graphed, &on)
            } else {
                (&eager, &off)
            };
            backend
                .download(&m.forward_cached(&mut caches[i], input).unwrap())
                .unwrap()
        };
        (run(0), run(1))
    };
    let (a, b) = logits(&mut caches, &prefill(&tables[0]));
    assert_eq!(a, b, "the prefill runs eagerly in both");

    let all: Vec<usize> = (0..8).collect();
    let five = [0, 2, 3, 5, 7];
    let mut worst_padded = 0f32;
    for step in 0..32 {
        let pos = PROMPT + step;
        let seqs: &[usize] = if step < 24 { &all } else { &five };
        let (a, b) = logits(&mut caches, &decode(&tables, seqs, pos));
        assert_eq!(a.len(), seqs.len() * 256);
        if seqs.len() == 8 {
            assert_eq!(a, b, "step {step}: a full batch must match bit for bit");
        } else {
            let gap = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            worst_padded = worst_padded.max(gap);
        }
    }
    eprintln!("padded steps: max |Δ logit| {worst_padded:.2e}");
    assert!(worst_padded < 5e-2, "padded steps drift: {worst_padded}");
    let counts = on.graph_counts();
    eprintln!("{counts:?}");
    assert_eq!(counts.eager, 0, "every decode step graphs");
    assert!(
        counts.captured >= 2,
        "a batch of 8 and one of 5 padded to 8"
    );
    assert_eq!(
        counts.replayed, 32,
        "every step replays a graph, new or kept"
    );
    assert_eq!(off.graph_counts().captured, 0);
}
