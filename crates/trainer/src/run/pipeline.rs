//! The bookkeeping of `trainer.pipeline`: how stale the trained samples were, how many
//! were dropped for it, and how long generation and training ran side by side.
//!
//! A policy version is the count of RL optimizer steps taken; a sample's staleness when a
//! mini-batch trains on it is the version of the weights being trained minus the version
//! that sampled it. Sync runs train their first mini-batch at staleness 0 (later
//! mini-batches of the step are as many versions older as optimizer steps came before
//! them); one-step-off runs start a step's training one step's optimizer steps stale.

use std::collections::BTreeMap;
use std::time::Instant;

/// `async/staleness_mean` and `async/staleness_max`: over every sample a mini-batch
/// trained on (a sample trained in several update epochs counts each time).
pub const STALENESS_MEAN: &str = "async/staleness_mean";
/// The largest staleness a mini-batch trained on.
pub const STALENESS_MAX: &str = "async/staleness_max";
/// Samples left out of mini-batches for being more than `trainer.pipeline.max_staleness`
/// versions old (once per update epoch).
pub const DROPPED_STALE: &str = "async/dropped_stale";
/// Wall time of the step's sampling of the next batch (one-step-off).
pub const SAMPLE_NEXT_S: &str = "async/sample_next_s";
/// Wall time of the training work that ran beside it (old log-probs, advantages, the
/// first mini-batch's forward and backward).
pub const TRAIN_SIDE_S: &str = "async/train_side_s";
/// Time both sides ran at once: what overlap saved against running them in turn.
pub const OVERLAPPED_S: &str = "async/overlapped_s";
/// Time the trainer waited for the sampler after its own side finished.
pub const WAIT_FOR_SAMPLER_S: &str = "async/wait_for_sampler_s";

/// Whether samples made by `sampled_version` are more than `max_staleness` versions older
/// than `current_version`.
pub fn too_stale(sampled_version: u64, current_version: u64, max_staleness: Option<u64>) -> bool {
    max_staleness.is_some_and(|max| current_version.saturating_sub(sampled_version) > max)
}

/// What a step's mini-batches saw of the staleness of their samples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Staleness {
    /// Samples trained on, summed over mini-batches.
    trained: usize,
    /// Sum of their staleness.
    sum: u64,
    /// The largest.
    max: u64,
    /// Samples dropped for staleness.
    dropped: usize,
}

impl Staleness {
    /// Decides whether a mini-batch of `samples` samples, made by `sampled_version`, trains
    /// at `current_version` under `max_staleness`, and counts it either way; returns true
    /// when it trains.
    pub fn admit(
        &mut self,
        samples: usize,
        sampled_version: u64,
        current_version: u64,
        max_staleness: Option<u64>,
    ) -> bool {
        if too_stale(sampled_version, current_version, max_staleness) {
            self.dropped += samples;
            return false;
        }
        let staleness = current_version.saturating_sub(sampled_version);
        self.trained += samples;
        self.sum += staleness * samples as u64;
        self.max = self.max.max(staleness);
        true
    }

    /// `async/dropped_stale`, and the mean and largest staleness when some sample trained.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut metrics = BTreeMap::from([(DROPPED_STALE.to_string(), self.dropped as f64)]);
        if self.trained > 0 {
            metrics.insert(
                STALENESS_MEAN.to_string(),
                self.sum as f64 / self.trained as f64,
            );
            metrics.insert(STALENESS_MAX.to_string(), self.max as f64);
        }
        metrics
    }
}

/// When one side of an overlap ran.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// When it started.
    pub start: Instant,
    /// When it finished.
    pub end: Instant,
}

impl Span {
    /// The span from `start` until now.
    pub fn since(start: Instant) -> Self {
        Self {
            start,
            end: Instant::now(),
        }
    }

    fn seconds(&self) -> f64 {
        self.end.duration_since(self.start).as_secs_f64()
    }
}

/// The overlap metrics of a step whose next batch was sampled (`sampling`) beside its
/// training work (`training`): each side's wall time, the time they shared, and how long
/// training then waited for the sampler. Run one after the other, they share none.
pub fn overlap_metrics(sampling: Span, training: Span) -> BTreeMap<String, f64> {
    let shared_start = sampling.start.max(training.start);
    let shared_end = sampling.end.min(training.end);
    let overlapped = shared_end
        .checked_duration_since(shared_start)
        .map_or(0.0, |d| d.as_secs_f64());
    let wait = sampling
        .end
        .checked_duration_since(training.end)
        .map_or(0.0, |d| d.as_secs_f64());
    BTreeMap::from([
        (SAMPLE_NEXT_S.to_string(), sampling.seconds()),
        (TRAIN_SIDE_S.to_string(), training.seconds()),
        (OVERLAPPED_S.to_string(), overlapped),
        (WAIT_FOR_SAMPLER_S.to_string(), wait),
    ])
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn staleness_is_averaged_over_samples_and_its_maximum_kept() {
        let mut staleness = Staleness::default();
        // A one-step-off batch made by version 4, trained by versions 6 and 7 in
        // mini-batches of 3 and 1 samples.
        assert!(staleness.admit(3, 4, 6, None));
        assert!(staleness.admit(1, 4, 7, None));
        let metrics = staleness.metrics();
        assert_eq!(metrics[STALENESS_MEAN], (3.0 * 2.0 + 3.0) / 4.0);
        assert_eq!(metrics[STALENESS_MAX], 3.0);
        assert_eq!(metrics[DROPPED_STALE], 0.0);
    }

    #[test]
    fn samples_beyond_max_staleness_are_dropped_and_counted() {
        let mut staleness = Staleness::default();
        assert!(staleness.admit(2, 10, 11, Some(1)));
        assert!(!staleness.admit(2, 10, 12, Some(1)));
        assert!(!staleness.admit(5, 10, 13, Some(1)));
        let metrics = staleness.metrics();
        assert_eq!(metrics[DROPPED_STALE], 7.0);
        assert_eq!(metrics[STALENESS_MAX], 1.0);
        assert_eq!(metrics[STALENESS_MEAN], 1.0);
    }

    #[test]
    fn a_step_that_dropped_everything_reports_only_the_drops() {
        let mut staleness = Staleness::default();
        assert!(!staleness.admit(4, 0, 3, Some(2)));
        let metrics = staleness.metrics();
        assert_eq!(metrics.len(), 1);
        assert_eq!(metrics[DROPPED_STALE], 4.0);
    }

    #[test]
    fn overlap_is_the_time_both_sides_ran_and_the_wait_what_sampling_ran_past_training() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let m = overlap_metrics(
            Span {
                start: at(0),
                end: at(500),
            },
            Span {
                start: at(100),
                end: at(300),
            },
        );
        assert!((m[SAMPLE_NEXT_S] - 0.5).abs() < 1e-9);
        assert!((m[TRAIN_SIDE_S] - 0.2).abs() < 1e-9);
        assert!((m[OVERLAPPED_S] - 0.2).abs() < 1e-9);
        assert!((m[WAIT_FOR_SAMPLER_S] - 0.2).abs() < 1e-9);
        // One after the other: nothing shared, and training never waited.
        let m = overlap_metrics(
            Span {
                start: at(0),
                end: at(400),
            },
            Span {
                start: at(400),
                end: at(600),
            },
        );
        assert_eq!(m[OVERLAPPED_S], 0.0);
        assert_eq!(m[WAIT_FOR_SAMPLER_S], 0.0);
    }
}
