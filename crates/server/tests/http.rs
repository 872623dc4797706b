//! The server over HTTP on a loopback port: auth, body errors, the future/long-poll cycle,
//! `seq_id` ordering with gradient accumulation, duplicates, checkpoints and sampling.

mod common;

use std::time::Duration;

use common::*;
use floe_server::proto;
use prost::Message;
use serde_json::json;

/// Decodes a `ForwardBackwardOutput` result: the loss and each datum's log-prob count.
fn loss_of(reply: &Reply) -> (f64, Vec<usize>) {
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.content_type,
        "application/x-protobuf",
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let out = proto::ForwardBackwardOutput::decode(&reply.body[..]).unwrap();
    let record = &out.loss_fn_outputs[0];
    let logprobs = &record.fields["logprobs"];
    let offsets: Vec<i64> = logprobs
        .offsets
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let lens = offsets
        .windows(2)
        .map(|w| ((w[1] - w[0]) / 4) as usize)
        .collect();
    assert_eq!(record.num_datums, 2);
    (out.metrics["loss:sum"], lens)
}

#[test]
fn auth_and_malformed_bodies_are_answered_with_json_errors() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let config_route = "/api/v1/client/config";
    let missing = request(addr, "POST", config_route, &[], b"{}");
    assert_eq!(missing.status, 401);
    assert!(missing.json()["detail"]
        .as_str()
        .unwrap()
        .contains("X-API-Key"));
    let wrong = request(
        addr,
        "POST",
        config_route,
        &[("X-API-Key", "tml-wrong")],
        b"{}",
    );
    assert_eq!(wrong.status, 401);
    let ok = request(addr, "POST", config_route, &[("X-API-Key", KEY)], b"{}");
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["pjwt_auth_enabled"], false);
    // Health checks need no key.
    assert_eq!(
        request(addr, "GET", "/api/v1/healthz", &[], b"").status,
        200
    );

    let bad = request(
        addr,
        "POST",
        "/api/v1/create_session",
        &[("X-API-Key", KEY)],
        b"{not json",
    );
    assert_eq!(bad.status, 400);
    assert!(
        bad.json()["detail"]
            .as_str()
            .unwrap()
            .contains("invalid JSON"),
        "{:?}",
        bad.json()
    );
    let bad_proto = post_proto(addr, "forward_backward", b"\xff\xff\xff");
    assert_eq!(bad_proto.status, 400);
    assert!(bad_proto.json()["detail"]
        .as_str()
        .unwrap()
        .contains("protobuf"));
    let too_big = post_json(
        addr,
        "create_session",
        &json!({ "tags": ["x".repeat(2 << 20)] }),
    );
    assert_eq!(too_big.status, 413);
    assert!(too_big.json()["detail"].is_string());
    let unknown_base = post_json(
        addr,
        "create_model",
        &json!({"session_id": "nope", "model_seq_id": 0, "base_model": "missing/model"}),
    );
    assert_eq!(unknown_base.status, 400);
    assert!(unknown_base.json()["detail"]
        .as_str()
        .unwrap()
        .contains(BASE_MODEL));
    let route = request(addr, "GET", "/nowhere", &[("X-API-Key", KEY)], b"");
    assert_eq!(route.status, 404);
    assert!(route.json()["detail"].is_string());
}

