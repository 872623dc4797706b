//! Concurrent sample requests on one engine run as one engine call, those sent while it
//! runs joining it between steps: the worker level (a verb holds the engine while jobs
//! queue, or a sink queues jobs from the engine thread mid-batch, so the batches are
//! exact), then the Tinker, native and OpenAI routes over HTTP. Seeded samples equal
//! those of requests run one at a time; a cancelled or refused request fails alone.

mod common;

use std::net::SocketAddr;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use common::*;
use floe_engine::{Generation, LocalEngineOptions, SampleRequest, SamplingParams};
use floe_server::futures::{CancelTicket, Futures, Outcome};
use floe_server::sample_batch::{
    SampleBatchLimits, SampleFailure, SampleJob, SampleSink, SampleStats,
};
use floe_server::worker::{open_engine, Worker, WorkerContext};
use prost::Message;
use serde_json::{json, Value};

/// A job queued by [`WorkerRig::queue_later`]: a sample job or a logged verb.
enum Later {
    Sample(Recorder, Vec<SampleRequest>),
    Verb(String),
}

/// What the worker test's sinks and verbs did, in order.
type Log = Arc<Mutex<Vec<String>>>;

/// A job's samples (sorted by request and index) or its failure.
type JobResult = Result<Vec<Generation>, SampleFailure>;

struct Recorder {
    job: usize,
    log: Log,
    generations: Vec<Generation>,
    done: mpsc::Sender<(usize, JobResult)>,
    /// Asks for progress reports.
    streams: bool,
    /// Runs on the engine thread at the first progress report, mid-batch.
    on_progress: Option<Box<dyn FnOnce() + Send>>,
    /// Has a preparation that must run before it samples.
    needs_prepare: bool,
}

impl SampleSink for Recorder {
    fn prepare(&mut self, _engine: &mut floe_engine::AnyLocalEngine) -> Result<(), SampleFailure> {
        if self.needs_prepare {
            self.log
                .lock()
                .unwrap()
                .push(format!("prepare {}", self.job));
        }
        Ok(())
    }

    fn needs_prepare(&self) -> bool {
        self.needs_prepare
    }

    fn streams(&self) -> bool {
        self.streams
    }

    fn progress(&mut self, _progress: floe_engine::SampleProgress<'_>) {
        if let Some(queue) = self.on_progress.take() {
            queue();
        }
    }

    fn generation(&mut self, generation: Generation) {
        self.log
            .lock()
            .unwrap()
            .push(format!("sample {}", self.job));
        self.generations.push(generation);
    }

    fn finish(mut self: Box<Self>, result: Result<(), SampleFailure>) -> Outcome {
        self.log.lock().unwrap().push(format!("done {}", self.job));
        self.generations
            .sort_by_key(|g| (g.request_id, g.sample_index));
        let Recorder {
            job,
            generations,
            done,
            ..
        } = *self;
        let _ = done.send((job, result.map(|()| generations)));
        Outcome::Json(Value::Null)
    }
}

