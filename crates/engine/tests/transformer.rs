//! The sampler and the packer against a real (tiny, random) Qwen3 on the f64 CPU backend:
//! batch-invariant sampling, sampler log-probs equal to the trainer's, and shared and
//! unshared packings giving the same log-prob for every response token.

use std::collections::HashMap;
use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_engine::{
    pack_rollouts, Generation, NgramSpec, PackingConfig, PackingMode, Response, RolloutGroup,
    SampleRequest, Sampler, SamplerConfig, SamplingParams, TokenRef,
};
use floe_model::batch::PackedBatch;
use floe_model::transformer::Transformer;
use floe_model::ModelConfig;

mod support;

const VOCAB: usize = 96;

fn tiny_model() -> Transformer<CpuBackend<f64>> {
    let config = ModelConfig {
        vocab_size: VOCAB,
        max_position_embeddings: 256,
        eos_token_ids: vec![],
        ..support::tiny_config()
    };
    // Random weights of std 0.02 give nearly flat logits; that is fine for sampling.
    Transformer::new_random(Arc::new(CpuBackend::<f64>::new()), config, 7).unwrap()
}

fn request(id: u64, prompt_len: usize, n: usize, max_new_tokens: usize) -> SampleRequest {
    SampleRequest {
        id,
        prompt: (0..prompt_len)
            .map(|i| ((id as usize * 13 + i * 5 + 1) % VOCAB) as u32)
            .collect(),
        n,
        params: SamplingParams {
            max_new_tokens,
            seed: Some(id),
            ..SamplingParams::default()
        },
    }
}

fn config(num_blocks: usize, block_size: usize, max_tokens_per_step: usize) -> SamplerConfig {
    SamplerConfig {
        num_blocks,
        block_size,
        max_tokens_per_step,
        max_running_seqs: 32,
        seed: 0,
        speculative: None,
    }
}

#[test]
fn sampling_is_batch_invariant_and_logprobs_match_the_trainer() {
    let model = tiny_model();
    let target = request(42, 13, 3, 12);
    // Alone, with the prompt's 3 full blocks shared by the 3 samples (the first step only
    // fills them and samples nothing).
    let alone = Sampler::new(&model, config(32, 4, 256))
        .unwrap()
        .generate(&model, vec![target.clone()])
        .unwrap();
    // Alone, without sharing (the prompt fits in one block) and 3 tokens a step.
    let unshared = Sampler::new(&model, config(8, 16, 3))
        .unwrap()
        .generate(&model, vec![target.clone()])
        .unwrap();
    for (a, b) in alone.iter().zip(&unshared) {
        assert_eq!(a.tokens, b.tokens);
    }
    let distinct: std::collections::HashSet<&Vec<u32>> = alone.iter().map(|g| &g.tokens).collect();
    assert_eq!(distinct.len(), 3, "samples draw from their own streams");

    // Small blocks (prefix sharing), a 5-token step budget (chunked prefill) and a cache
    // small enough to preempt.
    let mut busy: Vec<SampleRequest> = (0..5)
        .map(|id| request(id, 3 + 4 * id as usize, 2, 10))
        .collect();
    busy.insert(2, target.clone());
    let mut sampler = Sampler::new(&model, config(14, 4, 5)).unwrap();
    let out = sampler.generate(&model, busy.clone()).unwrap();
    assert!(sampler.stats().preemptions > 0, "{:?}", sampler.stats());
    let mine: Vec<&Generation> = out.iter().filter(|g| g.request_id == 42).collect();
    assert_eq!(mine.len(), 3);
    for (a, b) in alone.iter().zip(&mine) {
        assert_eq!(a.tokens, b.tokens);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }

    // The trainer's log-prob of each sampled token, from one packed forward.
    let prompts: HashMap<u64, &Vec<u32>> = busy.iter().map(|r| (r.id, &r.prompt)).collect();
    let mut batch = PackedBatch::default();
    let rows: Vec<_> = out
        .iter()
        .map(|g| {
            let sequence = [&prompts[&g.request_id][..], &g.tokens[..]].concat();
            let scored = batch.push_sequence(&sequence);
            scored.end - g.tokens.len()..scored.end
        })
        .collect();
    let stats = model.forward(&batch, 1.0).unwrap();
    for (g, rows) in out.iter().zip(rows) {
        for (sampled, trained) in g.logprobs.iter().zip(&stats.logprobs[rows]) {
            assert!(
                (f64::from(*sampled) - trained).abs() < 1e-5,
                "request {} sample {}: sampler {sampled} vs trainer {trained}",
                g.request_id,
                g.sample_index
            );
        }
    }
}

