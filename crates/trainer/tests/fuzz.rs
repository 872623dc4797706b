//! Issue 20: recipes and `KEY=VALUE` overrides fed random and mutated input. Loading gives
//! a config or an error naming the override or file (and the key), and validating any
//! loaded config gives `Ok` or the list of broken rules, never a panic or a hang.

use std::sync::OnceLock;

use floe_trainer::config::{Config, ConfigError, EMBEDDED_RECIPE};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::Value;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Every dotted key of the schema (sections included), read off the defaults.
fn keys() -> &'static [String] {
    static KEYS: OnceLock<Vec<String>> = OnceLock::new();
    KEYS.get_or_init(|| {
        fn walk(prefix: &str, value: &Value, keys: &mut Vec<String>) {
            if let Value::Object(map) = value {
                for (name, child) in map {
                    let key = if prefix.is_empty() {
                        name.clone()
                    } else {
                        format!("{prefix}.{name}")
                    };
                    keys.push(key.clone());
                    walk(&key, child, keys);
                }
            }
        }
        let mut keys = Vec::new();
        walk(
            "",
            &serde_json::to_value(Config::default()).unwrap(),
            &mut keys,
        );
        keys
    })
}

/// A value as typed on a command line or in a recipe: edge numbers, wrong types, TOML
/// syntax errors, arbitrary text.
fn raw_value() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(vec![
            "0", "1", "-1", "-2", "2", "7", "1000000007", "9223372036854775807",
            "18446744073709551615", "-9223372036854775808", "1e400", "-0.0", "nan", "inf",
            "-inf", "1.5", "true", "false", "\"\"", "\"x\"", "[]", "[1, 2]", "[\"\"]",
            "{a = 1}", "{}", "[", "\"", "'", "=", "cuda:99", "cuda:", "embedded:", "latest",
            "none", "grpo", "", "1979-05-27T07:32:00Z", "0x10", "1_000",
        ])
        .prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

/// A key: a real one, a real one with a typo or extra segment, or arbitrary.
fn key() -> impl Strategy<Value = String> {
    let real = any::<Index>().prop_map(|i| keys()[i.index(keys().len())].clone());
    let sizes = proptest::sample::select(vec![
        "trainer.train_batch_size",
        "trainer.policy_mini_batch_size",
        "trainer.micro_train_batch_size_per_gpu",
        "trainer.max_prompt_length",
        "trainer.max_tokens_per_microbatch",
        "trainer.algorithm.max_seq_len",
        "trainer.algorithm.overlong_buffer.len",
        "generator.n_samples_per_prompt",
        "generator.max_input_length",
        "generator.sampling_params.max_generate_length",
    ])
    .prop_map(str::to_string);
    prop_oneof![
        6 => real.clone(),
        3 => sizes,
        1 => (real.clone(), ".{0,3}").prop_map(|(k, s)| format!("{k}{s}")),
        1 => real.prop_map(|k| format!("{k}.x")),
        1 => "[a-z._ ]{0,12}",
        1 => any::<String>(),
    ]
}

fn override_text() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (key(), raw_value()).prop_map(|(k, v)| format!("{k}={v}")),
        1 => any::<String>(),
    ]
}

proptest! {
    #![proptest_config(config(384))]

    /// Any overrides on the embedded recipe load, or err naming the override; a loaded
    /// config validates or lists what is wrong.
    #[test]
    fn any_overrides_load_or_err_naming_the_override(
        overrides in proptest::collection::vec(override_text(), 1..4),
    ) {
        match Config::load(None, &overrides) {
            Ok(config) => {
                let _ = config.validate();
                let _ = config.validate_context_length(2048);
            }
            Err(err) => {
                prop_assert!(!matches!(err, ConfigError::Invalid(_)), "{}", err);
                prop_assert!(err.to_string().contains("override #"), "{}", err);
            }
        }
    }
}

