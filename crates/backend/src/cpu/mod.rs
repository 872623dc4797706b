//! The CPU reference backend: every [`Backend`] op in plain loops over slices, rayon over
//! rows and heads, and the `gemm` crate for products.
//!
//! [`CpuBackend<T>`] stores Compute and Full buffers alike as `Vec<T>` (it remembers the
//! kind each was allocated with) and Index buffers as `Vec<u32>`. `T = f32` is the
//! everyday backend; `T = f64` makes uploads and downloads exact, which the
//! finite-difference gradient checks of the backend and the model rely on.
//!
//! Every op checks the kinds of its arguments ([`Error::Kind`]), then their shapes against
//! [`crate::contract`] ([`Error::Shape`]).

mod attention;
mod float;
mod invariant;
mod lm_head;

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

pub use float::CpuFloat;

use crate::contract::{self, Ids, PagedLens};
use crate::host_adamw;
use crate::{
    sampling, AdamW, AttnShape, Backend, BufKind, Error, LmHead, Matmul, PagedLayout, Result,
    Sampled, SamplingRow, Segment,
};

/// A buffer of [`CpuBackend<T>`].
#[derive(Clone, Debug, PartialEq)]
pub enum CpuBuf<T> {
    /// A Compute or Full buffer (same storage on the CPU; the kind is kept for checks).
    Float {
        /// The values.
        data: Vec<T>,
        /// [`BufKind::Compute`] or [`BufKind::Full`].
        kind: BufKind,
    },
    /// An Index buffer.
    Index(Vec<u32>),
}

/// The CPU reference backend, generic over its float (`f32` by default).
#[derive(Debug, Default)]
pub struct CpuBackend<T: CpuFloat = f32> {
    /// See [`Backend::set_batch_invariant`].
    batch_invariant: AtomicBool,
    _float: PhantomData<T>,
}

impl<T: CpuFloat> Clone for CpuBackend<T> {
    fn clone(&self) -> Self {
        Self {
            batch_invariant: AtomicBool::new(self.batch_invariant()),
            _float: PhantomData,
        }
    }
}

impl<T: CpuFloat> CpuBackend<T> {
    /// A backend on rayon's global thread pool.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Elements per rayon task in elementwise ops: large enough that the task overhead is
/// small and the inner loop vectorises, small enough to split a layer's activations.
const ELEMENTWISE_CHUNK: usize = 1 << 13;

/// Elementwise and per-row ops over fewer values than this run on the calling thread.
/// Ops are called from outside rayon's pool, so a parallel one hands its work to the
/// pool and sleeps until it is done: two thread wake-ups, which cost more than a decode
/// step's small ops (a batch of 128 rows of 128) take on one thread.
const PARALLEL_ELEMENTS: usize = 1 << 16;

/// Products smaller than this many multiply-adds run on one thread.
const PARALLEL_GEMM_FLOPS: usize = 1 << 18;

/// `c = alpha·op(a)·op(b)`, or `c += alpha·op(a)·op(b)` when `accumulate`, on every thread
/// when the product is large enough; lengths checked by the caller.
pub(crate) fn gemm<T: CpuFloat>(
    c: &mut [T],
    a: &[T],
    b: &[T],
    dims: Matmul,
    accumulate: bool,
    alpha: T,
) {
    let parallel = dims.m * dims.n * dims.k >= PARALLEL_GEMM_FLOPS;
    gemm_on(c, a, b, dims, accumulate, alpha, parallel);
}

/// [`gemm`] on the calling thread only, for products inside an already parallel loop.
pub(crate) fn gemm_serial<T: CpuFloat>(
    c: &mut [T],
    a: &[T],
    b: &[T],
    dims: Matmul,
    accumulate: bool,
    alpha: T,
) {
    gemm_on(c, a, b, dims, accumulate, alpha, false);
}

fn gemm_on<T: CpuFloat>(
    c: &mut [T],
    a: &[T],
    b: &[T],
    dims: Matmul,
    accumulate: bool,
    alpha: T,
    parallel: bool,
) {
    let Matmul {
        m,
        n,
        k,
        trans_a,
        trans_b,
    } = dims;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(T::ZERO);
        }
        return;
    }
    // Row-major strides (row, column) of op(A) [m, k] and op(B) [k, n].
    let (a_rs, a_cs) = if trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if trans_b { (1, k) } else { (n, 1) };
    let parallelism = if parallel {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the caller checked `c.len() == m·n`, `a.len() == m·k` and `b.len() == k·n`,
    // so every offset the strides above produce lies inside its slice; `c` is borrowed
    // mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            T::ONE,
            alpha,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `out[i, :] = x[rows[i], :]`, rows of `dim`; checked by the caller.
fn gather<T: CpuFloat>(out: &mut [T], x: &[T], rows: &[u32], dim: usize) {
    let copy =
        |(o, &r): (&mut [T], &u32)| o.copy_from_slice(&x[r as usize * dim..(r as usize + 1) * dim]);
    if out.len() < PARALLEL_ELEMENTS {
        out.chunks_mut(dim).zip(rows).for_each(copy);
    } else {
        out.par_chunks_mut(dim).zip(rows.par_iter()).for_each(copy);
    }
}

/// `out = silu(gate) · up` elementwise; inlined into a [`float::wide`] call.
#[inline(always)]
fn swiglu_chunk<T: CpuFloat>(out: &mut [T], gate: &[T], up: &[T]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (T::ONE + (-g).exp_vec()) * u;
    }
}

