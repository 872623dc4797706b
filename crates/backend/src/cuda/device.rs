//! The device side of [`CudaBackend`]: context, stream, cuBLAS handle, buffers, the
//! NVRTC module cache, kernel launches and the GEMM wrapper.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{result as cublas_result, sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    sys as driver_sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::KernelTime;
use crate::{BufKind, Error, Matmul, Result};

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(format!("driver: {e}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for Error {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        Error::Cuda(format!("cuBLAS: {e:?}"))
    }
}

/// The storage behind a [`CudaBuf`], one variant per storage type.
pub(crate) enum Storage {
    /// [`BufKind::Compute`]: bf16, kept as raw `u16` bits.
    Bf16(CudaSlice<u16>),
    /// [`BufKind::Full`]: f32.
    F32(CudaSlice<f32>),
    /// [`BufKind::Index`]: u32.
    U32(CudaSlice<u32>),
}

/// A flat buffer in device memory: bf16 for Compute, f32 for Full, u32 for Index.
pub struct CudaBuf {
    pub(crate) storage: Storage,
    pub(crate) len: usize,
    pub(crate) kind: BufKind,
}

/// Element type code the kernels take next to each float pointer (`DT_BF16`, `DT_F32`).
pub(crate) fn dtype_code(kind: BufKind) -> i32 {
    match kind {
        BufKind::Full => 1,
        _ => 0,
    }
}

/// The kernel sources, one NVRTC program each, compiled on first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    Elementwise,
    NormRope,
    Attention,
    LmHead,
    Sampling,
}

const ALL_MODULES: [Module; 5] = [
    Module::Elementwise,
    Module::NormRope,
    Module::Attention,
    Module::LmHead,
    Module::Sampling,
];

const COMMON: &str = include_str!("kernels/common.cuh");

impl Module {
    fn source(self) -> &'static str {
        match self {
            Module::Elementwise => include_str!("kernels/elementwise.cu"),
            Module::NormRope => include_str!("kernels/norm_rope.cu"),
            Module::Attention => include_str!("kernels/attention.cu"),
            Module::LmHead => include_str!("kernels/lm_head.cu"),
            Module::Sampling => include_str!("kernels/sampling.cu"),
        }
    }

    fn file_name(self) -> &'static str {
        match self {
            Module::Elementwise => "elementwise.cu",
            Module::NormRope => "norm_rope.cu",
            Module::Attention => "attention.cu",
            Module::LmHead => "lm_head.cu",
            Module::Sampling => "sampling.cu",
        }
    }
}

/// The kernel lab's hook: with `FLOE_CUDA_KERNELS=DIR` set, a module whose file is in
/// `DIR` (e.g. `DIR/attention.cu`) compiles from there instead of the built-in source, so
/// variants of a kernel are timed on a GPU without rebuilding floe. The built-in
/// `common.cuh` stays; host code still launches the same kernel names and arguments.
fn lab_source(module: Module) -> Result<std::borrow::Cow<'static, str>> {
    let Some(dir) = std::env::var_os("FLOE_CUDA_KERNELS") else {
        return Ok(module.source().into());
    };
    let path = std::path::Path::new(&dir).join(module.file_name());
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            eprintln!(
                "floe: kernel lab: {} from {}",
                module.file_name(),
                path.display()
            );
            Ok(text.into())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(module.source().into()),
        Err(e) => Err(Error::Cuda(format!(
            "FLOE_CUDA_KERNELS: {}: {e}",
            path.display()
        ))),
    }
}

/// PTX per (module, architecture), shared by every backend of the process: NVRTC takes
/// about a second per module, a module load a millisecond.
fn ptx_cache() -> &'static Mutex<HashMap<(Module, &'static str), Ptx>> {
    static CACHE: OnceLock<Mutex<HashMap<(Module, &'static str), Ptx>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// NVRTC's `--gpu-architecture` for a compute capability.
fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "sm_90",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => Box::leak(format!("sm_{major}{minor}").into_boxed_str()),
    }
}

fn compile(module: Module, arch: &'static str) -> Result<Ptx> {
    let mut cache = ptx_cache().lock().expect("ptx cache poisoned");
    if let Some(ptx) = cache.get(&(module, arch)) {
        return Ok(ptx.clone());
    }
    let src = format!("{COMMON}\n{}", lab_source(module)?);
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(module.file_name().into()),
        options: vec!["--std=c++17".into(), "-lineinfo".into()],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(src, opts)
        .map_err(|e| Error::Cuda(format!("NVRTC failed on {}: {e}", module.file_name())))?;
    cache.insert((module, arch), ptx.clone());
    Ok(ptx)
}

