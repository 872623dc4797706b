//! The CPU reference backend against naive formulas (forwards) and central finite
//! differences in f64 (backwards), plus its argument checks.

use floe_backend::cpu::CpuBackend;
use floe_backend::{
    AdamW, AttnShape, Backend, BufKind, Error, LmHead, Matmul, PagedLayout, QueryRun, Segment,
};
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::SplitMix64;

type B = CpuBackend<f64>;
type Buf = <B as Backend>::Buf;

/// Test data from splitmix64 seeded with a test's number.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(SplitMix64::seed_from_u64(seed))
    }
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.uniform()).collect()
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

fn up(b: &B, x: &[f64]) -> Buf {
    b.upload_f64(x, BufKind::Compute).unwrap()
}

fn up_full(b: &B, x: &[f64]) -> Buf {
    b.upload_f64(x, BufKind::Full).unwrap()
}

fn down(b: &B, x: &Buf) -> Vec<f64> {
    b.download_f64(x).unwrap()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(1e-3_f64, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    assert!(
        worst / scale < tol,
        "{what}: max |Δ| = {worst:e} (relative {:e}, tolerance {tol:e})",
        worst / scale
    );
}

/// Central finite differences of `loss` at `x`, compared with `analytic`.
fn check_gradient(what: &str, x: &[f64], analytic: &[f64], loss: impl Fn(&[f64]) -> f64) {
    let h = 1e-5;
    let mut probe = x.to_vec();
    let numeric: Vec<f64> = (0..x.len())
        .map(|i| {
            probe[i] = x[i] + h;
            let plus = loss(&probe);
            probe[i] = x[i] - h;
            let minus = loss(&probe);
            probe[i] = x[i];
            (plus - minus) / (2.0 * h)
        })
        .collect();
    assert_close(what, analytic, &numeric, 1e-6);
}

fn naive_matmul(a: &[f64], b: &[f64], d: Matmul) -> Vec<f64> {
    let mut c = vec![0.0; d.m * d.n];
    for i in 0..d.m {
        for j in 0..d.n {
            for p in 0..d.k {
                let x = if d.trans_a {
                    a[p * d.m + i]
                } else {
                    a[i * d.k + p]
                };
                let y = if d.trans_b {
                    b[j * d.k + p]
                } else {
                    b[p * d.n + j]
                };
                c[i * d.n + j] += x * y;
            }
        }
    }
    c
}

#[test]
fn matmul_matches_naive_for_every_transpose_and_accumulates() {
    let b = B::new();
    let mut rng = Rng::new(1);
    for (m, n, k) in [(3, 5, 4), (70, 65, 80)] {
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                let d = Matmul {
                    m,
                    n,
                    k,
                    trans_a,
                    trans_b,
                };
                let (a, bb, c0) = (rng.vec(m * k), rng.vec(k * n), rng.vec(m * n));
                let want = naive_matmul(&a, &bb, d);
                let mut c = up(&b, &c0);
                b.matmul(&mut c, &up(&b, &a), &up(&b, &bb), d, false)
                    .unwrap();
                assert_close("matmul", &down(&b, &c), &want, 1e-12);
                b.matmul(&mut c, &up(&b, &a), &up(&b, &bb), d, true)
                    .unwrap();
                let twice: Vec<f64> = want.iter().map(|x| 2.0 * x).collect();
                assert_close("matmul accumulate", &down(&b, &c), &twice, 1e-12);
            }
        }
    }
}