/// `requests` sampled without and with prompt-lookup speculation (k = 4) in a small
/// cache and step budget; returns both and the draft tokens run and accepted.
fn with_and_without_speculation(
    model: &Transformer<CpuBackend<f64>>,
    requests: &[SampleRequest],
) -> (Vec<Generation>, Vec<Generation>, u64, u64) {
    let plain = Sampler::new(model, config(64, 4, 24))
        .unwrap()
        .generate(model, requests.to_vec())
        .unwrap();
    let mut sampler = Sampler::new(
        model,
        SamplerConfig {
            speculative: Some(NgramSpec::with_max_draft(4)),
            ..config(64, 4, 24)
        },
    )
    .unwrap();
    let speculative = sampler.generate(model, requests.to_vec()).unwrap();
    let stats = sampler.stats();
    (
        plain,
        speculative,
        stats.draft_tokens,
        stats.accepted_draft_tokens,
    )
}

fn assert_same_samples(plain: &[Generation], speculative: &[Generation]) {
    assert_eq!(plain.len(), speculative.len());
    for (a, b) in plain.iter().zip(speculative) {
        assert_eq!(a.tokens, b.tokens, "request {}", a.request_id);
        assert_eq!(a.logprobs.len(), b.logprobs.len());
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}

#[test]
fn speculative_greedy_decoding_equals_plain_greedy() {
    let model = tiny_model();
    let phrase: Vec<u32> = vec![5, 17, 33, 2, 60, 41, 8];
    let mut requests: Vec<SampleRequest> = (0..4)
        .map(|id| request(id, 6 + 5 * id as usize, 1, 24))
        .collect();
    // A prompt that repeats a phrase: lookup drafts its continuation.
    requests.push(SampleRequest {
        prompt: phrase.repeat(4),
        ..request(9, 1, 1, 24)
    });
    for r in &mut requests {
        r.params.temperature = 0.0;
    }
    let (plain, speculative, drafted, accepted) = with_and_without_speculation(&model, &requests);
    assert_same_samples(&plain, &speculative);
    assert!(accepted > 0, "{accepted} of {drafted} drafts accepted");
}

/// At temperature 1 the tokens are the same too: a draft token is kept exactly when the
/// row's ordinary draw lands on it (`floe_engine::speculative`).
#[test]
fn speculative_sampling_draws_the_plain_samples() {
    let model = tiny_model();
    let phrase: Vec<u32> = vec![5, 17, 33, 2, 60, 41, 8];
    let requests: Vec<SampleRequest> = (0..6)
        .map(|id| SampleRequest {
            prompt: phrase.repeat(1 + id as usize % 3),
            params: SamplingParams {
                top_k: 3,
                ..request(id, 1, 4, 16).params
            },
            ..request(id, 1, 4, 16)
        })
        .collect();
    let (plain, speculative, drafted, accepted) = with_and_without_speculation(&model, &requests);
    assert_same_samples(&plain, &speculative);
    assert!(accepted > 0, "{accepted} of {drafted} drafts accepted");
}

fn rollouts() -> Vec<RolloutGroup> {
    (0..5)
        .map(|g| RolloutGroup {
            prompt: (0..1 + g * 4)
                .map(|t| ((g * 31 + t * 7) % VOCAB) as u32)
                .collect(),
            responses: (0..3)
                .map(|r| {
                    let len = 1 + (g * 3 + r * 5) % 9;
                    Response {
                        targets: None,
                        tokens: (0..len)
                            .map(|t| ((g * 11 + r * 17 + t * 3) % VOCAB) as u32)
                            .collect(),
                        weights: vec![1.0; len],
                    }
                })
                .collect(),
        })
        .collect()
}

/// Log-prob of every response token under `mode` and `budget`.
fn token_logprobs(
    model: &Transformer<CpuBackend<f64>>,
    groups: &[RolloutGroup],
    mode: PackingMode,
    budget: usize,
) -> (HashMap<TokenRef, f64>, usize) {
    let batches = pack_rollouts(
        groups,
        PackingConfig {
            max_tokens_per_microbatch: budget,
            mode,
        },
    )
    .unwrap();
    let mut logprobs = HashMap::new();
    for micro in &batches {
        micro.batch.validate().unwrap();
        let stats = model.forward(&micro.batch, 1.0).unwrap();
        micro.for_each_scored_row(|row, token| {
            assert!(logprobs.insert(token, stats.logprobs[row]).is_none());
        });
    }
    (logprobs, batches.len())
}

#[test]
fn shared_and_unshared_packing_give_the_same_logprobs() {
    let model = tiny_model();
    let groups = rollouts();
    let (reference, _) = token_logprobs(&model, &groups, PackingMode::Unshared, 10_000);
    let tokens: usize = groups
        .iter()
        .flat_map(|g| &g.responses)
        .map(|r| r.tokens.len())
        .sum();
    assert_eq!(reference.len(), tokens);
    for (mode, budget) in [
        (PackingMode::Shared, 10_000),
        (PackingMode::Shared, 30),
        (PackingMode::Unshared, 30),
    ] {
        let (logprobs, batches) = token_logprobs(&model, &groups, mode, budget);
        assert!(budget > 1000 || batches > 1);
        assert_eq!(logprobs.len(), reference.len());
        for (token, lp) in &logprobs {
            let want = reference[token];
            assert!(
                (lp - want).abs() < 1e-9,
                "{mode:?}/{budget} {token:?}: {lp} vs {want}"
            );
        }
    }
}

/// Every parameter gradient of `Σ coefficient(token) · logprob(token)` over the response
/// tokens, accumulated over the micro-batches of `mode` and `budget`.
fn gradients(
    model: &mut Transformer<CpuBackend<f64>>,
    groups: &[RolloutGroup],
    mode: PackingMode,
    budget: usize,
) -> Vec<(String, Vec<f32>)> {
    let coefficient = |t: TokenRef| 0.1 + f64::from(t.group * 7 + t.response * 3 + t.token) / 50.0;
    model.zero_grad().unwrap();
    let packing = PackingConfig {
        max_tokens_per_microbatch: budget,
        mode,
    };
    for micro in pack_rollouts(groups, packing).unwrap() {
        let d_logprobs = micro.scatter_to_rows(coefficient);
        model
            .forward_backward(&micro.batch, 1.0, &mut |_| {
                Ok((d_logprobs.clone(), vec![0.0; d_logprobs.len()]))
            })
            .unwrap();
    }
    model
        .grads_to_host()
        .unwrap()
        .into_iter()
        .map(|(name, tensor)| (name, tensor.data))
        .collect()
}

#[test]
fn shared_split_and_unshared_packing_give_the_same_gradients() {
    let mut model = tiny_model();
    let groups = rollouts();
    let reference = gradients(&mut model, &groups, PackingMode::Unshared, 10_000);
    assert!(reference
        .iter()
        .all(|(_, g)| g.iter().any(|x| x.abs() > 1e-7)));
    for (mode, budget) in [(PackingMode::Shared, 10_000), (PackingMode::Shared, 30)] {
        let grads = gradients(&mut model, &groups, mode, budget);
        for ((name, want), (_, got)) in reference.iter().zip(&grads) {
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let worst = want
                .iter()
                .zip(got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-5 * scale,
                "{mode:?}/{budget} {name}: max |Δ| {worst} of {scale}"
            );
        }
    }
}
