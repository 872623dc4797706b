//! The table of futures: every slow request gets an id at once and its outcome later;
//! `retrieve_future` long-polls on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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
}

/// Futures by request id (`req-N`, N counting from 1).
pub struct Futures {
    next: AtomicU64,
    entries: Mutex<HashMap<u64, Entry>>,
    expiry: Duration,
}

impl Futures {
    /// An empty table whose finished futures are dropped `expiry` after finishing.
    pub fn new(expiry: Duration) -> Self {
        Self {
            next: AtomicU64::new(1),
            entries: Mutex::new(HashMap::new()),
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
            },
        );
        id
    }

    /// Records the outcome of `id` and wakes its pollers. Ids no longer present (expired
    /// sessions) are ignored.
    pub fn complete(&self, id: u64, outcome: Outcome) {
        if let Some(entry) = self.lock().get_mut(&id) {
            entry.finished_at = Some(Instant::now());
            entry.outcome.send_replace(Some(Arc::new(outcome)));
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

    /// Drops futures that finished more than the expiry time ago.
    pub fn expire(&self) {
        let now = Instant::now();
        self.lock().retain(|_, entry| {
            entry
                .finished_at
                .is_none_or(|at| now.duration_since(at) < self.expiry)
        });
    }

    /// The expiry time.
    pub fn expiry(&self) -> Duration {
        self.expiry
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
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