#[test]
fn bias_embedding_and_gather() {
    let b = B::new();
    let mut rng = Rng::new(2);
    let (rows, cols) = (5, 3);
    let (y0, bias) = (rng.vec(rows * cols), rng.vec(cols));
    let mut y = up(&b, &y0);
    b.add_bias(&mut y, &up(&b, &bias), rows, cols).unwrap();
    let want: Vec<f64> = (0..rows * cols).map(|i| y0[i] + bias[i % cols]).collect();
    assert_eq!(down(&b, &y), want);
    let mut dbias = up_full(&b, &[1.0, 2.0, 3.0]);
    b.add_bias_backward(&mut dbias, &up(&b, &y0), rows, cols)
        .unwrap();
    let sums: Vec<f64> = (0..cols)
        .map(|c| [1.0, 2.0, 3.0][c] + (0..rows).map(|r| y0[r * cols + c]).sum::<f64>())
        .collect();
    assert_close("add_bias_backward", &down(&b, &dbias), &sums, 1e-14);

    let (vocab, dim) = (6, 4);
    let table = rng.vec(vocab * dim);
    let ids = [3u32, 0, 3, 5];
    let mut out = b.zeros(ids.len() * dim, BufKind::Compute).unwrap();
    b.embedding_forward(
        &mut out,
        &up(&b, &table),
        &b.upload_index(&ids).unwrap(),
        dim,
    )
    .unwrap();
    let want: Vec<f64> = ids
        .iter()
        .flat_map(|&i| table[i as usize * dim..(i as usize + 1) * dim].to_vec())
        .collect();
    assert_eq!(down(&b, &out), want);
    let mut gathered = b.zeros(ids.len() * dim, BufKind::Compute).unwrap();
    b.gather_rows(
        &mut gathered,
        &up(&b, &table),
        &b.upload_index(&ids).unwrap(),
        dim,
    )
    .unwrap();
    assert_eq!(down(&b, &gathered), want);

    let dout = rng.vec(ids.len() * dim);
    let mut dtable = b.zeros(vocab * dim, BufKind::Full).unwrap();
    b.embedding_backward(
        &mut dtable,
        &up(&b, &dout),
        &b.upload_index(&ids).unwrap(),
        dim,
    )
    .unwrap();
    let mut want = vec![0.0; vocab * dim];
    for (t, &id) in ids.iter().enumerate() {
        for j in 0..dim {
            want[id as usize * dim + j] += dout[t * dim + j];
        }
    }
    assert_close("embedding_backward", &down(&b, &dtable), &want, 1e-14);
}

#[test]
fn elementwise_and_reductions() {
    let b = B::new();
    let (x, y0) = (vec![1.0, -2.0, 3.0], vec![0.5, 0.5, 0.5]);
    let mut y = up(&b, &y0);
    b.add_assign(&mut y, &up(&b, &x)).unwrap();
    assert_eq!(down(&b, &y), vec![1.5, -1.5, 3.5]);
    b.scale(&mut y, 2.0).unwrap();
    assert_eq!(down(&b, &y), vec![3.0, -3.0, 7.0]);
    assert_eq!(b.sum_squares(&up(&b, &x)).unwrap(), 14.0);
    let mut z = b.zeros(3, BufKind::Full).unwrap();
    b.copy(&mut z, &y).unwrap();
    assert_eq!(down(&b, &z), vec![3.0, -3.0, 7.0]);
    let mut long = b.zeros(5, BufKind::Full).unwrap();
    b.copy_into(&mut long, 2, &z).unwrap();
    assert_eq!(down(&b, &long), vec![0.0, 0.0, 3.0, -3.0, 7.0]);
    let mut piece = b.zeros(2, BufKind::Full).unwrap();
    b.copy_from(&mut piece, &long, 3).unwrap();
    assert_eq!(down(&b, &piece), vec![-3.0, 7.0]);
    assert!(b.copy_from(&mut piece, &long, 4).is_err(), "overrun");
    b.copy_range(&mut long, 0, &z, 1, 2).unwrap();
    assert_eq!(down(&b, &long), vec![-3.0, 7.0, 3.0, -3.0, 7.0]);
    assert!(b.copy_range(&mut long, 4, &z, 0, 2).is_err(), "dst overrun");
    assert!(b.copy_range(&mut long, 0, &z, 2, 2).is_err(), "src overrun");
    assert!(
        b.copy_range(&mut long, 0, &b.upload_index(&[1]).unwrap(), 0, 1)
            .is_err(),
        "kinds differ"
    );
    b.fill_zero(&mut long).unwrap();
    assert_eq!(down(&b, &long), vec![0.0; 5]);
    assert_eq!(b.kind(&long), BufKind::Full);
    let third = 1.0 / 3.0;
    assert_eq!(
        down(&b, &up(&b, &[third])),
        vec![third],
        "f64 upload is exact"
    );
}