#[test]
fn training_runs_in_seq_order_and_gradients_accumulate_until_optim_step() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let (session_id, model_id) = create_model(addr);

    let info = post_json(
        addr,
        "get_info",
        &json!({"model_id": model_id, "type": "get_info"}),
    );
    assert_eq!(info.json()["model_data"]["model_name"], BASE_MODEL);

    // The optimizer step (seq 3) arrives before the two chunks it depends on (seq 1, 2);
    // it must wait for them, and its future long-polls until then.
    let step = request_id(&post_json(addr, "optim_step", &optim_body(&model_id, 3)));
    let early = post_json(addr, "retrieve_future", &json!({"request_id": step}));
    assert_eq!(early.json()["type"], "try_again");
    let second = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 2, false),
    ));
    let first = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 1, false),
    ));
    // A re-sent request gets its original future.
    assert_eq!(
        request_id(&post_proto(
            addr,
            "forward_backward",
            &fwdbwd_body(&model_id, 1, false)
        )),
        first
    );
    let (loss1, lens) = loss_of(&retrieve(addr, &first));
    let (loss2, _) = loss_of(&retrieve(addr, &second));
    assert_eq!(lens, vec![4, 2]);
    // Both chunks ran on the same weights: the step had not happened yet.
    assert!(
        (loss1 - loss2).abs() < 1e-4 * loss1.abs(),
        "{loss1} vs {loss2}"
    );
    let metrics = retrieve(addr, &step).json();
    assert!(
        metrics["metrics"]["grad_norm:mean"].as_f64().unwrap() > 0.0,
        "{metrics}"
    );

    let after = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 4, true),
    ));
    let (loss3, _) = loss_of(&retrieve(addr, &after));
    assert!(
        loss3 < loss1,
        "the step did not lower the loss: {loss1} -> {loss3}"
    );

    // Named checkpoint, then a sampling session on it.
    let save = json!({"model_id": model_id, "seq_id": 5, "path": "ckpt", "type": "save_weights_for_sampler"});
    let saved = retrieve(
        addr,
        &request_id(&post_json(addr, "save_weights_for_sampler", &save)),
    )
    .json();
    let path = format!("tinker://{model_id}/sampler_weights/ckpt");
    assert_eq!(saved["path"], path.as_str());
    let sampling = post_json(
        addr,
        "create_sampling_session",
        &json!({"session_id": session_id, "sampling_session_seq_id": 0, "model_path": path}),
    );
    let sampler_id = sampling.json()["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let sampler = request(
        addr,
        "GET",
        &format!("/api/v1/samplers/{sampler_id}"),
        &[("X-API-Key", KEY)],
        b"",
    );
    assert_eq!(sampler.json()["base_model"], BASE_MODEL);
    let sample = post_json(
        addr,
        "asample",
        &json!({
            "sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12, 13]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "stop": []},
            "prompt_logprobs": true, "type": "sample"
        }),
    );
    assert_eq!(
        sample.json()["sample_sequence_ids"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let result = retrieve(addr, &request_id(&sample));
    assert_eq!(result.content_type, "application/x-protobuf");
    let response = proto::SampleResponse::decode(&result.body[..]).unwrap();
    assert_eq!(response.sequences.len(), 2);
    for sequence in &response.sequences {
        // `stop: []` disables every stop, so each sample runs to max_tokens.
        assert_eq!(sequence.stop_reason, proto::STOP_REASON_LENGTH);
        assert_eq!(sequence.tokens.len(), 3 * 4);
        assert_eq!(sequence.logprobs.as_ref().unwrap().len(), 3 * 4);
    }
    let prompt_logprobs = response.prompt_logprobs.unwrap();
    assert_eq!(prompt_logprobs.len(), 3 * 4);
    assert!(f32::from_le_bytes(prompt_logprobs[..4].try_into().unwrap()).is_nan());

    let finish = post_json(
        addr,
        &format!("sessions/{session_id}/finish"),
        &json!({"reason": {"type": "success"}}),
    );
    assert_eq!(finish.status, 200);
    let heartbeat = post_json(
        addr,
        "session_heartbeat",
        &json!({"session_id": session_id, "type": "session_heartbeat"}),
    );
    assert_eq!(heartbeat.status, 410);
}

#[test]
fn zstd_bodies_are_read_and_finished_futures_expire_with_410() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.future_expiry = Duration::from_millis(200);
    let addr = start(config);
    let (_, model_id) = create_model(addr);
    // A zstd-compressed body (the SDK's proto_compress_fwdbwd).
    let compressed = zstd::encode_all(&fwdbwd_body(&model_id, 1, true)[..], 3).unwrap();
    let submitted = request(
        addr,
        "POST",
        "/api/v1/forward_backward",
        &[("X-API-Key", KEY), ("Content-Encoding", "zstd")],
        &compressed,
    );
    let id = request_id(&submitted);
    loss_of(&retrieve(addr, &id));
    std::thread::sleep(Duration::from_millis(800));
    let gone = post_json(addr, "retrieve_future", &json!({"request_id": id}));
    assert_eq!(gone.status, 410);
    assert!(gone.json()["detail"].as_str().unwrap().contains("expired"));
    let unknown = post_json(
        addr,
        "retrieve_future",
        &json!({"request_id": "req-999999"}),
    );
    assert_eq!(unknown.status, 404);
}

