//! Issue 20: every route of `floe serve`, Tinker and native, fed random bytes and valid
//! requests with one field replaced by a random JSON value, dropped, or (protobuf) with
//! its bytes mangled.
//! Each answer is an HTTP status below 500 carrying a `detail` that says what is wrong,
//! never a panic or a server error, and the server still trains afterwards.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::*;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};

/// Tinker routes that take a JSON body (`forward_backward` takes protobuf, fuzzed apart).
const JSON_ROUTES: &[&str] = &[
    "client/config",
    "client/dynamic_config",
    "create_session",
    "session_heartbeat",
    "telemetry",
    "create_model",
    "get_info",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "asample",
    "retrieve_future",
    "retrieve_futures",
    "cancel_future",
    "weights_info",
];

/// Verbs of floe's native API (`/floe/v1/engines/{id}/VERB`) that take a JSON body.
const NATIVE_VERBS: &[&str] = &[
    "sample",
    "forward",
    "forward_backward",
    "forward_backward_policy",
    "optim_step",
    "load_state",
];

/// One server for every case, with a session, a LoRA model on the tiny base with saved
/// weights `fuzz`, a sampling session, a finished request and a native engine.
struct Fixture {
    addr: SocketAddr,
    session_id: String,
    model_id: String,
    sampler_id: String,
    finished_request: String,
    engine_id: String,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        // The server outlives every test of this binary: its data stays in the temp dir.
        let dir = Box::leak(Box::new(tempfile::tempdir().unwrap()));
        let addr = start(config(dir.path()));
        let (session_id, model_id) = create_model(addr);
        let save = json!({"model_id": model_id, "path": "fuzz", "seq_id": 1, "type": "save_weights"});
        let finished_request = request_id(&post_json(addr, "save_weights", &save));
        let saved = retrieve(addr, &finished_request).json();
        assert!(saved.get("error").is_none(), "{saved}");
        let sampling = post_json(
            addr,
            "create_sampling_session",
            &json!({"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}),
        );
        let sampler_id = sampling.json()["sampling_session_id"]
            .as_str()
            .unwrap()
            .to_string();
        let engine = post_native(addr, "/engines", &json!({"model": {"base_model": BASE_MODEL}}));
        assert_eq!(engine.status, 200, "{}", String::from_utf8_lossy(&engine.body));
        let engine_id = engine.json()["engine_id"].as_str().unwrap().to_string();
        Fixture {
            addr,
            session_id,
            model_id,
            sampler_id,
            finished_request,
            engine_id,
        }
    })
}

/// A valid JSON body of each route in [`JSON_ROUTES`] (the seq ids far ahead, so that a
/// mutated request never runs before the fixture's own).
fn template(route: &str, f: &Fixture) -> Value {
    let (session, model) = (f.session_id.as_str(), f.model_id.as_str());
    let path = format!("tinker://{model}/weights/fuzz");
    match route {
        "create_session" => {
            json!({"tags": [], "user_metadata": {}, "sdk_version": "fuzz", "type": "create_session"})
        }
        "session_heartbeat" => json!({"session_id": session, "type": "session_heartbeat"}),
        "create_model" => json!({
            "session_id": session, "model_seq_id": 1000, "base_model": BASE_MODEL,
            "lora_config": {"rank": 4}, "type": "create_model"
        }),
        "get_info" => json!({"model_id": model, "type": "get_info"}),
        "optim_step" => {
            let mut body = optim_body(model, 100_001);
            body["adam_params"]["learning_rate"] = json!(0.0);
            body
        }
        "save_weights" | "save_weights_for_sampler" => {
            json!({"model_id": model, "path": "fuzz", "seq_id": 100_002, "type": route})
        }
        "load_weights" => {
            json!({"model_id": model, "path": path, "seq_id": 100_003, "optimizer": false})
        }
        "create_sampling_session" => json!({
            "session_id": session, "sampling_session_seq_id": 1000, "base_model": BASE_MODEL
        }),
        "asample" => json!({
            "sampling_session_id": f.sampler_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 1.0, "stop": []},
            "type": "sample"
        }),
        "retrieve_future" | "cancel_future" => json!({"request_id": f.finished_request}),
        "retrieve_futures" => json!({
            "target": {"type": "sampling_session", "sampling_session_id": f.sampler_id},
            "prev_cursor": 0, "timeout": 0.0
        }),
        "weights_info" => json!({"tinker_path": path}),
        _ => json!({}),
    }
}