#[test]
fn rmsnorm_forward_and_backward() {
    let b = B::new();
    let mut rng = Rng::new(3);
    let (rows, dim, eps) = (4, 6, 1e-5_f32);
    let (x, w, r) = (rng.vec(rows * dim), rng.vec(dim), rng.vec(rows * dim));
    let forward = |x: &[f64], w: &[f64]| -> (Vec<f64>, Vec<f64>) {
        let mut out = b.zeros(rows * dim, BufKind::Compute).unwrap();
        let mut rstd = b.zeros(rows, BufKind::Full).unwrap();
        b.rmsnorm_forward(&mut out, &mut rstd, &up(&b, x), &up(&b, w), rows, dim, eps)
            .unwrap();
        (down(&b, &out), down(&b, &rstd))
    };
    let (out, rstd) = forward(&x, &w);
    let mut want = vec![0.0; rows * dim];
    for i in 0..rows {
        let row = &x[i * dim..(i + 1) * dim];
        let rs = 1.0 / (dot(row, row) / dim as f64 + eps as f64).sqrt();
        assert!((rstd[i] - rs).abs() < 1e-14);
        for j in 0..dim {
            want[i * dim + j] = row[j] * rs * w[j];
        }
    }
    assert_close("rmsnorm_forward", &out, &want, 1e-14);

    let mut dx = b.zeros(rows * dim, BufKind::Compute).unwrap();
    let mut dw = b.zeros(dim, BufKind::Full).unwrap();
    b.rmsnorm_backward(
        &mut dx,
        &mut dw,
        &up(&b, &r),
        &up(&b, &x),
        &up(&b, &w),
        &up_full(&b, &rstd),
        rows,
        dim,
    )
    .unwrap();
    check_gradient("rmsnorm dx", &x, &down(&b, &dx), |x| {
        dot(&forward(x, &w).0, &r)
    });
    check_gradient("rmsnorm dw", &w, &down(&b, &dw), |w| {
        dot(&forward(&x, w).0, &r)
    });
}

#[test]
fn rope_rotates_half_pairs_and_inverse_is_its_backward() {
    let b = B::new();
    let mut rng = Rng::new(4);
    let (tokens, heads, hd) = (3, 2, 4);
    let positions = [0u32, 5, 17];
    let inv_freq = [1.0, 0.01];
    let x = rng.vec(tokens * heads * hd);
    let rotate = |x: &[f64], inverse: bool| {
        let mut y = up(&b, x);
        b.rope(
            &mut y,
            &b.upload_index(&positions).unwrap(),
            &up_full(&b, &inv_freq),
            tokens,
            heads,
            hd,
            inverse,
        )
        .unwrap();
        down(&b, &y)
    };
    let y = rotate(&x, false);
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let at = (t * heads + h) * hd;
            for (i, &f) in inv_freq.iter().enumerate() {
                let a = pos as f64 * f;
                let (x1, x2) = (x[at + i], x[at + i + hd / 2]);
                assert!((y[at + i] - (x1 * a.cos() - x2 * a.sin())).abs() < 1e-14);
                assert!((y[at + i + hd / 2] - (x2 * a.cos() + x1 * a.sin())).abs() < 1e-14);
            }
        }
    }
    assert_close("rope inverse", &rotate(&y, true), &x, 1e-14);
    let r = rng.vec(x.len());
    check_gradient("rope backward", &x, &rotate(&r, true), |x| {
        dot(&rotate(x, false), &r)
    });
}

