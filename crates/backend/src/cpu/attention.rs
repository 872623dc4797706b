//! Softmax attention on the CPU: packed causal segments (training) and the paged KV cache
//! (sampling).
//!
//! Both cut their queries into [`QueryBlock`]s: up to [`QUERY_BLOCK`] consecutive tokens of
//! one sequence, for one kv head. A block gathers the keys and values its tokens read into
//! contiguous `[keys, D]` matrices and its `group` query heads into `[tokens · group, D]`,
//! then runs as matrix products (`block_forward`, `block_backward`); the per-row softmax
//! is the only scalar loop. Blocks run in parallel and write private outputs, which are
//! scattered (and, for keys read by several blocks, summed) afterwards. A decoded token
//! (a paged block of one query) reads the cache in place instead (`decode_forward`): for
//! one query row, gathering and packing cost more than the products.
//!
//! Batch invariant ([`crate::Backend::set_batch_invariant`]), the forward computes each
//! score row alone instead (`block_forward_invariant`): a query's keys are its
//! positions `0..=p` in order, in a packed segment (prefix, then the segment's own tokens)
//! as in the paged cache, and one fixed sequence of operations reduces over them, so the
//! row's output does not depend on the block it was cut into, nor on packed vs paged.

use rayon::prelude::*;

use super::float::{dot, max, sum, wide, CpuFloat};
use super::gemm_serial;
use super::invariant::fixed_dot;
use crate::{AttnShape, Error, Matmul, Result, Segment};

/// Most query tokens per block: bounds the score matrix and the work spent on keys past
/// the causal diagonal (under `QUERY_BLOCK / 2` per query on average), while keeping the
/// products large enough to run near the GEMM's peak.
const QUERY_BLOCK: usize = 64;

/// Consecutive query tokens `first..first + len` of one sequence, attending with the query
/// heads of kv head `kv_head`. Its keys (listed by the caller) end with the block's own
/// tokens: query `i` of the block sees the first `keys − len + i + 1` of them.
#[derive(Clone, Copy, Debug)]
struct QueryBlock {
    first: usize,
    len: usize,
    kv_head: usize,
}

/// The blocks of packed `segments`, each with the segment it belongs to.
fn packed_blocks(segments: &[Segment], kv_heads: usize) -> Vec<(QueryBlock, &Segment)> {
    let mut blocks = Vec::new();
    for seg in segments {
        let (start, end) = (seg.start as usize, (seg.start + seg.len) as usize);
        for first in (start..end).step_by(QUERY_BLOCK) {
            let len = QUERY_BLOCK.min(end - first);
            for kv_head in 0..kv_heads {
                blocks.push((
                    QueryBlock {
                        first,
                        len,
                        kv_head,
                    },
                    seg,
                ));
            }
        }
    }
    blocks
}

/// Key rows of a packed block: the segment's prefix, then causally its own tokens up to
/// the block's last.
fn packed_keys(seg: &Segment, block: &QueryBlock, rows: &mut Vec<usize>) {
    rows.clear();
    if seg.prefix_len > 0 {
        let p = seg.prefix_start as usize;
        rows.extend(p..p + seg.prefix_len as usize);
    }
    rows.extend(seg.start as usize..block.first + block.len);
}

/// `dst = [src[r · stride + offset ..][..width] for r in rows]`.
fn gather<T: CpuFloat>(
    dst: &mut Vec<T>,
    src: &[T],
    rows: impl Iterator<Item = usize>,
    stride: usize,
    offset: usize,
    width: usize,
) {
    dst.clear();
    for r in rows {
        let at = r * stride + offset;
        dst.extend_from_slice(&src[at..at + width]);
    }
}

