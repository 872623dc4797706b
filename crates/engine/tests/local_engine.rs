//! LocalEngine on the CPU with a tiny random Qwen3: scoring agrees with sampling, the
//! micro-batch split does not change a step, first-update PPO metrics are exact, SFT
//! learns, and a saved state resumes exactly.

use std::collections::BTreeMap;

use floe_backend::sampling::GAMMA;
use floe_engine::policy::OptimParams;
use floe_engine::{AnyLocalEngine, LocalEngineOptions, ModelSource};
use floe_engine::{Engine, Loss, SequenceGroup, TokenOutputs, TrainGroup, TrainResponse, Weights};
use floe_engine::{
    Generation, RequestIntake, SampleEvent, SampleFeed, SampleFlow, SampleRequest, SamplingParams,
};
use floe_model::weights::HostTensor;
use floe_rl::AlgorithmConfig;

mod support;
use support::tiny_config;

fn engine(max_tokens_per_microbatch: usize, seed: u64) -> AnyLocalEngine {
    let options = LocalEngineOptions {
        max_tokens_per_microbatch,
        kv_cache_bytes: Some(4 << 20),
        ..LocalEngineOptions::default()
    };
    let source = ModelSource::Random {
        config: tiny_config(),
        seed,
    };
    AnyLocalEngine::open(source, None, options).unwrap()
}

fn weights(engine: &AnyLocalEngine) -> BTreeMap<String, HostTensor> {
    match engine {
        AnyLocalEngine::Cpu(e) => e.policy().model().to_host_weights().unwrap(),
        AnyLocalEngine::Cuda(_) => unreachable!("the tests run on the CPU"),
    }
}

const OPTIM: OptimParams = OptimParams {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.01,
    max_grad_norm: 1.0,
};

/// Deterministic pseudo-random tokens in `2..vocab`.
fn tokens(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(GAMMA) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            2 + (x % 62) as u32
        })
        .collect()
}

/// Three groups with prompts of different lengths and responses of 1 to 9 tokens.
fn sequence_groups() -> Vec<SequenceGroup> {
    (0..3u64)
        .map(|g| SequenceGroup {
            targets: None,
            prompt: tokens(100 + g, 5 + 3 * g as usize),
            responses: (0..3u64)
                .map(|r| tokens(10 * g + r, 1 + ((3 * g + 2 * r) % 9) as usize))
                .collect(),
        })
        .collect()
}

/// Training groups over [`sequence_groups`] with `old_logprobs` from `scored`, varied
/// advantages and a mask that leaves out some tokens.
fn train_groups(groups: &[SequenceGroup], scored: &[Vec<TokenOutputs>]) -> Vec<TrainGroup> {
    groups
        .iter()
        .zip(scored)
        .enumerate()
        .map(|(g, (group, outputs))| TrainGroup {
            prompt: group.prompt.clone(),
            responses: group
                .responses
                .iter()
                .zip(outputs)
                .enumerate()
                .map(|(r, (tokens, out))| TrainResponse {
                    targets: None,
                    tokens: tokens.clone(),
                    loss_mask: (0..tokens.len())
                        .map(|i| if (i + r) % 4 == 3 { 0.0 } else { 1.0 })
                        .collect(),
                    advantages: vec![(g as f64 - 1.0) + 0.5 * r as f64 - 0.4; tokens.len()],
                    old_logprobs: out.logprobs.clone(),
                    rollout_logprobs: None,
                    ref_logprobs: None,
                })
                .collect(),
        })
        .collect()
}

fn policy_loss() -> Loss {
    Loss::Policy(AlgorithmConfig {
        use_kl_loss: false,
        ..AlgorithmConfig::default()
    })
}

