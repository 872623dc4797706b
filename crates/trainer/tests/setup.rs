//! What the trainer builds over the engine: the engine options a recipe implies, and SFT
//! batches whose examples share a prompt prefix.

use floe_engine::policy::OptimParams;
use floe_engine::{
    AnyLocalEngine, Engine, LocalEngineOptions, Loss, ModelSource, TrainGroup, TrainResponse,
};
use floe_model::ModelConfig;
use floe_trainer::setup::engine_options;
use floe_trainer::sft::{shared_prefix_groups, SftExample};

const OPTIM: OptimParams = OptimParams {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.01,
    max_grad_norm: 1.0,
};

/// The embedded model's shape with random weights, on the CPU.
fn engine(seed: u64) -> AnyLocalEngine {
    let options = LocalEngineOptions {
        kv_cache_bytes: Some(4 << 20),
        ..LocalEngineOptions::default()
    };
    let source = ModelSource::Random {
        config: ModelConfig::preset("tiny").unwrap(),
        seed,
    };
    AnyLocalEngine::open(source, None, options).unwrap()
}

/// `len` token ids in `2..64` drawn from `seed`.
fn tokens(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 2 + (seed.wrapping_mul(31).wrapping_add(i * 17) % 62) as u32)
        .collect()
}

#[test]
fn options_from_config_fit_the_longest_sequence() {
    let mut config = floe_trainer::Config::default();
    config.trainer.max_prompt_length = 100;
    config.generator.sampling_params.max_generate_length = 50;
    config.generator.eval_sampling_params.max_generate_length = 20;
    config.trainer.micro_train_batch_size_per_gpu = 4;
    assert_eq!(engine_options(&config).max_tokens_per_microbatch, 4 * 150);
    config.trainer.max_tokens_per_microbatch = 1000;
    assert_eq!(engine_options(&config).max_tokens_per_microbatch, 1000);
    // A budget below one whole sequence is raised to it, so every rollout packs.
    config.trainer.max_tokens_per_microbatch = 10;
    assert_eq!(engine_options(&config).max_tokens_per_microbatch, 150);
}

#[test]
fn sft_groups_sharing_a_prompt_prefix_train_like_single_examples() {
    // Five examples over two "schemas": prompts share a long prefix within a schema.
    let examples: Vec<SftExample> = (0..5u64)
        .map(|i| {
            let mut prompt = tokens(500 + i % 2, 20);
            prompt.extend(tokens(600 + i, 3 + i as usize));
            SftExample {
                prompt,
                answer: tokens(700 + i, 2 + i as usize),
            }
        })
        .collect();
    let shared = shared_prefix_groups(examples.iter());
    assert_eq!(shared.len(), 2, "one group per schema");
    let alone: Vec<TrainGroup> = examples
        .iter()
        .map(|e| TrainGroup {
            prompt: e.prompt.clone(),
            responses: vec![TrainResponse {
                targets: None,
                tokens: e.answer.clone(),
                loss_mask: vec![1.0; e.answer.len()],
                advantages: Vec::new(),
                old_logprobs: Vec::new(),
                rollout_logprobs: None,
                ref_logprobs: None,
            }],
        })
        .collect();
    let mut a = engine(6);
    let mut b = engine(6);
    let out_a = a
        .forward_backward(&alone, &Loss::CrossEntropy, 1.0)
        .unwrap();
    let out_b = b
        .forward_backward(&shared, &Loss::CrossEntropy, 1.0)
        .unwrap();
    assert!(
        (out_a.loss - out_b.loss).abs() <= 1e-5,
        "{} vs {}",
        out_a.loss,
        out_b.loss
    );
    let (step_a, step_b) = (a.optim_step(&OPTIM).unwrap(), b.optim_step(&OPTIM).unwrap());
    let rel = (step_a.grad_norm - step_b.grad_norm).abs() / step_a.grad_norm;
    assert!(
        rel <= 1e-4,
        "grad norms {} vs {}",
        step_a.grad_norm,
        step_b.grad_norm
    );
}

