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