#[test]
fn forward_logprobs_equal_the_samplers() {
    let mut engine = engine(4096, 1);
    let temperature = 0.7;
    let prompts = [tokens(1, 7), tokens(2, 20)];
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(id, prompt)| SampleRequest {
            id: id as u64,
            prompt: prompt.clone(),
            n: 2,
            params: SamplingParams {
                temperature,
                max_new_tokens: 12,
                seed: Some(5),
                force_full_length: true,
                ..SamplingParams::default()
            },
        })
        .collect();
    let mut generations = Vec::new();
    engine
        .sample(requests, &mut |generation| generations.push(generation))
        .unwrap();
    assert_eq!(generations.len(), 4);
    generations.sort_by_key(|g| (g.request_id, g.sample_index));
    let groups: Vec<SequenceGroup> = prompts
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
        .collect();
    let scored = engine
        .forward(&groups, Weights::Policy, temperature)
        .unwrap();
    for generation in &generations {
        let out = &scored[generation.request_id as usize][generation.sample_index];
        assert_eq!(out.logprobs.len(), generation.tokens.len());
        for (i, (&sampled, &forward)) in generation.logprobs.iter().zip(&out.logprobs).enumerate() {
            assert!(
                (f64::from(sampled) - forward).abs() <= 1e-4,
                "request {} sample {} token {i}: sampler {sampled}, forward {forward}",
                generation.request_id,
                generation.sample_index
            );
        }
    }
}

#[test]
fn micro_batch_split_does_not_change_the_step() {
    let groups = sequence_groups();
    let mut whole = engine(4096, 2);
    // Group 2 needs 10 + 7 + 9 + 3 = 29 tokens with its prompt once, so it is split.
    let mut split = engine(20, 2);
    let scored = whole.forward(&groups, Weights::Policy, 1.0).unwrap();
    // Products over a different number of rows may round differently in the last bits.
    let split_scored = split.forward(&groups, Weights::Policy, 1.0).unwrap();
    for (a, b) in scored.iter().flatten().zip(split_scored.iter().flatten()) {
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
        }
    }
    let train = train_groups(&groups, &scored);
    let a = whole.forward_backward(&train, &policy_loss(), 1.0).unwrap();
    let b = split.forward_backward(&train, &policy_loss(), 1.0).unwrap();
    // The split engine's log-probs round differently (the check above), so its ratios
    // differ from 1 by about 1e-7; whether they do depends on the CPU's SIMD width.
    assert!((a.loss - b.loss).abs() <= 1e-6, "{} vs {}", a.loss, b.loss);
    let step_a = whole.optim_step(&OPTIM).unwrap();
    let step_b = split.optim_step(&OPTIM).unwrap();
    assert!(step_a.grad_norm > 0.0);
    let rel = (step_a.grad_norm - step_b.grad_norm).abs() / step_a.grad_norm;
    assert!(
        rel <= 1e-5,
        "grad norms {} vs {}",
        step_a.grad_norm,
        step_b.grad_norm
    );
    // Gradients sum in a different order, so f32 weights may differ in the last bits.
    for ((name, wa), (_, wb)) in weights(&whole).iter().zip(&weights(&split)) {
        for (x, y) in wa.data.iter().zip(&wb.data) {
            assert!((x - y).abs() <= 1e-6, "{name}: {x} vs {y}");
        }
    }
}

#[test]
fn first_update_has_zero_ppo_kl_and_clipfrac() {
    let groups = sequence_groups();
    let mut engine = engine(20, 3);
    let scored = engine.forward(&groups, Weights::Policy, 1.0).unwrap();
    let out = engine
        .forward_backward(&train_groups(&groups, &scored), &policy_loss(), 1.0)
        .unwrap();
    assert_eq!(out.metrics["policy/ppo_kl"], 0.0);
    assert_eq!(out.metrics["policy/clipfrac"], 0.0);
}

#[test]
fn a_policy_step_raises_advantaged_responses_and_lowers_the_others() {
    let groups = sequence_groups();
    let mut engine = engine(4096, 5);
    let before = engine.forward(&groups, Weights::Policy, 1.0).unwrap();
    let mut train = train_groups(&groups, &before);
    // Within each group: the first response +1, the others -1/2 (zero mean, as GRPO's).
    for group in &mut train {
        for (r, response) in group.responses.iter_mut().enumerate() {
            response.loss_mask.fill(1.0);
            response.advantages.fill(if r == 0 { 1.0 } else { -0.5 });
        }
    }
    engine
        .forward_backward(&train, &policy_loss(), 1.0)
        .unwrap();
    engine.optim_step(&OPTIM).unwrap();
    let after = engine.forward(&groups, Weights::Policy, 1.0).unwrap();
    let sum = |o: &TokenOutputs| o.logprobs.iter().sum::<f64>();
    for (g, (b, a)) in before.iter().zip(&after).enumerate() {
        for (r, (b, a)) in b.iter().zip(a).enumerate() {
            let change = sum(a) - sum(b);
            if r == 0 {
                assert!(change > 0.0, "group {g} response {r}: {change}");
            } else {
                assert!(change < 0.0, "group {g} response {r}: {change}");
            }
        }
    }
}

