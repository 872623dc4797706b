//! Issue 20, `floe serve` under load: 64 concurrent clients (4 on each of 16 LoRA models
//! of the embedded tiny model) issue mixed verbs for a bounded time: `forward_backward`,
//! `optim_step`, `asample`, `save_weights` + `load_weights`, and `retrieve_future` again on
//! finished futures. Every request must be answered exactly once with a result of its
//! kind, every future must complete, the process's memory must stay bounded, and the
//! latency percentiles per verb are printed.
//!
//! `FLOE_LOAD_SECS` sets the time (20 s by default):
//! `FLOE_LOAD_SECS=300 cargo test -p floe-server --test load -- --nocapture` (the test
//! profile is optimised).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use floe_server::proto;
use prost::Message;
use serde_json::json;

const CLIENTS: usize = 64;
const CLIENTS_PER_MODEL: usize = 4;
const SAMPLE_TOKENS: usize = 4;
/// How long a future may stay unfinished before the test calls it lost.
const FUTURE_TIMEOUT: Duration = Duration::from_secs(120);
/// Finished futures are kept this long (the server's `--future-expiry-secs` here).
const FUTURE_EXPIRY: Duration = Duration::from_secs(5);

/// Polls `request_id` until it is no longer `try_again`; fails after `timeout`.
fn retrieve_within(addr: SocketAddr, request_id: &str, timeout: Duration) -> Reply {
    let deadline = Instant::now() + timeout;
    loop {
        let reply = post_json(
            addr,
            "retrieve_future",
            &json!({ "request_id": request_id, "allow_metadata_only": false }),
        );
        let again = reply.status == 200
            && reply.content_type.contains("json")
            && reply.json()["type"] == "try_again";
        if !again {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "future {request_id} unfinished after {timeout:?}"
        );
    }
}

/// The process's resident memory (`VmRSS` of /proc/self/status), in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib / 1024.0
}

/// A model shared by [`CLIENTS_PER_MODEL`] clients, who take its request order (`seq_id`)
/// from one counter, so the server sees their requests interleaved.
struct Model {
    id: String,
    sampler: String,
    next_seq: AtomicI64,
}

impl Model {
    fn create(addr: SocketAddr) -> Model {
        let (_, id) = create_model(addr);
        let submitted = post_json(
            addr,
            "save_weights_for_sampler",
            &json!({"model_id": id, "seq_id": 1, "sampling_session_seq_id": 0}),
        );
        let sampler = retrieve(addr, &request_id(&submitted)).json()["sampling_session_id"]
            .as_str()
            .unwrap()
            .to_string();
        Model {
            id,
            sampler,
            next_seq: AtomicI64::new(2),
        }
    }

    fn seq(&self) -> i64 {
        self.next_seq.fetch_add(1, Ordering::SeqCst)
    }
}

/// What the clients saw, merged.
#[derive(Default)]
struct Tally {
    /// Latencies (submit to result) per verb, in milliseconds.
    latencies: BTreeMap<&'static str, Vec<f64>>,
    /// Every request id the server issued.
    request_ids: Vec<String>,
}

/// A tiny xorshift generator per client.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Submits with `submit` (its reply must be a future), retrieves the result and checks it
/// with `check`; returns the request id and the result's bytes.
fn call(
    addr: SocketAddr,
    submit: impl FnOnce() -> Reply,
    check: impl FnOnce(&Reply),
) -> (String, Vec<u8>) {
    let id = request_id(&submit());
    let reply = retrieve_within(addr, &id, FUTURE_TIMEOUT);
    assert_eq!(
        reply.status,
        200,
        "{id}: {}",
        String::from_utf8_lossy(&reply.body)
    );
    check(&reply);
    (id, reply.body)
}

fn json_type(reply: &Reply, kind: &str) {
    let value = reply.json();
    assert_eq!(value["type"], kind, "{value}");
}

