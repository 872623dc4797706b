//! `config.json` parsing and safetensors load/save: round trips, shards, the fixtures
//! transformers wrote, and every error case.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use floe_model::config::{ConfigError, ModelConfig};
use floe_model::weights::{
    load_model_dir, save_model_dir, save_model_dir_sharded, tensor_specs, HostTensor, SaveDType,
    WeightsError,
};
use floe_model::Architecture;
use serde_json::json;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The test shape of `arch` (Qwen2's biases, Qwen3's norms: every optional tensor across
/// the families), tied or not, with a real model's RoPE base, context and special ids
/// (preset `small`'s) for the config files to carry.
fn small_config(arch: Architecture, tie: bool) -> ModelConfig {
    let real = ModelConfig::preset("small").unwrap();
    ModelConfig {
        vocab_size: 40,
        tie_word_embeddings: tie,
        rope_theta: real.rope_theta,
        max_position_embeddings: real.max_position_embeddings,
        bos_token_id: real.bos_token_id,
        eos_token_ids: real.eos_token_ids,
        ..ModelConfig::test_shape(arch)
    }
}

/// Weights with distinct, deterministic values (exactly representable in bf16).
fn weights_for(config: &ModelConfig) -> BTreeMap<String, HostTensor> {
    tensor_specs(config)
        .into_iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|i| ((i * 7 + t * 13) % 64) as f32 / 32.0 - 1.0)
                .collect();
            (name, HostTensor { shape, data })
        })
        .collect()
}

#[test]
fn tensor_specs_follow_hf_names_and_order() {
    let c = small_config(Architecture::Qwen3, false);
    let names: Vec<String> = tensor_specs(&c).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(
        &names[1..11],
        [
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ]
    );
    assert_eq!(names[names.len() - 2], "model.norm.weight");
    assert_eq!(names[names.len() - 1], "lm_head.weight");
    assert_eq!(names.len(), 1 + 2 * 11 + 2);

    let specs: BTreeMap<_, _> = tensor_specs(&c).into_iter().collect();
    assert_eq!(specs["model.layers.1.self_attn.q_proj.weight"], [32, 16]);
    assert_eq!(specs["model.layers.1.self_attn.k_proj.weight"], [16, 16]);
    assert_eq!(specs["model.layers.1.self_attn.o_proj.weight"], [16, 32]);
    assert_eq!(specs["model.layers.1.self_attn.k_norm.weight"], [8]);
    assert_eq!(specs["model.layers.1.mlp.down_proj.weight"], [16, 24]);

    let q2 = small_config(Architecture::Qwen2, true);
    let specs: BTreeMap<_, _> = tensor_specs(&q2).into_iter().collect();
    assert_eq!(specs["model.layers.0.self_attn.q_proj.bias"], [32]);
    assert_eq!(specs["model.layers.0.self_attn.v_proj.bias"], [16]);
    assert!(!specs.contains_key("lm_head.weight"));
    assert!(!specs.contains_key("model.layers.0.self_attn.q_norm.weight"));
}

#[test]
fn presets_have_the_public_shapes() {
    let c = ModelConfig::preset("0.6B").unwrap();
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers),
        (1024, 3072, 28)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (16, 8, 128)
    );
    assert!(c.tie_word_embeddings && c.qk_norm && !c.attention_bias);
    // Qwen3-0.6B has 596,049,920 parameters (tied).
    assert_eq!(c.num_parameters(), 596_049_920);
    let c8 = ModelConfig::preset("8B").unwrap();
    assert!(!c8.tie_word_embeddings);
    // Qwen3-8B: 8,190,735,360 parameters.
    assert_eq!(c8.num_parameters(), 8_190_735_360);
    // Qwen3-32B: 32.8B parameters, 31.2B of them outside the two embeddings.
    let c32 = ModelConfig::preset("32B").unwrap();
    let embeddings = 2 * c32.vocab_size * c32.hidden_size;
    assert_eq!(
        (c32.num_parameters(), c32.num_parameters() - embeddings),
        (32_762_123_264, 31_206_298_624)
    );
    // `tiny` is the default embedded model's shape, `small` the same depth twice as wide.
    let (tiny, small) = (
        ModelConfig::preset("tiny").unwrap(),
        ModelConfig::preset("small").unwrap(),
    );
    assert_eq!(
        (tiny.hidden_size, tiny.head_dim, tiny.vocab_size),
        (128, 32, 1024)
    );
    assert_eq!((small.hidden_size, small.head_dim), (256, 64));
    // The tests' shape: 512 embedding + 2 layers of 2,736 + the final norm's 16.
    let test = ModelConfig::test_shape(Architecture::Qwen3);
    assert_eq!(test.num_parameters(), 6_000);
    let err = ModelConfig::preset("3B").unwrap_err();
    assert!(err.to_string().contains("3B"), "{err}");
}

