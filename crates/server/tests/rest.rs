//! The REST routes around training (`training_runs*`, `checkpoints`, `weights_info`),
//! `cancel_future`, `complete_metadata` answers and session expiry, over HTTP.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn get(addr: SocketAddr, route: &str) -> Reply {
    request(
        addr,
        "GET",
        &format!("/api/v1/{route}"),
        &[("X-API-Key", KEY)],
        b"",
    )
}

fn save(addr: SocketAddr, route: &str, model_id: &str, seq_id: i64, name: &str) -> String {
    let submitted = post_json(
        addr,
        route,
        &json!({"model_id": model_id, "seq_id": seq_id, "path": name, "ttl_seconds": 60}),
    );
    retrieve(addr, &request_id(&submitted)).json()["path"]
        .as_str()
        .unwrap()
        .to_string()
}

fn checkpoint_ids(listing: &Value) -> Vec<String> {
    listing["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["checkpoint_id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn training_runs_and_checkpoints_are_listed_described_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let session = post_json(
        addr,
        "create_session",
        &json!({"tags": [], "user_metadata": {}, "sdk_version": "test"}),
    );
    let session_id = session.json()["session_id"].as_str().unwrap().to_string();
    let created = post_json(
        addr,
        "create_model",
        &json!({"session_id": session_id, "model_seq_id": 0, "base_model": BASE_MODEL,
                "user_metadata": {"renderer_name": "role_colon", "step": 3}}),
    );
    let model_id = retrieve(addr, &request_id(&created)).json()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    let weights = save(addr, "save_weights", &model_id, 1, "first");
    std::thread::sleep(Duration::from_millis(1100)); // distinct modification times
    let sampler = save(addr, "save_weights_for_sampler", &model_id, 2, "second");
    assert_eq!(weights, format!("tinker://{model_id}/weights/first"));
    assert_eq!(
        sampler,
        format!("tinker://{model_id}/sampler_weights/second")
    );

    let run = get(addr, &format!("training_runs/{model_id}")).json();
    assert_eq!(run["training_run_id"], model_id.as_str());
    assert_eq!(run["base_model"], BASE_MODEL);
    assert_eq!(run["user_metadata"]["renderer_name"], "role_colon");
    assert_eq!(run["user_metadata"]["step"], "3");
    assert_eq!(run["last_checkpoint"]["tinker_path"], weights.as_str());
    assert_eq!(run["last_checkpoint"]["checkpoint_type"], "training");
    assert_eq!(
        run["last_sampler_checkpoint"]["tinker_path"],
        sampler.as_str()
    );
    let stamp = run["last_request_time"].as_str().unwrap();
    assert!(stamp.len() == 20 && stamp.ends_with('Z'), "{stamp}");

    let runs = get(addr, "training_runs").json();
    assert_eq!(
        runs["training_runs"][0]["training_run_id"],
        model_id.as_str()
    );
    assert_eq!(runs["cursor"]["total_count"], 1);

    let listing = get(addr, &format!("training_runs/{model_id}/checkpoints")).json();
    assert_eq!(
        checkpoint_ids(&listing),
        ["sampler_weights/second", "weights/first"]
    );
    assert!(listing["checkpoints"][0]["size_bytes"].as_u64().unwrap() > 0);
    let page = get(addr, "checkpoints?limit=1&offset=1").json();
    assert_eq!(checkpoint_ids(&page), ["weights/first"]);
    assert_eq!(
        page["cursor"],
        json!({"offset": 1, "limit": 1, "total_count": 2})
    );
    let bad_page = get(addr, "checkpoints?limit=many");
    assert_eq!(bad_page.status, 400);
    assert!(bad_page.json()["detail"]
        .as_str()
        .unwrap()
        .contains("checkpoints"));

    let info = post_json(addr, "weights_info", &json!({"tinker_path": weights}));
    assert_eq!(info.status, 200);
    assert_eq!(info.json()["base_model"], BASE_MODEL);
    assert!(info.json()["is_lora"].is_boolean());
    let missing = post_json(
        addr,
        "weights_info",
        &json!({"tinker_path": format!("tinker://{model_id}/weights/none")}),
    );
    assert_eq!(missing.status, 404);

    let route = format!("/api/v1/training_runs/{model_id}/checkpoints/weights/first");
    let deleted = request(addr, "DELETE", &route, &[("X-API-Key", KEY)], b"");
    assert_eq!(
        deleted.status,
        200,
        "{}",
        String::from_utf8_lossy(&deleted.body)
    );
    let again = request(addr, "DELETE", &route, &[("X-API-Key", KEY)], b"");
    assert_eq!(again.status, 404);
    let listing = get(addr, &format!("training_runs/{model_id}/checkpoints")).json();
    assert_eq!(checkpoint_ids(&listing), ["sampler_weights/second"]);
    let load = post_json(
        addr,
        "load_weights",
        &json!({"session_id": session_id, "model_seq_id": 1, "path": weights, "optimizer": false}),
    );
    assert_eq!(load.status, 404, "a deleted checkpoint cannot be loaded");

    let escape = request(
        addr,
        "DELETE",
        &format!("/api/v1/training_runs/{model_id}/checkpoints/bogus/first"),
        &[("X-API-Key", KEY)],
        b"",
    );
    assert_eq!(escape.status, 400);
    assert_eq!(get(addr, "training_runs/unknown-run").status, 404);
}

#[test]
fn a_queued_sample_can_be_cancelled_and_a_finished_one_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let sampler = post_json(
        addr,
        "create_session",
        &json!({"tags": [], "user_metadata": {}}),
    );
    let session_id = sampler.json()["session_id"].as_str().unwrap().to_string();
    let created = post_json(
        addr,
        "create_sampling_session",
        &json!({"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}),
    );
    let sampler = created.json()["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let sample = |seq_id: u64, max_tokens: usize, prompt_logprobs: bool| {
        request_id(&post_json(
            addr,
            "asample",
            &json!({
                "sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12, 13]}]},
                "sampling_params": {"max_tokens": max_tokens, "stop": [], "temperature": 1.0,
                                    "top_k": -1, "top_p": 1.0},
                "prompt_logprobs": prompt_logprobs,
            }),
        ))
    };
    // A long sample occupies the engine. A sample with prompt log-probs cannot join its
    // running batch (it prepares on the engine first), so it waits at the front of the
    // queue, and the one queued behind it has not started.
    let running = sample(0, 300, false);
    let blocker = sample(1, 4, true);
    let queued = sample(2, 4, false);
    let cancel = post_json(addr, "cancel_future", &json!({"request_id": queued}));
    assert_eq!(cancel.json()["cancelled"], true, "{:?}", cancel.json());
    let failed = retrieve(addr, &queued).json();
    assert_eq!(failed["category"], "user");
    assert!(
        failed["error"].as_str().unwrap().contains("cancelled"),
        "{failed}"
    );
    assert_eq!(retrieve(addr, &running).status, 200);
    assert_eq!(retrieve(addr, &blocker).status, 200);
    let late = post_json(addr, "cancel_future", &json!({"request_id": running}));
    assert_eq!(late.json()["cancelled"], false);
    let unknown = post_json(addr, "cancel_future", &json!({"request_id": "nonsense"}));
    assert_eq!(unknown.status, 404);
}

#[test]
fn a_metadata_poll_answers_the_payload_size_first() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let (_, model_id) = create_model(addr);
    let id = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 1, true),
    ));
    let metadata = loop {
        let reply = post_json(
            addr,
            "retrieve_future",
            &json!({"request_id": id, "allow_metadata_only": true}),
        );
        if reply.json()["type"] != "try_again" {
            break reply.json();
        }
    };
    assert_eq!(metadata["status"], "complete_metadata", "{metadata}");
    let payload = retrieve(addr, &id);
    assert_eq!(
        metadata["response_payload_size"].as_u64().unwrap() as usize,
        payload.body.len()
    );
    assert_eq!(logprobs_of(&payload).len(), 2);
}