/// Requests with their own seeds and settings (greedy, nucleus, stop strings, several
/// samples, two requests in one job).
fn job_requests(job: usize) -> Vec<SampleRequest> {
    let request = |id: u64, prompt: Vec<u32>, n: usize, params: SamplingParams| SampleRequest {
        id,
        prompt,
        n,
        params,
    };
    let params = |seed: u64, temperature: f32, top_p: f32, max_new_tokens: usize| SamplingParams {
        temperature,
        top_p,
        max_new_tokens,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let j = job as u32;
    match job % 4 {
        0 => vec![request(
            7,
            vec![11, 12, 13 + j],
            2,
            params(job as u64, 1.0, 1.0, 12),
        )],
        1 => vec![request(7, vec![20 + j, 5], 1, params(99, 0.0, 1.0, 9))],
        2 => vec![request(
            3,
            vec![30, 31, 32, 33, 34 + j],
            3,
            SamplingParams {
                stop_strings: vec!["e".into()],
                ..params(5 + job as u64, 0.8, 0.9, 16)
            },
        )],
        _ => vec![
            request(1, vec![40 + j], 1, params(1, 1.2, 1.0, 10)),
            request(2, vec![40 + j, 41], 2, params(2, 0.7, 0.5, 7)),
        ],
    }
}

struct WorkerRig {
    worker: Arc<Worker>,
    futures: Arc<Futures>,
    stats: Arc<SampleStats>,
    log: Log,
    done: mpsc::Sender<(usize, JobResult)>,
    results: mpsc::Receiver<(usize, JobResult)>,
}

impl WorkerRig {
    fn new(limits: SampleBatchLimits) -> Self {
        let catalog = floe_server::Catalog::from_specs(&["tiny=embedded:tiny"]).unwrap();
        let base = catalog.get("tiny").unwrap().load().unwrap();
        let options = LocalEngineOptions {
            kv_cache_bytes: Some(16 << 20),
            max_running_seqs: 16,
            ..LocalEngineOptions::default()
        };
        let futures = Arc::new(Futures::new(Duration::from_secs(60)));
        let stats = Arc::new(SampleStats::default());
        let context = WorkerContext {
            futures: Arc::clone(&futures),
            max_queued: 64,
            batch_limits: limits,
            sample_stats: Arc::clone(&stats),
        };
        let build = Box::new(move || open_engine(base.source, base.tokenizer, options));
        let worker = Arc::new(Worker::spawn("test engine".into(), build, None, &context).unwrap());
        let (done, results) = mpsc::channel();
        Self {
            worker,
            futures,
            stats,
            log: Log::default(),
            done,
            results,
        }
    }

    /// Holds the engine until the returned sender is dropped or sent to.
    fn hold(&self) -> mpsc::Sender<()> {
        let (release, released) = mpsc::channel::<()>();
        let log = Arc::clone(&self.log);
        let job = Box::new(move |_: &mut floe_engine::AnyLocalEngine| {
            let _ = released.recv();
            log.lock().unwrap().push("hold".into());
            Outcome::Json(Value::Null)
        });
        self.worker.send(self.futures.issue(), job).unwrap();
        release
    }

    fn verb(&self, name: &str) {
        self.queue_later(vec![Later::Verb(name.to_string())])();
    }

    /// A sink that records job `job`.
    fn recorder(&self, job: usize) -> Recorder {
        Recorder {
            job,
            log: Arc::clone(&self.log),
            generations: Vec::new(),
            done: self.done.clone(),
            streams: false,
            on_progress: None,
            needs_prepare: false,
        }
    }

    /// Queues job `job` with `requests`; returns its future.
    fn sample(
        &self,
        job: usize,
        requests: Vec<SampleRequest>,
        cancel: Option<CancelTicket>,
    ) -> u64 {
        self.sample_into(self.recorder(job), requests, cancel)
    }

    /// Queues `requests` for `sink`; returns its future.
    fn sample_into(
        &self,
        sink: Recorder,
        requests: Vec<SampleRequest>,
        cancel: Option<CancelTicket>,
    ) -> u64 {
        let id = self.futures.issue();
        let job = SampleJob {
            requests,
            cancel,
            sink: Box::new(sink),
        };
        self.worker.send_sample(id, job).unwrap();
        id
    }

    /// What queues `later` in order when called (from any thread).
    fn queue_later(&self, later: Vec<Later>) -> Box<dyn FnOnce() + Send> {
        let (worker, futures, log) = (
            Arc::clone(&self.worker),
            Arc::clone(&self.futures),
            Arc::clone(&self.log),
        );
        let tasks: Vec<_> = later
            .into_iter()
            .map(|later| match later {
                Later::Sample(sink, requests) => {
                    let job = SampleJob {
                        requests,
                        cancel: None,
                        sink: Box::new(sink),
                    };
                    Err((futures.issue(), job))
                }
                Later::Verb(name) => {
                    let log = Arc::clone(&log);
                    let job: floe_server::worker::Job =
                        Box::new(move |_: &mut floe_engine::AnyLocalEngine| {
                            log.lock().unwrap().push(name);
                            Outcome::Json(Value::Null)
                        });
                    Ok((futures.issue(), job))
                }
            })
            .collect();
        Box::new(move || {
            for task in tasks {
                match task {
                    Ok((id, job)) => worker.send(id, job).unwrap(),
                    Err((id, job)) => worker.send_sample(id, job).unwrap(),
                }
            }
        })
    }

    /// The results of `count` jobs, by job.
    fn results(&self, count: usize) -> Vec<JobResult> {
        let mut results: Vec<Option<JobResult>> = (0..count).map(|_| None).collect();
        for _ in 0..count {
            let (job, result) = self.results.recv_timeout(Duration::from_secs(120)).unwrap();
            results[job] = Some(result);
        }
        results.into_iter().map(Option::unwrap).collect()
    }

    /// Waits until every job sent so far has run (and its batch is counted).
    fn sync(&self) {
        let (ran, wait) = mpsc::channel();
        let job = Box::new(move |_: &mut floe_engine::AnyLocalEngine| {
            let _ = ran.send(());
            Outcome::Json(Value::Null)
        });
        self.worker.send(self.futures.issue(), job).unwrap();
        wait.recv_timeout(Duration::from_secs(120)).unwrap();
    }

    /// Runs job `job` alone and waits for it.
    fn alone(&self, job: usize, requests: Vec<SampleRequest>) -> JobResult {
        self.sample(job, requests, None);
        let (done, result) = self.results.recv_timeout(Duration::from_secs(120)).unwrap();
        assert_eq!(done, job);
        result
    }
}

/// Log-probs of the same tokens computed in steps of different row counts: the CPU
/// GEMM picks its blocking of the inner dimension by the matrix shape, so a row's sums
/// round differently (a few ulp); the engine's own batch-invariance test allows the same.
const LOGPROB_ROUNDING: f64 = 1e-5;

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < LOGPROB_ROUNDING, "{what}: {x} vs {y}");
    }
}

