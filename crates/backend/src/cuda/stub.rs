//! The CUDA backend's stand-in when floe is built without the `cuda` feature: the types
//! exist so callers need no `cfg`, and [`CudaBackend::new`] says how to get the real one.

use crate::{
    AdamW, AttnShape, Backend, BufKind, Error, LmHead, Matmul, PagedLayout, Result, Sampled,
    SamplingRow, Segment,
};

/// Uninhabited without the `cuda` feature: [`CudaBackend::new`] always fails.
#[derive(Debug)]
pub enum CudaBackend {}

/// Uninhabited without the `cuda` feature.
#[derive(Debug)]
pub enum CudaBuf {}

impl CudaBackend {
    /// Always [`Error::NotCompiledWithCuda`]: rebuild with `--features cuda`.
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(Error::NotCompiledWithCuda)
    }

    /// Always [`Error::NotCompiledWithCuda`].
    pub fn compile_kernels(_arch: &'static str) -> Result<Vec<(&'static str, usize)>> {
        Err(Error::NotCompiledWithCuda)
    }

    /// Never called: no value of this type exists.
    pub fn warm_up(&self) -> Result<()> {
        match *self {}
    }

    /// Never called: no value of this type exists.
    pub fn memory_bandwidth(&self) -> f64 {
        match *self {}
    }

    /// Never called: no value of this type exists.
    pub fn start_profile(&self) {
        match *self {}
    }

    /// Never called: no value of this type exists.
    pub fn set_graphs(&mut self, _on: bool) {
        match *self {}
    }

    /// Never called: no value of this type exists.
    pub fn graph_counts(&self) -> super::GraphCounts {
        match *self {}
    }

    /// Never called: no value of this type exists.
    pub fn finish_profile(&self) -> Result<Vec<super::KernelTime>> {
        match *self {}
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;

    fn name(&self) -> String {
        match *self {}
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        match *self {}
    }

    fn synchronize(&self) -> Result<()> {
        match *self {}
    }

    fn compute_is_full(&self) -> bool {
        match *self {}
    }

    fn fork(&self) -> Result<Self> {
        match *self {}
    }

    fn wait_for(&self, _other: &Self) -> Result<()> {
        match *self {}
    }

    fn len(&self, _buf: &CudaBuf) -> usize {
        match *self {}
    }

    fn kind(&self, _buf: &CudaBuf) -> BufKind {
        match *self {}
    }

    fn zeros(&self, _len: usize, _kind: BufKind) -> Result<Self::Buf> {
        match *self {}
    }

    fn upload(&self, _data: &[f32], _kind: BufKind) -> Result<Self::Buf> {
        match *self {}
    }

    fn upload_f64(&self, _data: &[f64], _kind: BufKind) -> Result<Self::Buf> {
        match *self {}
    }

    fn upload_index(&self, _data: &[u32]) -> Result<Self::Buf> {
        match *self {}
    }

    fn write_index(&self, _dst: &mut CudaBuf, _data: &[u32]) -> Result<()> {
        match *self {}
    }

    fn download(&self, _buf: &CudaBuf) -> Result<Vec<f32>> {
        match *self {}
    }

    fn download_f64(&self, _buf: &CudaBuf) -> Result<Vec<f64>> {
        match *self {}
    }

    fn download_index(&self, _buf: &CudaBuf) -> Result<Vec<u32>> {
        match *self {}
    }

    fn copy(&self, _dst: &mut CudaBuf, _src: &CudaBuf) -> Result<()> {
        match *self {}
    }

    fn copy_range(
        &self,
        _dst: &mut CudaBuf,
        _dst_offset: usize,
        _src: &CudaBuf,
        _src_offset: usize,
        _len: usize,
    ) -> Result<()> {
        match *self {}
    }

    fn fill_zero(&self, _buf: &mut CudaBuf) -> Result<()> {
        match *self {}
    }

    fn fill_normal(&self, _buf: &mut CudaBuf, _seed: u64, _first: u64, _std: f64) -> Result<()> {
        match *self {}
    }

    fn add_assign(&self, _y: &mut CudaBuf, _x: &CudaBuf) -> Result<()> {
        match *self {}
    }

    fn scale(&self, _y: &mut CudaBuf, _alpha: f32) -> Result<()> {
        match *self {}
    }

    fn sum_squares(&self, _x: &CudaBuf) -> Result<f64> {
        match *self {}
    }

    fn gather_rows(
        &self,
        _out: &mut CudaBuf,
        _x: &CudaBuf,
        _rows: &CudaBuf,
        _dim: usize,
    ) -> Result<()> {
        match *self {}
    }

    fn matmul(
        &self,
        _c: &mut CudaBuf,
        _a: &CudaBuf,
        _b: &CudaBuf,
        _dims: Matmul,
        _accumulate: bool,
    ) -> Result<()> {
        match *self {}
    }

    fn add_bias(
        &self,
        _y: &mut CudaBuf,
        _bias: &CudaBuf,
        _rows: usize,
        _cols: usize,
    ) -> Result<()> {
        match *self {}
    }

    fn add_bias_backward(
        &self,
        _dbias: &mut CudaBuf,
        _dy: &CudaBuf,
        _rows: usize,
        _cols: usize,
    ) -> Result<()> {
        match *self {}
    }

    fn embedding_forward(
        &self,
        _out: &mut CudaBuf,
        _table: &CudaBuf,
        _ids: &CudaBuf,
        _dim: usize,
    ) -> Result<()> {
        match *self {}
    }

    fn embedding_backward(
        &self,
        _dtable: &mut CudaBuf,
        _dout: &CudaBuf,
        _ids: &CudaBuf,
        _dim: usize,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward(
        &self,
        _out: &mut CudaBuf,
        _rstd: &mut CudaBuf,
        _x: &CudaBuf,
        _w: &CudaBuf,
        _rows: usize,
        _dim: usize,
        _eps: f32,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        _dx: &mut CudaBuf,
        _dw: &mut CudaBuf,
        _dout: &CudaBuf,
        _x: &CudaBuf,
        _w: &CudaBuf,
        _rstd: &CudaBuf,
        _rows: usize,
        _dim: usize,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        _x: &mut CudaBuf,
        _positions: &CudaBuf,
        _inv_freq: &CudaBuf,
        _tokens: usize,
        _heads: usize,
        _head_dim: usize,
        _inverse: bool,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        _out: &mut CudaBuf,
        _lse: &mut CudaBuf,
        _q: &CudaBuf,
        _k: &CudaBuf,
        _v: &CudaBuf,
        _segments: &[Segment],
        _shape: AttnShape,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        _dq: &mut CudaBuf,
        _dk: &mut CudaBuf,
        _dv: &mut CudaBuf,
        _dout: &CudaBuf,
        _out: &CudaBuf,
        _lse: &CudaBuf,
        _q: &CudaBuf,
        _k: &CudaBuf,
        _v: &CudaBuf,
        _segments: &[Segment],
        _shape: AttnShape,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn kv_cache_write(
        &self,
        _k_cache: &mut CudaBuf,
        _v_cache: &mut CudaBuf,
        _k: &CudaBuf,
        _v: &CudaBuf,
        _slots: &CudaBuf,
        _kv_heads: usize,
        _head_dim: usize,
    ) -> Result<()> {
        match *self {}
    }

    fn paged_attention(
        &self,
        _out: &mut CudaBuf,
        _q: &CudaBuf,
        _k_cache: &CudaBuf,
        _v_cache: &CudaBuf,
        _layout: &PagedLayout<'_, Self>,
        _shape: AttnShape,
    ) -> Result<()> {
        match *self {}
    }

    fn swiglu_forward(&self, _out: &mut CudaBuf, _gate: &CudaBuf, _up: &CudaBuf) -> Result<()> {
        match *self {}
    }

    fn swiglu_backward(
        &self,
        _dgate: &mut CudaBuf,
        _dup: &mut CudaBuf,
        _dout: &CudaBuf,
        _gate: &CudaBuf,
        _up: &CudaBuf,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn lm_head_forward(
        &self,
        _logprobs: &mut CudaBuf,
        _entropy: &mut CudaBuf,
        _lse: &mut CudaBuf,
        _hidden: &CudaBuf,
        _w: &CudaBuf,
        _targets: &CudaBuf,
        _spec: LmHead,
    ) -> Result<()> {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn lm_head_backward(
        &self,
        _dhidden: &mut CudaBuf,
        _dw: &mut CudaBuf,
        _dlogprobs: &CudaBuf,
        _dentropy: &CudaBuf,
        _hidden: &CudaBuf,
        _w: &CudaBuf,
        _targets: &CudaBuf,
        _lse: &CudaBuf,
        _spec: LmHead,
    ) -> Result<()> {
        match *self {}
    }

    fn sample(
        &self,
        _logits: &CudaBuf,
        _vocab: usize,
        _rows: &[SamplingRow],
    ) -> Result<Vec<Sampled>> {
        match *self {}
    }

    fn adamw(
        &self,
        _param: &mut CudaBuf,
        _grad: &CudaBuf,
        _m: &mut CudaBuf,
        _v: &mut CudaBuf,
        _compute: Option<&mut CudaBuf>,
        _hp: AdamW,
    ) -> Result<()> {
        match *self {}
    }

    fn adamw_host(
        &self,
        _param: &mut CudaBuf,
        _grad: &CudaBuf,
        _master: &mut [f32],
        _m: &mut [f32],
        _v: &mut [f32],
        _hp: AdamW,
    ) -> Result<()> {
        match *self {}
    }
}

/// Bytes of NCCL's unique id.
pub const NCCL_ID_BYTES: usize = 128;

/// Uninhabited without the `cuda` feature: [`NcclCollective::new`] always fails.
#[derive(Debug)]
pub enum NcclCollective {}

impl NcclCollective {
    /// Always [`Error::NotCompiledWithCuda`].
    pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
        Err(Error::NotCompiledWithCuda)
    }

    /// Always [`Error::NotCompiledWithCuda`].
    pub fn new(
        _backend: &CudaBackend,
        _rank: usize,
        _world_size: usize,
        _id: &[u8],
    ) -> Result<Self> {
        Err(Error::NotCompiledWithCuda)
    }
}

impl NcclCollective {
    /// Uninhabited: never called.
    pub fn abort(&self, _reason: &str) {
        match *self {}
    }
}

impl crate::Collective<CudaBackend> for NcclCollective {
    fn rank(&self) -> usize {
        match *self {}
    }

    fn world_size(&self) -> usize {
        match *self {}
    }

    fn all_reduce_sum(&self, _buf: &mut CudaBuf) -> Result<()> {
        match *self {}
    }

    fn all_gather(&self, _send: &CudaBuf, _recv: &mut CudaBuf) -> Result<()> {
        match *self {}
    }

    fn reduce_scatter_sum(&self, _send: &CudaBuf, _recv: &mut CudaBuf) -> Result<()> {
        match *self {}
    }

    fn broadcast(&self, _buf: &mut CudaBuf, _root: usize) -> Result<()> {
        match *self {}
    }

    fn barrier(&self) -> Result<()> {
        match *self {}
    }
}
