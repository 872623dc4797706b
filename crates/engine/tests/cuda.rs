//! The sampler on the CUDA backend (bf16 KV cache and logits) against the trainer's
//! forward on the same device and against the CPU; the optimizer in host memory against
//! the one on the device. Skipped, with a note, where floe was
//! built without `--features floe-backend/cuda` or no GPU is present.

use std::sync::Arc;

use floe_backend::cpu::CpuBackend;
use floe_backend::cuda::CudaBackend;
use floe_backend::Backend;
use floe_engine::{CachedModel, Generation, SampleRequest, Sampler, SamplerConfig, SamplingParams};
use floe_model::batch::PackedBatch;
use floe_model::transformer::Transformer;
use floe_model::{Architecture, ModelConfig};

const VOCAB: usize = 512;

fn model_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen3,
        vocab_size: VOCAB,
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 1024,
        tie_word_embeddings: true,
        attention_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// `count` requests of `n` samples, 24 new tokens each; request `id` has a prompt of
/// `base + step · id` tokens.
fn requests_of(count: u64, n: usize, base: usize, step: usize) -> Vec<SampleRequest> {
    (0..count)
        .map(|id| SampleRequest {
            id,
            prompt: (0..base + step * id as usize)
                .map(|i| ((id as usize * 37 + i * 13 + 1) % VOCAB) as u32)
                .collect(),
            n,
            params: SamplingParams {
                max_new_tokens: 24,
                seed: Some(id),
                ..SamplingParams::default()
            },
        })
        .collect()
}

fn requests() -> Vec<SampleRequest> {
    requests_of(6, 4, 5, 11)
}

fn sampler_config(num_blocks: usize, block_size: usize, budget: usize) -> SamplerConfig {
    SamplerConfig {
        num_blocks,
        block_size,
        max_tokens_per_step: budget,
        max_running_seqs: 64,
        seed: 0,
        speculative: None,
    }
}

