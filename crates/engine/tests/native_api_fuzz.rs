//! Issue 20: the native API's JSON body types (`floe_engine::native_api`) fed arbitrary
//! JSON and bytes: each parses or errs, never panics, and what parses serializes again.

use floe_engine::native_api::*;
use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// Field and variant names of the native types and of the engine types inside them.
const KEYS: &[&str] = &[
    "base_model",
    "done",
    "embedded",
    "error",
    "generation",
    "engine_id",
    "export_id",
    "files",
    "grad_norm",
    "groups",
    "info",
    "loss",
    "max_tokens_per_microbatch",
    "metrics",
    "model",
    "models",
    "name",
    "outputs",
    "recompute",
    "requests",
    "seconds",
    "seed",
    "server",
    "settings",
    "skipped",
    "state_id",
    "step",
    "temperature",
    "tokenizer_files",
    "version",
    "weights",
    "id",
    "prompt",
    "n",
    "params",
    "responses",
    "targets",
    "policy",
    "reference",
    "cross_entropy",
    "tinker",
    "bytes",
    "path",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "tokens",
    "logprobs",
    "advantages",
    "rewards",
    "loss_fn",
    "kind",
    "lora",
    "rank",
    "alpha",
    "device",
    "type",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        Just(json!(1e300)),
        Just(json!("NaN")),
        Just(json!("-Infinity")),
        ".{0,6}".prop_map(Value::from),
        proptest::sample::select(KEYS).prop_map(Value::from),
    ];
    let key = prop_oneof![
        4 => proptest::sample::select(KEYS).prop_map(str::to_string),
        1 => ".{0,6}",
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(key.clone(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn parse<T: DeserializeOwned + Serialize>(value: &Value, text: &[u8]) {
    if let Ok(parsed) = serde_json::from_value::<T>(value.clone()) {
        let _ = serde_json::to_string(&parsed);
    }
    let _ = serde_json::from_slice::<T>(text);
}

fn parse_all(value: &Value, text: &[u8]) {
    parse::<ServerInfo>(value, text);
    parse::<ModelSpec>(value, text);
    parse::<EngineSettings>(value, text);
    parse::<CreateEngineRequest>(value, text);
    parse::<CreateEngineResponse>(value, text);
    parse::<SampleBody>(value, text);
    parse::<SampleEvent>(value, text);
    parse::<ForwardBody>(value, text);
    parse::<ForwardResponse>(value, text);
    parse::<ForwardBackwardBody>(value, text);
    parse::<ForwardBackwardResponse>(value, text);
    parse::<OptimStepResponse>(value, text);
    parse::<SyncResponse>(value, text);
    parse::<SaveStateResponse>(value, text);
    parse::<LoadStateBody>(value, text);
    parse::<ExportResponse>(value, text);
    parse::<ExportedFile>(value, text);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any JSON value, and any bytes, into every native body type.
    #[test]
    fn native_bodies_parse_any_json_or_err(
        value in json_value(),
        bytes in proptest::collection::vec(any::<u8>(), 0..48),
    ) {
        parse_all(&value, &bytes);
        parse_all(&value, value.to_string().as_bytes());
    }
}
