//! [`Backend`] for [`CudaBackend`]: argument kinds, then [`crate::contract`], checked on
//! the host, then one or a few kernel launches (or cuBLAS calls) per op, all on the
//! backend's stream.

use std::sync::Arc;

use cudarc::driver::LaunchConfig;

use super::attention::{self, dkdv_shared_bytes, forward_shared_bytes, work_lists, THREADS};
use super::device::{
    dtype_code, int, Arg, CudaBackend, CudaBuf, HostStaging, Module, Storage, STAGING_CHUNK,
};
use crate::contract::{self, Ids, PagedLens};
use crate::host_adamw::{self, AdamWTerms, Rounded};
use crate::{
    sampling, AdamW, AttnShape, Backend, BufKind, Error, LmHead, Matmul, NormedHeads, PagedLayout,
    Result, Sampled, SamplingRow, Segment,
};

fn need(op: &'static str, arg: &'static str, buf: &CudaBuf, kind: BufKind) -> Result<()> {
    if buf.kind == kind {
        Ok(())
    } else {
        Err(Error::Kind {
            op,
            arg,
            expected: kind,
            got: buf.kind,
        })
    }
}

/// Compute or Full; returns the kernels' type code.
fn float(op: &'static str, arg: &'static str, buf: &CudaBuf) -> Result<Arg> {
    if buf.kind == BufKind::Index {
        return Err(Error::Kind {
            op,
            arg,
            expected: BufKind::Compute,
            got: BufKind::Index,
        });
    }
    Ok(Arg::I32(dtype_code(buf.kind)))
}

fn i64_arg(n: usize) -> Arg {
    Arg::I64(n as i64)
}

/// The head sizes the attention kernels are instantiated for: a limit of this backend, not
/// of the op's contract.
fn supported_head_dim(op: &'static str, head_dim: usize) -> Result<()> {
    if matches!(head_dim, 32 | 64 | 128) {
        return Ok(());
    }
    Err(Error::Shape {
        op,
        msg: format!("head_dim {head_dim} unsupported on CUDA (32, 64 or 128)"),
    })
}

/// The instantiation of attention kernel `name` for `head_dim` (checked by
/// `supported_head_dim`).
fn attention_kernel(name: &'static str, head_dim: usize) -> &'static str {
    match (name, head_dim) {
        ("attention_forward", 32) => "attention_forward_d32",
        ("attention_forward", 64) => "attention_forward_d64",
        ("attention_forward", _) => "attention_forward_d128",
        ("attention_backward_dq", 32) => "attention_backward_dq_d32",
        ("attention_backward_dq", 64) => "attention_backward_dq_d64",
        ("attention_backward_dq", _) => "attention_backward_dq_d128",
        ("attention_backward_dkdv", 32) => "attention_backward_dkdv_d32",
        ("attention_backward_dkdv", 64) => "attention_backward_dkdv_d64",
        ("attention_backward_dkdv", _) => "attention_backward_dkdv_d128",
        ("paged_cascade_attention", 32) => "paged_cascade_attention_d32",
        ("paged_cascade_attention", 64) => "paged_cascade_attention_d64",
        ("paged_cascade_attention", _) => "paged_cascade_attention_d128",
        (_, 32) => "paged_prefill_attention_d32",
        (_, 64) => "paged_prefill_attention_d64",
        _ => "paged_prefill_attention_d128",
    }
}

/// The attention kernels take bf16 q/k/v/out/grads and f32 lse.
fn compute_args(op: &'static str, args: &[(&'static str, &CudaBuf)]) -> Result<()> {
    args.iter()
        .try_for_each(|&(name, buf)| need(op, name, buf, BufKind::Compute))
}