#[test]
fn swiglu_forward_and_backward() {
    let b = B::new();
    let mut rng = Rng::new(5);
    let n = 10;
    let (g, u, r) = (rng.vec(n), rng.vec(n), rng.vec(n));
    let forward = |g: &[f64], u: &[f64]| {
        let mut out = b.zeros(n, BufKind::Compute).unwrap();
        b.swiglu_forward(&mut out, &up(&b, g), &up(&b, u)).unwrap();
        down(&b, &out)
    };
    let want: Vec<f64> = (0..n)
        .map(|i| g[i] / (1.0 + (-g[i]).exp()) * u[i])
        .collect();
    assert_close("swiglu_forward", &forward(&g, &u), &want, 1e-14);
    let mut dg = b.zeros(n, BufKind::Compute).unwrap();
    let mut du = b.zeros(n, BufKind::Compute).unwrap();
    b.swiglu_backward(&mut dg, &mut du, &up(&b, &r), &up(&b, &g), &up(&b, &u))
        .unwrap();
    check_gradient("swiglu dgate", &g, &down(&b, &dg), |g| {
        dot(&forward(g, &u), &r)
    });
    check_gradient("swiglu dup", &u, &down(&b, &du), |u| {
        dot(&forward(&g, u), &r)
    });
}

/// Naive attention: for each query token, the list of key tokens it may read, then an
/// explicit softmax.
#[allow(clippy::too_many_arguments)]
fn naive_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    visible: &[Vec<usize>],
    hq: usize,
    hkv: usize,
    d: usize,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; visible.len() * hq * d];
    for (t, keys) in visible.iter().enumerate() {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qv = &q[(t * hq + h) * d..(t * hq + h + 1) * d];
            let s: Vec<f64> = keys
                .iter()
                .map(|&j| scale * dot(qv, &k[(j * hkv + g) * d..(j * hkv + g + 1) * d]))
                .collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
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

/// A packed batch: a plain sequence of 3, a shared prompt of 4, two responses (2 and 3
/// tokens) reading it as prefix, and a plain sequence of 1.
fn attention_layout() -> (usize, Vec<Segment>, Vec<Vec<usize>>) {
    let seg = |start, len, prefix_start, prefix_len| Segment {
        start,
        len,
        prefix_start,
        prefix_len,
    };
    let segments = vec![
        seg(0, 3, 0, 0),
        seg(3, 4, 0, 0),
        seg(7, 2, 3, 4),
        seg(9, 3, 3, 4),
        seg(12, 1, 0, 0),
    ];
    let mut visible = Vec::new();
    for s in &segments {
        for t in s.start..s.start + s.len {
            let mut keys: Vec<usize> = (s.prefix_start..s.prefix_start + s.prefix_len)
                .map(|x| x as usize)
                .collect();
            keys.extend(s.start as usize..=t as usize);
            visible.push(keys);
        }
    }
    (13, segments, visible)
}

#[test]
fn attention_matches_naive_and_finite_differences() {
    let b = B::new();
    let mut rng = Rng::new(6);
    let (tokens, segments, visible) = attention_layout();
    let (hq, hkv, d) = (4, 2, 3);
    let shape = AttnShape {
        tokens,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        scale: 0.7,
    };
    let q = rng.vec(tokens * hq * d);
    let k = rng.vec(tokens * hkv * d);
    let v = rng.vec(tokens * hkv * d);
    let r = rng.vec(tokens * hq * d);
    let forward = |q: &[f64], k: &[f64], v: &[f64]| {
        let mut out = b.zeros(tokens * hq * d, BufKind::Compute).unwrap();
        let mut lse = b.zeros(tokens * hq, BufKind::Full).unwrap();
        b.attention_forward(
            &mut out,
            &mut lse,
            &up(&b, q),
            &up(&b, k),
            &up(&b, v),
            &segments,
            shape,
        )
        .unwrap();
        (out, lse)
    };
    let (out, lse) = forward(&q, &k, &v);
    let want = naive_attention(&q, &k, &v, &visible, hq, hkv, d, 0.7_f32 as f64);
    assert_close("attention_forward", &down(&b, &out), &want, 1e-13);

    let mut dq = b.zeros(q.len(), BufKind::Compute).unwrap();
    let mut dk = b.zeros(k.len(), BufKind::Compute).unwrap();
    let mut dv = b.zeros(v.len(), BufKind::Compute).unwrap();
    b.attention_backward(
        &mut dq,
        &mut dk,
        &mut dv,
        &up(&b, &r),
        &out,
        &lse,
        &up(&b, &q),
        &up(&b, &k),
        &up(&b, &v),
        &segments,
        shape,
    )
    .unwrap();
    let loss = |q: &[f64], k: &[f64], v: &[f64]| dot(&down(&b, &forward(q, k, v).0), &r);
    check_gradient("attention dq", &q, &down(&b, &dq), |q| loss(q, &k, &v));
    check_gradient("attention dk", &k, &down(&b, &dk), |k| loss(&q, k, &v));
    check_gradient("attention dv", &v, &down(&b, &dv), |v| loss(&q, &k, v));
}

#[test]
fn paged_attention_equals_packed_attention() {
    let b = B::new();
    let mut rng = Rng::new(7);
    let (hq, hkv, d, block_size) = (4, 2, 3, 2);
    // Two sequences share a 4-token prompt (blocks 5 and 1); their continuations live in
    // their own blocks, scattered through a cache of 8 blocks.
    let prompt = 4;
    let lens = [7usize, 6];
    let tables: [Vec<u32>; 2] = [vec![5, 1, 6, 0], vec![5, 1, 3, 0]];
    let max_blocks = 4;
    let kv = |rng: &mut Rng, n: usize| rng.vec(n * hkv * d);
    let (k_prompt, v_prompt) = (kv(&mut rng, prompt), kv(&mut rng, prompt));
    let mut ks = Vec::new();
    let mut vs = Vec::new();
    for &len in &lens {
        let mut k = k_prompt.clone();
        k.extend(kv(&mut rng, len - prompt));
        let mut v = v_prompt.clone();
        v.extend(kv(&mut rng, len - prompt));
        ks.push(k);
        vs.push(v);
    }
    let num_blocks = 8;
    let row = hkv * d;
    let mut k_cache = b
        .zeros(num_blocks * block_size * row, BufKind::Compute)
        .unwrap();
    let mut v_cache = b
        .zeros(num_blocks * block_size * row, BufKind::Compute)
        .unwrap();
    let slot = |s: usize, p: usize| {
        tables[s][p / block_size] * block_size as u32 + (p % block_size) as u32
    };
    for s in 0..2 {
        let slots: Vec<u32> = (0..lens[s]).map(|p| slot(s, p)).collect();
        b.kv_cache_write(
            &mut k_cache,
            &mut v_cache,
            &up(&b, &ks[s]),
            &up(&b, &vs[s]),
            &b.upload_index(&slots).unwrap(),
            hkv,
            d,
        )
        .unwrap();
    }
    // Query every position of both sequences in one call.
    let total: usize = lens.iter().sum();
    let q = rng.vec(total * hq * d);
    let token_seq: Vec<u32> = (0..2).flat_map(|s| vec![s as u32; lens[s]]).collect();
    let token_pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
    let flat_tables: Vec<u32> = tables.concat();
    let (bt, ts, tp) = (
        b.upload_index(&flat_tables).unwrap(),
        b.upload_index(&token_seq).unwrap(),
        b.upload_index(&token_pos).unwrap(),
    );
    let layout = PagedLayout::<B> {
        block_tables: &bt,
        max_blocks,
        block_size,
        token_seq: &ts,
        token_pos: &tp,
        max_context: 7,
        runs: &[QueryRun { first: 0, len: 7 }, QueryRun { first: 7, len: 6 }],
        shared: &[],
    };
    let shape = AttnShape {
        tokens: total,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        scale: 0.5,
    };
    let mut paged = b.zeros(total * hq * d, BufKind::Compute).unwrap();
    b.paged_attention(&mut paged, &up(&b, &q), &k_cache, &v_cache, &layout, shape)
        .unwrap();
    // A run must be one sequence's consecutive positions: 0..8 crosses into the second.
    let crossing = PagedLayout::<B> {
        runs: &[QueryRun { first: 0, len: 8 }],
        ..layout
    };
    let err = b
        .paged_attention(
            &mut paged,
            &up(&b, &q),
            &k_cache,
            &v_cache,
            &crossing,
            shape,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("runs[0]") && err.contains("consecutive"),
        "{err}"
    );

    let segments = [
        Segment {
            start: 0,
            len: 7,
            ..Default::default()
        },
        Segment {
            start: 7,
            len: 6,
            ..Default::default()
        },
    ];
    let mut packed = b.zeros(total * hq * d, BufKind::Compute).unwrap();
    let mut lse = b.zeros(total * hq, BufKind::Full).unwrap();
    b.attention_forward(
        &mut packed,
        &mut lse,
        &up(&b, &q),
        &up(&b, &ks.concat()),
        &up(&b, &vs.concat()),
        &segments,
        shape,
    )
    .unwrap();
    assert_close(
        "paged vs packed",
        &down(&b, &paged),
        &down(&b, &packed),
        1e-14,
    );
}

#[test]
fn lm_head_matches_naive_and_finite_differences() {
    let b = B::new();
    let mut rng = Rng::new(8);
    let (tokens, dim, vocab) = (5, 4, 7);
    let spec = LmHead {
        tokens,
        dim,
        vocab,
        logit_scale: 1.25,
        chunk_rows: 2,
    };
    let (h, w) = (rng.vec(tokens * dim), rng.vec(vocab * dim));
    let targets: Vec<u32> = (0..tokens).map(|_| rng.below(vocab as u32)).collect();
    let (a, c) = (rng.vec(tokens), rng.vec(tokens));
    let tg = b.upload_index(&targets).unwrap();
    let forward = |h: &[f64], w: &[f64]| {
        let mut lp = b.zeros(tokens, BufKind::Full).unwrap();
        let mut ent = b.zeros(tokens, BufKind::Full).unwrap();
        let mut lse = b.zeros(tokens, BufKind::Full).unwrap();
        b.lm_head_forward(
            &mut lp,
            &mut ent,
            &mut lse,
            &up(&b, h),
            &up(&b, w),
            &tg,
            spec,
        )
        .unwrap();
        (down(&b, &lp), down(&b, &ent), down(&b, &lse))
    };
    let (lp, ent, lse) = forward(&h, &w);
    for t in 0..tokens {
        let z: Vec<f64> = (0..vocab)
            .map(|j| 1.25 * dot(&h[t * dim..(t + 1) * dim], &w[j * dim..(j + 1) * dim]))
            .collect();
        let norm = z.iter().map(|x| x.exp()).sum::<f64>().ln();
        let p: Vec<f64> = z.iter().map(|x| (x - norm).exp()).collect();
        let entropy = -p.iter().map(|p| p * p.ln()).sum::<f64>();
        assert!((lse[t] - norm).abs() < 1e-13);
        assert!((lp[t] - (z[targets[t] as usize] - norm)).abs() < 1e-13);
        assert!((ent[t] - entropy).abs() < 1e-13);
    }
    let mut dh = b.zeros(tokens * dim, BufKind::Compute).unwrap();
    let mut dw = up_full(&b, &vec![0.0; vocab * dim]);
    b.lm_head_backward(
        &mut dh,
        &mut dw,
        &up_full(&b, &a),
        &up_full(&b, &c),
        &up(&b, &h),
        &up(&b, &w),
        &tg,
        &up_full(&b, &lse),
        spec,
    )
    .unwrap();
    let loss = |h: &[f64], w: &[f64]| {
        let (lp, ent, _) = forward(h, w);
        dot(&lp, &a) + dot(&ent, &c)
    };
    check_gradient("lm_head dhidden", &h, &down(&b, &dh), |h| loss(h, &w));
    check_gradient("lm_head dw", &w, &down(&b, &dw), |w| loss(&h, w));
}

#[test]
fn adamw_matches_the_textbook_step() {
    let b = B::new();
    let hp = AdamW {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.01,
        step: 3,
        grad_scale: 0.5,
    };
    let (p0, g, m0, v0) = (
        vec![1.0, -2.0],
        vec![0.3, -0.4],
        vec![0.05, 0.1],
        vec![0.01, 0.02],
    );
    let mut p = up_full(&b, &p0);
    let mut m = up_full(&b, &m0);
    let mut v = up_full(&b, &v0);
    let mut compute = b.zeros(2, BufKind::Compute).unwrap();
    b.adamw(
        &mut p,
        &up_full(&b, &g),
        &mut m,
        &mut v,
        Some(&mut compute),
        hp,
    )
    .unwrap();
    let f = |x: f32| x as f64;
    for i in 0..2 {
        let gi = g[i] * 0.5;
        let mi = f(hp.beta1) * m0[i] + (1.0 - f(hp.beta1)) * gi;
        let vi = f(hp.beta2) * v0[i] + (1.0 - f(hp.beta2)) * gi * gi;
        let mhat = mi / (1.0 - f(hp.beta1).powi(3));
        let vhat = vi / (1.0 - f(hp.beta2).powi(3));
        let want = p0[i] * (1.0 - f(hp.lr) * f(hp.weight_decay))
            - f(hp.lr) * mhat / (vhat.sqrt() + f(hp.eps));
        assert!((down(&b, &p)[i] - want).abs() < 1e-14);
        assert!((down(&b, &m)[i] - mi).abs() < 1e-15);
        assert!((down(&b, &v)[i] - vi).abs() < 1e-15);
    }
    assert_eq!(down(&b, &compute), down(&b, &p));
}

#[test]
fn bad_arguments_are_errors_naming_the_op_and_argument() {
    let b = B::new();
    let x = b.zeros(6, BufKind::Compute).unwrap();
    let mut c = b.zeros(4, BufKind::Compute).unwrap();
    let d = Matmul {
        m: 2,
        n: 2,
        k: 3,
        trans_a: false,
        trans_b: false,
    };
    let wrong = b.zeros(5, BufKind::Compute).unwrap();
    let err = b.matmul(&mut c, &x, &wrong, d, false).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "matmul", .. }), "{err}");
    assert!(err.to_string().contains("`b`"), "{err}");

    let mut out = b.zeros(6, BufKind::Compute).unwrap();
    let mut rstd_compute = b.zeros(2, BufKind::Compute).unwrap();
    let w = b.zeros(3, BufKind::Compute).unwrap();
    let err = b
        .rmsnorm_forward(&mut out, &mut rstd_compute, &x, &w, 2, 3, 1e-6)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Kind {
                arg: "rstd",
                expected: BufKind::Full,
                ..
            }
        ),
        "{err}"
    );

    let ids = b.upload_index(&[0, 9]).unwrap();
    let mut emb = b.zeros(6, BufKind::Compute).unwrap();
    let err = b.embedding_forward(&mut emb, &x, &ids, 3).unwrap_err();
    assert!(err.to_string().contains("ids[1]"), "{err}");
    let err = b.embedding_forward(&mut emb, &ids, &ids, 3).unwrap_err();
    assert!(matches!(err, Error::Kind { arg: "table", .. }), "{err}");

    let shape = AttnShape {
        tokens: 2,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 3,
        scale: 1.0,
    };
    let mut lse = b.zeros(2, BufKind::Full).unwrap();
    let overlapping = [
        Segment {
            start: 0,
            len: 2,
            ..Default::default()
        },
        Segment {
            start: 1,
            len: 1,
            ..Default::default()
        },
    ];
    let err = b
        .attention_forward(&mut out, &mut lse, &x, &x, &x, &overlapping, shape)
        .unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
    let past_end = [Segment {
        start: 1,
        len: 2,
        ..Default::default()
    }];
    assert!(b
        .attention_forward(&mut out, &mut lse, &x, &x, &x, &past_end, shape)
        .is_err());

    let spec = LmHead {
        tokens: 2,
        dim: 3,
        vocab: 2,
        logit_scale: 1.0,
        chunk_rows: 1,
    };
    let mut lp = b.zeros(2, BufKind::Full).unwrap();
    let mut ent = b.zeros(2, BufKind::Full).unwrap();
    let err = b
        .lm_head_forward(
            &mut lp,
            &mut ent,
            &mut lse,
            &x,
            &x,
            &b.upload_index(&[0, 2]).unwrap(),
            spec,
        )
        .unwrap_err();
    assert!(err.to_string().contains("targets[1]"), "{err}");
    assert!(b.upload(&[1.0], BufKind::Index).is_err());
    assert!(b.download(&ids).is_err());
}