#[test]
fn invalid_requests_fail_in_turn_and_a_full_queue_answers_429() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.max_queued_per_engine = 2;
    let addr = start(config);
    let (_, model_id) = create_model(addr);
    // A datum whose targets are outside the vocabulary fails inside its future and still
    // takes its seq_id, so the next request runs.
    let mut bad =
        proto::ForwardBackwardRequest::decode(&fwdbwd_body(&model_id, 1, false)[..]).unwrap();
    bad.data[0].loss_fn_inputs.insert(
        "target_tokens".into(),
        tensor(
            [9i64, 9, 9, 100_000]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect(),
            proto::DTYPE_INT64,
            4,
        ),
    );
    let failed = retrieve(
        addr,
        &request_id(&post_proto(addr, "forward_backward", &bad.encode_to_vec())),
    );
    let failure = failed.json();
    assert_eq!(failure["category"], "user");
    assert!(
        failure["error"].as_str().unwrap().contains("vocabulary"),
        "{failure}"
    );
    let next = request_id(&post_proto(
        addr,
        "forward_backward",
        &fwdbwd_body(&model_id, 2, true),
    ));
    loss_of(&retrieve(addr, &next));

    // seq 3 is missing: 4 and 5 wait for it, and the queue (2) is then full.
    request_id(&post_json(addr, "optim_step", &optim_body(&model_id, 4)));
    request_id(&post_json(addr, "optim_step", &optim_body(&model_id, 5)));
    let full = post_json(addr, "optim_step", &optim_body(&model_id, 6));
    assert_eq!(full.status, 429);
    assert!(full.json()["detail"]
        .as_str()
        .unwrap()
        .contains("unfinished"));
}

#[test]
fn any_target_tokens_are_scored_where_the_input_puts_them() {
    // Some clients fill the targets of masked prompt positions with 0; the hosted service
    // scores whatever target_tokens say. Positions whose target is the next input token
    // must score as in the usual datum, and the others score their own target.
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let (_, model_id) = create_model(addr);
    let usual = datum(&[11, 12, 13, 14, 15]);
    let mut zero_filled = usual.clone();
    zero_filled.loss_fn_inputs.insert(
        "target_tokens".into(),
        tensor(
            [0i64, 0, 14, 15]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect(),
            proto::DTYPE_INT64,
            4,
        ),
    );
    let request = proto::ForwardBackwardRequest {
        model_id: model_id.clone(),
        seq_id: 1,
        data: vec![usual, zero_filled],
        loss_fn: "cross_entropy".into(),
        forward_only: true,
        ..Default::default()
    };
    let reply = retrieve(
        addr,
        &request_id(&post_proto(
            addr,
            "forward_backward",
            &request.encode_to_vec(),
        )),
    );
    let logprobs = logprobs_of(&reply);
    assert_eq!(logprobs[1][2..], logprobs[0][2..]);
    for (zero, usual) in logprobs[1][..2].iter().zip(&logprobs[0][..2]) {
        assert_ne!(zero, usual);
        assert!(zero.is_finite() && *zero <= 0.0);
    }
    // And it trains: the same datum through forward_backward.
    let train = proto::ForwardBackwardRequest {
        seq_id: 2,
        forward_only: false,
        ..request
    };
    loss_of(&retrieve(
        addr,
        &request_id(&post_proto(
            addr,
            "forward_backward",
            &train.encode_to_vec(),
        )),
    ));
}