/// The gradients of [`swiglu_chunk`]: silu(g) = g σ(g), silu'(g) = σ(g) (1 + g (1 − σ(g))).
#[inline(always)]
fn swiglu_backward_chunk<T: CpuFloat>(
    dgate: &mut [T],
    dup: &mut [T],
    dout: &[T],
    gate: &[T],
    up: &[T],
) {
    let inputs = dout.iter().zip(gate).zip(up);
    for ((dg, du), ((&d, &g), &u)) in dgate.iter_mut().zip(dup).zip(inputs) {
        let sig = T::ONE / (T::ONE + (-g).exp_vec());
        *du = d * g * sig;
        *dg = d * u * sig * (T::ONE + g * (T::ONE - sig));
    }
}

// ---- argument kinds --------------------------------------------------------------------

fn float_kind<T>(buf: &CpuBuf<T>) -> BufKind {
    match buf {
        CpuBuf::Float { kind, .. } => *kind,
        CpuBuf::Index(_) => BufKind::Index,
    }
}

/// The values of a Compute or Full buffer.
/// `src` is of `dst`'s kind (the copies between buffers).
fn same_kind<T>(op: &'static str, dst: &CpuBuf<T>, src: &CpuBuf<T>) -> Result<()> {
    if float_kind(dst) == float_kind(src) {
        return Ok(());
    }
    Err(Error::Kind {
        op,
        arg: "src",
        expected: float_kind(dst),
        got: float_kind(src),
    })
}

fn floats<'a, T>(op: &'static str, arg: &'static str, buf: &'a CpuBuf<T>) -> Result<&'a [T]> {
    match buf {
        CpuBuf::Float { data, .. } => Ok(data),
        CpuBuf::Index(_) => Err(Error::Kind {
            op,
            arg,
            expected: BufKind::Compute,
            got: BufKind::Index,
        }),
    }
}

fn floats_mut<'a, T>(
    op: &'static str,
    arg: &'static str,
    buf: &'a mut CpuBuf<T>,
) -> Result<&'a mut [T]> {
    match buf {
        CpuBuf::Float { data, .. } => Ok(data),
        CpuBuf::Index(_) => Err(Error::Kind {
            op,
            arg,
            expected: BufKind::Compute,
            got: BufKind::Index,
        }),
    }
}

/// The values of a buffer that must be Full (statistics, master weights, optimizer state).
fn full<'a, T>(op: &'static str, arg: &'static str, buf: &'a CpuBuf<T>) -> Result<&'a [T]> {
    match buf {
        CpuBuf::Float {
            data,
            kind: BufKind::Full,
        } => Ok(data),
        other => Err(Error::Kind {
            op,
            arg,
            expected: BufKind::Full,
            got: float_kind(other),
        }),
    }
}

fn full_mut<'a, T>(
    op: &'static str,
    arg: &'static str,
    buf: &'a mut CpuBuf<T>,
) -> Result<&'a mut [T]> {
    match buf {
        CpuBuf::Float {
            data,
            kind: BufKind::Full,
        } => Ok(data),
        other => Err(Error::Kind {
            op,
            arg,
            expected: BufKind::Full,
            got: float_kind(other),
        }),
    }
}

fn indices<'a, T>(op: &'static str, arg: &'static str, buf: &'a CpuBuf<T>) -> Result<&'a [u32]> {
    match buf {
        CpuBuf::Index(data) => Ok(data),
        other => Err(Error::Kind {
            op,
            arg,
            expected: BufKind::Index,
            got: float_kind(other),
        }),
    }
}

impl<T: CpuFloat> Backend for CpuBackend<T> {
    type Buf = CpuBuf<T>;

    fn name(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            T::NAME,
            rayon::current_num_threads()
        )
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn compute_is_full(&self) -> bool {
        true
    }

    /// The CPU backend keeps no state between ops: a fork is another handle on rayon's
    /// pool (in the same batch-invariant mode), and every op has finished when its call
    /// returns.
    fn fork(&self) -> Result<Self> {
        Ok(self.clone())
    }

    fn wait_for(&self, _other: &Self) -> Result<()> {
        Ok(())
    }

    fn batch_invariant(&self) -> bool {
        self.batch_invariant.load(Ordering::Relaxed)
    }

    fn set_batch_invariant(&self, on: bool) -> Result<()> {
        self.batch_invariant.store(on, Ordering::Relaxed);
        Ok(())
    }

    // ---- buffers -----------------------------------------------------------------------

    fn element_bytes(&self, kind: BufKind) -> usize {
        match kind {
            BufKind::Index => std::mem::size_of::<u32>(),
            BufKind::Compute | BufKind::Full => std::mem::size_of::<T>(),
        }
    }