/// Largest |sampler log-prob − trainer log-prob| over every sampled token.
fn logprob_gap<B: Backend>(
    model: &Transformer<B>,
    requests: &[SampleRequest],
    out: &[Generation],
) -> f64 {
    let mut batch = PackedBatch::default();
    let rows: Vec<_> = out
        .iter()
        .map(|g| {
            let prompt = &requests[g.request_id as usize].prompt;
            let scored = batch.push_sequence(&[&prompt[..], &g.tokens[..]].concat());
            scored.end - g.tokens.len()..scored.end
        })
        .collect();
    let stats = model.forward(&batch, 1.0).unwrap();
    out.iter()
        .zip(rows)
        .flat_map(|(g, rows)| {
            g.logprobs
                .iter()
                .zip(&stats.logprobs[rows])
                .map(|(s, t)| (f64::from(*s) - t).abs())
                .collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
}

/// Fraction of sampled tokens equal between two runs of the same requests.
fn agreement(a: &[Generation], b: &[Generation]) -> f64 {
    let (mut same, mut total) = (0usize, 0usize);
    for (x, y) in a.iter().zip(b) {
        for (s, t) in x.tokens.iter().zip(&y.tokens) {
            same += usize::from(s == t);
            total += 1;
        }
    }
    same as f64 / total as f64
}

fn generate<M: CachedModel>(
    model: &M,
    config: SamplerConfig,
    requests: &[SampleRequest],
) -> Vec<Generation> {
    Sampler::new(model, config)
        .unwrap()
        .generate(model, requests.to_vec())
        .unwrap()
}

#[test]
fn sampler_on_cuda_agrees_with_the_trainer_and_the_cpu() {
    let cuda = match CudaBackend::new(0) {
        Ok(cuda) => Arc::new(cuda),
        Err(e) => {
            eprintln!("skipping the CUDA sampler test: {e}");
            return;
        }
    };
    // Weights 8× the default init so the next-token distributions are peaked: reading a
    // wrong key or value then moves log-probs by far more than bf16 rounding does.
    let cpu_backend = Arc::new(CpuBackend::<f32>::new());
    let mut weights = Transformer::new_random(cpu_backend.clone(), model_config(), 3)
        .unwrap()
        .to_host_weights()
        .unwrap();
    for (name, tensor) in &mut weights {
        if !name.ends_with("norm.weight") {
            tensor.data.iter_mut().for_each(|w| *w *= 8.0);
        }
    }
    let cpu = Transformer::from_host_weights(cpu_backend, model_config(), &weights).unwrap();
    let gpu = Transformer::from_host_weights(cuda, model_config(), &weights).unwrap();
    let requests = requests();

    let roomy = generate(&gpu, sampler_config(256, 16, 4096), &requests);
    // Chunked prefill, shared prompt blocks and preemption.
    let mut tight_sampler = Sampler::new(&gpu, sampler_config(20, 8, 48)).unwrap();
    let tight = tight_sampler.generate(&gpu, requests.clone()).unwrap();
    assert!(tight_sampler.stats().preemptions > 0);
    let on_cpu = generate(&cpu, sampler_config(256, 16, 4096), &requests);

    let roomy_gap = logprob_gap(&gpu, &requests, &roomy);
    let tight_gap = logprob_gap(&gpu, &requests, &tight);
    let cpu_gap = logprob_gap(&cpu, &requests, &on_cpu);
    eprintln!(
        "sampler vs trainer log-prob max |Δ|: cuda {roomy_gap:.2e}, cuda chunked/shared/preempted \
         {tight_gap:.2e}, cpu f32 {cpu_gap:.2e}; tokens equal across batch shapes {:.1}%, \
         cuda vs cpu {:.1}%",
        100.0 * agreement(&roomy, &tight),
        100.0 * agreement(&roomy, &on_cpu)
    );
    assert!(cpu_gap < 1e-3, "cpu: {cpu_gap}");
    assert!(roomy_gap < 0.1, "cuda: {roomy_gap}");
    assert!(tight_gap < 0.1, "cuda, tight: {tight_gap}");

    // Greedy: the GPU's continuations follow the CPU's token for token until a near-tie
    // that bf16 rounding may flip; after one, the two continue from different prefixes.
    let greedy: Vec<SampleRequest> = requests
        .iter()
        .map(|r| SampleRequest {
            n: 1,
            params: SamplingParams {
                temperature: 0.0,
                ..r.params.clone()
            },
            ..r.clone()
        })
        .collect();
    let gpu_greedy = generate(&gpu, sampler_config(256, 16, 4096), &greedy);
    let cpu_greedy = generate(&cpu, sampler_config(256, 16, 4096), &greedy);
    let common_prefix: Vec<usize> = gpu_greedy
        .iter()
        .zip(&cpu_greedy)
        .map(|(g, c)| {
            g.tokens
                .iter()
                .zip(&c.tokens)
                .take_while(|(a, b)| a == b)
                .count()
        })
        .collect();
    let total: usize = cpu_greedy.iter().map(|c| c.tokens.len()).sum();
    let matched: usize = common_prefix.iter().sum();
    eprintln!("greedy: tokens before the first cuda/cpu difference per sequence {common_prefix:?} of {total} in all");
    assert!(
        2 * matched >= total,
        "greedy continuations part early: {common_prefix:?}"
    );

    // Samples of long prompts decode with cascade attention (the prompt's shared keys
    // read once per group): their log-probs still match the trainer's.
    let long = requests_of(2, 8, 600, 77);
    let cascade = generate(&gpu, sampler_config(256, 16, 4096), &long);
    let cascade_gap = logprob_gap(&gpu, &long, &cascade);
    eprintln!("long shared prompts: sampler vs trainer log-prob max |Δ| {cascade_gap:.2e}");
    assert!(cascade_gap < 0.1, "cuda, cascade: {cascade_gap}");
}

/// Mean-NLL gradient of `batch` into `policy`, then one optimizer step.
fn nll_step<B: Backend>(
    policy: &mut floe_engine::policy::Policy<B>,
    batch: &PackedBatch,
) -> floe_engine::policy::StepOutcome {
    let rows = batch.len();
    policy
        .forward_backward(batch, 1.0, &mut |_| {
            Ok((vec![-1.0 / rows as f64; rows], vec![0.0; rows]))
        })
        .unwrap();
    let params = floe_engine::policy::OptimParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        max_grad_norm: 1.0,
    };
    policy.optim_step(&params).unwrap()
}

#[test]
fn the_host_optimizer_on_cuda_updates_as_the_device_optimizer_does() {
    use floe_engine::policy::{OptimizerPlacement, Policy};
    let cuda = match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            eprintln!("skipping the CUDA host-optimizer test: {e}");
            return;
        }
    };
    let model = || Transformer::new_random(Arc::clone(&cuda), model_config(), 3).unwrap();
    let mut device = Policy::new(model());
    let mut host = Policy::new(model());
    host.set_optimizer_placement(OptimizerPlacement::Host)
        .unwrap();
    let batch = PackedBatch::from_sequences(&[
        (1..40).collect::<Vec<u32>>(),
        (7..30).map(|i| i * 3 % VOCAB as u32).collect(),
    ])
    .unwrap();
    let worst_gap = |device: &Policy<CudaBackend>, host: &Policy<CudaBackend>| {
        let device_weights = device.master_weights_to_host().unwrap();
        let host_weights = host.master_weights_to_host().unwrap();
        let mut worst: f64 = 0.0;
        for (name, a) in &device_weights {
            for (x, y) in a.data.iter().zip(&host_weights[name].data) {
                worst = worst.max(f64::from((x - y).abs()));
            }
        }
        worst
    };
    let mut gaps = Vec::new();
    for step in 0..3 {
        let (a, b) = (nll_step(&mut device, &batch), nll_step(&mut host, &batch));
        // The gradients come from bf16 weights that may round differently after a step.
        let rel = (a.grad_norm - b.grad_norm).abs() / a.grad_norm;
        assert!(
            rel < 1e-2,
            "step {step}: grad norms {} vs {}",
            a.grad_norm,
            b.grad_norm
        );
        gaps.push(worst_gap(&device, &host));
    }
    eprintln!("host vs device optimizer on CUDA, max |Δ master weight| after steps 1-3: {gaps:?}");
    // The first step starts from the same weights and gradients: the two placements run
    // one update rule and differ by f32 rounding only (lr 1e-3 moves a weight by ~1e-3).
    assert!(gaps[0] < 1e-6, "step 1: max |Δ| {}", gaps[0]);
    // Later gradients come from bf16 weights that may round apart, and AdamW moves a
    // weight whose gradient is near zero by about lr whatever its size, so such a weight
    // may differ by up to 2 lr a step.
    assert!(gaps[2] < 4e-3, "step 3: max |Δ| {}", gaps[2]);
}

