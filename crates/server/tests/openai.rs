//! The OpenAI-compatible routes (`/v1/chat/completions`, `/v1/completions`) on the
//! embedded tiny model: the token ids and log-probs they return are exactly what the
//! Tinker `asample` path samples for the same prompt and seed; streaming gives the same
//! tokens; `n`, stop strings; bad requests answer 4xx in OpenAI's error shape.

mod common;

use std::net::SocketAddr;

use common::*;
use prost::Message;
use serde_json::{json, Value};

fn post_v1(addr: SocketAddr, route: &str, body: &Value) -> Reply {
    request(
        addr,
        "POST",
        &format!("/v1/{route}"),
        &[
            ("Authorization", &format!("Bearer {KEY}")),
            ("Content-Type", "application/json"),
        ],
        body.to_string().as_bytes(),
    )
}

fn ok(reply: &Reply) -> Value {
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()
}

/// The `data:` payloads of an SSE body.
fn events(reply: &Reply) -> Vec<String> {
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(
        reply.content_type.starts_with("text/event-stream"),
        "{}",
        reply.content_type
    );
    String::from_utf8(reply.body.clone())
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").expect("a data event").to_string())
        .collect()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn chat_logprobs(choice: &Value) -> Vec<f32> {
    choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap() as f32)
        .collect()
}

/// A sampling session on the base model; returns its id.
fn sampling_session(addr: SocketAddr) -> String {
    let session = post_json(
        addr,
        "create_session",
        &json!({"tags": [], "user_metadata": {}, "sdk_version": "test", "type": "create_session"}),
    );
    let session_id = session.json()["session_id"].as_str().unwrap().to_string();
    let sampling = post_json(
        addr,
        "create_sampling_session",
        &json!({"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}),
    );
    sampling.json()["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `(tokens, logprobs)` of each sample `asample` draws.
fn asample(
    addr: SocketAddr,
    sampler_id: &str,
    prompt: &[u32],
    n: usize,
    max_tokens: usize,
    seed: u64,
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let sample = post_json(
        addr,
        "asample",
        &json!({
            "sampling_session_id": sampler_id, "seq_id": 0, "num_samples": n,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": seed},
            "type": "sample"
        }),
    );
    let result = retrieve(addr, &request_id(&sample));
    let response = floe_server::proto::SampleResponse::decode(&result.body[..]).unwrap();
    response
        .sequences
        .iter()
        .map(|s| {
            let tokens = s
                .tokens
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect();
            let logprobs = s
                .logprobs
                .as_ref()
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (tokens, logprobs)
        })
        .collect()
}

fn chat_body(model: &str, n: usize, seed: u64) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}],
        "max_tokens": 12, "temperature": 1.0, "n": n, "seed": seed,
    })
}

#[test]
fn chat_tokens_and_logprobs_equal_what_asample_draws() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let sampler_id = sampling_session(addr);
    for model in [BASE_MODEL, sampler_id.as_str()] {
        let reply = ok(&post_v1(addr, "chat/completions", &chat_body(model, 3, 7)));
        assert_eq!(reply["object"], "chat.completion");
        assert_eq!(reply["model"], model);
        let prompt = ids(&reply["prompt_token_ids"]);
        assert!(prompt.len() > 5, "{reply}");
        let choices = reply["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{reply}");
        let drawn = asample(addr, &sampler_id, &prompt, 3, 12, 7);
        let mut completion_tokens = 0;
        for (i, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], i);
            let tokens = ids(&choice["token_ids"]);
            let logprobs = chat_logprobs(choice);
            assert!(!tokens.is_empty());
            assert_eq!(tokens.len(), logprobs.len());
            assert_eq!(
                (tokens.clone(), logprobs),
                drawn[i],
                "choice {i} of {model}"
            );
            assert_eq!(choice["message"]["role"], "assistant");
            assert!(choice["message"]["content"].is_string());
            let reason = choice["finish_reason"].as_str().unwrap();
            assert!(reason == "stop" || reason == "length", "{reason}");
            assert_eq!(reason == "length", tokens.len() == 12, "{choice}");
            completion_tokens += tokens.len();
        }
        // The samples are not all alike.
        assert!(choices
            .iter()
            .any(|c| c["token_ids"] != choices[0]["token_ids"]));
        assert_eq!(reply["usage"]["prompt_tokens"], prompt.len());
        assert_eq!(reply["usage"]["completion_tokens"], completion_tokens);
    }
}

