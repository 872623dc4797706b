//! Every op of the CUDA backend against the CPU reference, forward and backward, on
//! random inputs within bf16 tolerances; then a timing table at Qwen3-0.6B/1.7B shapes.
//!
//! Compiled only with the `cuda` feature. Without a GPU (or driver) each test prints why
//! it skipped and passes, so CI on a CPU machine stays green.
//!
//! Inputs are rounded to bf16 before both backends see them, so the differences measure
//! the GPU's bf16 storage of outputs and intermediates, not of inputs. Every output
//! buffer starts poisoned with NaN: an element the kernel forgot stays NaN and fails.
#![cfg(feature = "cuda")]

use std::time::Instant;

use floe_backend::cpu::CpuBackend;
use floe_backend::cuda::{CudaBackend, CudaBuf};
use floe_backend::sampling::GAMMA;
use floe_backend::{
    AdamW, AttnShape, Backend, BufKind, LmHead, Matmul, NormedHeads, PagedLayout, QueryRun,
    Sampled, SamplingRow, Segment, SharedKeys,
};

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipping: no usable GPU ({e})");
            None
        }
    }
}

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(GAMMA) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// `n` values in `scale * [-1, 1)`, rounded to bf16 so both backends read the same.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| bf16(self.unit() * scale)).collect()
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
}

fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

fn nan(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// Max |Δ| and ‖Δ‖/‖ref‖ (NaN anywhere makes both NaN).
fn errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let (mut max, mut num, mut den) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = f64::from(g) - f64::from(w);
        if d.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        max = max.max(d.abs());
        num += d * d;
        den += f64::from(w) * f64::from(w);
    }
    (max, (num / den.max(1e-30)).sqrt())
}

/// Prints the two errors of `what` and fails when the relative one exceeds `tol`.
fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let (max, rel) = errors(got, want);
    println!(
        "{what:<40} max|Δ| {max:>10.3e}  rel L2 {rel:>10.3e}  (n = {})",
        want.len()
    );
    assert!(
        rel <= tol,
        "{what}: relative L2 error {rel:e} > {tol:e} (max |Δ| {max:e})"
    );
}

const TOL: f64 = 1e-2;

// ---- buffers and elementwise -------------------------------------------------------

#[test]
fn buffers_round_trip_and_convert() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(1);
    let data = rng.vec(1000, 3.0);
    for kind in [BufKind::Compute, BufKind::Full] {
        let b = g.upload(&data, kind).unwrap();
        assert_eq!(g.len(&b), 1000);
        assert_eq!(g.kind(&b), kind);
        assert_eq!(g.download(&b).unwrap(), data, "{kind:?} round trip");
    }
    let full = g
        .upload(&[1.0, 1.0 + 1.0 / 512.0, -3.25], BufKind::Full)
        .unwrap();
    let mut comp = g.upload(&nan(3), BufKind::Compute).unwrap();
    g.copy(&mut comp, &full).unwrap();
    assert_eq!(
        g.download(&comp).unwrap(),
        vec![1.0, 1.0, -3.25],
        "f32 -> bf16 rounds to nearest even"
    );
    let mut back = g.upload(&nan(3), BufKind::Full).unwrap();
    g.copy(&mut back, &comp).unwrap();
    assert_eq!(g.download(&back).unwrap(), vec![1.0, 1.0, -3.25]);

    let mut big = g.upload(&nan(10), BufKind::Full).unwrap();
    g.fill_zero(&mut big).unwrap();
    let part = g.upload(&[5.0, 6.0], BufKind::Full).unwrap();
    g.copy_into(&mut big, 7, &part).unwrap();
    assert_eq!(
        g.download(&big).unwrap(),
        vec![0., 0., 0., 0., 0., 0., 0., 5., 6., 0.]
    );
    assert!(
        g.copy_into(&mut big, 9, &part).is_err(),
        "overrun must be refused"
    );
    let mut piece = g.zeros(3, BufKind::Full).unwrap();
    g.copy_from(&mut piece, &big, 6).unwrap();
    assert_eq!(g.download(&piece).unwrap(), vec![0., 5., 6.]);
    assert!(
        g.copy_from(&mut piece, &big, 8).is_err(),
        "overrun must be refused"
    );
    let mut halves = g.upload(&[1.0, 2.0, 3.0, 4.0], BufKind::Compute).unwrap();
    let source = g.upload(&[9.0, 8.0, 7.0], BufKind::Compute).unwrap();
    g.copy_range(&mut halves, 1, &source, 1, 2).unwrap();
    assert_eq!(g.download(&halves).unwrap(), vec![1., 8., 7., 4.]);
    assert!(
        g.copy_range(&mut halves, 3, &source, 0, 2).is_err(),
        "overrun must be refused"
    );

    let idx = g.upload_index(&[3, 1, 4, 1, 5]).unwrap();
    assert_eq!(g.download_index(&idx).unwrap(), vec![3, 1, 4, 1, 5]);
    let z = g.zeros(0, BufKind::Compute).unwrap();
    assert!(g.download(&z).unwrap().is_empty());
    let (free, total) = g.memory_info().unwrap();
    assert!(free > 0 && free <= total);
    println!("{} ; memory free {free} of {total} bytes", g.name());
}

fn elementwise<B: Backend>(
    b: &B,
    y: &[f32],
    x: &[f32],
    ykind: BufKind,
) -> (Vec<f32>, Vec<f32>, f64) {
    let mut yb = b.upload(y, ykind).unwrap();
    let xb = b.upload(x, BufKind::Compute).unwrap();
    b.add_assign(&mut yb, &xb).unwrap();
    let added = b.download(&yb).unwrap();
    b.scale(&mut yb, -0.75).unwrap();
    let scaled = b.download(&yb).unwrap();
    (added, scaled, b.sum_squares(&xb).unwrap())
}

#[test]
fn add_scale_sum_squares() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(2);
    let (y, x) = (rng.vec(100_003, 2.0), rng.vec(100_003, 2.0));
    for kind in [BufKind::Compute, BufKind::Full] {
        let (ga, gs, gss) = elementwise(&g, &y, &x, kind);
        let (ca, cs, css) = elementwise(&c, &y, &x, kind);
        check(&format!("add_assign ({kind:?} += Compute)"), &ga, &ca, TOL);
        check(&format!("scale ({kind:?})"), &gs, &cs, TOL);
        check("sum_squares", &[gss as f32], &[css as f32], 1e-5);
    }
}

#[test]
fn random_normals_match_the_cpu_stream() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    // Far into the stream (an 8B model's last tensors start past 7·10⁹), both storages.
    let (n, seed, first) = (3_000_017, 7, 7_000_000_123);
    for kind in [BufKind::Full, BufKind::Compute] {
        let mut gb = g.zeros(n, kind).unwrap();
        g.fill_normal(&mut gb, seed, first, 0.02).unwrap();
        let mut cb = c.zeros(n, kind).unwrap();
        c.fill_normal(&mut cb, seed, first, 0.02).unwrap();
        let (got, want) = (g.download(&gb).unwrap(), c.download(&cb).unwrap());
        let want: Vec<f32> = match kind {
            BufKind::Compute => want.iter().map(|&x| bf16(x)).collect(),
            _ => want,
        };
        // CUDA's f64 log and cos may differ from the host's in the last bit, which moves
        // the rounding to f32 (or bf16) of a few elements by one unit.
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs();
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(&a, &b)| ulps(a, b))
            .max()
            .unwrap();
        println!("fill_normal ({kind:?}): {differ} of {n} differ, by at most {worst} ulp");
        assert!(
            worst <= 1 && differ <= 10,
            "{differ} elements differ, up to {worst} ulp"
        );
        let mean = got.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        let var = got.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 1e-4 && (var.sqrt() - 0.02).abs() < 1e-4,
            "{mean} {var}"
        );
    }
}

fn gather_embed<B: Backend>(
    b: &B,
    table: &[f32],
    ids: &[u32],
    dim: usize,
    dout: &[f32],
) -> Vec<Vec<f32>> {
    let t = b.upload(table, BufKind::Compute).unwrap();
    let i = b.upload_index(ids).unwrap();
    let mut out = b.upload(&nan(ids.len() * dim), BufKind::Compute).unwrap();
    b.gather_rows(&mut out, &t, &i, dim).unwrap();
    let gathered = b.download(&out).unwrap();
    let mut out = b.upload(&nan(ids.len() * dim), BufKind::Compute).unwrap();
    b.embedding_forward(&mut out, &t, &i, dim).unwrap();
    let embedded = b.download(&out).unwrap();
    let mut dtable = b.upload(&vec![0.5; table.len()], BufKind::Full).unwrap();
    let d = b.upload(dout, BufKind::Compute).unwrap();
    b.embedding_backward(&mut dtable, &d, &i, dim).unwrap();
    vec![gathered, embedded, b.download(&dtable).unwrap()]
}

