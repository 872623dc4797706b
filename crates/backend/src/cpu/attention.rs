//! Softmax attention on the CPU: packed causal segments (training) and the paged KV cache
//! (sampling). Both reduce to one routine, [`attend_row`], over a list of key rows.

use rayon::prelude::*;

use super::float::{axpy, dot, CpuFloat};
use crate::{AttnShape, Error, Result, Segment};

/// Marks a token that belongs to no segment in [`segment_of_tokens`].
const NO_SEGMENT: u32 = u32::MAX;

/// Checks `segments` against `tokens` and returns the segment of each token.
pub(crate) fn segment_of_tokens(
    op: &'static str,
    segments: &[Segment],
    tokens: usize,
) -> Result<Vec<u32>> {
    let mut owner = vec![NO_SEGMENT; tokens];
    for (i, s) in segments.iter().enumerate() {
        let (start, len) = (s.start as usize, s.len as usize);
        if start + len > tokens {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "segment {i} covers tokens {start}..{} of {tokens}",
                    start + len
                ),
            });
        }
        if s.prefix_len > 0 && (s.prefix_start + s.prefix_len) as usize > tokens {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "segment {i} has prefix {}..{} past {tokens} tokens",
                    s.prefix_start,
                    s.prefix_start + s.prefix_len
                ),
            });
        }
        for o in &mut owner[start..start + len] {
            if *o != NO_SEGMENT {
                return Err(Error::Shape {
                    op,
                    msg: format!("segments {} and {i} overlap", *o),
                });
            }
            *o = i as u32;
        }
    }
    Ok(owner)
}

/// The key rows query token `t` of segment `s` attends to: its prefix, then causally its
/// own segment up to and including `t`.
fn key_rows(s: &Segment, t: usize, rows: &mut Vec<usize>) {
    rows.clear();
    if s.prefix_len > 0 {
        let p = s.prefix_start as usize;
        rows.extend(p..p + s.prefix_len as usize);
    }
    rows.extend(s.start as usize..=t);
}

/// One query row of one head: `out = softmax(scale · q·Kᵀ) · V` over the key rows
/// `rows` (row `r` of head `kv_head` starts at `r · row_stride + kv_head · D`); returns the
/// log-sum-exp of the scaled logits.
#[allow(clippy::too_many_arguments)]
fn attend_row<T: CpuFloat>(
    out: &mut [T],
    scores: &mut Vec<T>,
    q: &[T],
    k: &[T],
    v: &[T],
    rows: &[usize],
    row_stride: usize,
    kv_head: usize,
    scale: T,
) -> T {
    let d = q.len();
    let at = |r: usize| r * row_stride + kv_head * d;
    scores.clear();
    let mut max = T::NEG_INFINITY;
    for &r in rows {
        let s = scale * dot(q, &k[at(r)..at(r) + d]);
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = T::ZERO;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(T::ZERO);
    let inv = T::ONE / sum;
    for (&r, &p) in rows.iter().zip(scores.iter()) {
        axpy(out, p * inv, &v[at(r)..at(r) + d]);
    }
    max + sum.ln()
}

/// Forward of packed causal attention; see [`crate::Backend::attention_forward`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: CpuFloat>(
    out: &mut [T],
    lse: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    owner: &[u32],
    segments: &[Segment],
    shape: AttnShape,
) {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let group = hq / hkv;
    let scale = T::from_f32(shape.scale);
    out.par_chunks_mut(hq * d)
        .zip(lse.par_chunks_mut(hq))
        .enumerate()
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(rows, scores), (t, (out_t, lse_t))| {
                let Some(seg) = segments.get(owner[t] as usize) else {
                    return;
                };
                key_rows(seg, t, rows);
                for h in 0..hq {
                    let q_th = &q[(t * hq + h) * d..(t * hq + h + 1) * d];
                    lse_t[h] = attend_row(
                        &mut out_t[h * d..(h + 1) * d],
                        scores,
                        q_th,
                        k,
                        v,
                        rows,
                        hkv * d,
                        h / group,
                        scale,
                    );
                }
            },
        );
}

