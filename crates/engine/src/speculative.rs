//! Speculative decoding with prompt-lookup (n-gram) drafts, vLLM's `ngram` method.
//!
//! # Proposal
//! A decoding sample looks for the most recent earlier occurrence of its last `n` tokens
//! in its own prompt and output (`n` from `ngram_max` down to `ngram_min`) and proposes
//! the up to `max_draft` tokens that followed it ([`NgramSpec::propose`]); where those run
//! into the end of the sequence, the copy goes on with the draft itself, so a sequence
//! that repeats a span of `p` tokens drafts its next `max_draft` repetitions rather than
//! only `p` tokens. The draft is a point mass: a function of the sample's tokens alone.
//!
//! # Verification and exact acceptance
//! The sampler runs the sample's last sampled token and its `d` draft tokens as one
//! chunk and gets `1 + d` logits rows; row `j` is the next-token distribution `p_j` after
//! the first `j` drafts. Each row is sampled exactly as without speculation (the
//! backend's `sample` op, [`floe_backend::SamplingRow`] `{ seed, offset: o + j }` for the
//! sample's `o` tokens so far), and the sample keeps the sampled tokens up to and
//! including the first that differs from the draft ([`kept_tokens`]); after `d` matches
//! row `d`'s token is the bonus token.
//!
//! This is the rejection rule for a point-mass proposal `q = δ_x`, with the acceptance
//! and residual draws taken from one uniform: draft `x` is accepted when the draw from
//! `p_j` lands on `x`, which has probability `p_j(x) = min(1, p_j(x) / q(x))`, and on
//! rejection the draw is a sample of `p_j` conditioned on not being `x`, which is the
//! residual `max(0, p_j − q)` renormalised. So the output's distribution is the target's,
//! the acceptance rate is the optimum for a deterministic draft, and, beyond that,
//! a sample's tokens and log-probs are *the same* as without speculation for the same
//! seed (to the extent the logits of a row do not depend on how the positions were
//! chunked, which is exact on the CPU backend): whether a draft was made, and how long,
//! never changes a token, so neither the batch nor the step's budget does. Greedy rows
//! (temperature 0) accept exactly when the draft is the argmax.
//!
//! A draft *model* (a proposal that is a distribution `q`, not a point) needs the
//! general rule instead: accept with probability `min(1, p(x)/q(x))` from a separate
//! stream, and on rejection draw from `max(0, p − q)`, which needs the rows' processed
//! probabilities on the host or a backend op for them.

use serde::de::value::MapAccessDeserializer;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Prompt-lookup drafts of up to `max_draft` tokens, found by matching the last
/// `ngram_max` down to `ngram_min` tokens.
///
/// In a config: a draft length (`speculative_ngram = 4`, with `ngram_max = 3` and
/// `ngram_min = 1`), or a table `{ max_draft = 4, ngram_max = 3, ngram_min = 2 }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct NgramSpec {
    /// Most draft tokens per sample per step (`k`).
    pub max_draft: usize,
    /// Longest suffix matched, tried first.
    pub ngram_max: usize,
    /// Shortest suffix matched (at least 1).
    pub ngram_min: usize,
}

impl NgramSpec {
    /// `max_draft` with the default n-gram lengths 3 down to 1.
    pub fn with_max_draft(max_draft: usize) -> Self {
        Self {
            max_draft,
            ngram_max: 3,
            ngram_min: 1,
        }
    }

    /// What is wrong with the spec, naming its fields; `None` when it is usable.
    pub fn problem(&self) -> Option<String> {
        if self.max_draft == 0 {
            Some("max_draft is 0; draft at least 1 token, or turn speculation off".into())
        } else if self.ngram_min == 0 {
            Some("ngram_min is 0; match at least 1 token".into())
        } else if self.ngram_min > self.ngram_max {
            Some(format!(
                "ngram_min {} is above ngram_max {}",
                self.ngram_min, self.ngram_max
            ))
        } else {
            None
        }
    }

