//! Rollouts to training micro-batches: packing under a token budget, prompt sharing,
//! and the map from packed rows back to (sample, token).
//!
//! # Layout
//!
//! A micro-batch is one [`PackedBatch`]: a row of tokens cut into segments. Row `t` of the
//! lm-head scores `targets[t]`, the token that follows `tokens[t]` in its sequence, so
//! the log-prob of response token `i` is read at the row holding the token before it.
//!
//! **Shared** ([`PackingMode::Shared`], ZoRRO-style; built by
//! [`PackedBatch::push_shared_prompt`]): a group of `n` responses to one prompt `p[0..P]`
//! becomes
//!
//! ```text
//! prompt segment     p[0] … p[P-2]                      positions 0 … P-2
//! response segment   p[P-1] r[0] … r[R-2]   (×n)        positions P-1 … P+R-2,
//!                                                       prefix = the prompt segment
//! ```
//!
//! Each response segment starts with the prompt's *last* token and drops the response's
//! last token, so its `R` rows predict exactly `r[0] … r[R-1]`. This is the one way to
//! read every response token's log-prob exactly once, in a row that belongs to that
//! response alone: the row predicting `r[0]` sees the whole prompt plus nothing else, and
//! sharing it would need per-response targets on one row. The price is one recomputed
//! token per response. The last response token is never an input, since nothing is
//! predicted from it. A group costs `(P − 1) + Σ R` tokens instead of `n (P + R − 1)`.
//!
//! **Unshared** ([`PackingMode::Unshared`]; [`PackedBatch::push_sequence`]): each
//! response is its own causal segment
//! `p[0] … p[P-1] r[0] … r[R-2]`, whose last `R` rows predict the response. Both layouts
//! give every response token the same context, hence the same log-prob.
//!
//! # Budget and balance
//!
//! Items (a shared group, or one response when unshared) are placed largest first into
//! the least-loaded micro-batch, opening a new one when the item fits nowhere, starting
//! from the least count the total could fit in. A shared group larger than the budget is
//! split into runs of responses, each with its own copy of the prompt (gradients of the
//! copies add up, as micro-batches accumulate). A response that cannot fit even alone
//! with its prompt is an error.

use std::ops::Range;

use floe_model::batch::PackedBatch;

/// Where a packed group's prompt lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackingMode {
    /// The prompt once per group (per micro-batch the group lands in), shared as a prefix
    /// by the group's responses.
    Shared,
    /// The prompt repeated in front of every response.
    Unshared,
}

/// One sampled response of a group.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// What each position scores when that is not the response itself: position `i`,
    /// having read `tokens[..i]`, scores `targets[i]` (Tinker datums whose
    /// `target_tokens` are not their input shifted by one); `tokens.len()` values.
    pub targets: Option<Vec<u32>>,
    /// Per-token loss weight (mask times any weighting), `tokens.len()` values; carried
    /// to [`MicroBatch::weights`].
    pub weights: Vec<f32>,
}

/// A prompt and its responses.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutGroup {
    /// Prompt tokens; at least one (it predicts the first response token).
    pub prompt: Vec<u32>,
    /// The group's responses; empty ones are skipped.
    pub responses: Vec<Response>,
}

/// A response token: which group, which response of it, which of its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TokenRef {
    /// Index into the groups given to [`pack_rollouts`].
    pub group: u32,
    /// Index into that group's responses.
    pub response: u32,
    /// Index into that response's tokens.
    pub token: u32,
}

/// The rows of a micro-batch that score one response, or a run of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseRows {
    /// Group index.
    pub group: u32,
    /// Response index within the group.
    pub response: u32,
    /// Row scoring the response's token 0; token `i` is scored at `first_row + i`.
    pub first_row: u32,
    /// Tokens of the response (all of them: a response is never split).
    pub len: u32,
}

/// One packed micro-batch for the model, plus the map from its rows back to response
/// tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MicroBatch {
    /// Tokens, targets, positions and segments. Row `t` scores `targets[t]`, the next
    /// token of its sequence; prompt rows score the next prompt token and map to nothing.
    pub batch: PackedBatch,
    /// `[T]` loss weight of each row: the response token's weight, 0 for other rows.
    pub weights: Vec<f32>,
    /// Which rows score which response tokens, in packing order.
    pub responses: Vec<ResponseRows>,
}