#[test]
fn gather_and_embedding() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(3);
    let (vocab, dim, tokens) = (517, 96, 300);
    let table = rng.vec(vocab * dim, 1.0);
    // Repeated ids: the backward sums each id's rows.
    let ids: Vec<u32> = (0..tokens).map(|_| rng.below(40)).collect();
    let dout = rng.vec(tokens * dim, 1.0);
    let gr = gather_embed(&g, &table, &ids, dim, &dout);
    let cr = gather_embed(&c, &table, &ids, dim, &dout);
    for (i, name) in [
        "gather_rows",
        "embedding_forward",
        "embedding_backward (+= into Full)",
    ]
    .iter()
    .enumerate()
    {
        check(name, &gr[i], &cr[i], TOL);
    }
}

/// The reductions that once used float atomics (sum_squares across blocks, column sums of
/// bias and RMSNorm weight gradients, embedding gradients of repeated ids) give bit-identical
/// results on repeated runs, so a GPU run with one seed is reproducible.
#[test]
fn reductions_are_deterministic() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(11);
    let big = rng.vec(3_000_001, 1.0);
    let (rows, cols, dim, tokens) = (4099, 300, 256, 20_000);
    let dy = rng.vec(rows * cols, 1.0);
    let ids: Vec<u32> = (0..tokens).map(|_| rng.below(37)).collect();
    let dout = rng.vec(tokens * dim, 1.0);
    let run = || {
        let x = g.upload(&big, BufKind::Full).unwrap();
        let norm = g.sum_squares(&x).unwrap();
        let dyb = g.upload(&dy, BufKind::Compute).unwrap();
        let mut dbias = g.upload(&vec![0.25; cols], BufKind::Full).unwrap();
        g.add_bias_backward(&mut dbias, &dyb, rows, cols).unwrap();
        let mut dtable = g.upload(&vec![0.5; 40 * dim], BufKind::Full).unwrap();
        let d = g.upload(&dout, BufKind::Compute).unwrap();
        let i = g.upload_index(&ids).unwrap();
        g.embedding_backward(&mut dtable, &d, &i, dim).unwrap();
        (
            norm.to_bits(),
            g.download(&dbias).unwrap(),
            g.download(&dtable).unwrap(),
        )
    };
    let first = run();
    for _ in 0..3 {
        let again = run();
        assert_eq!(first.0, again.0, "sum_squares differs between runs");
        assert!(
            first
                .1
                .iter()
                .zip(&again.1)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "add_bias_backward differs between runs"
        );
        assert!(
            first
                .2
                .iter()
                .zip(&again.2)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "embedding_backward differs between runs"
        );
    }
}

// ---- dense -------------------------------------------------------------------------

fn matmul_case<B: Backend>(
    b: &B,
    a: &[f32],
    bm: &[f32],
    c0: &[f32],
    dims: Matmul,
    ckind: BufKind,
) -> Vec<f32> {
    let ab = b.upload(a, BufKind::Compute).unwrap();
    let bb = b.upload(bm, BufKind::Compute).unwrap();
    let mut cb = b.upload(&nan(dims.m * dims.n), ckind).unwrap();
    b.matmul(&mut cb, &ab, &bb, dims, false).unwrap();
    let fresh = b.download(&cb).unwrap();
    let mut cb = b.upload(c0, ckind).unwrap();
    b.matmul(&mut cb, &ab, &bb, dims, true).unwrap();
    let mut out = fresh;
    out.extend(b.download(&cb).unwrap());
    out
}

#[test]
fn matmul_all_transposes() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(4);
    let (m, n, k) = (67, 129, 250);
    for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
        let dims = Matmul {
            m,
            n,
            k,
            trans_a,
            trans_b,
        };
        let a = rng.vec(m * k, 1.0);
        let bm = rng.vec(k * n, 1.0);
        let c0 = rng.vec(m * n, 4.0);
        for ckind in [BufKind::Compute, BufKind::Full] {
            let gr = matmul_case(&g, &a, &bm, &c0, dims, ckind);
            let cr = matmul_case(&c, &a, &bm, &c0, dims, ckind);
            check(
                &format!("matmul ta={trans_a} tb={trans_b} C={ckind:?} (=, +=)"),
                &gr,
                &cr,
                TOL,
            );
        }
    }
}

fn bias_case<B: Backend>(
    b: &B,
    y: &[f32],
    bias: &[f32],
    rows: usize,
    cols: usize,
) -> Vec<Vec<f32>> {
    let mut yb = b.upload(y, BufKind::Compute).unwrap();
    let bb = b.upload(bias, BufKind::Compute).unwrap();
    b.add_bias(&mut yb, &bb, rows, cols).unwrap();
    let mut db = b.upload(&vec![1.0; cols], BufKind::Full).unwrap();
    let dy = b.upload(y, BufKind::Compute).unwrap();
    b.add_bias_backward(&mut db, &dy, rows, cols).unwrap();
    vec![b.download(&yb).unwrap(), b.download(&db).unwrap()]
}

#[test]
fn bias_forward_backward() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(5);
    let (rows, cols) = (1000, 384);
    let y = rng.vec(rows * cols, 1.0);
    let bias = rng.vec(cols, 1.0);
    let gr = bias_case(&g, &y, &bias, rows, cols);
    let cr = bias_case(&c, &y, &bias, rows, cols);
    check("add_bias", &gr[0], &cr[0], TOL);
    check("add_bias_backward (+= into Full)", &gr[1], &cr[1], TOL);
}

// ---- RMSNorm, RoPE, SwiGLU -------------------------------------------------------------

fn rmsnorm_case<B: Backend>(
    b: &B,
    x: &[f32],
    w: &[f32],
    dout: &[f32],
    rows: usize,
    dim: usize,
) -> Vec<Vec<f32>> {
    let xb = b.upload(x, BufKind::Compute).unwrap();
    let wb = b.upload(w, BufKind::Compute).unwrap();
    let mut out = b.upload(&nan(rows * dim), BufKind::Compute).unwrap();
    let mut rstd = b.upload(&nan(rows), BufKind::Full).unwrap();
    b.rmsnorm_forward(&mut out, &mut rstd, &xb, &wb, rows, dim, 1e-6)
        .unwrap();
    let d = b.upload(dout, BufKind::Compute).unwrap();
    let mut dx = b.upload(&nan(rows * dim), BufKind::Compute).unwrap();
    let mut dw = b.upload(&vec![0.25; dim], BufKind::Full).unwrap();
    b.rmsnorm_backward(&mut dx, &mut dw, &d, &xb, &wb, &rstd, rows, dim)
        .unwrap();
    vec![
        b.download(&out).unwrap(),
        b.download(&rstd).unwrap(),
        b.download(&dx).unwrap(),
        b.download(&dw).unwrap(),
    ]
}

#[test]
fn rmsnorm_forward_backward() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(6);
    for (rows, dim) in [(300, 1024), (2000, 128), (7, 2048)] {
        let x = rng.vec(rows * dim, 2.0);
        let w: Vec<f32> = rng.vec(dim, 0.5).iter().map(|v| bf16(1.0 + v)).collect();
        let dout = rng.vec(rows * dim, 1.0);
        let gr = rmsnorm_case(&g, &x, &w, &dout, rows, dim);
        let cr = rmsnorm_case(&c, &x, &w, &dout, rows, dim);
        for (i, name) in ["out", "rstd", "dx", "dw (+=)"].iter().enumerate() {
            check(&format!("rmsnorm {rows}x{dim} {name}"), &gr[i], &cr[i], TOL);
        }
    }
}

fn rope_case<B: Backend>(
    b: &B,
    x: &[f32],
    pos: &[u32],
    inv: &[f32],
    heads: usize,
    hd: usize,
) -> Vec<Vec<f32>> {
    let p = b.upload_index(pos).unwrap();
    let f = b.upload(inv, BufKind::Full).unwrap();
    let mut xb = b.upload(x, BufKind::Compute).unwrap();
    b.rope(&mut xb, &p, &f, pos.len(), heads, hd, false)
        .unwrap();
    let fwd = b.download(&xb).unwrap();
    b.rope(&mut xb, &p, &f, pos.len(), heads, hd, true).unwrap();
    vec![fwd, b.download(&xb).unwrap()]
}

