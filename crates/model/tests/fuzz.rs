//! Issue 20: every parser of the model crate that takes outside input, fed random and
//! mutated input. Tokenizer input (any text round-trips through the byte-level BPE, any id
//! list decodes or errs), chat templates (any messages through Qwen3's, any template
//! source), Hugging Face `config.json` (any JSON, valid configs with one key broken) and
//! safetensors (random, truncated and mangled bytes). Each gives a result or an error that
//! names the file or key, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use floe_model::chat_template::{ChatMessage, ChatTemplate, TemplateError};
use floe_model::config::{ConfigError, ModelConfig};
use floe_model::tokenizer::{train_bpe, Tokenizer, QWEN3_SPECIAL_TOKENS, THINK_TOKENS};
use floe_model::weights::{load_model_dir, load_tensors, save_tensors, HostTensor};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Value};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A byte-level BPE trained once on a small mixed corpus, with Qwen3's special tokens.
fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let texts: Vec<String> = (0..200)
            .map(|i| {
                format!(
                    "SELECT name FROM t{i} WHERE city = 'Zürich' -- {i} ∑ 🚀\n\
                     <think>why</think> answer {i}"
                )
            })
            .collect();
        train_bpe(&texts, 400, &QWEN3_SPECIAL_TOKENS).unwrap()
    })
}

/// Text that hits the tokenizer's edges: special and thinking tokens, multibyte and
/// combining characters, control characters, whitespace runs, plus arbitrary text.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("<|im_start|>".to_string()),
        Just("<|im_end|>".to_string()),
        Just("<|endoftext|>".to_string()),
        Just(THINK_TOKENS[0].to_string()),
        Just(THINK_TOKENS[1].to_string()),
        Just("<|im_".to_string()),
        Just("é\u{301}🚀∑\u{200d}\u{feff}".to_string()),
        Just("\r\n\t \u{0}\u{1b}".to_string()),
        Just("    ".to_string()),
        any::<char>().prop_map(String::from),
        ".{0,12}",
    ];
    prop_oneof![
        proptest::collection::vec(piece, 0..12).prop_map(|p| p.concat()),
        any::<String>(),
        proptest::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

/// Any JSON value, at most three levels deep; object keys are often ones that matter.
fn json_value(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(2),
            Just(3),
            Just(u32::MAX as u64 + 1)
        ]
        .prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        ".{0,8}".prop_map(Value::from),
    ];
    let key = prop_oneof![
        3 => proptest::sample::select(keys).prop_map(str::to_string),
        1 => ".{0,6}",
    ];
    leaf.prop_recursive(3, 32, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(key.clone(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

const CONFIG_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_type",
    "type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "role",
    "content",
];

/// A replacement for one value: a plausible edge value or any JSON.
fn replacement() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(3)),
        Just(json!(1.5)),
        Just(json!(1u64 << 40)),
        Just(json!(u64::MAX)),
        Just(json!("x")),
        Just(json!({"rope_type": "llama3", "factor": 8.0})),
        Just(json!(["LlamaForCausalLM"])),
        Just(json!("llama")),
        json_value(CONFIG_KEYS),
    ]
}

// ---------------------------------------------------------------------------------------
// Tokenizer input.

proptest! {
    #![proptest_config(config(512))]

    /// Any text encodes, and decoding gives it back exactly (byte-level BPE, special
    /// tokens kept), with or without the post-processor.
    #[test]
    fn any_text_round_trips_through_the_tokenizer(text in text(), specials in any::<bool>()) {
        let tok = tokenizer();
        let ids = tok.encode(&text, specials).unwrap();
        prop_assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        prop_assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }

    /// Any id list, in or far out of the vocabulary, decodes or errs.
    #[test]
    fn any_ids_decode_or_err(
        ids in proptest::collection::vec(prop_oneof![0u32..420, any::<u32>()], 0..32),
        skip in any::<bool>(),
    ) {
        let tok = tokenizer();
        let _ = tok.decode(&ids, skip);
        for id in ids {
            let _ = tok.id_to_token(id);
        }
    }
}

