//! `exact_logprobs` on the CPU (issue 21): a sampled token's log-prob equals, bit for bit,
//! the one the packed training forward computes for it, however the sampler batched,
//! chunked and shared the work; without the mode they agree to rounding only.

use floe_engine::{AnyLocalEngine, LocalEngineOptions, ModelSource};
use floe_engine::{Engine, Generation, Loss, SequenceGroup, TrainGroup, TrainResponse, Weights};
use floe_engine::{SampleRequest, SamplingParams};
use floe_model::ModelConfig;
use floe_rl::AlgorithmConfig;

mod support;
use support::tiny_config;

/// How the sampler and the trainer cut the work: the sampler's tokens per step and
/// running samples (decode batches of every size, prefill in chunks), the trainer's
/// tokens per micro-batch (how the forward packs the groups).
#[derive(Clone, Copy, Debug)]
struct Cutting {
    max_tokens_per_step: usize,
    max_running_seqs: usize,
    max_tokens_per_microbatch: usize,
}

const CUTTINGS: [Cutting; 3] = [
    // Everything in one step and one micro-batch.
    Cutting {
        max_tokens_per_step: 2048,
        max_running_seqs: 256,
        max_tokens_per_microbatch: 4096,
    },
    // Prompts prefilled 7 tokens a step beside 3 running samples; small micro-batches.
    Cutting {
        max_tokens_per_step: 7,
        max_running_seqs: 3,
        max_tokens_per_microbatch: 60,
    },
    // One sample at a time, prefilled 16 tokens a step.
    Cutting {
        max_tokens_per_step: 16,
        max_running_seqs: 1,
        max_tokens_per_microbatch: 150,
    },
];

fn engine(config: ModelConfig, cutting: Cutting, exact: bool) -> AnyLocalEngine {
    let options = LocalEngineOptions {
        max_tokens_per_step: cutting.max_tokens_per_step,
        max_running_seqs: cutting.max_running_seqs,
        max_tokens_per_microbatch: cutting.max_tokens_per_microbatch,
        kv_cache_bytes: Some(8 << 20),
        exact_logprobs: exact,
        ..LocalEngineOptions::default()
    };
    AnyLocalEngine::open(ModelSource::Random { config, seed: 7 }, None, options).unwrap()
}

/// Deterministic tokens in `3..vocab` (clear of the eos ids of both test shapes).
fn tokens(seed: u64, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 3 + (floe_backend::sampling::mix64(seed * 1000 + i) % u64::from(vocab - 3)) as u32)
        .collect()
}

/// Four prompts of 3 to 33 tokens, three samples each (sharing the prompt's blocks),
/// of 5 to 20 tokens, so decode batches shrink as samples finish.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    [3, 9, 20, 33]
        .iter()
        .enumerate()
        .map(|(i, &len)| tokens(i as u64 + 1, len, vocab))
        .collect()
}

fn sample(engine: &mut AnyLocalEngine, prompts: &[Vec<u32>], temperature: f32) -> Vec<Generation> {
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(id, prompt)| SampleRequest {
            id: id as u64,
            prompt: prompt.clone(),
            n: 3,
            params: SamplingParams {
                temperature,
                max_new_tokens: 5 + 5 * id,
                seed: Some(11),
                force_full_length: true,
                ..SamplingParams::default()
            },
        })
        .collect();
    let mut generations = Vec::new();
    engine
        .sample(requests, &mut |generation| generations.push(generation))
        .unwrap();
    generations.sort_by_key(|g| (g.request_id, g.sample_index));
    generations
}

fn groups(prompts: &[Vec<u32>], generations: &[Generation]) -> Vec<SequenceGroup> {
    prompts
        .iter()
        .enumerate()
        .map(|(id, prompt)| SequenceGroup {
            targets: None,
            prompt: prompt.clone(),
            responses: generations
                .iter()
                .filter(|g| g.request_id == id as u64)
                .map(|g| g.tokens.clone())
                .collect(),
        })
        .collect()
}