#[test]
fn rope_forward_inverse() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(7);
    // The model's head size and a small odd-half one.
    for (tokens, heads, hd) in [(200, 6, 128), (50, 3, 12)] {
        let x = rng.vec(tokens * heads * hd, 1.0);
        let pos: Vec<u32> = (0..tokens).map(|_| rng.below(4096)).collect();
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1e6f32.powf(-2.0 * i as f32 / hd as f32))
            .collect();
        let gr = rope_case(&g, &x, &pos, &inv, heads, hd);
        let cr = rope_case(&c, &x, &pos, &inv, heads, hd);
        check(&format!("rope d={hd} forward"), &gr[0], &cr[0], TOL);
        check(
            &format!("rope d={hd} inverse (backward)"),
            &gr[1],
            &cr[1],
            TOL,
        );
        check(
            &format!("rope d={hd} inverse of forward = identity"),
            &gr[1],
            &x,
            TOL,
        );
    }
}

fn qk_norm_rope_case<B: Backend>(
    b: &B,
    raw: [&[f32]; 2],
    norm: [&[f32]; 2],
    heads: [usize; 2],
    pos: &[u32],
    inv: &[f32],
    hd: usize,
) -> Vec<Vec<f32>> {
    let t = pos.len();
    let p = b.upload_index(pos).unwrap();
    let f = b.upload(inv, BufKind::Full).unwrap();
    let up = |x: &[f32], kind| b.upload(x, kind).unwrap();
    let (raw_q, raw_k) = (up(raw[0], BufKind::Compute), up(raw[1], BufKind::Compute));
    let (w_q, w_k) = (up(norm[0], BufKind::Compute), up(norm[1], BufKind::Compute));
    let mut out_q = up(&nan(t * heads[0] * hd), BufKind::Compute);
    let mut out_k = up(&nan(t * heads[1] * hd), BufKind::Compute);
    let mut rstd_q = up(&nan(t * heads[0]), BufKind::Full);
    let mut rstd_k = up(&nan(t * heads[1]), BufKind::Full);
    let q = NormedHeads {
        out: &mut out_q,
        rstd: &mut rstd_q,
        raw: &raw_q,
        norm: &w_q,
        heads: heads[0],
    };
    let k = NormedHeads {
        out: &mut out_k,
        rstd: &mut rstd_k,
        raw: &raw_k,
        norm: &w_k,
        heads: heads[1],
    };
    b.qk_norm_rope(q, k, &p, &f, t, hd, 1e-6).unwrap();
    [&out_q, &rstd_q, &out_k, &rstd_k]
        .iter()
        .map(|x| b.download(x).unwrap())
        .collect()
}

#[test]
fn qk_norm_rope_fuses_norm_and_rope() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(17);
    // Qwen3-1.7B's heads (16 q, 8 kv of 128), 32B's grouping at a few tokens, and d=64.
    for (tokens, hq, hkv, hd) in [(130, 16, 8, 128), (3, 64, 8, 128), (40, 4, 2, 64)] {
        let raw_q = rng.vec(tokens * hq * hd, 2.0);
        let raw_k = rng.vec(tokens * hkv * hd, 2.0);
        let w = |rng: &mut Rng| -> Vec<f32> {
            rng.vec(hd, 0.5).iter().map(|v| bf16(1.0 + v)).collect()
        };
        let (w_q, w_k) = (w(&mut rng), w(&mut rng));
        let pos: Vec<u32> = (0..tokens).map(|_| rng.below(32768)).collect();
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1e6f32.powf(-2.0 * i as f32 / hd as f32))
            .collect();
        let (raw, norm) = ([&raw_q[..], &raw_k], [&w_q[..], &w_k]);
        let gr = qk_norm_rope_case(&g, raw, norm, [hq, hkv], &pos, &inv, hd);
        let cr = qk_norm_rope_case(&c, raw, norm, [hq, hkv], &pos, &inv, hd);
        for (i, name) in ["q", "q rstd", "k", "k rstd"].iter().enumerate() {
            check(
                &format!("qk_norm_rope {tokens}x({hq}+{hkv})x{hd} {name}"),
                &gr[i],
                &cr[i],
                TOL,
            );
        }
    }
}

fn swiglu_case<B: Backend>(b: &B, gate: &[f32], up: &[f32], dout: &[f32]) -> Vec<Vec<f32>> {
    let n = gate.len();
    let gb = b.upload(gate, BufKind::Compute).unwrap();
    let ub = b.upload(up, BufKind::Compute).unwrap();
    let db = b.upload(dout, BufKind::Compute).unwrap();
    let mut out = b.upload(&nan(n), BufKind::Compute).unwrap();
    b.swiglu_forward(&mut out, &gb, &ub).unwrap();
    let mut dg = b.upload(&nan(n), BufKind::Compute).unwrap();
    let mut du = b.upload(&nan(n), BufKind::Compute).unwrap();
    b.swiglu_backward(&mut dg, &mut du, &db, &gb, &ub).unwrap();
    vec![
        b.download(&out).unwrap(),
        b.download(&dg).unwrap(),
        b.download(&du).unwrap(),
    ]
}

#[test]
fn swiglu_forward_backward() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(8);
    // One size a multiple of 8, one not.
    for n in [131_072, 123_457] {
        let (gate, up, dout) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let gr = swiglu_case(&g, &gate, &up, &dout);
        let cr = swiglu_case(&c, &gate, &up, &dout);
        for (i, name) in ["forward", "dgate", "dup"].iter().enumerate() {
            check(&format!("swiglu n={n} {name}"), &gr[i], &cr[i], TOL);
        }
    }
}

// ---- attention -------------------------------------------------------------------------

struct AttnInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
}

fn attention_case<B: Backend>(
    b: &B,
    x: &AttnInputs,
    segs: &[Segment],
    shape: AttnShape,
) -> Vec<Vec<f32>> {
    let (t, hq, hk, d) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
    let q = b.upload(&x.q, BufKind::Compute).unwrap();
    let k = b.upload(&x.k, BufKind::Compute).unwrap();
    let v = b.upload(&x.v, BufKind::Compute).unwrap();
    // The test's segments cover every token, so every output element must be written.
    let mut out = b.upload(&nan(t * hq * d), BufKind::Compute).unwrap();
    let mut lse = b.upload(&nan(t * hq), BufKind::Full).unwrap();
    b.attention_forward(&mut out, &mut lse, &q, &k, &v, segs, shape)
        .unwrap();
    let dout = b.upload(&x.dout, BufKind::Compute).unwrap();
    let mut dq = b.upload(&nan(t * hq * d), BufKind::Compute).unwrap();
    let mut dk = b.upload(&nan(t * hk * d), BufKind::Compute).unwrap();
    let mut dv = b.upload(&nan(t * hk * d), BufKind::Compute).unwrap();
    b.attention_backward(
        &mut dq, &mut dk, &mut dv, &dout, &out, &lse, &q, &k, &v, segs, shape,
    )
    .unwrap();
    vec![
        b.download(&out).unwrap(),
        b.download(&lse).unwrap(),
        b.download(&dq).unwrap(),
        b.download(&dk).unwrap(),
        b.download(&dv).unwrap(),
    ]
}

/// Two prompts shared by response segments (prompt sharing), plus a plain sequence; lengths
/// chosen to straddle tile boundaries.
fn packed_segments() -> (Vec<Segment>, usize) {
    let mut segs = Vec::new();
    let mut at = 0u32;
    let mut push = |len: u32, prefix: Option<(u32, u32)>, segs: &mut Vec<Segment>| {
        let (prefix_start, prefix_len) = prefix.unwrap_or((0, 0));
        segs.push(Segment {
            start: at,
            len,
            prefix_start,
            prefix_len,
        });
        at += len;
        (at - len, len)
    };
    let p1 = push(45, None, &mut segs);
    for len in [33, 7, 64] {
        push(len, Some(p1), &mut segs);
    }
    push(70, None, &mut segs);
    let p2 = push(31, None, &mut segs);
    for len in [1, 40] {
        push(len, Some(p2), &mut segs);
    }
    (segs, at as usize)
}

/// Segments spanning several 64-row tiles: a 130-token prompt shared by a 200-token
/// response, then a plain 150-token sequence.
fn long_segments() -> (Vec<Segment>, usize) {
    let segs = vec![
        Segment {
            start: 0,
            len: 130,
            prefix_start: 0,
            prefix_len: 0,
        },
        Segment {
            start: 130,
            len: 200,
            prefix_start: 0,
            prefix_len: 130,
        },
        Segment {
            start: 330,
            len: 150,
            prefix_start: 0,
            prefix_len: 0,
        },
    ];
    (segs, 480)
}

