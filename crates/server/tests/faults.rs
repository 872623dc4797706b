//! Issue 6's fault tests: a client killed mid-request, a server restarted mid-run, 100
//! concurrent samples on one model under back-pressure, bad API keys, oversize and
//! garbage bodies, expired futures.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use floe_server::proto;
use prost::Message;
use serde_json::{json, Value};

/// Opens the unnamed sampling session on `model_id`'s live weights (request `seq_id`).
fn sampling_session(addr: SocketAddr, model_id: &str, seq_id: i64) -> String {
    let submitted = post_json(
        addr,
        "save_weights_for_sampler",
        &json!({"model_id": model_id, "seq_id": seq_id, "sampling_session_seq_id": 0}),
    );
    let result = retrieve(addr, &request_id(&submitted)).json();
    result["sampling_session_id"].as_str().unwrap().to_string()
}

fn sample_body(sampler: &str, seq_id: u64, max_tokens: usize) -> Value {
    json!({
        "sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12, 13]}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": seq_id, "stop": [],
                            "temperature": 1.0, "top_k": -1, "top_p": 1.0},
        "type": "sample",
    })
}

/// The sampled token count of a `SampleResponse` result.
fn sampled_tokens(reply: &Reply) -> usize {
    assert_eq!(
        reply.content_type,
        "application/x-protobuf",
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let response = proto::SampleResponse::decode(&reply.body[..]).unwrap();
    response.sequences[0].tokens.len() / 4
}

fn detail(reply: &Reply) -> String {
    reply.json()["detail"]
        .as_str()
        .unwrap_or_else(|| panic!("no detail in {:?}", reply))
        .to_string()
}

#[test]
fn a_client_killed_mid_request_leaves_the_server_serving() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let (_, model_id) = create_model(addr);

    // A body cut off after its first bytes: the client dies mid-upload.
    let mut cut = TcpStream::connect(addr).unwrap();
    write!(
        cut,
        "POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nContent-Length: 100000\r\n\r\n"
    )
    .unwrap();
    cut.write_all(&fwdbwd_body(&model_id, 1, false)[..10])
        .unwrap();
    drop(cut);

    // A long poll abandoned while its sample is still running.
    let sampler = sampling_session(addr, &model_id, 1);
    let slow = request_id(&post_json(addr, "asample", &sample_body(&sampler, 0, 200)));
    let mut poll = TcpStream::connect(addr).unwrap();
    let body = json!({"request_id": slow, "allow_metadata_only": false}).to_string();
    write!(
        poll,
        "POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(poll);

    // The abandoned future still resolves for a client that asks again, and the model's
    // ordered requests go on (the dead upload's seq_id 1 was never delivered, so the
    // sampler save above took it).
    assert_eq!(sampled_tokens(&retrieve(addr, &slow)), 200);
    let forward = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 2, true),
    ));
    assert_eq!(logprobs_of(&retrieve(addr, &forward)).len(), 2);
    assert_eq!(
        request(addr, "GET", "/api/v1/healthz", &[], b"").status,
        200
    );
}

