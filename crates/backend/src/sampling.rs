//! Sampling one token from a row of logits, the reference every backend matches.
//!
//! [`sample_row`] applies the [`SamplingRow`] parameters in Hugging Face order
//! (temperature, top-k, top-p, min-p) and draws with [`uniform`], a counter-based
//! generator: a draw depends only on `(seed, offset)`, so a sequence samples the same
//! tokens whatever batch it runs in and on whichever backend.
//!
//! # The exact procedure (what a kernel must reproduce)
//! With `z = logits / temperature` (in f64) and `m = max z`:
//! 1. **greedy** (`temperature == 0`): the lowest id among the maximal logits; its
//!    log-probability under `softmax(logits)`.
//! 2. **top-k** (`top_k > 0`): keep tokens whose `z` is at least the `top_k`-th largest
//!    value (ties with it are kept, as in transformers).
//! 3. **top-p** (`top_p < 1`): over the tokens left, with probabilities renormalised
//!    among them, sorted by decreasing probability (lower id first on ties), keep a token
//!    when the mass strictly before it is below `top_p`. The top token always stays.
//! 4. **min-p** (`min_p > 0`): keep tokens with `exp(z − m) ≥ min_p`, i.e. probability at
//!    least `min_p ×` the top probability.
//! 5. **draw**: with weights `w_i = exp(z_i − m)` over the kept tokens and
//!    `u = uniform(seed, offset)`, walk the kept tokens in increasing id order and return
//!    the first whose running sum of weights exceeds `u · Σ w` (the last kept token if
//!    rounding leaves none).
//!
//! The returned log-probability is `z_tok − logsumexp(z)` over the *whole* vocabulary,
//! before truncation (see [`Sampled`]). NaN logits are never chosen. A row that asks
//! for `top_logprobs` also gets the most likely tokens under that same distribution,
//! computed with the same `z` and `logsumexp(z)`, so the sampled token's entry among them
//! equals its log-probability bit for bit.

use crate::{Sampled, SamplingRow};