#[test]
fn attention_forward_backward() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(9);
    let cases = [
        (
            packed_segments(),
            [(4, 2, 128), (4, 4, 64), (6, 1, 128), (2, 1, 32)].as_slice(),
        ),
        (long_segments(), [(4, 2, 128), (2, 1, 64)].as_slice()),
    ];
    for ((segs, tokens), shapes) in cases {
        for &(hq, hk, d) in shapes {
            let shape = AttnShape {
                tokens,
                q_heads: hq,
                kv_heads: hk,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let x = AttnInputs {
                q: rng.vec(tokens * hq * d, 2.0),
                k: rng.vec(tokens * hk * d, 2.0),
                v: rng.vec(tokens * hk * d, 1.0),
                dout: rng.vec(tokens * hq * d, 1.0),
            };
            let gr = attention_case(&g, &x, &segs, shape);
            let cr = attention_case(&c, &x, &segs, shape);
            for (i, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
                check(
                    &format!("attention T={tokens} {hq}q/{hk}kv d={d} {name}"),
                    &gr[i],
                    &cr[i],
                    TOL,
                );
            }
        }
    }
}

/// A paged-attention problem: tokens written to the cache, then queries reading it.
struct Paged {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    slots: Vec<u32>,
    cache_rows: usize,
    tables: Vec<u32>,
    seq: Vec<u32>,
    pos: Vec<u32>,
    /// Prefill chunks among the queries (the CUDA backend takes the long ones on the
    /// tensor cores; the CPU ignores them).
    runs: Vec<QueryRun>,
    /// Decodes whose sequences share leading blocks (the CUDA backend reads those keys
    /// once per group; the CPU ignores them).
    shared: Vec<SharedKeys>,
    max_blocks: usize,
    block_size: usize,
    shape: AttnShape,
}

fn paged_case<B: Backend>(b: &B, x: &Paged) -> Vec<Vec<f32>> {
    let shape = x.shape;
    let row = shape.kv_heads * shape.head_dim;
    let mut kc = b
        .upload(&vec![0.0; x.cache_rows * row], BufKind::Compute)
        .unwrap();
    let mut vc = b
        .upload(&vec![0.0; x.cache_rows * row], BufKind::Compute)
        .unwrap();
    let kb = b.upload(&x.k, BufKind::Compute).unwrap();
    let vb = b.upload(&x.v, BufKind::Compute).unwrap();
    let sb = b.upload_index(&x.slots).unwrap();
    b.kv_cache_write(
        &mut kc,
        &mut vc,
        &kb,
        &vb,
        &sb,
        shape.kv_heads,
        shape.head_dim,
    )
    .unwrap();
    let qb = b.upload(&x.q, BufKind::Compute).unwrap();
    let bt = b.upload_index(&x.tables).unwrap();
    let ts = b.upload_index(&x.seq).unwrap();
    let tp = b.upload_index(&x.pos).unwrap();
    let layout = PagedLayout {
        block_tables: &bt,
        max_blocks: x.max_blocks,
        block_size: x.block_size,
        token_seq: &ts,
        token_pos: &tp,
        max_context: *x.pos.iter().max().unwrap() as usize + 1,
        runs: &x.runs,
        shared: &x.shared,
    };
    let mut out = b.upload(&nan(x.q.len()), BufKind::Compute).unwrap();
    b.paged_attention(&mut out, &qb, &kc, &vc, &layout, shape)
        .unwrap();
    vec![
        b.download(&kc).unwrap(),
        b.download(&vc).unwrap(),
        b.download(&out).unwrap(),
    ]
}

#[test]
fn kv_cache_and_paged_attention() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(10);
    // (q heads, kv heads, head_dim, sequence lengths): groups of 1, 2, 4, 5, 8 and 16 query
    // heads (16 takes two warps); contexts that split (520, 2000 keys) and that do not.
    let cases: [(usize, usize, usize, &[u32]); 7] = [
        (8, 2, 128, &[300, 37, 520]),
        (16, 8, 128, &[100, 200]),
        (8, 1, 64, &[300, 37, 520]),
        (10, 2, 32, &[2000, 5]),
        (4, 4, 64, &[77, 256, 257]),
        (16, 4, 128, &[1500]),
        (16, 1, 128, &[600, 33]),
    ];
    for (hq, hk, d, lens) in cases {
        let block_size = 16;
        let max_blocks = lens
            .iter()
            .map(|&l| l as usize)
            .max()
            .unwrap()
            .div_ceil(block_size);
        let n_blocks: usize = lens
            .iter()
            .map(|&l| (l as usize).div_ceil(block_size))
            .sum();
        // Blocks handed out in reverse, so a sequence's blocks are not contiguous.
        let mut free: Vec<u32> = (0..n_blocks as u32).rev().collect();
        let mut tables = vec![0u32; lens.len() * max_blocks];
        let (mut slots, mut seq, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        for (s, &len) in lens.iter().enumerate() {
            for blk in 0..(len as usize).div_ceil(block_size) {
                tables[s * max_blocks + blk] = free.pop().unwrap();
            }
            for p in 0..len {
                let blk = tables[s * max_blocks + p as usize / block_size];
                slots.push(blk * block_size as u32 + p % block_size as u32);
            }
        }
        let t_kv = slots.len();
        // One query per sequence at its last position (decoding) plus a few mid-sequence,
        // then a prefill chunk of each sequence from a third of its length: up to 130
        // tokens, a run the CUDA backend takes on the tensor cores when it has 16 or more
        // (tiles of 64 and a partial one), with the warp kernel's tokens listed.
        for (s, &len) in lens.iter().enumerate() {
            for p in [len - 1, len / 2, 0] {
                seq.push(s as u32);
                pos.push(p);
            }
        }
        let mut runs = Vec::new();
        for (s, &len) in lens.iter().enumerate() {
            let (lo, hi) = (len / 3, (len / 3 + 130).min(len));
            runs.push(QueryRun {
                first: seq.len() as u32,
                len: hi - lo,
            });
            for p in lo..hi {
                seq.push(s as u32);
                pos.push(p);
            }
        }
        let shape = AttnShape {
            tokens: seq.len(),
            q_heads: hq,
            kv_heads: hk,
            head_dim: d,
            scale: 0.088,
        };
        let k = rng.vec(t_kv * hk * d, 2.0);
        let v = rng.vec(t_kv * hk * d, 1.0);
        let q = rng.vec(seq.len() * hq * d, 2.0);
        let problem = Paged {
            q,
            k,
            v,
            slots,
            cache_rows: n_blocks * block_size,
            tables,
            seq,
            pos,
            runs,
            shared: Vec::new(),
            max_blocks,
            block_size,
            shape,
        };
        let gr = paged_case(&g, &problem);
        let cr = paged_case(&c, &problem);
        let what = format!("{hq}q/{hk}kv d{d} lens {lens:?}");
        check(&format!("kv_cache_write k {what}"), &gr[0], &cr[0], TOL);
        check(&format!("kv_cache_write v {what}"), &gr[1], &cr[1], TOL);
        check(&format!("paged_attention {what}"), &gr[2], &cr[2], TOL);
    }
}