/// A kernel argument; the driver copies each from an 8-byte slot, reading as many bytes as
/// the kernel's parameter has (little-endian, so 4-byte values sit in the low half).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer (0 for null).
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

impl Arg {
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// Converts a size to a kernel `int`, naming the op when it does not fit.
pub(crate) fn int(op: &'static str, what: &str, v: usize) -> Result<Arg> {
    i32::try_from(v).map(Arg::I32).map_err(|_| Error::Shape {
        op,
        msg: format!("{what} = {v} exceeds the kernels' 32-bit range"),
    })
}

/// The CUDA backend: one device, one stream, bf16 storage with f32 accumulation.
pub struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    blas: CudaBlas,
    arch: &'static str,
    pub(crate) sm_count: u32,
    /// Peak DRAM bandwidth, bytes/s, from the memory clock and bus width.
    memory_bandwidth: f64,
    device_name: String,
    modules: Mutex<HashMap<Module, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// The dynamic shared memory each kernel has opted in to, by name.
    opted_in_shared: Mutex<HashMap<&'static str, u32>>,
    /// The cuBLASLt path of [`CudaBackend::gemm`], when `FLOE_GEMM` asks for it.
    blas_lt: Option<super::gemm_lt::LtGemm>,
    /// cuBLAS's (and cuBLASLt's) workspace; kept alive as long as the handles use it.
    _blas_workspace: CudaSlice<u8>,
    /// Whether launches and GEMMs are being timed ([`CudaBackend::start_profile`]).
    profiling: AtomicBool,
    spans: Mutex<Vec<Span>>,
    /// Page-locked buffers of [`crate::Backend::adamw_host`], made on its first call.
    pub(crate) host_staging: Mutex<Option<HostStaging>>,
    /// Split partials of paged attention (f32), grown to the largest call so far: a
    /// decode step calls it once per layer, and a fresh buffer each time costs two
    /// allocations and a free-memory query per layer.
    pub(crate) paged_partials: Mutex<Option<CudaBuf>>,
    /// The last upload of each attention work list, by name: every layer of a step gets
    /// the same lists, so all but the first reuse them instead of an allocation and a
    /// copy each (see [`CudaBackend::uploaded_lists`]).
    uploaded_lists: Mutex<HashMap<&'static str, (Vec<u32>, CudaBuf)>>,
    /// Whether paged attention reads a group's shared keys once for all its tokens
    /// (cascade); `FLOE_CASCADE=0` turns it off, to time what it gains.
    pub(crate) cascade: bool,
    /// Whether [`crate::Backend::graphed`] regions become CUDA graphs;
    /// `FLOE_CUDA_GRAPHS=0` runs them eagerly, to time what graphs gain.
    pub(crate) graphs_enabled: bool,
    /// The [`super::graph::Pass`] the ops are in (a `u8`, read by every launch).
    pub(crate) graph_pass: AtomicU8,
    /// Captured graphs and the state of the running pass.
    pub(crate) graphs: Mutex<super::graph::Graphs>,
}

/// The uploaded attention work lists, held by one op (see [`CudaBackend::uploaded_lists`]).
pub(crate) struct UploadedLists<'a> {
    backend: &'a CudaBackend,
    held: std::sync::MutexGuard<'a, HashMap<&'static str, (Vec<u32>, CudaBuf)>>,
}

impl UploadedLists<'_> {
    /// The device address of the index list `data`, uploaded under `name` unless the
    /// last list of that name was the same. It stays valid for every kernel enqueued
    /// before the next list of that name differs (the old buffer is then freed in stream
    /// order, after them).
    pub(crate) fn upload(&mut self, name: &'static str, data: &[u32]) -> Result<Arg> {
        if self.backend.pass() != super::graph::Pass::Eager {
            return self.backend.graph_list(name, data);
        }
        if let Some((held, buf)) = self.held.get(name) {
            if held[..] == *data {
                return Ok(self.backend.p(buf));
            }
        }
        let buf = self.backend.upload_index_to(data)?;
        let arg = self.backend.p(&buf);
        self.held.insert(name, (data.to_vec(), buf));
        Ok(arg)
    }
}

/// Elements of one chunk that [`crate::Backend::adamw_host`] streams through the host.
pub(crate) const STAGING_CHUNK: usize = 8 << 20;

