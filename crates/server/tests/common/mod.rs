//! A server on an ephemeral loopback port and a minimal HTTP/1.1 client for the tests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use floe_engine::LocalEngineOptions;
use floe_server::{proto, ApiKeys, Auth, Catalog, SampleBatchLimits, ServerConfig};

/// The key the test servers accept.
pub const KEY: &str = "tml-test-key";
/// The base model name the test servers offer (the embedded tiny model).
pub const BASE_MODEL: &str = "floe/tiny";

/// Whether the `tinker` SDK can be imported; when not, says the test is skipped.
pub fn tinker_sdk_installed() -> bool {
    let installed = std::process::Command::new("python3")
        .args(["-c", "import tinker"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !installed {
        eprintln!("skipped: the tinker SDK is not installed (pip install tinker==0.38.0)");
    }
    installed
}

/// A test server's config: the embedded tiny model, small KV cache, short long-poll.
pub fn config(data_dir: &Path) -> ServerConfig {
    ServerConfig {
        catalog: Catalog::from_specs(&[format!("{BASE_MODEL}=embedded:tiny")]).unwrap(),
        data_dir: data_dir.to_path_buf(),
        auth: Auth::Keys(Arc::new(ApiKeys::fixed([KEY]))),
        engine: LocalEngineOptions {
            kv_cache_bytes: Some(16 << 20),
            max_running_seqs: 16,
            ..LocalEngineOptions::default()
        },
        long_poll: Duration::from_secs(2),
        future_expiry: Duration::from_secs(60),
        session_expiry: Duration::from_secs(600),
        max_body_bytes: 1 << 20,
        max_queued_per_engine: 64,
        sample_batch: SampleBatchLimits::default(),
    }
}

/// Starts a server on its own runtime thread; returns its address.
pub fn start(config: ServerConfig) -> SocketAddr {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            sender.send(listener.local_addr().unwrap()).unwrap();
            floe_server::serve(listener, config).await.unwrap();
        });
    });
    receiver.recv().unwrap()
}