/// The embedded recipe with one line's value replaced, the line removed, or the text cut.
#[derive(Debug, Clone)]
enum Mutation {
    Value(Index, String),
    Remove(Index),
    Truncate(Index),
    Insert(Index, String),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), raw_value()).prop_map(|(i, v)| Mutation::Value(i, v)),
        1 => any::<Index>().prop_map(Mutation::Remove),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => (any::<Index>(), prop_oneof![
            (key(), raw_value()).prop_map(|(k, v)| format!("{k} = {v}")),
            key().prop_map(|k| format!("[{k}]")),
            any::<String>(),
        ])
        .prop_map(|(i, line)| Mutation::Insert(i, line)),
    ]
}

fn mutate(text: &str, mutation: &Mutation) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    match mutation {
        Mutation::Value(i, value) => {
            let with_values: Vec<usize> = (0..lines.len())
                .filter(|&n| lines[n].contains(" = ") && !lines[n].trim_start().starts_with('#'))
                .collect();
            let n = with_values[i.index(with_values.len())];
            let key = lines[n].split(" = ").next().unwrap().to_string();
            lines[n] = format!("{key} = {value}");
        }
        Mutation::Remove(i) => {
            let n = i.index(lines.len());
            lines.remove(n);
        }
        Mutation::Truncate(i) => {
            let cut = text
                .char_indices()
                .map(|(at, _)| at)
                .nth(i.index(text.chars().count().max(1)))
                .unwrap_or(text.len());
            return text[..cut].to_string();
        }
        Mutation::Insert(i, line) => {
            let n = i.index(lines.len() + 1);
            lines.insert(n, line.clone());
        }
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(config(256))]

    /// The embedded recipe, mutated, as a recipe file with an override on top: it loads
    /// or errs naming the file or the override; a loaded one validates or lists problems.
    #[test]
    fn mutated_recipes_load_or_err_naming_the_file(
        mutation in mutation(),
        extra in proptest::option::of(override_text()),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("recipe.toml");
        std::fs::write(&path, mutate(EMBEDDED_RECIPE, &mutation)).unwrap();
        let overrides: Vec<String> = extra.into_iter().collect();
        match Config::load(Some(&path), &overrides) {
            Ok(config) => {
                let _ = config.validate();
            }
            Err(err) => {
                let text = err.to_string();
                prop_assert!(!matches!(err, ConfigError::Invalid(_)), "{}", text);
                prop_assert!(
                    text.contains("recipe.toml") || text.contains("override #")
                        || text.contains("built-in defaults"),
                    "{}", text
                );
            }
        }
    }

    /// Arbitrary text as a recipe loads or errs naming the file.
    #[test]
    fn any_recipe_text_loads_or_errs_naming_the_file(text in any::<String>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("recipe.toml");
        std::fs::write(&path, &text).unwrap();
        match Config::load(Some(&path), &[]) {
            Ok(config) => {
                let _ = config.validate();
            }
            Err(err) => prop_assert!(err.to_string().contains("recipe.toml"), "{}", err),
        }
    }
}

/// Found by the fuzzer: `policy_mini_batch_size × n_samples_per_prompt` overflowed
/// (a panic) and the divisor hint for a huge prime batch size searched for seconds to
/// ages. Both now give a validation message at once.
#[test]
fn huge_batch_sizes_validate_without_overflow_or_stall() {
    for set in [
        [
            "trainer.train_batch_size=9223372036854775807",
            "trainer.policy_mini_batch_size=9223372036854775807",
        ],
        [
            "trainer.train_batch_size=9223372036854775783",
            "trainer.policy_mini_batch_size=2",
        ],
        [
            "trainer.train_batch_size=9223372036854775783",
            "trainer.policy_mini_batch_size=4611686018427387904",
        ],
    ] {
        let overrides: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        let started = std::time::Instant::now();
        let err = Config::load(None, &overrides)
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(
            err.to_string().contains("trainer.policy_mini_batch_size"),
            "{err}"
        );
        assert!(
            started.elapsed().as_secs() < 5,
            "{set:?} took {:?}",
            started.elapsed()
        );
    }
}
