//! Recipe loading, overrides, error messages, validation and the effective config.

use std::path::Path;

use floe_engine::{Device, NgramSpec, Recompute};
use floe_env::dataset::Row;
use floe_trainer::config::{Config, ConfigError, Logger, Resume, Scheduler, EFFECTIVE_CONFIG_FILE};

fn overrides(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| item.to_string()).collect()
}

fn write_recipe(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn embedded_recipe_loads_and_validates() {
    let config = Config::load(None, &[]).unwrap();
    config.validate().unwrap();
    assert_eq!(config.model.path, "embedded:tiny");
    assert_eq!(config.data.train_data, vec!["synthetic:sql".to_string()]);
    assert!(config.sft.enabled);
    assert_eq!(config.engine.device, Device::Cpu);
}

#[test]
fn example_gpu_recipe_loads_and_validates() {
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes/qwen3-0.6b-bird.toml");
    let config = Config::load(Some(&recipe), &[]).unwrap();
    config.validate().unwrap();
    assert_eq!(config.engine.device, Device::Cuda(0));
    assert_eq!(config.trainer.resume, Resume::Latest);
    assert_eq!(config.trainer.algorithm.eps_clip_high, 0.28);
}

#[test]
fn struct_defaults_follow_skyrl() {
    let config = Config::default();
    assert_eq!(config.trainer.train_batch_size, 1024);
    assert_eq!(config.trainer.policy_mini_batch_size, 256);
    assert_eq!(config.trainer.max_prompt_length, 512);
    assert_eq!(config.trainer.eval_interval, 5);
    assert_eq!(config.trainer.ckpt_interval, 10);
    assert_eq!(config.generator.n_samples_per_prompt, 5);
    assert_eq!(config.generator.sampling_params.max_generate_length, 1024);
    assert_eq!(config.generator.sampling_params.top_k, -1);
    assert_eq!(config.trainer.policy.optimizer_config.lr, 1e-6);
    assert_eq!(config.trainer.policy.optimizer_config.weight_decay, 0.01);
    assert_eq!(config.trainer.policy.optimizer_config.max_grad_norm, 1.0);
    assert!(config.trainer.algorithm.use_kl_loss);
    assert_eq!(config.trainer.algorithm.kl_loss_coef, 0.001);
}

#[test]
fn overrides_apply_in_order_and_parse_toml_values() {
    let config = Config::load(
        None,
        &overrides(&[
            "trainer.train_batch_size=16",
            "generator.n_samples_per_prompt=8",
            "trainer.policy.optimizer_config.lr=3e-5",
            "trainer.policy.optimizer_config.scheduler=cosine",
            "generator.sampling_params.stop=[\"</answer>\", \"\\n\\n\"]",
            "model.path=/data/models/Qwen3-0.6B",
            "trainer.resume=runs/x/global_step_10",
            "engine.device=cuda:1",
            "trainer.logger=tensorboard",
            "trainer.train_batch_size = 32",
        ]),
    )
    .unwrap();
    assert_eq!(config.trainer.train_batch_size, 32);
    assert_eq!(config.generator.n_samples_per_prompt, 8);
    assert_eq!(config.trainer.policy.optimizer_config.lr, 3e-5);
    assert_eq!(
        config.trainer.policy.optimizer_config.scheduler,
        Scheduler::Cosine
    );
    assert_eq!(
        config.generator.sampling_params.stop,
        vec!["</answer>", "\n\n"]
    );
    assert_eq!(config.model.path, "/data/models/Qwen3-0.6B");
    assert_eq!(
        config.trainer.resume,
        Resume::Path("runs/x/global_step_10".into())
    );
    assert_eq!(config.engine.device, Device::Cuda(1));
    assert_eq!(config.trainer.logger, vec![Logger::Tensorboard]);
    // Keys the overrides did not touch keep the recipe's values.
    let recipe = Config::load(None, &[]).unwrap();
    assert_eq!(
        config.trainer.policy_mini_batch_size,
        recipe.trainer.policy_mini_batch_size
    );
}

#[test]
fn integer_given_for_a_float_is_accepted() {
    let config = Config::load(
        None,
        &overrides(&["generator.sampling_params.temperature=1"]),
    )
    .unwrap();
    assert_eq!(config.generator.sampling_params.temperature, 1.0);
}

#[test]
fn unknown_override_key_suggests_the_closest() {
    let err = Config::load(None, &overrides(&["trainer.train_batchsize=16"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown key 'trainer.train_batchsize' (in override #1); did you mean 'trainer.train_batch_size'?"
    );
}

#[test]
fn key_in_the_wrong_section_suggests_where_it_lives() {
    let err = Config::load(
        None,
        &overrides(&["trainer.seed=1", "trainer.n_samples_per_prompt=4"]),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown key 'trainer.n_samples_per_prompt' (in override #2); did you mean 'generator.n_samples_per_prompt'?"
    );
}

#[test]
fn unknown_key_in_a_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = write_recipe(
        dir.path(),
        "r.toml",
        "[generator.sampling_params]\ntemprature = 0.7\n",
    );
    let err = Config::load(Some(&recipe), &[]).unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("unknown key 'generator.sampling_params.temprature' (in "),
        "{message}"
    );
    assert!(message.contains("r.toml"), "{message}");
    assert!(
        message.ends_with("did you mean 'generator.sampling_params.temperature'?"),
        "{message}"
    );
}

#[test]
fn far_off_key_has_no_suggestion() {
    let err = Config::load(None, &overrides(&["wandb.project=x"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown key 'wandb.project' (in override #1)"
    );
}

#[test]
fn type_error_names_key_origin_and_expected_type() {
    let err = Config::load(None, &overrides(&["trainer.train_batch_size=lots"])).unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("bad value for 'trainer.train_batch_size' (in override #1): invalid type: string \"lots\""),
        "{message}"
    );
    assert!(message.contains("expected"), "{message}");

    let dir = tempfile::tempdir().unwrap();
    let recipe = write_recipe(dir.path(), "r.toml", "[engine]\ndevice = \"gpu\"\n");
    let message = Config::load(Some(&recipe), &[]).unwrap_err().to_string();
    assert!(
        message.starts_with("bad value for 'engine.device' (in "),
        "{message}"
    );
    assert!(message.contains("expected `cpu` or `cuda:N`"), "{message}");

    let message = Config::load(
        None,
        &overrides(&["trainer.policy.optimizer_config.scheduler=cosin"]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("'trainer.policy.optimizer_config.scheduler'"),
        "{message}"
    );
    assert!(message.contains("cosine"), "{message}");
}

#[test]
fn recompute_takes_booleans_auto_and_a_layer_count() {
    assert_eq!(Config::default().engine.recompute, Recompute::Auto);
    let recompute = |value: &str| {
        Config::load(None, &overrides(&[&format!("engine.recompute={value}")]))
            .map(|config| config.engine.recompute)
    };
    assert_eq!(recompute("true").unwrap(), Recompute::All);
    assert_eq!(recompute("false").unwrap(), Recompute::None);
    assert_eq!(recompute("auto").unwrap(), Recompute::Auto);
    assert_eq!(recompute("\"auto\"").unwrap(), Recompute::Auto);
    assert_eq!(recompute("10").unwrap(), Recompute::Layers(10));
    let message = recompute("some").unwrap_err().to_string();
    assert!(
        message.starts_with("bad value for 'engine.recompute' (in override #1)"),
        "{message}"
    );
    assert!(
        message.contains("\"auto\" or a number of layers"),
        "{message}"
    );
    let dir = tempfile::tempdir().unwrap();
    let recipe = write_recipe(dir.path(), "r.toml", "[engine]\nrecompute = true\n");
    let config = Config::load(Some(&recipe), &[]).unwrap();
    assert_eq!(config.engine.recompute, Recompute::All);
}

#[test]
fn speculative_ngram_takes_a_draft_length_or_a_table_and_round_trips() {
    assert_eq!(Config::default().engine.speculative_ngram, None);
    let spec = |items: &[&str]| {
        Config::load(None, &overrides(items)).map(|config| config.engine.speculative_ngram)
    };
    assert_eq!(
        spec(&["engine.speculative_ngram=4"]).unwrap(),
        Some(NgramSpec::with_max_draft(4))
    );
    let table = NgramSpec {
        max_draft: 2,
        ngram_max: 4,
        ngram_min: 2,
    };
    assert_eq!(
        spec(&["engine.speculative_ngram={ max_draft = 2, ngram_max = 4, ngram_min = 2 }"])
            .unwrap(),
        Some(table)
    );
    assert_eq!(
        spec(&[
            "engine.speculative_ngram.max_draft=2",
            "engine.speculative_ngram.ngram_max=4",
            "engine.speculative_ngram.ngram_min=2",
        ])
        .unwrap(),
        Some(table)
    );
    let message = spec(&["engine.speculative_ngram={ max_draft = 2, ngram = 2 }"])
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("bad value for 'engine.speculative_ngram.ngram' (in override #1)"),
        "{message}"
    );
    assert!(message.contains("unknown field `ngram`"), "{message}");
    let problems = invalid_messages(&["engine.speculative_ngram={ max_draft = 0 }"]);
    assert!(
        problems[0].starts_with("engine.speculative_ngram.max_draft is 0"),
        "{problems:?}"
    );
    let problems = invalid_messages(&["engine.speculative_ngram={ max_draft = 3, ngram_min = 5 }"]);
    assert!(
        problems[0].contains("engine.speculative_ngram.ngram_min 5 is above ngram_max 3"),
        "{problems:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let config = Config::load(None, &overrides(&["engine.speculative_ngram=3"])).unwrap();
    let path = config.save_effective(&dir.path().join("run")).unwrap();
    assert_eq!(Config::load(Some(&path), &[]).unwrap(), config);
}

#[test]
fn malformed_override_and_toml_are_reported() {
    let err = Config::load(None, &overrides(&["trainer.train_batch_size"])).unwrap_err();
    assert!(matches!(err, ConfigError::OverrideSyntax { .. }), "{err}");
    assert!(err.to_string().contains("is not KEY=VALUE"));

    let dir = tempfile::tempdir().unwrap();
    let recipe = write_recipe(dir.path(), "broken.toml", "[trainer\nseed = 1\n");
    let message = Config::load(Some(&recipe), &[]).unwrap_err().to_string();
    assert!(
        message.contains("broken.toml is not valid TOML"),
        "{message}"
    );

    let missing = dir.path().join("missing.toml");
    let message = Config::load(Some(&missing), &[]).unwrap_err().to_string();
    assert!(message.contains("missing.toml"), "{message}");
}

#[test]
fn later_files_layer_over_earlier_ones() {
    let dir = tempfile::tempdir().unwrap();
    let base = write_recipe(
        dir.path(),
        "base.toml",
        "[trainer]\nseed = 7\ntrain_batch_size = 64\n[data]\ntrain_data = [\"a.parquet\"]\n",
    );
    let top = write_recipe(dir.path(), "top.toml", "[trainer]\ntrain_batch_size = 32\n");
    let config = Config::load_files(&[&base, &top], &overrides(&["trainer.seed=9"])).unwrap();
    assert_eq!(config.trainer.train_batch_size, 32);
    assert_eq!(config.trainer.seed, 9);
    assert_eq!(config.data.train_data, vec!["a.parquet".to_string()]);
    // Unset keys keep struct defaults.
    assert_eq!(config.trainer.policy_mini_batch_size, 256);
}

fn invalid_messages(items: &[&str]) -> Vec<String> {
    let config = Config::load(None, &overrides(items)).unwrap();
    match config.validate() {
        Err(ConfigError::Invalid(problems)) => problems,
        other => panic!("expected an invalid config, got {other:?}"),
    }
}

#[test]
fn batch_sizes_must_divide() {
    let problems = invalid_messages(&[
        "trainer.train_batch_size=10",
        "trainer.policy_mini_batch_size=4",
    ]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with(
            "trainer.train_batch_size (10) is not a multiple of trainer.policy_mini_batch_size (4)"
        ),
        "{problems:?}"
    );
    assert!(problems[0].contains("2 or 5"), "{problems:?}");

    let problems = invalid_messages(&[
        "trainer.policy_mini_batch_size=4",
        "generator.n_samples_per_prompt=4",
        "trainer.micro_train_batch_size_per_gpu=5",
    ]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("(4 × 4 = 16 sequences)"),
        "{problems:?}"
    );
    assert!(
        problems[0].contains("trainer.micro_train_batch_size_per_gpu (5)"),
        "{problems:?}"
    );

    // A token budget replaces the sequence-count rule.
    Config::load(
        None,
        &overrides(&[
            "trainer.micro_train_batch_size_per_gpu=5",
            "trainer.max_tokens_per_microbatch=4096",
        ]),
    )
    .unwrap()
    .validate()
    .unwrap();
}

#[test]
fn teacher_mistakes_are_fractions() {
    let problems = invalid_messages(&[
        "data.synthetic_decision_confusion=1.5",
        "data.synthetic_extra_column=-0.1",
    ]);
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(
        problems[0].contains("data.synthetic_decision_confusion is 1.5"),
        "{problems:?}"
    );
    assert!(
        problems[1].contains("data.synthetic_extra_column is -0.1"),
        "{problems:?}"
    );
}

#[test]
fn kl_placements_are_exclusive() {
    let problems = invalid_messages(&[
        "trainer.algorithm.use_kl_loss=true",
        "trainer.algorithm.use_kl_in_reward=true",
    ]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("use_kl_loss and trainer.algorithm.use_kl_in_reward are both true")
    );
}

#[test]
fn dapo_options_are_off_by_default_and_their_errors_name_the_key() {
    let config = Config::load(None, &[]).unwrap();
    let a = &config.trainer.algorithm;
    assert!(a.dynamic_sampling.kind.is_none());
    assert_eq!(a.overlong_buffer.len, 0);
    assert!(!config.generator.apply_overlong_filtering);

    let config = Config::load(
        None,
        &overrides(&[
            "trainer.algorithm.dynamic_sampling.type=\"filter\"",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=10",
            "trainer.algorithm.overlong_buffer.len=64",
            "trainer.algorithm.overlong_buffer.penalty_factor=1",
            "generator.apply_overlong_filtering=true",
        ]),
    )
    .unwrap();
    config.validate().unwrap();
    assert_eq!(
        config.trainer.algorithm.dynamic_sampling.max_sample_batches,
        10
    );

    let problems = invalid_messages(&[
        "trainer.algorithm.dynamic_sampling.type=\"filter\"",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=0",
        "generator.n_samples_per_prompt=1",
        "trainer.algorithm.advantage_estimator=\"rloo\"",
        "generator.sampling_params.max_generate_length=100",
        "trainer.algorithm.overlong_buffer.len=128",
        "trainer.algorithm.overlong_buffer.penalty_factor=-1",
    ]);
    let has = |needle: &str| problems.iter().any(|p| p.contains(needle));
    assert!(
        has("trainer.algorithm.dynamic_sampling.max_sample_batches is 0"),
        "{problems:?}"
    );
    assert!(
        has("trainer.algorithm.dynamic_sampling.type is set with generator.n_samples_per_prompt = 1"),
        "{problems:?}"
    );
    assert!(
        has("trainer.algorithm.overlong_buffer.len (128) is longer than generator.sampling_params.max_generate_length (100)"),
        "{problems:?}"
    );
    assert!(
        has("trainer.algorithm.overlong_buffer.penalty_factor is -1"),
        "{problems:?}"
    );
    assert_eq!(problems.len(), 4, "{problems:?}");

    let message = Config::load(
        None,
        &overrides(&["trainer.algorithm.dynamic_sampling.type=\"resample\""]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("'trainer.algorithm.dynamic_sampling.type'"),
        "{message}"
    );
    let problems = invalid_messages(&[
        "trainer.algorithm.dynamic_sampling.type=\"replace\"",
        "trainer.algorithm.dynamic_sampling.min_replace_ratio=1.5",
    ]);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("trainer.algorithm.dynamic_sampling.min_replace_ratio is 1.5")),
        "{problems:?}"
    );
    assert!(message.contains("filter"), "{message}");
}

#[test]
fn seq_mean_token_sum_norm_needs_max_seq_len() {
    let problems = invalid_messages(&["trainer.algorithm.loss_reduction=seq_mean_token_sum_norm"]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("set trainer.algorithm.max_seq_len"),
        "{problems:?}"
    );
    Config::load(
        None,
        &overrides(&[
            "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm",
            "trainer.algorithm.max_seq_len=320",
        ]),
    )
    .unwrap()
    .validate()
    .unwrap();
}

#[test]
fn every_broken_rule_is_reported_at_once() {
    let problems = invalid_messages(&[
        "trainer.max_prompt_length=0",
        "generator.sampling_params.top_p=1.5",
        "trainer.policy.optimizer_config.lr=-1",
        "trainer.eval_interval=0",
        "engine.memory_fraction=2.0",
        "engine.zero_stage=3",
    ]);
    let joined = problems.join("\n");
    assert_eq!(problems.len(), 6, "{joined}");
    assert!(joined.contains("engine.zero_stage is 3"));
    assert!(joined.contains("trainer.max_prompt_length is 0"));
    assert!(joined.contains("generator.sampling_params.top_p is 1.5"));
    assert!(joined.contains("trainer.policy.optimizer_config.lr is -1"));
    assert!(joined.contains("trainer.eval_interval is 0; use a positive number, or -1"));
    assert!(joined.contains("engine.memory_fraction is 2"));
}

#[test]
fn a_split_optimizer_state_is_refused_for_lora_adapters() {
    for stage in [1, 2] {
        let zero = format!("engine.zero_stage={stage}");
        let problems = invalid_messages(&["model.lora.rank=8", &zero]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        let named = format!("engine.zero_stage = {stage} with model.lora.rank");
        assert!(problems[0].contains(&named), "{problems:?}");
    }
}

#[test]
fn lengths_must_fit_the_model_context() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 1024}"#,
    )
    .unwrap();
    let model = format!("model.path={}", dir.path().display());
    let problems = invalid_messages(&[
        &model,
        "trainer.max_prompt_length=800",
        "generator.sampling_params.max_generate_length=300",
    ]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("(800 + 300 = 1100) exceeds the model's context of 1024 tokens"),
        "{problems:?}"
    );

    let config = Config::load(None, &[]).unwrap();
    assert!(config.validate_context_length(4096).is_ok());
    let message = config.validate_context_length(128).unwrap_err().to_string();
    assert!(
        message.contains("exceeds the model's context of 128 tokens"),
        "{message}"
    );
}

#[test]
fn effective_config_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::load(
        None,
        &overrides(&[
            "trainer.max_training_steps=3",
            "generator.sampling_params.stop=[\"</sql>\"]",
        ]),
    )
    .unwrap();
    let path = config.save_effective(&dir.path().join("run")).unwrap();
    assert_eq!(path, dir.path().join("run").join(EFFECTIVE_CONFIG_FILE));
    let text = std::fs::read_to_string(&path).unwrap();
    // Every section is spelled out, defaults included.
    for section in [
        "[data]",
        "[trainer.policy.optimizer_config]",
        "[trainer.algorithm]",
        "[generator.eval_sampling_params]",
        "[environment.sql]",
        "[sft]",
    ] {
        assert!(text.contains(section), "{section} missing from\n{text}");
    }
    assert!(text.contains("micro_forward_batch_size_per_gpu"), "{text}");
    let reloaded = Config::load(Some(&path), &[]).unwrap();
    assert_eq!(reloaded, config);
}

#[test]
fn algorithm_section_is_the_rl_crates_config() {
    let config = Config::load(
        None,
        &overrides(&[
            "trainer.algorithm.advantage_estimator=reinforce++",
            "trainer.algorithm.entropy_coeff=0.01",
        ]),
    )
    .unwrap();
    assert_eq!(
        config.trainer.algorithm.advantage_estimator,
        floe_rl::AdvantageEstimator::ReinforcePlusPlus
    );
    assert_eq!(config.trainer.algorithm.entropy_coeff, 0.01);

    let message = Config::load(
        None,
        &overrides(&["trainer.algorithm.advantage_estimator=grpoo"]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        message
            .starts_with("bad value for 'trainer.algorithm.advantage_estimator' (in override #1)"),
        "{message}"
    );
    assert!(message.contains("`grpo`"), "{message}");

    // Rules the rl crate owns come back with the section named.
    let problems = invalid_messages(&["trainer.algorithm.eps_clip_low=1.5"]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with("trainer.algorithm: eps_clip_low must be in [0, 1]"),
        "{problems:?}"
    );
}

#[test]
fn per_database_caps_load_from_a_recipe_and_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = write_recipe(
        dir.path(),
        "caps.toml",
        "[sft]\nenabled = true\nmax_examples = 5\nmax_examples_per_database = { shop = 1 }\n",
    );
    let config = Config::load(
        Some(&recipe),
        &overrides(&["sft.max_examples_per_database.school=0"]),
    )
    .unwrap();
    let caps = config.sft.max_examples_per_database.clone().unwrap();
    assert_eq!((caps["shop"], caps["school"]), (1, 0));

    // Rows in order: the caps skip later shop and every school row, rows without a
    // reference answer are never examples, and max_examples fills up from the rows after
    // them.
    let rows: Vec<Row> = [
        ("shop", true),
        ("school", true),
        ("shop", true),
        ("library", true),
        ("library", false),
        ("library", true),
        ("school", true),
        ("library", true),
        ("library", true),
        ("library", true),
    ]
    .iter()
    .enumerate()
    .map(|(index, &(db, answered))| {
        let mut extra_info = serde_json::Map::new();
        extra_info.insert("db_id".into(), db.into());
        if answered {
            extra_info.insert("reference_answer".into(), "<answer>x</answer>".into());
        }
        Row::new(Vec::new(), "synth_sql", None, None, extra_info, index)
    })
    .collect();
    let mask = config.sft.example_mask(&rows);
    assert_eq!(
        mask,
        [true, false, false, true, false, true, false, true, true, false]
    );
}
