//! Sample jobs of every client of one engine run together, in one
//! [`Engine::sample_joining`] call: the engine's continuous batch. The batch starts with
//! the sample jobs queued when the worker picks up the first, and between engine steps it
//! takes further sample jobs from the front of the worker's queue, so a client that
//! arrives while the batch runs joins it at the next step instead of waiting for it to
//! end. Jobs join in arrival order while the jobs of the batch not yet answered stay
//! within [`SampleBatchLimits`]; the batch never takes a job past another verb (a training
//! step waits for the batch to end, and a sample sent after it samples the new weights),
//! nor mid-run a job that must first run on the engine alone ([`SampleSink::needs_prepare`]:
//! prompt log-probs), which starts the next batch, nor more than 65,536 jobs
//! in all (its bookkeeping stays bounded under clients that never stop coming). Each
//! request gets an id unique on the engine; generations go back to their job under the
//! client's own id.
//!
//! A job is answered as soon as its own samples are done; a job that streams gets each
//! running sample's tokens after every engine step (the batch samples with progress
//! reports while it holds such a job), and one whose client hung up has its samples
//! cancelled in the engine's batch at the next report, so their compute stops. A job
//! cancelled before it joins, or whose preparation fails, is answered alone; so is a job
//! with a request the engine refuses (each of its requests is checked before any is
//! submitted), while the batch goes on.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use floe_engine::{
    AnyLocalEngine, Engine, Generation, RequestIntake, SampleEvent, SampleFeed, SampleFlow,
    SampleProgress, SampleRequest,
};
use serde::Serialize;

use crate::futures::{CancelTicket, Outcome};

/// How large one batch may grow: a job alone always runs, and others join it while the
/// totals of its jobs not yet answered stay within both limits (a job that would pass
/// them waits, at the front of the queue, until enough of the batch is answered).
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
    /// full while early samples finish, small enough to bound the engine's queue.
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
    /// Runs on the engine, alone, before the batch samples (e.g. prompt log-probs), for a
    /// job the batch starts with; a job that joins a running batch skips it (see
    /// [`SampleSink::needs_prepare`]). A failure answers this job only.
    fn prepare(&mut self, _engine: &mut AnyLocalEngine) -> Result<(), SampleFailure> {
        Ok(())
    }
    /// Whether [`SampleSink::prepare`] must run before the job samples. Such a job cannot
    /// join a batch that is already running (the engine is busy sampling): it waits at
    /// the front of the queue and starts the next batch.
    fn needs_prepare(&self) -> bool {
        false
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

/// The size of the jobs of a batch not yet answered.
#[derive(Default)]
struct BatchSize {
    samples: usize,
    tokens: usize,
}

impl BatchSize {
    /// Whether `job` fits beside them within `limits` (an empty batch takes any job).
    fn fits(&self, job: &SampleJob, limits: &SampleBatchLimits) -> bool {
        let empty = self.samples == 0 && self.tokens == 0;
        empty
            || (self.samples.saturating_add(job.samples()) <= limits.max_samples
                && self.tokens.saturating_add(job.tokens()) <= limits.max_tokens)
    }

    fn add(&mut self, samples: usize, tokens: usize) {
        self.samples = self.samples.saturating_add(samples);
        self.tokens = self.tokens.saturating_add(tokens);
    }

    fn remove(&mut self, samples: usize, tokens: usize) {
        self.samples -= samples;
        self.tokens -= tokens;
    }
}

/// The worker's queue as a batch sees it: its front, taken only when it is a sample job
/// the batch accepts; anything else stays at the front, for later or for the worker.
pub(crate) trait JobQueue {
    /// The front job, when it is a sample job and `accept` takes it.
    fn take_sample_if(
        &mut self,
        accept: &mut dyn FnMut(&SampleJob) -> bool,
    ) -> Option<(u64, SampleJob)>;
}

/// Counters of the batches every engine of a server ran, counted as things happen (a
/// batch's jobs, samples and time while it runs; the batch itself when it ends).
#[derive(Default)]
pub struct SampleStats {
    batches: AtomicU64,
    engine_calls: AtomicU64,
    jobs: AtomicU64,
    joined_jobs: AtomicU64,
    requests: AtomicU64,
    samples: AtomicU64,
    tokens: AtomicU64,
    cancelled: AtomicU64,
    micros: AtomicU64,
}

/// A snapshot of [`SampleStats`] (`GET /floe/v1/stats`).
#[derive(Clone, Debug, Serialize)]
pub struct SampleStatsSnapshot {
    /// Batches run to their end.
    pub batches: u64,
    /// Engine sample calls made: one per batch.
    pub engine_calls: u64,
    /// Client calls (`asample`, native `sample`, `/v1` completions) those served.
    pub jobs: u64,
    /// Those of them that joined a batch already running (after its first engine step).
    pub joined_jobs: u64,
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
            joined_jobs: self.joined_jobs.load(Ordering::Relaxed),
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
    /// `None` once answered.
    sink: Option<Box<dyn SampleSink>>,
    /// Its requests, until the engine's next poll takes them.
    requests: Vec<SampleRequest>,
    unfinished: usize,
    /// Its share of the batch's size (samples, tokens), released when it is answered.
    size: (usize, usize),
    /// It wants progress reports.
    streams: bool,
}

/// Most jobs one batch takes: then it takes no more and ends when they are answered, so
/// what it keeps per job and request stays bounded however long clients keep joining.
const MAX_JOBS_PER_BATCH: usize = 1 << 16;

/// A batch while it runs: its jobs, and the [`SampleFeed`] the engine polls between steps.
struct Batch<'a> {
    queue: &'a mut dyn JobQueue,
    /// Counted as things happen, so a long batch shows in them while it runs.
    stats: &'a SampleStats,
    /// Up to when the batch's time is counted in `stats`.
    counted_until: Instant,
    limits: SampleBatchLimits,
    done: &'a mut dyn FnMut(u64, Outcome),
    /// In the order they were taken.
    jobs: Vec<Running>,
    /// Jobs whose requests went to the engine: a prefix of `jobs`.
    submitted_jobs: usize,
    /// Of the jobs not yet answered.
    size: BatchSize,
    /// Jobs not yet answered that want progress reports.
    streaming: usize,
    /// Engine id `first_id + i` is request `owners[i].1` (the client's id) of job
    /// `owners[i].0`.
    first_id: u64,
    owners: Vec<(usize, u64)>,
    /// Polls so far: the engine has stepped once fewer times (none before the first).
    polls: u64,
    /// Jobs taken from the queue, those answered alone at once included (the counts
    /// below are also the batch's, for its log line).
    taken: usize,
    joined: usize,
    requests: usize,
    samples: usize,
    tokens: usize,
    cancelled: usize,
}