#[test]
fn parses_the_transformers_5_fixture_configs() {
    let q3 = ModelConfig::from_hf_file(fixture("qwen3_tiny/config.json")).unwrap();
    assert_eq!(q3.architecture, Architecture::Qwen3);
    assert_eq!(
        (q3.head_dim, q3.rope_theta, q3.eos_token_ids.clone()),
        (32, 1e6, vec![2])
    );
    assert!(q3.qk_norm && q3.tie_word_embeddings && !q3.attention_bias);

    let q2 = ModelConfig::from_hf_file(fixture("qwen2_tiny/config.json")).unwrap();
    assert_eq!(q2.architecture, Architecture::Qwen2);
    assert!(q2.attention_bias && !q2.qk_norm);
    assert_eq!((q2.head_dim, q2.bos_token_id), (16, None));
    assert_eq!(q2.eos_token_ids, vec![1, 2]);

    let ll = ModelConfig::from_hf_file(fixture("llama_tiny/config.json")).unwrap();
    let s = ll.rope_scaling.expect("llama3 scaling");
    assert_eq!((s.factor, s.original_max_position_embeddings), (4.0, 32));
    assert_eq!((ll.rms_norm_eps, ll.rope_theta), (1e-5, 10000.0));
}

#[test]
fn parses_transformers_4_style_and_applies_defaults() {
    let v = json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    });
    let c = ModelConfig::from_hf_json(&v).unwrap();
    assert_eq!((c.num_key_value_heads, c.head_dim), (4, 8));
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert_eq!((c.rope_theta, c.max_position_embeddings), (500000.0, 2048));
    assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    assert!(!c.tie_word_embeddings);

    // model_type alone identifies the family.
    let v = json!({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                   "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2});
    let c = ModelConfig::from_hf_json(&v).unwrap();
    assert!(c.attention_bias);
    assert_eq!(c.rope_theta, 10000.0);
}

#[test]
fn to_hf_json_round_trips() {
    for name in ["qwen3_tiny", "qwen2_tiny", "llama_tiny"] {
        let c = ModelConfig::from_hf_file(fixture(&format!("{name}/config.json"))).unwrap();
        let back = ModelConfig::from_hf_json(&c.to_hf_json("float32")).unwrap();
        assert_eq!(back, c, "{name}");
    }
}

#[test]
fn config_errors_name_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let write = |v: serde_json::Value| std::fs::write(&path, v.to_string()).unwrap();

    write(json!({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10}));
    let err = ModelConfig::from_hf_file(&path).unwrap_err();
    assert!(matches!(
        err,
        ConfigError::MissingKey {
            key: "hidden_size",
            ..
        }
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("config.json") && msg.contains("hidden_size"),
        "{msg}"
    );

    write(json!({"architectures": ["MixtralForCausalLM"]}));
    let msg = ModelConfig::from_hf_file(&path).unwrap_err().to_string();
    assert!(
        msg.contains("MixtralForCausalLM") && msg.contains("Qwen3ForCausalLM"),
        "{msg}"
    );

    write(json!({"architectures": ["Qwen3ForCausalLM"], "vocab_size": "many"}));
    let msg = ModelConfig::from_hf_file(&path).unwrap_err().to_string();
    assert!(msg.contains("vocab_size") && msg.contains("many"), "{msg}");

    let base = json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
        "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2});
    let mut yarn = base.clone();
    yarn["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    write(yarn);
    let msg = ModelConfig::from_hf_file(&path).unwrap_err().to_string();
    assert!(
        msg.contains("rope_scaling.rope_type") && msg.contains("yarn"),
        "{msg}"
    );
    let mut gqa = base.clone();
    gqa["num_key_value_heads"] = json!(3);
    let msg = ModelConfig::from_hf_json(&gqa).unwrap_err().to_string();
    assert!(msg.contains("num_key_value_heads"), "{msg}");
    let mut biased = base.clone();
    biased["attention_bias"] = json!(true);
    let msg = ModelConfig::from_hf_json(&biased).unwrap_err().to_string();
    assert!(msg.contains("attention_bias"), "{msg}");
    let mut sliding = base;
    sliding["use_sliding_window"] = json!(true);
    let msg = ModelConfig::from_hf_json(&sliding).unwrap_err().to_string();
    assert!(msg.contains("use_sliding_window"), "{msg}");

    std::fs::write(&path, "{not json").unwrap();
    let msg = ModelConfig::from_hf_file(&path).unwrap_err().to_string();
    assert!(msg.contains("config.json") && msg.contains("JSON"), "{msg}");
    let msg = ModelConfig::from_hf_file(dir.path().join("absent.json"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("absent.json"), "{msg}");
}

#[test]
fn loads_the_fixtures_transformers_saved() {
    for (name, tie) in [
        ("qwen3_tiny", true),
        ("qwen2_tiny", false),
        ("llama_tiny", false),
    ] {
        let (config, weights) = load_model_dir(fixture(name)).unwrap();
        assert_eq!(config.tie_word_embeddings, tie);
        let specs = tensor_specs(&config);
        assert_eq!(weights.len(), specs.len(), "{name}");
        for (tensor, shape) in specs {
            let t = &weights[&tensor];
            assert_eq!(t.shape, shape, "{name} {tensor}");
            assert!(t.data.iter().all(|x| x.is_finite()), "{name} {tensor}");
        }
        // The fixture generator set every norm to 1 + 0.2·noise: values near 1.
        let norm = &weights["model.norm.weight"].data;
        let mean = norm.iter().sum::<f32>() / norm.len() as f32;
        assert!((mean - 1.0).abs() < 0.15, "{name}: mean {mean}");
    }
}

#[test]
fn round_trips_f32_exactly_and_bf16_by_rounding() {
    let dir = tempfile::tempdir().unwrap();
    for arch in Architecture::ALL {
        for tie in [false, true] {
            let config = small_config(arch, tie);
            let mut weights = weights_for(&config);
            save_model_dir(dir.path(), &config, &weights, SaveDType::F32).unwrap();
            let (c2, w2) = load_model_dir(dir.path()).unwrap();
            assert_eq!((&c2, &w2), (&config, &weights), "{arch:?} tie={tie}");

            // A value that bf16 cannot hold comes back rounded to nearest even.
            weights.get_mut("model.norm.weight").unwrap().data[0] = 1.0 + 1.0 / 512.0;
            save_model_dir(dir.path(), &config, &weights, SaveDType::BF16).unwrap();
            let (_, w3) = load_model_dir(dir.path()).unwrap();
            assert_eq!(w3["model.norm.weight"].data[0], 1.0);
            assert_eq!(
                w3["model.embed_tokens.weight"],
                weights["model.embed_tokens.weight"]
            );
        }
    }
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert!(text.contains("\"torch_dtype\": \"bfloat16\""), "{text}");
}

#[test]
fn sharded_round_trip_and_layout_switch() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_config(Architecture::Qwen2, false);
    let weights = weights_for(&config);
    // Single file first, then shards of at most 2 KiB over it: the stale single file
    // must go, or loading would read it instead of the index.
    save_model_dir(dir.path(), &config, &weights, SaveDType::F32).unwrap();
    save_model_dir_sharded(dir.path(), &config, &weights, SaveDType::F32, 2048).unwrap();
    assert!(!dir.path().join("model.safetensors").exists());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() > 2, "{files:?}");
    assert!(files
        .iter()
        .all(|f| f.starts_with("model-") && f.ends_with(".safetensors")));
    let total: usize = tensor_specs(&config)
        .iter()
        .map(|(_, s)| 4 * s.iter().product::<usize>())
        .sum();
    assert_eq!(index["metadata"]["total_size"], json!(total));

    let (c2, w2) = load_model_dir(dir.path()).unwrap();
    assert_eq!((c2, w2), (config.clone(), weights.clone()));

    // And back to one file: the index goes.
    save_model_dir(dir.path(), &config, &weights, SaveDType::F32).unwrap();
    assert!(!dir.path().join("model.safetensors.index.json").exists());
    assert_eq!(load_model_dir(dir.path()).unwrap().1, weights);
}

/// Named raw tensors: (name, dtype, shape, little-endian bytes).
type RawTensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// Writes a raw safetensors file holding `tensors` (name → (dtype, shape, bytes)).
fn write_raw(path: &Path, tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

fn f32_bytes(t: &HostTensor) -> Vec<u8> {
    t.data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn reads_f16_ignores_extras_and_accepts_a_redundant_tied_head() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_config(Architecture::Llama, true);
    let weights = weights_for(&config);
    std::fs::write(
        dir.path().join("config.json"),
        config.to_hf_json("float16").to_string(),
    )
    .unwrap();
    let mut raw: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(n, t)| {
            let bytes = t
                .data
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect();
            (n.as_str(), safetensors::Dtype::F16, t.shape.clone(), bytes)
        })
        .collect();
    let emb = &weights["model.embed_tokens.weight"];
    raw.push((
        "lm_head.weight",
        safetensors::Dtype::F32,
        emb.shape.clone(),
        f32_bytes(emb),
    ));
    raw.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        safetensors::Dtype::F32,
        vec![1],
        vec![0; 4],
    ));
    write_raw(&dir.path().join("model.safetensors"), &raw);
    let (_, loaded) = load_model_dir(dir.path()).unwrap();
    assert_eq!(
        loaded, weights,
        "values in [-1, 1) on a 1/32 grid are exact in f16"
    );
}