#[test]
fn sft_steps_lower_the_cross_entropy() {
    let groups = sequence_groups();
    let mut engine = engine(4096, 4);
    let scored = engine.forward(&groups, Weights::Policy, 1.0).unwrap();
    let train = train_groups(&groups, &scored);
    let optim = OptimParams { lr: 1e-2, ..OPTIM };
    let mut losses = Vec::new();
    for _ in 0..5 {
        let out = engine
            .forward_backward(&train, &Loss::CrossEntropy, 1.0)
            .unwrap();
        losses.push(out.loss);
        engine.optim_step(&optim).unwrap();
    }
    // Random weights start near ln(64) ≈ 4.16 nats per token.
    assert!((losses[0] - 64f64.ln()).abs() < 0.5, "{losses:?}");
    assert!(losses[4] < losses[0] - 0.3, "{losses:?}");
}

#[test]
fn saved_state_resumes_identically() {
    let groups = sequence_groups();
    let mut straight = engine(4096, 5);
    straight.freeze_reference().unwrap();
    let scored = straight.forward(&groups, Weights::Policy, 1.0).unwrap();
    let train = train_groups(&groups, &scored);
    straight
        .forward_backward(&train, &policy_loss(), 1.0)
        .unwrap();
    straight.optim_step(&OPTIM).unwrap();

    let dir = tempfile::tempdir().unwrap();
    straight.save_state(dir.path()).unwrap();
    let mut resumed = engine(4096, 99);
    resumed.load_state(dir.path()).unwrap();
    assert_eq!(weights(&resumed), weights(&straight));
    assert_eq!(
        resumed.forward(&groups, Weights::Reference, 1.0).unwrap(),
        straight.forward(&groups, Weights::Reference, 1.0).unwrap()
    );

    for engine in [&mut straight, &mut resumed] {
        engine
            .forward_backward(&train, &policy_loss(), 1.0)
            .unwrap();
        engine.optim_step(&OPTIM).unwrap();
    }
    assert_eq!(weights(&resumed), weights(&straight));
}

#[test]
fn bad_requests_name_what_is_wrong() {
    let mut engine = engine(4096, 6);
    let groups = vec![SequenceGroup {
        targets: None,
        prompt: vec![2, 3],
        responses: vec![vec![4, 500]],
    }];
    let err = engine
        .forward(&groups, Weights::Policy, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("group 0 response 0") && err.contains("500"),
        "{err}"
    );
    let err = engine
        .forward(&sequence_groups(), Weights::Reference, 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("freeze_reference"), "{err}");
    let mut train = train_groups(
        &sequence_groups(),
        &engine
            .forward(&sequence_groups(), Weights::Policy, 1.0)
            .unwrap(),
    );
    train[1].responses[2].advantages.pop();
    let err = engine
        .forward_backward(&train, &policy_loss(), 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("group 1 response 2: advantages"), "{err}");
}

#[test]
fn an_unavailable_cuda_device_is_a_clear_error() {
    let options = LocalEngineOptions {
        device: floe_engine::Device::Cuda(0),
        ..LocalEngineOptions::default()
    };
    let source = ModelSource::Random {
        config: tiny_config(),
        seed: 0,
    };
    // Without the `cuda` feature, or without a driver, opening fails and names the device.
    if let Err(err) = AnyLocalEngine::open(source, None, options) {
        assert!(err.to_string().starts_with("device `cuda:0`: "), "{err}");
    }
}