/// A training model's id samples its current weights: after an optimizer step the same
/// seed gives other log-probs, still equal to what `asample` draws from the model's
/// sampling session.
#[test]
fn a_training_model_id_samples_its_current_policy() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let (_, model_id) = create_model(addr);
    let saved = post_json(
        addr,
        "save_weights_for_sampler",
        &json!({"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0}),
    );
    let sampler_id = retrieve(addr, &request_id(&saved)).json()["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let sample = |seed: u64| {
        let reply = ok(&post_v1(
            addr,
            "chat/completions",
            &chat_body(&model_id, 1, seed),
        ));
        let choice = &reply["choices"][0];
        let prompt = ids(&reply["prompt_token_ids"]);
        let drawn = asample(addr, &sampler_id, &prompt, 1, 12, seed);
        let got = (ids(&choice["token_ids"]), chat_logprobs(choice));
        assert_eq!(got, drawn[0]);
        got
    };
    let before = sample(7);
    let step = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 2, false),
    ));
    assert_eq!(retrieve(addr, &step).status, 200);
    let step = request_id(&post_json(addr, "optim_step", &optim_body(&model_id, 3)));
    assert_eq!(retrieve(addr, &step).status, 200);
    let after = sample(7);
    assert_ne!(
        before, after,
        "the optimizer step did not reach the endpoint"
    );
}

#[test]
fn streamed_chat_gives_the_same_tokens_logprobs_and_text() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let whole = ok(&post_v1(
        addr,
        "chat/completions",
        &chat_body(BASE_MODEL, 2, 11),
    ));
    let mut body = chat_body(BASE_MODEL, 2, 11);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = events(&post_v1(addr, "chat/completions", &body));
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut tokens = vec![Vec::new(); 2];
    let mut logprobs = vec![Vec::new(); 2];
    let mut text = vec![String::new(); 2];
    let mut finish = vec![Value::Null; 2];
    let mut prompt = None;
    let mut usage = None;
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk");
        if let Some(p) = chunk.get("prompt_token_ids") {
            prompt = Some(p.clone());
        }
        if let Some(u) = chunk.get("usage") {
            usage = Some(u.clone());
        }
        for choice in chunk["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            if let Some(t) = choice.get("token_ids") {
                tokens[i].extend(ids(t));
                logprobs[i].extend(chat_logprobs(choice));
            }
            if let Some(c) = choice["delta"]["content"].as_str() {
                text[i].push_str(c);
            }
            if !choice["finish_reason"].is_null() {
                finish[i] = choice["finish_reason"].clone();
            }
        }
    }
    assert_eq!(prompt.unwrap(), whole["prompt_token_ids"]);
    assert_eq!(usage.unwrap(), whole["usage"]);
    for (i, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(tokens[i], ids(&choice["token_ids"]), "choice {i}");
        assert_eq!(logprobs[i], chat_logprobs(choice), "choice {i}");
        assert_eq!(text[i], choice["message"]["content"].as_str().unwrap());
        assert_eq!(finish[i], choice["finish_reason"]);
    }
}

#[test]
fn completions_take_text_or_token_ids_and_stream() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let sampler_id = sampling_session(addr);
    let text = ok(&post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": "User: Name a colour.", "max_tokens": 6, "seed": 3}),
    ));
    assert_eq!(text["object"], "text_completion");
    let prompt = ids(&text["prompt_token_ids"]);
    let by_ids = ok(&post_v1(
        addr,
        "completions",
        &json!({"model": sampler_id, "prompt": prompt, "max_tokens": 6, "seed": 3}),
    ));
    assert_eq!(
        by_ids["choices"][0]["token_ids"],
        text["choices"][0]["token_ids"]
    );
    assert_eq!(by_ids["choices"][0]["text"], text["choices"][0]["text"]);
    let choice = &text["choices"][0];
    let logprobs: Vec<f32> = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let drawn = asample(addr, &sampler_id, &prompt, 1, 6, 3);
    assert_eq!((ids(&choice["token_ids"]), logprobs), drawn[0]);

    let events = events(&post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": "User: Name a colour.", "max_tokens": 6, "seed": 3, "stream": true}),
    ));
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut tokens = Vec::new();
    let mut streamed = String::new();
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        let c = &chunk["choices"][0];
        if let Some(t) = c.get("token_ids") {
            tokens.extend(ids(t));
        }
        streamed.push_str(c["text"].as_str().unwrap());
    }
    assert_eq!(tokens, ids(&choice["token_ids"]));
    assert_eq!(streamed, choice["text"].as_str().unwrap());
}