/// A server that can be stopped, as a process exit would stop it: connections close,
/// its tasks and engines are dropped, only files on disk remain.
pub struct Stoppable {
    /// Its address.
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Stoppable {
    /// Starts a server on its own runtime thread.
    pub fn start(config: ServerConfig) -> Self {
        let (addr_sender, addr_receiver) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_sender.send(listener.local_addr().unwrap()).unwrap();
                tokio::select! {
                    served = floe_server::serve(listener, config) => served.unwrap(),
                    _ = stopped => {}
                }
            });
            // Dropping the runtime drops every task (open connections, long polls, the
            // expiry loop) and with them the server state and its engine handles.
            runtime.shutdown_background();
        });
        Self {
            addr: addr_receiver.recv().unwrap(),
            stop,
            thread,
        }
    }

    /// Stops the server and waits until its runtime is gone.
    pub fn stop(self) {
        let _ = self.stop.send(());
        self.thread.join().unwrap();
    }
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Content-Type header.
    pub content_type: String,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Sends one request (`Connection: close`) and reads the whole answer.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    // A server may answer an oversize body and close before reading all of it; its answer
    // is still there to read.
    let wrote = stream.write_all(body);
    let mut raw = Vec::new();
    if let Err(error) = stream.read_to_end(&mut raw) {
        assert!(
            !raw.is_empty(),
            "no answer: {error} (writing the body: {wrote:?})"
        );
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no header end");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let mut content_type = String::new();
    let mut chunked = false;
    for line in lines {
        let (name, value) = line.split_once(':').unwrap();
        match name.to_ascii_lowercase().as_str() {
            "content-type" => content_type = value.trim().to_string(),
            "transfer-encoding" => chunked = value.trim().eq_ignore_ascii_case("chunked"),
            _ => {}
        }
    }
    let mut body = raw[split + 4..].to_vec();
    if chunked {
        body = dechunk(&body);
    }
    Reply {
        status,
        content_type,
        body,
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let end = raw.windows(2).position(|w| w == b"\r\n").unwrap();
        let size =
            usize::from_str_radix(std::str::from_utf8(&raw[..end]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[end + 2..end + 2 + size]);
        raw = &raw[end + 4 + size..];
    }
}

/// POSTs JSON with the test key.
pub fn post_json(addr: SocketAddr, route: &str, body: &serde_json::Value) -> Reply {
    request(
        addr,
        "POST",
        &format!("/api/v1/{route}"),
        &[("X-API-Key", KEY), ("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// POSTs protobuf bytes with the test key.
pub fn post_proto(addr: SocketAddr, route: &str, body: &[u8]) -> Reply {
    request(
        addr,
        "POST",
        &format!("/api/v1/{route}"),
        &[
            ("X-API-Key", KEY),
            ("Content-Type", "application/x-protobuf"),
        ],
        body,
    )
}

/// Polls a future until it is no longer `try_again`.
pub fn retrieve(addr: SocketAddr, request_id: &str) -> Reply {
    loop {
        let reply = post_json(
            addr,
            "retrieve_future",
            &serde_json::json!({ "request_id": request_id, "allow_metadata_only": false }),
        );
        let again = reply.status == 200
            && reply.content_type.contains("json")
            && reply.json()["type"] == "try_again";
        if !again {
            return reply;
        }
    }
}

/// Creates a session and a model on [`BASE_MODEL`]; returns `(session_id, model_id)`.
pub fn create_model(addr: SocketAddr) -> (String, String) {
    let session = post_json(
        addr,
        "create_session",
        &serde_json::json!({"tags": [], "user_metadata": {}, "sdk_version": "test", "type": "create_session"}),
    );
    assert_eq!(session.status, 200, "{:?}", session);
    let session_id = session.json()["session_id"].as_str().unwrap().to_string();
    let created = post_json(
        addr,
        "create_model",
        &serde_json::json!({
            "session_id": session_id, "model_seq_id": 0, "base_model": BASE_MODEL,
            "lora_config": {"rank": 8}, "optimizer_config": {"type": "adamw"}, "type": "create_model"
        }),
    );
    assert_eq!(
        created.status,
        200,
        "{}",
        String::from_utf8_lossy(&created.body)
    );
    let request_id = created.json()["request_id"].as_str().unwrap().to_string();
    let result = retrieve(addr, &request_id).json();
    let model_id = result["model_id"].as_str().unwrap().to_string();
    assert_eq!(model_id, format!("{session_id}:train:0"));
    (session_id, model_id)
}

/// Token ids as the protobuf's int32 little-endian bytes.
pub fn tokens_bytes(tokens: &[i32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// A 1-D dense protobuf tensor.
pub fn tensor(values: Vec<u8>, dtype: i32, len: usize) -> proto::Tensor {
    proto::Tensor {
        encoding: Some(proto::tensor::Encoding::Dense(values)),
        dtype,
        shape: vec![len as i64],
    }
}

/// A next-token cross-entropy datum over `tokens`.
pub fn datum(tokens: &[i32]) -> proto::Datum {
    let n = tokens.len() - 1;
    let targets: Vec<u8> = tokens[1..]
        .iter()
        .flat_map(|&t| i64::from(t).to_le_bytes())
        .collect();
    let weights: Vec<u8> = (0..n).flat_map(|_| 1f32.to_le_bytes()).collect();
    proto::Datum {
        model_input: vec![proto::Chunk {
            chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
                tokens: tokens_bytes(&tokens[..n]),
            })),
        }],
        loss_fn_inputs: HashMap::from([
            (
                "target_tokens".to_string(),
                tensor(targets, proto::DTYPE_INT64, n),
            ),
            (
                "weights".to_string(),
                tensor(weights, proto::DTYPE_FLOAT32, n),
            ),
        ]),
    }
}

/// The `request_id` of a 200 submit answer.
pub fn request_id(reply: &Reply) -> String {
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()["request_id"].as_str().unwrap().to_string()
}

/// Each datum's `logprobs` from a `ForwardBackwardOutput` result.
pub fn logprobs_of(reply: &Reply) -> Vec<Vec<f32>> {
    assert_eq!(
        reply.content_type,
        "application/x-protobuf",
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let out = <proto::ForwardBackwardOutput as prost::Message>::decode(&reply.body[..]).unwrap();
    let field = &out.loss_fn_outputs[0].fields["logprobs"];
    let offsets: Vec<usize> = field
        .offsets
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
        .collect();
    offsets
        .windows(2)
        .map(|w| {
            field.data[w[0]..w[1]]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        })
        .collect()
}

/// A `forward_backward` body over two fixed datums (`forward_only` for `forward`).
pub fn fwdbwd_body(model_id: &str, seq_id: i32, forward_only: bool) -> Vec<u8> {
    let request = proto::ForwardBackwardRequest {
        model_id: model_id.to_string(),
        seq_id,
        data: vec![datum(&[11, 12, 13, 14, 15]), datum(&[21, 22, 23])],
        loss_fn: "cross_entropy".into(),
        forward_only,
        ..Default::default()
    };
    prost::Message::encode_to_vec(&request)
}

/// An `optim_step` body with a large learning rate (the tiny model moves visibly).
pub fn optim_body(model_id: &str, seq_id: i64) -> serde_json::Value {
    serde_json::json!({
        "model_id": model_id, "seq_id": seq_id, "type": "optim_step",
        "adam_params": {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                        "weight_decay": 0.0, "grad_clip_norm": 0.0}
    })
}