#[test]
fn every_recipe_validates_8b_fits_an_80_gb_card_with_a_host_optimizer_and_32b_lora_an_h200() {
    let recipes = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes");
    for entry in std::fs::read_dir(&recipes).unwrap() {
        let path = entry.unwrap().path();
        let config = floe_trainer::Config::load(Some(&path), &[]).unwrap();
        config
            .validate()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let h100 = Some(80_000_000_000);
    let recipe = recipes.join("qwen3-8b-bird.toml");
    let load = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        floe_trainer::Config::load(Some(&recipe), &overrides).unwrap()
    };
    let config = load(&["model.path=embedded:8B"]);
    let plan = floe_trainer::setup::memory_plan(&config, h100, 1).unwrap();
    plan.check().unwrap();
    assert!(plan.host_bytes() > 0, "{plan}");
    let config = load(&["model.path=embedded:8B", "engine.offload_optimizer=false"]);
    let err = floe_trainer::setup::memory_plan(&config, h100, 1)
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
    assert!(err.contains("set engine.offload_optimizer = true"), "{err}");
    // Split over 8 ranks, the optimizer state fits beside the weights on each card with
    // 12K-token prompts (the full f32 gradients stay: 26 GiB; the recipe's 32K prompts
    // need their activations' room too).
    let config = load(&[
        "model.path=embedded:8B",
        "engine.offload_optimizer=false",
        "engine.zero_stage=1",
        "trainer.max_prompt_length=12288",
        "trainer.max_tokens_per_microbatch=16384",
    ]);
    let plan = floe_trainer::setup::memory_plan(&config, h100, 8).unwrap();
    plan.check().unwrap_or_else(|e| panic!("{e}\n{plan}"));
    assert_eq!(plan.host_bytes(), 0, "{plan}");
    assert!(plan.to_string().contains("1/N shard"), "{plan}");
    let one_rank = floe_trainer::setup::memory_plan(&config, h100, 1).unwrap();
    assert!(one_rank.check().is_err(), "{one_rank}");
    // At stage 1 a refusal names stage 2; at stage 2 the full f32 gradients (26 GiB) give
    // way to one layer's and the embedding's, and a gradient shard.
    let stage_2 = load(&[
        "model.path=embedded:8B",
        "engine.offload_optimizer=false",
        "engine.zero_stage=2",
        "trainer.max_prompt_length=12288",
        "trainer.max_tokens_per_microbatch=16384",
    ]);
    let sharded = floe_trainer::setup::memory_plan(&stage_2, h100, 8).unwrap();
    sharded.check().unwrap_or_else(|e| panic!("{e}\n{sharded}"));
    let shown = sharded.to_string();
    assert!(shown.contains("one layer's gradients + vocab"), "{shown}");
    let freed = plan.device_bytes() - sharded.device_bytes();
    assert!(
        freed > 20 << 30,
        "stage 2 frees {freed} bytes:\n{plan}\n{sharded}"
    );
    let tight = Some(40 << 30);
    let err = floe_trainer::setup::memory_plan(&config, tight, 8)
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("set engine.zero_stage = 2 (each of the 8 ranks"),
        "{err}"
    );
    // Across 8 ranks with the state whole, the refusal names the stage that splits it.
    let config = load(&[
        "model.path=embedded:8B",
        "engine.offload_optimizer=false",
        "trainer.max_prompt_length=12288",
        "trainer.max_tokens_per_microbatch=16384",
    ]);
    let err = floe_trainer::setup::memory_plan(&config, h100, 8)
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("set engine.zero_stage = 1 (each of the 8 ranks"),
        "{err}"
    );

    // 32B: LoRA adapters on a frozen bf16 base fit an H200 (140 GiB as the card reports
    // it); full parameters do not, and the refusal names LoRA.
    let h200 = Some(140 << 30);
    let recipe = recipes.join("qwen3-32b-bird.toml");
    let load = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        floe_trainer::Config::load(Some(&recipe), &overrides).unwrap()
    };
    let plan =
        floe_trainer::setup::memory_plan(&load(&["model.path=embedded:32B"]), h200, 1).unwrap();
    plan.check().unwrap_or_else(|e| panic!("{e}\n{plan}"));
    let config = load(&["model.path=embedded:32B", "model.lora.rank=0"]);
    let err = floe_trainer::setup::memory_plan(&config, h200, 1)
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.lora.rank"), "{err}");
}