/// A chat choice's `logprobs.content` items from the chunks of a stream, by choice.
fn streamed_chat_logprob_items(events: &[String], n: usize) -> Vec<Vec<Value>> {
    let mut items = vec![Vec::new(); n];
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        for choice in chunk["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            if let Some(content) = choice["logprobs"]["content"].as_array() {
                items[i].extend(content.iter().cloned());
            }
        }
    }
    items
}

/// Asserts a chat `logprobs.content` item's `top_logprobs` are `k` alternatives by
/// decreasing log-prob, none above the sampled token's unless it is among them, and
/// that the sampled token, when among them, has its own log-prob there.
fn assert_top_alternatives(item: &Value, k: usize) {
    let top = item["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), k, "{item}");
    let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
    assert!(values.windows(2).all(|w| w[0] >= w[1]), "{item}");
    for t in top {
        assert!(t["token"].is_string() && t["bytes"].is_array(), "{item}");
    }
    let sampled = item["logprob"].as_f64().unwrap();
    assert!(sampled <= values[0], "{item}");
    if sampled > values[k - 1] {
        assert!(
            top.iter()
                .any(|t| t["token"] == item["token"] && t["logprob"].as_f64() == Some(sampled)),
            "the sampled token is missing from its top alternatives: {item}"
        );
    }
}

#[test]
fn top_logprobs_are_the_most_likely_tokens_streamed_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let plain = ok(&post_v1(
        addr,
        "chat/completions",
        &chat_body(BASE_MODEL, 2, 5),
    ));
    let mut body = chat_body(BASE_MODEL, 2, 5);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(4);
    let asked = ok(&post_v1(addr, "chat/completions", &body));
    for (i, (choice, plain)) in asked["choices"]
        .as_array()
        .unwrap()
        .iter()
        .zip(plain["choices"].as_array().unwrap())
        .enumerate()
    {
        // Asking changes neither the tokens nor their log-probs (what a trainer keeps).
        assert_eq!(choice["token_ids"], plain["token_ids"], "choice {i}");
        assert_eq!(chat_logprobs(choice), chat_logprobs(plain), "choice {i}");
        for item in plain["logprobs"]["content"].as_array().unwrap() {
            assert_eq!(item["top_logprobs"], json!([]), "{item}");
        }
        for item in choice["logprobs"]["content"].as_array().unwrap() {
            assert_top_alternatives(item, 4);
        }
    }
    body["stream"] = json!(true);
    let streamed =
        streamed_chat_logprob_items(&events(&post_v1(addr, "chat/completions", &body)), 2);
    for (i, choice) in asked["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            Value::from(streamed[i].clone()),
            choice["logprobs"]["content"],
            "choice {i}"
        );
    }

    // Greedy: the sampled token is the most likely one.
    let greedy = ok(&post_v1(
        addr,
        "chat/completions",
        &json!({"model": BASE_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 6, "temperature": 0.0, "logprobs": true, "top_logprobs": 20}),
    ));
    for item in greedy["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
    {
        assert_top_alternatives(item, 20);
        assert_eq!(
            item["top_logprobs"][0]["logprob"], item["logprob"],
            "{item}"
        );
    }

    // Completions: one token-text → log-prob map per token (texts may coincide).
    let completion = json!({"model": BASE_MODEL, "prompt": "User: Name a colour.",
                            "max_tokens": 6, "seed": 3, "logprobs": 3});
    let whole = ok(&post_v1(addr, "completions", &completion));
    let logprobs = &whole["choices"][0]["logprobs"];
    let tops = logprobs["top_logprobs"].as_array().unwrap();
    let sampled = logprobs["token_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), sampled.len(), "{logprobs}");
    for (top, lp) in tops.iter().zip(sampled) {
        let top = top.as_object().unwrap();
        assert!((1..=3).contains(&top.len()), "{logprobs}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(lp.as_f64().unwrap() <= best, "{logprobs}");
    }
    let mut stream = completion.clone();
    stream["stream"] = json!(true);
    let events = events(&post_v1(addr, "completions", &stream));
    let mut streamed_tops = Vec::new();
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        if let Some(top) = chunk["choices"][0]["logprobs"]["top_logprobs"].as_array() {
            streamed_tops.extend(top.iter().cloned());
        }
    }
    assert_eq!(&streamed_tops, tops);
    let unasked = ok(&post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": "Hi", "max_tokens": 2}),
    ));
    assert!(unasked["choices"][0]["logprobs"]["top_logprobs"].is_null());
}