    /// The draft for a sequence of `tokens` (prompt then output), at most `most` tokens:
    /// what followed the most recent earlier occurrence of its longest matching suffix,
    /// continued periodically past the end (see the module docs). Empty when no suffix of
    /// `ngram_min..=ngram_max` tokens occurred before.
    pub fn propose(&self, tokens: &[u32], most: usize) -> Vec<u32> {
        let most = most.min(self.max_draft);
        let mut draft = Vec::with_capacity(most);
        if most == 0 {
            return draft;
        }
        let len = tokens.len();
        for n in (self.ngram_min..=self.ngram_max).rev() {
            if n >= len {
                continue;
            }
            let suffix = &tokens[len - n..];
            // Starts before `len - n`, so at least one token follows the occurrence.
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                // `from < len`, so a position past the end reads a draft token already made.
                let from = start + n;
                for at in from..from + most {
                    draft.push(if at < len {
                        tokens[at]
                    } else {
                        draft[at - len]
                    });
                }
                return draft;
            }
        }
        draft
    }
}

/// How many of the tokens sampled from a draft's `1 + d` rows the sample keeps: those up
/// to and including the first that differs from `draft` (all `1 + d` when every draft
/// token matched). See the module docs for why this is exact.
pub fn kept_tokens(draft: &[u32], sampled: impl IntoIterator<Item = u32>) -> usize {
    let mut kept = 0;
    for (i, token) in sampled.into_iter().enumerate() {
        kept += 1;
        if draft.get(i) != Some(&token) {
            break;
        }
    }
    kept
}

/// The table form of [`NgramSpec`] in a config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NgramTable {
    max_draft: usize,
    #[serde(default = "default_ngram_max")]
    ngram_max: usize,
    #[serde(default = "default_ngram_min")]
    ngram_min: usize,
}

fn default_ngram_max() -> usize {
    NgramSpec::with_max_draft(1).ngram_max
}

fn default_ngram_min() -> usize {
    NgramSpec::with_max_draft(1).ngram_min
}

impl<'de> Deserialize<'de> for NgramSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Form;
        impl<'de> Visitor<'de> for Form {
            type Value = NgramSpec;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a draft length (e.g. 4) or a table { max_draft, ngram_max, ngram_min }",
                )
            }

            fn visit_u64<E: de::Error>(self, k: u64) -> Result<NgramSpec, E> {
                Ok(NgramSpec::with_max_draft(k as usize))
            }

            fn visit_i64<E: de::Error>(self, k: i64) -> Result<NgramSpec, E> {
                u64::try_from(k)
                    .map_err(|_| E::custom(format!("draft length {k} is negative")))
                    .and_then(|k| self.visit_u64(k))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<NgramSpec, A::Error> {
                let table = NgramTable::deserialize(MapAccessDeserializer::new(map))?;
                Ok(NgramSpec {
                    max_draft: table.max_draft,
                    ngram_max: table.ngram_max,
                    ngram_min: table.ngram_min,
                })
            }
        }
        deserializer.deserialize_any(Form)
    }
}

#[cfg(test)]
mod tests {
    use floe_backend::sampling::{mix64, sample_row};
    use floe_backend::SamplingRow;

    use super::*;

    fn spec(max_draft: usize, ngram_max: usize, ngram_min: usize) -> NgramSpec {
        NgramSpec {
            max_draft,
            ngram_max,
            ngram_min,
        }
    }

