//! Metric names (SkyRL/verl taxonomy) and the pure statistics behind them.

use std::collections::BTreeMap;

/// Metric keys as logged; per-data-source and per-k keys are built by the functions here.
pub mod names {
    /// Mean of the sequence scores.
    pub const REWARD_AVG_RAW_REWARD: &str = "reward/avg_raw_reward";
    /// Mean of `max(score, 0)`.
    pub const REWARD_MEAN_POSITIVE_REWARD: &str = "reward/mean_positive_reward";
    /// Sequences whose group had equal rewards, when `zero_variance_filter` is on.
    pub const REWARD_NUM_ZERO_VARIANCE_FILTERED: &str = "reward/num_zero_variance_filtered";
    /// Dynamic sampling: batches of prompts the step sampled (the first included).
    pub const DYNAMIC_SAMPLING_NUM_GEN_BATCHES: &str = "dynamic_sampling/num_gen_batches";
    /// Dynamic sampling: groups the step sampled over all its batches.
    pub const DYNAMIC_SAMPLING_NUM_SAMPLED_GROUPS: &str = "dynamic_sampling/num_sampled_groups";
    /// Dynamic sampling: sampled groups dropped for equal rewards.
    pub const DYNAMIC_SAMPLING_NUM_FILTERED_GROUPS: &str = "dynamic_sampling/num_filtered_groups";
    /// Dynamic sampling: the share of sampled groups dropped for equal rewards.
    pub const DYNAMIC_SAMPLING_FILTERED_GROUPS_FRAC: &str = "dynamic_sampling/filtered_groups_frac";
    /// Dynamic sampling: groups the step trained on (`train_batch_size` unless the batch
    /// cap was reached first).
    pub const DYNAMIC_SAMPLING_NUM_TRAINED_GROUPS: &str = "dynamic_sampling/num_trained_groups";
    /// `replace` dynamic sampling: groups without a signal that were replaced by copies
    /// of groups with one.
    pub const DYNAMIC_SAMPLING_NUM_REPLACED_GROUPS: &str = "dynamic_sampling/num_replaced_groups";
    /// Overlong shaping: the share of sampled responses whose last turn stopped at the
    /// length limit.
    pub const OVERLONG_TRUNCATED_FRAC: &str = "overlong/truncated_frac";
    /// Overlong filtering: sampled responses masked out of the loss for their truncation.
    pub const OVERLONG_NUM_FILTERED: &str = "overlong/num_filtered";
    /// Soft overlong punishment: mean penalty over sampled responses (0 or below).
    pub const OVERLONG_PENALTY_MEAN: &str = "overlong/penalty_mean";
    /// Soft overlong punishment: the share of sampled responses penalised.
    pub const OVERLONG_PENALIZED_FRAC: &str = "overlong/penalized_frac";
    /// Mean response length in tokens.
    pub const GENERATE_AVG_NUM_TOKENS: &str = "generate/avg_num_tokens";
    /// Shortest response.
    pub const GENERATE_MIN_NUM_TOKENS: &str = "generate/min_num_tokens";
    /// Longest response.
    pub const GENERATE_MAX_NUM_TOKENS: &str = "generate/max_num_tokens";
    /// Population std of the response lengths.
    pub const GENERATE_STD_NUM_TOKENS: &str = "generate/std_num_tokens";
    /// Mean length of responses with a non-zero score.
    pub const GENERATE_AVG_TOKENS_NON_ZERO_REWARDS: &str = "generate/avg_tokens_non_zero_rewards";
    /// Mean length of responses with a zero score.
    pub const GENERATE_AVG_TOKENS_ZERO_REWARDS: &str = "generate/avg_tokens_zero_rewards";
    /// Sequences in the batch.
    pub const GENERATE_BATCH_NUM_SEQ: &str = "generate/batch_num_seq";
    /// Mean per-sequence reward after KL-in-reward.
    pub const LOSS_AVG_FINAL_REWARDS: &str = "loss/avg_final_rewards";
    /// Mean advantage over response tokens.
    pub const LOSS_AVG_RAW_ADVANTAGES: &str = "loss/avg_raw_advantages";
    /// Mean |advantage| over response tokens.
    pub const LOSS_AVG_RAW_ADVANTAGES_ABS: &str = "loss/avg_raw_advantages_abs";
    /// KL-in-reward: mean per-sequence KL.
    pub const LOSS_AVG_KL: &str = "loss/avg_kl";
    /// KL-in-reward: mean per-sequence maximum KL.
    pub const LOSS_AVG_KL_MAX: &str = "loss/avg_kl_max";
    /// KL-in-reward: the current β.
    pub const LOSS_KL_LOSS_COEF: &str = "loss/kl_loss_coef";
    /// Policy-gradient part of the loss (summed over micro-batches).
    pub const POLICY_PG_LOSS: &str = "policy/pg_loss";
    /// KL loss before its coefficient (summed over micro-batches).
    pub const POLICY_KL_LOSS: &str = "policy/kl_loss";
    /// Total loss that was differentiated (summed over micro-batches).
    pub const POLICY_FINAL_LOSS: &str = "policy/final_loss";
    /// Masked mean of `logπ_old − logπ`.
    pub const POLICY_PPO_KL: &str = "policy/ppo_kl";
    /// Largest `|logπ − logπ_old|` over valid tokens: 0 when the ratio is exactly 1 on
    /// every token (the first update of a step whose old log-probs are exact).
    pub const POLICY_PPO_LOG_RATIO_ABS_MAX: &str = "policy/ppo_log_ratio_abs_max";
    /// Fraction of valid tokens where the clip bound was selected.
    pub const POLICY_CLIPFRAC: &str = "policy/clipfrac";
    /// Dual clip: fraction of valid tokens where `−c·A` was selected.
    pub const POLICY_CLIPFRAC_LOWER: &str = "policy/clipfrac_lower";
    /// Masked mean token entropy.
    pub const POLICY_ENTROPY: &str = "policy/entropy";
    /// Global gradient L2 norm before clipping.
    pub const POLICY_GRAD_NORM: &str = "policy/grad_norm";
    /// Learning rate of the step.
    pub const POLICY_LR: &str = "policy/policy_lr";
    /// Off-policy: mean of `ρ = exp(logπ_old − logπ_rollout)` over valid tokens.
    pub const IS_RATIO_MEAN: &str = "policy/loss_metrics/is_ratio_mean";
    /// Off-policy: std of ρ.
    pub const IS_RATIO_STD: &str = "policy/loss_metrics/is_ratio_std";
    /// Off-policy: minimum ρ.
    pub const IS_RATIO_MIN: &str = "policy/loss_metrics/is_ratio_min";
    /// Off-policy: maximum ρ.
    pub const IS_RATIO_MAX: &str = "policy/loss_metrics/is_ratio_max";
    /// Token TIS: fraction of valid tokens whose ρ was capped.
    pub const TIS_TOKEN_CLIP_HIGH_RATIO: &str = "policy/loss_metrics/tis_token_clip_high_ratio";
    /// Sequence TIS: fraction of sequences whose ρ product was capped.
    pub const TIS_SEQ_CLIP_HIGH_RATIO: &str = "policy/loss_metrics/tis_seq_clip_high_ratio";
    /// Fraction of sequences dropped for an outlier token.
    pub const OUTLIER_SEQ_MASKED_RATIO: &str = "policy/loss_metrics/outlier_seq_masked_ratio";
    /// Fraction of valid tokens dropped by the token mask.
    pub const TOKEN_MASKED_RATIO: &str = "policy/loss_metrics/token_masked_ratio";
    /// Fraction of sequences failing the sequence mask.
    pub const SEQUENCE_MASKED_RATIO: &str = "policy/loss_metrics/sequence_masked_ratio";
    /// Eval over every data source: mean score.
    pub const EVAL_ALL_AVG_SCORE: &str = "eval/all/avg_score";
    /// Eval over every data source: mean of `max(score, 0)`.
    pub const EVAL_ALL_MEAN_POSITIVE_REWARD: &str = "eval/all/mean_positive_reward";

