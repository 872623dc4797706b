//! The table of futures: every slow request gets an id at once and its outcome later;
//! `retrieve_future` long-polls on it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// What a finished request produced.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// A JSON result.
    Json(serde_json::Value),
    /// A protobuf result (`forward_backward`, `asample`).
    Proto(Vec<u8>),
    /// A failure reported inside the future (HTTP 200 `{error, category}`).
    Failed {
        /// What went wrong.
        error: String,
        /// `user` for bad requests, `server` for engine failures.
        category: &'static str,
    },
}

impl Outcome {
    /// A failure caused by the request.
    pub fn user_error(error: impl Into<String>) -> Self {
        Outcome::Failed {
            error: error.into(),
            category: "user",
        }
    }

    /// A failure of the server or engine.
    pub fn server_error(error: impl Into<String>) -> Self {
        Outcome::Failed {
            error: error.into(),
            category: "server",
        }
    }
}

/// What `retrieve_future` finds for an id.
pub enum Poll {
    /// Finished.
    Ready(Arc<Outcome>),
    /// Not finished within the long-poll window.
    Pending,
    /// Issued here once, finished, and dropped after the expiry time.
    Expired,
    /// Never issued.
    Unknown,
}

struct Entry {
    outcome: watch::Sender<Option<Arc<Outcome>>>,
    finished_at: Option<Instant>,
    /// Set for requests that may be cancelled before they start (samples).
    cancel: Option<CancelTicket>,
    /// The completion log this request is reported to when it finishes (samples).
    log: Option<String>,
}

/// One finished request in a completion log.
#[derive(Clone, Debug)]
pub struct Completion {
    /// Its position in the log, counting from 1.
    pub cursor: u64,
    /// The request.
    pub id: u64,
    /// Whether it failed (`{error, category}`).
    pub failed: bool,
    /// Bytes of its result payload (the SDK reserves memory before fetching it).
    pub payload_bytes: usize,
}

/// The finished requests of one sampling client in finishing order, so the SDK can
/// long-poll one route (`retrieve_futures`) for all its samples.
struct CompletionLog {
    done: VecDeque<Completion>,
    last_cursor: watch::Sender<u64>,
}

/// Whether a queued job may still start: the job claims it when it starts, and
/// `cancel_future` can take it only before then.
#[derive(Clone, Default)]
pub struct CancelTicket(Arc<AtomicU8>);

const TICKET_QUEUED: u8 = 0;
const TICKET_STARTED: u8 = 1;
const TICKET_CANCELLED: u8 = 2;