/// Same samples: tokens, stop reasons, texts and ids exactly, log-probs up to rounding.
fn assert_same_generations(a: &[Generation], b: &[Generation], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(
            (
                x.request_id,
                x.sample_index,
                &x.tokens,
                &x.stop_reason,
                &x.text
            ),
            (
                y.request_id,
                y.sample_index,
                &y.tokens,
                &y.stop_reason,
                &y.text
            ),
            "{what}"
        );
        let widen = |g: &Generation| g.logprobs.iter().map(|&l| f64::from(l)).collect::<Vec<_>>();
        assert_close(&widen(x), &widen(y), what);
    }
}

fn position(log: &[String], entry: &str) -> usize {
    log.iter()
        .position(|e| e == entry)
        .unwrap_or_else(|| panic!("{entry:?} is not in {log:?}"))
}

#[test]
fn queued_sample_jobs_run_as_one_engine_call_without_passing_a_verb() {
    let rig = WorkerRig::new(SampleBatchLimits::default());
    let release = rig.hold();
    // Jobs 0..6 queue behind the held engine, then a verb, then jobs 6..8. Job 4 is
    // refused by the engine (top_p 0), job 5 is cancelled before its batch starts.
    for job in 0..6 {
        let mut requests = job_requests(job);
        if job == 4 {
            requests[0].params.top_p = 0.0;
        }
        let ticket = CancelTicket::default();
        let id = rig.sample(job, requests, Some(ticket.clone()));
        rig.futures.set_cancel_ticket(id, ticket);
        if job == 5 {
            assert!(rig.futures.cancel(id));
        }
    }
    rig.verb("optim_step");
    for job in 6..8 {
        rig.sample(job, job_requests(job), None);
    }
    release.send(()).unwrap();
    let batched = rig.results(8);
    rig.sync();
    let log = rig.log.lock().unwrap().clone();

    // Two batches, one engine call each: the jobs before the verb, then those after it
    // (the refused request fails alone, the rest of its batch unchanged).
    let stats = rig.stats.snapshot();
    assert_eq!((stats.batches, stats.jobs), (2, 8), "{stats:?}");
    assert_eq!(stats.engine_calls, 2, "{stats:?}");
    let verb = position(&log, "optim_step");
    for job in [0, 1, 2, 3] {
        assert!(position(&log, &format!("done {job}")) < verb, "{log:?}");
    }
    for job in [6, 7] {
        assert!(position(&log, &format!("sample {job}")) > verb, "{log:?}");
    }
    let refused = batched[4].as_ref().unwrap_err();
    assert!(refused.by_request, "{refused:?}");
    assert!(refused.message.contains("sample request 7") && refused.message.contains("top_p"));
    let cancelled = batched[5].as_ref().unwrap_err();
    assert!(cancelled.message.contains("cancelled"), "{cancelled:?}");

    // Each job alone gives the same samples under the client's request ids.
    for job in [0, 1, 2, 3, 6, 7] {
        let alone = rig.alone(job, job_requests(job)).unwrap();
        let together = batched[job].as_ref().unwrap();
        assert_same_generations(&alone, together, &format!("job {job}"));
        let expected: usize = job_requests(job).iter().map(|r| r.n).sum();
        assert_eq!(together.len(), expected);
    }
}

