//! DAPO's sample shaping (Yu et al., 2025), as verl and SkyRL run it: which groups carry a
//! learning signal (dynamic sampling keeps only those) and the soft overlong punishment
//! (a reward penalty that grows linearly over the last tokens before the length limit).

use crate::advantage::zero_variance_sequences;

/// Each group of the batch, in first-seen order, with whether it carries a learning signal:
/// its scores are not all equal. A group of equal scores has zero advantage under GRPO,
/// RLOO and MaxRL, so it only dilutes the batch; dynamic sampling drops it. Scores compare
/// exactly, as [`zero_variance_sequences`] does.
pub fn group_signal(scores_s: &[f64], group_ids_s: &[u64]) -> Vec<(u64, bool)> {
    let flat = zero_variance_sequences(scores_s, group_ids_s);
    let mut groups: Vec<(u64, bool)> = Vec::new();
    for (&id, &zero_variance) in group_ids_s.iter().zip(&flat) {
        if !groups.iter().any(|&(seen, _)| seen == id) {
            groups.push((id, !zero_variance));
        }
    }
    groups
}

/// SkyRL's `replace` dynamic sampling (after POLARIS): when more than `min_replace_ratio`
/// of a batch's groups carry a signal, each group without one is replaced by a copy of a
/// group with one, so the step trains on a full batch without sampling again. Returns, per
/// group, the group whose samples fill its place (itself when it has a signal), or `None`
/// when too few groups carry a signal (sample another batch). Copies are drawn without
/// repetition while there are enough groups with a signal, with repetition after that;
/// `uniform_below(n)` draws in `0..n` (the caller seeds it, so a step's choice replays).
pub fn replacement_groups(
    has_signal: &[bool],
    min_replace_ratio: f64,
    mut uniform_below: impl FnMut(usize) -> usize,
) -> Option<Vec<usize>> {
    let mut good: Vec<usize> = (0..has_signal.len()).filter(|&g| has_signal[g]).collect();
    if good.is_empty() || good.len() as f64 <= has_signal.len() as f64 * min_replace_ratio {
        return None;
    }
    let bad = has_signal.len() - good.len();
    let mut sources: Vec<usize> = if good.len() >= bad {
        // The first `bad` places of a partial Fisher–Yates shuffle.
        for i in 0..bad {
            let j = i + uniform_below(good.len() - i);
            good.swap(i, j);
        }
        good[..bad].to_vec()
    } else {
        (0..bad).map(|_| good[uniform_below(good.len())]).collect()
    };
    sources.reverse();
    Some(
        has_signal
            .iter()
            .enumerate()
            .map(|(g, &signal)| if signal { g } else { sources.pop().unwrap() })
            .collect(),
    )
}

/// DAPO's soft overlong punishment of a response of `response_len` tokens when responses
/// stop at `max_response_len`: 0 up to `max_response_len - buffer_len`, then falling
/// linearly to `-penalty_factor` at `max_response_len` (verl's
/// `min(-(len - expected) / buffer_len · factor, 0)`), and held at `-penalty_factor`
/// beyond it (a multi-turn trajectory can generate more than one turn's limit). Added to
/// the sequence's reward. A `buffer_len` of 0 is no punishment; a buffer longer than the
/// limit starts at length 0.
pub fn overlong_penalty(
    response_len: usize,
    max_response_len: usize,
    buffer_len: usize,
    penalty_factor: f64,
) -> f64 {
    if buffer_len == 0 {
        return 0.0;
    }
    let expected = max_response_len.saturating_sub(buffer_len);
    let exceed = response_len.saturating_sub(expected).min(buffer_len);
    -(exceed as f64) / buffer_len as f64 * penalty_factor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_of_equal_scores_carry_no_signal() {
        // Groups 3 (all correct), 1 (mixed), 0 (all wrong), 2 (one sample), in that order.
        let scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 1.0];
        let groups = [3, 3, 1, 1, 0, 0, 2, 3];
        assert_eq!(
            group_signal(&scores, &groups),
            vec![(3, false), (1, true), (0, false), (2, false)]
        );
        assert!(group_signal(&[], &[]).is_empty());
    }

    #[test]
    fn replacement_fills_every_silent_group_with_a_group_with_signal() {
        // A counter for draws: uniform_below(n) = counter % n.
        let counter = |start: usize| {
            let mut next = start;
            move |n: usize| {
                next += 1;
                (next - 1) % n
            }
        };
        // 3 of 5 carry a signal (0.6 > 0.3): the 2 silent ones get distinct sources.
        let signal = [true, false, true, false, true];
        let sources = replacement_groups(&signal, 0.3, counter(0)).unwrap();
        assert_eq!(sources.len(), 5);
        for g in [0, 2, 4] {
            assert_eq!(sources[g], g);
        }
        assert!(signal[sources[1]] && signal[sources[3]]);
        assert_ne!(sources[1], sources[3]);
        // 1 of 3 (0.33 > 0.3): both silent groups copy the one group with a signal.
        assert_eq!(
            replacement_groups(&[false, true, false], 0.3, counter(7)),
            Some(vec![1, 1, 1])
        );
        // At or under the ratio, or with no signal at all: sample again.
        assert_eq!(
            replacement_groups(&[true, false, false, false], 0.3, counter(0)),
            None
        );
        assert_eq!(replacement_groups(&[false, false], 0.0, counter(0)), None);
        // All carry a signal: nothing changes.
        assert_eq!(
            replacement_groups(&[true, true], 0.3, counter(0)),
            Some(vec![0, 1])
        );
    }

    #[test]
    fn overlong_penalty_matches_hand_computed_values() {
        // Limit 20, buffer 4, factor 1: free up to 16, then -1/4 per token down to -1.
        let p = |len| overlong_penalty(len, 20, 4, 1.0);
        assert_eq!(p(0), 0.0);
        assert_eq!(p(16), 0.0);
        assert_eq!(p(17), -0.25);
        assert_eq!(p(18), -0.5);
        assert_eq!(p(19), -0.75);
        assert_eq!(p(20), -1.0);
        assert_eq!(p(25), -1.0, "held at -factor past the limit");
        // Factor 0.5 scales it; DAPO's 16k buffer over a 20k limit: 4k free tokens.
        assert_eq!(overlong_penalty(19, 20, 4, 0.5), -0.375);
        assert_eq!(overlong_penalty(4096, 20480, 16384, 1.0), 0.0);
        assert_eq!(overlong_penalty(12288, 20480, 16384, 1.0), -0.5);
        // No buffer, no penalty; a buffer as long as the limit starts at 0 tokens.
        assert_eq!(overlong_penalty(20, 20, 0, 1.0), 0.0);
        assert_eq!(overlong_penalty(5, 20, 20, 1.0), -0.25);
    }
}
