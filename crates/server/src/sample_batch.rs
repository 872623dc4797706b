//! Sample jobs of every client of one engine run together: the worker drains the sample
//! jobs queued behind the one it picks up (up to [`SampleBatchLimits`], stopping at the
//! first other verb so nothing passes a training step) and hands all their requests to
//! one [`Engine::sample`] call, the engine's continuous batch. Each request gets an id
//! unique in the call; generations go back to their job under the client's own id.
//!
//! A job is answered as soon as its own samples are done; a job that streams gets each
//! running sample's tokens after every engine step (the whole batch then samples with
//! progress reports), and one whose client hung up has its samples cancelled in the
//! engine's batch at the next report, so their compute stops. A job cancelled before the batch starts, or whose preparation fails
//! (prompt log-probs), is answered alone; a request the engine refuses fails its job alone
//! and the rest are resubmitted (the engine checks every request before it samples any).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use floe_engine::{
    AnyLocalEngine, Engine, Generation, SampleError, SampleEvent, SampleFlow, SampleProgress,
    SampleRequest,
};
use serde::Serialize;

use crate::futures::{CancelTicket, Outcome};

/// How large one batch may grow: a job alone always runs, later ones join while the
/// totals stay within both limits, so a late client waits at most one capped batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleBatchLimits {
    /// Most samples (`n` summed over requests).
    pub max_samples: usize,
    /// Most tokens: `n × (prompt + max_new_tokens)` summed, the KV positions the batch
    /// may need.
    pub max_tokens: usize,
}

impl Default for SampleBatchLimits {
    /// Four times an engine's default running samples (256): enough to keep its slots
    /// full while early samples finish, small enough that a late client waits one batch.
    fn default() -> Self {
        Self {
            max_samples: 1024,
            max_tokens: 1 << 21,
        }
    }
}

/// Why a sample job did not finish.
#[derive(Clone, Debug)]
pub struct SampleFailure {
    /// What went wrong.
    pub message: String,
    /// The request was at fault (a 400), not the engine.
    pub by_request: bool,
}

impl SampleFailure {
    fn engine(error: &floe_engine::Error) -> Self {
        Self {
            message: error.to_string(),
            by_request: error.is_invalid_request(),
        }
    }

    fn panicked() -> Self {
        Self {
            message: "the engine panicked".to_string(),
            by_request: false,
        }
    }
}

/// Where one job's results go (a Tinker future, a native stream, an OpenAI response).
pub trait SampleSink: Send {
    /// Runs on the engine, alone, before the batch samples (e.g. prompt log-probs); a
    /// failure answers this job only.
    fn prepare(&mut self, _engine: &mut AnyLocalEngine) -> Result<(), SampleFailure> {
        Ok(())
    }
    /// Whether the job wants [`SampleSink::progress`] (a streaming client); a batch
    /// without one samples without progress reports.
    fn streams(&self) -> bool {
        false
    }
    /// A running sample's tokens so far, under the client's request id.
    fn progress(&mut self, _progress: SampleProgress<'_>) {}
    /// Whether the client is gone; asked with each progress report, and a job whose client
    /// is gone has its samples cancelled in the engine's batch (it then wants
    /// [`SampleSink::streams`] to be asked at all).
    fn hung_up(&self) -> bool {
        false
    }
    /// One finished sample, under the client's request id.
    fn generation(&mut self, generation: Generation);
    /// The job is over: every sample was delivered, or it failed; returns its future's
    /// outcome.
    fn finish(self: Box<Self>, result: Result<(), SampleFailure>) -> Outcome;
}

/// Requests of one client call, sampled with whatever else is queued on the engine.
pub struct SampleJob {
    /// The requests, under the client's ids.
    pub requests: Vec<SampleRequest>,
    /// Taken when the batch starts; a job cancelled before then does not run.
    pub cancel: Option<CancelTicket>,
    /// Receives the results.
    pub sink: Box<dyn SampleSink>,
}

impl SampleJob {
    fn samples(&self) -> usize {
        self.requests.iter().map(|r| r.n).sum()
    }