/// One SFT step of `tokens` tokens: the verbs a client's first step calls.
fn sft_step(engine: &mut floe_engine::AnyLocalEngine, tokens: usize) {
    use floe_engine::{Engine, Loss, TrainGroup, TrainResponse};
    let response: Vec<u32> = (0..tokens as u32).map(|i| 2 + i * 7 % 1000).collect();
    let n = response.len();
    let group = TrainGroup {
        prompt: vec![1, 2, 3],
        responses: vec![TrainResponse {
            targets: None,
            tokens: response,
            loss_mask: vec![1.0; n],
            advantages: vec![0.0; n],
            old_logprobs: vec![0.0; n],
            rollout_logprobs: None,
            ref_logprobs: None,
        }],
    };
    engine
        .forward_backward(&[group], &Loss::CrossEntropy, 1.0)
        .unwrap();
    let params = floe_engine::policy::OptimParams {
        lr: 1e-5,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
    };
    engine.optim_step(&params).unwrap();
}

#[test]
fn engines_beside_each_other_are_admitted_only_while_every_step_fits() {
    use floe_engine::{AnyLocalEngine, Device, LocalEngineOptions, ModelSource};
    // Each engine opens its own backend; this one only checks for a GPU.
    if let Err(e) = CudaBackend::new(0).map(|_gpu| ()) {
        eprintln!("skipping the CUDA admission test: {e}");
        return;
    }
    let source = || ModelSource::Random {
        config: ModelConfig::preset("0.6B").unwrap(),
        seed: 1,
    };
    let tokens = 4096;
    let options = |kv_gib: Option<usize>, memory_fraction: f64| LocalEngineOptions {
        device: Device::Cuda(0),
        max_tokens_per_microbatch: tokens,
        kv_cache_bytes: kv_gib.map(|g| g << 30),
        memory_fraction,
        ..LocalEngineOptions::default()
    };
    // Two engines with small KV caches, then one that takes what they leave.
    let mut a = AnyLocalEngine::open(source(), None, options(Some(1), 0.95)).unwrap();
    let mut b = AnyLocalEngine::open(source(), None, options(Some(1), 0.95)).unwrap();
    let mut c = AnyLocalEngine::open(source(), None, options(None, 0.95)).unwrap();
    let reserved = c.memory_plan().reserved_by_others;
    assert_eq!(
        reserved,
        a.memory_plan().per_step_bytes() + b.memory_plan().per_step_bytes()
    );
    eprintln!(
        "third engine: KV cache {:.2} GiB beside {:.2} GiB kept for the others' steps",
        c.memory_plan().kv_cache_bytes().unwrap() as f64 / f64::from(1 << 30),
        reserved as f64 / f64::from(1 << 30)
    );
    // Every engine's step still finds its memory: the others kept it free.
    for engine in [&mut a, &mut b, &mut c] {
        sft_step(engine, tokens - 8);
    }
    // A fourth does not fit, and is refused at creation naming the others.
    let err = AnyLocalEngine::open(source(), None, options(Some(1), 0.95))
        .err()
        .expect("no room for a fourth engine")
        .to_string();
    assert!(err.contains("close other engines"), "{err}");
    // Once one is gone, it fits.
    drop(c);
    let mut d = AnyLocalEngine::open(source(), None, options(Some(1), 0.95)).unwrap();
    sft_step(&mut d, tokens - 8);
}