    #[test]
    fn proposes_what_followed_the_most_recent_longest_match() {
        // ... 1 2 3 [7 8] ... 1 2 3 [9 5 6] ... 2 3: the trigram "1 2 3" is absent at the
        // end, the bigram "2 3" last occurred before 9 5 6.
        let tokens = [1, 2, 3, 7, 8, 4, 1, 2, 3, 9, 5, 6, 0, 2, 3];
        assert_eq!(spec(4, 3, 1).propose(&tokens, 8), &[9, 5, 6, 0]);
        assert_eq!(spec(2, 3, 1).propose(&tokens, 8), &[9, 5]);
        assert_eq!(spec(4, 3, 1).propose(&tokens, 1), &[9]);
        // A trigram match wins over more recent bigram matches.
        let tokens = [5, 6, 7, 1, 6, 7, 2, 5, 6, 7];
        assert_eq!(spec(2, 3, 2).propose(&tokens, 8), &[1, 6]);
        // Past the end of the sequence the copy repeats the span.
        assert_eq!(spec(4, 1, 1).propose(&[4, 4, 4], 8), &[4, 4, 4, 4]);
        assert_eq!(spec(5, 2, 2).propose(&[7, 1, 2, 1, 2], 8), &[1, 2, 1, 2, 1]);
        assert_eq!(spec(4, 3, 1).propose(&[5, 6, 9, 5, 6], 8), &[9, 5, 6, 9]);
        // No earlier occurrence of any suffix long enough.
        assert!(spec(4, 3, 2).propose(&[1, 2, 3, 4, 3], 8).is_empty());
        assert!(spec(4, 3, 1).propose(&[1], 8).is_empty());
        assert!(spec(4, 3, 1).propose(&[1, 1], 0).is_empty());
    }

    #[test]
    fn keeps_tokens_through_the_first_mismatch() {
        assert_eq!(kept_tokens(&[], [5]), 1);
        assert_eq!(kept_tokens(&[5, 6, 7], [5, 6, 7, 8]), 4);
        assert_eq!(kept_tokens(&[5, 6, 7], [5, 9, 7, 8]), 2);
        assert_eq!(kept_tokens(&[5, 6, 7], [4, 6, 7, 8]), 1);
    }