    fn tokens(&self) -> usize {
        self.requests
            .iter()
            .map(|r| {
                r.n.saturating_mul(r.prompt.len().saturating_add(r.params.max_new_tokens))
            })
            .fold(0, usize::saturating_add)
    }
}

/// The size of a batch being formed.
#[derive(Default)]
pub(crate) struct BatchSize {
    samples: usize,
    tokens: usize,
}

impl BatchSize {
    /// Adds `job` when it fits `limits` (an empty batch takes any job).
    pub(crate) fn admit(&mut self, job: &SampleJob, limits: &SampleBatchLimits) -> bool {
        let samples = self.samples.saturating_add(job.samples());
        let tokens = self.tokens.saturating_add(job.tokens());
        let empty = self.samples == 0 && self.tokens == 0;
        if !empty && (samples > limits.max_samples || tokens > limits.max_tokens) {
            return false;
        }
        self.samples = samples;
        self.tokens = tokens;
        true
    }
}

/// Counters of the batches every engine of a server ran.
#[derive(Default)]
pub struct SampleStats {
    batches: AtomicU64,
    engine_calls: AtomicU64,
    jobs: AtomicU64,
    requests: AtomicU64,
    samples: AtomicU64,
    tokens: AtomicU64,
    cancelled: AtomicU64,
    micros: AtomicU64,
}

/// A snapshot of [`SampleStats`] (`GET /floe/v1/stats`).
#[derive(Clone, Debug, Serialize)]
pub struct SampleStatsSnapshot {
    /// Batches formed.
    pub batches: u64,
    /// Engine `sample` calls made (a batch makes one more per request the engine refuses).
    pub engine_calls: u64,
    /// Client calls (`asample`, native `sample`, `/v1` completions) those served.
    pub jobs: u64,
    /// Requests (prompts) in them.
    pub requests: u64,
    /// Samples generated.
    pub samples: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Samples cancelled unfinished (their client hung up).
    pub cancelled_samples: u64,
    /// Seconds the engines spent in those calls.
    pub seconds: f64,
    /// `tokens / seconds`.
    pub tokens_per_second: f64,
}

impl SampleStats {
    /// The counters now.
    pub fn snapshot(&self) -> SampleStatsSnapshot {
        let tokens = self.tokens.load(Ordering::Relaxed);
        let seconds = self.micros.load(Ordering::Relaxed) as f64 / 1e6;
        SampleStatsSnapshot {
            batches: self.batches.load(Ordering::Relaxed),
            engine_calls: self.engine_calls.load(Ordering::Relaxed),
            jobs: self.jobs.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            samples: self.samples.load(Ordering::Relaxed),
            tokens,
            cancelled_samples: self.cancelled.load(Ordering::Relaxed),
            seconds,
            tokens_per_second: if seconds > 0.0 {
                tokens as f64 / seconds
            } else {
                0.0
            },
        }
    }
}

/// A job of the batch while it runs.
struct Running {
    future: u64,
    requests: Vec<SampleRequest>,
    /// `None` once answered.
    sink: Option<Box<dyn SampleSink>>,
    unfinished: usize,
}

impl Running {
    fn answer(&mut self, result: Result<(), SampleFailure>, done: &mut dyn FnMut(u64, Outcome)) {
        if let Some(sink) = self.sink.take() {
            done(self.future, sink.finish(result));
        }
    }
}

/// Runs `batch` (futures and their jobs, in arrival order) as one engine call, calling
/// `done` with each job's outcome as soon as it has one. `next_id` numbers the requests
/// the engine sees, never reused on one engine, so a generation of another call (one a
/// panic left queued in the engine) is never taken for one of this call.
pub(crate) fn run_batch(
    engine: &mut AnyLocalEngine,
    batch: Vec<(u64, SampleJob)>,
    next_id: &mut u64,
    stats: &SampleStats,
    done: &mut dyn FnMut(u64, Outcome),
) {
    let started = Instant::now();
    let jobs = batch.len();
    let mut running = Vec::with_capacity(jobs);
    for (future, job) in batch {
        let mut sink = job.sink;
        if job.cancel.is_some_and(|ticket| !ticket.start()) {
            done(
                future,
                sink.finish(Err(SampleFailure {
                    message: "cancelled by the client before it started".to_string(),
                    by_request: true,
                })),
            );
            continue;
        }
        let prepared = catch_unwind(AssertUnwindSafe(|| sink.prepare(engine)))
            .unwrap_or_else(|_| Err(SampleFailure::panicked()));
        if let Err(failure) = prepared {
            done(future, sink.finish(Err(failure)));
            continue;
        }
        let unfinished = job.requests.iter().map(|r| r.n).sum();
        let mut job = Running {
            future,
            requests: job.requests,
            sink: Some(sink),
            unfinished,
        };
        if job.requests.is_empty() {
            job.answer(Ok(()), done);
        }
        running.push(job);
    }
    let (mut requests, mut samples, mut tokens, mut cancelled) = (0, 0, 0, 0);
    loop {
        // Engine id `first + i` is request `owners[i].1` of job `owners[i].0`.
        let first = *next_id;
        let mut owners = Vec::new();
        let mut submitted = Vec::new();
        for (j, job) in running.iter().enumerate() {
            if job.sink.is_none() {
                continue;
            }
            for request in &job.requests {
                submitted.push(SampleRequest {
                    id: first + owners.len() as u64,
                    ..request.clone()
                });
                owners.push((j, request.id));
            }
        }
        *next_id += owners.len() as u64;
        let owner = |id: u64| id.checked_sub(first).and_then(|i| owners.get(i as usize));
        if submitted.is_empty() {
            break;
        }
        let submitted_requests = submitted.len();
        stats.engine_calls.fetch_add(1, Ordering::Relaxed);
        let mut delivered = false;
        let streams = running
            .iter()
            .any(|job| job.sink.as_ref().is_some_and(|sink| sink.streams()));
        let mut on_event = |event: SampleEvent<'_>| {
            let request_id = match &event {
                SampleEvent::Progress(progress) => progress.request_id,
                SampleEvent::Finished(generation) => generation.request_id,
            };
            let Some(&(j, client_id)) = owner(request_id) else {
                tracing::warn!(id = request_id, "a sample of no request of this batch");
                return SampleFlow::Continue;
            };
            delivered = true;
            let job = &mut running[j];
            match event {
                SampleEvent::Progress(progress) => {
                    let Some(sink) = &mut job.sink else {
                        // Answered: its client hung up.
                        return SampleFlow::Cancel;
                    };
                    if sink.hung_up() {
                        cancelled += job.unfinished;
                        tracing::info!(
                            request = client_id,
                            samples = job.unfinished,
                            "the client hung up; its samples are cancelled"
                        );
                        let failure = SampleFailure {
                            message: "the client hung up".to_string(),
                            by_request: true,
                        };
                        job.answer(Err(failure), done);
                        return SampleFlow::Cancel;
                    }
                    sink.progress(SampleProgress {
                        request_id: client_id,
                        ..progress
                    });
                }
                SampleEvent::Finished(mut generation) => {
                    generation.request_id = client_id;
                    samples += 1;
                    tokens += generation.tokens.len();
                    job.unfinished = job.unfinished.saturating_sub(1);
                    if let Some(sink) = &mut job.sink {
                        sink.generation(generation);
                    }
                    if job.unfinished == 0 {
                        job.answer(Ok(()), done);
                    }
                }
            }
            SampleFlow::Continue
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            if streams {
                engine.sample_streaming(submitted, &mut on_event)
            } else {
                engine.sample(submitted, &mut |generation| {
                    on_event(SampleEvent::Finished(generation));
                })
            }
        }));
        match result {
            Ok(Ok(())) => {
                requests += submitted_requests;
                break;
            }
            // The engine checks every request before sampling any: fail the refused
            // one's job and run the others again.
            Ok(Err(floe_engine::Error::Sample(SampleError::InvalidRequest { id, reason })))
                if !delivered && owner(id).is_some() =>
            {
                let (j, client_id) = owners[(id - first) as usize];
                let failure = SampleFailure {
                    message: format!("sample request {client_id}: {reason}"),
                    by_request: true,
                };
                running[j].answer(Err(failure), done);
            }
            Ok(Err(error)) => {
                requests += submitted_requests;
                let failure = SampleFailure::engine(&error);
                for job in &mut running {
                    job.answer(Err(failure.clone()), done);
                }
                break;
            }
            Err(_) => {
                requests += submitted_requests;
                for job in &mut running {
                    job.answer(Err(SampleFailure::panicked()), done);
                }
                break;
            }
        }
    }
    // Every future completes, even if the engine returned without some samples (a job
    // cancelled for its hung-up client was answered then).
    for job in &mut running {
        let result = if job.unfinished == 0 {
            Ok(())
        } else {
            Err(SampleFailure {
                message: "the engine finished without all of this request's samples".into(),
                by_request: false,
            })
        };
        job.answer(result, done);
    }
    let elapsed = started.elapsed();
    stats.batches.fetch_add(1, Ordering::Relaxed);
    stats.jobs.fetch_add(jobs as u64, Ordering::Relaxed);
    stats.requests.fetch_add(requests as u64, Ordering::Relaxed);
    stats.samples.fetch_add(samples as u64, Ordering::Relaxed);
    stats.tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    stats
        .cancelled
        .fetch_add(cancelled as u64, Ordering::Relaxed);
    stats
        .micros
        .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    tracing::info!(
        jobs,
        requests,
        samples,
        tokens,
        seconds = elapsed.as_secs_f64(),
        tokens_per_second = tokens as f64 / elapsed.as_secs_f64().max(1e-9),
        "sample batch"
    );
}