    fn len(&self, buf: &CpuBuf<T>) -> usize {
        match buf {
            CpuBuf::Float { data, .. } => data.len(),
            CpuBuf::Index(data) => data.len(),
        }
    }

    fn kind(&self, buf: &CpuBuf<T>) -> BufKind {
        float_kind(buf)
    }

    fn zeros(&self, len: usize, kind: BufKind) -> Result<CpuBuf<T>> {
        Ok(match kind {
            BufKind::Index => CpuBuf::Index(vec![0; len]),
            kind => CpuBuf::Float {
                data: vec![T::ZERO; len],
                kind,
            },
        })
    }

    fn upload(&self, data: &[f32], kind: BufKind) -> Result<CpuBuf<T>> {
        if kind == BufKind::Index {
            return Err(Error::Kind {
                op: "upload",
                arg: "kind",
                expected: BufKind::Compute,
                got: kind,
            });
        }
        Ok(CpuBuf::Float {
            data: data.iter().map(|&x| T::from_f32(x)).collect(),
            kind,
        })
    }

    fn upload_f64(&self, data: &[f64], kind: BufKind) -> Result<CpuBuf<T>> {
        if kind == BufKind::Index {
            return Err(Error::Kind {
                op: "upload_f64",
                arg: "kind",
                expected: BufKind::Compute,
                got: kind,
            });
        }
        Ok(CpuBuf::Float {
            data: data.iter().map(|&x| T::from_f64(x)).collect(),
            kind,
        })
    }

    fn upload_index(&self, data: &[u32]) -> Result<CpuBuf<T>> {
        Ok(CpuBuf::Index(data.to_vec()))
    }

    fn write_index(&self, dst: &mut CpuBuf<T>, data: &[u32]) -> Result<()> {
        match dst {
            CpuBuf::Index(v) if v.len() == data.len() => {
                v.copy_from_slice(data);
                Ok(())
            }
            CpuBuf::Index(v) => Err(Error::Shape {
                op: "write_index",
                msg: format!("dst has {} elements, data {}", v.len(), data.len()),
            }),
            _ => Err(Error::Kind {
                op: "write_index",
                arg: "dst",
                expected: BufKind::Index,
                got: float_kind(dst),
            }),
        }
    }

    fn download(&self, buf: &CpuBuf<T>) -> Result<Vec<f32>> {
        Ok(floats("download", "buf", buf)?
            .iter()
            .map(|x| x.to_f32())
            .collect())
    }

    fn download_f64(&self, buf: &CpuBuf<T>) -> Result<Vec<f64>> {
        Ok(floats("download_f64", "buf", buf)?
            .iter()
            .map(|x| x.to_f64())
            .collect())
    }

    fn download_index(&self, buf: &CpuBuf<T>) -> Result<Vec<u32>> {
        Ok(indices("download_index", "buf", buf)?.to_vec())
    }

    fn copy(&self, dst: &mut CpuBuf<T>, src: &CpuBuf<T>) -> Result<()> {
        const OP: &str = "copy";
        contract::copy(self.len(dst), self.len(src))?;
        match (dst, src) {
            (CpuBuf::Index(d), CpuBuf::Index(s)) => d.copy_from_slice(s),
            (CpuBuf::Float { data: d, .. }, CpuBuf::Float { data: s, .. }) => d.copy_from_slice(s),
            (dst, src) => {
                return Err(Error::Kind {
                    op: OP,
                    arg: "src",
                    expected: float_kind(dst),
                    got: float_kind(src),
                })
            }
        }
        Ok(())
    }

    fn copy_range(
        &self,
        dst: &mut CpuBuf<T>,
        dst_offset: usize,
        src: &CpuBuf<T>,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        contract::copy_range(self.len(dst), dst_offset, self.len(src), src_offset, len)?;
        same_kind("copy_range", dst, src)?;
        let (to, from) = (dst_offset..dst_offset + len, src_offset..src_offset + len);
        match (dst, src) {
            (CpuBuf::Index(d), CpuBuf::Index(s)) => d[to].copy_from_slice(&s[from]),
            (CpuBuf::Float { data: d, .. }, CpuBuf::Float { data: s, .. }) => {
                d[to].copy_from_slice(&s[from])
            }
            _ => unreachable!("kinds checked equal above"),
        }
        Ok(())
    }

    fn fill_zero(&self, buf: &mut CpuBuf<T>) -> Result<()> {
        match buf {
            CpuBuf::Float { data, .. } => data.fill(T::ZERO),
            CpuBuf::Index(data) => data.fill(0),
        }
        Ok(())
    }

    fn fill_normal(&self, buf: &mut CpuBuf<T>, seed: u64, first: u64, std: f64) -> Result<()> {
        let data = floats_mut("fill_normal", "buf", buf)?;
        data.par_iter_mut().enumerate().for_each(|(i, x)| {
            *x = T::from_f32((std * crate::sampling::normal(seed, first + i as u64)) as f32);
        });
        Ok(())
    }