#[test]
fn a_restarted_server_loses_sessions_but_loads_saved_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let first = Stoppable::start(config(dir.path()));
    let addr = first.addr;
    let (session_id, model_id) = create_model(addr);
    request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 1, false),
    ));
    request_id(&post_json(addr, "optim_step", &optim_body(&model_id, 2)));
    let saved = post_json(
        addr,
        "save_weights",
        &json!({"model_id": model_id, "seq_id": 3, "path": "before-restart"}),
    );
    let path = retrieve(addr, &request_id(&saved)).json()["path"]
        .as_str()
        .unwrap()
        .to_string();
    let forward = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 4, true),
    ));
    let expected = logprobs_of(&retrieve(addr, &forward));
    // Mid-run: a training step is submitted, and the server goes down under it.
    request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 5, false),
    ));
    first.stop();

    let second = Stoppable::start(config(dir.path()));
    let addr = second.addr;
    // Sessions and models lived in memory: gone.
    let heartbeat = post_json(
        addr,
        "session_heartbeat",
        &json!({"session_id": session_id}),
    );
    assert_eq!(heartbeat.status, 410, "{}", detail(&heartbeat));
    let info = post_json(addr, "get_info", &json!({"model_id": model_id}));
    assert_eq!(info.status, 404, "{}", detail(&info));
    // Checkpoints lived on disk: listed, described and loaded.
    let run = request(
        addr,
        "GET",
        &format!("/api/v1/training_runs/{model_id}"),
        &[("X-API-Key", KEY)],
        b"",
    );
    assert_eq!(run.status, 200, "{}", String::from_utf8_lossy(&run.body));
    assert_eq!(run.json()["last_checkpoint"]["tinker_path"], path);
    let info = post_json(addr, "weights_info", &json!({"tinker_path": path}));
    assert_eq!(info.json()["base_model"], BASE_MODEL);
    let (session_id, _) = create_model(addr);
    let loaded = post_json(
        addr,
        "load_weights",
        &json!({"session_id": session_id, "model_seq_id": 1, "path": path, "optimizer": true}),
    );
    let loaded_id = retrieve(addr, &request_id(&loaded)).json()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    let forward = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&loaded_id, 1, true),
    ));
    let restored = logprobs_of(&retrieve(addr, &forward));
    let max_diff = restored
        .iter()
        .flatten()
        .zip(expected.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        max_diff < 1e-6,
        "restored weights score {max_diff} away: {restored:?} vs {expected:?}"
    );
    second.stop();
}

#[test]
fn a_hundred_concurrent_samples_are_all_answered_under_back_pressure() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.max_queued_per_engine = 8;
    let addr = start(config);
    let (_, model_id) = create_model(addr);
    let sampler = sampling_session(addr, &model_id, 1);
    let rejected = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..100u64)
        .map(|seq| {
            let (sampler, rejected) = (sampler.clone(), Arc::clone(&rejected));
            std::thread::spawn(move || {
                // Back off on 429 as the SDK does, with a bounded number of tries.
                for attempt in 0..200 {
                    let reply = post_json(addr, "asample", &sample_body(&sampler, seq, 4));
                    if reply.status == 429 {
                        assert!(detail(&reply).contains("retry"), "{reply:?}");
                        rejected.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(20 + 5 * attempt));
                        continue;
                    }
                    return sampled_tokens(&retrieve(addr, &request_id(&reply)));
                }
                panic!("sample {seq} was refused 200 times");
            })
        })
        .collect();
    for client in clients {
        assert_eq!(client.join().unwrap(), 4);
    }
    assert!(
        rejected.load(Ordering::Relaxed) > 0,
        "100 samples on a queue of 8 never met back-pressure"
    );
}

#[test]
fn the_sdk_retries_429_until_a_hundred_concurrent_samples_are_answered() {
    if !tinker_sdk_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.max_queued_per_engine = 8;
    let addr = start(config);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/tinker_sdk_concurrency.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .env("TINKER_BASE_URL", format!("http://{addr}"))
        .env("TINKER_API_KEY", KEY)
        .env("FLOE_BASE_MODEL", BASE_MODEL)
        .env("TINKER_TELEMETRY", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "SDK script failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("100 samples answered"), "{stdout}");
}

#[test]
fn bad_api_keys_get_401_with_a_body_on_every_route() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let routes = [
        ("POST", "/api/v1/create_session"),
        ("POST", "/api/v1/retrieve_future"),
        ("POST", "/api/v1/forward_backward"),
        ("GET", "/api/v1/training_runs"),
        ("GET", "/api/v1/checkpoints"),
        ("DELETE", "/api/v1/training_runs/r/checkpoints/weights/x"),
    ];
    for (method, route) in routes {
        for key in [None, Some("tml-wrong"), Some("")] {
            let headers: Vec<(&str, &str)> = key.map(|k| ("X-API-Key", k)).into_iter().collect();
            let reply = request(addr, method, route, &headers, b"{}");
            assert_eq!(reply.status, 401, "{method} {route} with key {key:?}");
            assert!(detail(&reply).contains("X-API-Key"), "{reply:?}");
        }
    }
}