#[test]
fn sample_draws_each_row_with_the_reference_sampler() {
    use floe_backend::sampling::sample_row;
    use floe_backend::SamplingRow;
    let b = B::new();
    let mut rng = Rng::new(9);
    let vocab = 11;
    let logits = rng.vec(3 * vocab);
    let rows: Vec<SamplingRow> = (0..3)
        .map(|i| SamplingRow {
            temperature: [0.0, 0.7, 1.0][i],
            top_k: [0, 5, 0][i],
            top_p: [1.0, 1.0, 0.9][i],
            min_p: 0.0,
            seed: 42 + i as u64,
            offset: 3,
            top_logprobs: 0,
        })
        .collect();
    let got = b.sample(&up(&b, &logits), vocab, &rows).unwrap();
    for (i, row) in rows.iter().enumerate() {
        let z: Vec<f32> = logits[i * vocab..(i + 1) * vocab]
            .iter()
            .map(|&x| x as f32)
            .collect();
        assert_eq!(got[i], sample_row(&z, row), "row {i}");
    }
    assert!(b.sample(&up(&b, &logits), 10, &rows).is_err());
}

#[test]
fn f32_backend_agrees_with_f64() {
    let (b32, b64) = (CpuBackend::<f32>::new(), B::new());
    let mut rng = Rng::new(10);
    let (tokens, dim, vocab) = (9, 24, 300);
    let spec = LmHead {
        tokens,
        dim,
        vocab,
        logit_scale: 1.0,
        chunk_rows: 4,
    };
    let (h, w) = (rng.vec(tokens * dim), rng.vec(vocab * dim));
    let targets: Vec<u32> = (0..tokens).map(|_| rng.below(vocab as u32)).collect();
    fn run<T: floe_backend::cpu::CpuFloat>(
        b: &CpuBackend<T>,
        h: &[f64],
        w: &[f64],
        targets: &[u32],
        spec: LmHead,
    ) -> Vec<f64> {
        let full = |n| b.zeros(n, BufKind::Full).unwrap();
        let (mut lp, mut ent, mut lse) = (full(spec.tokens), full(spec.tokens), full(spec.tokens));
        let up = |x: &[f64]| b.upload_f64(x, BufKind::Compute).unwrap();
        let tg = b.upload_index(targets).unwrap();
        b.lm_head_forward(&mut lp, &mut ent, &mut lse, &up(h), &up(w), &tg, spec)
            .unwrap();
        let mut out = b.download_f64(&lp).unwrap();
        out.extend(b.download_f64(&ent).unwrap());
        out
    }
    let want = run(&b64, &h, &w, &targets, spec);
    let got = run(&b32, &h, &w, &targets, spec);
    assert_close("f32 lm_head", &got, &want, 1e-5);
}
