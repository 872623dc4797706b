//! The batch-invariant product `C (+)= A·Bᵀ` on the CPU: every element is one
//! [`fixed_dot`], whatever the shape of the call, the tiling, the thread or the row's
//! neighbours, so a token's activations do not depend on the batch it is computed in.
//!
//! `gemm` cannot promise this: its blocking (and so each element's order of additions)
//! follows `m`, `n` and `k`, and padding one row into a larger call was found not to
//! pin it. Here the order of each element's reduction is written out: [`LANES`]
//! independent partial sums over `k` in steps of `LANES`, folded lane 0 to 7, then the
//! tail in order. Each lane is a multiply then an add, rounded separately (Rust never
//! contracts them into a fused multiply-add), so the x86-64 baseline build and the AVX2
//! build of the same loop give the same bits.

use rayon::prelude::*;

use super::float::CpuFloat;

/// Partial sums of one element's reduction (one AVX register of `f32`).
const LANES: usize = 8;
/// Rows of `A` one tile reads: each `B` row loaded is used this many times.
const TILE_ROWS: usize = 4;
/// Rows of `B` one tile reads: each `A` row loaded is used this many times.
const TILE_COLS: usize = 2;
/// Columns of `C` one task computes when the rows are too few to share out: a panel of
/// `B` small enough to stay in cache while every row passes over it.
const PANEL_COLS: usize = 64;
/// Rows of `C` one task computes when there are enough to share out.
const BLOCK_ROWS: usize = 16;

/// The one reduction order of the batch-invariant product: `Σ_p a_p b_p` as
/// [`LANES`] partial sums, folded in lane order, then the tail.
#[inline(always)]
pub(crate) fn fixed_dot<T: CpuFloat>(a: &[T], b: &[T]) -> T {
    tile::<T, 1, 1>([a], [b])[0][0]
}

/// `R × C` elements `out[i][j] = fixed_dot(a[i], b[j])` at once: each loaded vector
/// serves several elements, and each element still runs [`fixed_dot`]'s exact sequence.
#[inline(always)]
fn tile<T: CpuFloat, const R: usize, const C: usize>(a: [&[T]; R], b: [&[T]; C]) -> [[T; C]; R] {
    let k = a[0].len();
    let full = k - k % LANES;
    let mut acc = [[[T::ZERO; LANES]; C]; R];
    for p in (0..full).step_by(LANES) {
        let av: [&[T]; R] = std::array::from_fn(|i| &a[i][p..p + LANES]);
        let bv: [&[T]; C] = std::array::from_fn(|j| &b[j][p..p + LANES]);
        for i in 0..R {
            for j in 0..C {
                for l in 0..LANES {
                    acc[i][j][l] += av[i][l] * bv[j][l];
                }
            }
        }
    }
    let mut out = [[T::ZERO; C]; R];
    for i in 0..R {
        for j in 0..C {
            let mut s = acc[i][j].iter().fold(T::ZERO, |s, &x| s + x);
            for p in full..k {
                s += a[i][p] * b[j][p];
            }
            out[i][j] = s;
        }
    }
    out
}

/// Rows `a` (`[rows, k]`) against columns `cols` of `b` (`[n, k]`), into `c` (`[rows,
/// width]` with `width >= cols.len()`, column `cols.start` at 0).
#[inline(always)]
fn panel<T: CpuFloat>(
    c: &mut [T],
    width: usize,
    a: &[T],
    b: &[T],
    k: usize,
    cols: std::ops::Range<usize>,
    accumulate: bool,
) {
    let rows = a.len() / k;
    let row = |i: usize| &a[i * k..(i + 1) * k];
    let col = |j: usize| &b[j * k..(j + 1) * k];
    let put = |c: &mut [T], i: usize, j: usize, v: T| {
        let x = &mut c[i * width + j - cols.start];
        *x = if accumulate { *x + v } else { v };
    };
    let mut i = 0;
    while i < rows {
        let r = TILE_ROWS.min(rows - i);
        let mut j = cols.start;
        while j < cols.end {
            let w = TILE_COLS.min(cols.end - j);
            if r == TILE_ROWS && w == TILE_COLS {
                let t = tile::<T, TILE_ROWS, TILE_COLS>(
                    std::array::from_fn(|di| row(i + di)),
                    std::array::from_fn(|dj| col(j + dj)),
                );
                for (di, t_row) in t.iter().enumerate() {
                    for (dj, &v) in t_row.iter().enumerate() {
                        put(c, i + di, j + dj, v);
                    }
                }
            } else {
                for di in 0..r {
                    for dj in 0..w {
                        put(c, i + di, j + dj, fixed_dot(row(i + di), col(j + dj)));
                    }
                }
            }
            j += w;
        }
        i += r;
    }
}