/// The splitmix64 increment, `⌊2⁶⁴ / φ⌋`.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser (Stafford's variant 13): a bijection of `u64` whose output
/// bits each depend on every input bit.
///
/// floe's one copy of splitmix64's arithmetic: the stateless uses (this sampling rule,
/// the engine's per-sample seeds, the trainer's derived seeds) call it, and the seeded
/// generators (random weights, datasets, test data) use `rand_xoshiro::SplitMix64`,
/// whose `k`-th output from state `s` is `mix64(s + k · GAMMA)` (checked in
/// `tests/sampling.rs`).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)` that depends only on `(seed, offset)`: the `offset`-th
/// output of a splitmix64 generator whose state starts at `mix64(seed)`.
///
/// Exactly, in wrapping 64-bit unsigned arithmetic:
/// `bits = mix64(mix64(seed) + (offset + 1) · 0x9E3779B97F4A7C15)`, and the result is
/// `(bits >> 11) · 2⁻⁵³` (53 random bits, the f64 mantissa). A CUDA kernel computes the
/// identical value with `unsigned long long` arithmetic and `__ull2double_rn`.
#[inline]
pub fn uniform(seed: u64, offset: u64) -> f64 {
    let state = mix64(seed).wrapping_add(offset.wrapping_add(1).wrapping_mul(GAMMA));
    (mix64(state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The `index`-th standard normal of the splitmix64 stream seeded with `seed` (Box–Muller,
/// two draws per normal), computed without drawing the ones before it: the generator's
/// state after `k` draws is `seed + k · GAMMA`. The random weights of a model are this
/// stream over its tensors, so any element can be made on its own, on any backend.
///
/// Exactly, in wrapping 64-bit arithmetic, with `s = seed + 2 · index · GAMMA` and
/// `unit(k) = ((mix64(s + k · GAMMA) >> 11) + 1) · 2⁻⁵³` (in `(0, 1]`):
/// `sqrt(−2 ln unit(1)) · cos(2π · unit(2))` in f64.
#[inline]
pub fn normal(seed: u64, index: u64) -> f64 {
    let state = seed.wrapping_add(index.wrapping_mul(2).wrapping_mul(GAMMA));
    let unit = |k: u64| {
        ((mix64(state.wrapping_add(k.wrapping_mul(GAMMA))) >> 11) + 1) as f64 / (1u64 << 53) as f64
    };
    let (u, v) = (unit(1), unit(2));
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// `logits / T` in f64 (T = 1 for greedy rows), NaN as `-inf` so it is never chosen and
/// adds no mass, with the lowest id among its maxima and that maximum.
fn scaled_logits(logits: &[f32], row: &SamplingRow) -> (Vec<f64>, usize, f64) {
    let inv_t = if row.temperature <= 0.0 {
        1.0
    } else {
        1.0 / f64::from(row.temperature)
    };
    let z: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(x) * inv_t
            }
        })
        .collect();
    let (argmax, max) =
        z.iter()
            .copied()
            .enumerate()
            .fold((0, f64::NEG_INFINITY), |best, (i, v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            });
    (z, argmax, max)
}

/// `logsumexp(z)` given its maximum `max`; `+inf` when every entry is `-inf`, so that
/// every log-prob `z − lse` is `-inf` rather than NaN.
fn logsumexp(z: &[f64], max: f64) -> f64 {
    if max == f64::NEG_INFINITY {
        return f64::INFINITY;
    }
    max + z.iter().map(|&v| (v - max).exp()).sum::<f64>().ln()
}

/// The `k` largest entries of `z` (lower id first on ties), by decreasing value, with
/// their log-probs `z − lse`: the same arithmetic as the sampled token's.
fn top_of(z: &[f64], lse: f64, k: usize) -> Vec<(u32, f32)> {
    let k = k.min(z.len());
    if k == 0 {
        return Vec::new();
    }
    let order = |a: &usize, b: &usize| z[*b].total_cmp(&z[*a]).then(a.cmp(b));
    let mut ids: Vec<usize> = (0..z.len()).collect();
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_unstable_by(order);
    ids.into_iter()
        .map(|i| (i as u32, (z[i] - lse) as f32))
        .collect()
}

/// The `row.top_logprobs` most likely tokens of `logits` and their log-probs, exactly as
/// [`sample_row`] reports them in [`Sampled::top_logprobs`]; for backends that draw on
/// the device and compute these on the host.
pub fn top_logprobs(logits: &[f32], row: &SamplingRow) -> Vec<(u32, f32)> {
    if row.top_logprobs == 0 {
        return Vec::new();
    }
    let (z, _, max) = scaled_logits(logits, row);
    top_of(&z, logsumexp(&z, max), row.top_logprobs)
}

/// Draws one token from `logits` (one row of `[vocab]`) with `row`'s parameters; see the
/// module documentation for the exact procedure. `logits` must not be empty.
pub fn sample_row(logits: &[f32], row: &SamplingRow) -> Sampled {
    assert!(!logits.is_empty(), "sample_row: empty logits");
    let greedy = row.temperature <= 0.0;
    let (z, argmax, max) = scaled_logits(logits, row);
    let lse = logsumexp(&z, max);
    let top_logprobs = top_of(&z, lse, row.top_logprobs);
    if max == f64::NEG_INFINITY {
        // Every logit is -inf or NaN: nothing carries mass, the draw is token 0.
        return Sampled {
            token: 0,
            logprob: f32::NEG_INFINITY,
            top_logprobs,
        };
    }
    let scaled = &z;
    let logprob = move |tok: usize| Sampled {
        token: tok as u32,
        logprob: (scaled[tok] - lse) as f32,
        top_logprobs,
    };
    if greedy || max == f64::INFINITY {
        return logprob(argmax);
    }

    let mut keep: Vec<bool> = z.iter().map(|&v| v > f64::NEG_INFINITY).collect();

    // top-k: keep everything at least as large as the k-th largest value.
    let k = row.top_k.max(0) as usize;
    if k > 0 && k < z.len() {
        let mut sorted = z.clone();
        let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let kth = *kth;
        for (kept, &v) in keep.iter_mut().zip(&z) {
            *kept &= v >= kth;
        }
    }

    // top-p over what top-k left, in decreasing probability, lower id first on ties.
    if row.top_p < 1.0 {
        let mut order: Vec<usize> = (0..z.len()).filter(|&i| keep[i]).collect();
        order.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
        let total: f64 = order.iter().map(|&i| (z[i] - max).exp()).sum();
        let top_p = f64::from(row.top_p);
        let mut before = 0.0;
        for &i in &order {
            if before / total >= top_p && before > 0.0 {
                keep[i] = false;
            }
            before += (z[i] - max).exp();
        }
    }

    // min-p relative to the top probability (which is never removed above).
    if row.min_p > 0.0 {
        let floor = f64::from(row.min_p).ln();
        for (kept, &v) in keep.iter_mut().zip(&z) {
            *kept &= v - max >= floor;
        }
    }

    // Inverse CDF over the kept tokens in id order.
    let weights: Vec<f64> = z
        .iter()
        .zip(&keep)
        .map(|(&v, &k)| if k { (v - max).exp() } else { 0.0 })
        .collect();
    let target = uniform(row.seed, row.offset) * weights.iter().sum::<f64>();
    let mut running = 0.0;
    let mut last_kept = argmax;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            running += w;
            last_kept = i;
            if running > target {
                return logprob(i);
            }
        }
    }
    logprob(last_kept)
}