    #[test]
    fn reads_a_draft_length_or_a_table() {
        let read = |s: &str| serde_json::from_str::<NgramSpec>(s);
        assert_eq!(read("4").unwrap(), NgramSpec::with_max_draft(4));
        assert_eq!(
            read(r#"{"max_draft": 2, "ngram_min": 2}"#).unwrap(),
            spec(2, 3, 2)
        );
        assert!(read(r#"{"max_draft": 2, "ngram": 2}"#)
            .unwrap_err()
            .to_string()
            .contains("unknown field `ngram`"));
        assert!(read("-1").unwrap_err().to_string().contains("negative"));
        let json = serde_json::to_string(&spec(5, 4, 2)).unwrap();
        assert_eq!(read(&json).unwrap(), spec(5, 4, 2));
        assert_eq!(spec(4, 3, 1).problem(), None);
        assert!(spec(0, 3, 1).problem().unwrap().contains("max_draft"));
        assert!(spec(4, 3, 0).problem().unwrap().contains("ngram_min"));
        assert!(spec(4, 1, 2).problem().unwrap().contains("ngram_min 2"));
    }

    const VOCAB: usize = 6;

    /// A peaked next-token distribution of the whole context, so drafts are often right.
    fn logits(context: &[u32]) -> Vec<f32> {
        let hash = context.iter().fold(17u64, |h, &t| mix64(h ^ u64::from(t)));
        (0..VOCAB as u64)
            .map(|v| 3.0 * (mix64(hash ^ v) >> 40) as f32 / (1u64 << 24) as f32)
            .collect()
    }

    fn row(seed: u64, offset: u64) -> SamplingRow {
        SamplingRow {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
            seed,
            offset,
            top_logprobs: 0,
        }
    }

    /// The probabilities `sample_row` draws from with [`row`]'s processing (temperature 1,
    /// top-p 0.9), computed on their own.
    fn target(logits: &[f32]) -> Vec<f64> {
        let weights: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
        let mut kept = vec![0.0; logits.len()];
        let mut before = 0.0;
        for &i in &order {
            if !(before / total >= 0.9 && before > 0.0) {
                kept[i] = weights[i];
            }
            before += weights[i];
        }
        let mass: f64 = kept.iter().sum();
        kept.iter().map(|w| w / mass).collect()
    }

    /// The first two generated tokens after `prompt` for one seed, drafting
    /// `draft` (a point mass) for both positions and keeping sampled tokens by `keep`.
    fn two_tokens(
        prompt: &[u32],
        draft: [u32; 2],
        seed: u64,
        keep: impl Fn(&[u32], &[u32]) -> usize,
    ) -> (u32, u32) {
        // Verification rows: after the prompt, after prompt + draft[0], after + draft[1].
        let sampled: Vec<u32> = (0..=draft.len())
            .map(|j| {
                let context = [prompt, &draft[..j]].concat();
                sample_row(&logits(&context), &row(seed, j as u64)).token
            })
            .collect();
        let kept = keep(&draft, &sampled);
        let mut out = sampled[..kept].to_vec();
        // Then decode normally.
        while out.len() < 2 {
            let context = [prompt, &out[..]].concat();
            out.push(sample_row(&logits(&context), &row(seed, out.len() as u64)).token);
        }
        (out[0], out[1])
    }

    /// Pearson's chi-square of `counts` against `expected` probabilities over `n` draws,
    /// cells with fewer than 5 expected draws pooled into one; returns it with its
    /// degrees of freedom.
    fn chi_square(counts: &[u64], expected: &[f64], n: u64) -> (f64, usize) {
        let (mut stat, mut cells) = (0.0, 0);
        let (mut pooled_count, mut pooled_expected) = (0.0, 0.0);
        for (&c, &p) in counts.iter().zip(expected) {
            let e = p * n as f64;
            if e < 5.0 {
                pooled_count += c as f64;
                pooled_expected += e;
            } else {
                stat += (c as f64 - e).powi(2) / e;
                cells += 1;
            }
        }
        if pooled_expected > 0.0 {
            stat += (pooled_count - pooled_expected).powi(2) / pooled_expected.max(1e-12);
            cells += 1;
        }
        (stat, cells - 1)
    }

    /// Over 20 000 seeds, the first two tokens with a draft (kept by [`kept_tokens`])
    /// follow the exact joint distribution `p(t1) p(t2 | t1)`; accepting every draft
    /// instead is rejected by the same test by a wide margin.
    #[test]
    fn exact_acceptance_keeps_the_target_distribution() {
        let prompt = [1u32, 2, 3];
        let p1 = target(&logits(&prompt));
        let joint: Vec<f64> = (0..VOCAB)
            .flat_map(|a| {
                let p2 = target(&logits(&[1, 2, 3, a as u32]));
                let p1a = p1[a];
                p2.into_iter().map(move |p| p1a * p)
            })
            .collect();
        // Draft the two most likely tokens of the chain, so drafts are often accepted.
        let first = (0..VOCAB).max_by(|&a, &b| p1[a].total_cmp(&p1[b])).unwrap();
        let second = (0..VOCAB)
            .max_by(|&a, &b| joint[first * VOCAB + a].total_cmp(&joint[first * VOCAB + b]))
            .unwrap();
        let draft = [first as u32, second as u32];

        let n = 20_000u64;
        let histogram = |keep: &dyn Fn(&[u32], &[u32]) -> usize| {
            let mut counts = vec![0u64; VOCAB * VOCAB];
            for seed in 0..n {
                let (a, b) = two_tokens(&prompt, draft, mix64(seed), keep);
                counts[a as usize * VOCAB + b as usize] += 1;
            }
            counts
        };
        let exact = histogram(&|draft, sampled| kept_tokens(draft, sampled.iter().copied()));
        let (stat, df) = chi_square(&exact, &joint, n);
        // df + 10 standard deviations (√(2 df)): a false failure has probability far
        // below 1e-12.
        let threshold = df as f64 + 10.0 * (2.0 * df as f64).sqrt();
        assert!(
            stat < threshold,
            "chi-square {stat:.1} over {df} df, threshold {threshold:.1}"
        );
        let accepted = exact[first * VOCAB + second] as f64 / n as f64;
        assert!(accepted > 0.2, "the draft is accepted often ({accepted})");

        let always_accept = histogram(&|draft, _| draft.len() + 1);
        let (wrong, _) = chi_square(&always_accept, &joint, n);
        assert!(
            wrong > 10.0 * threshold,
            "always accepting: chi-square {wrong:.1}"
        );
        eprintln!(
            "chi-square over {df} df: exact rule {stat:.1}, always accept {wrong:.1}, \
             threshold {threshold:.1}"
        );
    }
}
