//! The decisions of a collective watchdog, apart from any device: which collectives are
//! still pending, when one has waited too long, and the message every later op answers
//! with. `cuda::NcclCollective` runs it on a thread of its own, with CUDA events as the
//! done markers; here the clock and the "is it done" answers are inputs, so the tests
//! need no GPU.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// One collective enqueued and not yet seen done.
struct Pending<M> {
    seq: u64,
    op: &'static str,
    /// The count NCCL was given (per rank for all_gather and reduce_scatter).
    elements: usize,
    enqueued: Instant,
    /// What tells whether the device has finished it (a CUDA event recorded after it).
    done_marker: M,
}

impl<M> Pending<M> {
    fn describe(&self) -> String {
        format!("{} #{} ({} elements)", self.op, self.seq, self.elements)
    }
}

/// One rank's collectives as the watchdog sees them: those pending, oldest first, and the
/// failure once there is one. A failure is final: the communicator is aborted for it.
pub(crate) struct CollectiveWatch<M> {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    next_seq: u64,
    pending: VecDeque<Pending<M>>,
    failure: Option<String>,
}

impl<M> CollectiveWatch<M> {
    pub(crate) fn new(rank: usize, world_size: usize, timeout: Duration) -> Self {
        Self {
            rank,
            world_size,
            timeout,
            next_seq: 0,
            pending: VecDeque::new(),
            failure: None,
        }
    }

    /// Ok while no failure was seen; after one, the error every op of the collective
    /// returns instead of touching the aborted communicator.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        match &self.failure {
            None => Ok(()),
            Some(failure) => Err(Error::Collective {
                op,
                msg: format!("the NCCL communicator was aborted: {failure}"),
            }),
        }
    }

    /// Takes note of `op`, just enqueued at `now`, and returns its sequence number. After
    /// a failure the op may have been enqueued on an aborted communicator, so its result
    /// is the failure's error.
    pub(crate) fn enqueued(
        &mut self,
        op: &'static str,
        elements: usize,
        now: Instant,
        done_marker: M,
    ) -> Result<u64> {
        self.check(op)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push_back(Pending {
            seq,
            op,
            elements,
            enqueued: now,
            done_marker,
        });
        Ok(seq)
    }

    /// Records `failure` from outside the watch (another rank stopped); true when it is
    /// the first failure, which the caller then acts on.
    pub(crate) fn fail(&mut self, failure: &str) -> bool {
        if self.failure.is_some() {
            return false;
        }
        self.failure = Some(failure.to_owned());
        true
    }

    /// One look at the collective at `now`: drops the pending collectives `is_done` says
    /// are finished, oldest first (they finish in order, on one stream), then fails on
    /// `async_error` (what NCCL reported, if anything), on an `is_done` error, or when the
    /// oldest pending collective is older than the timeout. Returns the failure message
    /// the first time it fails, so the caller aborts once; `None` otherwise.
    pub(crate) fn poll(
        &mut self,
        now: Instant,
        async_error: Option<&str>,
        mut is_done: impl FnMut(&M) -> std::result::Result<bool, String>,
    ) -> Option<String> {
        if self.failure.is_some() {
            return None;
        }
        let mut query_error = None;
        while let Some(oldest) = self.pending.front() {
            match is_done(&oldest.done_marker) {
                Ok(true) => {
                    self.pending.pop_front();
                }
                Ok(false) => break,
                Err(e) => {
                    query_error = Some(e);
                    break;
                }
            }
        }
        let who = format!("rank {} of {}", self.rank, self.world_size);
        let oldest = self.pending.front();
        let age = |p: &Pending<M>| now.saturating_duration_since(p.enqueued).as_secs();
        let failure = if let Some(error) = async_error {
            let during = match oldest {
                Some(p) => format!("with {} pending for {} s", p.describe(), age(p)),
                None => "with no collective pending".into(),
            };
            Some(format!(
                "{who}: NCCL reported an asynchronous error ({error}) {during}: a peer rank \
                 died or the network failed"
            ))
        } else if let (Some(error), Some(p)) = (query_error, oldest) {
            Some(format!(
                "{who}: NCCL {}: CUDA failed while checking whether it finished: {error}",
                p.describe()
            ))
        } else {
            oldest
                .filter(|p| now.saturating_duration_since(p.enqueued) > self.timeout)
                .map(|p| {
                    format!(
                        "{who}: NCCL {} not finished after {} s: a peer rank died or stopped \
                         calling collectives",
                        p.describe(),
                        age(p)
                    )
                })
        };
        self.failure.clone_from(&failure);
        failure
    }
}