impl MicroBatch {
    /// Rows in the micro-batch.
    pub fn len(&self) -> usize {
        self.batch.len()
    }

    /// True when it holds no row.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    /// Calls `f(row, token)` for every row that scores a response token.
    pub fn for_each_scored_row(&self, mut f: impl FnMut(usize, TokenRef)) {
        for rows in &self.responses {
            for i in 0..rows.len {
                let token = TokenRef {
                    group: rows.group,
                    response: rows.response,
                    token: i,
                };
                f((rows.first_row + i) as usize, token);
            }
        }
    }

    /// A `[T]` vector holding `value(token)` at each scoring row and 0 elsewhere: the
    /// way per-token loss gradients go back to packed rows (the model's
    /// `forward_backward` takes `dL/dlogprob` per row).
    pub fn scatter_to_rows(&self, mut value: impl FnMut(TokenRef) -> f64) -> Vec<f64> {
        let mut rows = vec![0.0; self.len()];
        self.for_each_scored_row(|row, token| rows[row] = value(token));
        rows
    }
}

/// How to pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackingConfig {
    /// Most tokens in one micro-batch.
    pub max_tokens_per_microbatch: usize,
    /// Shared or repeated prompts.
    pub mode: PackingMode,
}

/// Rollouts that cannot be packed as given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PackingError {
    /// A group with responses has an empty prompt, so nothing predicts their first token.
    #[error("group {group}: the prompt is empty; at least one token must precede a response")]
    EmptyPrompt {
        /// Group index.
        group: usize,
    },
    /// A response's weights do not match its tokens.
    #[error("group {group} response {response}: {weights} weights for {tokens} tokens")]
    WeightsLength {
        /// Group index.
        group: usize,
        /// Response index.
        response: usize,
        /// Tokens of the response.
        tokens: usize,
        /// Weights given.
        weights: usize,
    },
    /// A response's scored targets do not match its tokens.
    #[error("group {group} response {response}: {targets} targets for {tokens} tokens")]
    TargetsLength {
        /// Group index.
        group: usize,
        /// Response index.
        response: usize,
        /// Tokens of the response.
        tokens: usize,
        /// Targets given.
        targets: usize,
    },
    /// A response with its prompt exceeds the micro-batch budget on its own.
    #[error(
        "group {group} response {response}: prompt and response need {tokens} tokens, more \
         than max_tokens_per_microbatch = {budget}; raise the budget or cap lengths"
    )]
    TooLong {
        /// Group index.
        group: usize,
        /// Response index.
        response: usize,
        /// Tokens it needs alone.
        tokens: usize,
        /// The budget.
        budget: usize,
    },
}

/// A unit of packing: some responses of one group, placed together.
struct Item {
    group: usize,
    responses: Vec<usize>,
    tokens: usize,
}

/// Packs `groups` into micro-batches of at most `config.max_tokens_per_microbatch`
/// tokens; see the module docs for the layout. Every non-empty response's tokens are
/// scored exactly once across the returned micro-batches.
pub fn pack_rollouts(
    groups: &[RolloutGroup],
    config: PackingConfig,
) -> Result<Vec<MicroBatch>, PackingError> {
    let budget = config.max_tokens_per_microbatch;
    let mut items = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        let mut responses = Vec::new();
        for (r, response) in group.responses.iter().enumerate() {
            if response.weights.len() != response.tokens.len() {
                return Err(PackingError::WeightsLength {
                    group: g,
                    response: r,
                    tokens: response.tokens.len(),
                    weights: response.weights.len(),
                });
            }
            if let Some(targets) = &response.targets {
                if targets.len() != response.tokens.len() {
                    return Err(PackingError::TargetsLength {
                        group: g,
                        response: r,
                        tokens: response.tokens.len(),
                        targets: targets.len(),
                    });
                }
            }
            if response.tokens.is_empty() {
                continue;
            }
            if group.prompt.is_empty() {
                return Err(PackingError::EmptyPrompt { group: g });
            }
            let alone = group.prompt.len() - 1 + response.tokens.len();
            if alone > budget {
                return Err(PackingError::TooLong {
                    group: g,
                    response: r,
                    tokens: alone,
                    budget,
                });
            }
            responses.push(r);
        }
        let prompt_cost = group.prompt.len().saturating_sub(1);
        match config.mode {
            PackingMode::Unshared => items.extend(responses.into_iter().map(|r| Item {
                group: g,
                responses: vec![r],
                tokens: prompt_cost + group.responses[r].tokens.len(),
            })),
            PackingMode::Shared => {
                // Runs of responses that fit the budget with one prompt copy each.
                let mut run = Item {
                    group: g,
                    responses: Vec::new(),
                    tokens: prompt_cost,
                };
                for r in responses {
                    let len = group.responses[r].tokens.len();
                    if run.tokens + len > budget {
                        let next = Item {
                            group: g,
                            responses: Vec::new(),
                            tokens: prompt_cost,
                        };
                        items.push(std::mem::replace(&mut run, next));
                    }
                    run.responses.push(r);
                    run.tokens += len;
                }
                if !run.responses.is_empty() {
                    items.push(run);
                }
            }
        }
    }

    if items.is_empty() {
        return Ok(Vec::new());
    }
    let bins = balance(items, budget);
    Ok(bins
        .into_iter()
        .map(|bin| layout(groups, &bin, config.mode))
        .collect())
}