#[test]
fn overlap_on_two_streams_equals_the_verbs_one_after_the_other() {
    use floe_engine::{
        AnyLocalEngine, Device, Engine, LocalEngineOptions, Loss, ModelSource, SequenceGroup,
        TrainGroup, TrainResponse, Weights,
    };
    if let Err(e) = CudaBackend::new(0).map(|_gpu| ()) {
        eprintln!("skipping the CUDA overlap test: {e}");
        return;
    }
    let open = || {
        let source = ModelSource::Random {
            config: model_config(),
            seed: 3,
        };
        let options = LocalEngineOptions {
            device: Device::Cuda(0),
            kv_cache_bytes: Some(64 << 20),
            ..LocalEngineOptions::default()
        };
        AnyLocalEngine::open(source, None, options).unwrap()
    };
    let response = |r: u32| -> Vec<u32> { (0..40).map(|i| 2 + (i * 7 + r * 13) % 500).collect() };
    let groups = vec![SequenceGroup {
        prompt: (1..30).collect(),
        responses: (0..3).map(response).collect(),
        targets: None,
    }];
    let train = vec![TrainGroup {
        prompt: groups[0].prompt.clone(),
        responses: groups[0]
            .responses
            .iter()
            .map(|tokens| TrainResponse {
                targets: None,
                tokens: tokens.clone(),
                loss_mask: vec![1.0; tokens.len()],
                advantages: vec![0.0; tokens.len()],
                old_logprobs: vec![0.0; tokens.len()],
                rollout_logprobs: None,
                ref_logprobs: None,
            })
            .collect(),
    }];
    let optim = floe_engine::policy::OptimParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
    };
    let collect = |sampled: &mut Vec<Generation>| {
        sampled.sort_by_key(|g| (g.request_id, g.sample_index));
        sampled
            .iter()
            .map(|g| (g.tokens.clone(), g.logprobs.clone()))
            .collect::<Vec<_>>()
    };

    // One after the other, through the plain verbs.
    let mut apart = open();
    let mut sampled_apart = Vec::new();
    apart
        .sample(requests(), &mut |g| sampled_apart.push(g))
        .unwrap();
    let scored_apart = apart.forward(&groups, Weights::Policy, 1.0).unwrap();
    let loss_apart = apart
        .forward_backward(&train, &Loss::CrossEntropy, 1.0)
        .unwrap();
    apart.optim_step(&optim).unwrap();

    // Overlapped: sampling on a second stream and thread, training on this one.
    let mut together = open();
    let (sampled, (scored, loss)) = together
        .overlap(
            |sampler| {
                let mut sampled = Vec::new();
                sampler
                    .sample(requests(), &mut |g| sampled.push(g))
                    .map(|()| sampled)
            },
            |trainer| {
                let scored = trainer.forward(&groups, Weights::Policy, 1.0).unwrap();
                let loss = trainer.forward_backward(&train, &Loss::CrossEntropy, 1.0);
                (scored, loss.unwrap())
            },
        )
        .unwrap();
    // The same kernels on the same inputs: equal bits whichever stream ran them.
    assert_eq!(collect(&mut sampled.unwrap()), collect(&mut sampled_apart));
    assert_eq!(scored, scored_apart);
    assert_eq!(loss, loss_apart);
    // The optimizer step waits for the sampling stream and applies as it does apart.
    together.optim_step(&optim).unwrap();
    assert_eq!(
        together.forward(&groups, Weights::Policy, 1.0).unwrap(),
        apart.forward(&groups, Weights::Policy, 1.0).unwrap()
    );
    // The sampler came back: a plain sample call works after the overlap.
    together.sample(requests(), &mut |_| {}).unwrap();
}