    /// `reward/avg_pass_at_{n}`.
    pub fn reward_avg_pass_at(n: usize) -> String {
        format!("reward/avg_pass_at_{n}")
    }

    /// `eval/<data_source>/<metric>`; `data_source = "all"` for the aggregate. A `/` in the
    /// data source (`openai/gsm8k`) becomes `_` so the key keeps three levels.
    pub fn eval(data_source: &str, metric: &str) -> String {
        format!("eval/{}/{metric}", data_source.replace('/', "_"))
    }

    /// `pass_at_{k}`, the metric part of an eval key.
    pub fn pass_at(k: usize) -> String {
        format!("pass_at_{k}")
    }
}

/// Unbiased pass@k from `n` samples of which `c` are correct: `1 − C(n−c, k)/C(n, k)`,
/// computed as a product to stay exact for large `n`. 1 when fewer than `k` are wrong.
///
/// # Panics
/// If `c > n` or `k > n` or `k == 0`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    assert!(
        c <= n && (1..=n).contains(&k),
        "pass@k needs c <= n and 1 <= k <= n (n={n}, c={c}, k={k})"
    );
    if n - c < k {
        return 1.0;
    }
    // C(n−c, k)/C(n, k) = Π_{i=n−c+1}^{n} (1 − k/i).
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// SkyRL's `pass_at_{n}`: the fraction of groups in which any sample scored above 0.
pub fn pass_at_n_any(scores_s: &[f64], group_ids: &[u64]) -> f64 {
    assert_eq!(scores_s.len(), group_ids.len(), "one group id per score");
    let mut passed: BTreeMap<u64, bool> = BTreeMap::new();
    for (&s, &g) in scores_s.iter().zip(group_ids) {
        *passed.entry(g).or_insert(false) |= s > 0.0;
    }
    mean(passed.values().map(|&p| f64::from(u8::from(p))))
}