impl Batch<'_> {
    /// Answers job `j`, unless it was answered already.
    fn answer(&mut self, j: usize, result: Result<(), SampleFailure>) {
        let job = &mut self.jobs[j];
        if let Some(sink) = job.sink.take() {
            self.size.remove(job.size.0, job.size.1);
            self.streaming -= usize::from(job.streams);
            (self.done)(job.future, sink.finish(result));
        }
    }

    /// Takes the sample jobs at the front of the queue that fit beside the unanswered
    /// ones. With the `engine` (before the batch runs) each is prepared; without it (the
    /// engine is sampling) a job that needs preparation stays queued.
    fn take_jobs(&mut self, mut engine: Option<&mut AnyLocalEngine>) {
        while self.taken < MAX_JOBS_PER_BATCH {
            let (size, limits, mid_run) = (&self.size, &self.limits, engine.is_none());
            let taken = self.queue.take_sample_if(&mut |job| {
                size.fits(job, limits) && !(mid_run && job.sink.needs_prepare())
            });
            let Some((future, job)) = taken else {
                return;
            };
            self.start(future, job, engine.as_deref_mut());
        }
    }

    /// Adds `job` to the batch (its requests go to the engine at the next poll), or
    /// answers it alone when it was cancelled or its preparation fails.
    fn start(&mut self, future: u64, job: SampleJob, engine: Option<&mut AnyLocalEngine>) {
        self.taken += 1;
        self.stats.jobs.fetch_add(1, Ordering::Relaxed);
        let size = (job.samples(), job.tokens());
        let SampleJob {
            requests,
            cancel,
            mut sink,
        } = job;
        if cancel.is_some_and(|ticket| !ticket.start()) {
            let failure = SampleFailure {
                message: "cancelled by the client before it started".to_string(),
                by_request: true,
            };
            (self.done)(future, sink.finish(Err(failure)));
            return;
        }
        if let Some(engine) = engine {
            let prepared = catch_unwind(AssertUnwindSafe(|| sink.prepare(engine)))
                .unwrap_or_else(|_| Err(SampleFailure::panicked()));
            if let Err(failure) = prepared {
                (self.done)(future, sink.finish(Err(failure)));
                return;
            }
        }
        if self.polls > 0 {
            self.joined += 1;
            self.stats.joined_jobs.fetch_add(1, Ordering::Relaxed);
        }
        self.size.add(size.0, size.1);
        let (nothing_to_sample, streams) = (requests.is_empty(), sink.streams());
        self.streaming += usize::from(streams);
        self.jobs.push(Running {
            future,
            sink: Some(sink),
            requests,
            unfinished: size.0,
            size,
            streams,
        });
        if nothing_to_sample {
            self.answer(self.jobs.len() - 1, Ok(()));
        }
    }

    /// Hands the requests of the jobs taken since the last poll to the engine, each job's
    /// all or none: a job with a request the engine refuses fails alone.
    fn submit_jobs(&mut self, intake: &mut dyn RequestIntake) {
        while self.submitted_jobs < self.jobs.len() {
            let j = self.submitted_jobs;
            self.submitted_jobs += 1;
            let requests = std::mem::take(&mut self.jobs[j].requests);
            if self.jobs[j].sink.is_none() || requests.is_empty() {
                continue;
            }
            let first = self.first_id + self.owners.len() as u64;
            let clients: Vec<u64> = requests.iter().map(|r| r.id).collect();
            let requests: Vec<SampleRequest> = requests
                .into_iter()
                .enumerate()
                .map(|(i, request)| SampleRequest {
                    id: first + i as u64,
                    ..request
                })
                .collect();
            let mut result = requests.iter().try_for_each(|r| intake.check(r));
            if result.is_ok() {
                self.owners
                    .extend(clients.iter().map(|&client| (j, client)));
                self.requests += requests.len();
                let count = requests.len() as u64;
                self.stats.requests.fetch_add(count, Ordering::Relaxed);
                result = requests.into_iter().try_for_each(|r| intake.submit(r));
            }
            if let Err(error) = result {
                let message = match error {
                    floe_engine::SampleError::InvalidRequest { id, reason } => {
                        let client = id
                            .checked_sub(first)
                            .and_then(|i| clients.get(usize::try_from(i).ok()?))
                            .copied()
                            .unwrap_or(id);
                        format!("sample request {client}: {reason}")
                    }
                    other => other.to_string(),
                };
                let failure = SampleFailure {
                    message,
                    by_request: true,
                };
                self.answer(j, Err(failure));
            }
        }
    }

    /// Adds the time since it was last counted to the engines' sampling time.
    fn count_time(&mut self) {
        let now = Instant::now();
        let micros = (now - self.counted_until).as_micros() as u64;
        self.stats.micros.fetch_add(micros, Ordering::Relaxed);
        self.counted_until = now;
    }

    /// The job and client id of engine request `id`, when it is one of this batch's.
    fn owner(&self, id: u64) -> Option<(usize, u64)> {
        let i = id.checked_sub(self.first_id)?;
        self.owners.get(usize::try_from(i).ok()?).copied()
    }
}

