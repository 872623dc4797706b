//! The whole pipeline on a very small embedded run: synthetic SQL data, BPE tokenizer,
//! tiny model, SFT, two GRPO steps with evals and checkpoints, report.

use std::path::Path;

use floe_trainer::checkpoint::{load_trainer_state, CHECKPOINTS_DIR, LATEST_FILE};
use floe_trainer::eval_checkpoint::{eval_checkpoint, EvalRequest};
use floe_trainer::outputs::metrics::read_metrics;
use floe_trainer::run::train;
use floe_trainer::setup::TOKENIZER_DIR;
use floe_trainer::Config;

/// The embedded recipe shrunk to seconds on a 2-core CPU.
fn tiny_overrides(run_dir: &Path) -> Vec<String> {
    [
        format!("trainer.run_dir={}", run_dir.display()),
        "data.synthetic_train_size=32".into(),
        "data.synthetic_val_size=8".into(),
        "trainer.max_training_steps=2".into(),
        "trainer.max_prompt_length=1024".into(),
        "trainer.train_batch_size=4".into(),
        "trainer.policy_mini_batch_size=2".into(),
        "trainer.micro_train_batch_size_per_gpu=4".into(),
        "trainer.eval_interval=1".into(),
        "trainer.eval_batch_size=8".into(),
        "trainer.ckpt_interval=1".into(),
        "trainer.max_ckpts_to_keep=1".into(),
        "trainer.logger=[\"tensorboard\"]".into(),
        "generator.n_samples_per_prompt=2".into(),
        "generator.sampling_params.max_generate_length=16".into(),
        "generator.eval_sampling_params.max_generate_length=16".into(),
        "sft.epochs=1".into(),
        "sft.batch_size=8".into(),
    ]
    .into_iter()
    .collect()
}

#[test]
fn embedded_pipeline_writes_metrics_tensorboard_report_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = Config::load(None, &tiny_overrides(&run_dir)).unwrap();
    let outcome = train(&config).unwrap();
    assert_eq!(outcome.steps, 2);
    assert!(outcome.initial_eval.contains_key("eval/all/avg_score"));
    // Synthetic SQL rows report per database (`synth_sql_<db>`) as well as over all.
    assert!(outcome
        .final_eval
        .keys()
        .any(|k| k.starts_with("eval/synth_sql_") && k.ends_with("/accuracy")));

    let records = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let has = |step: u64, name: &str| {
        records
            .iter()
            .any(|r| r.step == step && r.metrics.contains_key(name))
    };
    assert!(has(0, "sft/loss"));
    assert!(has(0, "eval/all/accuracy"));
    for step in [1, 2] {
        for name in [
            "reward/avg_raw_reward",
            "generate/avg_num_tokens",
            "policy/grad_norm",
            "policy/policy_lr",
            "timing/generate",
            "timing/score",
            "timing/fwd_logprobs",
            "timing/train",
            "timing/sync",
            "timing/step",
            "eval/all/avg_score",
            "policy/rollout_train_logprobs_abs_diff_max",
        ] {
            assert!(has(step, name), "step {step} lacks {name}");
        }
    }
    // DAPO's options are off by default and add no metrics.
    for record in &records {
        assert!(
            !record
                .metrics
                .keys()
                .any(|k| k.starts_with("dynamic_sampling/") || k.starts_with("overlong/")),
            "step {}: {:?}",
            record.step,
            record.metrics.keys()
        );
    }
    // The sampler and the trainer score the same tokens under the same weights.
    for record in &records {
        if let Some(diff) = record
            .metrics
            .get("policy/rollout_train_logprobs_abs_diff_max")
        {
            assert!(
                *diff < 1e-3,
                "step {}: sampler and trainer log-probs differ by {diff}",
                record.step
            );
        }
    }

    let events = std::fs::read_dir(run_dir.join("tensorboard"))
        .unwrap()
        .count();
    assert!(events >= 1, "no TensorBoard event file");
    assert!(run_dir.join("report.html").is_file());
    assert!(run_dir.join("evals/global_step_2.jsonl").is_file());
    // Each eval record carries its row's extra_info, to split accuracy by template etc.
    let first_eval = std::fs::read_to_string(run_dir.join("evals/global_step_0.jsonl")).unwrap();
    let record: serde_json::Value =
        serde_json::from_str(first_eval.lines().next().unwrap()).unwrap();
    assert!(
        record["extra_info"]["template"].is_string(),
        "{}",
        record["extra_info"]
    );

    let checkpoints = run_dir.join(CHECKPOINTS_DIR);
    let latest = std::fs::read_to_string(checkpoints.join(LATEST_FILE)).unwrap();
    assert_eq!(latest.trim(), "global_step_2");
    assert!(checkpoints.join("global_step_2/engine").is_dir());
    assert!(
        !checkpoints.join("global_step_1").exists(),
        "max_ckpts_to_keep = 1 keeps only the newest"
    );
    let state = load_trainer_state(&checkpoints.join("global_step_2")).unwrap();
    assert_eq!(state.global_step, 2);
    assert_eq!(state.optimizer_steps, 4, "2 steps × 2 mini-batches");

    // `floe eval` on the run: its latest checkpoint, 2 samples a question at temperature 1.
    let generations = dir.path().join("eval.jsonl");
    let report = eval_checkpoint(&EvalRequest {
        target: run_dir.clone(),
        data: None,
        n: Some(2),
        temperature: Some(1.0),
        out: Some(generations.clone()),
    })
    .unwrap();
    assert!(report.checkpoint.ends_with("global_step_2"));
    assert_eq!(report.num_prompts, 8);
    for key in [
        "eval/all/avg_score",
        "eval/all/accuracy",
        "eval/all/pass_at_1",
        "eval/all/pass_at_2_correct",
    ] {
        assert!(report.metrics.contains_key(key), "floe eval lacks {key}");
    }
    let lines = std::fs::read_to_string(&generations)
        .unwrap()
        .lines()
        .count();
    assert_eq!(lines, 16, "8 questions × 2 samples");
}