/// A batch holds jobs of at most its limits unanswered: the others wait in arrival order
/// at the front of the queue and join as the batch's jobs are answered.
#[test]
fn a_batch_stays_within_its_limits_and_takes_jobs_as_room_frees() {
    let limits = SampleBatchLimits {
        max_samples: 4,
        max_tokens: usize::MAX,
    };
    let rig = WorkerRig::new(limits);
    let release = rig.hold();
    let two_samples = |seed: u64| {
        let mut requests = job_requests(0);
        requests[0].params.seed = Some(seed);
        requests
    };
    for job in 0..5 {
        rig.sample(job, two_samples(job as u64), None);
    }
    release.send(()).unwrap();
    rig.results(5);
    rig.sync();
    let log = rig.log.lock().unwrap().clone();
    let stats = rig.stats.snapshot();
    // 2 + 2 samples fill the batch; each later job joins once a job is answered, before
    // the batch could end.
    assert_eq!((stats.batches, stats.jobs), (1, 5), "{stats:?}");
    assert_eq!(stats.joined_jobs, 3, "{stats:?}");
    for job in 2..5 {
        let first_sample = position(&log, &format!("sample {job}"));
        let done_before = (0..job)
            .filter(|j| position(&log, &format!("done {j}")) < first_sample)
            .count();
        assert!(
            done_before + 1 >= job,
            "job {job} ran beside two others: {log:?}"
        );
    }
}

/// Jobs queued while a batch runs (from the engine thread, at its first job's first
/// progress report, so they are queued before the engine's next step) join it: one
/// samples as alone and one the engine refuses fails alone, while the batch goes on. A
/// job that must prepare on the engine, and the job behind it, start the next batch
/// instead; so does a job queued behind a verb, which runs after the verb.
#[test]
fn sample_jobs_queued_while_a_batch_runs_join_it_but_never_pass_a_verb() {
    let rig = WorkerRig::new(SampleBatchLimits::default());
    let release = rig.hold();
    let mut refused = job_requests(2);
    refused[0].params.top_p = 0.0;
    let needs_prepare = Recorder {
        needs_prepare: true,
        ..rig.recorder(3)
    };
    let first = Recorder {
        streams: true,
        on_progress: Some(rig.queue_later(vec![
            Later::Sample(rig.recorder(1), job_requests(1)),
            Later::Sample(rig.recorder(2), refused),
            Later::Sample(needs_prepare, job_requests(3)),
            Later::Sample(rig.recorder(4), job_requests(4)),
        ])),
        ..rig.recorder(0)
    };
    rig.sample_into(first, job_requests(0), None);
    release.send(()).unwrap();
    let joined = rig.results(5);
    rig.sync();

    let stats = rig.stats.snapshot();
    // Batch 1: job 0, with jobs 1 and 2 joined mid-run (2 refused); batch 2: jobs 3, 4.
    assert_eq!(
        (stats.batches, stats.jobs, stats.joined_jobs),
        (2, 5, 2),
        "{stats:?}"
    );
    assert_eq!(stats.engine_calls, 2, "{stats:?}");
    let refused = joined[2].as_ref().unwrap_err();
    assert!(refused.by_request, "{refused:?}");
    assert!(refused.message.contains("sample request 3") && refused.message.contains("top_p"));
    let log = rig.log.lock().unwrap().clone();
    for job in [0, 1] {
        assert!(
            position(&log, &format!("done {job}")) < position(&log, "prepare 3"),
            "{log:?}"
        );
    }
    for job in [0, 1, 3, 4] {
        let alone = rig.alone(job, job_requests(job)).unwrap();
        assert_same_generations(&alone, joined[job].as_ref().unwrap(), &format!("job {job}"));
    }

    // A job queued mid-batch behind a verb waits for the verb, which waits for the batch.
    rig.sync();
    let before = rig.stats.snapshot();
    let start = rig.log.lock().unwrap().len();
    let first = Recorder {
        streams: true,
        on_progress: Some(rig.queue_later(vec![
            Later::Verb("optim_step".into()),
            Later::Sample(rig.recorder(1), job_requests(1)),
        ])),
        ..rig.recorder(0)
    };
    rig.sample_into(first, job_requests(0), None);
    rig.results(2);
    rig.sync();
    let stats = rig.stats.snapshot();
    assert_eq!(stats.batches - before.batches, 2, "{stats:?}");
    assert_eq!(stats.joined_jobs, before.joined_jobs, "{stats:?}");
    let log = rig.log.lock().unwrap()[start..].to_vec();
    let verb = position(&log, "optim_step");
    assert!(position(&log, "done 0") < verb, "{log:?}");
    assert!(verb < position(&log, "sample 1"), "{log:?}");
}