#[test]
fn oversize_and_garbage_bodies_get_4xx_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let (_, model_id) = create_model(addr);
    let json_routes = [
        "create_session",
        "session_heartbeat",
        "create_model",
        "get_info",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "load_weights",
        "create_sampling_session",
        "asample",
        "retrieve_future",
        "cancel_future",
        "weights_info",
        "sessions/none/finish",
    ];
    let garbage: [&[u8]; 5] = [
        b"",
        b"{not json",
        b"\x00\xff\xfe binary \x80",
        b"[1, 2, 3]",
        br#"{"tags": "x", "model_id": 7, "seq_id": "x", "session_id": null, "request_id": 5, "tinker_path": 1, "path": 2}"#,
    ];
    for route in json_routes {
        for body in garbage {
            let reply = request(
                addr,
                "POST",
                &format!("/api/v1/{route}"),
                &[("X-API-Key", KEY), ("Content-Type", "application/json")],
                body,
            );
            assert!(
                (400..500).contains(&reply.status),
                "{route} answered {} to {:?}",
                reply.status,
                String::from_utf8_lossy(body)
            );
            // Each message names the route, or (finish) the session it cannot find.
            let message = detail(&reply);
            let name = route.rsplit('/').next().unwrap();
            assert!(
                message.contains(name) || message.contains("unknown session_id"),
                "{route}: {message}"
            );
        }
    }
    for body in [
        &b"\xff\xff\xff\xff"[..],
        b"\x0a\x05abc",
        b"not a protobuf at all",
    ] {
        let reply = post_proto(addr, "forward_backward", body);
        assert_eq!(reply.status, 400, "{reply:?}");
        assert!(detail(&reply).contains("forward_backward"), "{reply:?}");
    }
    // A protobuf that decodes but names tokens outside the vocabulary fails in its turn.
    let mut request_proto =
        proto::ForwardBackwardRequest::decode(&fwdbwd_body(&model_id, 1, true)[..]).unwrap();
    request_proto.data[0].model_input[0] = proto::Chunk {
        chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
            tokens: tokens_bytes(&[1 << 30, 2, 3, 4]),
        })),
    };
    let failed = retrieve(
        addr,
        &request_id(&post_proto(
            addr,
            "forward_backward",
            &request_proto.encode_to_vec(),
        )),
    );
    assert_eq!(failed.json()["category"], "user", "{:?}", failed.json());

    // Over --max-body-mib (1 MiB in tests), plain and as a zstd bomb.
    let big = vec![b'x'; 2 << 20];
    for route in ["asample", "create_session"] {
        let reply = request(
            addr,
            "POST",
            &format!("/api/v1/{route}"),
            &[("X-API-Key", KEY)],
            &big,
        );
        assert_eq!(reply.status, 413, "{route}");
        assert!(!detail(&reply).is_empty());
    }
    let bomb = zstd::encode_all(&vec![0u8; 8 << 20][..], 19).unwrap();
    assert!(bomb.len() < 1 << 20);
    let reply = request(
        addr,
        "POST",
        "/api/v1/forward_backward",
        &[("X-API-Key", KEY), ("Content-Encoding", "zstd")],
        &bomb,
    );
    assert_eq!(reply.status, 413, "{reply:?}");
    assert!(detail(&reply).contains("decompressed"));

    // Still serving.
    let forward = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 2, true),
    ));
    assert_eq!(logprobs_of(&retrieve(addr, &forward)).len(), 2);
}

#[test]
fn finished_sample_futures_expire_with_410() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.future_expiry = Duration::from_millis(300);
    let addr = start(config);
    let (_, model_id) = create_model(addr);
    let sampler = sampling_session(addr, &model_id, 1);
    let id = request_id(&post_json(addr, "asample", &sample_body(&sampler, 0, 3)));
    assert_eq!(sampled_tokens(&retrieve(addr, &id)), 3);
    // Retrievable again until it expires.
    assert_eq!(sampled_tokens(&retrieve(addr, &id)), 3);
    std::thread::sleep(Duration::from_millis(1200));
    let gone = post_json(addr, "retrieve_future", &json!({"request_id": id}));
    assert_eq!(gone.status, 410);
    assert!(detail(&gone).contains("expired"), "{gone:?}");
}
