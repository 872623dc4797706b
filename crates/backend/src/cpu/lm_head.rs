//! The fused lm-head on the CPU: per chunk of rows, logits by one product, then
//! log-prob, entropy and log-sum-exp per row; the backward recomputes the chunk's logits.
//!
//! Batch invariant, the logits come from the batch-invariant product, unscaled, and are
//! then multiplied by `logit_scale`: the sampler's [`token_logprobs`] takes the same steps
//! from the cached forward's logits, so both get the same bits.

use rayon::prelude::*;

use super::float::{max, wide, CpuFloat};
use super::gemm;
use super::invariant::matmul_xwt;
use crate::{LmHead, Matmul};

/// Rows `[start, start + rows)` of the chunk walk.
fn chunks(spec: &LmHead) -> impl Iterator<Item = (usize, usize)> {
    let (tokens, step) = (spec.tokens, spec.chunk_rows);
    (0..tokens)
        .step_by(step)
        .map(move |start| (start, step.min(tokens - start)))
}

/// `(Σ w_j, Σ w_j (z_j − shift))` accumulated in f64, in independent lanes so the loop
/// vectorises.
#[inline(always)]
fn sums_f64<T: CpuFloat>(w: &[T], z: &[T], shift: T) -> (f64, f64) {
    const LANES: usize = 8;
    let (mut sum, mut weighted) = ([0.0_f64; LANES], [0.0_f64; LANES]);
    for (w, z) in w.chunks_exact(LANES).zip(z.chunks_exact(LANES)) {
        for i in 0..LANES {
            sum[i] += w[i].to_f64();
            weighted[i] += (w[i] * (z[i] - shift)).to_f64();
        }
    }
    let tail = w.len() - w.len() % LANES;
    let (mut sum, mut weighted) = (sum.iter().sum::<f64>(), weighted.iter().sum::<f64>());
    for (&w, &z) in w[tail..].iter().zip(&z[tail..]) {
        sum += w.to_f64();
        weighted += (w * (z - shift)).to_f64();
    }
    (sum, weighted)
}

/// `logits[r, :] = logit_scale · hidden[r] · wᵀ` for one chunk; `invariant` forms it as
/// `(hidden[r] · wᵀ) · logit_scale`, row by row (see the module docs).
fn chunk_logits<T: CpuFloat>(
    logits: &mut [T],
    hidden: &[T],
    w: &[T],
    rows: usize,
    spec: &LmHead,
    invariant: bool,
) {
    if invariant {
        matmul_xwt(logits, hidden, w, (rows, spec.vocab, spec.dim), false);
        let scale = T::from_f32(spec.logit_scale);
        logits.par_iter_mut().for_each(|z| *z *= scale);
        return;
    }
    let dims = Matmul {
        m: rows,
        n: spec.vocab,
        k: spec.dim,
        trans_a: false,
        trans_b: true,
    };
    gemm(
        logits,
        hidden,
        w,
        dims,
        false,
        T::from_f32(spec.logit_scale),
    );
}

/// Log-prob of `target`, entropy and log-sum-exp of one row of scaled logits `z`;
/// `e` is scratch. Inlined, so that [`forward`]'s [`wide`] call recompiles it.
#[inline(always)]
fn row_stats<T: CpuFloat>(z: &[T], target: u32, e: &mut Vec<T>) -> (T, T, T) {
    let max = max(z);
    e.clear();
    e.extend(z.iter().map(|&x| (x - max).exp_vec()));
    // Sums over the vocabulary accumulate in f64 whatever T is: with 10⁵ terms, f32
    // accumulation would cost digits the sampler (which works in f64) keeps.
    let (sum, weighted) = sums_f64(e, z, max);
    let row_lse = max + T::from_f64(sum.ln());
    // H = −Σ p (z − lse) = lse − Σ p z = (lse − max) − Σ p (z − max).
    let entropy = T::from_f64(sum.ln() - weighted / sum);
    (z[target as usize] - row_lse, entropy, row_lse)
}

/// Overwrites a row of scaled logits `z` with the gradient of its log-prob of `target`
/// and its entropy, `(d_logprob, d_entropy)`, with respect to the unscaled logits; `p`
/// is scratch. Inlined, so that [`backward`]'s [`wide`] call recompiles it.
#[inline(always)]
fn row_grad<T: CpuFloat>(
    z: &mut [T],
    p: &mut Vec<T>,
    target: u32,
    (g_lp, g_h): (T, T),
    row_lse: T,
    scale: T,
) {
    p.clear();
    p.extend(z.iter().map(|&z| (z - row_lse).exp_vec()));
    let mean_z = T::from_f64(sums_f64(p, z, T::ZERO).1);
    for (z, &p) in z.iter_mut().zip(p.iter()) {
        *z = scale * (-g_lp * p - g_h * p * (*z - mean_z));
    }
    z[target as usize] += scale * g_lp;
}