/// Geometry shared by the blocks of one call.
#[derive(Clone, Copy)]
struct Heads {
    /// Query heads per kv head.
    group: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Heads {
    fn new(shape: &AttnShape) -> Self {
        Self {
            group: shape.q_heads / shape.kv_heads,
            q_heads: shape.q_heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
        }
    }

    /// The block's `[len · group, D]` rows of a `[T, q_heads, D]` tensor (its kv head's
    /// query heads are adjacent in each token's row).
    fn gather_q<T: CpuFloat>(&self, dst: &mut Vec<T>, x: &[T], b: &QueryBlock) {
        let width = self.group * self.head_dim;
        let rows = b.first..b.first + b.len;
        gather(
            dst,
            x,
            rows,
            self.q_heads * self.head_dim,
            b.kv_head * width,
            width,
        );
    }

    /// `[keys, D]` rows of kv head `b.kv_head` of a `[·, kv_heads, D]` tensor or cache.
    fn gather_kv<T: CpuFloat>(&self, dst: &mut Vec<T>, x: &[T], b: &QueryBlock, keys: &[usize]) {
        let d = self.head_dim;
        gather(
            dst,
            x,
            keys.iter().copied(),
            self.kv_heads * d,
            b.kv_head * d,
            d,
        );
    }

    /// Writes a block's `[len · group, D]` rows back into a `[T, q_heads, D]` tensor.
    fn scatter_q<T: CpuFloat>(&self, x: &mut [T], b: &QueryBlock, rows: &[T]) {
        let width = self.group * self.head_dim;
        for (i, src) in rows.chunks_exact(width).enumerate() {
            let at = (b.first + i) * self.q_heads * self.head_dim + b.kv_head * width;
            x[at..at + width].copy_from_slice(src);
        }
    }

    /// Adds a block's `[keys, D]` gradient rows into a `[T, kv_heads, D]` tensor.
    fn scatter_add_kv<T: CpuFloat>(&self, x: &mut [T], b: &QueryBlock, keys: &[usize], rows: &[T]) {
        let d = self.head_dim;
        for (&r, src) in keys.iter().zip(rows.chunks_exact(d)) {
            let at = (r * self.kv_heads + b.kv_head) * d;
            for (x, &s) in x[at..at + d].iter_mut().zip(src) {
                *x += s;
            }
        }
    }
}

/// Per-thread buffers of one block.
struct Scratch<T> {
    keys: Vec<usize>,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    /// `[len · group, keys]` scores, then probabilities.
    p: Vec<T>,
    /// Backward: `[len · group, keys]` gradients of the probabilities, then of the scores.
    dp: Vec<T>,
    dout: Vec<T>,
    out: Vec<T>,
}

impl<T> Default for Scratch<T> {
    fn default() -> Self {
        Self {
            keys: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            p: Vec::new(),
            dp: Vec::new(),
            dout: Vec::new(),
            out: Vec::new(),
        }
    }
}

/// Keys visible to score row `r` of a block of `len` queries over `keys` keys.
#[inline]
fn visible(r: usize, group: usize, len: usize, keys: usize) -> usize {
    keys - len + r / group + 1
}

/// One block's forward from the gathered `s.q`, `s.k`, `s.v`: returns its `[len · group,
/// D]` outputs and `[len · group]` log-sum-exps.
fn block_forward<T: CpuFloat>(
    s: &mut Scratch<T>,
    len: usize,
    heads: &Heads,
    scale: T,
) -> (Vec<T>, Vec<T>) {
    let (d, group) = (heads.head_dim, heads.group);
    let (m, n) = (len * group, s.keys.len());
    s.p.resize(m * n, T::ZERO);
    let scores = Matmul {
        m,
        n,
        k: d,
        trans_a: false,
        trans_b: true,
    };
    gemm_serial(&mut s.p, &s.q, &s.k, scores, false, scale);
    let lse = wide(|| causal_softmax(&mut s.p, n, group, len));
    let mut out = vec![T::ZERO; m * d];
    let values = Matmul {
        m,
        n: d,
        k: n,
        trans_a: false,
        trans_b: false,
    };
    gemm_serial(&mut out, &s.p, &s.v, values, false, T::ONE);
    (out, lse)
}

/// Turns `[len · group, keys]` scores into probabilities, in place, each row over the
/// keys it sees (zero past them); returns the rows' log-sum-exps.
#[inline(always)]
fn causal_softmax<T: CpuFloat>(p: &mut [T], n: usize, group: usize, len: usize) -> Vec<T> {
    let mut lse = Vec::with_capacity(p.len() / n);
    for (r, row) in p.chunks_exact_mut(n).enumerate() {
        let (seen, masked) = row.split_at_mut(visible(r, group, len, n));
        let max = max(seen);
        for x in seen.iter_mut() {
            *x = (*x - max).exp_vec();
        }
        let sum = sum(seen);
        let inv = T::ONE / sum;
        for x in seen.iter_mut() {
            *x *= inv;
        }
        masked.fill(T::ZERO);
        lse.push(max + sum.ln());
    }
    lse
}

/// [`block_forward`] one score row at a time, each by the same fixed sequence of
/// operations over its visible keys: scores by [`fixed_dot`] then scaled, the softmax
/// by [`max`] and [`sum`] (lanes by key index), and the output accumulated key by key
/// in position order.
fn block_forward_invariant<T: CpuFloat>(
    s: &mut Scratch<T>,
    len: usize,
    heads: &Heads,
    scale: T,
) -> (Vec<T>, Vec<T>) {
    let (d, group) = (heads.head_dim, heads.group);
    let (m, n) = (len * group, s.keys.len());
    let mut out = vec![T::ZERO; m * d];
    let mut lse = Vec::with_capacity(m);
    for (r, out_r) in out.chunks_exact_mut(d).enumerate() {
        let q = &s.q[r * d..(r + 1) * d];
        let seen = visible(r, group, len, n);
        s.p.clear();
        s.p.extend(
            s.k.chunks_exact(d)
                .take(seen)
                .map(|k| fixed_dot(q, k) * scale),
        );
        let max = max(&s.p);
        for x in s.p.iter_mut() {
            *x = (*x - max).exp_vec();
        }
        let sum = sum(&s.p);
        let inv = T::ONE / sum;
        for (&e, v) in s.p.iter().zip(s.v.chunks_exact(d)) {
            let p = e * inv;
            for (o, &v) in out_r.iter_mut().zip(v) {
                *o += p * v;
            }
        }
        lse.push(max + sum.ln());
    }
    (out, lse)
}

/// Forward of packed causal attention; see [`crate::Backend::attention_forward`].
/// `invariant` computes each query row alone (see the module docs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: CpuFloat>(
    out: &mut [T],
    lse: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    segments: &[Segment],
    shape: AttnShape,
    invariant: bool,
) {
    let heads = Heads::new(&shape);
    let scale = T::from_f32(shape.scale);
    let blocks = packed_blocks(segments, heads.kv_heads);
    let block_forward = if invariant {
        block_forward_invariant
    } else {
        block_forward
    };
    let results: Vec<(Vec<T>, Vec<T>)> = blocks
        .par_iter()
        .map_init(Scratch::default, |s, (b, seg)| {
            packed_keys(seg, b, &mut s.keys);
            heads.gather_q(&mut s.q, q, b);
            heads.gather_kv(&mut s.k, k, b, &s.keys);
            heads.gather_kv(&mut s.v, v, b, &s.keys);
            block_forward(s, b.len, &heads, scale)
        })
        .collect();
    for ((b, _), (out_b, lse_b)) in blocks.iter().zip(&results) {
        heads.scatter_q(out, b, out_b);
        let width = heads.group;
        for (i, src) in lse_b.chunks_exact(width).enumerate() {
            let at = (b.first + i) * heads.q_heads + b.kv_head * width;
            lse[at..at + width].copy_from_slice(src);
        }
    }
}

