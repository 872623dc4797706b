//! GEMMs through cuBLASLt, where the algorithm is ours to pick: `FLOE_GEMM=lt` takes the
//! heuristic's first choice per shape, `FLOE_GEMM=lt-tuned` times the heuristic's top
//! candidates once per shape of at most [`TUNED_MAX_ROWS`] rows (the decode projections,
//! where cuBLAS's default leaves most SMs idle) and keeps the fastest. The default stays
//! `cublasGemmEx` until the device says otherwise.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::sys;
use cudarc::driver::CudaStream;

use crate::{BufKind, Error, Matmul, Result};

/// Candidates asked of the heuristic when tuning.
const CANDIDATES: usize = 8;
/// Shapes with more rows than this keep the heuristic's choice: training's packed
/// batches vary in rows from step to step, and tuning each would cost more than it saves.
pub(crate) const TUNED_MAX_ROWS: usize = 256;

/// Which GEMM path a backend takes (`FLOE_GEMM`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmPath {
    /// `cublasGemmEx` with the default algorithm.
    Blas,
    /// cuBLASLt, the heuristic's first algorithm.
    Lt,
    /// cuBLASLt, the fastest of the heuristic's candidates, timed once per shape.
    LtTuned,
}

impl GemmPath {
    /// From `FLOE_GEMM` (`blas`, the default when unset, `lt` or `lt-tuned`); any other
    /// value is an error that names the variable, not a silent default.
    pub(crate) fn from_env() -> Result<Self> {
        match std::env::var("FLOE_GEMM") {
            Err(_) => Ok(GemmPath::Blas),
            Ok(v) => match v.as_str() {
                "" | "blas" => Ok(GemmPath::Blas),
                "lt" => Ok(GemmPath::Lt),
                "lt-tuned" => Ok(GemmPath::LtTuned),
                _ => Err(Error::Cuda(format!(
                    "FLOE_GEMM={v:?}: expected blas, lt or lt-tuned"
                ))),
            },
        }
    }
}

fn check(status: sys::cublasStatus_t, what: &str) -> Result<()> {
    if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("cuBLASLt {what}: {status:?}")))
    }
}

/// One GEMM's operand types, transposes and sizes: what a plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    dims: (usize, usize, usize, bool, bool),
    ab: BufKind,
    c: BufKind,
}

/// A shape's descriptors and chosen algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// Layouts of cuBLASLt's A (our `b`), B (our `a`) and C/D, column-major.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: made by `Plan::new` and used by no one after the plan.
        unsafe {
            if !self.desc.is_null() {
                sys::cublasLtMatmulDescDestroy(self.desc);
            }
            for layout in self.layouts.into_iter().filter(|l| !l.is_null()) {
                sys::cublasLtMatrixLayoutDestroy(layout);
            }
        }
    }
}

/// The row-major operands of one call: device addresses and the scalars.
#[derive(Clone, Copy)]
pub(crate) struct Operands {
    pub c: u64,
    pub a: u64,
    pub b: u64,
    pub alpha: f32,
    pub beta: f32,
}

/// A cuBLASLt handle and the plans of the shapes seen so far.
pub(crate) struct LtGemm {
    handle: sys::cublasLtHandle_t,
    plans: Mutex<HashMap<Key, Plan>>,
    tune: bool,
    workspace: (u64, usize),
}

// SAFETY: the handle and plans are used only under `plans`'s lock, on the owning
// backend's stream.
unsafe impl Send for LtGemm {}
// SAFETY: as above.
unsafe impl Sync for LtGemm {}

impl Drop for LtGemm {
    fn drop(&mut self) {
        self.plans.lock().expect("poisoned").clear();
        // SAFETY: every plan made with the handle is gone.
        unsafe { sys::cublasLtDestroy(self.handle) };
    }
}

fn data_type(kind: BufKind) -> sys::cudaDataType {
    match kind {
        BufKind::Full => sys::cudaDataType::CUDA_R_32F,
        _ => sys::cudaDataType::CUDA_R_16BF,
    }
}