impl SampleFeed for Batch<'_> {
    /// Between engine steps: the sample jobs queued since join (the first poll submits
    /// those the batch started with).
    fn poll(&mut self, intake: &mut dyn RequestIntake) {
        self.count_time();
        self.take_jobs(None);
        self.submit_jobs(intake);
        self.polls += 1;
    }

    fn wants_progress(&self) -> bool {
        self.streaming > 0
    }

    fn on_event(&mut self, event: SampleEvent<'_>) -> SampleFlow {
        let request_id = match &event {
            SampleEvent::Progress(progress) => progress.request_id,
            SampleEvent::Finished(generation) => generation.request_id,
        };
        let Some((j, client_id)) = self.owner(request_id) else {
            tracing::warn!(id = request_id, "a sample of no request of this batch");
            return SampleFlow::Continue;
        };
        match event {
            SampleEvent::Progress(progress) => {
                let job = &mut self.jobs[j];
                let Some(sink) = &mut job.sink else {
                    // Answered: its client hung up, or another of its requests failed.
                    return SampleFlow::Cancel;
                };
                if sink.hung_up() {
                    self.cancelled += job.unfinished;
                    let count = job.unfinished as u64;
                    self.stats.cancelled.fetch_add(count, Ordering::Relaxed);
                    tracing::info!(
                        request = client_id,
                        samples = job.unfinished,
                        "the client hung up; its samples are cancelled"
                    );
                    let failure = SampleFailure {
                        message: "the client hung up".to_string(),
                        by_request: true,
                    };
                    self.answer(j, Err(failure));
                    return SampleFlow::Cancel;
                }
                sink.progress(SampleProgress {
                    request_id: client_id,
                    ..progress
                });
            }
            SampleEvent::Finished(mut generation) => {
                let job = &mut self.jobs[j];
                let Some(sink) = &mut job.sink else {
                    // Answered: a sample that finished in the step its client's hang-up
                    // was noticed, already counted among the cancelled ones.
                    return SampleFlow::Continue;
                };
                generation.request_id = client_id;
                self.samples += 1;
                self.tokens += generation.tokens.len();
                self.stats.samples.fetch_add(1, Ordering::Relaxed);
                let count = generation.tokens.len() as u64;
                self.stats.tokens.fetch_add(count, Ordering::Relaxed);
                job.unfinished = job.unfinished.saturating_sub(1);
                sink.generation(generation);
                if job.unfinished == 0 {
                    self.answer(j, Ok(()));
                }
            }
        }
        SampleFlow::Continue
    }
}