#[test]
fn load_errors_name_the_file_and_tensor() {
    let config = small_config(Architecture::Qwen3, false);
    let weights = weights_for(&config);
    let setup = |edit: &dyn Fn(&mut RawTensors)| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            config.to_hf_json("float32").to_string(),
        )
        .unwrap();
        let mut raw: Vec<_> = weights
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    safetensors::Dtype::F32,
                    t.shape.clone(),
                    f32_bytes(t),
                )
            })
            .collect();
        edit(&mut raw);
        let refs: Vec<_> = raw
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
            .collect();
        write_raw(&dir.path().join("model.safetensors"), &refs);
        dir
    };

    let dir = setup(&|raw| raw.retain(|(n, ..)| n != "model.layers.1.mlp.up_proj.weight"));
    let err = load_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, WeightsError::MissingTensor { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("up_proj"),
        "{msg}"
    );

    let dir = setup(&|raw| {
        let t = raw
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        t.2 = vec![8, 2];
    });
    let msg = load_model_dir(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("model.norm.weight") && msg.contains("[8, 2]"),
        "{msg}"
    );

    let dir = setup(&|raw| {
        let t = raw
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        t.1 = safetensors::Dtype::I32;
    });
    let msg = load_model_dir(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("model.norm.weight") && msg.contains("I32"),
        "{msg}"
    );

    let dir = setup(&|_| {});
    std::fs::write(dir.path().join("model.safetensors"), b"garbage").unwrap();
    let msg = load_model_dir(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");

    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, WeightsError::NoWeights { .. }), "{err}");

    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map": 3}"#,
    )
    .unwrap();
    let msg = load_model_dir(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("index.json") && msg.contains("weight_map"),
        "{msg}"
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.embed_tokens.weight": "model-1.safetensors"}}"#,
    )
    .unwrap();
    let msg = load_model_dir(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("index.json") && msg.contains("input_layernorm"),
        "{msg}"
    );

    let msg = load_model_dir(dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("nowhere") && msg.contains("config.json"),
        "{msg}"
    );
}