/// Page-locked host memory for streaming a parameter through the host in chunks: two
/// buffers for gradients coming down and two for bf16 weights going up, so the copies of
/// one chunk overlap the update of the next. Each buffer's event marks when the copy
/// last queued on it is done; the host waits on it before touching the buffer.
pub(crate) struct HostStaging {
    pub(crate) grads: [Staged<f32>; 2],
    pub(crate) weights: [Staged<u16>; 2],
}

/// One page-locked buffer and the event of its last copy.
pub(crate) struct Staged<T> {
    pub(crate) buf: PinnedHostSlice<T>,
    pub(crate) done: CudaEvent,
}

impl HostStaging {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        // Gradients are read by the host: cached memory. Weights are only written by it:
        // write-combined memory, faster to send.
        let grads = || -> Result<Staged<f32>> {
            Ok(Staged {
                // SAFETY: every element is written by a copy before the host reads it.
                buf: unsafe { ctx.alloc_pinned_with_flags::<f32>(STAGING_CHUNK, 0)? },
                done: ctx.new_event(None)?,
            })
        };
        let weights = || -> Result<Staged<u16>> {
            Ok(Staged {
                // SAFETY: the host writes every element it sends.
                buf: unsafe {
                    ctx.alloc_pinned_with_flags::<u16>(
                        STAGING_CHUNK,
                        driver_sys::CU_MEMHOSTALLOC_WRITECOMBINED,
                    )?
                },
                done: ctx.new_event(None)?,
            })
        };
        Ok(Self {
            grads: [grads()?, grads()?],
            weights: [weights()?, weights()?],
        })
    }
}

/// One timed launch or GEMM: what ran, between two events recorded on the stream.
struct Span {
    name: Cow<'static, str>,
    start: CudaEvent,
    end: CudaEvent,
}

/// Shared memory a block may use without opting in.
const STATIC_SHARED_LIMIT: u32 = 48 * 1024;

