//! LocalEngine with LoRA policies on the CPU: engines built from one [`SharedBase`] read
//! one copy of the base and train their adapters apart; the merged export computes what
//! the adapters compute; a LoRA state restores onto its base and never onto trained
//! full weights.

use floe_engine::policy::OptimParams;
use floe_engine::{
    AdapterSource, AnyLocalEngine, LocalEngine, LocalEngineOptions, ModelSource, SharedBase,
};
use floe_engine::{Engine, Loss, SequenceGroup, TrainGroup, TrainResponse, Weights};
use floe_model::lora::LoraConfig;
use floe_model::weights::{load_model_dir, SaveDType};

use floe_backend::cpu::CpuBackend;

mod support;
use support::tiny_config;

fn options() -> LocalEngineOptions {
    LocalEngineOptions {
        kv_cache_bytes: Some(4 << 20),
        export_dtype: SaveDType::F32,
        ..LocalEngineOptions::default()
    }
}

fn random_base() -> ModelSource {
    ModelSource::Random {
        config: tiny_config(),
        seed: 5,
    }
}

fn lora_on(base: ModelSource, rank: usize) -> ModelSource {
    ModelSource::Lora {
        base: Box::new(base),
        adapters: AdapterSource::Fresh(LoraConfig::new(rank)),
    }
}

fn cpu(engine: &AnyLocalEngine) -> &LocalEngine<CpuBackend> {
    match engine {
        AnyLocalEngine::Cpu(e) => e,
        AnyLocalEngine::Cuda(_) => unreachable!("the tests run on the CPU"),
    }
}

const OPTIM: OptimParams = OptimParams {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.0,
    max_grad_norm: 1.0,
};

fn train_group() -> TrainGroup {
    let tokens = vec![7, 9, 11, 13, 15, 17];
    TrainGroup {
        prompt: vec![3, 5],
        responses: vec![TrainResponse {
            targets: None,
            loss_mask: vec![1.0; tokens.len()],
            advantages: vec![0.0; tokens.len()],
            old_logprobs: vec![0.0; tokens.len()],
            rollout_logprobs: None,
            ref_logprobs: None,
            tokens,
        }],
    }
}

/// The engine's log-probs of the training group's response.
fn scores(engine: &mut AnyLocalEngine) -> Vec<f64> {
    let group = train_group();
    let sequences = SequenceGroup {
        targets: None,
        prompt: group.prompt,
        responses: vec![group.responses[0].tokens.clone()],
    };
    let out = engine.forward(&[sequences], Weights::Policy, 1.0).unwrap();
    out[0][0].logprobs.clone()
}

fn step(engine: &mut AnyLocalEngine) -> f64 {
    let out = engine
        .forward_backward(&[train_group()], &Loss::CrossEntropy, 1.0)
        .unwrap();
    engine.optim_step(&OPTIM).unwrap();
    out.loss
}

#[test]
fn lora_engines_share_one_base_and_train_apart() {
    let shared = SharedBase::new(random_base());
    let source = || lora_on(ModelSource::Shared(shared.clone()), 4);
    let mut first = AnyLocalEngine::open(source(), None, options()).unwrap();
    let mut second = AnyLocalEngine::open(source(), None, options()).unwrap();
    let base = cpu(&first).policy().model().to_host_weights().unwrap();
    assert!(cpu(&first).policy().model().base_is_shared());
    let untouched = scores(&mut second);
    assert_eq!(
        scores(&mut first),
        untouched,
        "fresh adapters equal the base"
    );

    let losses: Vec<f64> = (0..4).map(|_| step(&mut first)).collect();
    assert!(losses[3] < losses[0], "{losses:?}");
    assert_ne!(scores(&mut first), untouched);
    assert_eq!(
        scores(&mut second),
        untouched,
        "the other session is unchanged"
    );
    assert_eq!(
        cpu(&second).policy().model().to_host_weights().unwrap(),
        base
    );
}

#[test]
fn a_lora_export_is_the_merged_model() {
    let mut engine = AnyLocalEngine::open(lora_on(random_base(), 4), None, options()).unwrap();
    for _ in 0..3 {
        step(&mut engine);
    }
    let dir = tempfile::tempdir().unwrap();
    engine.export_hf(dir.path()).unwrap();
    let (config, _) = load_model_dir(dir.path()).unwrap();
    assert!(
        !config.tie_word_embeddings,
        "the unembed adapter unties the head"
    );
    let mut merged =
        AnyLocalEngine::open(ModelSource::Dir(dir.path().into()), None, options()).unwrap();
    for (m, a) in scores(&mut merged).iter().zip(scores(&mut engine)) {
        assert!((m - a).abs() < 1e-5, "merged {m} vs adapters {a}");
    }
}

#[test]
fn a_lora_state_restores_onto_its_base_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = AnyLocalEngine::open(lora_on(random_base(), 2), None, options()).unwrap();
    step(&mut engine);
    engine.save_state(dir.path()).unwrap();
    let mut restored = AnyLocalEngine::open(random_base(), None, options()).unwrap();
    restored.load_state(dir.path()).unwrap();
    assert_eq!(scores(&mut restored), scores(&mut engine));
    assert_eq!(
        step(&mut restored),
        step(&mut engine),
        "it continues identically"
    );

    let mut trained = AnyLocalEngine::open(random_base(), None, options()).unwrap();
    step(&mut trained);
    let err = trained.load_state(dir.path()).unwrap_err();
    assert!(err.to_string().contains("LoRA adapters"), "{err}");
}