#[test]
fn rl_can_leave_out_the_warm_starts_examples() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut overrides = tiny_overrides(&run_dir);
    overrides.extend([
        "trainer.max_training_steps=1".to_string(),
        "trainer.eval_before_train=false".into(),
        "sft.max_examples=8".into(),
        "sft.rl_on_examples=false".into(),
    ]);
    let config = Config::load(None, &overrides).unwrap();
    train(&config).unwrap();

    let records = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let num_train_prompts = records
        .iter()
        .find_map(|r| r.metrics.get("data/num_train_prompts"))
        .copied();
    assert_eq!(
        num_train_prompts,
        Some(24.0),
        "32 prompts less the 8 SFT examples"
    );
    let checkpoints = run_dir.join(CHECKPOINTS_DIR);
    let state = load_trainer_state(&checkpoints.join("global_step_1")).unwrap();
    assert_eq!(state.data_cursor.len, 24);
}

#[test]
fn a_cap_on_a_database_no_row_has_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut overrides = tiny_overrides(&dir.path().join("run"));
    overrides.push("sft.max_examples_per_database.scool=4".into());
    let config = Config::load(None, &overrides).unwrap();
    let err = train(&config).unwrap_err().to_string();
    assert!(err.contains("`scool`") && err.contains("school"), "{err}");
}