#[test]
fn a_stop_string_ends_the_choice_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let body = |stop: Option<&str>| {
        let mut body = json!({"model": BASE_MODEL, "prompt": "SELECT name FROM", "max_tokens": 24,
                              "seed": 5, "temperature": 1.0});
        if let Some(stop) = stop {
            body["stop"] = json!([stop]);
        }
        body
    };
    let free = ok(&post_v1(addr, "completions", &body(None)));
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "too short to cut: {text:?}");
    // A stop string from the middle of what the seed samples.
    let stop: String = chars[3..5].iter().collect();
    let cut = ok(&post_v1(addr, "completions", &body(Some(&stop))));
    let choice = &cut["choices"][0];
    let expected = &text[..text.find(&stop).unwrap()];
    assert_eq!(
        choice["text"].as_str().unwrap(),
        expected,
        "stop {stop:?} in {text:?}"
    );
    assert_eq!(choice["finish_reason"], "stop");
    // The tokens sampled up to the stop (its tokens included) are a prefix of the free run's.
    let free_tokens = ids(&free["choices"][0]["token_ids"]);
    let cut_tokens = ids(&choice["token_ids"]);
    assert!(cut_tokens.len() < free_tokens.len());
    assert_eq!(cut_tokens[..], free_tokens[..cut_tokens.len()]);
    // Streamed, the pieces add up to the same cut text and tokens.
    let mut streaming = body(Some(&stop));
    streaming["stream"] = json!(true);
    let (mut text, mut tokens) = (String::new(), Vec::new());
    for event in events(&post_v1(addr, "completions", &streaming)) {
        if event == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&event).unwrap();
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap());
        if let Some(t) = chunk["choices"][0].get("token_ids") {
            tokens.extend(ids(t));
        }
    }
    assert_eq!((text.as_str(), tokens), (expected, cut_tokens));
}

/// `/v1/tokenize` gives the ids the sampling routes prompt with, and the chat template's
/// text; `include_stop_str_in_output` keeps the stop string in the text.
#[test]
fn tokenize_matches_the_prompts_and_stop_strings_can_stay_in_the_text() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let chat = ok(&post_v1(
        addr,
        "chat/completions",
        &chat_body(BASE_MODEL, 1, 7),
    ));
    let messages = chat_body(BASE_MODEL, 1, 7)["messages"].clone();
    let tokenized = ok(&post_v1(
        addr,
        "tokenize",
        &json!({"model": BASE_MODEL, "messages": messages}),
    ));
    assert_eq!(tokenized["tokens"], chat["prompt_token_ids"]);
    assert!(tokenized["prompt"]
        .as_str()
        .unwrap()
        .contains("What is 2 + 3?"));
    let text = "User: Name a colour.";
    let completion = ok(&post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": text, "max_tokens": 24, "seed": 5}),
    ));
    let tokenized = ok(&post_v1(
        addr,
        "tokenize",
        &json!({"model": BASE_MODEL, "prompt": text}),
    ));
    assert_eq!(tokenized["tokens"], completion["prompt_token_ids"]);
    assert_eq!(tokenized["count"], completion["usage"]["prompt_tokens"]);
    let both = post_v1(
        addr,
        "tokenize",
        &json!({"model": BASE_MODEL, "prompt": text, "messages": messages}),
    );
    assert_openai_error(&both, 400, "exactly one of prompt");

    let sampled: Vec<char> = completion["choices"][0]["text"]
        .as_str()
        .unwrap()
        .chars()
        .collect();
    assert!(sampled.len() >= 6, "too short to cut: {sampled:?}");
    let stop: String = sampled[3..5].iter().collect();
    let kept = ok(&post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": text, "max_tokens": 24, "seed": 5,
                "stop": [stop], "include_stop_str_in_output": true}),
    ));
    let kept = kept["choices"][0]["text"].as_str().unwrap();
    assert!(kept.ends_with(&stop), "{kept:?} does not end with {stop:?}");
}

