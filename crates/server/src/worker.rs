//! One engine per thread. A [`Worker`] owns an [`AnyLocalEngine`] on its own OS thread
//! (the engine and its device stay on one thread, and a slow verb never blocks the HTTP
//! runtime) and runs jobs in the order they are sent, completing each job's future.
//! Sample jobs run as one batch ([`crate::sample_batch`]): those queued back to back when
//! it starts, and those queued while it runs, which join the engine's running batch at
//! its next step; no job passes another verb.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use floe_engine::{AnyLocalEngine, KnobNames, LocalEngineOptions, ModelSource};
use floe_model::tokenizer::Tokenizer;

use crate::futures::{Futures, Outcome};
use crate::sample_batch::{
    run_batch, JobQueue, SampleBatchLimits, SampleFailure, SampleJob, SampleStats,
};

/// Work for an engine; returns the outcome of its future.
pub type Job = Box<dyn FnOnce(&mut AnyLocalEngine) -> Outcome + Send>;

/// Builds the engine on the worker's thread.
pub type EngineBuilder = Box<dyn FnOnce() -> Result<AnyLocalEngine, String> + Send>;

/// Opens an engine for the server; a memory plan that does not fit beside the engines
/// already resident is refused here, naming the server's flags and the clients' settings.
pub fn open_engine(
    source: ModelSource,
    tokenizer: Option<Tokenizer>,
    options: LocalEngineOptions,
) -> Result<AnyLocalEngine, String> {
    AnyLocalEngine::open(source, tokenizer, options).map_err(|e| match e {
        floe_engine::Error::Plan(plan) => plan.named_for(KnobNames::Serve).to_string(),
        e => e.to_string(),
    })
}

/// Why a job was not queued.
#[derive(Debug)]
pub enum QueueError {
    /// The worker already holds its maximum of unfinished jobs (HTTP 429).
    Full(usize),
    /// The worker's engine failed to build or its thread ended.
    Gone,
}

/// What a worker's queue holds, each with its future.
enum Task {
    /// Runs alone.
    Verb(u64, Job),
    /// Runs in a batch with the sample jobs queued around it.
    Sample(u64, SampleJob),
}

/// The worker's queue: the task taken from the channel but not yet run, then the channel.
struct Queue<'a> {
    receiver: &'a mpsc::Receiver<Task>,
    front: &'a mut Option<Task>,
}

impl JobQueue for Queue<'_> {
    fn take_sample_if(
        &mut self,
        accept: &mut dyn FnMut(&SampleJob) -> bool,
    ) -> Option<(u64, SampleJob)> {
        if self.front.is_none() {
            *self.front = self.receiver.try_recv().ok();
        }
        match self.front.take() {
            Some(Task::Sample(id, job)) if accept(&job) => Some((id, job)),
            other => {
                *self.front = other;
                None
            }
        }
    }
}

/// What every worker of a server shares.
#[derive(Clone)]
pub struct WorkerContext {
    /// The futures jobs complete.
    pub futures: Arc<Futures>,
    /// Most unfinished jobs per worker.
    pub max_queued: usize,
    /// How large a sample batch may grow.
    pub batch_limits: SampleBatchLimits,
    /// Where sample batches are counted.
    pub sample_stats: Arc<SampleStats>,
}

/// A handle on an engine thread.
pub struct Worker {
    jobs: mpsc::Sender<Task>,
    queued: Arc<AtomicUsize>,
    max_queued: usize,
}

impl Worker {
    /// Starts a thread that builds an engine with `build`, completes future `ready` with
    /// `ready_outcome` (or the build error), then runs jobs until every handle is dropped.
    pub fn spawn(
        name: String,
        build: EngineBuilder,
        ready: Option<(u64, Outcome)>,
        context: &WorkerContext,
    ) -> std::io::Result<Self> {
        let (jobs, receiver) = mpsc::channel::<Task>();
        let queued = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&queued);
        let WorkerContext {
            futures,
            max_queued,
            batch_limits,
            sample_stats,
        } = context.clone();
        std::thread::Builder::new().name(name).spawn(move || {
            let built = catch_unwind(AssertUnwindSafe(build))
                .unwrap_or_else(|_| Err("the engine panicked while loading".to_string()));
            let mut engine = match built {
                Ok(engine) => {
                    if let Some((id, outcome)) = ready {
                        futures.complete(id, outcome);
                    }
                    engine
                }
                Err(error) => {
                    let error = format!("loading the model failed: {error}");
                    tracing::error!("{error}");
                    if let Some((id, _)) = ready {
                        futures.complete(id, Outcome::server_error(error.clone()));
                    }
                    // Fail whatever was queued meanwhile, then end the thread: later sends
                    // see a closed channel.
                    while let Ok(task) = receiver.try_recv() {
                        let outcome = Outcome::server_error(error.clone());
                        match task {
                            Task::Verb(id, _) => futures.complete(id, outcome),
                            Task::Sample(id, job) => futures.complete(
                                id,
                                job.sink.finish(Err(SampleFailure {
                                    message: error.clone(),
                                    by_request: false,
                                })),
                            ),
                        }
                    }
                    return;
                }
            };
            let mut done = |id: u64, outcome: Outcome| {
                futures.complete(id, outcome);
                counter.fetch_sub(1, Ordering::Relaxed);
            };
            // A task taken from the channel but left for later by a batch, which runs next.
            let mut front: Option<Task> = None;
            let mut next_sample_id = 0;
            while let Some(task) = front.take().or_else(|| receiver.recv().ok()) {
                match task {
                    Task::Verb(id, job) => {
                        let outcome = catch_unwind(AssertUnwindSafe(|| job(&mut engine)))
                            .unwrap_or_else(|_| Outcome::server_error("the engine panicked"));
                        done(id, outcome);
                    }
                    sample @ Task::Sample(..) => {
                        // The batch takes it, and the sample jobs behind it, from the front.
                        front = Some(sample);
                        let mut queue = Queue {
                            receiver: &receiver,
                            front: &mut front,
                        };
                        run_batch(
                            &mut engine,
                            &mut queue,
                            batch_limits,
                            &mut next_sample_id,
                            &sample_stats,
                            &mut done,
                        );
                    }
                }
            }
        })?;
        Ok(Self {
            jobs,
            queued,
            max_queued,
        })
    }

    /// Whether another job fits the queue.
    pub fn has_room(&self) -> Result<(), QueueError> {
        if self.queued.load(Ordering::Relaxed) >= self.max_queued {
            return Err(QueueError::Full(self.max_queued));
        }
        Ok(())
    }

    /// Queues `job` for future `id`, after every job sent before it.
    pub fn send(&self, id: u64, job: Job) -> Result<(), QueueError> {
        self.enqueue(Task::Verb(id, job))
    }

    /// Queues sample `job` for future `id`, after every job sent before it; it runs in
    /// the engine's batch with the sample jobs queued around it, joining a batch that is
    /// running when it arrives (unless a verb is queued before it).
    pub fn send_sample(&self, id: u64, job: SampleJob) -> Result<(), QueueError> {
        self.enqueue(Task::Sample(id, job))
    }

    fn enqueue(&self, task: Task) -> Result<(), QueueError> {
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.send(task).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            QueueError::Gone
        })
    }
}