/// One block's gradients from the gathered `s.q`, `s.k`, `s.v`, `s.dout`, `s.out` and the
/// rows' log-sum-exps: returns `dq` (`[len · group, D]`), `dk` and `dv` (`[keys, D]`).
fn block_backward<T: CpuFloat>(
    s: &mut Scratch<T>,
    lse: &[T],
    len: usize,
    heads: &Heads,
    scale: T,
) -> [Vec<T>; 3] {
    let (d, group) = (heads.head_dim, heads.group);
    let (m, n) = (len * group, s.keys.len());
    let scores = Matmul {
        m,
        n,
        k: d,
        trans_a: false,
        trans_b: true,
    };
    s.p.resize(m * n, T::ZERO);
    s.dp.resize(m * n, T::ZERO);
    gemm_serial(&mut s.p, &s.q, &s.k, scores, false, scale);
    gemm_serial(&mut s.dp, &s.dout, &s.v, scores, false, T::ONE);
    wide(|| causal_softmax_backward(s, lse, d, group, len));
    let mut dq = vec![T::ZERO; m * d];
    let mut dk = vec![T::ZERO; n * d];
    let mut dv = vec![T::ZERO; n * d];
    let from_scores = Matmul {
        m,
        n: d,
        k: n,
        trans_a: false,
        trans_b: false,
    };
    gemm_serial(&mut dq, &s.dp, &s.k, from_scores, false, scale);
    let to_keys = Matmul {
        m: n,
        n: d,
        k: m,
        trans_a: true,
        trans_b: false,
    };
    gemm_serial(&mut dk, &s.dp, &s.q, to_keys, false, scale);
    gemm_serial(&mut dv, &s.p, &s.dout, to_keys, false, T::ONE);
    [dq, dk, dv]
}