proptest! {
    #![proptest_config(config(24))]

    /// A `tokenizer.json` with bytes cut off or changed loads or errs naming the file.
    #[test]
    fn mangled_tokenizer_json_errs_naming_the_file(
        at in any::<Index>(),
        byte in any::<u8>(),
        truncate in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        tokenizer().save_dir(dir.path()).unwrap();
        let path = dir.path().join("tokenizer.json");
        let mut bytes = std::fs::read(&path).unwrap();
        let i = at.index(bytes.len());
        if truncate {
            bytes.truncate(i);
        } else {
            bytes[i] = byte;
        }
        std::fs::write(&path, &bytes).unwrap();
        if let Err(err) = Tokenizer::from_dir(dir.path()) {
            prop_assert!(err.to_string().contains("tokenizer.json"), "{}", err);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Chat templates.

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just("system".to_string()),
        Just("user".to_string()),
        Just("assistant".to_string()),
        Just("tool".to_string()),
        ".{0,8}",
    ];
    let content = prop_oneof![
        4 => text().prop_map(Value::from),
        1 => json_value(CONFIG_KEYS),
    ];
    (
        role,
        content,
        proptest::option::of(text()),
        proptest::option::of(json_value(&["name", "arguments", "function"])),
    )
        .prop_map(|(role, content, reasoning, tool_calls)| {
            let mut m = json!({"role": role, "content": content});
            if let Some(r) = reasoning {
                m["reasoning_content"] = r.into();
            }
            if let Some(t) = tool_calls {
                m["tool_calls"] = t;
            }
            m
        })
}

/// Jinja source built from the pieces chat templates use, Python methods included, so
/// many parse and the renderer's built-ins get odd arguments.
fn template_source() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("{{ "),
        Just(" }}"),
        Just("{% "),
        Just(" %}"),
        Just("{#"),
        Just("#}"),
        Just("{%- "),
        Just(" -%}"),
        Just("if "),
        Just("elif "),
        Just("else"),
        Just("endif"),
        Just("for m in messages"),
        Just("endfor"),
        Just("set x = "),
        Just("messages"),
        Just("messages[0]"),
        Just("messages[-1]"),
        Just("m.role"),
        Just("m.content"),
        Just("m['content']"),
        Just("x"),
        Just("loop.index0"),
        Just(".startswith("),
        Just(".endswith(("),
        Just(".split("),
        Just(".rstrip("),
        Just(".strip("),
        Just(".lstrip("),
        Just(".replace("),
        Just(".find("),
        Just(".count("),
        Just(".join("),
        Just(".upper()"),
        Just(".isdigit()"),
        Just(".items()"),
        Just(".get("),
        Just(".keys()"),
        Just(".values()"),
        Just("|tojson"),
        Just("|tojson(indent=2)"),
        Just("|tojson(separators=(',', ':'))"),
        Just("|length"),
        Just("|trim"),
        Just("raise_exception("),
        Just("strftime_now("),
        Just("'%Y-%m-%d'"),
        Just("'%'"),
        Just("'%Q'"),
        Just("''"),
        Just("'\\n'"),
        Just("'<think>'"),
        Just("9223372036854775807"),
        Just("-1"),
        Just("0"),
        Just(", "),
        Just(")"),
        Just("("),
        Just(" + "),
        Just(" ~ "),
        Just(" and "),
        Just(" not "),
        Just(" is defined"),
        Just(" in "),
        Just("add_generation_prompt"),
        Just("tools"),
        Just("enable_thinking"),
        Just("bos_token"),
        Just("ns = namespace(a=1)"),
        Just("ns.a"),
    ];
    prop_oneof![
        4 => proptest::collection::vec(piece, 0..24).prop_map(|p| p.concat()),
        1 => any::<String>(),
    ]
}

