//! Parallel reward scoring, so that the trainer can overlap scoring with generation.
//!
//! [`Scorer`] takes jobs one at a time as completions finish ([`Scorer::submit`] returns at
//! once) and hands results back in completion order, each tagged with the caller's id. A
//! job that panics yields an error for its id instead of taking the run down.
//! [`score_all`] scores a whole batch and keeps input order.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rayon::prelude::*;

/// Errors from the scoring pool.
#[derive(Debug, thiserror::Error)]
pub enum ScoringError {
    /// The worker threads could not be started.
    #[error("cannot start {threads} scoring threads: {message}")]
    Pool {
        /// Threads asked for.
        threads: usize,
        /// Why.
        message: String,
    },
    /// A scoring job panicked.
    #[error("scoring job {id} panicked: {message}")]
    Panicked {
        /// The job's id.
        id: u64,
        /// The panic message.
        message: String,
    },
}

/// One finished job.
#[derive(Debug)]
pub struct Scored<T> {
    /// The id given to [`Scorer::submit`].
    pub id: u64,
    /// The job's output, or the panic it raised.
    pub result: Result<T, ScoringError>,
}

fn build_pool(threads: usize) -> Result<rayon::ThreadPool, ScoringError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("floe-score-{i}"))
        .build()
        .map_err(|err| ScoringError::Pool {
            threads,
            message: err.to_string(),
        })
}

/// A streaming scorer over its own thread pool.
pub struct Scorer<T> {
    pool: rayon::ThreadPool,
    sender: Sender<Scored<T>>,
    receiver: Receiver<Scored<T>>,
    outstanding: usize,
}

impl<T: Send + 'static> Scorer<T> {
    /// A scorer with `threads` workers (0: one per core).
    pub fn new(threads: usize) -> Result<Self, ScoringError> {
        let (sender, receiver) = crossbeam_channel::unbounded();
        Ok(Self {
            pool: build_pool(threads)?,
            sender,
            receiver,
            outstanding: 0,
        })
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Queues `job` (first in, first started) and returns immediately.
    pub fn submit(&mut self, id: u64, job: impl FnOnce() -> T + Send + 'static) {
        let sender = self.sender.clone();
        self.outstanding += 1;
        self.pool.spawn_fifo(move || {
            let result =
                catch_unwind(AssertUnwindSafe(job)).map_err(|panic| ScoringError::Panicked {
                    id,
                    message: panic_message(panic.as_ref()),
                });
            // The receiver lives as long as the scorer; a dropped scorer discards results.
            let _ = sender.send(Scored { id, result });
        });
    }

    /// Jobs submitted and not yet received.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// The next finished job, without waiting.
    pub fn try_recv(&mut self) -> Option<Scored<T>> {
        let scored = self.receiver.try_recv().ok()?;
        self.outstanding -= 1;
        Some(scored)
    }

    /// Waits for the next finished job; `None` when nothing is outstanding.
    pub fn recv(&mut self) -> Option<Scored<T>> {
        if self.outstanding == 0 {
            return None;
        }
        let scored = self
            .receiver
            .recv()
            .expect("the scorer holds a sender, so the channel stays open");
        self.outstanding -= 1;
        Some(scored)
    }

    /// Waits up to `timeout` for the next finished job.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Option<Scored<T>> {
        if self.outstanding == 0 {
            return None;
        }
        match self.receiver.recv_timeout(timeout) {
            Ok(scored) => {
                self.outstanding -= 1;
                Some(scored)
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Waits for every outstanding job; results in completion order.
    pub fn drain(&mut self) -> Vec<Scored<T>> {
        std::iter::from_fn(|| self.recv()).collect()
    }
}

/// Scores `items` on `threads` workers (0: one per core); output `i` is `score(&items[i])`.
pub fn score_all<I, T, F>(items: &[I], threads: usize, score: F) -> Result<Vec<T>, ScoringError>
where
    I: Sync,
    T: Send,
    F: Fn(&I) -> T + Sync + Send,
{
    let pool = build_pool(threads)?;
    Ok(pool.install(|| items.par_iter().map(&score).collect()))
}

/// The message of a caught panic (`panic!` payloads are a `&str` or a `String`).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_string())
}