/// [`panel`] compiled for AVX2: the same operations, eight lanes per instruction.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn panel_avx2<T: CpuFloat>(
    c: &mut [T],
    width: usize,
    a: &[T],
    b: &[T],
    k: usize,
    cols: std::ops::Range<usize>,
    accumulate: bool,
) {
    panel(c, width, a, b, k, cols, accumulate)
}

fn panel_best<T: CpuFloat>(
    c: &mut [T],
    width: usize,
    a: &[T],
    b: &[T],
    k: usize,
    cols: std::ops::Range<usize>,
    accumulate: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked on the line above.
        unsafe { panel_avx2(c, width, a, b, k, cols, accumulate) };
        return;
    }
    panel(c, width, a, b, k, cols, accumulate)
}

/// `c[r, j] = fixed_dot(a[r, :], b[j, :])` (`c += …` when `accumulate`) for `a: [m, k]`,
/// `b: [n, k]`, `c: [m, n]`, all row-major; lengths checked by the caller.
pub(crate) fn matmul_xwt<T: CpuFloat>(
    c: &mut [T],
    a: &[T],
    b: &[T],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(T::ZERO);
        }
        return;
    }
    if m >= BLOCK_ROWS * rayon::current_num_threads() {
        c.par_chunks_mut(BLOCK_ROWS * n)
            .zip(a.par_chunks(BLOCK_ROWS * k))
            .for_each(|(c, a)| {
                for first in (0..n).step_by(PANEL_COLS) {
                    let cols = first..n.min(first + PANEL_COLS);
                    // `c`'s rows are whole here: write through an offset view.
                    panel_best(&mut c[first..], n, a, b, k, cols, accumulate);
                }
            });
        return;
    }
    // Few rows (decoding): share the columns out instead, each task into its own panel.
    let panels: Vec<Vec<T>> = (0..n.div_ceil(PANEL_COLS))
        .into_par_iter()
        .map(|p| {
            let cols = p * PANEL_COLS..n.min((p + 1) * PANEL_COLS);
            let width = cols.len();
            let mut out = vec![T::ZERO; m * width];
            if accumulate {
                for (o, c) in out.chunks_exact_mut(width).zip(c.chunks_exact(n)) {
                    o.copy_from_slice(&c[cols.clone()]);
                }
            }
            panel_best(&mut out, width, a, b, k, cols, accumulate);
            out
        })
        .collect();
    for (p, out) in panels.iter().enumerate() {
        let first = p * PANEL_COLS;
        let width = out.len() / m;
        for (c, o) in c.chunks_exact_mut(n).zip(out.chunks_exact(width)) {
            c[first..first + width].copy_from_slice(o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let z = crate::sampling::mix64(seed.wrapping_mul(0x9E37_79B9) ^ i);
                ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every row of every call equals the row computed alone, bit for bit, for any
    /// number of rows (both task layouts, full and edge tiles) and with accumulation.
    #[test]
    fn each_row_is_the_row_alone() {
        let (n, k) = (131, 77);
        let b = values(n * k, 1);
        for m in [1, 3, 4, 5, 17, 64, 100] {
            let a = values(m * k, 2);
            let base = values(m * n, 3);
            for accumulate in [false, true] {
                let mut c = base.clone();
                matmul_xwt(&mut c, &a, &b, (m, n, k), accumulate);
                for r in 0..m {
                    let mut alone = base[r * n..(r + 1) * n].to_vec();
                    matmul_xwt(
                        &mut alone,
                        &a[r * k..(r + 1) * k],
                        &b,
                        (1, n, k),
                        accumulate,
                    );
                    assert!(c[r * n..(r + 1) * n] == alone[..], "m {m} row {r}");
                    for j in 0..n {
                        let dot = fixed_dot(&a[r * k..(r + 1) * k], &b[j * k..(j + 1) * k]);
                        let want = if accumulate {
                            base[r * n + j] + dot
                        } else {
                            dot
                        };
                        assert_eq!(c[r * n + j].to_bits(), want.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn matches_a_plain_product() {
        let (m, n, k) = (9, 10, 35);
        let (a, b) = (values(m * k, 4), values(n * k, 5));
        let mut c = vec![0.0; m * n];
        matmul_xwt(&mut c, &a, &b, (m, n, k), false);
        for r in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|p| f64::from(a[r * k + p]) * f64::from(b[j * k + p]))
                    .sum();
                assert!((f64::from(c[r * n + j]) - want).abs() < 1e-5);
            }
        }
    }
}