/// One client's loop until `until`: a random verb at a time.
fn client(addr: SocketAddr, index: usize, model: &Model, until: Instant, tally: &Mutex<Tally>) {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9));
    let mut latencies: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let mut ids = Vec::new();
    let mut last_finished: Option<(String, Vec<u8>, Instant)> = None;
    let mut samples = 0u64;
    while Instant::now() < until {
        let started = Instant::now();
        let (verb, done) = match rng.below(20) {
            0..=6 => {
                let seq = model.seq() as i32;
                let done = call(
                    addr,
                    || {
                        post_proto(
                            addr,
                            "forward_backward",
                            &fwdbwd_body(&model.id, seq, false),
                        )
                    },
                    |reply| {
                        let lens: Vec<usize> = logprobs_of(reply).iter().map(Vec::len).collect();
                        assert_eq!(lens, [4, 2]);
                    },
                );
                ("forward_backward", vec![done])
            }
            7..=9 => {
                let seq = model.seq();
                let done = call(
                    addr,
                    || post_json(addr, "optim_step", &optim_body(&model.id, seq)),
                    |reply| json_type(reply, "optim_step"),
                );
                ("optim_step", vec![done])
            }
            10..=15 => {
                samples += 1;
                // Sample ids are the request's own (not ordered), unique per client.
                let seq = (index as u64) << 32 | samples;
                let body = json!({
                    "sampling_session_id": model.sampler, "seq_id": seq, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12, 13]}]},
                    "sampling_params": {"max_tokens": SAMPLE_TOKENS, "seed": seq, "stop": [],
                                        "temperature": 1.0, "top_k": -1, "top_p": 1.0},
                    "type": "sample",
                });
                let done = call(
                    addr,
                    || post_json(addr, "asample", &body),
                    |reply| {
                        assert_eq!(reply.content_type, "application/x-protobuf");
                        let response = proto::SampleResponse::decode(&reply.body[..]).unwrap();
                        assert_eq!(response.sequences[0].tokens.len() / 4, SAMPLE_TOKENS);
                    },
                );
                ("sample", vec![done])
            }
            16..=17 => {
                // One checkpoint name per client, overwritten, so the disk stays bounded.
                let name = format!("load-{index}");
                let seq = model.seq();
                let body = json!({"model_id": model.id, "seq_id": seq, "path": name,
                                  "overwrite": true});
                let saved = call(
                    addr,
                    || post_json(addr, "save_weights", &body),
                    |reply| json_type(reply, "save_weights"),
                );
                let path = serde_json::from_slice::<serde_json::Value>(&saved.1).unwrap()["path"]
                    .as_str()
                    .unwrap()
                    .to_string();
                let seq = model.seq();
                let body = json!({"model_id": model.id, "seq_id": seq, "path": path,
                                  "optimizer": true});
                let loaded = call(
                    addr,
                    || post_json(addr, "load_weights", &body),
                    |reply| json_type(reply, "load_weights"),
                );
                ("save+load", vec![saved, loaded])
            }
            _ => {
                // A finished future asked again (well before it expires) answers the same
                // bytes.
                let Some((id, body, at)) = &last_finished else {
                    continue;
                };
                if at.elapsed() > FUTURE_EXPIRY / 2 {
                    continue;
                }
                let again = retrieve_within(addr, id, FUTURE_TIMEOUT);
                assert_eq!(again.status, 200, "{id} asked again");
                assert_eq!(
                    &again.body, body,
                    "{id} answered differently the second time"
                );
                ("retrieve_future", Vec::new())
            }
        };
        latencies
            .entry(verb)
            .or_default()
            .push(started.elapsed().as_secs_f64() * 1e3);
        for (id, body) in done {
            ids.push(id.clone());
            last_finished = Some((id, body, Instant::now()));
        }
    }
    let mut tally = tally.lock().unwrap();
    for (verb, mut values) in latencies {
        tally.latencies.entry(verb).or_default().append(&mut values);
    }
    tally.request_ids.append(&mut ids);
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn sixty_four_clients_with_mixed_verbs_are_all_answered_once_in_bounded_memory() {
    let secs: u64 = std::env::var("FLOE_LOAD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    // Finished futures are kept for this long: the steady state comes within the test.
    config.future_expiry = FUTURE_EXPIRY;
    let addr = start(config);
    let models: Vec<Arc<Model>> = (0..CLIENTS / CLIENTS_PER_MODEL)
        .map(|_| Arc::new(Model::create(addr)))
        .collect();
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    // RSS once every engine has run each verb for a while, and at the end.
    let warm_at = started + Duration::from_secs(secs / 4);
    let warm_rss = Arc::new(AtomicU64::new(0));
    let peak_rss = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (warm_rss, peak_rss) = (Arc::clone(&warm_rss), Arc::clone(&peak_rss));
        std::thread::spawn(move || {
            while Instant::now() < until {
                std::thread::sleep(Duration::from_millis(250));
                let rss = rss_mib().to_bits();
                if Instant::now() >= warm_at && warm_rss.load(Ordering::SeqCst) == 0 {
                    warm_rss.store(rss, Ordering::SeqCst);
                }
                if f64::from_bits(rss) > f64::from_bits(peak_rss.load(Ordering::SeqCst)) {
                    peak_rss.store(rss, Ordering::SeqCst);
                }
            }
        })
    };
    let rss_before = rss_mib();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|index| {
            let (model, tally) = (
                Arc::clone(&models[index / CLIENTS_PER_MODEL]),
                Arc::clone(&tally),
            );
            std::thread::spawn(move || client(addr, index, &model, until, &tally))
        })
        .collect();
    for client in clients {
        client.join().expect("a client failed");
    }
    let elapsed = started.elapsed().as_secs_f64();
    sampler.join().unwrap();
    let rss_after = rss_mib();
    let warm = f64::from_bits(warm_rss.load(Ordering::SeqCst));
    let peak = f64::from_bits(peak_rss.load(Ordering::SeqCst));

    let tally = tally.lock().unwrap();
    let unique: HashSet<&String> = tally.request_ids.iter().collect();
    assert_eq!(
        unique.len(),
        tally.request_ids.len(),
        "a request id was issued twice"
    );
    let total: usize = tally.latencies.values().map(Vec::len).sum();
    println!(
        "{CLIENTS} clients, {secs} s ({elapsed:.1} s with the last answers): {total} calls, \
         {} futures, {:.1} calls/s",
        tally.request_ids.len(),
        total as f64 / elapsed
    );
    println!(
        "{:<17} {:>7} {:>9} {:>9} {:>9}",
        "verb", "calls", "p50 ms", "p95 ms", "p99 ms"
    );
    for (verb, values) in &tally.latencies {
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "{verb:<17} {:>7} {:>9.1} {:>9.1} {:>9.1}",
            sorted.len(),
            percentile(&sorted, 0.50),
            percentile(&sorted, 0.95),
            percentile(&sorted, 0.99)
        );
    }
    println!(
        "RSS: {rss_before:.0} MiB before the clients, {warm:.0} MiB at {}s, peak {peak:.0} MiB, \
         {rss_after:.0} MiB after",
        secs / 4
    );
    for verb in [
        "forward_backward",
        "optim_step",
        "sample",
        "save+load",
        "retrieve_future",
    ] {
        assert!(
            tally.latencies.get(verb).is_some_and(|v| !v.is_empty()),
            "no {verb} call was made"
        );
    }
    // Bounded: after the warm-up, growth stays within a fixed allowance (allocator slack,
    // futures kept until they expire), not proportional to the requests served.
    assert!(
        rss_after <= warm * 1.25 + 64.0,
        "RSS grew from {warm:.0} MiB to {rss_after:.0} MiB under load"
    );
}