// ---- over HTTP ----

fn sampling_session(addr: SocketAddr) -> String {
    let session = post_json(
        addr,
        "create_session",
        &json!({"tags": [], "user_metadata": {}}),
    );
    let session_id = session.json()["session_id"].as_str().unwrap().to_string();
    let created = post_json(
        addr,
        "create_sampling_session",
        &json!({"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}),
    );
    created.json()["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The server's sample counters once they count `jobs` jobs and every batch begun has
/// ended (a job is answered before its batch ends and is counted).
fn stats(addr: SocketAddr, jobs: u64) -> Value {
    let mut sampling = Value::Null;
    for _ in 0..1000 {
        let reply = request(addr, "GET", "/floe/v1/stats", &[("X-API-Key", KEY)], b"");
        assert_eq!(reply.status, 200);
        sampling = reply.json()["sampling"].clone();
        let idle = sampling["batches"] == sampling["engine_calls"];
        if sampling["jobs"].as_u64().unwrap() >= jobs && idle {
            return sampling;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the server never counted {jobs} sample jobs with every batch done: {sampling}");
}

/// The samples of an `asample` answer: tokens exactly, log-probs up to rounding, prompt
/// log-probs exactly (a forward of the prompt alone either way).
fn assert_same_sample_response(a: &[u8], b: &[u8], what: &str) {
    use floe_server::proto::SampleResponse;
    let (a, b) = (
        SampleResponse::decode(a).unwrap(),
        SampleResponse::decode(b).unwrap(),
    );
    let floats = |bytes: &[u8]| -> Vec<f64> {
        bytes
            .chunks(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect()
    };
    assert_eq!(a.sequences.len(), b.sequences.len(), "{what}");
    for (x, y) in a.sequences.iter().zip(&b.sequences) {
        assert_eq!(
            (&x.tokens, x.stop_reason),
            (&y.tokens, y.stop_reason),
            "{what}"
        );
        let (lx, ly) = (
            x.logprobs.as_deref().unwrap(),
            y.logprobs.as_deref().unwrap(),
        );
        assert_close(&floats(lx), &floats(ly), what);
    }
    assert_eq!(a.prompt_logprobs, b.prompt_logprobs, "{what}");
}

/// A Tinker `asample` body of request `i`, each with its own seed and settings.
fn asample_body(sampler: &str, i: u64) -> Value {
    let stop = if i % 3 == 0 { json!([]) } else { Value::Null };
    let temperature = [1.0, 0.7, 0.0][i as usize % 3];
    let top_p = [1.0, 0.9][i as usize % 2];
    json!({
        "sampling_session_id": sampler, "seq_id": i, "num_samples": 1 + i % 3,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11 + i, 12, 13, 14 + i]}]},
        "sampling_params": {"max_tokens": 6 + i % 5, "seed": 1000 + i, "stop": stop,
                            "temperature": temperature, "top_k": -1, "top_p": top_p},
        "prompt_logprobs": i % 2 == 1,
    })
}

#[test]
fn concurrent_tinker_samples_share_engine_calls_and_equal_sequential_ones() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let sampler = sampling_session(addr);
    const N: u64 = 12;

    let sequential: Vec<Vec<u8>> = (0..N)
        .map(|i| {
            let id = request_id(&post_json(addr, "asample", &asample_body(&sampler, i)));
            retrieve(addr, &id).body
        })
        .collect();
    // (A request sent as the one before it is answered may join that one's batch.)
    let before = stats(addr, N);

    // A long sample holds the engine while the others queue behind it (the first may join
    // its batch; the second, with prompt log-probs, cannot, and the rest wait behind it
    // for the next batch); one of those is cancelled and one is refused by the engine
    // (negative temperature).
    let long = json!({
        "sampling_session_id": sampler, "seq_id": 100, "num_samples": 4,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 1000, "stop": [], "seed": 1},
    });
    let long = request_id(&post_json(addr, "asample", &long));
    let ids: Vec<String> = (0..N)
        .map(|i| request_id(&post_json(addr, "asample", &asample_body(&sampler, i))))
        .collect();
    let mut refused = asample_body(&sampler, N);
    refused["sampling_params"]["temperature"] = json!(-1.0);
    let refused = request_id(&post_json(addr, "asample", &refused));
    let cancelled = request_id(&post_json(addr, "asample", &asample_body(&sampler, N + 1)));
    let cancel = post_json(addr, "cancel_future", &json!({"request_id": cancelled}));
    assert_eq!(cancel.json()["cancelled"], true);

    assert_eq!(retrieve(addr, &long).status, 200);
    for (i, id) in ids.iter().enumerate() {
        let reply = retrieve(addr, id);
        assert_eq!(reply.content_type, "application/x-protobuf", "{reply:?}");
        assert_same_sample_response(&reply.body, &sequential[i], &format!("request {i}"));
        let response = floe_server::proto::SampleResponse::decode(&reply.body[..]).unwrap();
        assert_eq!(response.sequences.len(), 1 + i % 3);
    }
    let refused = retrieve(addr, &refused).json();
    assert_eq!(refused["category"], "user", "{refused}");
    assert!(
        refused["error"].as_str().unwrap().contains("temperature"),
        "{refused}"
    );
    let cancelled = retrieve(addr, &cancelled).json();
    assert!(
        cancelled["error"].as_str().unwrap().contains("cancelled"),
        "{cancelled}"
    );

    // The long sample, then the N + 2 queued behind it: fewer engine calls than requests.
    let after = stats(addr, 2 * N + 3);
    let jobs = after["jobs"].as_u64().unwrap() - before["jobs"].as_u64().unwrap();
    let batches = after["batches"].as_u64().unwrap() - before["batches"].as_u64().unwrap();
    assert_eq!(jobs, N + 3, "{after}");
    assert!(
        batches < jobs / 2,
        "{batches} batches for {jobs} requests: {after}"
    );
}

/// A native `sample` call's generations, or its error line.
fn native_sample(addr: SocketAddr, engine: &str, requests: &Value) -> Result<Vec<Value>, String> {
    let reply = request(
        addr,
        "POST",
        &format!("/floe/v1/engines/{engine}/sample"),
        &[("X-API-Key", KEY), ("Content-Type", "application/json")],
        json!({ "requests": requests }).to_string().as_bytes(),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let mut generations = Vec::new();
    for line in String::from_utf8(reply.body).unwrap().lines() {
        let event: Value = serde_json::from_str(line).unwrap();
        if let Some(generation) = event.get("generation") {
            generations.push(generation.clone());
        } else if event.get("done").is_some() {
            generations.sort_by_key(|g| {
                (
                    g["request_id"].as_u64().unwrap(),
                    g["sample_index"].as_u64().unwrap(),
                )
            });
            return Ok(generations);
        } else {
            return Err(event["error"].as_str().unwrap().to_string());
        }
    }
    panic!("the stream ended without done");
}

fn native_request(i: u64) -> Value {
    json!({
        "id": i, "prompt": [3 + i, 4, 5], "n": 2,
        "params": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                   "max_new_tokens": 24, "stop_token_ids": [], "stop_strings": [],
                   "include_stop_str_in_output": false, "seed": 77 + i, "logprobs": true,
                   "force_full_length": true},
    })
}

#[test]
fn concurrent_native_calls_equal_one_call_of_the_same_requests() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let created = request(
        addr,
        "POST",
        "/floe/v1/engines",
        &[("X-API-Key", KEY), ("Content-Type", "application/json")],
        json!({"model": {"base_model": BASE_MODEL}, "settings": {}})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(created.status, 200, "{created:?}");
    let engine = created.json()["engine_id"].as_str().unwrap().to_string();
    const N: u64 = 16;

    let all: Vec<Value> = (0..N).map(native_request).collect();
    let one_call = native_sample(addr, &engine, &Value::Array(all)).unwrap();
    assert_eq!(one_call.len(), 2 * N as usize);

    // Concurrent calls, one of which the engine refuses (n = 0).
    let threads: Vec<_> = (0..=N)
        .map(|i| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let mut request = native_request(i);
                if i == N {
                    request["n"] = json!(0);
                }
                native_sample(addr, &engine, &json!([request]))
            })
        })
        .collect();
    let answers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (i, answer) in answers.iter().enumerate().take(N as usize) {
        let generations = answer.as_ref().unwrap();
        let parse = |g: &[Value]| -> Vec<Generation> {
            g.iter()
                .map(|g| serde_json::from_value(g.clone()).unwrap())
                .collect()
        };
        assert_same_generations(
            &parse(generations),
            &parse(&one_call[2 * i..2 * i + 2]),
            &format!("request {i}"),
        );
    }
    let refused = answers[N as usize].as_ref().unwrap_err();
    assert!(refused.contains("n is 0"), "{refused}");
}