/// Requests of two prompts, two samples each, seeded.
fn sample_requests() -> Vec<SampleRequest> {
    [tokens(1, 7), tokens(2, 20)]
        .into_iter()
        .enumerate()
        .map(|(id, prompt)| SampleRequest {
            id: id as u64,
            prompt,
            n: 2,
            params: SamplingParams {
                temperature: 1.0,
                max_new_tokens: 10,
                seed: Some(9),
                ..SamplingParams::default()
            },
        })
        .collect()
}

#[test]
fn overlap_samples_and_trains_as_the_verbs_do_one_after_the_other() {
    let groups = sequence_groups();
    // One after the other, through the plain verbs.
    let mut apart = engine(4096, 3);
    let mut sampled_apart = Vec::new();
    apart
        .sample(sample_requests(), &mut |g| {
            sampled_apart.push((g.request_id, g.sample_index, g.tokens, g.logprobs))
        })
        .unwrap();
    let scored_apart = apart.forward(&groups, Weights::Policy, 1.0).unwrap();
    let train = train_groups(&groups, &scored_apart);
    let loss_apart = apart.forward_backward(&train, &policy_loss(), 1.0).unwrap();
    apart.optim_step(&OPTIM).unwrap();

    // Overlapped: sampling on its thread, the forward and backward on this one.
    let mut together = engine(4096, 3);
    let (sampled, (scored, loss)) = together
        .overlap(
            |sampler| {
                let mut sampled = Vec::new();
                sampler
                    .sample(sample_requests(), &mut |g| {
                        sampled.push((g.request_id, g.sample_index, g.tokens, g.logprobs))
                    })
                    .map(|()| sampled)
            },
            |trainer| {
                let scored = trainer.forward(&groups, Weights::Policy, 1.0).unwrap();
                let train = train_groups(&groups, &scored);
                let loss = trainer.forward_backward(&train, &policy_loss(), 1.0);
                (scored, loss.unwrap())
            },
        )
        .unwrap();
    let mut sampled = sampled.unwrap();
    sampled.sort_by_key(|s| (s.0, s.1));
    sampled_apart.sort_by_key(|s| (s.0, s.1));
    assert_eq!(sampled, sampled_apart);
    assert_eq!(scored, scored_apart);
    assert_eq!(loss, loss_apart);
    // The weights are the engine's own again: the optimizer step applies, and equally.
    assert!(!together.optim_step(&OPTIM).unwrap().skipped);
    assert_eq!(weights(&together), weights(&apart));
    // The sampler came back: a plain sample call works after the overlap.
    together.sample(sample_requests(), &mut |_| {}).unwrap();
}

/// Hands `late[k]` to the engine at its `k`-th poll and keeps what comes back.
struct LateRequests {
    late: Vec<Vec<SampleRequest>>,
    polls: usize,
    refused: Vec<String>,
    finished: Vec<Generation>,
    progress_reports: usize,
}

impl SampleFeed for LateRequests {
    fn poll(&mut self, intake: &mut dyn RequestIntake) {
        for request in self
            .late
            .get_mut(self.polls)
            .map(std::mem::take)
            .unwrap_or_default()
        {
            if let Err(error) = intake.submit(request) {
                self.refused.push(error.to_string());
            }
        }
        self.polls += 1;
    }

    fn wants_progress(&self) -> bool {
        true
    }

    fn on_event(&mut self, event: SampleEvent<'_>) -> SampleFlow {
        match event {
            SampleEvent::Progress(_) => self.progress_reports += 1,
            SampleEvent::Finished(generation) => self.finished.push(generation),
        }
        SampleFlow::Continue
    }
}