/// A duration in whole seconds from the environment variable `name`, whose value is
/// `value`: `default` when unset; anything but a positive whole number is an error naming
/// the variable and the value.
pub(crate) fn seconds_setting(name: &str, value: Option<&str>, default: u64) -> Result<Duration> {
    let Some(value) = value else {
        return Ok(Duration::from_secs(default));
    };
    match value.trim().parse::<u64>() {
        Ok(secs) if secs > 0 => Ok(Duration::from_secs(secs)),
        _ => Err(Error::Collective {
            op: "init",
            msg: format!("{name}={value:?}: expected a positive whole number of seconds"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(600);

    /// A done marker the test flips: the stand-in for a CUDA event.
    type Marker = std::rc::Rc<std::cell::Cell<bool>>;

    fn done(m: &Marker) -> std::result::Result<bool, String> {
        Ok(m.get())
    }

    fn marker() -> Marker {
        Marker::default()
    }

    #[test]
    fn a_collective_older_than_the_timeout_fails_naming_rank_op_and_sequence() {
        let start = Instant::now();
        let mut watch = CollectiveWatch::new(1, 4, TIMEOUT);
        for _ in 0..37 {
            let m = marker();
            watch.enqueued("barrier", 1, start, m.clone()).unwrap();
            m.set(true);
        }
        let seq = watch
            .enqueued("all_reduce_sum", 25_000_000, start, marker())
            .unwrap();
        assert_eq!(seq, 37);
        assert_eq!(
            watch.poll(start + TIMEOUT, None, done),
            None,
            "not older yet"
        );
        let failure = watch
            .poll(start + Duration::from_secs(601), None, done)
            .expect("older than the timeout");
        assert_eq!(
            failure,
            "rank 1 of 4: NCCL all_reduce_sum #37 (25000000 elements) not finished after \
             601 s: a peer rank died or stopped calling collectives"
        );
        assert_eq!(
            watch.poll(start + Duration::from_secs(700), None, done),
            None,
            "a failure is reported once, so the communicator is aborted once"
        );
    }

    #[test]
    fn finished_collectives_are_dropped_oldest_first() {
        let start = Instant::now();
        let mut watch = CollectiveWatch::new(0, 2, TIMEOUT);
        let markers: Vec<Marker> = (0..3).map(|_| marker()).collect();
        for (i, m) in markers.iter().enumerate() {
            let at = start + Duration::from_secs(i as u64 * 100);
            watch.enqueued("all_gather", 8, at, m.clone()).unwrap();
        }
        markers[0].set(true);
        markers[1].set(true);
        // #0 and #1 are done; #2, enqueued at 200 s, is only 500 s old at 700 s.
        assert_eq!(
            watch.poll(start + Duration::from_secs(700), None, done),
            None
        );
        assert_eq!(watch.pending.len(), 1);
        markers[2].set(true);
        assert_eq!(
            watch.poll(start + Duration::from_secs(5000), None, done),
            None
        );
        assert!(watch.pending.is_empty());
        // Only the oldest is asked about: a later one is never done before it.
        let late = marker();
        watch.enqueued("broadcast", 4, start, marker()).unwrap();
        watch.enqueued("broadcast", 4, start, late.clone()).unwrap();
        late.set(true);
        let failure = watch
            .poll(start + Duration::from_secs(5000), None, done)
            .unwrap();
        assert!(failure.contains("broadcast #3 (4 elements)"), "{failure}");
    }

    #[test]
    fn an_async_error_fails_at_once() {
        let start = Instant::now();
        let mut watch = CollectiveWatch::new(2, 3, TIMEOUT);
        watch
            .enqueued("reduce_scatter_sum", 1024, start, marker())
            .unwrap();
        let failure = watch
            .poll(
                start + Duration::from_secs(3),
                Some("remote process exited or there was a network error"),
                done,
            )
            .unwrap();
        assert_eq!(
            failure,
            "rank 2 of 3: NCCL reported an asynchronous error (remote process exited or there \
             was a network error) with reduce_scatter_sum #0 (1024 elements) pending for 3 s: \
             a peer rank died or the network failed"
        );
        let mut idle = CollectiveWatch::<Marker>::new(0, 2, TIMEOUT);
        let failure = idle
            .poll(start, Some("unhandled system error"), done)
            .unwrap();
        assert!(failure.contains("with no collective pending"), "{failure}");
    }

    #[test]
    fn a_failed_query_fails_naming_the_collective() {
        let start = Instant::now();
        let mut watch = CollectiveWatch::new(0, 2, TIMEOUT);
        watch
            .enqueued("all_reduce_sum", 10, start, marker())
            .unwrap();
        let failure = watch
            .poll(start, None, |_| Err("an illegal memory access".into()))
            .unwrap();
        assert_eq!(
            failure,
            "rank 0 of 2: NCCL all_reduce_sum #0 (10 elements): CUDA failed while checking \
             whether it finished: an illegal memory access"
        );
    }

    #[test]
    fn a_failure_from_outside_acts_once_and_every_op_answers_with_it() {
        let start = Instant::now();
        let mut watch = CollectiveWatch::new(0, 4, TIMEOUT);
        watch.enqueued("all_gather", 3, start, marker()).unwrap();
        assert!(watch.fail("rank 0 of 4: rank 2 stopped: CUDA out of memory"));
        assert!(
            !watch.fail("rank 0 of 4: rank 3 stopped"),
            "only the first acts"
        );
        let Err(Error::Collective { msg, .. }) = watch.check("barrier") else {
            panic!("an op ran after the failure");
        };
        assert!(msg.ends_with("rank 2 stopped: CUDA out of memory"), "{msg}");
        // The watchdog does not abort a second time for its own reasons.
        assert_eq!(watch.poll(start + TIMEOUT * 2, None, done), None);
    }

    #[test]
    fn after_a_failure_every_op_answers_with_it() {
        let start = Instant::now();
        let mut watch = CollectiveWatch::new(1, 2, TIMEOUT);
        assert!(watch.check("barrier").is_ok());
        watch
            .enqueued("all_reduce_sum", 7, start, marker())
            .unwrap();
        let failure = watch.poll(start, Some("remote error"), done).unwrap();
        for op in ["all_reduce_sum", "all_gather", "barrier"] {
            let Err(Error::Collective { op: got, msg }) = watch.check(op) else {
                panic!("{op} ran after the failure");
            };
            assert_eq!(got, op);
            assert!(msg.ends_with(&failure), "{msg}");
        }
        let Err(Error::Collective { msg, .. }) = watch.enqueued("broadcast", 1, start, marker())
        else {
            panic!("an op enqueued after the failure succeeded");
        };
        assert!(msg.contains("aborted"), "{msg}");
    }

    #[test]
    fn settings_in_seconds_default_when_unset_and_reject_bad_values() {
        let name = "FLOE_NCCL_TIMEOUT_SECS";
        assert_eq!(
            seconds_setting(name, None, 600).unwrap(),
            Duration::from_secs(600)
        );
        assert_eq!(
            seconds_setting(name, Some("90"), 600).unwrap(),
            Duration::from_secs(90)
        );
        for bad in ["", "0", "-5", "1.5", "ten"] {
            let e = seconds_setting(name, Some(bad), 600)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{name}={bad:?}")), "{e}");
        }
    }
}