/// The log-probs of `targets` that the batch-invariant [`forward`] computes for a row
/// whose unscaled logits are `logits`: `logits · logit_scale`, then [`row_stats`]'s
/// `z[target] − lse` for each (one log-sum-exp for all of them).
pub(crate) fn token_logprobs<T: CpuFloat>(
    logits: &[T],
    logit_scale: f32,
    targets: impl Iterator<Item = u32>,
) -> Vec<T> {
    let scale = T::from_f32(logit_scale);
    let z: Vec<T> = logits.iter().map(|&x| x * scale).collect();
    let row_lse = row_stats(&z, 0, &mut Vec::new()).2;
    targets.map(|t| z[t as usize] - row_lse).collect()
}

/// See [`crate::Backend::lm_head_forward`]. Targets are already checked `< vocab`;
/// `invariant` as in the module docs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: CpuFloat>(
    logprobs: &mut [T],
    entropy: &mut [T],
    lse: &mut [T],
    hidden: &[T],
    w: &[T],
    targets: &[u32],
    spec: LmHead,
    invariant: bool,
) {
    let (dim, vocab) = (spec.dim, spec.vocab);
    let mut logits = vec![T::ZERO; spec.chunk_rows.min(spec.tokens) * vocab];
    for (start, rows) in chunks(&spec) {
        let z = &mut logits[..rows * vocab];
        chunk_logits(
            z,
            &hidden[start * dim..(start + rows) * dim],
            w,
            rows,
            &spec,
            invariant,
        );
        let range = start..start + rows;
        z.par_chunks(vocab)
            .zip(logprobs[range.clone()].par_iter_mut())
            .zip(entropy[range.clone()].par_iter_mut())
            .zip(lse[range.clone()].par_iter_mut())
            .zip(targets[range].par_iter())
            .for_each_init(Vec::new, |e, ((((z, lp), ent), lse), &target)| {
                (*lp, *ent, *lse) = wide(|| row_stats(z, target, e));
            });
    }
}

/// See [`crate::Backend::lm_head_backward`].
///
/// With `z` the scaled logits, `p = softmax(z)` and `μ = Σ p z`:
/// `∂logprob/∂z_j = δ_{j,target} − p_j` and `∂H/∂z_j = −p_j (z_j − μ)`; the gradient of
/// the unscaled product `h·wᵀ` is `logit_scale` times their weighted sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: CpuFloat>(
    dhidden: &mut [T],
    dw: &mut [T],
    dlogprobs: &[T],
    dentropy: &[T],
    hidden: &[T],
    w: &[T],
    targets: &[u32],
    lse: &[T],
    spec: LmHead,
) {
    let (dim, vocab) = (spec.dim, spec.vocab);
    let scale = T::from_f32(spec.logit_scale);
    let mut grad = vec![T::ZERO; spec.chunk_rows.min(spec.tokens) * vocab];
    for (start, rows) in chunks(&spec) {
        let h = &hidden[start * dim..(start + rows) * dim];
        let g = &mut grad[..rows * vocab];
        // The blocked product even when batch invariant: nothing read from the backward
        // is a log-prob, and its logits differ from the forward's only by rounding.
        chunk_logits(g, h, w, rows, &spec, false);
        g.par_chunks_mut(vocab)
            .enumerate()
            .for_each_init(Vec::new, |p, (r, g)| {
                let t = start + r;
                let grads = (dlogprobs[t], dentropy[t]);
                wide(|| row_grad(g, p, targets[t], grads, lse[t], scale));
            });
        let dh = Matmul {
            m: rows,
            n: dim,
            k: vocab,
            trans_a: false,
            trans_b: false,
        };
        gemm(
            &mut dhidden[start * dim..(start + rows) * dim],
            g,
            w,
            dh,
            false,
            T::ONE,
        );
        let dwd = Matmul {
            m: vocab,
            n: dim,
            k: rows,
            trans_a: true,
            trans_b: false,
        };
        gemm(dw, g, h, dwd, true, T::ONE);
    }
}