impl LtGemm {
    /// A handle using `workspace` (address, bytes), which outlives it; `tune` times the
    /// candidates of small shapes.
    pub(crate) fn new(workspace: (u64, usize), tune: bool) -> Result<Self> {
        let mut handle = MaybeUninit::uninit();
        // SAFETY: writes the handle on success.
        let handle = unsafe {
            check(sys::cublasLtCreate(handle.as_mut_ptr()), "create")?;
            handle.assume_init()
        };
        Ok(Self {
            handle,
            plans: Mutex::new(HashMap::new()),
            tune,
            workspace,
        })
    }

    /// `C = alpha·op(A)·op(B) + beta·C`, row-major, as [`super::CudaBackend::gemm`]
    /// takes it; `ab` and `c` are the operands' kinds.
    pub(crate) fn gemm(
        &self,
        stream: &Arc<CudaStream>,
        ops: Operands,
        ab: BufKind,
        c: BufKind,
        dims: Matmul,
    ) -> Result<()> {
        let key = Key {
            dims: (dims.m, dims.n, dims.k, dims.trans_a, dims.trans_b),
            ab,
            c,
        };
        let mut plans = self.plans.lock().expect("poisoned");
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(stream, key, ops)?),
        };
        self.run(stream, plan, &plan.algo, ops, ops.c)
    }

    /// Descriptors for `key` and its algorithm: the heuristic's first, or when tuning a
    /// small shape the fastest of its candidates on these operands (written to a scratch
    /// output, so `C` is unchanged).
    fn plan(&self, stream: &Arc<CudaStream>, key: Key, ops: Operands) -> Result<Plan> {
        let (m, n, k, trans_a, trans_b) = key.dims;
        let op = |t: bool| {
            if t {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Row-major C[m,n] = A·B is column-major Cᵀ[n,m] = Bᵀ·Aᵀ: cuBLASLt's A is our b.
        // A column-major layout is (rows, cols, leading dimension) of the stored matrix.
        let lt_a = if trans_b { (k, n, k) } else { (n, k, n) };
        let lt_b = if trans_a { (m, k, m) } else { (k, m, k) };
        let lt_c = (n, m, n);
        // SAFETY: each create writes its out-pointer on success; attributes are plain
        // values of the documented types.
        unsafe {
            // Made empty first, so whatever is created below is destroyed on an error.
            let mut plan = Plan {
                desc: std::ptr::null_mut(),
                layouts: [std::ptr::null_mut(); 3],
                algo: std::mem::zeroed(),
            };
            check(
                sys::cublasLtMatmulDescCreate(
                    &mut plan.desc,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cudaDataType::CUDA_R_32F,
                ),
                "matmul desc",
            )?;
            let desc = plan.desc;
            let shapes = [(lt_a, key.ab), (lt_b, key.ab), (lt_c, key.c)];
            for (slot, ((rows, cols, ld), kind)) in plan.layouts.iter_mut().zip(shapes) {
                check(
                    sys::cublasLtMatrixLayoutCreate(
                        slot,
                        data_type(kind),
                        rows as u64,
                        cols as u64,
                        ld.max(1) as i64,
                    ),
                    "matrix layout",
                )?;
            }
            for (attr, value) in [
                (
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    op(trans_b),
                ),
                (
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    op(trans_a),
                ),
            ] {
                check(
                    sys::cublasLtMatmulDescSetAttribute(
                        desc,
                        attr,
                        &value as *const _ as *const c_void,
                        std::mem::size_of_val(&value),
                    ),
                    "transpose attribute",
                )?;
            }
            let candidates = self.candidates(
                &plan,
                if self.tune && m <= TUNED_MAX_ROWS {
                    CANDIDATES
                } else {
                    1
                },
            )?;
            plan.algo = if candidates.len() == 1 {
                candidates[0]
            } else {
                self.fastest(stream, &plan, &candidates, ops, key)?
            };
            Ok(plan)
        }
    }

    /// Up to `count` algorithms the heuristic offers for `plan`, best first.
    fn candidates(&self, plan: &Plan, count: usize) -> Result<Vec<sys::cublasLtMatmulAlgo_t>> {
        // SAFETY: the preference is destroyed before returning; results are written by
        // the heuristic for the first `returned` entries.
        unsafe {
            let mut pref = MaybeUninit::uninit();
            check(
                sys::cublasLtMatmulPreferenceCreate(pref.as_mut_ptr()),
                "preference",
            )?;
            let pref = pref.assume_init();
            let bytes = self.workspace.1 as u64;
            let set = check(
                sys::cublasLtMatmulPreferenceSetAttribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &bytes as *const u64 as *const c_void,
                    std::mem::size_of::<u64>(),
                ),
                "workspace preference",
            );
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
                vec![std::mem::zeroed(); count];
            let mut returned = 0i32;
            let [a, b, c] = plan.layouts;
            let found = set.and_then(|()| {
                check(
                    sys::cublasLtMatmulAlgoGetHeuristic(
                        self.handle,
                        plan.desc,
                        a,
                        b,
                        c,
                        c,
                        pref,
                        count as i32,
                        results.as_mut_ptr(),
                        &mut returned,
                    ),
                    "heuristic",
                )
            });
            sys::cublasLtMatmulPreferenceDestroy(pref);
            found?;
            let algos: Vec<_> = results[..returned.max(0) as usize]
                .iter()
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .collect();
            if algos.is_empty() {
                return Err(Error::Cuda("cuBLASLt: no algorithm for this GEMM".into()));
            }
            Ok(algos)
        }
    }

    /// The candidate that runs `ops` fastest (median of a few runs each, into a scratch
    /// output); synchronizes the stream.
    fn fastest(
        &self,
        stream: &Arc<CudaStream>,
        plan: &Plan,
        candidates: &[sys::cublasLtMatmulAlgo_t],
        ops: Operands,
        key: Key,
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let (m, n, _, _, _) = key.dims;
        // SAFETY: written by each run before anything reads it (nothing does).
        let scratch = unsafe {
            match key.c {
                BufKind::Full => ScratchOut::F32(stream.alloc::<f32>(m * n)?),
                _ => ScratchOut::Bf16(stream.alloc::<u16>(m * n)?),
            }
        };
        let d = scratch.ptr(stream);
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = (f32::INFINITY, candidates[0]);
        for algo in candidates {
            // A candidate the heuristic offered may still refuse these operands.
            if self.run(stream, plan, algo, ops, d).is_err() {
                continue;
            }
            let mut times = Vec::with_capacity(5);
            for _ in 0..5 {
                let start = stream.record_event(timing)?;
                self.run(stream, plan, algo, ops, d)?;
                let end = stream.record_event(timing)?;
                end.synchronize()?;
                times.push(start.elapsed_ms(&end)?);
            }
            times.sort_by(f32::total_cmp);
            if times[2] < best.0 {
                best = (times[2], *algo);
            }
        }
        Ok(best.1)
    }

    /// One cuBLASLt call of `plan` with `algo`, reading C at `ops.c`, writing D at `d`.
    fn run(
        &self,
        stream: &Arc<CudaStream>,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        ops: Operands,
        d: u64,
    ) -> Result<()> {
        let [a_layout, b_layout, c_layout] = plan.layouts;
        // SAFETY: the caller checked every operand's length against the plan's shape; the
        // workspace outlives the handle.
        unsafe {
            check(
                sys::cublasLtMatmul(
                    self.handle,
                    plan.desc,
                    &ops.alpha as *const f32 as *const c_void,
                    ops.b as *const c_void,
                    a_layout,
                    ops.a as *const c_void,
                    b_layout,
                    &ops.beta as *const f32 as *const c_void,
                    ops.c as *const c_void,
                    c_layout,
                    d as *mut c_void,
                    c_layout,
                    algo,
                    self.workspace.0 as *mut c_void,
                    self.workspace.1,
                    stream.cu_stream() as sys::cudaStream_t,
                ),
                "matmul",
            )
        }
    }
}

/// The tuning runs' output, freed after them in stream order.
enum ScratchOut {
    F32(cudarc::driver::CudaSlice<f32>),
    Bf16(cudarc::driver::CudaSlice<u16>),
}

impl ScratchOut {
    fn ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        use cudarc::driver::DevicePtr;
        match self {
            ScratchOut::F32(s) => s.device_ptr(stream).0,
            ScratchOut::Bf16(s) => s.device_ptr(stream).0,
        }
    }
}