/// The `token_ids` and log-probs of a `/v1/completions` answer's choices.
fn completion(addr: SocketAddr, i: u64) -> Vec<(Vec<u64>, Vec<f64>)> {
    let reply = request(
        addr,
        "POST",
        "/v1/completions",
        &[
            ("Authorization", &format!("Bearer {KEY}")),
            ("Content-Type", "application/json"),
        ],
        json!({"model": BASE_MODEL, "prompt": [7 + i, 8, 9], "max_tokens": 8, "n": 2,
               "seed": 500 + i, "temperature": 0.9})
        .to_string()
        .as_bytes(),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let numbers = |v: &Value| -> Vec<Value> { v.as_array().unwrap().clone() };
    numbers(&reply.json()["choices"])
        .iter()
        .map(|c| {
            let ids = numbers(&c["token_ids"])
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect();
            let logprobs = numbers(&c["logprobs"]["token_logprobs"]);
            (ids, logprobs.iter().map(|l| l.as_f64().unwrap()).collect())
        })
        .collect()
}

#[test]
fn concurrent_openai_completions_equal_sequential_ones() {
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    const N: u64 = 8;
    let sequential: Vec<_> = (0..N).map(|i| completion(addr, i)).collect();
    let threads: Vec<_> = (0..N)
        .map(|i| std::thread::spawn(move || completion(addr, i)))
        .collect();
    for (i, thread) in threads.into_iter().enumerate() {
        let concurrent = thread.join().unwrap();
        assert_eq!(concurrent.len(), sequential[i].len());
        for ((ids, logprobs), (sequential_ids, sequential_logprobs)) in
            concurrent.iter().zip(&sequential[i])
        {
            assert_eq!(ids, sequential_ids, "request {i}");
            assert_close(logprobs, sequential_logprobs, &format!("request {i}"));
        }
    }
}