/// `s.p` (scores) becomes `p = exp(s − lse)` and `s.dp` (`dO·Vᵀ`) becomes
/// `ds = p (dp − rowsum(dO ∘ O))`, the softmax Jacobian applied to dp; zero past each
/// row's visible keys.
#[inline(always)]
fn causal_softmax_backward<T: CpuFloat>(
    s: &mut Scratch<T>,
    lse: &[T],
    d: usize,
    group: usize,
    len: usize,
) {
    let n = s.keys.len();
    for (r, (p, dp)) in
        s.p.chunks_exact_mut(n)
            .zip(s.dp.chunks_exact_mut(n))
            .enumerate()
    {
        let seen = visible(r, group, len, n);
        let delta = dot(&s.dout[r * d..(r + 1) * d], &s.out[r * d..(r + 1) * d]);
        let (p_seen, p_masked) = p.split_at_mut(seen);
        let (dp_seen, dp_masked) = dp.split_at_mut(seen);
        for (p, dp) in p_seen.iter_mut().zip(dp_seen.iter_mut()) {
            *p = (*p - lse[r]).exp_vec();
            *dp = *p * (*dp - delta);
        }
        p_masked.fill(T::ZERO);
        dp_masked.fill(T::ZERO);
    }
}

/// Backward of packed causal attention; see [`crate::Backend::attention_backward`].
/// `dk` and `dv` must be zero on entry (blocks add into them: keys shared as a prefix are
/// read by several segments and their gradients sum).
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
    let heads = Heads::new(&shape);
    let scale = T::from_f32(shape.scale);
    let blocks = packed_blocks(segments, heads.kv_heads);
    let results: Vec<(Vec<usize>, [Vec<T>; 3])> = blocks
        .par_iter()
        .map_init(Scratch::default, |s, (b, seg)| {
            packed_keys(seg, b, &mut s.keys);
            heads.gather_q(&mut s.q, q, b);
            heads.gather_q(&mut s.dout, dout, b);
            heads.gather_q(&mut s.out, out, b);
            heads.gather_kv(&mut s.k, k, b, &s.keys);
            heads.gather_kv(&mut s.v, v, b, &s.keys);
            let group = heads.group;
            let mut lse_b = Vec::with_capacity(b.len * group);
            gather(
                &mut lse_b,
                lse,
                b.first..b.first + b.len,
                heads.q_heads,
                b.kv_head * group,
                group,
            );
            let grads = block_backward(s, &lse_b, b.len, &heads, scale);
            (s.keys.clone(), grads)
        })
        .collect();
    for ((b, _), (keys, [dq_b, dk_b, dv_b])) in blocks.iter().zip(&results) {
        heads.scatter_q(dq, b, dq_b);
        heads.scatter_add_kv(dk, b, keys, dk_b);
        heads.scatter_add_kv(dv, b, keys, dv_b);
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

    /// Blocks of query tokens that are consecutive positions of one sequence (a prefill
    /// chunk; every decoded token is a block of its own).
    fn blocks(&self, kv_heads: usize) -> Vec<QueryBlock> {
        let mut blocks = Vec::new();
        let tokens = self.token_seq.len();
        let mut first = 0;
        while first < tokens {
            let mut len = 1;
            while len < QUERY_BLOCK
                && first + len < tokens
                && self.token_seq[first + len] == self.token_seq[first]
                && self.token_pos[first + len] == self.token_pos[first] + len as u32
            {
                len += 1;
            }
            blocks.extend((0..kv_heads).map(|kv_head| QueryBlock {
                first,
                len,
                kv_head,
            }));
            first += len;
        }
        blocks
    }

    /// Cache slots of positions `0..=pos` of the block's sequence, `pos` its last token's.
    fn keys(&self, b: &QueryBlock, rows: &mut Vec<usize>) -> Result<()> {
        let last = b.first + b.len - 1;
        let (seq, pos) = (self.token_seq[last] as usize, self.token_pos[last] as usize);
        rows.clear();
        for p in 0..=pos {
            rows.push(self.slot(seq, p)?);
        }
        Ok(())
    }
}