fn assert_openai_error(reply: &Reply, status: u16, needle: &str) {
    assert_eq!(
        reply.status,
        status,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("{body}"));
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

#[test]
fn bad_requests_answer_4xx_in_openai_error_shape() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let messages = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"model": "gpt-4", "messages": messages}),
            404,
            "gpt-4",
        ),
        (json!({"model": BASE_MODEL}), 400, "messages"),
        (
            json!({"model": BASE_MODEL, "messages": []}),
            400,
            "messages must not be empty",
        ),
        (
            json!({"model": BASE_MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "role",
        ),
        (
            json!({"model": BASE_MODEL, "messages": messages, "n": 0}),
            400,
            "n 0",
        ),
        (
            json!({"model": BASE_MODEL, "messages": messages, "max_tokens": 1_000_000}),
            400,
            "max_tokens",
        ),
        (
            json!({"model": BASE_MODEL, "messages": messages, "temperature": -1.0}),
            400,
            "temperature",
        ),
        (
            json!({"model": BASE_MODEL, "messages": messages, "logprobs": true, "top_logprobs": 21}),
            400,
            "top_logprobs 21 is not in [0, 20]",
        ),
        (
            json!({"model": BASE_MODEL, "messages": messages, "stop": [""]}),
            400,
            "stop",
        ),
    ];
    for (body, status, needle) in cases {
        assert_openai_error(&post_v1(addr, "chat/completions", &body), status, needle);
    }
    let gpt = post_v1(
        addr,
        "chat/completions",
        &json!({"model": "gpt-4", "messages": messages}),
    );
    assert_eq!(gpt.json()["error"]["code"], "model_not_found");
    assert_openai_error(
        &post_v1(
            addr,
            "completions",
            &json!({"model": BASE_MODEL, "prompt": [1, 999999]}),
        ),
        400,
        "vocabulary",
    );
    let too_many = post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": "hi", "logprobs": 6}),
    );
    assert_openai_error(&too_many, 400, "logprobs 6 is not in [0, 5]");
    assert_eq!(too_many.json()["error"]["param"], "logprobs");
    let garbled = request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", &format!("Bearer {KEY}"))],
        b"{not json",
    );
    assert_openai_error(&garbled, 400, "invalid request body");
    let keyless = request(addr, "POST", "/v1/chat/completions", &[], b"{}");
    assert_openai_error(&keyless, 401, "missing API key");
    let wrong = request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer nope")],
        b"{}",
    );
    assert_openai_error(&wrong, 401, "not accepted");
    // X-API-Key works here too, and Bearer works on the Tinker routes.
    let listed = request(addr, "GET", "/v1/models", &[("X-API-Key", KEY)], b"");
    assert_eq!(ok(&listed)["data"][0]["id"], BASE_MODEL);
    let caps = request(
        addr,
        "GET",
        "/api/v1/get_server_capabilities",
        &[("Authorization", &format!("Bearer {KEY}"))],
        b"",
    );
    assert_eq!(caps.status, 200);
}