#[test]
fn cascade_attention_over_shared_prompt_blocks() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(11);
    let block_size = 16usize;
    // (q heads, kv heads, head_dim, prompts as (length, samples)): groups of 2, 4 and 8
    // query heads; 9 samples x 8 heads take two row tiles; the 300-token prompt (288 shared
    // keys) is just above the cascade's minimum, the 100-token one below it.
    type Case = (usize, usize, usize, &'static [(u32, u32)]);
    let cases: [Case; 4] = [
        (16, 8, 128, &[(700, 5), (300, 3)]),
        (32, 8, 128, &[(1100, 16), (100, 2)]),
        (64, 8, 128, &[(520, 9)]),
        (8, 2, 64, &[(2000, 4), (700, 2)]),
    ];
    for (hq, hk, d, prompts) in cases {
        // Each sample's table: its prompt's whole blocks (shared), then blocks of its own
        // for the prompt's tail and a different number of generated tokens.
        let mut next_block = 0u32;
        let mut seqs: Vec<(Vec<u32>, u32)> = Vec::new(); // (table, length)
        let mut shared = Vec::new();
        for &(len, samples) in prompts {
            let whole = len as usize / block_size;
            let prompt_blocks: Vec<u32> = (next_block..next_block + whole as u32).collect();
            next_block += whole as u32;
            let first = seqs.len() as u32 + 1; // token 0 is an unrelated decode
            for i in 0..samples {
                let total = len + 1 + (i * 37) % 90;
                let mut table = prompt_blocks.clone();
                while table.len() * block_size < total as usize {
                    table.push(next_block);
                    next_block += 1;
                }
                seqs.push((table, total));
            }
            shared.push(SharedKeys {
                first,
                len: samples,
                keys: (whole * block_size) as u32,
            });
        }
        // An unrelated sequence: its decode comes first, a prefill chunk of it last.
        let lone_len = 400u32;
        let lone: Vec<u32> = (0..lone_len.div_ceil(block_size as u32))
            .map(|i| next_block + i)
            .collect();
        next_block += lone.len() as u32;
        seqs.push((lone, lone_len));
        let lone_seq = (seqs.len() - 1) as u32;
        let max_blocks = seqs.iter().map(|(t, _)| t.len()).max().unwrap();
        let mut tables = vec![0u32; seqs.len() * max_blocks];
        for (s, (t, _)) in seqs.iter().enumerate() {
            tables[s * max_blocks..s * max_blocks + t.len()].copy_from_slice(t);
        }
        // Every position of every sequence written once (shared blocks by the first
        // sample that holds them).
        let mut written = std::collections::HashSet::new();
        let mut slots = Vec::new();
        for (t, total) in &seqs {
            for p in 0..*total as usize {
                let slot = t[p / block_size] * block_size as u32 + (p % block_size) as u32;
                if written.insert(slot) {
                    slots.push(slot);
                }
            }
        }
        let (mut seq, mut pos) = (vec![lone_seq], vec![lone_len / 2]);
        for (s, (_, total)) in seqs.iter().enumerate().take(seqs.len() - 1) {
            seq.push(s as u32);
            pos.push(total - 1);
        }
        let run_first = seq.len() as u32;
        for p in 100..140 {
            seq.push(lone_seq);
            pos.push(p);
        }
        let runs = vec![QueryRun {
            first: run_first,
            len: 40,
        }];
        let shape = AttnShape {
            tokens: seq.len(),
            q_heads: hq,
            kv_heads: hk,
            head_dim: d,
            scale: 0.088,
        };
        let problem = Paged {
            q: rng.vec(seq.len() * hq * d, 2.0),
            k: rng.vec(slots.len() * hk * d, 2.0),
            v: rng.vec(slots.len() * hk * d, 1.0),
            slots,
            cache_rows: next_block as usize * block_size,
            tables,
            seq,
            pos,
            runs,
            shared,
            max_blocks,
            block_size,
            shape,
        };
        let cr = paged_case(&c, &problem);
        let gr = paged_case(&g, &problem);
        let what = format!("{hq}q/{hk}kv d{d} prompts {prompts:?}");
        check(&format!("cascade attention {what}"), &gr[2], &cr[2], TOL);
    }
}

// ---- lm-head ---------------------------------------------------------------------------

fn lm_head_case<B: Backend>(
    b: &B,
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    dlp: &[f32],
    dent: &[f32],
    spec: LmHead,
) -> Vec<Vec<f32>> {
    let hb = b.upload(h, BufKind::Compute).unwrap();
    let wb = b.upload(w, BufKind::Compute).unwrap();
    let tb = b.upload_index(targets).unwrap();
    let n = spec.tokens;
    let mut lp = b.upload(&nan(n), BufKind::Full).unwrap();
    let mut ent = b.upload(&nan(n), BufKind::Full).unwrap();
    let mut lse = b.upload(&nan(n), BufKind::Full).unwrap();
    b.lm_head_forward(&mut lp, &mut ent, &mut lse, &hb, &wb, &tb, spec)
        .unwrap();
    let dlpb = b.upload(dlp, BufKind::Full).unwrap();
    let dentb = b.upload(dent, BufKind::Full).unwrap();
    let mut dh = b.upload(&nan(h.len()), BufKind::Compute).unwrap();
    let mut dw = b.upload(&vec![0.5; w.len()], BufKind::Full).unwrap();
    b.lm_head_backward(&mut dh, &mut dw, &dlpb, &dentb, &hb, &wb, &tb, &lse, spec)
        .unwrap();
    vec![
        b.download(&lp).unwrap(),
        b.download(&ent).unwrap(),
        b.download(&lse).unwrap(),
        b.download(&dh).unwrap(),
        b.download(&dw).unwrap(),
    ]
}

#[test]
fn lm_head_forward_backward() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(11);
    let (tokens, dim, vocab) = (150, 256, 5003);
    let spec = LmHead {
        tokens,
        dim,
        vocab,
        logit_scale: 1.0 / 0.7,
        chunk_rows: 64,
    };
    let h = rng.vec(tokens * dim, 1.0);
    let w = rng.vec(vocab * dim, 0.2);
    let targets: Vec<u32> = (0..tokens).map(|_| rng.below(vocab as u32)).collect();
    let dlp = rng.vec(tokens, 1.0);
    let dent = rng.vec(tokens, 0.5);
    let gr = lm_head_case(&g, &h, &w, &targets, &dlp, &dent, spec);
    let cr = lm_head_case(&c, &h, &w, &targets, &dlp, &dent, spec);
    for (i, name) in ["logprobs", "entropy", "lse", "dhidden", "dw (+=)"]
        .iter()
        .enumerate()
    {
        check(&format!("lm_head {name}"), &gr[i], &cr[i], TOL);
    }
}

// ---- sampling --------------------------------------------------------------------------

#[test]
fn sampling_matches_reference() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(12);
    let vocab = 151_936;
    let settings = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 50, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (0.8, 20, 0.95, 0.05),
        (1.2, 0, 1.0, 0.1),
        (1.0, 1, 1.0, 0.0),
        (0.6, 0, 0.5, 0.0),
        // Hot enough that the noise floor holds most of the mass: the draw lands
        // anywhere in the vocabulary, not only on the peaks.
        (4.0, 0, 1.0, 0.0),
    ];
    let mut rows = Vec::new();
    for rep in 0..8u64 {
        for (i, &(temperature, top_k, top_p, min_p)) in settings.iter().enumerate() {
            rows.push(SamplingRow {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: 1000 + i as u64,
                offset: rep,
                top_logprobs: 0,
            });
        }
    }
    // Peaked logits (a few large values over a bf16 noise floor) like a real model's.
    let mut logits = Vec::with_capacity(rows.len() * vocab);
    for _ in 0..rows.len() {
        let mut row = rng.vec(vocab, 3.0);
        for _ in 0..30 {
            let i = rng.below(vocab as u32) as usize;
            row[i] = bf16(8.0 + 6.0 * rng.unit());
        }
        logits.extend(row);
    }
    for kind in [BufKind::Compute, BufKind::Full] {
        let gl = g.upload(&logits, kind).unwrap();
        let cl = c.upload(&logits, kind).unwrap();
        let gs = g.sample(&gl, vocab, &rows).unwrap();
        let cs = c.sample(&cl, vocab, &rows).unwrap();
        let same = gs
            .iter()
            .zip(&cs)
            .filter(|(a, b)| a.token == b.token)
            .count();
        let glp: Vec<f32> = gs.iter().map(|s| s.logprob).collect();
        let clp: Vec<f32> = cs.iter().map(|s| s.logprob).collect();
        println!(
            "sample ({kind:?} logits): {same}/{} tokens identical",
            rows.len()
        );
        for (i, (a, b)) in gs.iter().zip(&cs).enumerate() {
            if a.token != b.token {
                println!("  row {i} {:?}: gpu {a:?} cpu {b:?}", rows[i]);
            }
        }
        assert_eq!(same, rows.len(), "every draw must match the reference");
        check(&format!("sample logprob ({kind:?})"), &glp, &clp, 1e-5);
    }
    // Every other row asks for its most likely tokens (`/v1` top_logprobs): the draws
    // stay, and the alternatives are the reference's (the same host code over the
    // downloaded row; the drawn token's entry carries the kernel's log-prob).
    let asking: Vec<SamplingRow> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| SamplingRow {
            top_logprobs: if i % 2 == 1 { 1 + i % 20 } else { 0 },
            ..*row
        })
        .collect();
    let gl = g.upload(&logits, BufKind::Compute).unwrap();
    let plain = g.sample(&gl, vocab, &rows).unwrap();
    let gs = g.sample(&gl, vocab, &asking).unwrap();
    let cs = c
        .sample(
            &c.upload(&logits, BufKind::Compute).unwrap(),
            vocab,
            &asking,
        )
        .unwrap();
    for (i, ((a, b), p)) in gs.iter().zip(&cs).zip(&plain).enumerate() {
        assert_eq!(
            (a.token, a.logprob),
            (p.token, p.logprob),
            "row {i}: asking changed the draw"
        );
        assert_eq!(a.top_logprobs.len(), asking[i].top_logprobs, "row {i}");
        let ids = |s: &Sampled| s.top_logprobs.iter().map(|&(t, _)| t).collect::<Vec<_>>();
        assert_eq!(ids(a), ids(b), "row {i}: top tokens");
        for (&(t, x), &(_, y)) in a.top_logprobs.iter().zip(&b.top_logprobs) {
            assert!((x - y).abs() <= 1e-5, "row {i} token {t}: gpu {x} cpu {y}");
        }
    }
    println!(
        "sample top_logprobs: {} rows asking, same tokens as the CPU",
        rows.len() / 2
    );
}