/// A block of one query token (a decoded token) read straight from the cache rows
/// `s.keys`: gathering its keys and values and multiplying them by the gemm crate's
/// packed kernels at `m = group` cost several times the arithmetic (copies, packing),
/// which made gathering most of a decode step's attention. Returns its `[group, D]`
/// outputs; the same sums as [`block_forward`] up to their order. Inlined into a
/// [`wide`] call.
#[inline(always)]
fn decode_forward<T: CpuFloat>(
    s: &mut Scratch<T>,
    k_cache: &[T],
    v_cache: &[T],
    kv_head: usize,
    heads: &Heads,
    scale: T,
) -> Vec<T> {
    let (d, group, n) = (heads.head_dim, heads.group, s.keys.len());
    let (stride, offset) = (heads.kv_heads * d, kv_head * d);
    let at = |slot: usize| slot * stride + offset..slot * stride + offset + d;
    // `[group, keys]` scores, each key row read once for the group's query heads.
    s.p.resize(group * n, T::ZERO);
    for (j, &slot) in s.keys.iter().enumerate() {
        let k = &k_cache[at(slot)];
        for (r, q) in s.q.chunks_exact(d).enumerate() {
            s.p[r * n + j] = dot(q, k) * scale;
        }
    }
    for p in s.p.chunks_exact_mut(n) {
        let max = max(p);
        for x in p.iter_mut() {
            *x = (*x - max).exp_vec();
        }
        let inv = T::ONE / sum(p);
        for x in p.iter_mut() {
            *x *= inv;
        }
    }
    // Each output row in columns of up to `COLUMNS`, summed over the keys in order in a
    // fixed-size accumulator the compiler keeps in registers (summed in place, the row
    // went through memory at every key).
    const COLUMNS: usize = 32;
    let mut out = vec![T::ZERO; group * d];
    for (p, out) in s.p.chunks_exact(n).zip(out.chunks_exact_mut(d)) {
        for (c, out) in out.chunks_mut(COLUMNS).enumerate() {
            let mut acc = [T::ZERO; COLUMNS];
            let width = out.len();
            let columns = |slot: usize| &v_cache[at(slot)][c * COLUMNS..][..width];
            if width == COLUMNS {
                for (&p, &slot) in p.iter().zip(&s.keys) {
                    let v: &[T; COLUMNS] = columns(slot).try_into().expect("COLUMNS wide");
                    for i in 0..COLUMNS {
                        acc[i] += p * v[i];
                    }
                }
            } else {
                for (&p, &slot) in p.iter().zip(&s.keys) {
                    for (a, &v) in acc.iter_mut().zip(columns(slot)) {
                        *a += p * v;
                    }
                }
            }
            out.copy_from_slice(&acc[..width]);
        }
    }
    out
}