impl CancelTicket {
    /// Called by the job as it starts: false when it was cancelled and must not run.
    pub fn start(&self) -> bool {
        self.0
            .compare_exchange(
                TICKET_QUEUED,
                TICKET_STARTED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Cancels the job if it has not started; true when it will not run.
    fn cancel(&self) -> bool {
        match self.0.compare_exchange(
            TICKET_QUEUED,
            TICKET_CANCELLED,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(state) => state == TICKET_CANCELLED,
        }
    }
}

/// Futures by request id (`req-N`, N counting from 1).
pub struct Futures {
    next: AtomicU64,
    entries: Mutex<HashMap<u64, Entry>>,
    /// Completion logs by key; locked only while `entries` is, or alone.
    logs: Mutex<HashMap<String, CompletionLog>>,
    expiry: Duration,
}

impl Futures {
    /// An empty table whose finished futures are dropped `expiry` after finishing.
    pub fn new(expiry: Duration) -> Self {
        Self {
            next: AtomicU64::new(1),
            entries: Mutex::new(HashMap::new()),
            logs: Mutex::new(HashMap::new()),
            expiry,
        }
    }

    /// A new pending future.
    pub fn issue(&self) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (outcome, _) = watch::channel(None);
        self.lock().insert(
            id,
            Entry {
                outcome,
                finished_at: None,
                cancel: None,
                log: None,
            },
        );
        id
    }

    /// Records the outcome of `id` and wakes its pollers. Ids no longer present (expired
    /// sessions) are ignored.
    pub fn complete(&self, id: u64, outcome: Outcome) {
        if let Some(entry) = self.lock().get_mut(&id) {
            entry.finished_at = Some(Instant::now());
            let outcome = Arc::new(outcome);
            entry.outcome.send_replace(Some(Arc::clone(&outcome)));
            if let Some(key) = &entry.log {
                self.append(key, id, &outcome);
            }
        }
    }

    /// Reports future `id` to completion log `key` when it finishes (at once if it has).
    pub fn track(&self, id: u64, key: String) {
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(&id) else {
            return;
        };
        let finished = entry.outcome.borrow().clone();
        match finished {
            Some(outcome) => self.append(&key, id, &outcome),
            None => entry.log = Some(key),
        }
    }

    fn append(&self, key: &str, id: u64, outcome: &Outcome) {
        let (failed, payload_bytes) = match outcome {
            Outcome::Json(value) => (false, value.to_string().len()),
            Outcome::Proto(bytes) => (false, bytes.len()),
            Outcome::Failed { .. } => (true, 0),
        };
        let mut logs = self.logs();
        let log = logs
            .entry(key.to_string())
            .or_insert_with(CompletionLog::new);
        let cursor = *log.last_cursor.borrow() + 1;
        log.done.push_back(Completion {
            cursor,
            id,
            failed,
            payload_bytes,
        });
        log.last_cursor.send_replace(cursor);
    }

    /// The completions of log `key` after cursor `seen` (those up to it are dropped: the
    /// client has them), waiting up to `wait` for one when there is none yet; returns
    /// them with the cursor to send next.
    pub async fn completions(
        &self,
        key: &str,
        seen: u64,
        wait: Duration,
    ) -> (Vec<Completion>, u64) {
        let newer = |log: &mut CompletionLog| -> Vec<Completion> {
            log.done.retain(|c| c.cursor > seen);
            log.done.iter().cloned().collect()
        };
        let mut last_cursor = {
            let mut logs = self.logs();
            let log = logs
                .entry(key.to_string())
                .or_insert_with(CompletionLog::new);
            let done = newer(log);
            if !done.is_empty() {
                let cursor = done.last().map_or(seen, |c| c.cursor);
                return (done, cursor);
            }
            log.last_cursor.subscribe()
        };
        // Timing out is an answer too: no completion yet.
        let _ = tokio::time::timeout(wait, last_cursor.wait_for(|&last| last > seen)).await;
        let done = self.logs().get_mut(key).map(newer).unwrap_or_default();
        let cursor = done.last().map_or(seen, |c| c.cursor);
        (done, cursor)
    }

    /// Lets `cancel_future` stop pending future `id` through `ticket` (held by its job).
    pub fn set_cancel_ticket(&self, id: u64, ticket: CancelTicket) {
        if let Some(entry) = self.lock().get_mut(&id) {
            entry.cancel = Some(ticket);
        }
    }

    /// Cancels future `id` if its job has not started; true when it will not run.
    /// Unknown, finished, started and uncancellable futures are left alone.
    pub fn cancel(&self, id: u64) -> bool {
        let entries = self.lock();
        match entries.get(&id) {
            Some(entry) if entry.finished_at.is_none() => {
                entry.cancel.as_ref().is_some_and(CancelTicket::cancel)
            }
            _ => false,
        }
    }

    /// Waits up to `wait` for `id` to finish.
    pub async fn poll(&self, id: u64, wait: Duration) -> Poll {
        let mut receiver = match self.lock().get(&id) {
            Some(entry) => entry.outcome.subscribe(),
            None if id > 0 && id < self.next.load(Ordering::Relaxed) => return Poll::Expired,
            None => return Poll::Unknown,
        };
        let ready = tokio::time::timeout(wait, receiver.wait_for(Option::is_some)).await;
        match ready {
            Ok(Ok(outcome)) => Poll::Ready(outcome.clone().expect("waited for Some")),
            // The sender lives in the table; it is dropped only when the entry expires.
            Ok(Err(_)) => Poll::Expired,
            Err(_) => Poll::Pending,
        }
    }

    /// Drops futures that finished more than the expiry time ago, with their places in
    /// the completion logs.
    pub fn expire(&self) {
        let now = Instant::now();
        let mut entries = self.lock();
        entries.retain(|_, entry| {
            entry
                .finished_at
                .is_none_or(|at| now.duration_since(at) < self.expiry)
        });
        for log in self.logs().values_mut() {
            log.done.retain(|c| entries.contains_key(&c.id));
        }
    }

    /// The expiry time.
    pub fn expiry(&self) -> Duration {
        self.expiry
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn logs(&self) -> std::sync::MutexGuard<'_, HashMap<String, CompletionLog>> {
        self.logs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CompletionLog {
    fn new() -> Self {
        Self {
            done: VecDeque::new(),
            last_cursor: watch::channel(0).0,
        }
    }
}

/// The wire form of a request id.
pub fn request_id_string(id: u64) -> String {
    format!("req-{id}")
}

/// Parses [`request_id_string`]'s form.
pub fn parse_request_id(text: &str) -> Option<u64> {
    text.strip_prefix("req-")?.parse().ok()
}