/// Backward of packed causal attention; see [`crate::Backend::attention_backward`].
/// `dq`, `dk`, `dv` must be zero on entry.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: CpuFloat>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    dout: &[T],
    out: &[T],
    lse: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    segments: &[Segment],
    shape: AttnShape,
) {
    let (tokens, hq, hkv, d) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
    let group = hq / hkv;
    let scale = T::from_f32(shape.scale);
    // One task per kv head: it owns the gradients of its keys and values and of the query
    // heads that read them, in private [T, ·, D] buffers scattered back at the end (shared
    // prefix keys are read by several segments and must sum).
    let per_head: Vec<(Vec<T>, Vec<T>, Vec<T>)> = (0..hkv)
        .into_par_iter()
        .map(|g| {
            let mut dq_g = vec![T::ZERO; tokens * group * d];
            let mut dk_g = vec![T::ZERO; tokens * d];
            let mut dv_g = vec![T::ZERO; tokens * d];
            let mut rows = Vec::new();
            let mut probs = Vec::new();
            let kv_at = |r: usize| (r * hkv + g) * d;
            for seg in segments {
                for t in seg.start as usize..(seg.start + seg.len) as usize {
                    key_rows(seg, t, &mut rows);
                    for hg in 0..group {
                        let h = g * group + hg;
                        let at = (t * hq + h) * d;
                        let (q_th, do_th, o_th) =
                            (&q[at..at + d], &dout[at..at + d], &out[at..at + d]);
                        let lse_th = lse[t * hq + h];
                        // rowsum(dO ∘ O): the softmax Jacobian's correction term.
                        let delta = dot(do_th, o_th);
                        probs.clear();
                        for &r in &rows {
                            probs.push(
                                (scale * dot(q_th, &k[kv_at(r)..kv_at(r) + d]) - lse_th).exp(),
                            );
                        }
                        let dq_th = &mut dq_g[(t * group + hg) * d..(t * group + hg + 1) * d];
                        for (&r, &p) in rows.iter().zip(&probs) {
                            let dp = dot(do_th, &v[kv_at(r)..kv_at(r) + d]);
                            let ds = p * (dp - delta);
                            axpy(dq_th, scale * ds, &k[kv_at(r)..kv_at(r) + d]);
                            axpy(&mut dk_g[r * d..(r + 1) * d], scale * ds, q_th);
                            axpy(&mut dv_g[r * d..(r + 1) * d], p, do_th);
                        }
                    }
                }
            }
            (dq_g, dk_g, dv_g)
        })
        .collect();
    for (g, (dq_g, dk_g, dv_g)) in per_head.iter().enumerate() {
        for t in 0..tokens {
            let q_at = (t * hq + g * group) * d;
            dq[q_at..q_at + group * d].copy_from_slice(&dq_g[t * group * d..(t + 1) * group * d]);
            let kv_at = (t * hkv + g) * d;
            dk[kv_at..kv_at + d].copy_from_slice(&dk_g[t * d..(t + 1) * d]);
            dv[kv_at..kv_at + d].copy_from_slice(&dv_g[t * d..(t + 1) * d]);
        }
    }
}

/// Where a paged-attention query reads: block tables and token placement, checked.
pub(crate) struct PagedIndex<'a> {
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
    pub block_size: usize,
    pub token_seq: &'a [u32],
    pub token_pos: &'a [u32],
    pub num_blocks: usize,
}

impl PagedIndex<'_> {
    /// The cache slot of position `pos` of sequence `seq`, checked against the tables.
    fn slot(&self, seq: usize, pos: usize) -> Result<usize> {
        let col = pos / self.block_size;
        if col >= self.max_blocks {
            return Err(Error::Shape {
                op: "paged_attention",
                msg: format!(
                    "position {pos} needs block column {col}, block_tables has {} columns",
                    self.max_blocks
                ),
            });
        }
        let idx = seq * self.max_blocks + col;
        let block = *self.block_tables.get(idx).ok_or_else(|| Error::Shape {
            op: "paged_attention",
            msg: format!(
                "sequence {seq} has no row in block_tables of {} entries",
                self.block_tables.len()
            ),
        })? as usize;
        if block >= self.num_blocks {
            return Err(Error::Shape {
                op: "paged_attention",
                msg: format!(
                    "block id {block} (sequence {seq}) >= {} cache blocks",
                    self.num_blocks
                ),
            });
        }
        Ok(block * self.block_size + pos % self.block_size)
    }
}

/// Attention of each query token over its sequence's cached positions `0..=pos`.
pub(crate) fn paged<T: CpuFloat>(
    out: &mut [T],
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    index: &PagedIndex<'_>,
    shape: AttnShape,
) -> Result<()> {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let group = hq / hkv;
    let scale = T::from_f32(shape.scale);
    out.par_chunks_mut(hq * d).enumerate().try_for_each_init(
        || (Vec::new(), Vec::new()),
        |(rows, scores), (t, out_t)| -> Result<()> {
            let (seq, pos) = (index.token_seq[t] as usize, index.token_pos[t] as usize);
            rows.clear();
            for p in 0..=pos {
                rows.push(index.slot(seq, p)?);
            }
            for h in 0..hq {
                let q_th = &q[(t * hq + h) * d..(t * hq + h + 1) * d];
                attend_row(
                    &mut out_t[h * d..(h + 1) * d],
                    scores,
                    q_th,
                    k_cache,
                    v_cache,
                    rows,
                    hkv * d,
                    h / group,
                    scale,
                );
            }
            Ok(())
        },
    )
}