/// Attention of each query token over its sequence's cached positions `0..=pos`;
/// `invariant` computes each query row alone (see the module docs).
pub(crate) fn paged<T: CpuFloat>(
    out: &mut [T],
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    index: &PagedIndex<'_>,
    shape: AttnShape,
    invariant: bool,
) -> Result<()> {
    let heads = Heads::new(&shape);
    let scale = T::from_f32(shape.scale);
    let blocks = index.blocks(heads.kv_heads);
    let block_forward = if invariant {
        block_forward_invariant
    } else {
        block_forward
    };
    let results: Vec<Vec<T>> = blocks
        .par_iter()
        .map_init(Scratch::default, |s, b| -> Result<Vec<T>> {
            index.keys(b, &mut s.keys)?;
            heads.gather_q(&mut s.q, q, b);
            if b.len == 1 && !invariant {
                let (kv_head, heads) = (b.kv_head, &heads);
                return Ok(wide(|| {
                    decode_forward(s, k_cache, v_cache, kv_head, heads, scale)
                }));
            }
            heads.gather_kv(&mut s.k, k_cache, b, &s.keys);
            heads.gather_kv(&mut s.v, v_cache, b, &s.keys);
            Ok(block_forward(s, b.len, &heads, scale).0)
        })
        .collect::<Result<_>>()?;
    for (b, out_b) in blocks.iter().zip(&results) {
        heads.scatter_q(out, b, out_b);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The blocked attention against one softmax per query row, on segments several
    //! [`QUERY_BLOCK`]s long (the op tests in `tests/cpu_ops.rs` use short ones).

    use super::*;

    const SHAPE: (usize, usize, usize) = (4, 2, 8);

    fn shape(tokens: usize) -> AttnShape {
        AttnShape {
            tokens,
            q_heads: SHAPE.0,
            kv_heads: SHAPE.1,
            head_dim: SHAPE.2,
            scale: 0.4,
        }
    }

    /// Deterministic values in [−1, 1).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n as u64)
            .map(|i| {
                let z = crate::sampling::mix64(seed.wrapping_mul(0x9E37_79B9) ^ i);
                (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    /// One softmax per query row over `keys[t]` (rows of k/v), f64.
    fn naive(q: &[f64], k: &[f64], v: &[f64], keys: &[Vec<usize>], scale: f64) -> Vec<f64> {
        let (hq, hkv) = (SHAPE.0, SHAPE.1);
        let d = q.len() / (keys.len() * hq);
        let mut out = vec![0.0; q.len()];
        for (t, keys) in keys.iter().enumerate() {
            for h in 0..hq {
                let g = h / (hq / hkv);
                let q_th = &q[(t * hq + h) * d..][..d];
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| scale * dot(q_th, &k[(j * hkv + g) * d..][..d]))
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                for (&j, &sj) in keys.iter().zip(&s) {
                    let p = (sj - max).exp() / z;
                    for i in 0..d {
                        out[(t * hq + h) * d + i] += p * v[(j * hkv + g) * d + i];
                    }
                }
            }
        }
        out
    }

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// A plain sequence of 150 tokens, a shared prompt of 70 read by responses of 80 and
    /// 5 tokens, one token outside every segment, and a sequence of 1.
    fn layout() -> (usize, Vec<Segment>, Vec<Vec<usize>>) {
        let seg = |start, len, prefix_start, prefix_len| Segment {
            start,
            len,
            prefix_start,
            prefix_len,
        };
        let segments = vec![
            seg(0, 150, 0, 0),
            seg(150, 70, 0, 0),
            seg(220, 80, 150, 70),
            seg(300, 5, 150, 70),
            seg(306, 1, 0, 0),
        ];
        let mut keys = vec![Vec::new(); 307];
        for s in &segments {
            for t in s.start..s.start + s.len {
                let prefix = s.prefix_start..s.prefix_start + s.prefix_len;
                keys[t as usize] = prefix.chain(s.start..=t).map(|x| x as usize).collect();
            }
        }
        (307, segments, keys)
    }

    fn packed_forward_in<F: CpuFloat>(
        q: &[F],
        k: &[F],
        v: &[F],
        segments: &[Segment],
        invariant: bool,
    ) -> [Vec<F>; 2] {
        let (hq, _, d) = SHAPE;
        let tokens = q.len() / (hq * d);
        let mut out = vec![F::ZERO; q.len()];
        let mut lse = vec![F::ZERO; tokens * hq];
        forward(
            &mut out,
            &mut lse,
            q,
            k,
            v,
            segments,
            shape(tokens),
            invariant,
        );
        [out, lse]
    }

    fn packed_forward(q: &[f64], k: &[f64], v: &[f64], segments: &[Segment]) -> [Vec<f64>; 2] {
        packed_forward_in(q, k, v, segments, false)
    }

    #[test]
    fn packed_forward_matches_one_softmax_per_row() {
        let (tokens, segments, keys) = layout();
        let (hq, hkv, d) = SHAPE;
        let q = values(tokens * hq * d, 1);
        let (k, v) = (values(tokens * hkv * d, 2), values(tokens * hkv * d, 3));
        for invariant in [false, true] {
            let [out, lse] = packed_forward_in(&q, &k, &v, &segments, invariant);
            let want = naive(&q, &k, &v, &keys, 0.4_f32 as f64);
            assert!(max_diff(&out, &want) < 1e-13, "{}", max_diff(&out, &want));
            // The token outside every segment is left untouched.
            assert!(out[305 * hq * d..306 * hq * d].iter().all(|&x| x == 0.0));
            assert!(lse[305 * hq..306 * hq].iter().all(|&x| x == 0.0));
        }
    }

    /// Batch invariant, in f32: a 150-token sequence attended packed (one segment, or
    /// a 60-token prompt shared as the prefix of the rest) gives the same bits as paged
    /// (one query at a time in reverse order, or the whole sequence as one prefill).
    #[test]
    fn invariant_rows_are_equal_packed_and_paged() {
        let (hq, hkv, d) = SHAPE;
        let tokens = 150;
        let to_f32 = |x: Vec<f64>| x.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let q = to_f32(values(tokens * hq * d, 30));
        let k = to_f32(values(tokens * hkv * d, 31));
        let v = to_f32(values(tokens * hkv * d, 32));
        let whole = [Segment {
            start: 0,
            len: 150,
            prefix_start: 0,
            prefix_len: 0,
        }];
        let shared = [
            Segment {
                start: 0,
                len: 60,
                prefix_start: 0,
                prefix_len: 0,
            },
            Segment {
                start: 60,
                len: 90,
                prefix_start: 0,
                prefix_len: 60,
            },
        ];
        let [packed, _] = packed_forward_in(&q, &k, &v, &whole, true);
        assert!(packed_forward_in(&q, &k, &v, &shared, true)[0] == packed);
        // The cache holds the keys in position order, blocks of 16 in a shuffled table.
        let block_size = 16;
        let table: Vec<u32> = (0..10).rev().collect();
        let row = hkv * d;
        let (mut k_cache, mut v_cache) = (vec![0.0; 160 * row], vec![0.0; 160 * row]);
        for p in 0..tokens {
            let slot = table[p / block_size] as usize * block_size + p % block_size;
            k_cache[slot * row..][..row].copy_from_slice(&k[p * row..][..row]);
            v_cache[slot * row..][..row].copy_from_slice(&v[p * row..][..row]);
        }
        let one_by_one: Vec<u32> = (0..150).rev().collect();
        let prefill: Vec<u32> = (0..150).collect();
        for token_pos in [one_by_one, prefill] {
            let token_seq = vec![0; tokens];
            let index = PagedIndex {
                block_tables: &table,
                max_blocks: 10,
                block_size,
                token_seq: &token_seq,
                token_pos: &token_pos,
                num_blocks: 10,
            };
            let q_paged: Vec<f32> = token_pos
                .iter()
                .flat_map(|&p| q[p as usize * hq * d..][..hq * d].to_vec())
                .collect();
            let mut out = vec![0.0; q.len()];
            paged(
                &mut out,
                &q_paged,
                &k_cache,
                &v_cache,
                &index,
                shape(tokens),
                true,
            )
            .unwrap();
            for (t, &p) in token_pos.iter().enumerate() {
                let want = &packed[p as usize * hq * d..][..hq * d];
                assert!(out[t * hq * d..][..hq * d] == *want, "position {p}");
            }
        }
    }

    /// Directional finite differences of `L = Σ out · r` along random directions.
    #[test]
    fn packed_backward_matches_directional_differences() {
        let (tokens, segments, _) = layout();
        let (hq, hkv, d) = SHAPE;
        let q = values(tokens * hq * d, 4);
        let (k, v) = (values(tokens * hkv * d, 5), values(tokens * hkv * d, 6));
        let r = values(tokens * hq * d, 7);
        let [out, lse] = packed_forward(&q, &k, &v, &segments);
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        backward(
            &mut dq,
            &mut dk,
            &mut dv,
            &r,
            &out,
            &lse,
            &q,
            &k,
            &v,
            &segments,
            shape(tokens),
        );
        let loss =
            |q: &[f64], k: &[f64], v: &[f64]| dot(&packed_forward(q, k, v, &segments)[0], &r);
        let eps = 1e-5;
        let step = |x: &[f64], u: &[f64], sign: f64| -> Vec<f64> {
            x.iter().zip(u).map(|(x, u)| x + sign * eps * u).collect()
        };
        for (name, which, grad) in [("q", 0, &dq), ("k", 1, &dk), ("v", 2, &dv)] {
            let x = [&q, &k, &v][which];
            let u = values(x.len(), 10 + which as u64);
            let at = |sign: f64| {
                let mut args = [q.clone(), k.clone(), v.clone()];
                args[which] = step(x, &u, sign);
                loss(&args[0], &args[1], &args[2])
            };
            let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
            let analytic = dot(grad, &u);
            assert!(
                (numeric - analytic).abs() < 1e-7 * analytic.abs().max(1.0),
                "d{name}: {analytic} vs finite differences {numeric}"
            );
        }
    }

    /// Two sequences of 150 and 90 positions sharing their first two cache blocks, queried
    /// as a 100-token prefill chunk (two blocks) and single tokens out of position order.
    #[test]
    fn paged_matches_one_softmax_per_row() {
        // Head dims of 8 and 40 (decode_forward's 32-column accumulators, whole and cut).
        for d in [SHAPE.2, 40] {
            paged_matches_one_softmax_per_row_at(d);
        }
    }

    fn paged_matches_one_softmax_per_row_at(d: usize) {
        let (hq, hkv) = (SHAPE.0, SHAPE.1);
        let block_size = 16;
        let max_blocks = 10;
        let tables: Vec<u32> = [
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            [0, 1, 12, 13, 14, 15, 16, 17, 18, 19],
        ]
        .concat();
        let num_blocks = 20;
        let row = hkv * d;
        let k_cache = values(num_blocks * block_size * row, 20);
        let v_cache = values(num_blocks * block_size * row, 21);
        let slot = |s: usize, p: usize| {
            tables[s * max_blocks + p / block_size] as usize * block_size + p % block_size
        };
        let mut token_seq = vec![0u32; 100];
        let mut token_pos: Vec<u32> = (20..120).collect();
        token_seq.extend([1, 0, 1, 1]);
        token_pos.extend([89, 149, 3, 60]);
        let tokens = token_seq.len();
        let q = values(tokens * hq * d, 22);
        let index = PagedIndex {
            block_tables: &tables,
            max_blocks,
            block_size,
            token_seq: &token_seq,
            token_pos: &token_pos,
            num_blocks,
        };
        // The naive reference reads the cache as a [slots, kv_heads, D] tensor.
        let keys: Vec<Vec<usize>> = (0..tokens)
            .map(|t| {
                (0..=token_pos[t] as usize)
                    .map(|p| slot(token_seq[t] as usize, p))
                    .collect()
            })
            .collect();
        let want = naive(&q, &k_cache, &v_cache, &keys, 0.4_f32 as f64);
        for invariant in [false, true] {
            let mut out = vec![0.0; q.len()];
            let shape = AttnShape {
                head_dim: d,
                ..shape(tokens)
            };
            paged(&mut out, &q, &k_cache, &v_cache, &index, shape, invariant).unwrap();
            assert!(
                max_diff(&out, &want) < 1e-13,
                "d {d}: {}",
                max_diff(&out, &want)
            );
        }
    }
}