/// `(sampled, forward)` log-prob pairs of every generated token.
fn logprob_pairs(
    engine: &mut AnyLocalEngine,
    prompts: &[Vec<u32>],
    generations: &[Generation],
    temperature: f32,
) -> Vec<(f64, f64)> {
    let scored = engine
        .forward(&groups(prompts, generations), Weights::Policy, temperature)
        .unwrap();
    generations
        .iter()
        .flat_map(|g| {
            let forward = &scored[g.request_id as usize][g.sample_index].logprobs;
            assert_eq!(forward.len(), g.logprobs.len());
            g.logprobs
                .iter()
                .map(|&s| f64::from(s))
                .zip(forward.iter().copied())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn max_abs_delta(pairs: &[(f64, f64)]) -> f64 {
    pairs.iter().map(|(s, f)| (s - f).abs()).fold(0.0, f64::max)
}

/// Exact: every sampled log-prob `==` the training forward's, under every cutting, at
/// temperatures 0.7, 1 and 0 (greedy, scored at 1); and the samples themselves do not
/// depend on the cutting. Off: the two agree to rounding only (the worst delta is
/// printed: 4.8e-7 at the test shape, 9.5e-7 at the embedded one).
fn check_shape(config: ModelConfig) {
    let prompts = prompts(config.vocab_size as u32);
    for temperature in [0.7, 1.0, 0.0] {
        let mut first_tokens = None;
        for cutting in CUTTINGS {
            let mut exact = engine(config.clone(), cutting, true);
            let generations = sample(&mut exact, &prompts, temperature);
            let tokens: Vec<Vec<u32>> = generations.iter().map(|g| g.tokens.clone()).collect();
            assert_eq!(*first_tokens.get_or_insert_with(|| tokens.clone()), tokens);
            let pairs = logprob_pairs(&mut exact, &prompts, &generations, temperature);
            assert!(pairs.len() > 100);
            for (i, &(sampled, forward)) in pairs.iter().enumerate() {
                assert!(
                    sampled == forward,
                    "{cutting:?} temperature {temperature}, token {i}: sampled {sampled}, \
                     forward {forward}"
                );
            }

            let mut off = engine(config.clone(), cutting, false);
            let generations = sample(&mut off, &prompts, temperature);
            let delta = max_abs_delta(&logprob_pairs(
                &mut off,
                &prompts,
                &generations,
                temperature,
            ));
            eprintln!(
                "exact_logprobs off, {cutting:?}, temperature {temperature}: max |delta| {delta:e}"
            );
            assert!(delta <= 1e-5, "{delta}");
        }
    }
}

#[test]
fn sampled_logprobs_equal_the_training_forwards_bit_for_bit_at_the_test_shape() {
    check_shape(tiny_config());
}

/// The shape of `floe train`'s default embedded model (hidden 128, 4 layers, vocabulary
/// 1024), random weights.
#[test]
fn sampled_logprobs_equal_the_training_forwards_bit_for_bit_at_the_embedded_shape() {
    check_shape(ModelConfig::preset("tiny").unwrap());
}

/// The sampler's log-probs as the old ones: the first update's ratio is exactly 1 (the
/// training forward gives the same log-probs), so PPO's KL and clip fraction are 0.
#[test]
fn sampler_logprobs_as_old_logprobs_give_a_ratio_of_exactly_one() {
    let cutting = CUTTINGS[1];
    let mut engine = engine(tiny_config(), cutting, true);
    let prompts = prompts(64);
    let generations = sample(&mut engine, &prompts, 1.0);
    let groups: Vec<TrainGroup> = groups(&prompts, &generations)
        .into_iter()
        .enumerate()
        .map(|(id, group)| TrainGroup {
            prompt: group.prompt,
            responses: generations
                .iter()
                .filter(|g| g.request_id == id as u64)
                .map(|g| TrainResponse {
                    targets: None,
                    tokens: g.tokens.clone(),
                    loss_mask: vec![1.0; g.tokens.len()],
                    advantages: vec![g.sample_index as f64 - 1.0; g.tokens.len()],
                    old_logprobs: g.logprobs.iter().map(|&l| f64::from(l)).collect(),
                    rollout_logprobs: None,
                    ref_logprobs: None,
                })
                .collect(),
        })
        .collect();
    let loss = Loss::Policy(AlgorithmConfig {
        use_kl_loss: false,
        ..AlgorithmConfig::default()
    });
    let out = engine.forward_backward(&groups, &loss, 1.0).unwrap();
    assert_eq!(out.metrics["policy/ppo_kl"], 0.0);
    assert_eq!(out.metrics["policy/clipfrac"], 0.0);
    assert_eq!(out.metrics["policy/ppo_log_ratio_abs_max"], 0.0);
}