#[test]
fn tools_render_through_the_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let messages = json!([{"role": "user", "content": "How many users?"}]);
    let tools = json!([{"type": "function", "function": {"name": "run_sql", "description": "Run a SQL query",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]);
    let plain = ok(&post_v1(
        addr,
        "chat/completions",
        &json!({"model": BASE_MODEL, "messages": messages, "max_tokens": 2, "seed": 1}),
    ));
    let with_tools = ok(&post_v1(
        addr,
        "chat/completions",
        &json!({"model": BASE_MODEL, "messages": messages, "tools": tools, "max_tokens": 2, "seed": 1}),
    ));
    // The tool definitions are in the prompt (Qwen3's `# Tools` system block).
    assert!(
        ids(&with_tools["prompt_token_ids"]).len() > ids(&plain["prompt_token_ids"]).len() + 20
    );
    // A multi-turn episode with an assistant tool call and the tool's answer renders too.
    let episode = json!([
        {"role": "user", "content": "How many users?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "run_sql", "arguments": "{\"query\": \"SELECT COUNT(*) FROM users\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]);
    ok(&post_v1(
        addr,
        "chat/completions",
        &json!({"model": BASE_MODEL, "messages": episode, "tools": tools, "max_tokens": 2}),
    ));
}

/// The unmodified `openai` Python SDK: chat, streaming and completions, checked against
/// the token ids and log-probs the server returns. Skipped, with a note, without it.
#[test]
fn openai_python_sdk_chats_and_streams() {
    let installed = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !installed {
        eprintln!("skipped: the openai Python package is not installed (pip install openai)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let out = std::process::Command::new("python3")
        .arg(format!(
            "{}/tests/openai_sdk.py",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("OPENAI_BASE_URL", format!("http://{addr}/v1"))
        .env("OPENAI_API_KEY", KEY)
        .env("FLOE_BASE_MODEL", BASE_MODEL)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_sdk.py failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("OpenAI SDK OK"), "{stdout}");
}

/// The server's sample counters (`GET /floe/v1/stats`).
fn sampling_stats(addr: SocketAddr) -> Value {
    let reply = request(addr, "GET", "/floe/v1/stats", &[("X-API-Key", KEY)], b"");
    ok(&reply)["sampling"].clone()
}

/// Clients that hang up, streaming or not, get their samples cancelled in the engine's
/// batch (the batch ends long before their `max_tokens`), and a later request is served.
#[test]
fn a_client_that_hangs_up_cancels_its_samples() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let hang_up = |stream: bool, wait_for: &str| {
        let body = json!({
            "model": BASE_MODEL, "prompt": "User: Name a colour.", "max_tokens": 400, "n": 4,
            "seed": 5, "stream": stream,
        })
        .to_string();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        write!(
            client,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        // A streaming client reads a few chunks first; a waiting one reads nothing.
        let mut seen = String::new();
        let mut buffer = [0u8; 4096];
        while !seen.contains(wait_for) {
            let n = client.read(&mut buffer).unwrap();
            assert!(n > 0, "the server closed the stream: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buffer[..n]));
        }
        if wait_for.is_empty() {
            // Time for the server to read the request and start sampling it.
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        drop(client);
    };
    // Every sample of the request either finished (an early end of sequence) or was
    // cancelled, and some were cancelled; returns (cancelled, finished) so far.
    let wait_done = |total: u64, before: (u64, u64)| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let stats = sampling_stats(addr);
            let counts = (
                stats["cancelled_samples"].as_u64().unwrap(),
                stats["samples"].as_u64().unwrap(),
            );
            if counts.0 + counts.1 == total {
                assert!(counts.0 > before.0, "nothing cancelled: {stats}");
                return counts;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "samples neither finished nor cancelled: {stats}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    // Streaming: chunks of every choice, then gone.
    hang_up(true, "\"index\":3");
    let counts = wait_done(4, (0, 0));
    // Not streaming: gone while it samples.
    hang_up(false, "");
    let counts = wait_done(8, counts);
    // The engine serves the next request in full.
    let text = ok(&post_v1(
        addr,
        "completions",
        &json!({"model": BASE_MODEL, "prompt": "User: Name a colour.", "max_tokens": 6, "seed": 3}),
    ));
    assert!(!text["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .is_empty());
    assert_eq!(sampling_stats(addr)["samples"], counts.1 + 1);
}