// ---- optimizer -------------------------------------------------------------------------

fn adamw_case<B: Backend>(b: &B, p: &[f32], grads: &[Vec<f32>], hp: AdamW) -> Vec<Vec<f32>> {
    let n = p.len();
    let mut pb = b.upload(p, BufKind::Full).unwrap();
    let mut m = b.zeros(n, BufKind::Full).unwrap();
    let mut v = b.zeros(n, BufKind::Full).unwrap();
    let mut compute = b.upload(&nan(n), BufKind::Compute).unwrap();
    for (step, g) in grads.iter().enumerate() {
        let gb = b.upload(g, BufKind::Full).unwrap();
        let hp = AdamW {
            step: step as u64 + 1,
            ..hp
        };
        b.adamw(&mut pb, &gb, &mut m, &mut v, Some(&mut compute), hp)
            .unwrap();
    }
    vec![
        b.download(&pb).unwrap(),
        b.download(&m).unwrap(),
        b.download(&v).unwrap(),
        b.download(&compute).unwrap(),
    ]
}

#[test]
fn adamw_steps() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(13);
    let n = 100_000;
    let p = rng.vec(n, 1.0);
    let grads: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(n, 0.01)).collect();
    let hp = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
        grad_scale: 0.5,
    };
    let gr = adamw_case(&g, &p, &grads, hp);
    let cr = adamw_case(&c, &p, &grads, hp);
    // f32 math on both sides: far tighter than the bf16 tolerance.
    check("adamw param (Full)", &gr[0], &cr[0], 1e-6);
    check("adamw m", &gr[1], &cr[1], 1e-5);
    check("adamw v", &gr[2], &cr[2], 1e-5);
    check("adamw compute copy (bf16)", &gr[3], &cr[3], TOL);
}

/// `adamw_host`'s steps: the master weights, moments and the weights it wrote on the device.
fn adamw_host_case<B: Backend>(
    b: &B,
    p: &[f32],
    grads: &[Vec<f32>],
    hp: AdamW,
    kind: BufKind,
) -> Vec<Vec<f32>> {
    let n = p.len();
    let mut master = p.to_vec();
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let mut weights = b.upload(&nan(n), kind).unwrap();
    for (step, g) in grads.iter().enumerate() {
        let gb = b.upload(g, BufKind::Full).unwrap();
        let hp = AdamW {
            step: step as u64 + 1,
            ..hp
        };
        b.adamw_host(&mut weights, &gb, &mut master, &mut m, &mut v, hp)
            .unwrap();
    }
    vec![master, m, v, b.download(&weights).unwrap()]
}

#[test]
fn adamw_host_steps_as_the_kernel_does() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::<f32>::new();
    let mut rng = Rng::new(15);
    // Three chunks of the host stream, the last one partial.
    let n = (8 << 20) * 2 + 12_345;
    let p = rng.vec(n, 1.0);
    let grads: Vec<Vec<f32>> = (0..2).map(|_| rng.vec(n, 0.01)).collect();
    let hp = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
        grad_scale: 0.5,
    };
    let kernel = adamw_case(&g, &p, &grads, hp);
    let streamed = adamw_host_case(&g, &p, &grads, hp, BufKind::Compute);
    check(
        "adamw_host master vs kernel",
        &streamed[0],
        &kernel[0],
        1e-6,
    );
    check("adamw_host m vs kernel", &streamed[1], &kernel[1], 1e-5);
    check("adamw_host v vs kernel", &streamed[2], &kernel[2], 1e-5);
    check("adamw_host bf16 weights", &streamed[3], &kernel[3], 1e-4);
    // A Full parameter (a LoRA adapter's master on the device) and the CPU backend.
    let small = 1000;
    let full = adamw_host_case(
        &g,
        &p[..small],
        &[grads[0][..small].to_vec()],
        hp,
        BufKind::Full,
    );
    let cpu = adamw_host_case(
        &c,
        &p[..small],
        &[grads[0][..small].to_vec()],
        hp,
        BufKind::Full,
    );
    check("adamw_host Full weights = master", &full[3], &full[0], 0.0);
    check("adamw_host cuda vs cpu", &full[0], &cpu[0], 1e-6);
}

// ---- timing ----------------------------------------------------------------------------

/// Median seconds of `f` over `reps` runs after two warm-ups (synchronised around each).
fn time(g: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    g.synchronize().unwrap();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f();
        g.synchronize().unwrap();
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Random bf16 operands of a layer projection `C[m×n] = A[m×k]·W[n×k]ᵀ`: A, W, C and
/// the GEMM's dims.
fn projection(
    g: &CudaBackend,
    rng: &mut Rng,
    (m, n, k): (usize, usize, usize),
) -> (CudaBuf, CudaBuf, CudaBuf, Matmul) {
    let a = g.upload(&rng.vec(m * k, 1.0), BufKind::Compute).unwrap();
    let w = g.upload(&rng.vec(n * k, 1.0), BufKind::Compute).unwrap();
    let c = g.zeros(m * n, BufKind::Compute).unwrap();
    let dims = Matmul {
        m,
        n,
        k,
        trans_a: false,
        trans_b: true,
    };
    (a, w, c, dims)
}

/// Times a layer projection on random operands ([`projection`]): the median seconds a
/// call, and A and C for the weight-gradient timing.
fn time_projection(
    g: &CudaBackend,
    rng: &mut Rng,
    shape: (usize, usize, usize),
    reps: usize,
) -> (f64, CudaBuf, CudaBuf) {
    let (a, w, mut c, dims) = projection(g, rng, shape);
    let s = time(g, reps, || g.matmul(&mut c, &a, &w, dims, false).unwrap());
    (s, a, c)
}

/// Decode GEMMs: the Qwen3-1.7B layer's projections as a decode step runs them (one GEMM
/// each, M = the step's tokens), 50 back to back as a step issues them, against the
/// weight bytes they must read. `FLOE_GEMM` picks the path (cuBLAS by default, `lt`,
/// `lt-tuned`); `dev/decode_gemm_torch.py` times torch on the same shapes. Run with
/// `--ignored` on a GPU machine.
#[test]
#[ignore]
fn decode_gemm_table() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(31);
    let reps = 50;
    for m in [64usize, 128, 256] {
        for (name, n, k) in [
            ("q", 2048, 2048),
            ("k or v", 1024, 2048),
            ("o", 2048, 2048),
            ("gate or up", 6144, 2048),
            ("down", 2048, 6144),
        ] {
            let (a, w, mut c, dims) = projection(&g, &mut rng, (m, n, k));
            let s = time(&g, 5, || {
                for _ in 0..reps {
                    g.matmul(&mut c, &a, &w, dims, false).unwrap();
                }
            }) / reps as f64;
            println!(
                "{:<44} {:>10.4} ms {:>8.1} GB/s {:>6.1} TFLOP/s",
                format!("decode gemm {name} [{m}x{k}]·[{n}x{k}]ᵀ"),
                s * 1e3,
                (2 * n * k) as f64 / s / 1e9,
                2.0 * (m * n * k) as f64 / s / 1e12
            );
        }
    }
}