#[test]
fn auto_recompute_keeps_the_kv_cache_a_run_samples_with() {
    let recipe =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes/qwen3-1.7b-bird.toml");
    let plan = |overrides: &[&str]| {
        let overrides: Vec<String> = ["model.path=embedded:1.7B", "engine.recompute=auto"]
            .iter()
            .chain(overrides)
            .map(|o| o.to_string())
            .collect();
        let config = floe_trainer::Config::load(Some(&recipe), &overrides).unwrap();
        let plan = floe_trainer::setup::memory_plan(&config, Some(80_000_000_000), 1).unwrap();
        plan.check().unwrap_or_else(|e| panic!("{e}"));
        plan
    };
    // 256 samples at once of up to 36,864 tokens want more KV cache than the card has:
    // every layer is recomputed, as `recompute = true` does.
    let recipe_plan = plan(&[]);
    assert_eq!(recipe_plan.recomputed_layers, 27, "{recipe_plan}");
    // 16 samples of up to 4,096 tokens want 7 GiB: most layers are stored.
    let short = plan(&[
        "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=4",
        "generator.n_samples_per_prompt=4",
        "trainer.eval_batch_size=16",
        "trainer.max_prompt_length=2048",
        "generator.sampling_params.max_generate_length=2048",
        "generator.eval_sampling_params.max_generate_length=2048",
        "trainer.max_tokens_per_microbatch=8192",
    ]);
    assert!(short.recomputed_layers < 27, "{short}");
    assert!(short.kv_cache_bytes().unwrap() >= 16 * 4096 * 2 * 28 * 1024 * 2);
    // On the CPU nothing is recomputed.
    let cpu = floe_trainer::Config::load(None, &[]).unwrap();
    let cpu_plan = floe_trainer::setup::memory_plan(&cpu, None, 1).unwrap();
    assert_eq!(cpu_plan.recomputed_layers, 0);
}

#[test]
fn a_checkpoint_the_disk_cannot_hold_is_refused_naming_the_numbers_and_knobs() {
    use floe_trainer::setup::{check_checkpoint_space, checkpoint_bytes};
    let dir = tempfile::tempdir().unwrap();
    let load = |extra: &[&str]| {
        let mut overrides = vec![
            format!("trainer.run_dir={}", dir.path().display()),
            "model.path=embedded:32B".to_string(),
        ];
        overrides.extend(extra.iter().map(|s| s.to_string()));
        floe_trainer::Config::load(None, &overrides).unwrap()
    };
    // Every parameter (31.2B outside the embeddings, whose vocabulary is the embedded
    // one's 1024 ids) in f32 with two f32 moments: 12 bytes each.
    let full = load(&[]);
    let params = 31_206_298_624u64 + 2 * 1024 * 5120;
    assert_eq!(checkpoint_bytes(&full).unwrap(), 12 * params + (64 << 20));
    // A LoRA checkpoint holds the adapters alone (268M values at rank 32: 3.3 GB).
    let lora = load(&["model.lora.rank=32"]);
    assert!(checkpoint_bytes(&lora).unwrap() * 100 < checkpoint_bytes(&full).unwrap());
    check_checkpoint_space(&full, 1).unwrap();
    let err = check_checkpoint_space(&full, u64::MAX / 4)
        .unwrap_err()
        .to_string();
    for knob in [
        "trainer.run_dir",
        "trainer.max_ckpts_to_keep",
        "model.lora.rank",
        "GB free",
    ] {
        assert!(err.contains(knob), "{knob}: {err}");
    }
}