/// Runs a batch: the sample jobs at the front of `queue` (the worker's, whose front is a
/// sample job) that fit `limits`, prepared on the engine, then one
/// [`Engine::sample_joining`] call that takes the sample jobs queued while it runs (see
/// the module docs), calling `done` with each job's outcome as soon as it has one.
/// `next_id` numbers the requests the engine sees, never reused on one engine, so a
/// generation of another call (one a panic left queued in the engine) is never taken for
/// one of this call.
pub(crate) fn run_batch(
    engine: &mut AnyLocalEngine,
    queue: &mut dyn JobQueue,
    limits: SampleBatchLimits,
    next_id: &mut u64,
    stats: &SampleStats,
    done: &mut dyn FnMut(u64, Outcome),
) {
    let started = Instant::now();
    let mut batch = Batch {
        queue,
        stats,
        counted_until: started,
        limits,
        done,
        jobs: Vec::new(),
        submitted_jobs: 0,
        size: BatchSize::default(),
        streaming: 0,
        first_id: *next_id,
        owners: Vec::new(),
        polls: 0,
        taken: 0,
        joined: 0,
        requests: 0,
        samples: 0,
        tokens: 0,
        cancelled: 0,
    };
    batch.take_jobs(Some(engine));
    stats.engine_calls.fetch_add(1, Ordering::Relaxed);
    let result = catch_unwind(AssertUnwindSafe(|| engine.sample_joining(&mut batch)));
    *next_id = batch.first_id + batch.owners.len() as u64;
    let failure = match result {
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(SampleFailure::engine(&error)),
        Err(_) => Some(SampleFailure::panicked()),
    };
    // Every future completes: after a failure with that failure, and otherwise too, even
    // if the engine returned without some samples (a job cancelled for its hung-up client
    // was answered then).
    for j in 0..batch.jobs.len() {
        let result = match &failure {
            Some(failure) => Err(failure.clone()),
            None if batch.jobs[j].unfinished == 0 => Ok(()),
            None => Err(SampleFailure {
                message: "the engine finished without all of this request's samples".into(),
                by_request: false,
            }),
        };
        batch.answer(j, result);
    }
    batch.count_time();
    stats.batches.fetch_add(1, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let Batch {
        taken: jobs,
        joined,
        requests,
        samples,
        tokens,
        cancelled,
        ..
    } = batch;
    tracing::info!(
        jobs,
        joined,
        requests,
        samples,
        tokens,
        cancelled,
        seconds = elapsed.as_secs_f64(),
        tokens_per_second = tokens as f64 / elapsed.as_secs_f64().max(1e-9),
        "sample batch"
    );
}