/// Mean of `max(score, 0)` (negative format penalties count as 0).
pub fn mean_positive_reward(scores_s: &[f64]) -> f64 {
    mean(scores_s.iter().map(|s| s.max(0.0)))
}

/// Mean, population std, min and max of some values (all 0 when there are none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Arithmetic mean.
    pub mean: f64,
    /// Population standard deviation (divides by n).
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

/// Summarises `values`.
pub fn summarize(values: &[f64]) -> Summary {
    if values.is_empty() {
        return Summary {
            mean: 0.0,
            std: 0.0,
            min: 0.0,
            max: 0.0,
        };
    }
    let m = mean(values.iter().copied());
    Summary {
        mean: m,
        std: mean(values.iter().map(|v| (v - m).powi(2))).sqrt(),
        min: values.iter().copied().fold(f64::INFINITY, f64::min),
        max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Mean score of each group, in ascending group-id order.
pub fn group_means(scores_s: &[f64], group_ids: &[u64]) -> Vec<f64> {
    assert_eq!(scores_s.len(), group_ids.len(), "one group id per score");
    let mut sums: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for (&s, &g) in scores_s.iter().zip(group_ids) {
        let e = sums.entry(g).or_insert((0.0, 0.0));
        e.0 += s;
        e.1 += 1.0;
    }
    sums.values().map(|(s, n)| s / n).collect()
}

/// Reward metrics of a training batch: `reward/avg_raw_reward`, `reward/avg_pass_at_{n}`
/// (`n` = samples per prompt), `reward/mean_positive_reward`.
pub fn reward_metrics(
    scores_s: &[f64],
    group_ids: &[u64],
    n_samples: usize,
) -> BTreeMap<String, f64> {
    BTreeMap::from([
        (
            names::REWARD_AVG_RAW_REWARD.to_string(),
            mean(scores_s.iter().copied()),
        ),
        (
            names::reward_avg_pass_at(n_samples),
            pass_at_n_any(scores_s, group_ids),
        ),
        (
            names::REWARD_MEAN_POSITIVE_REWARD.to_string(),
            mean_positive_reward(scores_s),
        ),
    ])
}

/// `generate/{avg,min,max,std}_num_tokens` and the mean lengths of zero / non-zero
/// scored responses (0 when there are none).
pub fn response_length_metrics(lengths_s: &[usize], scores_s: &[f64]) -> BTreeMap<String, f64> {
    assert_eq!(lengths_s.len(), scores_s.len(), "one score per response");
    let lengths: Vec<f64> = lengths_s.iter().map(|&l| l as f64).collect();
    let s = summarize(&lengths);
    let split = |zero: bool| {
        mean(
            lengths
                .iter()
                .zip(scores_s)
                .filter(|(_, &r)| (r == 0.0) == zero)
                .map(|(l, _)| *l),
        )
    };
    BTreeMap::from([
        (names::GENERATE_AVG_NUM_TOKENS.to_string(), s.mean),
        (names::GENERATE_MIN_NUM_TOKENS.to_string(), s.min),
        (names::GENERATE_MAX_NUM_TOKENS.to_string(), s.max),
        (names::GENERATE_STD_NUM_TOKENS.to_string(), s.std),
        (
            names::GENERATE_AVG_TOKENS_NON_ZERO_REWARDS.to_string(),
            split(false),
        ),
        (
            names::GENERATE_AVG_TOKENS_ZERO_REWARDS.to_string(),
            split(true),
        ),
        (
            names::GENERATE_BATCH_NUM_SEQ.to_string(),
            lengths.len() as f64,
        ),
    ])
}

/// Eval metrics per data source and over all: `eval/<ds>/{avg_score, pass_at_{n},
/// mean_positive_reward}` with `n` = samples per prompt.
pub fn eval_metrics(
    data_sources_s: &[&str],
    scores_s: &[f64],
    group_ids: &[u64],
    n_samples: usize,
) -> BTreeMap<String, f64> {
    assert_eq!(
        data_sources_s.len(),
        scores_s.len(),
        "one data source per score"
    );
    let mut by_source: BTreeMap<&str, (Vec<f64>, Vec<u64>)> = BTreeMap::new();
    for ((&ds, &s), &g) in data_sources_s.iter().zip(scores_s).zip(group_ids) {
        let e = by_source.entry(ds).or_default();
        e.0.push(s);
        e.1.push(g);
    }
    let mut out = BTreeMap::new();
    let mut put = |ds: &str, scores: &[f64], groups: &[u64]| {
        out.insert(names::eval(ds, "avg_score"), mean(scores.iter().copied()));
        out.insert(
            names::eval(ds, &names::pass_at(n_samples)),
            pass_at_n_any(scores, groups),
        );
        out.insert(
            names::eval(ds, "mean_positive_reward"),
            mean_positive_reward(scores),
        );
    };
    for (ds, (scores, groups)) in &by_source {
        put(ds, scores, groups);
    }
    put("all", scores_s, group_ids);
    out
}

/// Combines the metrics of the micro-batches of one step: keys ending in `_loss` are summed
/// (they are already normalised by global counts), `_min`/`_max` keys take the min/max, the
/// rest are averaged over the micro-batches that reported them.
pub fn reduce_micro_batch_metrics(
    per_micro_batch: &[BTreeMap<String, f64>],
) -> BTreeMap<String, f64> {
    let mut values: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for m in per_micro_batch {
        for (k, &v) in m {
            values.entry(k).or_default().push(v);
        }
    }
    values
        .into_iter()
        .map(|(k, vs)| {
            let v = if k.ends_with("_loss") {
                vs.iter().sum()
            } else if k.ends_with("_min") {
                vs.iter().copied().fold(f64::INFINITY, f64::min)
            } else if k.ends_with("_max") {
                vs.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            } else {
                mean(vs.iter().copied())
            };
            (k.to_string(), v)
        })
        .collect()
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_matches_combinatorics() {
        // n=5, c=2, k=2: 1 − C(3,2)/C(5,2) = 1 − 3/10.
        assert!((pass_at_k(5, 2, 2) - 0.7).abs() < 1e-12);
        // k=1 is the plain accuracy c/n.
        assert!((pass_at_k(8, 3, 1) - 0.375).abs() < 1e-12);
        assert_eq!(pass_at_k(4, 3, 2), 1.0);
        assert_eq!(pass_at_k(4, 0, 4), 0.0);
    }

    #[test]
    fn reward_metrics_on_hand_computed_batch() {
        // Groups: 0 → (1, −1) passes, 1 → (0, 0) fails.
        let m = reward_metrics(&[1.0, -1.0, 0.0, 0.0], &[0, 0, 1, 1], 2);
        assert_eq!(m[names::REWARD_AVG_RAW_REWARD], 0.0);
        assert_eq!(m["reward/avg_pass_at_2"], 0.5);
        assert_eq!(m[names::REWARD_MEAN_POSITIVE_REWARD], 0.25);
        assert_eq!(
            group_means(&[1.0, -1.0, 0.0, 0.5], &[0, 0, 1, 1]),
            vec![0.0, 0.25]
        );
    }

    #[test]
    fn summaries_and_lengths() {
        let s = summarize(&[1.0, 3.0]);
        assert_eq!(
            s,
            Summary {
                mean: 2.0,
                std: 1.0,
                min: 1.0,
                max: 3.0
            }
        );
        let m = response_length_metrics(&[10, 20, 30], &[1.0, 0.0, 0.0]);
        assert_eq!(m[names::GENERATE_AVG_NUM_TOKENS], 20.0);
        assert_eq!(m[names::GENERATE_AVG_TOKENS_NON_ZERO_REWARDS], 10.0);
        assert_eq!(m[names::GENERATE_AVG_TOKENS_ZERO_REWARDS], 25.0);
        assert_eq!(m[names::GENERATE_MAX_NUM_TOKENS], 30.0);
    }

    #[test]
    fn eval_metrics_split_by_data_source() {
        let m = eval_metrics(
            &["bird", "bird", "gsm8k", "gsm8k"],
            &[1.0, 0.0, 0.0, 0.0],
            &[0, 0, 1, 1],
            2,
        );
        assert_eq!(m["eval/bird/avg_score"], 0.5);
        assert_eq!(m["eval/bird/pass_at_2"], 1.0);
        assert_eq!(m["eval/gsm8k/pass_at_2"], 0.0);
        assert_eq!(m[names::EVAL_ALL_AVG_SCORE], 0.25);
        assert_eq!(m["eval/all/pass_at_2"], 0.5);
        assert_eq!(m[names::EVAL_ALL_MEAN_POSITIVE_REWARD], 0.25);
        assert_eq!(
            names::eval("openai/gsm8k", "avg_score"),
            "eval/openai_gsm8k/avg_score"
        );
    }

    #[test]
    fn micro_batch_metrics_reduce_by_suffix() {
        let a = BTreeMap::from([
            ("policy/pg_loss".to_string(), 0.25),
            ("policy/clipfrac".to_string(), 0.1),
            ("policy/loss_metrics/is_ratio_max".to_string(), 2.0),
        ]);
        let b = BTreeMap::from([
            ("policy/pg_loss".to_string(), 0.5),
            ("policy/clipfrac".to_string(), 0.3),
            ("policy/loss_metrics/is_ratio_max".to_string(), 1.5),
        ]);
        let m = reduce_micro_batch_metrics(&[a, b]);
        assert_eq!(m["policy/pg_loss"], 0.75);
        assert!((m["policy/clipfrac"] - 0.2).abs() < 1e-15);
        assert_eq!(m["policy/loss_metrics/is_ratio_max"], 2.0);
    }
}