    // ---- elementwise and reductions ----------------------------------------------------

    fn add_assign(&self, y: &mut CpuBuf<T>, x: &CpuBuf<T>) -> Result<()> {
        const OP: &str = "add_assign";
        let x = floats(OP, "x", x)?;
        let y = floats_mut(OP, "y", y)?;
        contract::add_assign(y.len(), x.len())?;
        let add = |(y, x): (&mut [T], &[T])| {
            for (y, &x) in y.iter_mut().zip(x) {
                *y += x;
            }
        };
        if y.len() < PARALLEL_ELEMENTS {
            add((y, x));
        } else {
            y.par_chunks_mut(ELEMENTWISE_CHUNK)
                .zip(x.par_chunks(ELEMENTWISE_CHUNK))
                .for_each(add);
        }
        Ok(())
    }

    fn scale(&self, y: &mut CpuBuf<T>, alpha: f32) -> Result<()> {
        let alpha = T::from_f32(alpha);
        floats_mut("scale", "y", y)?
            .par_iter_mut()
            .for_each(|y| *y *= alpha);
        Ok(())
    }

    fn sum_squares(&self, x: &CpuBuf<T>) -> Result<f64> {
        // Fixed chunks summed in order: rayon's own `sum` splits by work stealing, so its
        // rounding (and a run's grad norms, hence its weights) would vary between runs.
        let partial: Vec<f64> = floats("sum_squares", "x", x)?
            .par_chunks(ELEMENTWISE_CHUNK)
            .map(|chunk| chunk.iter().map(|&x| x.to_f64() * x.to_f64()).sum())
            .collect();
        Ok(partial.iter().sum())
    }

    fn gather_rows(
        &self,
        out: &mut CpuBuf<T>,
        x: &CpuBuf<T>,
        rows: &CpuBuf<T>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        let rows = indices(OP, "rows", rows)?;
        let x = floats(OP, "x", x)?;
        let out = floats_mut(OP, "out", out)?;
        contract::gather_rows(out.len(), x.len(), Ids::Host(rows), dim)?;
        gather(out, x, rows, dim);
        Ok(())
    }

    // ---- dense -------------------------------------------------------------------------

    fn matmul(
        &self,
        c: &mut CpuBuf<T>,
        a: &CpuBuf<T>,
        b: &CpuBuf<T>,
        dims: Matmul,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let a = floats(OP, "a", a)?;
        let b = floats(OP, "b", b)?;
        let c = floats_mut(OP, "c", c)?;
        contract::matmul(c.len(), a.len(), b.len(), dims)?;
        if self.batch_invariant() && !dims.trans_a && dims.trans_b {
            invariant::matmul_xwt(c, a, b, (dims.m, dims.n, dims.k), accumulate);
        } else {
            gemm(c, a, b, dims, accumulate, T::ONE);
        }
        Ok(())
    }

    fn add_bias(
        &self,
        y: &mut CpuBuf<T>,
        bias: &CpuBuf<T>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "add_bias";
        let bias = floats(OP, "bias", bias)?;
        let y = floats_mut(OP, "y", y)?;
        contract::add_bias(y.len(), bias.len(), rows, cols)?;
        if cols == 0 {
            return Ok(());
        }
        y.par_chunks_mut(cols).for_each(|row| {
            for (y, &b) in row.iter_mut().zip(bias) {
                *y += b;
            }
        });
        Ok(())
    }

    fn add_bias_backward(
        &self,
        dbias: &mut CpuBuf<T>,
        dy: &CpuBuf<T>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "add_bias_backward";
        let dy = floats(OP, "dy", dy)?;
        let dbias = floats_mut(OP, "dbias", dbias)?;
        contract::add_bias_backward(dbias.len(), dy.len(), rows, cols)?;
        if cols == 0 {
            return Ok(());
        }
        for row in dy.chunks(cols) {
            for (db, &d) in dbias.iter_mut().zip(row) {
                *db += d;
            }
        }
        Ok(())
    }

    // ---- embedding ---------------------------------------------------------------------

    fn embedding_forward(
        &self,
        out: &mut CpuBuf<T>,
        table: &CpuBuf<T>,
        ids: &CpuBuf<T>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_forward";
        let ids = indices(OP, "ids", ids)?;
        let table = floats(OP, "table", table)?;
        let out = floats_mut(OP, "out", out)?;
        contract::embedding_forward(out.len(), table.len(), Ids::Host(ids), dim)?;
        gather(out, table, ids, dim);
        Ok(())
    }

    fn embedding_backward(
        &self,
        dtable: &mut CpuBuf<T>,
        dout: &CpuBuf<T>,
        ids: &CpuBuf<T>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        let ids = indices(OP, "ids", ids)?;
        let dout = floats(OP, "dout", dout)?;
        let dtable = floats_mut(OP, "dtable", dtable)?;
        contract::embedding_backward(dtable.len(), dout.len(), Ids::Host(ids), dim)?;
        for (row, &id) in dout.chunks(dim).zip(ids) {
            let id = id as usize;
            for (d, &g) in dtable[id * dim..(id + 1) * dim].iter_mut().zip(row) {
                *d += g;
            }
        }
        Ok(())
    }