fn cfg(grid: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads of the one-block-per-row lm-head kernels.
const ROW_THREADS: u32 = 512;
/// Threads of a block of the one-warp-per-row kernels.
const WARP_ROW_THREADS: u32 = 256;

impl CudaBackend {
    pub(crate) fn upload_index_to(&self, data: &[u32]) -> Result<CudaBuf> {
        let mut buf = self.alloc(data.len(), BufKind::Index)?;
        Backend::write_index(self, &mut buf, data)?;
        Ok(buf)
    }

    /// `out[i, :] = x[rows[i], :]` (`gather_rows`, `embedding_forward`), checked by the
    /// caller; `odt`, `xdt` the type codes.
    fn gather(
        &self,
        op: &'static str,
        (out, odt): (&CudaBuf, Arg),
        (x, xdt): (&CudaBuf, Arg),
        rows: &CudaBuf,
        dim: usize,
    ) -> Result<()> {
        self.launch(
            Module::Elementwise,
            "gather_rows",
            self.rows_cols(rows.len, dim),
            &[
                self.p(out),
                odt,
                self.p(x),
                xdt,
                self.p(rows),
                int(op, "rows", rows.len)?,
                int(op, "dim", dim)?,
            ],
        )
    }

    /// Grid for the one-warp-per-row kernels.
    fn warp_rows(&self, rows: usize) -> LaunchConfig {
        let warps = (WARP_ROW_THREADS / 32) as usize;
        let blocks = rows.div_ceil(warps).clamp(1, self.sm_count as usize * 32);
        cfg((blocks as u32, 1, 1), WARP_ROW_THREADS)
    }

    /// Grid for row-broadcast kernels (`gather_rows`, `add_bias`, ...): x over columns, y
    /// over rows.
    fn rows_cols(&self, rows: usize, cols: usize) -> LaunchConfig {
        let threads = 256u32;
        let gx = cols.div_ceil(threads as usize).max(1);
        let gy = rows.clamp(1, 65535);
        cfg((gx as u32, gy as u32, 1), threads)
    }

    /// `dst[c] += Σ_r src[r, c] · other[r, c] · row_scale[r]` (the last two optional), in
    /// two passes (partial sums per chunk of rows, then the chunks in order) so the result
    /// does not depend on block scheduling.
    #[allow(clippy::too_many_arguments)]
    fn column_sum(
        &self,
        dst: &CudaBuf,
        src: &CudaBuf,
        other: Option<&CudaBuf>,
        row_scale: Option<&CudaBuf>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let threads = 256u32;
        let gx = cols.div_ceil(threads as usize).max(1);
        // Enough row chunks to fill the device, each at least 32 rows long.
        let gy = rows
            .div_ceil(32)
            .clamp(1, (self.sm_count as usize * 8).div_ceil(gx).max(1));
        let partial = self.alloc(gy * cols, BufKind::Full)?;
        let opt = |b: Option<&CudaBuf>| match b {
            Some(b) => (self.p(b), Arg::I32(dtype_code(b.kind))),
            None => (Arg::Ptr(0), Arg::I32(0)),
        };
        let (o, odt) = opt(other);
        let (r, rdt) = opt(row_scale);
        self.launch(
            Module::Elementwise,
            "column_sum",
            cfg((gx as u32, gy as u32, 1), threads),
            &[
                self.p(&partial),
                self.p(src),
                Arg::I32(dtype_code(src.kind)),
                o,
                odt,
                r,
                rdt,
                int("column_sum", "rows", rows)?,
                int("column_sum", "cols", cols)?,
            ],
        )?;
        self.launch(
            Module::Elementwise,
            "column_sum_finish",
            self.grid_1d(cols, threads),
            &[
                self.p(dst),
                self.p(&partial),
                int("column_sum", "chunks", gy)?,
                int("column_sum", "cols", cols)?,
            ],
        )
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;

    fn name(&self) -> String {
        self.describe()
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok()
    }

    fn synchronize(&self) -> Result<()> {
        self.eager_only("a synchronize")?;
        self.stream.synchronize()?;
        Ok(())
    }

    fn compute_is_full(&self) -> bool {
        false
    }

    /// A stream at the device's highest priority: its blocks are scheduled first, so the
    /// sampler's latency-bound decode steps are not queued behind training GEMMs.
    fn fork(&self) -> Result<Self> {
        self.ctx.bind_to_thread()?;
        let (_lowest, highest) = cudarc::driver::result::stream::get_priority_range()?;
        Self::on_new_stream(Arc::clone(&self.ctx), highest)
    }

    fn wait_for(&self, other: &Self) -> Result<()> {
        self.eager_only("a wait")?;
        self.stream.join(&other.stream)?;
        Ok(())
    }

    fn captures_graphs(&self) -> bool {
        self.graphs_enabled
    }

    fn graphed<E: From<Error> + std::fmt::Display>(
        &self,
        ops: &mut dyn FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.run_graphed(ops)
    }

    // ---- buffers ---------------------------------------------------------------------

    fn element_bytes(&self, kind: BufKind) -> usize {
        super::element_bytes(kind)
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn kind(&self, buf: &CudaBuf) -> BufKind {
        buf.kind
    }

    fn zeros(&self, len: usize, kind: BufKind) -> Result<CudaBuf> {
        let mut buf = self.alloc(len, kind)?;
        self.fill_zero(&mut buf)?;
        Ok(buf)
    }

    fn upload(&self, data: &[f32], kind: BufKind) -> Result<CudaBuf> {
        self.eager_only("an upload")?;
        let mut buf = self.alloc(data.len(), kind)?;
        if data.is_empty() {
            return Ok(buf);
        }
        let n = data.len();
        match &mut buf.storage {
            Storage::Bf16(s) => {
                let bits: Vec<u16> = data
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                self.stream.memcpy_htod(&bits, &mut s.slice_mut(..n))?;
            }
            Storage::F32(s) => self.stream.memcpy_htod(data, &mut s.slice_mut(..n))?,
            Storage::U32(_) => {
                return Err(Error::Kind {
                    op: "upload",
                    arg: "kind",
                    expected: BufKind::Full,
                    got: BufKind::Index,
                })
            }
        }
        Ok(buf)
    }

    fn upload_index(&self, data: &[u32]) -> Result<CudaBuf> {
        self.upload_index_to(data)
    }

    fn write_index(&self, dst: &mut CudaBuf, data: &[u32]) -> Result<()> {
        const OP: &str = "write_index";
        self.eager_only("an upload")?;
        need(OP, "dst", dst, BufKind::Index)?;
        if dst.len != data.len() {
            return Err(Error::Shape {
                op: OP,
                msg: format!("dst has {} elements, data {}", dst.len, data.len()),
            });
        }
        if let Storage::U32(s) = &mut dst.storage {
            if !data.is_empty() {
                self.stream
                    .memcpy_htod(data, &mut s.slice_mut(..data.len()))?;
            }
        }
        Ok(())
    }

    fn download(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        self.eager_only("a download")?;
        let n = buf.len;
        let out = match &buf.storage {
            Storage::Bf16(s) => {
                let mut bits = vec![0u16; n];
                if n > 0 {
                    self.stream.memcpy_dtoh(&s.slice(..n), &mut bits)?;
                }
                self.stream.synchronize()?;
                bits.into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect()
            }
            Storage::F32(s) => {
                let mut v = vec![0f32; n];
                if n > 0 {
                    self.stream.memcpy_dtoh(&s.slice(..n), &mut v)?;
                }
                self.stream.synchronize()?;
                v
            }
            Storage::U32(_) => {
                return Err(Error::Kind {
                    op: "download",
                    arg: "buf",
                    expected: BufKind::Full,
                    got: BufKind::Index,
                })
            }
        };
        Ok(out)
    }

    fn download_index(&self, buf: &CudaBuf) -> Result<Vec<u32>> {
        self.eager_only("a download")?;
        need("download_index", "buf", buf, BufKind::Index)?;
        let mut v = vec![0u32; buf.len];
        if let Storage::U32(s) = &buf.storage {
            if buf.len > 0 {
                self.stream.memcpy_dtoh(&s.slice(..buf.len), &mut v)?;
            }
        }
        self.stream.synchronize()?;
        Ok(v)
    }

    fn copy(&self, dst: &mut CudaBuf, src: &CudaBuf) -> Result<()> {
        const OP: &str = "copy";
        self.eager_only(OP)?;
        contract::copy(dst.len, src.len)?;
        let n = src.len;
        if n == 0 {
            return Ok(());
        }
        match (&mut dst.storage, &src.storage) {
            (Storage::Bf16(d), Storage::Bf16(s)) => self
                .stream
                .memcpy_dtod(&s.slice(..n), &mut d.slice_mut(..n))?,
            (Storage::F32(d), Storage::F32(s)) => self
                .stream
                .memcpy_dtod(&s.slice(..n), &mut d.slice_mut(..n))?,
            (Storage::U32(d), Storage::U32(s)) => self
                .stream
                .memcpy_dtod(&s.slice(..n), &mut d.slice_mut(..n))?,
            (Storage::U32(_), _) | (_, Storage::U32(_)) => {
                return Err(Error::Kind {
                    op: OP,
                    arg: "src",
                    expected: dst.kind,
                    got: src.kind,
                })
            }
            _ => {
                let ddt = float(OP, "dst", dst)?;
                let sdt = float(OP, "src", src)?;
                self.launch(
                    Module::Elementwise,
                    "convert",
                    self.grid_1d(n, 256),
                    &[self.p(dst), ddt, self.p(src), sdt, i64_arg(n)],
                )?;
            }
        }
        Ok(())
    }

    fn copy_range(
        &self,
        dst: &mut CudaBuf,
        dst_offset: usize,
        src: &CudaBuf,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.eager_only("copy_range")?;
        need("copy_range", "src", src, dst.kind)?;
        contract::copy_range(dst.len, dst_offset, src.len, src_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (to, from) = (dst_offset..dst_offset + len, src_offset..src_offset + len);
        match (&mut dst.storage, &src.storage) {
            (Storage::Bf16(d), Storage::Bf16(s)) => self
                .stream
                .memcpy_dtod(&s.slice(from), &mut d.slice_mut(to))?,
            (Storage::F32(d), Storage::F32(s)) => self
                .stream
                .memcpy_dtod(&s.slice(from), &mut d.slice_mut(to))?,
            (Storage::U32(d), Storage::U32(s)) => self
                .stream
                .memcpy_dtod(&s.slice(from), &mut d.slice_mut(to))?,
            _ => unreachable!("kinds checked equal above"),
        }
        Ok(())
    }

    fn fill_zero(&self, buf: &mut CudaBuf) -> Result<()> {
        self.eager_only("fill_zero")?;
        match &mut buf.storage {
            Storage::Bf16(s) => self.stream.memset_zeros(s)?,
            Storage::F32(s) => self.stream.memset_zeros(s)?,
            Storage::U32(s) => self.stream.memset_zeros(s)?,
        }
        Ok(())
    }

    fn fill_normal(&self, buf: &mut CudaBuf, seed: u64, first: u64, std: f64) -> Result<()> {
        let dt = float("fill_normal", "buf", buf)?;
        // u64 and f64 travel as the bits of a `long long`.
        self.launch(
            Module::Elementwise,
            "fill_normal",
            self.grid_1d(buf.len, 256),
            &[
                self.p(buf),
                dt,
                Arg::I64(seed as i64),
                Arg::I64(first as i64),
                Arg::I64(std.to_bits() as i64),
                i64_arg(buf.len),
            ],
        )
    }

    // ---- elementwise and reductions --------------------------------------------------

    fn add_assign(&self, y: &mut CudaBuf, x: &CudaBuf) -> Result<()> {
        const OP: &str = "add_assign";
        let ydt = float(OP, "y", y)?;
        let xdt = float(OP, "x", x)?;
        contract::add_assign(y.len, x.len)?;
        self.launch(
            Module::Elementwise,
            "add_assign",
            self.grid_1d(y.len, 256),
            &[self.p(y), ydt, self.p(x), xdt, i64_arg(y.len)],
        )
    }

    fn scale(&self, y: &mut CudaBuf, alpha: f32) -> Result<()> {
        let dt = float("scale", "y", y)?;
        self.launch(
            Module::Elementwise,
            "scale",
            self.grid_1d(y.len, 256),
            &[self.p(y), dt, Arg::F32(alpha), i64_arg(y.len)],
        )
    }

    fn sum_squares(&self, x: &CudaBuf) -> Result<f64> {
        self.eager_only("sum_squares")?;
        let dt = float("sum_squares", "x", x)?;
        let grid = self.grid_1d(x.len, 256);
        let blocks = grid.grid_dim.0 as usize;
        let partial = self.stream.alloc_zeros::<f64>(blocks.max(1))?;
        let partial_ptr = {
            use cudarc::driver::DevicePtr;
            partial.device_ptr(&self.stream).0
        };
        self.launch(
            Module::Elementwise,
            "sum_squares",
            grid,
            &[self.p(x), dt, i64_arg(x.len), Arg::Ptr(partial_ptr)],
        )?;
        let mut sums = vec![0f64; blocks.max(1)];
        self.stream.memcpy_dtoh(&partial, &mut sums)?;
        self.stream.synchronize()?;
        // In block order: the same total on every run.
        Ok(sums.iter().sum())
    }

    fn gather_rows(
        &self,
        out: &mut CudaBuf,
        x: &CudaBuf,
        rows: &CudaBuf,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        let odt = float(OP, "out", out)?;
        let xdt = float(OP, "x", x)?;
        need(OP, "rows", rows, BufKind::Index)?;
        contract::gather_rows(out.len, x.len, Ids::Device(rows.len), dim)?;
        self.gather(OP, (out, odt), (x, xdt), rows, dim)
    }

    // ---- dense -----------------------------------------------------------------------

    fn matmul(
        &self,
        c: &mut CudaBuf,
        a: &CudaBuf,
        b: &CudaBuf,
        dims: Matmul,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "matmul";
        float(OP, "a", a)?;
        float(OP, "b", b)?;
        float(OP, "c", c)?;
        contract::matmul(c.len, a.len, b.len, dims)?;
        if a.kind != b.kind {
            return Err(Error::Kind {
                op: OP,
                arg: "b",
                expected: a.kind,
                got: b.kind,
            });
        }
        if a.kind == BufKind::Full && c.kind == BufKind::Compute {
            return Err(Error::Kind {
                op: OP,
                arg: "c",
                expected: BufKind::Full,
                got: c.kind,
            });
        }
        self.gemm(
            (self.ptr(c), c.kind),
            (self.ptr(a), a.kind),
            (self.ptr(b), b.kind),
            dims,
            1.0,
            if accumulate { 1.0 } else { 0.0 },
        )
    }

    fn add_bias(&self, y: &mut CudaBuf, bias: &CudaBuf, rows: usize, cols: usize) -> Result<()> {
        const OP: &str = "add_bias";
        let ydt = float(OP, "y", y)?;
        let bdt = float(OP, "bias", bias)?;
        contract::add_bias(y.len, bias.len, rows, cols)?;
        self.launch(
            Module::Elementwise,
            "add_bias",
            self.rows_cols(rows, cols),
            &[
                self.p(y),
                ydt,
                self.p(bias),
                bdt,
                int(OP, "rows", rows)?,
                int(OP, "cols", cols)?,
            ],
        )
    }

    fn add_bias_backward(
        &self,
        dbias: &mut CudaBuf,
        dy: &CudaBuf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "add_bias_backward";
        need(OP, "dbias", dbias, BufKind::Full)?;
        float(OP, "dy", dy)?;
        contract::add_bias_backward(dbias.len, dy.len, rows, cols)?;
        self.column_sum(dbias, dy, None, None, rows, cols)
    }

    // ---- embedding -------------------------------------------------------------------

    fn embedding_forward(
        &self,
        out: &mut CudaBuf,
        table: &CudaBuf,
        ids: &CudaBuf,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_forward";
        let odt = float(OP, "out", out)?;
        let tdt = float(OP, "table", table)?;
        need(OP, "ids", ids, BufKind::Index)?;
        contract::embedding_forward(out.len, table.len, Ids::Device(ids.len), dim)?;
        self.gather(OP, (out, odt), (table, tdt), ids, dim)
    }

    fn embedding_backward(
        &self,
        dtable: &mut CudaBuf,
        dout: &CudaBuf,
        ids: &CudaBuf,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        need(OP, "dtable", dtable, BufKind::Full)?;
        let ddt = float(OP, "dout", dout)?;
        need(OP, "ids", ids, BufKind::Index)?;
        // Group the tokens by id on the host (ids are few: one per token of the batch), so
        // the kernel sums each id's rows in token order without atomics.
        let ids_host = self.download_index(ids)?;
        contract::embedding_backward(dtable.len, dout.len, Ids::Host(&ids_host), dim)?;
        let mut order: Vec<u32> = (0..ids_host.len() as u32).collect();
        order.sort_by_key(|&t| ids_host[t as usize]);
        let mut distinct: Vec<u32> = Vec::new();
        let mut starts: Vec<u32> = Vec::new();
        for (j, &t) in order.iter().enumerate() {
            let id = ids_host[t as usize];
            if distinct.last() != Some(&id) {
                distinct.push(id);
                starts.push(j as u32);
            }
        }
        starts.push(order.len() as u32);
        if distinct.is_empty() {
            return Ok(());
        }
        let (distinct_buf, starts_buf, order_buf) = (
            self.upload_index_to(&distinct)?,
            self.upload_index_to(&starts)?,
            self.upload_index_to(&order)?,
        );
        self.launch(
            Module::Elementwise,
            "embedding_backward",
            self.rows_cols(distinct.len(), dim),
            &[
                self.p(dtable),
                self.p(dout),
                ddt,
                self.p(&distinct_buf),
                self.p(&starts_buf),
                self.p(&order_buf),
                int(OP, "ids", distinct.len())?,
                int(OP, "dim", dim)?,
            ],
        )
    }

    // ---- RMSNorm ---------------------------------------------------------------------

    fn rmsnorm_forward(
        &self,
        out: &mut CudaBuf,
        rstd: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_forward";
        let odt = float(OP, "out", out)?;
        need(OP, "rstd", rstd, BufKind::Full)?;
        let xdt = float(OP, "x", x)?;
        let wdt = float(OP, "w", w)?;
        contract::rmsnorm_forward(out.len, rstd.len, x.len, w.len, rows, dim)?;
        self.launch(
            Module::NormRope,
            "rmsnorm_forward",
            self.warp_rows(rows),
            &[
                self.p(out),
                odt,
                self.p(rstd),
                Arg::I32(1),
                self.p(x),
                xdt,
                self.p(w),
                wdt,
                int(OP, "rows", rows)?,
                int(OP, "dim", dim)?,
                Arg::F32(eps),
            ],
        )
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CudaBuf,
        dw: &mut CudaBuf,
        dout: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        rstd: &CudaBuf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_backward";
        let dxdt = float(OP, "dx", dx)?;
        need(OP, "dw", dw, BufKind::Full)?;
        let ddt = float(OP, "dout", dout)?;
        let xdt = float(OP, "x", x)?;
        let wdt = float(OP, "w", w)?;
        need(OP, "rstd", rstd, BufKind::Full)?;
        contract::rmsnorm_backward(dx.len, dw.len, dout.len, x.len, w.len, rstd.len, rows, dim)?;
        self.launch(
            Module::NormRope,
            "rmsnorm_backward_dx",
            self.warp_rows(rows),
            &[
                self.p(dx),
                dxdt,
                self.p(dout),
                ddt,
                self.p(x),
                xdt,
                self.p(w),
                wdt,
                self.p(rstd),
                Arg::I32(1),
                int(OP, "rows", rows)?,
                int(OP, "dim", dim)?,
            ],
        )?;
        self.column_sum(dw, dout, Some(x), Some(rstd), rows, dim)
    }

    // ---- RoPE ------------------------------------------------------------------------

    fn rope(
        &self,
        x: &mut CudaBuf,
        positions: &CudaBuf,
        inv_freq: &CudaBuf,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "rope";
        let xdt = float(OP, "x", x)?;
        need(OP, "positions", positions, BufKind::Index)?;
        need(OP, "inv_freq", inv_freq, BufKind::Full)?;
        contract::rope(x.len, positions.len, inv_freq.len, tokens, heads, head_dim)?;
        self.launch(
            Module::NormRope,
            "rope",
            self.grid_1d(tokens * heads * head_dim / 2, 256),
            &[
                self.p(x),
                xdt,
                self.p(positions),
                self.p(inv_freq),
                int(OP, "tokens", tokens)?,
                int(OP, "heads", heads)?,
                int(OP, "head_dim", head_dim)?,
                Arg::I32(inverse as i32),
            ],
        )
    }

    fn qk_norm_rope(
        &self,
        q: NormedHeads<'_, Self>,
        k: NormedHeads<'_, Self>,
        positions: &CudaBuf,
        inv_freq: &CudaBuf,
        tokens: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "qk_norm_rope";
        need(OP, "positions", positions, BufKind::Index)?;
        need(OP, "inv_freq", inv_freq, BufKind::Full)?;
        let mut args = Vec::with_capacity(22);
        for side in [&q, &k] {
            args.extend([
                self.p(side.out),
                float(OP, "out", side.out)?,
                self.p(side.rstd),
                self.p(side.raw),
                float(OP, "raw", side.raw)?,
                self.p(side.norm),
                float(OP, "norm", side.norm)?,
                int(OP, "heads", side.heads)?,
            ]);
            need(OP, "rstd", side.rstd, BufKind::Full)?;
            contract::qk_norm_rope_side(
                side.out.len,
                side.rstd.len,
                side.raw.len,
                side.norm.len,
                positions.len,
                inv_freq.len,
                tokens,
                side.heads,
                head_dim,
            )?;
        }
        args.extend([
            self.p(positions),
            self.p(inv_freq),
            int(OP, "tokens", tokens)?,
            int(OP, "head_dim", head_dim)?,
            Arg::F32(eps),
        ]);
        let rows = tokens * (q.heads + k.heads);
        self.launch(
            Module::NormRope,
            "qk_norm_rope",
            self.warp_rows(rows),
            &args,
        )
    }

    // ---- attention over packed segments ----------------------------------------------

    fn attention_forward(
        &self,
        out: &mut CudaBuf,
        lse: &mut CudaBuf,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &[Segment],
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_forward";
        compute_args(OP, &[("q", q), ("k", k), ("v", v), ("out", out)])?;
        need(OP, "lse", lse, BufKind::Full)?;
        contract::attention_forward(out.len, lse.len, q.len, k.len, v.len, segments, shape)?;
        supported_head_dim(OP, shape.head_dim)?;
        let AttnShape {
            q_heads,
            kv_heads,
            head_dim,
            scale,
            ..
        } = shape;
        let lists = work_lists(segments, false);
        if lists.n_query_tiles() == 0 {
            return Ok(());
        }
        let mut held = self.uploaded_lists();
        let segs = held.upload("attention.segs", &lists.segs)?;
        let items = held.upload("attention.query_tiles", &lists.query_tiles)?;
        let kernel = attention_kernel("attention_forward", head_dim);
        self.launch(
            Module::Attention,
            kernel,
            LaunchConfig {
                grid_dim: (lists.n_query_tiles() as u32, q_heads as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: forward_shared_bytes(head_dim),
            },
            &[
                self.p(out),
                self.p(lse),
                self.p(q),
                self.p(k),
                self.p(v),
                segs,
                items,
                int(OP, "q_heads", q_heads)?,
                int(OP, "kv_heads", kv_heads)?,
                Arg::F32(scale),
            ],
        )
    }

    fn attention_backward(
        &self,
        dq: &mut CudaBuf,
        dk: &mut CudaBuf,
        dv: &mut CudaBuf,
        dout: &CudaBuf,
        out: &CudaBuf,
        lse: &CudaBuf,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &[Segment],
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        compute_args(
            OP,
            &[
                ("dq", dq),
                ("dk", dk),
                ("dv", dv),
                ("dout", dout),
                ("out", out),
                ("q", q),
                ("k", k),
                ("v", v),
            ],
        )?;
        need(OP, "lse", lse, BufKind::Full)?;
        contract::attention_backward(
            dq.len, dk.len, dv.len, dout.len, out.len, lse.len, q.len, k.len, v.len, segments,
            shape,
        )?;
        supported_head_dim(OP, shape.head_dim)?;
        let AttnShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            scale,
        } = shape;
        let lists = work_lists(segments, true);
        self.fill_zero(dq)?;
        self.fill_zero(dk)?;
        self.fill_zero(dv)?;
        if lists.n_query_tiles() == 0 {
            return Ok(());
        }
        let mut held = self.uploaded_lists();
        let segs = held.upload("attention.segs", &lists.segs)?;
        let items = held.upload("attention.query_tiles", &lists.query_tiles)?;
        let key_tiles = held.upload("attention.key_tiles", &lists.key_tiles)?;
        let tile_ranges = held.upload("attention.tile_ranges", &lists.tile_ranges)?;
        let ranges = held.upload("attention.ranges", &lists.ranges)?;
        let rows = tokens * q_heads;
        let delta = self.alloc(rows, BufKind::Full)?;
        self.launch(
            Module::Attention,
            "attention_backward_delta",
            self.warp_rows(rows),
            &[
                self.p(&delta),
                self.p(dout),
                self.p(out),
                i64_arg(rows),
                int(OP, "head_dim", head_dim)?,
            ],
        )?;
        let heads = [
            int(OP, "q_heads", q_heads)?,
            int(OP, "kv_heads", kv_heads)?,
            Arg::F32(scale),
        ];
        let dq_kernel = attention_kernel("attention_backward_dq", head_dim);
        let mut args = vec![
            self.p(dq),
            self.p(dout),
            self.p(lse),
            self.p(&delta),
            self.p(q),
            self.p(k),
            self.p(v),
            segs,
            items,
        ];
        args.extend(heads);
        self.launch(
            Module::Attention,
            dq_kernel,
            LaunchConfig {
                grid_dim: (lists.n_query_tiles() as u32, q_heads as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: forward_shared_bytes(head_dim),
            },
            &args,
        )?;
        let dkdv_kernel = attention_kernel("attention_backward_dkdv", head_dim);
        let mut args = vec![
            self.p(dk),
            self.p(dv),
            self.p(dout),
            self.p(lse),
            self.p(&delta),
            self.p(q),
            self.p(k),
            self.p(v),
            segs,
            key_tiles,
            tile_ranges,
            ranges,
        ];
        args.extend(heads);
        self.launch(
            Module::Attention,
            dkdv_kernel,
            LaunchConfig {
                grid_dim: (lists.n_key_tiles() as u32, kv_heads as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: dkdv_shared_bytes(head_dim),
            },
            &args,
        )
    }

    // ---- paged KV cache (sampling) ---------------------------------------------------

    fn kv_cache_write(
        &self,
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        slots: &CudaBuf,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        const OP: &str = "kv_cache_write";
        need(OP, "slots", slots, BufKind::Index)?;
        compute_args(
            OP,
            &[
                ("k_cache", k_cache),
                ("v_cache", v_cache),
                ("k", k),
                ("v", v),
            ],
        )?;
        contract::kv_cache_write(
            k_cache.len,
            v_cache.len,
            k.len,
            v.len,
            Ids::Device(slots.len),
            kv_heads,
            head_dim,
        )?;
        let row = kv_heads * head_dim;
        self.launch(
            Module::Attention,
            "kv_cache_write",
            self.rows_cols(slots.len, row),
            &[
                self.p(k_cache),
                self.p(v_cache),
                self.p(k),
                self.p(v),
                self.p(slots),
                int(OP, "tokens", slots.len)?,
                int(OP, "row", row)?,
            ],
        )
    }

    fn paged_attention(
        &self,
        out: &mut CudaBuf,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        layout: &PagedLayout<'_, Self>,
        shape: AttnShape,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        compute_args(
            OP,
            &[
                ("out", out),
                ("q", q),
                ("k_cache", k_cache),
                ("v_cache", v_cache),
            ],
        )?;
        need(OP, "block_tables", layout.block_tables, BufKind::Index)?;
        need(OP, "token_seq", layout.token_seq, BufKind::Index)?;
        need(OP, "token_pos", layout.token_pos, BufKind::Index)?;
        let lens = PagedLens {
            block_tables: layout.block_tables.len,
            max_blocks: layout.max_blocks,
            block_size: layout.block_size,
            token_seq: layout.token_seq.len,
            token_pos: Ids::Device(layout.token_pos.len),
            max_context: layout.max_context,
            runs: layout.runs,
            shared: layout.shared,
        };
        contract::paged_attention(out.len, q.len, k_cache.len, v_cache.len, lens, shape)?;
        supported_head_dim(OP, shape.head_dim)?;
        let AttnShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            scale,
        } = shape;
        let work = attention::paged_work(layout.runs, tokens);
        let mut held = self.uploaded_lists();
        let int_args = [
            int(OP, "max_blocks", layout.max_blocks)?,
            int(OP, "block_size", layout.block_size)?,
            int(OP, "q_heads", q_heads)?,
            int(OP, "kv_heads", kv_heads)?,
        ];
        if !work.prefill_tiles.is_empty() {
            let items = held.upload("paged.prefill_tiles", &work.prefill_tiles)?;
            let mut args = vec![
                self.p(out),
                self.p(q),
                self.p(k_cache),
                self.p(v_cache),
                self.p(layout.block_tables),
                self.p(layout.token_seq),
                self.p(layout.token_pos),
                items,
            ];
            args.extend(int_args);
            args.push(Arg::F32(scale));
            self.launch(
                Module::Attention,
                attention_kernel("paged_prefill_attention", head_dim),
                LaunchConfig {
                    grid_dim: ((work.prefill_tiles.len() / 2) as u32, q_heads as u32, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: forward_shared_bytes(head_dim),
                },
                &args,
            )?;
        }
        // The warp kernel takes the other tokens: all of them (no list), or those listed.
        let (decode_tokens, token_list_arg) = match &work.decode_tokens {
            None => (tokens, Arg::Ptr(0)),
            Some(list) if list.is_empty() => return Ok(()),
            Some(list) => (list.len(), held.upload("paged.token_list", list)?),
        };
        let group = q_heads / kv_heads;
        let blocks_per_token = kv_heads * group.div_ceil(attention::PAGED_MAX_GROUP);
        let cascade = if self.cascade {
            attention::cascade(layout.shared, work.decode_tokens.as_deref(), tokens, group)
        } else {
            None
        };
        // Splits of each token's keys, and the partial slots a token needs.
        let (splits, split_len, slots) = match &cascade {
            None => {
                let (splits, split_len) = attention::paged_splits(
                    decode_tokens,
                    blocks_per_token,
                    layout.max_context,
                    self.sm_count as usize,
                );
                (splits, split_len, splits)
            }
            Some(c) => c.splits(kv_heads, layout.max_context, self.sm_count as usize),
        };
        // Partials (more than one slot, or a cascade) are unnormalised accumulators that
        // the combine pass merges: per row of the listed tokens, `head_dim` of them per
        // slot, then (max, sum) pairs after all rows' accumulators.
        let rows = decode_tokens * q_heads;
        let mut partials = self.paged_partials.lock().expect("poisoned");
        let with_partials = slots > 1 || cascade.is_some();
        let (acc, ml) = if with_partials {
            let need = rows * slots * (head_dim + 2);
            if partials.as_ref().is_none_or(|b| b.len < need) {
                // The old buffer is freed in stream order, after the kernels that still
                // read it; allocated first, so that a capture (where allocations fail)
                // frees nothing.
                *partials = Some(self.alloc(need, BufKind::Full)?);
            }
            let base = self.ptr(partials.as_ref().expect("allocated above"));
            let ml_offset = (rows * slots * head_dim * std::mem::size_of::<f32>()) as u64;
            (Arg::Ptr(base), Arg::Ptr(base + ml_offset))
        } else {
            (Arg::Ptr(0), Arg::Ptr(0))
        };
        let key_start_arg = match &cascade {
            Some(c) => held.upload("paged.key_start", &c.key_start)?,
            None => Arg::Ptr(0),
        };
        let split_args = [
            int(OP, "split_len", split_len)?,
            int(OP, "slots", slots)?,
            Arg::F32(scale),
        ];
        if let Some(c) = &cascade {
            let items = held.upload("paged.cascade_items", &c.items)?;
            let mut args = vec![
                acc,
                ml,
                self.p(q),
                self.p(k_cache),
                self.p(v_cache),
                self.p(layout.block_tables),
                self.p(layout.token_seq),
                token_list_arg,
                items,
            ];
            args.extend(int_args);
            args.extend(split_args);
            self.launch(
                Module::Attention,
                attention_kernel("paged_cascade_attention", head_dim),
                LaunchConfig {
                    grid_dim: (
                        (c.items.len() / 4) as u32,
                        kv_heads as u32,
                        c.max_keys.div_ceil(split_len) as u32,
                    ),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: forward_shared_bytes(head_dim),
                },
                &args,
            )?;
        }
        let mut args = vec![
            self.p(out),
            acc,
            ml,
            self.p(q),
            self.p(k_cache),
            self.p(v_cache),
            self.p(layout.block_tables),
            self.p(layout.token_seq),
            self.p(layout.token_pos),
            token_list_arg,
            key_start_arg,
        ];
        args.extend(int_args);
        args.extend(split_args);
        self.launch(
            Module::Attention,
            attention::paged_decode_kernel(head_dim, group),
            cfg(
                (decode_tokens as u32, blocks_per_token as u32, splits as u32),
                32 * attention::PAGED_WARPS as u32,
            ),
            &args,
        )?;
        if with_partials {
            let warps = 4;
            self.launch(
                Module::Attention,
                "paged_attention_combine",
                cfg((rows.div_ceil(warps) as u32, 1, 1), 32 * warps as u32),
                &[
                    self.p(out),
                    acc,
                    ml,
                    self.p(layout.token_pos),
                    token_list_arg,
                    key_start_arg,
                    int(OP, "tokens", decode_tokens)?,
                    int(OP, "q_heads", q_heads)?,
                    int(OP, "slots", slots)?,
                    int(OP, "split_len", split_len)?,
                    int(OP, "head_dim", head_dim)?,
                ],
            )?;
        }
        Ok(())
    }

    // ---- SwiGLU ----------------------------------------------------------------------

    fn swiglu_forward(&self, out: &mut CudaBuf, gate: &CudaBuf, up: &CudaBuf) -> Result<()> {
        const OP: &str = "swiglu_forward";
        let odt = float(OP, "out", out)?;
        let gdt = float(OP, "gate", gate)?;
        let udt = float(OP, "up", up)?;
        contract::swiglu_forward(out.len, gate.len, up.len)?;
        self.launch(
            Module::Elementwise,
            "swiglu_forward",
            self.grid_1d(out.len, 256),
            &[
                self.p(out),
                odt,
                self.p(gate),
                gdt,
                self.p(up),
                udt,
                i64_arg(out.len),
            ],
        )
    }

    fn swiglu_backward(
        &self,
        dgate: &mut CudaBuf,
        dup: &mut CudaBuf,
        dout: &CudaBuf,
        gate: &CudaBuf,
        up: &CudaBuf,
    ) -> Result<()> {
        const OP: &str = "swiglu_backward";
        let dgdt = float(OP, "dgate", dgate)?;
        let dudt = float(OP, "dup", dup)?;
        let ddt = float(OP, "dout", dout)?;
        let gdt = float(OP, "gate", gate)?;
        let udt = float(OP, "up", up)?;
        contract::swiglu_backward(dgate.len, dup.len, dout.len, gate.len, up.len)?;
        let n = gate.len;
        self.launch(
            Module::Elementwise,
            "swiglu_backward",
            self.grid_1d(n, 256),
            &[
                self.p(dgate),
                dgdt,
                self.p(dup),
                dudt,
                self.p(dout),
                ddt,
                self.p(gate),
                gdt,
                self.p(up),
                udt,
                i64_arg(n),
            ],
        )
    }

    // ---- fused lm-head ---------------------------------------------------------------

    fn lm_head_forward(
        &self,
        logprobs: &mut CudaBuf,
        entropy: &mut CudaBuf,
        lse: &mut CudaBuf,
        hidden: &CudaBuf,
        w: &CudaBuf,
        targets: &CudaBuf,
        spec: LmHead,
    ) -> Result<()> {
        const OP: &str = "lm_head_forward";
        lm_head_kinds(OP, hidden, w, targets)?;
        for (name, b) in [
            ("logprobs", &*logprobs),
            ("entropy", &*entropy),
            ("lse", &*lse),
        ] {
            float(OP, name, b)?;
        }
        contract::lm_head_forward(
            logprobs.len,
            entropy.len,
            lse.len,
            hidden.len,
            w.len,
            Ids::Device(targets.len),
            spec,
        )?;
        let chunk = spec.chunk_rows.min(spec.tokens);
        if chunk == 0 {
            return Ok(());
        }
        let logits = self.alloc(chunk * spec.vocab, BufKind::Full)?;
        let elem = super::element_bytes(hidden.kind) as u64;
        for start in (0..spec.tokens).step_by(spec.chunk_rows) {
            let rows = spec.chunk_rows.min(spec.tokens - start);
            self.gemm(
                (self.ptr(&logits), BufKind::Full),
                (
                    self.ptr(hidden) + (start * spec.dim) as u64 * elem,
                    hidden.kind,
                ),
                (self.ptr(w), w.kind),
                Matmul {
                    m: rows,
                    n: spec.vocab,
                    k: spec.dim,
                    trans_a: false,
                    trans_b: true,
                },
                spec.logit_scale,
                0.0,
            )?;
            self.launch(
                Module::LmHead,
                "lm_head_forward_rows",
                cfg((rows as u32, 1, 1), ROW_THREADS),
                &[
                    self.p(logprobs),
                    Arg::I32(dtype_code(logprobs.kind)),
                    self.p(entropy),
                    Arg::I32(dtype_code(entropy.kind)),
                    self.p(lse),
                    Arg::I32(dtype_code(lse.kind)),
                    self.p(&logits),
                    self.p(targets),
                    int(OP, "vocab", spec.vocab)?,
                    int(OP, "start", start)?,
                ],
            )?;
        }
        Ok(())
    }

    fn lm_head_backward(
        &self,
        dhidden: &mut CudaBuf,
        dw: &mut CudaBuf,
        dlogprobs: &CudaBuf,
        dentropy: &CudaBuf,
        hidden: &CudaBuf,
        w: &CudaBuf,
        targets: &CudaBuf,
        lse: &CudaBuf,
        spec: LmHead,
    ) -> Result<()> {
        const OP: &str = "lm_head_backward";
        lm_head_kinds(OP, hidden, w, targets)?;
        float(OP, "dhidden", dhidden)?;
        need(OP, "dw", dw, BufKind::Full)?;
        for (name, b) in [
            ("dlogprobs", dlogprobs),
            ("dentropy", dentropy),
            ("lse", lse),
        ] {
            float(OP, name, b)?;
        }
        if hidden.kind != BufKind::Compute {
            // d logits is bf16, and cuBLAS multiplies like types only.
            return Err(Error::Kind {
                op: OP,
                arg: "hidden",
                expected: BufKind::Compute,
                got: hidden.kind,
            });
        }
        contract::lm_head_backward(
            dhidden.len,
            dw.len,
            dlogprobs.len,
            dentropy.len,
            hidden.len,
            w.len,
            Ids::Device(targets.len),
            lse.len,
            spec,
        )?;
        let chunk = spec.chunk_rows.min(spec.tokens);
        if chunk == 0 {
            return Ok(());
        }
        let logits = self.alloc(chunk * spec.vocab, BufKind::Full)?;
        let dlogits = self.alloc(chunk * spec.vocab, BufKind::Compute)?;
        let h_elem = super::element_bytes(hidden.kind) as u64;
        let dh_elem = super::element_bytes(dhidden.kind) as u64;
        for start in (0..spec.tokens).step_by(spec.chunk_rows) {
            let rows = spec.chunk_rows.min(spec.tokens - start);
            let h_chunk = self.ptr(hidden) + (start * spec.dim) as u64 * h_elem;
            self.gemm(
                (self.ptr(&logits), BufKind::Full),
                (h_chunk, hidden.kind),
                (self.ptr(w), w.kind),
                Matmul {
                    m: rows,
                    n: spec.vocab,
                    k: spec.dim,
                    trans_a: false,
                    trans_b: true,
                },
                spec.logit_scale,
                0.0,
            )?;
            self.launch(
                Module::LmHead,
                "lm_head_backward_rows",
                cfg((rows as u32, 1, 1), ROW_THREADS),
                &[
                    self.p(&dlogits),
                    self.p(&logits),
                    self.p(lse),
                    Arg::I32(dtype_code(lse.kind)),
                    self.p(dlogprobs),
                    Arg::I32(dtype_code(dlogprobs.kind)),
                    self.p(dentropy),
                    Arg::I32(dtype_code(dentropy.kind)),
                    self.p(targets),
                    int(OP, "vocab", spec.vocab)?,
                    int(OP, "start", start)?,
                    Arg::F32(spec.logit_scale),
                ],
            )?;
            // dhidden[chunk] = dlogits · w
            self.gemm(
                (
                    self.ptr(dhidden) + (start * spec.dim) as u64 * dh_elem,
                    dhidden.kind,
                ),
                (self.ptr(&dlogits), BufKind::Compute),
                (self.ptr(w), w.kind),
                Matmul {
                    m: rows,
                    n: spec.dim,
                    k: spec.vocab,
                    trans_a: false,
                    trans_b: false,
                },
                1.0,
                0.0,
            )?;
            // dw += dlogitsᵀ · hidden[chunk]
            self.gemm(
                (self.ptr(dw), BufKind::Full),
                (self.ptr(&dlogits), BufKind::Compute),
                (h_chunk, hidden.kind),
                Matmul {
                    m: spec.vocab,
                    n: spec.dim,
                    k: rows,
                    trans_a: true,
                    trans_b: false,
                },
                1.0,
                1.0,
            )?;
        }
        Ok(())
    }

    // ---- sampling --------------------------------------------------------------------

    fn sample(&self, logits: &CudaBuf, vocab: usize, rows: &[SamplingRow]) -> Result<Vec<Sampled>> {
        const OP: &str = "sample";
        let dt = float(OP, "logits", logits)?;
        contract::sample(logits.len, vocab, rows.len())?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let n = rows.len();
        let temperature: Vec<f32> = rows.iter().map(|r| r.temperature).collect();
        let top_k: Vec<i32> = rows.iter().map(|r| r.top_k).collect();
        let top_p: Vec<f32> = rows.iter().map(|r| r.top_p).collect();
        let min_p: Vec<f32> = rows.iter().map(|r| r.min_p).collect();
        // The draw's uniform comes from the same function the CPU uses.
        let uniforms: Vec<f64> = rows
            .iter()
            .map(|r| sampling::uniform(r.seed, r.offset))
            .collect();
        let s = &self.stream;
        let temperature = s.clone_htod(&temperature)?;
        let top_k = s.clone_htod(&top_k)?;
        let top_p = s.clone_htod(&top_p)?;
        let min_p = s.clone_htod(&min_p)?;
        let uniforms = s.clone_htod(&uniforms)?;
        let tokens = s.alloc_zeros::<u32>(n)?;
        let logprobs = s.alloc_zeros::<f32>(n)?;
        let ptr = |x: u64| Arg::Ptr(x);
        use cudarc::driver::DevicePtr;
        self.launch(
            Module::Sampling,
            "sample_rows",
            cfg((n as u32, 1, 1), 1024),
            &[
                ptr(tokens.device_ptr(s).0),
                ptr(logprobs.device_ptr(s).0),
                self.p(logits),
                dt,
                int(OP, "vocab", vocab)?,
                ptr(temperature.device_ptr(s).0),
                ptr(top_k.device_ptr(s).0),
                ptr(top_p.device_ptr(s).0),
                ptr(min_p.device_ptr(s).0),
                ptr(uniforms.device_ptr(s).0),
            ],
        )?;
        let tokens = s.clone_dtoh(&tokens)?;
        let logprobs = s.clone_dtoh(&logprobs)?;
        s.synchronize()?;
        let mut sampled: Vec<Sampled> = tokens
            .into_iter()
            .zip(logprobs)
            .map(|(token, logprob)| Sampled {
                token,
                logprob,
                top_logprobs: Vec::new(),
            })
            .collect();
        // The rows that ask for top log-probs (OpenAI clients, rarely) get them on the
        // host from their downloaded logits, by the reference code; other rows pay nothing.
        for (r, row) in rows.iter().enumerate() {
            if row.top_logprobs == 0 {
                continue;
            }
            let row_logits = self.download_range(logits, r * vocab, vocab)?;
            let sampled = &mut sampled[r];
            sampled.top_logprobs = sampling::top_logprobs(&row_logits, row);
            // The host's log-sum-exp adds in another order than the kernel's: the sampled
            // token's entry takes the kernel's value, which the trainer compares against.
            for top in &mut sampled.top_logprobs {
                if top.0 == sampled.token {
                    top.1 = sampled.logprob;
                }
            }
        }
        Ok(sampled)
    }

    // ---- optimizer -------------------------------------------------------------------

    fn adamw(
        &self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        compute: Option<&mut CudaBuf>,
        hp: AdamW,
    ) -> Result<()> {
        const OP: &str = "adamw";
        for (name, b) in [("param", &*param), ("grad", grad), ("m", &*m), ("v", &*v)] {
            need(OP, name, b, BufKind::Full)?;
        }
        let compute = match compute {
            Some(c) => Some((float(OP, "compute", c)?, c)),
            None => None,
        };
        let n = param.len;
        let n_compute = compute.as_ref().map(|(_, c)| c.len);
        contract::adamw(n, grad.len, m.len, v.len, n_compute, &hp)?;
        let (cptr, cdt) = match compute {
            Some((cdt, c)) => (self.p(c), cdt),
            None => (Arg::Ptr(0), Arg::I32(0)),
        };
        let step = i32::try_from(hp.step).unwrap_or(i32::MAX);
        let bias1 = 1.0 - f64::from(hp.beta1).powi(step);
        let bias2 = 1.0 - f64::from(hp.beta2).powi(step);
        self.launch(
            Module::Elementwise,
            "adamw",
            self.grid_1d(n, 256),
            &[
                self.p(param),
                self.p(grad),
                Arg::I32(1),
                self.p(m),
                self.p(v),
                cptr,
                cdt,
                Arg::F32(hp.lr),
                Arg::F32(hp.beta1),
                Arg::F32(hp.beta2),
                Arg::F32(hp.eps),
                Arg::F32(hp.weight_decay),
                Arg::F32(hp.grad_scale),
                Arg::F32(bias1 as f32),
                Arg::F32(bias2 as f32),
                i64_arg(n),
            ],
        )
    }

    fn adamw_host(
        &self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        hp: AdamW,
    ) -> Result<()> {
        const OP: &str = "adamw_host";
        self.eager_only(OP)?;
        need(OP, "grad", grad, BufKind::Full)?;
        float(OP, "param", param)?;
        contract::adamw_host(param.len, grad.len, master.len(), m.len(), v.len(), &hp)?;
        let terms = AdamWTerms::new(&hp);
        let Storage::F32(g) = &grad.storage else {
            unreachable!("a Full buffer holds f32")
        };
        match &mut param.storage {
            Storage::Bf16(p) => self.adamw_host_streamed(p, g, master, m, v, &terms),
            // Full weights (a LoRA adapter's masters): small, sent whole.
            Storage::F32(p) => {
                let g = self.stream.clone_dtoh(g)?;
                host_adamw::step(&terms, master, &g, m, v, Rounded::None);
                self.stream.memcpy_htod(&*master, p)?;
                Ok(())
            }
            Storage::U32(_) => unreachable!("checked by `float`"),
        }
    }
}

impl CudaBackend {
    /// Elements `start..start + len` of float `buf`, as f32.
    fn download_range(&self, buf: &CudaBuf, start: usize, len: usize) -> Result<Vec<f32>> {
        self.eager_only("a download")?;
        let range = start..start + len;
        let out = match &buf.storage {
            Storage::Bf16(s) => {
                let mut bits = vec![0u16; len];
                self.stream.memcpy_dtoh(&s.slice(range), &mut bits)?;
                self.stream.synchronize()?;
                bits.into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect()
            }
            Storage::F32(s) => {
                let mut v = vec![0f32; len];
                self.stream.memcpy_dtoh(&s.slice(range), &mut v)?;
                self.stream.synchronize()?;
                v
            }
            Storage::U32(_) => {
                return Err(Error::Kind {
                    op: "download_range",
                    arg: "buf",
                    expected: BufKind::Full,
                    got: BufKind::Index,
                })
            }
        };
        Ok(out)
    }

    /// [`Backend::adamw_host`] for a bf16 `param`: chunk by chunk, the gradient comes down
    /// into one page-locked buffer while the host updates the chunk before it and the
    /// chunk before that goes up, all queued on the one stream.
    fn adamw_host_streamed(
        &self,
        param: &mut cudarc::driver::CudaSlice<u16>,
        grad: &cudarc::driver::CudaSlice<f32>,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        terms: &AdamWTerms,
    ) -> Result<()> {
        let n = master.len();
        let chunks: Vec<(usize, usize)> = (0..n)
            .step_by(STAGING_CHUNK)
            .map(|start| (start, (start + STAGING_CHUNK).min(n)))
            .collect();
        self.with_host_staging(|staging| {
            let stream = &self.stream;
            let download = |staging: &mut HostStaging, c: usize| -> Result<()> {
                let (start, end) = chunks[c];
                let slot = &mut staging.grads[c % 2];
                let host = &mut slot.buf.as_mut_slice()?[..end - start];
                stream.memcpy_dtoh(&grad.slice(start..end), host)?;
                slot.done.record(stream)?;
                Ok(())
            };
            download(staging, 0)?;
            for (c, &(start, end)) in chunks.iter().enumerate() {
                if c + 1 < chunks.len() {
                    download(staging, c + 1)?;
                }
                let HostStaging { grads, weights } = staging;
                let (down, up) = (&mut grads[c % 2], &mut weights[c % 2]);
                down.done.synchronize()?;
                // The weights this buffer sent two chunks ago must be on the device.
                up.done.synchronize()?;
                let g = &down.buf.as_mut_slice()?[..end - start];
                let bits = &mut up.buf.as_mut_slice()?[..end - start];
                host_adamw::step(
                    terms,
                    &mut master[start..end],
                    g,
                    &mut m[start..end],
                    &mut v[start..end],
                    Rounded::Bf16(bits),
                );
                stream.memcpy_htod(&*bits, &mut param.slice_mut(start..end))?;
                up.done.record(stream)?;
            }
            // The buffers outlive this call, but a later one must not find its chunks still
            // in flight unordered with the host's writes: the events above order them.
            Ok(())
        })
    }
}

/// Checks the kinds of the arguments the two lm-head ops share.
fn lm_head_kinds(op: &'static str, hidden: &CudaBuf, w: &CudaBuf, targets: &CudaBuf) -> Result<()> {
    float(op, "hidden", hidden)?;
    float(op, "w", w)?;
    need(op, "targets", targets, BufKind::Index)?;
    if hidden.kind != w.kind {
        return Err(Error::Kind {
            op,
            arg: "w",
            expected: hidden.kind,
            got: w.kind,
        });
    }
    Ok(())
}