/// Bytes of cuBLAS workspace (the size NVIDIA recommends on Hopper).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl CudaBackend {
    /// Opens device `ordinal`. Fails with [`Error::Cuda`] when the driver, NVRTC or cuBLAS
    /// library cannot be loaded or no such device exists.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics when a library is missing; look for each one first.
        // SAFETY: these only try to dlopen the library by its usual names.
        unsafe {
            if !cudarc::driver::sys::is_culib_present() {
                return Err(Error::Cuda(
                    "no CUDA driver found: libcuda.so could not be loaded".into(),
                ));
            }
            if !cudarc::nvrtc::sys::is_culib_present() {
                return Err(Error::Cuda(
                    "NVRTC not found: add the CUDA toolkit's lib64 to LD_LIBRARY_PATH".into(),
                ));
            }
            if !cudarc::cublas::sys::is_culib_present()
                || !cudarc::cublaslt::sys::is_culib_present()
            {
                return Err(Error::Cuda(
                    "cuBLAS not found: add the CUDA toolkit's lib64 to LD_LIBRARY_PATH".into(),
                ));
            }
        }
        let count = CudaContext::device_count()?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Cuda(format!(
                "no CUDA device {ordinal}: {count} device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // Each backend's stream orders its own ops, and forks of it are ordered by
        // `wait_for` alone, so cudarc's per-buffer events are pure overhead.
        // SAFETY: a buffer is used on another backend's stream only after that stream
        // waits for this one (`Backend::wait_for`), and the reverse.
        unsafe { ctx.disable_event_tracking() };
        Self::on_new_stream(ctx, 0)
    }

    /// A backend on a new stream of `ctx` at `priority` (0 the default, lower numbers
    /// first), with its own cuBLAS handle and workspace (a handle must not be used by two
    /// host threads at once) and its own module handles.
    pub(crate) fn on_new_stream(ctx: Arc<CudaContext>, priority: i32) -> Result<Self> {
        let stream = ctx.new_stream_with_priority(priority)?;
        let blas = CudaBlas::new(stream.clone())?;
        let workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _sync) = workspace.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both in `Self`).
            let status = unsafe {
                cublas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            };
            if status != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(Error::Cuda(format!("cublasSetWorkspace: {status:?}")));
            }
        }
        let blas_lt = match super::gemm_lt::GemmPath::from_env()? {
            super::gemm_lt::GemmPath::Blas => None,
            path => {
                let (ptr, _sync) = workspace.device_ptr(&stream);
                let tune = path == super::gemm_lt::GemmPath::LtTuned;
                Some(super::gemm_lt::LtGemm::new(
                    (ptr, BLAS_WORKSPACE_BYTES),
                    tune,
                )?)
            }
        };
        let (major, minor) = ctx.compute_capability()?;
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let device_name = ctx.name()?;
        // Peak DRAM bandwidth: two transfers a memory clock (DDR) over the whole bus.
        let memory_clock_khz = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
        )? as f64;
        let bus_bits = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
        )? as f64;
        let memory_bandwidth = 2.0 * memory_clock_khz * 1e3 * bus_bits / 8.0;
        Ok(Self {
            ctx,
            stream,
            blas,
            blas_lt,
            arch: arch_name(major, minor),
            sm_count,
            device_name,
            memory_bandwidth,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            opted_in_shared: Mutex::new(HashMap::new()),
            _blas_workspace: workspace,
            profiling: AtomicBool::new(false),
            spans: Mutex::new(Vec::new()),
            host_staging: Mutex::new(None),
            paged_partials: Mutex::new(None),
            uploaded_lists: Mutex::new(HashMap::new()),
            cascade: std::env::var("FLOE_CASCADE").map_or(true, |v| v != "0"),
            graphs_enabled: std::env::var("FLOE_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            graph_pass: AtomicU8::new(super::graph::Pass::Eager as u8),
            graphs: Mutex::new(super::graph::Graphs::default()),
        })
    }

    /// Captures [`crate::Backend::graphed`] regions as graphs (`on`, the default unless
    /// `FLOE_CUDA_GRAPHS=0`) or runs them eagerly.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs_enabled = on;
    }

    /// Runs `f` with the staging buffers, making them on first use.
    pub(crate) fn with_host_staging<R>(
        &self,
        f: impl FnOnce(&mut HostStaging) -> Result<R>,
    ) -> Result<R> {
        let mut staging = self.host_staging.lock().expect("poisoned");
        if staging.is_none() {
            *staging = Some(HostStaging::new(&self.ctx)?);
        }
        f(staging.as_mut().expect("made above"))
    }

    /// Starts timing every kernel launch and GEMM with a pair of CUDA events around it (the
    /// per-kernel breakdown of `floe bench --profile`). Launches stay asynchronous; the
    /// events add a few microseconds of host time each.
    pub fn start_profile(&self) {
        self.spans.lock().expect("poisoned").clear();
        self.profiling.store(true, Ordering::Relaxed);
    }

    /// Stops timing, waits for the stream and returns the GPU time per kernel name (GEMMs
    /// per shape) since [`Self::start_profile`], largest first.
    pub fn finish_profile(&self) -> Result<Vec<KernelTime>> {
        self.profiling.store(false, Ordering::Relaxed);
        self.stream.synchronize()?;
        let spans = std::mem::take(&mut *self.spans.lock().expect("poisoned"));
        let mut by_name: HashMap<Cow<'static, str>, (usize, f64)> = HashMap::new();
        for span in spans {
            let ms = span.start.elapsed_ms(&span.end)?;
            let entry = by_name.entry(span.name).or_default();
            entry.0 += 1;
            entry.1 += f64::from(ms);
        }
        let mut times: Vec<KernelTime> = by_name
            .into_iter()
            .map(|(name, (calls, total_ms))| KernelTime {
                name: name.into_owned(),
                calls,
                total_ms,
            })
            .collect();
        times.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        Ok(times)
    }

    /// Whether launches are being timed (graphs are off meanwhile: the timing events
    /// need eager launches).
    pub(crate) fn profiling(&self) -> bool {
        self.profiling.load(Ordering::Relaxed)
    }

    /// Runs `enqueue` between two timing events while profiling; otherwise just runs it.
    fn timed(
        &self,
        name: impl FnOnce() -> Cow<'static, str>,
        enqueue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if !self.profiling.load(Ordering::Relaxed) {
            return enqueue();
        }
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timing)?;
        enqueue()?;
        let end = self.stream.record_event(timing)?;
        self.spans.lock().expect("poisoned").push(Span {
            name: name(),
            start,
            end,
        });
        Ok(())
    }

    /// Compiles every kernel module for `arch` (e.g. `sm_90`) with NVRTC alone, no driver or
    /// GPU needed: the build check of the kernel sources. Returns each module's PTX size.
    pub fn compile_kernels(arch: &'static str) -> Result<Vec<(&'static str, usize)>> {
        // SAFETY: only tries to dlopen NVRTC by its usual names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(Error::Cuda(
                "NVRTC not found: add the CUDA toolkit's lib64 to LD_LIBRARY_PATH".into(),
            ));
        }
        ALL_MODULES
            .iter()
            .map(|&m| Ok((m.file_name(), compile(m, arch)?.to_src().len())))
            .collect()
    }

    /// `cuda:N (device name, sm_XY)`.
    pub(crate) fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, {}, {} SMs, bf16 compute / f32 master)",
            self.ctx.ordinal(),
            self.device_name,
            self.arch,
            self.sm_count
        )
    }

    /// `module`, compiled (once per process) and loaded (once per backend).
    fn module(&self, module: Module) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().expect("poisoned");
        if let Some(m) = modules.get(&module) {
            return Ok(m.clone());
        }
        let loaded = self.ctx.load_module(compile(module, self.arch)?)?;
        modules.insert(module, loaded.clone());
        Ok(loaded)
    }

    fn function(&self, module: Module, kernel: &'static str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().expect("poisoned").get(kernel) {
            return Ok(f.clone());
        }
        let f = self.module(module)?.load_function(kernel)?;
        self.functions
            .lock()
            .expect("poisoned")
            .insert(kernel, f.clone());
        Ok(f)
    }

    /// Peak DRAM bandwidth in bytes/s (the memory clock's two transfers over the bus
    /// width): the roofline of memory-bound work such as decoding.
    pub fn memory_bandwidth(&self) -> f64 {
        self.memory_bandwidth
    }

    /// Compiles (once per process) and loads every module, so later timings and the first
    /// training step exclude NVRTC.
    pub fn warm_up(&self) -> Result<()> {
        for m in ALL_MODULES {
            self.module(m)?;
        }
        Ok(())
    }

    /// Enqueues `kernel` of `module` on the stream.
    pub(crate) fn launch(
        &self,
        module: Module,
        kernel: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<()> {
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            return Ok(());
        }
        let f = self.function(module, kernel)?;
        if cfg.shared_mem_bytes > STATIC_SHARED_LIMIT {
            // Blocks get more than 48 KiB of shared memory only when the function opts in;
            // once per size, so that a graph capture (after the check pass) never asks.
            let mut opted = self.opted_in_shared.lock().expect("poisoned");
            if opted
                .get(kernel)
                .is_none_or(|&bytes| bytes < cfg.shared_mem_bytes)
            {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    cfg.shared_mem_bytes as i32,
                )?;
                opted.insert(kernel, cfg.shared_mem_bytes);
            }
        }
        let slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        if !self.graph_launch(
            kernel,
            cfg.grid_dim,
            cfg.block_dim,
            cfg.shared_mem_bytes,
            &slots,
        ) {
            return Ok(());
        }
        let mut builder = self.stream.launch_builder(&f);
        for slot in &slots {
            builder.arg(slot);
        }
        self.timed(
            || Cow::Borrowed(kernel),
            || {
                // SAFETY: each kernel's parameter list matches `args` (checked by the op
                // that builds them) and every pointer is a live allocation of this context.
                unsafe { builder.launch(cfg) }
                    .map_err(|e| Error::Cuda(format!("launching {kernel}: {e}")))?;
                Ok(())
            },
        )
    }

    /// A 1-D grid-stride launch over `n` items: enough blocks to fill the device, no more.
    pub(crate) fn grid_1d(&self, n: usize, threads: u32) -> LaunchConfig {
        let blocks = n
            .div_ceil(threads as usize)
            .min(self.sm_count as usize * 16);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    // ---- buffers ---------------------------------------------------------------------

    /// A buffer of `len` elements of `kind`, contents unspecified.
    pub(crate) fn alloc(&self, len: usize, kind: BufKind) -> Result<CudaBuf> {
        if self.pass() == super::graph::Pass::Record {
            return Err(Error::Cuda(
                "an allocation inside a CUDA graph capture".into(),
            ));
        }
        // cuMemAlloc rejects zero bytes; an empty buffer still owns one element.
        let n = len.max(1);
        let free = self
            .ctx
            .mem_get_info()
            .map(|(f, _)| f)
            .unwrap_or(usize::MAX);
        let bytes = n * super::element_bytes(kind);
        if bytes > free {
            return Err(Error::OutOfMemory {
                what: format!("a {kind:?} buffer of {len} elements"),
                requested: bytes,
                free,
            });
        }
        // The free-memory check above misses what the stream's pool holds or fragments;
        // the driver's own refusal is reported the same way.
        let out_of_memory = |e: cudarc::driver::DriverError| {
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory {
                    what: format!("a {kind:?} buffer of {len} elements"),
                    requested: bytes,
                    free,
                }
            } else {
                e.into()
            }
        };
        // SAFETY: every caller writes the buffer before it is read (or zeroes it).
        let storage = unsafe {
            match kind {
                BufKind::Compute => {
                    Storage::Bf16(self.stream.alloc::<u16>(n).map_err(out_of_memory)?)
                }
                BufKind::Full => Storage::F32(self.stream.alloc::<f32>(n).map_err(out_of_memory)?),
                BufKind::Index => Storage::U32(self.stream.alloc::<u32>(n).map_err(out_of_memory)?),
            }
        };
        Ok(CudaBuf { storage, len, kind })
    }

    /// The device address of `buf`'s first element.
    pub(crate) fn ptr(&self, buf: &CudaBuf) -> u64 {
        match &buf.storage {
            Storage::Bf16(s) => s.device_ptr(&self.stream).0,
            Storage::F32(s) => s.device_ptr(&self.stream).0,
            Storage::U32(s) => s.device_ptr(&self.stream).0,
        }
    }

    /// `buf`'s address as a kernel argument.
    pub(crate) fn p(&self, buf: &CudaBuf) -> Arg {
        Arg::Ptr(self.ptr(buf))
    }

    /// The per-step work lists, held for one op: its launches read them, so no other
    /// thread may replace one meanwhile (see [`UploadedLists::upload`]).
    pub(crate) fn uploaded_lists(&self) -> UploadedLists<'_> {
        UploadedLists {
            backend: self,
            held: self.uploaded_lists.lock().expect("poisoned"),
        }
    }

    // ---- GEMM ------------------------------------------------------------------------

    /// `C = alpha·op(A)·op(B) + beta·C` on row-major operands given by address and kind.
    /// A and B share one storage type (bf16 or f32); C may be either (bf16 inputs with an
    /// f32 output is how parameter gradients accumulate). Accumulation is always f32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        c: (u64, BufKind),
        a: (u64, BufKind),
        b: (u64, BufKind),
        dims: Matmul,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use cublas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let Matmul {
            m,
            n,
            k,
            trans_a,
            trans_b,
        } = dims;
        if m == 0 || n == 0 || !self.graph_gemm([c, a, b], dims, alpha, beta) {
            return Ok(());
        }
        let ty = |kind: BufKind| match kind {
            BufKind::Full => CUDA_R_32F,
            _ => CUDA_R_16BF,
        };
        let as_int = |v: usize| {
            i32::try_from(v).map_err(|_| Error::Shape {
                op: "matmul",
                msg: format!("dimension {v} exceeds cuBLAS's 32-bit range"),
            })
        };
        // Row-major C[m,n] = A·B is column-major Cᵀ[n,m] = Bᵀ·Aᵀ: swap the operands.
        let (op_b, ldb) = if trans_b {
            (CUBLAS_OP_T, k)
        } else {
            (CUBLAS_OP_N, n)
        };
        let (op_a, lda) = if trans_a {
            (CUBLAS_OP_T, m)
        } else {
            (CUBLAS_OP_N, k)
        };
        self.ctx.bind_to_thread()?;
        let name = || {
            let t = |trans: bool| if trans { "T" } else { "N" };
            let out = if c.1 == BufKind::Full { "f32" } else { "bf16" };
            let acc = if beta == 0.0 { "" } else { " +=" };
            Cow::Owned(format!(
                "gemm {m}x{n}x{k} {}{} -> {out}{acc}",
                t(trans_a),
                t(trans_b)
            ))
        };
        if let Some(lt) = &self.blas_lt {
            let ops = super::gemm_lt::Operands {
                c: c.0,
                a: a.0,
                b: b.0,
                alpha,
                beta,
            };
            return self.timed(name, || lt.gemm(&self.stream, ops, a.1, c.1, dims));
        }
        // SAFETY: the caller checked every operand's length against `dims`.
        self.timed(name, || unsafe {
            cublas_result::gemm_ex(
                *self.blas.handle(),
                op_b,
                op_a,
                as_int(n)?,
                as_int(m)?,
                as_int(k)?,
                (&alpha) as *const f32 as *const _,
                b.0 as *const _,
                ty(b.1),
                as_int(ldb.max(1))?,
                a.0 as *const _,
                ty(a.1),
                as_int(lda.max(1))?,
                (&beta) as *const f32 as *const _,
                c.0 as *mut _,
                ty(c.1),
                as_int(n)?,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
            Ok(())
        })
    }
}