/// Requests handed to a running `sample_joining` call join its batch between steps and
/// sample the tokens each samples alone (log-probs up to the rounding of steps with other
/// row counts); one the engine refuses fails alone.
#[test]
fn requests_joining_a_running_sample_call_sample_as_alone() {
    let mut engine = engine(4096, 4);
    let requests = sample_requests();
    let mut alone = Vec::new();
    for request in &requests {
        engine
            .sample(vec![request.clone()], &mut |g| alone.push(g))
            .unwrap();
    }
    let mut bad = requests[1].clone();
    bad.id = 7;
    bad.prompt.push(100_000);
    let mut feed = LateRequests {
        late: vec![
            vec![requests[0].clone()],
            vec![],
            vec![],
            vec![bad, requests[1].clone()],
        ],
        polls: 0,
        refused: Vec::new(),
        finished: Vec::new(),
        progress_reports: 0,
    };
    engine.sample_joining(&mut feed).unwrap();
    assert!(
        feed.polls > 4,
        "the call ended before the late requests joined"
    );
    assert_eq!(feed.refused.len(), 1, "{:?}", feed.refused);
    assert!(
        feed.refused[0].contains("sample request 7") && feed.refused[0].contains("vocabulary"),
        "{:?}",
        feed.refused
    );
    assert!(feed.progress_reports > 0);
    let key = |g: &Generation| (g.request_id, g.sample_index);
    feed.finished.sort_by_key(key);
    alone.sort_by_key(key);
    assert_eq!(feed.finished.len(), alone.len());
    for (joined, alone) in feed.finished.iter().zip(&alone) {
        assert_eq!(
            (joined.request_id, joined.sample_index, &joined.tokens),
            (alone.request_id, alone.sample_index, &alone.tokens)
        );
        for (a, b) in joined.logprobs.iter().zip(&alone.logprobs) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}

/// An engine that takes no requests mid-run: the [`Engine`] trait's own `sample_joining`
/// over a local engine's verbs (as the remote engine has it).
struct NoJoins(AnyLocalEngine);

impl Engine for NoJoins {
    type Error = floe_engine::Error;

    fn info(&self) -> &floe_engine::EngineInfo {
        self.0.info()
    }
    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> floe_engine::Result<()> {
        self.0.sample(requests, on_generation)
    }
    fn sample_streaming(
        &mut self,
        requests: Vec<SampleRequest>,
        on_event: &mut dyn FnMut(SampleEvent<'_>) -> SampleFlow,
    ) -> floe_engine::Result<()> {
        self.0.sample_streaming(requests, on_event)
    }
    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> floe_engine::Result<Vec<Vec<TokenOutputs>>> {
        self.0.forward(groups, weights, temperature)
    }
    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> floe_engine::Result<floe_engine::ForwardBackwardOutput> {
        self.0.forward_backward(groups, loss, temperature)
    }
    fn optim_step(
        &mut self,
        params: &OptimParams,
    ) -> floe_engine::Result<floe_engine::policy::StepOutcome> {
        self.0.optim_step(params)
    }
    fn sync_sampler_weights(&mut self) -> floe_engine::Result<std::time::Duration> {
        self.0.sync_sampler_weights()
    }
    fn freeze_reference(&mut self) -> floe_engine::Result<()> {
        self.0.freeze_reference()
    }
    fn reset_optimizer(&mut self) -> floe_engine::Result<()> {
        self.0.reset_optimizer()
    }
    fn save_state(&mut self, dir: &std::path::Path) -> floe_engine::Result<()> {
        self.0.save_state(dir)
    }
    fn load_state(&mut self, dir: &std::path::Path) -> floe_engine::Result<()> {
        self.0.load_state(dir)
    }
    fn export_hf(&mut self, dir: &std::path::Path) -> floe_engine::Result<()> {
        self.0.export_hf(dir)
    }
}

/// Without joins, `sample_joining` polls once and samples what that poll handed over as
/// one call: the same samples as `sample`; later requests stay with the caller.
#[test]
fn an_engine_without_joins_samples_one_poll_as_one_call() {
    let mut engine = NoJoins(engine(4096, 4));
    let mut alone = Vec::new();
    engine
        .sample(sample_requests(), &mut |g| alone.push(g))
        .unwrap();
    let mut feed = LateRequests {
        late: vec![sample_requests(), sample_requests()],
        polls: 0,
        refused: Vec::new(),
        finished: Vec::new(),
        progress_reports: 0,
    };
    engine.sample_joining(&mut feed).unwrap();
    assert_eq!(feed.polls, 1);
    assert!(feed.progress_reports > 0, "progress, as the feed wants");
    let key = |g: &Generation| (g.request_id, g.sample_index);
    feed.finished.sort_by_key(key);
    alone.sort_by_key(key);
    assert_eq!(feed.finished, alone);
}