/// Timing table at Qwen3-0.6B/1.7B shapes: T = 8 × 2048 packed tokens, 16 q / 8 kv heads
/// of 128. Run with `--ignored` on a GPU machine.
#[test]
#[ignore]
fn timing_table() {
    let Some(g) = gpu() else { return };
    g.warm_up().unwrap();
    let mut rng = Rng::new(14);
    let tokens = 8 * 2048;
    let (hq, hk, d) = (16, 8, 128);
    let rand = |rng: &mut Rng, n: usize, kind| g.upload(&rng.vec(n, 1.0), kind).unwrap();
    println!("\n{:<44} {:>10} {:>12}", "op (shape)", "ms", "rate");
    for hidden in [1024usize, 2048] {
        let inter = 3 * hidden;
        // GEMMs of one layer: qkv, o, gate+up, down (forward), in bf16 with f32 accumulate.
        for (name, n, k) in [
            ("qkv proj", (hq + 2 * hk) * d, hidden),
            ("o proj", hidden, hq * d),
            ("gate+up proj", 2 * inter, hidden),
            ("down proj", hidden, inter),
        ] {
            let (s, a, c) = time_projection(&g, &mut rng, (tokens, n, k), 20);
            let flops = 2.0 * (tokens * n * k) as f64;
            println!(
                "{:<44} {:>10.3} {:>8.1} TFLOP/s",
                format!("matmul {name} h={hidden} [{tokens}x{k}]·[{n}x{k}]ᵀ"),
                s * 1e3,
                flops / s / 1e12
            );
            // The weight gradient: dW (Full, +=) = dYᵀ · X.
            let mut dw = g.zeros(n * k, BufKind::Full).unwrap();
            let dims = Matmul {
                m: n,
                n: k,
                k: tokens,
                trans_a: true,
                trans_b: false,
            };
            let s = time(&g, 20, || g.matmul(&mut dw, &c, &a, dims, true).unwrap());
            println!(
                "{:<44} {:>10.3} {:>8.1} TFLOP/s",
                format!("  dW += dYᵀX (f32 out) {name}"),
                s * 1e3,
                flops / s / 1e12
            );
        }
        // RMSNorm over the hidden size.
        let x = rand(&mut rng, tokens * hidden, BufKind::Compute);
        let w = rand(&mut rng, hidden, BufKind::Compute);
        let mut out = g.zeros(tokens * hidden, BufKind::Compute).unwrap();
        let mut rstd = g.zeros(tokens, BufKind::Full).unwrap();
        let s = time(&g, 50, || {
            g.rmsnorm_forward(&mut out, &mut rstd, &x, &w, tokens, hidden, 1e-6)
                .unwrap()
        });
        let bytes = (2 * tokens * hidden * 2) as f64;
        println!(
            "{:<44} {:>10.3} {:>8.1} GB/s",
            format!("rmsnorm fwd h={hidden}"),
            s * 1e3,
            bytes / s / 1e9
        );
        let mut dx = g.zeros(tokens * hidden, BufKind::Compute).unwrap();
        let mut dw = g.zeros(hidden, BufKind::Full).unwrap();
        let s = time(&g, 50, || {
            g.rmsnorm_backward(&mut dx, &mut dw, &out, &x, &w, &rstd, tokens, hidden)
                .unwrap()
        });
        let bytes = (3 * tokens * hidden * 2) as f64;
        println!(
            "{:<44} {:>10.3} {:>8.1} GB/s",
            format!("rmsnorm bwd h={hidden}"),
            s * 1e3,
            bytes / s / 1e9
        );
        // SwiGLU over the intermediate size.
        let gate = rand(&mut rng, tokens * inter, BufKind::Compute);
        let up = rand(&mut rng, tokens * inter, BufKind::Compute);
        let mut o = g.zeros(tokens * inter, BufKind::Compute).unwrap();
        let s = time(&g, 50, || g.swiglu_forward(&mut o, &gate, &up).unwrap());
        let bytes = (3 * tokens * inter * 2) as f64;
        println!(
            "{:<44} {:>10.3} {:>8.1} GB/s",
            format!("swiglu fwd i={inter}"),
            s * 1e3,
            bytes / s / 1e9
        );
        let mut dg = g.zeros(tokens * inter, BufKind::Compute).unwrap();
        let mut du = g.zeros(tokens * inter, BufKind::Compute).unwrap();
        let s = time(&g, 50, || {
            g.swiglu_backward(&mut dg, &mut du, &o, &gate, &up).unwrap()
        });
        let bytes = (5 * tokens * inter * 2) as f64;
        println!(
            "{:<44} {:>10.3} {:>8.1} GB/s",
            format!("swiglu bwd i={inter}"),
            s * 1e3,
            bytes / s / 1e9
        );
    }
    // RoPE on q.
    let mut q = rand(&mut rng, tokens * hq * d, BufKind::Compute);
    let pos = g
        .upload_index(&(0..tokens as u32).map(|t| t % 2048).collect::<Vec<_>>())
        .unwrap();
    let inv = g
        .upload(
            &(0..d / 2)
                .map(|i| 1e6f32.powf(-2.0 * i as f32 / d as f32))
                .collect::<Vec<_>>(),
            BufKind::Full,
        )
        .unwrap();
    let s = time(&g, 50, || {
        g.rope(&mut q, &pos, &inv, tokens, hq, d, false).unwrap()
    });
    let bytes = (2 * tokens * hq * d * 2) as f64;
    println!(
        "{:<44} {:>10.3} {:>8.1} GB/s",
        "rope q (16 heads)",
        s * 1e3,
        bytes / s / 1e9
    );
    // Attention: 8 causal sequences of 2048.
    let segs: Vec<Segment> = (0..8)
        .map(|i| Segment {
            start: i * 2048,
            len: 2048,
            prefix_start: 0,
            prefix_len: 0,
        })
        .collect();
    let shape = AttnShape {
        tokens,
        q_heads: hq,
        kv_heads: hk,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let k = rand(&mut rng, tokens * hk * d, BufKind::Compute);
    let v = rand(&mut rng, tokens * hk * d, BufKind::Compute);
    let mut out = g.zeros(tokens * hq * d, BufKind::Compute).unwrap();
    let mut lse = g.zeros(tokens * hq, BufKind::Full).unwrap();
    let s = time(&g, 5, || {
        g.attention_forward(&mut out, &mut lse, &q, &k, &v, &segs, shape)
            .unwrap()
    });
    // Causal: half of the 2·2·T·L·H·D multiply-adds of full attention.
    let flops = 4.0 * 8.0 * 2048.0 * 2048.0 / 2.0 * (hq * d) as f64;
    println!(
        "{:<44} {:>10.3} {:>8.1} TFLOP/s",
        "attention fwd 8x2048 causal 16q/8kv d128",
        s * 1e3,
        flops / s / 1e12
    );
    let dout = rand(&mut rng, tokens * hq * d, BufKind::Compute);
    let mut dq = g.zeros(tokens * hq * d, BufKind::Compute).unwrap();
    let mut dk = g.zeros(tokens * hk * d, BufKind::Compute).unwrap();
    let mut dv = g.zeros(tokens * hk * d, BufKind::Compute).unwrap();
    let s = time(&g, 3, || {
        g.attention_backward(
            &mut dq, &mut dk, &mut dv, &dout, &out, &lse, &q, &k, &v, &segs, shape,
        )
        .unwrap()
    });
    println!(
        "{:<44} {:>10.3} {:>8.1} TFLOP/s",
        "attention bwd (2.5x fwd flops)",
        s * 1e3,
        2.5 * flops / s / 1e12
    );
    // lm-head forward+backward over 4096 tokens at vocab 151936, hidden 1024.
    let (lt, ld, lv) = (4096, 1024, 151_936);
    let h = rand(&mut rng, lt * ld, BufKind::Compute);
    let w = rand(&mut rng, lv * ld, BufKind::Compute);
    let targets = g
        .upload_index(
            &(0..lt as u32)
                .map(|i| i * 37 % lv as u32)
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let spec = LmHead {
        tokens: lt,
        dim: ld,
        vocab: lv,
        logit_scale: 1.0,
        chunk_rows: 1024,
    };
    let mut lp = g.zeros(lt, BufKind::Full).unwrap();
    let mut ent = g.zeros(lt, BufKind::Full).unwrap();
    let mut lse = g.zeros(lt, BufKind::Full).unwrap();
    let s = time(&g, 5, || {
        g.lm_head_forward(&mut lp, &mut ent, &mut lse, &h, &w, &targets, spec)
            .unwrap()
    });
    let flops = 2.0 * (lt * ld * lv) as f64;
    println!(
        "{:<44} {:>10.3} {:>8.1} TFLOP/s",
        "lm_head fwd 4096 tok, vocab 151936, h1024",
        s * 1e3,
        flops / s / 1e12
    );
    let mut dh = g.zeros(lt * ld, BufKind::Compute).unwrap();
    let mut dw = g.zeros(lv * ld, BufKind::Full).unwrap();
    let s = time(&g, 3, || {
        g.lm_head_backward(&mut dh, &mut dw, &lp, &ent, &h, &w, &targets, &lse, spec)
            .unwrap()
    });
    println!(
        "{:<44} {:>10.3} {:>8.1} TFLOP/s",
        "lm_head bwd (3 GEMMs)",
        s * 1e3,
        3.0 * flops / s / 1e12
    );
    // Sampling 64 rows of the full vocabulary with top-p.
    let logits = rand(&mut rng, 64 * lv, BufKind::Compute);
    let rows: Vec<SamplingRow> = (0..64)
        .map(|i| SamplingRow {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            seed: i,
            offset: 0,
            top_logprobs: 0,
        })
        .collect();
    let s = time(&g, 10, || {
        g.sample(&logits, lv, &rows).unwrap();
    });
    println!(
        "{:<44} {:>10.3}",
        "sample 64 rows top-p 0.95 (with download)",
        s * 1e3
    );
    // Paged decode, one query per sequence at the end of its context: 64 sequences at
    // 2048 keys, 256 at 512 (the generation benchmark's shapes), one at 32768; groups of
    // 2 query heads a kv head (0.6B-1.7B), 4 (4B, 8B) and 8 (32B).
    for (group, seqs, ctx) in [
        (2, 64usize, 2048usize),
        (2, 256, 512),
        (2, 1, 32768),
        (4, 256, 512),
        (8, 256, 512),
        (8, 64, 2048),
    ] {
        let hq = group * hk;
        let bs = 16;
        let mb = ctx / bs;
        let kc = rand(&mut rng, seqs * ctx * hk * d, BufKind::Compute);
        let vc = rand(&mut rng, seqs * ctx * hk * d, BufKind::Compute);
        let tables = g
            .upload_index(&(0..(seqs * mb) as u32).collect::<Vec<_>>())
            .unwrap();
        let ts = g
            .upload_index(&(0..seqs as u32).collect::<Vec<_>>())
            .unwrap();
        let tp = g.upload_index(&vec![ctx as u32 - 1; seqs]).unwrap();
        let qd = rand(&mut rng, seqs * hq * d, BufKind::Compute);
        let mut od = g.zeros(seqs * hq * d, BufKind::Compute).unwrap();
        let layout = PagedLayout {
            block_tables: &tables,
            max_blocks: mb,
            block_size: bs,
            token_seq: &ts,
            token_pos: &tp,
            max_context: ctx,
            runs: &[],
            shared: &[],
        };
        let dshape = AttnShape {
            tokens: seqs,
            q_heads: hq,
            ..shape
        };
        let s = time(&g, 20, || {
            g.paged_attention(&mut od, &qd, &kc, &vc, &layout, dshape)
                .unwrap()
        });
        let bytes = (2 * seqs * ctx * hk * d * 2) as f64;
        println!(
            "{:<44} {:>10.3} {:>8.1} GB/s",
            format!("paged decode {seqs} seq x {ctx} ctx, group {group}"),
            s * 1e3,
            bytes / s / 1e9
        );
    }
    // GRPO-shaped decode: 8 prompts of 4096 keys x 16 samples, 512 keys of each sample's
    // own, group 2; with the prompt's keys read once per group (cascade) and once per
    // sample. GB/s counts the bytes a cascade must read.
    {
        let (group, prompts, samples, prompt, own) = (2usize, 8usize, 16usize, 4096, 512);
        let hq = group * hk;
        let bs = 16;
        let (pb, ob) = (prompt / bs, own / bs);
        let seqs = prompts * samples;
        let mb = pb + ob;
        let blocks = prompts * pb + seqs * ob;
        let kc = rand(&mut rng, blocks * bs * hk * d, BufKind::Compute);
        let vc = rand(&mut rng, blocks * bs * hk * d, BufKind::Compute);
        let mut table = Vec::with_capacity(seqs * mb);
        for s in 0..seqs {
            let p = s / samples;
            table.extend((0..pb).map(|b| (p * pb + b) as u32));
            table.extend((0..ob).map(|b| (prompts * pb + s * ob + b) as u32));
        }
        let tables = g.upload_index(&table).unwrap();
        let ts = g
            .upload_index(&(0..seqs as u32).collect::<Vec<_>>())
            .unwrap();
        let ctx = prompt + own;
        let tp = g.upload_index(&vec![ctx as u32 - 1; seqs]).unwrap();
        let qd = rand(&mut rng, seqs * hq * d, BufKind::Compute);
        let mut od = g.zeros(seqs * hq * d, BufKind::Compute).unwrap();
        let groups: Vec<SharedKeys> = (0..prompts)
            .map(|p| SharedKeys {
                first: (p * samples) as u32,
                len: samples as u32,
                keys: prompt as u32,
            })
            .collect();
        let dshape = AttnShape {
            tokens: seqs,
            q_heads: hq,
            ..shape
        };
        let bytes = (2 * (prompts * prompt + seqs * own) * hk * d * 2) as f64;
        for (what, shared) in [("cascade", groups.as_slice()), ("per sample", &[])] {
            let layout = PagedLayout {
                block_tables: &tables,
                max_blocks: mb,
                block_size: bs,
                token_seq: &ts,
                token_pos: &tp,
                max_context: ctx,
                runs: &[],
                shared,
            };
            let s = time(&g, 20, || {
                g.paged_attention(&mut od, &qd, &kc, &vc, &layout, dshape)
                    .unwrap()
            });
            println!(
                "{:<44} {:>10.3} {:>8.1} GB/s",
                format!("paged decode 8x16 of 4096+512, {what}"),
                s * 1e3,
                bytes / s / 1e9
            );
        }
    }
    // Paged prefill: whole prompts attending causally to themselves through the cache, as
    // one run each (tensor cores) and as single tokens (the warp kernel).
    for (seqs, ctx) in [(8usize, 2048usize), (1, 16384)] {
        let bs = 16;
        let mb = ctx / bs;
        let kc = rand(&mut rng, seqs * ctx * hk * d, BufKind::Compute);
        let vc = rand(&mut rng, seqs * ctx * hk * d, BufKind::Compute);
        let tables = g
            .upload_index(&(0..(seqs * mb) as u32).collect::<Vec<_>>())
            .unwrap();
        let t = seqs * ctx;
        let ts = g
            .upload_index(&(0..t).map(|i| (i / ctx) as u32).collect::<Vec<_>>())
            .unwrap();
        let tp = g
            .upload_index(&(0..t).map(|i| (i % ctx) as u32).collect::<Vec<_>>())
            .unwrap();
        let qp = rand(&mut rng, t * hq * d, BufKind::Compute);
        let mut op = g.zeros(t * hq * d, BufKind::Compute).unwrap();
        let runs: Vec<QueryRun> = (0..seqs)
            .map(|s| QueryRun {
                first: (s * ctx) as u32,
                len: ctx as u32,
            })
            .collect();
        let pshape = AttnShape { tokens: t, ..shape };
        // Causal attention FLOPs: QK and PV over half the square, every head.
        let flops = 4.0 * (seqs * ctx * ctx / 2 * hq * d) as f64;
        for (what, runs) in [("runs", runs.as_slice()), ("tokens", &[])] {
            let layout = PagedLayout {
                block_tables: &tables,
                max_blocks: mb,
                block_size: bs,
                token_seq: &ts,
                token_pos: &tp,
                max_context: ctx,
                runs,
                shared: &[],
            };
            let s = time(&g, 5, || {
                g.paged_attention(&mut op, &qp, &kc, &vc, &layout, pshape)
                    .unwrap()
            });
            println!(
                "{:<44} {:>10.3} {:>8.1} TFLOP/s",
                format!("paged prefill {seqs} x {ctx} as {what}"),
                s * 1e3,
                flops / s / 1e12
            );
        }
    }
}

/// The kernel sources compile for Hopper; needs only NVRTC, not a GPU.
#[test]
fn kernels_compile() {
    match CudaBackend::compile_kernels("sm_90") {
        Ok(modules) => {
            for (name, ptx) in modules {
                println!("{name}: {ptx} bytes of PTX");
            }
        }
        Err(floe_backend::Error::Cuda(msg)) if msg.starts_with("NVRTC not found") => {
            eprintln!("skipping: {msg}")
        }
        Err(e) => panic!("{e}"),
    }
}