/// Largest item first into the least-loaded bin, a new bin when it fits in none.
/// Items within a bin keep input order.
fn balance(mut items: Vec<Item>, budget: usize) -> Vec<Vec<Item>> {
    let total: usize = items.iter().map(|item| item.tokens).sum();
    let mut bins: Vec<(usize, Vec<Item>)> = (0..total.div_ceil(budget))
        .map(|_| (0, Vec::new()))
        .collect();
    // Stable sort: equal sizes keep input order.
    items.sort_by_key(|item| std::cmp::Reverse(item.tokens));
    for item in items {
        let least = bins
            .iter()
            .enumerate()
            .min_by_key(|(index, (load, _))| (*load, *index))
            .map(|(index, _)| index);
        match least {
            Some(index) if bins[index].0 + item.tokens <= budget => {
                bins[index].0 += item.tokens;
                bins[index].1.push(item);
            }
            _ => bins.push((item.tokens, vec![item])),
        }
    }
    bins.into_iter()
        .map(|(_, mut items)| {
            items.sort_by_key(|item| (item.group, item.responses[0]));
            items
        })
        .collect()
}

/// Lays out the items of one micro-batch with the model's own packing primitives.
fn layout(groups: &[RolloutGroup], items: &[Item], mode: PackingMode) -> MicroBatch {
    let mut micro = MicroBatch::default();
    for item in items {
        let group = &groups[item.group];
        let responses: Vec<&Response> = item
            .responses
            .iter()
            .map(|&r| &group.responses[r])
            .collect();
        let rows: Vec<Range<usize>> = match mode {
            PackingMode::Shared => {
                let tokens: Vec<Vec<u32>> = responses.iter().map(|r| r.tokens.clone()).collect();
                micro
                    .batch
                    .push_shared_prompt(&group.prompt, &tokens)
                    .expect("prompt and responses are non-empty, checked by pack_rollouts")
            }
            PackingMode::Unshared => responses
                .iter()
                .map(|response| {
                    let sequence = [&group.prompt[..], &response.tokens[..]].concat();
                    let scored = micro.batch.push_sequence(&sequence);
                    scored.end - response.tokens.len()..scored.end
                })
                .collect(),
        };
        micro.weights.resize(micro.batch.len(), 0.0);
        for ((&r, response), rows) in item.responses.iter().zip(&responses).zip(rows) {
            micro.weights[rows.clone()].copy_from_slice(&response.weights);
            if let Some(targets) = &response.targets {
                micro.batch.targets[rows.clone()].copy_from_slice(targets);
            }
            micro.responses.push(ResponseRows {
                group: item.group as u32,
                response: r as u32,
                first_row: rows.start as u32,
                len: rows.len() as u32,
            });
        }
    }
    micro
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_backend::Segment;

    fn response(tokens: &[u32]) -> Response {
        Response {
            targets: None,
            tokens: tokens.to_vec(),
            weights: tokens.iter().map(|&t| t as f32 / 10.0).collect(),
        }
    }

    fn config(budget: usize, mode: PackingMode) -> PackingConfig {
        PackingConfig {
            max_tokens_per_microbatch: budget,
            mode,
        }
    }

    #[test]
    fn given_targets_replace_what_a_responses_rows_score() {
        let mut scored = response(&[20, 21, 22]);
        scored.targets = Some(vec![0, 0, 22]);
        let groups = [RolloutGroup {
            prompt: vec![1, 2, 3],
            responses: vec![response(&[10, 11]), scored],
        }];
        for mode in [PackingMode::Shared, PackingMode::Unshared] {
            let b = &pack_rollouts(&groups, config(100, mode)).unwrap()[0];
            // The inputs are unchanged; only the second response's rows score otherwise.
            let last = b.responses[1];
            let rows = last.first_row as usize..(last.first_row + last.len) as usize;
            assert_eq!(b.batch.targets[rows], [0, 0, 22], "{mode:?}");
            assert!(b.batch.tokens.contains(&21), "{mode:?}");
        }
        let mut short = response(&[20, 21]);
        short.targets = Some(vec![0]);
        let bad = [RolloutGroup {
            prompt: vec![1],
            responses: vec![short],
        }];
        let err = pack_rollouts(&bad, config(100, PackingMode::Shared)).unwrap_err();
        assert!(err.to_string().contains("1 targets for 2 tokens"), "{err}");
    }

    #[test]
    fn shared_layout_of_one_group() {
        let groups = [RolloutGroup {
            prompt: vec![1, 2, 3],
            responses: vec![response(&[10, 11]), response(&[20, 21, 22])],
        }];
        let batches = pack_rollouts(&groups, config(100, PackingMode::Shared)).unwrap();
        assert_eq!(batches.len(), 1);
        let b = &batches[0];
        assert_eq!(b.batch.tokens, [1, 2, 3, 10, 3, 20, 21]);
        assert_eq!(b.batch.targets, [2, 3, 10, 11, 20, 21, 22]);
        assert_eq!(b.batch.positions, [0, 1, 2, 3, 2, 3, 4]);
        let seg = |start, len, prefix_start, prefix_len| Segment {
            start,
            len,
            prefix_start,
            prefix_len,
        };
        assert_eq!(
            b.batch.segments,
            [seg(0, 2, 0, 0), seg(2, 2, 0, 2), seg(4, 3, 0, 2)]
        );
        assert_eq!(b.weights, [0.0, 0.0, 1.0, 1.1, 2.0, 2.1, 2.2]);
    }

    #[test]
    fn unshared_layout_repeats_the_prompt() {
        let groups = [RolloutGroup {
            prompt: vec![1, 2],
            responses: vec![response(&[10, 11]), response(&[20])],
        }];
        let b = &pack_rollouts(&groups, config(100, PackingMode::Unshared)).unwrap()[0];
        assert_eq!(b.batch.tokens, [1, 2, 10, 1, 2]);
        assert_eq!(b.batch.targets, [2, 10, 11, 2, 20]);
        assert_eq!(b.batch.positions, [0, 1, 2, 0, 1]);
        assert_eq!(b.weights, [0.0, 1.0, 1.1, 0.0, 2.0]);
        assert!(b.batch.segments.iter().all(|s| s.prefix_len == 0));
    }

    #[test]
    fn single_token_prompt_has_no_prompt_segment() {
        let groups = [RolloutGroup {
            prompt: vec![7],
            responses: vec![response(&[10, 11]), response(&[])],
        }];
        let b = &pack_rollouts(&groups, config(100, PackingMode::Shared)).unwrap()[0];
        assert_eq!(b.batch.tokens, [7, 10]);
        assert_eq!(b.batch.segments.len(), 1);
        assert_eq!(b.batch.segments[0].prefix_len, 0);
        assert_eq!(b.responses.len(), 1, "the empty response is skipped");
    }

    /// Deterministic rollouts of varied sizes.
    fn rollouts(groups: usize) -> Vec<RolloutGroup> {
        (0..groups)
            .map(|g| RolloutGroup {
                prompt: (0..3 + (g * 7) % 11)
                    .map(|t| (g * 100 + t) as u32)
                    .collect(),
                responses: (0..1 + g % 4)
                    .map(|r| {
                        response(
                            &(0..(g * 5 + r * 3) % 13)
                                .map(|t| t as u32)
                                .collect::<Vec<_>>(),
                        )
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn every_response_token_is_scored_exactly_once_within_budget() {
        let groups = rollouts(20);
        for mode in [PackingMode::Shared, PackingMode::Unshared] {
            for budget in [24, 40, 1000] {
                let batches = pack_rollouts(&groups, config(budget, mode)).unwrap();
                let mut seen = std::collections::HashSet::new();
                for b in &batches {
                    assert!(
                        b.len() <= budget,
                        "{mode:?} budget {budget}: {} tokens",
                        b.len()
                    );
                    let covered: u32 = b.batch.segments.iter().map(|s| s.len).sum();
                    assert_eq!(covered as usize, b.len(), "segments tile the batch");
                    let mut scored = vec![false; b.len()];
                    b.for_each_scored_row(|row, t| {
                        let response = &groups[t.group as usize].responses[t.response as usize];
                        assert_eq!(b.batch.targets[row], response.tokens[t.token as usize]);
                        assert_eq!(b.weights[row], response.weights[t.token as usize]);
                        let prompt_len = groups[t.group as usize].prompt.len() as u32;
                        assert_eq!(b.batch.positions[row], prompt_len - 1 + t.token);
                        assert!(seen.insert(t), "{t:?} scored twice");
                        scored[row] = true;
                    });
                    for (row, scored) in scored.iter().enumerate() {
                        if !scored {
                            assert_eq!(b.weights[row], 0.0);
                        }
                    }
                    let values = b.scatter_to_rows(|t| t.token as f64 + 1.0);
                    b.for_each_scored_row(|row, t| assert_eq!(values[row], t.token as f64 + 1.0));
                }
                let expected: usize = groups
                    .iter()
                    .flat_map(|g| &g.responses)
                    .map(|r| r.tokens.len())
                    .sum();
                assert_eq!(seen.len(), expected, "{mode:?} budget {budget}");
            }
        }
    }

    #[test]
    fn sharing_saves_tokens_and_balancing_spreads_them() {
        let groups = rollouts(20);
        let total = |mode| -> usize {
            pack_rollouts(&groups, config(1000, mode))
                .unwrap()
                .iter()
                .map(MicroBatch::len)
                .sum()
        };
        assert!(total(PackingMode::Shared) < total(PackingMode::Unshared));

        let batches = pack_rollouts(&groups, config(64, PackingMode::Shared)).unwrap();
        let sizes: Vec<usize> = batches.iter().map(MicroBatch::len).collect();
        let sum: usize = sizes.iter().sum();
        // Least-loaded placement may need one bin more than the lower bound.
        assert!(batches.len() <= sum.div_ceil(64) + 1, "{sizes:?}");
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= 16, "unbalanced: {sizes:?}");
    }

    #[test]
    fn oversized_groups_split_and_oversized_responses_fail() {
        let groups = [RolloutGroup {
            prompt: vec![1; 9],
            responses: vec![response(&[2; 6]), response(&[3; 6]), response(&[4; 6])],
        }];
        // Each response fits with the prompt (8 + 6), two do not (8 + 12).
        let batches = pack_rollouts(&groups, config(15, PackingMode::Shared)).unwrap();
        assert_eq!(batches.len(), 3);
        assert!(batches
            .iter()
            .all(|b| b.len() == 14 && b.responses.len() == 1));

        assert_eq!(
            pack_rollouts(&groups, config(13, PackingMode::Shared)),
            Err(PackingError::TooLong {
                group: 0,
                response: 0,
                tokens: 14,
                budget: 13
            })
        );
        let nothing = [RolloutGroup {
            prompt: vec![1],
            responses: vec![response(&[])],
        }];
        assert_eq!(
            pack_rollouts(&nothing, config(0, PackingMode::Shared)),
            Ok(vec![])
        );
        let empty_prompt = [RolloutGroup {
            prompt: vec![],
            responses: vec![response(&[1])],
        }];
        assert_eq!(
            pack_rollouts(&empty_prompt, config(13, PackingMode::Shared)),
            Err(PackingError::EmptyPrompt { group: 0 })
        );
    }
}
