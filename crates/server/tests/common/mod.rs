//! A server on an ephemeral loopback port and a minimal HTTP/1.1 client for the tests.

#![allow(dead_code)]

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use floe_server::{Auth, Catalog, ServerConfig};
use floe_trainer::local::LocalEngineOptions;

/// The key the test servers accept.
pub const KEY: &str = "tml-test-key";
/// The base model name the test servers offer (the embedded tiny model).
pub const BASE_MODEL: &str = "floe/tiny";

/// A test server's config: the embedded tiny model, small KV cache, short long-poll.
pub fn config(data_dir: &Path) -> ServerConfig {
    ServerConfig {
        catalog: Catalog::from_specs(&[format!("{BASE_MODEL}=embedded:tiny")]).unwrap(),
        data_dir: data_dir.to_path_buf(),
        auth: Auth::Keys(HashSet::from([KEY.to_string()])),
        engine: LocalEngineOptions {
            kv_cache_bytes: Some(16 << 20),
            max_running_seqs: 16,
            ..LocalEngineOptions::default()
        },
        long_poll: Duration::from_secs(2),
        future_expiry: Duration::from_secs(60),
        max_body_bytes: 1 << 20,
        max_queued_per_engine: 64,
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
    stream.write_all(body).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
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