#[test]
fn save_rejects_missing_or_misshapen_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_config(Architecture::Qwen3, true);
    let mut weights = weights_for(&config);
    weights.remove("model.layers.0.self_attn.k_norm.weight");
    let msg = save_model_dir(dir.path(), &config, &weights, SaveDType::F32)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("k_norm"), "{msg}");
    let mut weights = weights_for(&config);
    weights.get_mut("model.norm.weight").unwrap().shape = vec![15];
    let msg = save_model_dir(dir.path(), &config, &weights, SaveDType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("model.norm.weight") && msg.contains("[15]"),
        "{msg}"
    );
    assert!(!dir.path().join("config.json").exists());
}

#[test]
fn named_tensor_files_round_trip() {
    use floe_model::weights::{load_tensors, save_tensors};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moments.safetensors");
    let tensors: BTreeMap<String, HostTensor> = [
        (
            "m.a".to_string(),
            HostTensor::new(vec![2, 3], (0..6).map(|i| i as f32 * 0.1).collect()).unwrap(),
        ),
        (
            "v.b".to_string(),
            HostTensor::new(vec![1], vec![f32::MIN_POSITIVE]).unwrap(),
        ),
    ]
    .into_iter()
    .collect();
    save_tensors(&path, &tensors).unwrap();
    assert_eq!(load_tensors(&path).unwrap(), tensors);

    let bad: BTreeMap<String, HostTensor> = [(
        "m.c".to_string(),
        HostTensor {
            shape: vec![4],
            data: vec![0.0; 3],
        },
    )]
    .into_iter()
    .collect();
    let msg = save_tensors(&path, &bad).unwrap_err().to_string();
    assert!(msg.contains("m.c"), "{msg}");
    let msg = load_tensors(dir.path().join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("absent.safetensors"), "{msg}");
}

#[test]
fn parses_a_published_qwen3_4b_config() {
    // The keys and values of Qwen3-4B's config.json as transformers 4.51 wrote it.
    let v = json!({
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
        "initializer_range": 0.02, "intermediate_size": 9728,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936
    });
    let c = ModelConfig::from_hf_json(&v).unwrap();
    assert_eq!(c, ModelConfig::preset("4B").unwrap());
    assert_eq!(c.num_parameters(), 4_022_468_096);
}