/// POSTs JSON to a native route (`path` under `/floe/v1`) with the test key.
fn post_native(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(
        addr,
        "POST",
        &format!("/floe/v1{path}"),
        &[("X-API-Key", KEY), ("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// The route of a [`NATIVE_VERBS`] entry (two bodies share `forward_backward`).
fn native_route(verb: &str) -> &str {
    verb.strip_suffix("_policy").unwrap_or(verb)
}

/// A valid body of each native verb in [`NATIVE_VERBS`] (the optimizer's rate 0, so the
/// engine's weights never change).
fn native_template(verb: &str) -> Value {
    let response = json!({
        "tokens": [13, 14], "loss_mask": [1.0, 1.0], "advantages": [0.5, -0.5],
        "old_logprobs": [-1.0, -1.0], "rollout_logprobs": null, "ref_logprobs": null
    });
    match verb {
        "sample" => json!({"requests": [{
            "id": 1, "prompt": [11, 12], "n": 2,
            "params": {"temperature": 1.0, "max_new_tokens": 3, "seed": 5}
        }]}),
        "forward" => json!({
            "groups": [{"prompt": [11, 12], "responses": [[13, 14], [15]]}],
            "weights": "Policy", "temperature": 1.0
        }),
        "forward_backward_policy" => json!({
            "groups": [{"prompt": [11, 12], "responses": [response]}],
            "loss": {"Policy": {
                "policy_loss_type": "regular", "eps_clip_low": 0.2, "eps_clip_high": 0.28,
                "clip_ratio_c": 3.0, "loss_reduction": "token_mean", "use_kl_loss": false,
                "entropy_coeff": 0.0, "max_seq_len": 64
            }},
            "temperature": 1.0
        }),
        "forward_backward" => json!({
            "groups": [{"prompt": [11, 12], "responses": [response]}],
            "loss": {"Tinker": {"loss": "ppo", "clip_low_threshold": 0.8, "clip_high_threshold": 1.2}},
            "temperature": 1.0
        }),
        "optim_step" => json!({
            "lr": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
            "max_grad_norm": 1.0
        }),
        "load_state" => json!({"state_id": "state-none"}),
        _ => json!({}),
    }
}

/// Any JSON value, two levels deep at most.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        "\\PC{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Paths (object keys and array indices) to every value inside `value`.
fn paths(value: &Value, prefix: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                prefix.push(json!(key));
                out.push(prefix.clone());
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                prefix.push(json!(i));
                out.push(prefix.clone());
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

/// `body` with the value at `path` replaced by `new`, or removed when `new` is `None`.
fn mutate(mut body: Value, path: &[Value], new: Option<Value>) -> Value {
    let (last, parents) = path.split_last().expect("a non-empty path");
    let mut at = &mut body;
    for step in parents {
        at = match step {
            Value::String(key) => &mut at[key.as_str()],
            index => &mut at[index.as_u64().unwrap() as usize],
        };
    }
    match (last, new) {
        (Value::String(key), Some(new)) => at[key.as_str()] = new,
        (Value::String(key), None) => {
            at.as_object_mut().unwrap().remove(key);
        }
        (index, Some(new)) => at[index.as_u64().unwrap() as usize] = new,
        (index, None) => {
            at.as_array_mut()
                .unwrap()
                .remove(index.as_u64().unwrap() as usize);
        }
    }
    body
}

/// The answer is a client error or success, and an error says what is wrong.
fn assert_handled(reply: &Reply, what: &str) {
    assert!(
        reply.status < 500,
        "{what}: HTTP {}: {}",
        reply.status,
        String::from_utf8_lossy(&reply.body)
    );
    if reply.status >= 400 {
        let detail = serde_json::from_slice::<Value>(&reply.body)
            .ok()
            .and_then(|v| v["detail"].as_str().map(str::to_string));
        assert!(
            detail.is_some_and(|d| !d.is_empty()),
            "{what}: HTTP {} without a detail: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_bytes_on_any_route_are_client_errors(
        route in prop::sample::select(JSON_ROUTES),
        body in prop::collection::vec(any::<u8>(), 0..512),
        proto in any::<bool>(),
    ) {
        let f = fixture();
        let reply = if proto {
            post_proto(f.addr, route, &body)
        } else {
            request(
                f.addr,
                "POST",
                &format!("/api/v1/{route}"),
                &[("X-API-Key", KEY), ("Content-Type", "application/json")],
                &body,
            )
        };
        assert_handled(&reply, route);
    }

    #[test]
    fn valid_requests_with_one_field_changed_are_answered_cleanly(
        route in prop::sample::select(JSON_ROUTES),
        which in any::<Index>(),
        new in prop::option::weighted(0.8, json_value()),
    ) {
        let f = fixture();
        let body = template(route, f);
        let mut all = Vec::new();
        paths(&body, &mut Vec::new(), &mut all);
        prop_assume!(!all.is_empty());
        let path = which.get(&all).clone();
        let body = mutate(body, &path, new);
        assert_handled(&post_json(f.addr, route, &body), &format!("{route} {body}"));
    }

    #[test]
    fn mangled_protobuf_forward_backward_is_a_client_error(
        flips in prop::collection::vec((any::<Index>(), any::<u8>()), 1..6),
        cut in any::<Index>(),
        truncate in any::<bool>(),
    ) {
        let f = fixture();
        let mut body = fwdbwd_body(&f.model_id, 200_000, true);
        for (at, byte) in flips {
            let i = at.index(body.len());
            body[i] = byte;
        }
        if truncate {
            body.truncate(cut.index(body.len()));
        }
        assert_handled(&post_proto(f.addr, "forward_backward", &body), "protobuf forward_backward");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn native_verbs_answer_random_and_mutated_bodies_cleanly(
        verb in prop::sample::select(NATIVE_VERBS),
        which in any::<Index>(),
        new in prop::option::weighted(0.8, json_value()),
        bytes in prop::option::weighted(0.2, prop::collection::vec(any::<u8>(), 0..256)),
    ) {
        let f = fixture();
        let path = format!("/engines/{}/{}", f.engine_id, native_route(verb));
        let reply = match bytes {
            Some(bytes) => request(
                f.addr,
                "POST",
                &format!("/floe/v1{path}"),
                &[("X-API-Key", KEY), ("Content-Type", "application/json")],
                &bytes,
            ),
            None => {
                let body = native_template(verb);
                let mut all = Vec::new();
                paths(&body, &mut Vec::new(), &mut all);
                let path_in_body = which.get(&all).clone();
                post_native(f.addr, &path, &mutate(body, &path_in_body, new))
            }
        };
        assert_handled(&reply, &path);
    }
}

#[test]
fn the_unchanged_native_bodies_are_accepted() {
    let f = fixture();
    for verb in NATIVE_VERBS.iter().filter(|v| **v != "load_state") {
        let reply = post_native(
            f.addr,
            &format!("/engines/{}/{}", f.engine_id, native_route(verb)),
            &native_template(verb),
        );
        assert_eq!(
            reply.status,
            200,
            "{verb}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
}

#[test]
fn the_server_still_trains_after_the_fuzzing() {
    // Runs in the same process as the fuzz tests (in any order); a fresh model on the
    // same server must still take a step.
    let f = fixture();
    let (_session, model_id) = create_model(f.addr);
    let id = request_id(&post_proto(
        f.addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 0, false),
    ));
    assert_eq!(retrieve(f.addr, &id).status, 200);
    let step = request_id(&post_json(f.addr, "optim_step", &optim_body(&model_id, 1)));
    assert_eq!(retrieve(f.addr, &step).status, 200);
}

#[test]
fn the_unchanged_requests_are_accepted() {
    // The mutations start from valid requests, so they reach past the body's parsing.
    let f = fixture();
    for route in JSON_ROUTES {
        let reply = post_json(f.addr, route, &template(route, f));
        assert_eq!(
            reply.status,
            200,
            "{route}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
}