    // ---- RMSNorm -----------------------------------------------------------------------

    fn rmsnorm_forward(
        &self,
        out: &mut CpuBuf<T>,
        rstd: &mut CpuBuf<T>,
        x: &CpuBuf<T>,
        w: &CpuBuf<T>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_forward";
        let x = floats(OP, "x", x)?;
        let w = floats(OP, "w", w)?;
        let out = floats_mut(OP, "out", out)?;
        let rstd = full_mut(OP, "rstd", rstd)?;
        contract::rmsnorm_forward(out.len(), rstd.len(), x.len(), w.len(), rows, dim)?;
        if dim == 0 {
            return Ok(());
        }
        let (eps, n) = (T::from_f32(eps), T::from_f64(dim as f64));
        let norm = |((out, rstd), x): ((&mut [T], &mut T), &[T])| {
            let mean_sq = float::dot(x, x) / n;
            let r = T::ONE / (mean_sq + eps).sqrt();
            *rstd = r;
            for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
                *o = x * r * w;
            }
        };
        if x.len() < PARALLEL_ELEMENTS {
            out.chunks_mut(dim)
                .zip(rstd.iter_mut())
                .zip(x.chunks(dim))
                .for_each(norm);
        } else {
            out.par_chunks_mut(dim)
                .zip(rstd.par_iter_mut())
                .zip(x.par_chunks(dim))
                .for_each(norm);
        }
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CpuBuf<T>,
        dw: &mut CpuBuf<T>,
        dout: &CpuBuf<T>,
        x: &CpuBuf<T>,
        w: &CpuBuf<T>,
        rstd: &CpuBuf<T>,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_backward";
        let dout = floats(OP, "dout", dout)?;
        let x = floats(OP, "x", x)?;
        let w = floats(OP, "w", w)?;
        let rstd = full(OP, "rstd", rstd)?;
        let dx = floats_mut(OP, "dx", dx)?;
        let dw = floats_mut(OP, "dw", dw)?;
        contract::rmsnorm_backward(
            dx.len(),
            dw.len(),
            dout.len(),
            x.len(),
            w.len(),
            rstd.len(),
            rows,
            dim,
        )?;
        if dim == 0 {
            return Ok(());
        }
        let n = T::from_f64(dim as f64);
        // y_i = x_i r w_i with r = (mean(x²) + eps)^(-1/2), so
        // dx_i = r w_i dy_i − x_i r³/n · Σ_j dy_j w_j x_j.
        dx.par_chunks_mut(dim)
            .zip(dout.par_chunks(dim))
            .zip(x.par_chunks(dim))
            .zip(rstd.par_iter())
            .for_each(|(((dx, dy), x), &r)| {
                let mut proj = T::ZERO;
                for ((&dy, &x), &w) in dy.iter().zip(x).zip(w) {
                    proj += dy * w * x;
                }
                let c = r * r * r * proj / n;
                for (((dx, &dy), &x), &w) in dx.iter_mut().zip(dy).zip(x).zip(w) {
                    *dx = r * w * dy - c * x;
                }
            });
        for ((dy, x), &r) in dout.chunks(dim).zip(x.chunks(dim)).zip(rstd) {
            for ((dw, &dy), &x) in dw.iter_mut().zip(dy).zip(x) {
                *dw += dy * x * r;
            }
        }
        Ok(())
    }

    // ---- RoPE --------------------------------------------------------------------------

    fn rope(
        &self,
        x: &mut CpuBuf<T>,
        positions: &CpuBuf<T>,
        inv_freq: &CpuBuf<T>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "rope";
        let positions = indices(OP, "positions", positions)?;
        let inv_freq = full(OP, "inv_freq", inv_freq)?;
        let x = floats_mut(OP, "x", x)?;
        contract::rope(
            x.len(),
            positions.len(),
            inv_freq.len(),
            tokens,
            heads,
            head_dim,
        )?;
        let half = head_dim / 2;
        if heads == 0 || half == 0 {
            return Ok(());
        }
        // Packed sequences repeat positions (each restarts at 0), so the sines and cosines
        // are computed once per distinct position, into rows of `table` in sorted order.
        let mut distinct = positions.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        // [distinct, half] (cos, sin) pairs; the sine negated for the inverse rotation.
        let mut table = vec![(T::ZERO, T::ZERO); distinct.len() * half];
        let serial = x.len() < PARALLEL_ELEMENTS;
        let fill = |(angles, &pos): (&mut [(T, T)], &u32)| {
            let pos = T::from_f64(pos as f64);
            for ((cos, sin), &f) in angles.iter_mut().zip(inv_freq) {
                // The angle is formed in the storage float, as HF forms it in f32.
                let angle = pos * f;
                *cos = angle.cos();
                *sin = if inverse { -angle.sin() } else { angle.sin() };
            }
        };
        if serial {
            table.chunks_mut(half).zip(&distinct).for_each(fill);
        } else {
            table
                .par_chunks_mut(half)
                .zip(distinct.par_iter())
                .for_each(fill);
        }
        let rotate = |(x_t, &pos): (&mut [T], &u32)| {
            let at = distinct
                .binary_search(&pos)
                .expect("every position is listed")
                * half;
            let angles = &table[at..at + half];
            for head in x_t.chunks_exact_mut(head_dim) {
                let (lo, hi) = head.split_at_mut(half);
                for ((a, b), &(cos, sin)) in lo.iter_mut().zip(hi.iter_mut()).zip(angles) {
                    let (x, y) = (*a, *b);
                    *a = x * cos - y * sin;
                    *b = y * cos + x * sin;
                }
            }
        };
        if serial {
            x.chunks_mut(heads * head_dim)
                .zip(positions)
                .for_each(rotate);
        } else {
            x.par_chunks_mut(heads * head_dim)
                .zip(positions.par_iter())
                .for_each(rotate);
        }
        Ok(())
    }

    // ---- attention over packed segments ------------------------------------------------

    fn attention_forward(
        &self,
        out: &mut CpuBuf<T>,
        lse: &mut CpuBuf<T>,
        q: &CpuBuf<T>,
        k: &CpuBuf<T>,
        v: &CpuBuf<T>,
        segments: &[Segment],
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_forward";
        let q = floats(OP, "q", q)?;
        let k = floats(OP, "k", k)?;
        let v = floats(OP, "v", v)?;
        let out = floats_mut(OP, "out", out)?;
        let lse = full_mut(OP, "lse", lse)?;
        contract::attention_forward(
            out.len(),
            lse.len(),
            q.len(),
            k.len(),
            v.len(),
            segments,
            shape,
        )?;
        let invariant = self.batch_invariant();
        attention::forward(out, lse, q, k, v, segments, shape, invariant);
        Ok(())
    }

    fn attention_backward(
        &self,
        dq: &mut CpuBuf<T>,
        dk: &mut CpuBuf<T>,
        dv: &mut CpuBuf<T>,
        dout: &CpuBuf<T>,
        out: &CpuBuf<T>,
        lse: &CpuBuf<T>,
        q: &CpuBuf<T>,
        k: &CpuBuf<T>,
        v: &CpuBuf<T>,
        segments: &[Segment],
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        let dout = floats(OP, "dout", dout)?;
        let out = floats(OP, "out", out)?;
        let lse = full(OP, "lse", lse)?;
        let q = floats(OP, "q", q)?;
        let k = floats(OP, "k", k)?;
        let v = floats(OP, "v", v)?;
        let dq = floats_mut(OP, "dq", dq)?;
        let dk = floats_mut(OP, "dk", dk)?;
        let dv = floats_mut(OP, "dv", dv)?;
        contract::attention_backward(
            dq.len(),
            dk.len(),
            dv.len(),
            dout.len(),
            out.len(),
            lse.len(),
            q.len(),
            k.len(),
            v.len(),
            segments,
            shape,
        )?;
        dq.fill(T::ZERO);
        dk.fill(T::ZERO);
        dv.fill(T::ZERO);
        attention::backward(dq, dk, dv, dout, out, lse, q, k, v, segments, shape);
        Ok(())
    }

    // ---- paged KV cache (sampling) -----------------------------------------------------

    fn kv_cache_write(
        &self,
        k_cache: &mut CpuBuf<T>,
        v_cache: &mut CpuBuf<T>,
        k: &CpuBuf<T>,
        v: &CpuBuf<T>,
        slots: &CpuBuf<T>,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        const OP: &str = "kv_cache_write";
        let slots = indices(OP, "slots", slots)?;
        let k = floats(OP, "k", k)?;
        let v = floats(OP, "v", v)?;
        let k_cache = floats_mut(OP, "k_cache", k_cache)?;
        let v_cache = floats_mut(OP, "v_cache", v_cache)?;
        contract::kv_cache_write(
            k_cache.len(),
            v_cache.len(),
            k.len(),
            v.len(),
            Ids::Host(slots),
            kv_heads,
            head_dim,
        )?;
        let row = kv_heads * head_dim;
        for (t, &slot) in slots.iter().enumerate() {
            let (src, dst) = (t * row..(t + 1) * row, slot as usize * row);
            k_cache[dst..dst + row].copy_from_slice(&k[src.clone()]);
            v_cache[dst..dst + row].copy_from_slice(&v[src]);
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        out: &mut CpuBuf<T>,
        q: &CpuBuf<T>,
        k_cache: &CpuBuf<T>,
        v_cache: &CpuBuf<T>,
        layout: &PagedLayout<'_, Self>,
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        let q = floats(OP, "q", q)?;
        let k_cache = floats(OP, "k_cache", k_cache)?;
        let v_cache = floats(OP, "v_cache", v_cache)?;
        let out = floats_mut(OP, "out", out)?;
        let block_tables = indices(OP, "block_tables", layout.block_tables)?;
        let token_seq = indices(OP, "token_seq", layout.token_seq)?;
        let token_pos = indices(OP, "token_pos", layout.token_pos)?;
        let lens = PagedLens {
            block_tables: block_tables.len(),
            max_blocks: layout.max_blocks,
            block_size: layout.block_size,
            token_seq: token_seq.len(),
            token_pos: Ids::Host(token_pos),
            max_context: layout.max_context,
            runs: layout.runs,
            shared: layout.shared,
        };
        contract::paged_attention(
            out.len(),
            q.len(),
            k_cache.len(),
            v_cache.len(),
            lens,
            shape,
        )?;
        let block_elems = layout.block_size * shape.kv_heads * shape.head_dim;
        let index = attention::PagedIndex {
            block_tables,
            max_blocks: layout.max_blocks,
            block_size: layout.block_size,
            token_seq,
            token_pos,
            num_blocks: k_cache.len() / block_elems,
        };
        attention::paged(
            out,
            q,
            k_cache,
            v_cache,
            &index,
            shape,
            self.batch_invariant(),
        )
    }

    // ---- SwiGLU ------------------------------------------------------------------------

    fn swiglu_forward(&self, out: &mut CpuBuf<T>, gate: &CpuBuf<T>, up: &CpuBuf<T>) -> Result<()> {
        const OP: &str = "swiglu_forward";
        let gate = floats(OP, "gate", gate)?;
        let up = floats(OP, "up", up)?;
        let out = floats_mut(OP, "out", out)?;
        contract::swiglu_forward(out.len(), gate.len(), up.len())?;
        let swiglu = |((out, gate), up): ((&mut [T], &[T]), &[T])| {
            float::wide(|| swiglu_chunk(out, gate, up))
        };
        if out.len() < PARALLEL_ELEMENTS {
            swiglu(((out, gate), up));
        } else {
            out.par_chunks_mut(ELEMENTWISE_CHUNK)
                .zip(gate.par_chunks(ELEMENTWISE_CHUNK))
                .zip(up.par_chunks(ELEMENTWISE_CHUNK))
                .for_each(swiglu);
        }
        Ok(())
    }

    fn swiglu_backward(
        &self,
        dgate: &mut CpuBuf<T>,
        dup: &mut CpuBuf<T>,
        dout: &CpuBuf<T>,
        gate: &CpuBuf<T>,
        up: &CpuBuf<T>,
    ) -> Result<()> {
        const OP: &str = "swiglu_backward";
        let dout = floats(OP, "dout", dout)?;
        let gate = floats(OP, "gate", gate)?;
        let up = floats(OP, "up", up)?;
        let dgate = floats_mut(OP, "dgate", dgate)?;
        let dup = floats_mut(OP, "dup", dup)?;
        contract::swiglu_backward(dgate.len(), dup.len(), dout.len(), gate.len(), up.len())?;
        let chunk = ELEMENTWISE_CHUNK;
        dgate
            .par_chunks_mut(chunk)
            .zip(dup.par_chunks_mut(chunk))
            .zip(dout.par_chunks(chunk))
            .zip(gate.par_chunks(chunk).zip(up.par_chunks(chunk)))
            .for_each(|(((dgate, dup), dout), (gate, up))| {
                float::wide(|| swiglu_backward_chunk(dgate, dup, dout, gate, up))
            });
        Ok(())
    }

    // ---- fused lm-head -----------------------------------------------------------------

    fn lm_head_forward(
        &self,
        logprobs: &mut CpuBuf<T>,
        entropy: &mut CpuBuf<T>,
        lse: &mut CpuBuf<T>,
        hidden: &CpuBuf<T>,
        w: &CpuBuf<T>,
        targets: &CpuBuf<T>,
        spec: LmHead,
    ) -> Result<()> {
        const OP: &str = "lm_head_forward";
        let hidden = floats(OP, "hidden", hidden)?;
        let w = floats(OP, "w", w)?;
        let targets = indices(OP, "targets", targets)?;
        let logprobs = full_mut(OP, "logprobs", logprobs)?;
        let entropy = full_mut(OP, "entropy", entropy)?;
        let lse = full_mut(OP, "lse", lse)?;
        contract::lm_head_forward(
            logprobs.len(),
            entropy.len(),
            lse.len(),
            hidden.len(),
            w.len(),
            Ids::Host(targets),
            spec,
        )?;
        let invariant = self.batch_invariant();
        lm_head::forward(logprobs, entropy, lse, hidden, w, targets, spec, invariant);
        Ok(())
    }

    fn lm_head_backward(
        &self,
        dhidden: &mut CpuBuf<T>,
        dw: &mut CpuBuf<T>,
        dlogprobs: &CpuBuf<T>,
        dentropy: &CpuBuf<T>,
        hidden: &CpuBuf<T>,
        w: &CpuBuf<T>,
        targets: &CpuBuf<T>,
        lse: &CpuBuf<T>,
        spec: LmHead,
    ) -> Result<()> {
        const OP: &str = "lm_head_backward";
        let dlogprobs = full(OP, "dlogprobs", dlogprobs)?;
        let dentropy = full(OP, "dentropy", dentropy)?;
        let hidden = floats(OP, "hidden", hidden)?;
        let w = floats(OP, "w", w)?;
        let targets = indices(OP, "targets", targets)?;
        let lse = full(OP, "lse", lse)?;
        let dhidden = floats_mut(OP, "dhidden", dhidden)?;
        let dw = floats_mut(OP, "dw", dw)?;
        contract::lm_head_backward(
            dhidden.len(),
            dw.len(),
            dlogprobs.len(),
            dentropy.len(),
            hidden.len(),
            w.len(),
            Ids::Host(targets),
            lse.len(),
            spec,
        )?;
        lm_head::backward(
            dhidden, dw, dlogprobs, dentropy, hidden, w, targets, lse, spec,
        );
        Ok(())
    }

    // ---- sampling ----------------------------------------------------------------------

    fn sample(
        &self,
        logits: &CpuBuf<T>,
        vocab: usize,
        rows: &[SamplingRow],
    ) -> Result<Vec<Sampled>> {
        const OP: &str = "sample";
        let logits = floats(OP, "logits", logits)?;
        contract::sample(logits.len(), vocab, rows.len())?;
        let invariant = self.batch_invariant();
        Ok(logits
            .par_chunks(vocab)
            .zip(rows.par_iter())
            .map(|(z, row)| {
                let z32: Vec<f32> = z.iter().map(|x| x.to_f32()).collect();
                let mut sampled = sampling::sample_row(&z32, row);
                if invariant {
                    // The training forward's log-probs of this row, bit for bit.
                    let logit_scale = if row.temperature > 0.0 {
                        1.0 / row.temperature
                    } else {
                        1.0
                    };
                    let targets = std::iter::once(sampled.token)
                        .chain(sampled.top_logprobs.iter().map(|&(id, _)| id));
                    let logprobs = lm_head::token_logprobs(z, logit_scale, targets);
                    sampled.logprob = logprobs[0].to_f32();
                    for (top, lp) in sampled.top_logprobs.iter_mut().zip(&logprobs[1..]) {
                        top.1 = lp.to_f32();
                    }
                }
                sampled
            })
            .collect())
    }

    // ---- optimizer ---------------------------------------------------------------------

    fn adamw(
        &self,
        param: &mut CpuBuf<T>,
        grad: &CpuBuf<T>,
        m: &mut CpuBuf<T>,
        v: &mut CpuBuf<T>,
        compute: Option<&mut CpuBuf<T>>,
        hp: AdamW,
    ) -> Result<()> {
        const OP: &str = "adamw";
        let grad = full(OP, "grad", grad)?;
        let param = full_mut(OP, "param", param)?;
        let m = full_mut(OP, "m", m)?;
        let v = full_mut(OP, "v", v)?;
        let compute = match compute {
            Some(c) => Some(floats_mut(OP, "compute", c)?),
            None => None,
        };
        let n_compute = compute.as_ref().map(|c| c.len());
        contract::adamw(param.len(), grad.len(), m.len(), v.len(), n_compute, &hp)?;
        // The CUDA kernel's rule term for term (bias corrections in f64, rounded once to
        // T), so at f32 this is bit for bit the host optimizer of `adamw_host`.
        let f = |x: f32| T::from_f32(x);
        let (b1, b2) = (f(hp.beta1), f(hp.beta2));
        let step = i32::try_from(hp.step).unwrap_or(i32::MAX);
        let bc1 = T::from_f64(1.0 - f64::from(hp.beta1).powi(step));
        let bc2 = T::from_f64(1.0 - f64::from(hp.beta2).powi(step));
        let (lr, eps, decay, gscale) = (f(hp.lr), f(hp.eps), f(hp.weight_decay), f(hp.grad_scale));
        param
            .par_iter_mut()
            .zip(m.par_iter_mut().zip(v.par_iter_mut()))
            .zip(grad.par_iter())
            .for_each(|((p, (m, v)), &g)| {
                let g = g * gscale;
                let mut w = *p;
                w -= lr * decay * w;
                *m = b1 * *m + (T::ONE - b1) * g;
                *v = b2 * *v + (T::ONE - b2) * g * g;
                w -= lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
                *p = w;
            });
        if let Some(compute) = compute {
            compute.copy_from_slice(param);
        }
        Ok(())
    }

    fn adamw_host(
        &self,
        param: &mut CpuBuf<T>,
        grad: &CpuBuf<T>,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        hp: AdamW,
    ) -> Result<()> {
        const OP: &str = "adamw_host";
        let grad: Vec<f32> = full(OP, "grad", grad)?.iter().map(|g| g.to_f32()).collect();
        let param = floats_mut(OP, "param", param)?;
        contract::adamw_host(param.len(), grad.len(), master.len(), m.len(), v.len(), &hp)?;
        let terms = host_adamw::AdamWTerms::new(&hp);
        host_adamw::step(&terms, master, &grad, m, v, host_adamw::Rounded::None);
        for (p, &w) in param.iter_mut().zip(master.iter()) {
            *p = T::from_f32(w);
        }
        Ok(())
    }
}