#[test]
fn sessions_without_heartbeats_expire_with_their_models() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.session_expiry = Duration::from_millis(800);
    let addr = start(config);
    // A client thread heartbeats every listed session, as the SDK does every 10 s.
    let beating = Arc::new(Mutex::new(Vec::<String>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let heart = {
        let (beating, done) = (Arc::clone(&beating), Arc::clone(&done));
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                for session_id in beating.lock().unwrap().clone() {
                    let beat = post_json(
                        addr,
                        "session_heartbeat",
                        &json!({"session_id": session_id}),
                    );
                    assert_eq!(beat.status, 200, "{session_id} expired while beating");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let session = |beating: &Mutex<Vec<String>>| {
        let reply = post_json(addr, "create_session", &json!({"tags": []}));
        let session_id = reply.json()["session_id"].as_str().unwrap().to_string();
        beating.lock().unwrap().push(session_id.clone());
        let created = post_json(
            addr,
            "create_model",
            &json!({"session_id": session_id, "model_seq_id": 0, "base_model": BASE_MODEL}),
        );
        let model = retrieve(addr, &request_id(&created)).json()["model_id"]
            .as_str()
            .unwrap()
            .to_string();
        (session_id, model)
    };
    let (idle_session, idle_model) = session(&beating);
    let (_, live_model) = session(&beating);
    // A crashed client: seq_id 1 never arrives, so seq_id 2 waits behind it, and the
    // heartbeats stop.
    let stuck = request_id(&post_json(addr, "optim_step", &optim_body(&idle_model, 2)));
    beating.lock().unwrap().retain(|s| *s != idle_session);
    let mut waited = Duration::ZERO;
    while post_json(addr, "get_info", &json!({"model_id": idle_model})).status == 200 {
        assert!(
            waited < Duration::from_secs(20),
            "the idle session never expired"
        );
        std::thread::sleep(Duration::from_millis(100));
        waited += Duration::from_millis(100);
    }
    let gone = post_json(
        addr,
        "session_heartbeat",
        &json!({"session_id": idle_session}),
    );
    assert_eq!(gone.status, 410);
    // The request it held for the missing seq_id fails instead of waiting forever.
    let failed = retrieve(addr, &stuck).json();
    assert_eq!(failed["category"], "user");
    assert!(
        failed["error"].as_str().unwrap().contains("expired"),
        "{failed}"
    );
    let info = post_json(addr, "get_info", &json!({"model_id": live_model}));
    assert_eq!(info.status, 200, "a session with heartbeats was dropped");
    done.store(true, Ordering::Relaxed);
    heart.join().unwrap();
}

#[test]
fn retrieve_futures_long_polls_a_sampling_clients_completions() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let session = post_json(addr, "create_session", &json!({"tags": []}));
    let session_id = session.json()["session_id"].as_str().unwrap().to_string();
    let created = post_json(
        addr,
        "create_sampling_session",
        &json!({"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}),
    );
    let sampler = created.json()["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let sample = |seq_id: u64| {
        request_id(&post_json(
            addr,
            "asample",
            &json!({
                "sampling_session_id": sampler, "seq_id": seq_id,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]},
                "sampling_params": {"max_tokens": 3, "stop": []},
            }),
        ))
    };
    let poll = |clone: u64, cursor: u64, timeout: f64| {
        post_json(
            addr,
            "retrieve_futures",
            &json!({
                "target": {"type": "sampling_session", "sampling_session_id": sampler,
                           "cloned_sampler_id": clone},
                "prev_cursor": cursor, "timeout": timeout, "retrieved_request_ids": [],
            }),
        )
        .json()
    };
    // Two samples of the original client, one of its first clone (seq_ids from 10⁹).
    let ours = [sample(0), sample(1)];
    let cloned = sample(1_000_000_000);
    let mut seen = Vec::new();
    let mut cursor = 0;
    while seen.len() < 2 {
        let answer = poll(0, cursor, 5.0);
        cursor = answer["cursor"].as_u64().unwrap();
        seen.extend(answer["completions"].as_array().unwrap().iter().cloned());
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    for completion in &seen {
        assert_eq!(completion["state"], "finished");
        let id = completion["request_id"].as_str().unwrap();
        assert!(
            ours.contains(&id.to_string()),
            "{id} is not one of {ours:?}"
        );
        let payload = retrieve(addr, id);
        assert_eq!(
            completion["response_payload_uncompressed_size"]
                .as_u64()
                .unwrap() as usize,
            payload.body.len()
        );
    }
    // Seen completions are not answered again; an immediate poll answers nothing new.
    let nothing = poll(0, cursor, 0.0);
    assert_eq!(nothing["completions"], json!([]));
    assert_eq!(nothing["cursor"], cursor);
    let clone = poll(1, 0, 5.0);
    assert_eq!(clone["completions"][0]["request_id"], cloned.as_str());

    let unknown = post_json(
        addr,
        "retrieve_futures",
        &json!({"target": {"type": "sampling_session", "sampling_session_id": "nope"}}),
    );
    assert_eq!(unknown.status, 404);
}