#[test]
fn a_lora_run_trains_adapters_checkpoints_only_them_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut overrides = tiny_overrides(&run_dir);
    overrides.extend([
        "trainer.max_training_steps=1".to_string(),
        "trainer.eval_before_train=false".into(),
        "model.lora.rank=4".into(),
        "model.lora.train_unembed=false".into(),
    ]);
    let config = Config::load(None, &overrides).unwrap();
    train(&config).unwrap();
    let engine = run_dir.join(CHECKPOINTS_DIR).join("global_step_1/engine");
    let adapter: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(engine.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(adapter["r"], 4);
    let targets = adapter["target_modules"].to_string();
    assert!(targets.contains("q_proj") && targets.contains("down_proj"));
    assert!(
        !targets.contains("lm_head"),
        "train_unembed=false: {targets}"
    );
    assert!(
        !engine.join("model").exists(),
        "a LoRA checkpoint holds the adapters, not the frozen base"
    );

    // Two steps in all: the run resumes from its step-1 adapters and takes one more.
    // (The embedded recipe starts fresh each time; this run asks to resume.)
    overrides.extend([
        "trainer.max_training_steps=2".into(),
        "trainer.resume=latest".into(),
    ]);
    let outcome = train(&Config::load(None, &overrides).unwrap()).unwrap();
    assert!(outcome.resumed_from.unwrap().ends_with("global_step_1"));
    let records = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    // The SFT warm-up trained the adapters (the untrained model's RL rewards are all
    // zero, so its RL gradients are too); the resumed run logged its second step.
    assert!(records
        .iter()
        .any(|r| r.metrics.get("sft/grad_norm").is_some_and(|g| *g > 0.0)));
    assert!(records.iter().any(|r| r.step == 2));

    // `floe eval` puts the adapters back on the run's base.
    let report = eval_checkpoint(&EvalRequest {
        target: run_dir.clone(),
        data: None,
        n: Some(1),
        temperature: None,
        out: Some(dir.path().join("eval.jsonl")),
    })
    .unwrap();
    assert!(report.checkpoint.ends_with("global_step_2"));
}

#[test]
fn a_folder_with_only_a_config_trains_from_random_weights_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("Qwen3-shape");
    std::fs::create_dir(&model_dir).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/qwen3_tiny/config.json");
    let mut shape: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    shape["max_position_embeddings"] = 2048.into();
    std::fs::write(model_dir.join("config.json"), shape.to_string()).unwrap();

    let run_dir = dir.path().join("run");
    let mut overrides = tiny_overrides(&run_dir);
    overrides.extend([
        format!("model.path={}", model_dir.display()),
        "trainer.max_training_steps=1".into(),
        "trainer.eval_before_train=false".into(),
    ]);
    // Without the option, the missing weights are named with the knob.
    let err = train(&Config::load(None, &overrides).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no model.safetensors") && err.contains("model.random_weights = true"),
        "{err}"
    );

    // With it: the folder's shape over the run's own tokenizer (the folder has none).
    overrides.push("model.random_weights=true".into());
    train(&Config::load(None, &overrides).unwrap()).unwrap();
    assert!(run_dir.join(TOKENIZER_DIR).join("tokenizer.json").is_file());
    let records = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    assert!(records.iter().any(|r| r.step == 1));
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            run_dir
                .join(CHECKPOINTS_DIR)
                .join("global_step_1/engine/model/config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(saved["hidden_size"], 64);
    assert_eq!(saved["num_hidden_layers"], 2);
}

#[test]
fn a_lora_config_that_trains_nothing_is_refused() {
    let overrides = [
        "model.lora.rank=8".to_string(),
        "model.lora.train_attn=false".into(),
        "model.lora.train_mlp=false".into(),
        "model.lora.train_unembed=false".into(),
    ];
    let config = Config::load(None, &overrides).unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("nothing would train"), "{err}");
}

#[test]
fn a_missing_model_folder_is_named_with_the_random_weights_alternative() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("models/Qwen3-32B");
    let mut overrides = tiny_overrides(&dir.path().join("run"));
    overrides.push(format!("model.path={}", missing.display()));
    let config = Config::load(None, &overrides).unwrap();
    // Training and planning (`floe plan`) both stop at the folder, naming it and the way
    // to run its shape without it; training writes nothing first.
    let trained = train(&config).unwrap_err().to_string();
    let planned = floe_trainer::setup::memory_plan(&config, None, 1)
        .unwrap_err()
        .to_string();
    for err in [&trained, &planned] {
        assert!(
            err.contains(&format!("{:?}", missing.display().to_string()))
                && err.contains("no such folder")
                && err.contains("model.path=embedded:<shape>"),
            "{err}"
        );
    }
    assert!(!dir.path().join("run").join("metrics.jsonl").exists());
}

#[test]
fn a_missing_prompt_file_is_named_with_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut overrides = tiny_overrides(&dir.path().join("run"));
    overrides.push("data.val_data=[\"data/bird/dev.parquet\"]".into());
    let err = train(&Config::load(None, &overrides).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("data.val_data: data/bird/dev.parquet: no such file")
            && err.contains("floe data bird"),
        "{err}"
    );
}