proptest! {
    #![proptest_config(config(128))]

    /// Qwen3's template renders any messages and extra variables, or errs naming the
    /// template: a wrong role, a non-string content, an odd `tools`.
    #[test]
    fn qwen3_renders_any_messages_or_errs(
        messages in proptest::collection::vec(message(), 0..5),
        generation in any::<bool>(),
        extra in prop_oneof![
            Just(Value::Null),
            Just(json!({"enable_thinking": false})),
            json_value(&["enable_thinking", "tools", "bos_token", "eos_token", "messages"]),
        ],
    ) {
        let template = ChatTemplate::qwen3();
        if let Err(err) = template.render(&messages, generation, &extra) {
            prop_assert!(matches!(err, TemplateError::Render { .. }), "{}", err);
            prop_assert!(err.to_string().contains("<qwen3>"), "{}", err);
        }
    }

    /// Any template source compiles or errs with a syntax error; one that compiles
    /// renders or errs.
    #[test]
    fn any_template_source_compiles_and_renders_or_errs(
        source in template_source(),
        messages in proptest::collection::vec(message(), 0..3),
    ) {
        match ChatTemplate::from_str(&source) {
            Err(err) => prop_assert!(matches!(err, TemplateError::Syntax { .. }), "{}", err),
            Ok(template) => {
                let typed = [ChatMessage::new("user", "hi")];
                let _ = template.render(&typed, true, &Value::Null);
                if let Err(err) = template.render(&messages, false, &json!({"tools": []})) {
                    prop_assert!(matches!(err, TemplateError::Render { .. }), "{}", err);
                }
            }
        }
    }

    /// A `tokenizer_config.json` of any JSON gives a template or an error naming it.
    #[test]
    fn any_tokenizer_config_gives_a_template_or_names_the_file(
        value in json_value(&["chat_template", "name", "template", "default", "bos_token", "eos_token"]),
        raw in proptest::option::of(".{0,40}"),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, raw.unwrap_or_else(|| value.to_string())).unwrap();
        if let Err(err) = ChatTemplate::from_tokenizer_config(&path) {
            prop_assert!(err.to_string().contains("tokenizer_config.json"), "{}", err);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Hugging Face config.json.

fn fixture_config() -> Map<String, Value> {
    let text = std::fs::read_to_string(fixture("qwen3_tiny/config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Whether `err` points at `key` (or, for the architecture keys, at the architecture).
fn names_key(err: &ConfigError, key: &str) -> bool {
    let text = err.to_string();
    text.contains(&format!("`{key}"))
        || text.contains(&format!("{key}."))
        || text.contains(&format!("{key} "))
        || (matches!(err, ConfigError::UnsupportedArchitecture { .. })
            && ["architectures", "model_type"].contains(&key))
}

/// Found by the property below: a bad value inside `rope_parameters` named only its own
/// key (`rope_type`), not where it sits.
#[test]
fn a_bad_nested_rope_key_is_named_with_its_parent() {
    let mut map = fixture_config();
    map.insert("rope_parameters".into(), json!({ "rope_type": false }));
    let err = ModelConfig::from_hf_json(&Value::Object(map)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "<json>: key `rope_parameters.rope_type`: expected a string, got false"
    );
}

proptest! {
    #![proptest_config(config(512))]

    /// Any JSON parses or errs; a parsed config's tensor list can be built.
    #[test]
    fn any_json_config_parses_or_errs(value in json_value(CONFIG_KEYS)) {
        if let Ok(config) = ModelConfig::from_hf_json(&value) {
            let _ = config.num_parameters();
        }
    }

    /// The fixture's config with one key (top level or inside `rope_parameters`) removed
    /// or replaced parses, or errs naming that key.
    #[test]
    fn a_config_with_one_key_broken_errs_naming_it(
        key in proptest::sample::select(CONFIG_KEYS),
        nested in any::<bool>(),
        value in proptest::option::of(replacement()),
    ) {
        let mut map = fixture_config();
        let target = if nested {
            map.get_mut("rope_parameters").unwrap().as_object_mut().unwrap()
        } else {
            &mut map
        };
        match value {
            Some(v) => target.insert(key.to_string(), v),
            None => target.remove(key),
        };
        let shown = if nested { "rope_parameters" } else { key };
        match ModelConfig::from_hf_json(&Value::Object(map)) {
            Ok(config) => {
                let _ = config.num_parameters();
            }
            Err(err) => {
                prop_assert!(names_key(&err, shown) || names_key(&err, key), "{key}: {}", err);
                prop_assert!(err.to_string().starts_with("<json>"), "{}", err);
            }
        }
    }

    /// A `config.json` of arbitrary bytes errs naming the file.
    #[test]
    fn config_file_of_any_bytes_names_the_file(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, &bytes).unwrap();
        if let Err(err) = ModelConfig::from_hf_file(&path) {
            prop_assert!(err.to_string().contains("config.json"), "{}", err);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Safetensors.

/// A small valid safetensors file (two tensors).
fn small_safetensors() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "a".to_string(),
            HostTensor::new(vec![2, 3], (0..6).map(|x| x as f32).collect()).unwrap(),
        );
        tensors.insert(
            "b.weight".to_string(),
            HostTensor::new(vec![4], vec![1.0; 4]).unwrap(),
        );
        save_tensors(&path, &tensors).unwrap();
        std::fs::read(&path).unwrap()
    })
}

#[derive(Debug, Clone)]
enum Mangle {
    Truncate(Index),
    SetByte(Index, u8),
    /// Replace a byte of the JSON header with a character that changes its meaning.
    Header(Index, char),
}

fn mangle() -> impl Strategy<Value = Mangle> {
    prop_oneof![
        any::<Index>().prop_map(Mangle::Truncate),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mangle::SetByte(i, b)),
        (
            any::<Index>(),
            proptest::sample::select(vec!['9', '0', '"', ',', ']', '}', 'x', '-', '1'])
        )
            .prop_map(|(i, c)| Mangle::Header(i, c)),
    ]
}

fn apply(bytes: &mut Vec<u8>, mangle: &Mangle) {
    match mangle {
        Mangle::Truncate(i) => bytes.truncate(i.index(bytes.len())),
        Mangle::SetByte(i, b) => {
            let i = i.index(bytes.len());
            bytes[i] = *b;
        }
        Mangle::Header(i, c) => {
            let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let i = 8 + i.index(header.min(bytes.len() - 8));
            bytes[i] = *c as u8;
        }
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Arbitrary bytes load as tensors or err naming the file.
    #[test]
    fn any_bytes_load_or_err_naming_the_file(
        bytes in proptest::collection::vec(any::<u8>(), 0..96),
        header in proptest::option::of(0u64..200),
    ) {
        let mut bytes = bytes;
        if let (Some(n), true) = (header, bytes.len() >= 8) {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fuzz.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        if let Err(err) = load_tensors(&path) {
            prop_assert!(err.to_string().contains("fuzz.safetensors"), "{}", err);
        }
    }

    /// A valid file truncated or mangled loads or errs naming the file; what loads is
    /// internally consistent.
    #[test]
    fn mangled_safetensors_load_or_err_naming_the_file(mangle in mangle()) {
        let mut bytes = small_safetensors().to_vec();
        apply(&mut bytes, &mangle);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fuzz.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        match load_tensors(&path) {
            Ok(tensors) => {
                for t in tensors.values() {
                    prop_assert_eq!(t.shape.iter().product::<usize>(), t.data.len());
                }
            }
            Err(err) => prop_assert!(err.to_string().contains("fuzz.safetensors"), "{}", err),
        }
    }
}

proptest! {
    #![proptest_config(config(24))]

    /// The tiny Qwen3 fixture with its weights file mangled loads or errs naming it.
    #[test]
    fn model_dir_with_mangled_weights_errs_naming_the_file(mangle in mangle()) {
        let dir = tempfile::tempdir().unwrap();
        let source = fixture("qwen3_tiny");
        std::fs::copy(source.join("config.json"), dir.path().join("config.json")).unwrap();
        let mut bytes = std::fs::read(source.join("model.safetensors")).unwrap();
        apply(&mut bytes, &mangle);
        std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        if let Err(err) = load_model_dir(dir.path()) {
            prop_assert!(err.to_string().contains("model.safetensors"), "{}", err);
        }
    }
}

/// Found by the fuzzer: `tokenizers` panicked (`expect("Helper")`) on a JSON syntax error
/// inside `tokenizer.json`'s `decoder` object; it is now an error naming the file.
#[test]
fn tokenizer_json_with_a_syntax_error_in_the_decoder_errs_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    tokenizer().save_dir(dir.path()).unwrap();
    let path = dir.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let at = text.find("\"decoder\": {").unwrap() + "\"decoder\": {".len();
    std::fs::write(&path, format!("{}\u{0}{}", &text[..at], &text[at..])).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("not valid JSON"),
        "{err}"
    );
}

/// Found by the fuzzer: a `config.json` whose sizes overflow (`vocab_size` = 2^64 - 1) or
/// whose layer count would take ages to list parsed, then overflowed in
/// `num_parameters`; both are now errors naming the key.
#[test]
fn configs_with_impossible_sizes_err_naming_the_key() {
    for (key, value) in [
        ("vocab_size", json!(u64::MAX)),
        ("intermediate_size", json!(1u64 << 62)),
        ("num_hidden_layers", json!(1u64 << 40)),
    ] {
        let mut map = fixture_config();
        map.insert(key.to_string(), value);
        let err = ModelConfig::from_hf_json(&Value::Object(map)).unwrap_err();
        assert!(err.to_string().contains(&format!("`{key}`")), "{err}");
    }
}
