//! floe's compute backends: the primitive operations the model needs, behind one trait.
//!
//! The [`Backend`] trait is the contract between the model (layer 2) and a device. It holds
//! exactly the ops a decoder-only transformer needs for training and sampling: matrix
//! products, embedding, RMSNorm, RoPE, causal attention over packed variable-length
//! segments, SwiGLU, a fused lm-head log-prob/entropy, AdamW and sampling. Each op that
//! takes part in training has its forward and backward side by side.
//!
//! Implementations:
//! - [`cpu::CpuBackend`]: the reference, generic over its float (`f32` by default, `f64`
//!   for finite-difference gradient checks); rayon for parallelism, `gemm` for products.
//! - [`cuda::CudaBackend`] (feature `cuda`): NVRTC-compiled kernels and cuBLAS, bf16
//!   storage with f32 accumulation. Without the feature the type still exists and its
//!   constructor returns [`Error::NotCompiledWithCuda`], so callers need no `cfg`.
//!
//! # Conventions
//! - Every matrix is row-major. Activations are token-major: a packed batch of `T` tokens
//!   with `H` heads of size `D` is `[T, H, D]`.
//! - Buffers are flat; every op receives the dimensions it needs and checks buffer
//!   lengths against them, returning [`Error::Shape`] naming the op and argument. The
//!   checks are stated once, in [`contract`], for every backend.
//! - Ops whose output is a *gradient of a parameter* accumulate (`+=`) into it, so
//!   micro-batches sum without extra passes. Ops whose output is an activation or the
//!   gradient of an activation overwrite it.
//! - A buffer's [`BufKind`] says its role; each backend picks the storage type per role.

#![deny(missing_docs)]

pub mod collective;
// Only NCCL's collective runs a watchdog; its decisions are unit-tested in every build.
#[cfg(any(feature = "cuda", test))]
mod collective_watchdog;
pub mod contract;
pub mod cpu;
pub mod cuda;
mod error;
mod host_adamw;
pub mod sampling;

pub use collective::{Collective, InProcessCollective};
pub use error::{Error, Result};

/// The role of a buffer; each backend decides how each role is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufKind {
    /// Activations, compute copies of weights, activation gradients, KV cache, logits.
    /// bf16 on CUDA; the backend's float on CPU.
    Compute,
    /// Master weights, parameter gradients, optimizer state and statistics that must stay
    /// precise (RMSNorm `rstd`, attention `lse`, log-probs, entropies). f32 on CUDA; the
    /// backend's float on CPU.
    Full,
    /// Token ids, positions, cache slots, block tables: `u32`.
    Index,
}

/// Dimensions of `C[m, n] (+)= op(A) · op(B)`, row-major, where `op(X)` is `X` or `Xᵀ`.
///
/// `A` is stored `[m, k]` (or `[k, m]` when `trans_a`), `B` is `[k, n]` (or `[n, k]`
/// when `trans_b`). A linear layer `y = x Wᵀ` with `W: [out, in]` is
/// `m = tokens, n = out, k = in, trans_b = true`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matmul {
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Read `A` transposed.
    pub trans_a: bool,
    /// Read `B` transposed.
    pub trans_b: bool,
}

/// One sequence of a packed batch, as the attention ops see it.
///
/// Query token `start + j` attends to every token of its prefix,
/// `[prefix_start, prefix_start + prefix_len)`, then causally to
/// `[start, start + j]`. A plain packed sequence has `prefix_len == 0`. Prompt sharing
/// puts a group's prompt in its own segment once and gives each response segment that
/// prompt as its prefix: responses then attend to the prompt without recomputing it, and
/// the backward pass sums the gradients of all responses into the prompt's keys/values.
/// A segment that is itself a shared prompt is an ordinary causal segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    /// First token of the segment in the packed batch.
    pub start: u32,
    /// Number of tokens in the segment.
    pub len: u32,
    /// First token of the prefix this segment attends to (any value when `prefix_len == 0`).
    pub prefix_start: u32,
    /// Number of prefix tokens (0 for none).
    pub prefix_len: u32,
}

/// Head layout of an attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    /// Total tokens in the packed batch (`T`).
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads; divides `q_heads` (grouped-query attention).
    pub kv_heads: usize,
    /// Size of each head (`D`).
    pub head_dim: usize,
    /// Logit scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// Where each query token of a paged-attention call reads its keys and values.
///
/// The KV cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]` for keys and
/// the same for values; a token of sequence `s` at position `p` lives in slot
/// `block_tables[s * max_blocks + p / block_size] * block_size + p % block_size`. Query
/// token `t` belongs to sequence `token_seq[t]`, sits at position `token_pos[t]`, and
/// attends to that sequence's cached positions `0..=token_pos[t]` (which must already be
/// written with [`Backend::kv_cache_write`]). This one op serves prefill (many tokens per
/// sequence), chunked prefill and decoding (one token per sequence); sequences that share
/// a prompt share its blocks.
pub struct PagedLayout<'a, B: Backend + ?Sized> {
    /// `[n_seqs, max_blocks]` Index buffer of physical block ids.
    pub block_tables: &'a B::Buf,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// `[T]` Index buffer: sequence of each query token.
    pub token_seq: &'a B::Buf,
    /// `[T]` Index buffer: position of each query token.
    pub token_pos: &'a B::Buf,
    /// The largest `token_pos + 1` in this call (sizes the work, never read past).
    pub max_context: usize,
    /// Runs of query tokens that are one sequence's consecutive positions (prefill
    /// chunks), in token order; tokens outside every run are attended to one by one. A
    /// backend may attend for a long run as a block (the CUDA backend on the tensor
    /// cores); each token sees the same keys either way.
    pub runs: &'a [QueryRun],
    /// Groups of decode tokens whose sequences hold the same leading cached keys in the
    /// same physical blocks (the samples of one prompt), in token order, outside every
    /// run. A backend may read those keys once for the whole group (the CUDA backend's
    /// cascade attention); each token sees the same keys either way.
    pub shared: &'a [SharedKeys],
}

/// Query tokens `first..first + len` of a paged-attention call: one sequence's
/// positions `token_pos[first]..token_pos[first] + len` (see [`PagedLayout::runs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRun {
    /// First token of the run.
    pub first: u32,
    /// Tokens in the run.
    pub len: u32,
}

/// Query tokens `first..first + len` of a paged-attention call whose sequences share
/// their cached positions `0..keys` (see [`PagedLayout::shared`]): the same physical
/// blocks in the same columns of their block tables, and `keys <= token_pos` of each, so
/// every token of the group reads all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedKeys {
    /// First token of the group.
    pub first: u32,
    /// Tokens in the group.
    pub len: u32,
    /// Leading positions the group shares.
    pub keys: u32,
}

/// One side, q or k, of [`Backend::qk_norm_rope`]: `heads` rows of `head_dim` a token.
pub struct NormedHeads<'a, B: Backend + ?Sized> {
    /// `[T, heads, head_dim]`, written: the normalized, rotated heads.
    pub out: &'a mut B::Buf,
    /// `[T × heads]` Full, written: each row's `1 / rms` for the backward.
    pub rstd: &'a mut B::Buf,
    /// `[T, heads, head_dim]`: the projection's output.
    pub raw: &'a B::Buf,
    /// `[head_dim]`: the norm's weight.
    pub norm: &'a B::Buf,
    /// Heads a token.
    pub heads: usize,
}

/// Shape and options of the fused lm-head log-prob/entropy op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LmHead {
    /// Rows (tokens) of `hidden`.
    pub tokens: usize,
    /// Hidden size.
    pub dim: usize,
    /// Vocabulary size (rows of the lm-head weight).
    pub vocab: usize,
    /// Logits are multiplied by this before the softmax (`1 / temperature`).
    pub logit_scale: f32,
    /// Rows processed per chunk: at most `chunk_rows × vocab` logits exist at once.
    pub chunk_rows: usize,
}

/// Per-row sampling parameters, applied in Hugging Face order: temperature, top-k,
/// top-p, min-p.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingRow {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 or less disables.
    pub top_k: i32,
    /// Keep the smallest set whose probability reaches `top_p`; 1.0 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p ×` the top probability; 0 disables.
    pub min_p: f32,
    /// Seed of this sequence's random stream.
    pub seed: u64,
    /// Index of this draw in the sequence's stream (usually the number of tokens sampled
    /// so far), so a draw depends only on `(seed, offset)` and never on batch composition.
    pub offset: u64,
    /// How many of the most likely tokens to report in [`Sampled::top_logprobs`] (capped
    /// at the vocabulary); 0, the common case, computes nothing more.
    pub top_logprobs: usize,
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token id.
    pub token: u32,
    /// Log-probability of `token` under `softmax(logits / temperature)` (temperature 1 for
    /// greedy rows), before top-k/top-p/min-p truncation: the same quantity the trainer's
    /// [`Backend::lm_head_forward`] computes with `logit_scale = 1 / temperature`.
    pub logprob: f32,
    /// The row's [`SamplingRow::top_logprobs`] most likely tokens and their log-probs in
    /// that same distribution (so `token`'s entry, when it is among them, is `logprob`),
    /// by decreasing log-prob, lower id first on ties; empty when the row asked for none.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Hyper-parameters of one AdamW step (decoupled weight decay, bias-corrected moments).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay (`p -= lr * weight_decay * p`).
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
    /// Multiplies the gradient before use (global-norm clipping, loss scaling).
    pub grad_scale: f32,
}

/// The primitive ops of a decoder-only transformer on one device.
///
/// Ops are enqueued in order and may run asynchronously; [`Backend::download`] and
/// [`Backend::synchronize`] wait for everything before them.
pub trait Backend: Send + Sync + 'static {
    /// A flat buffer in device memory.
    type Buf: Send + Sync;

    /// A short description of the device, e.g. `cpu (f32, 2 threads)`.
    fn name(&self) -> String;
    /// Bytes `(free, total)` of device memory, where the device can tell.
    fn memory_info(&self) -> Option<(usize, usize)>;
    /// Waits until every enqueued op has finished.
    fn synchronize(&self) -> Result<()>;
    /// True when Compute and Full buffers share one storage type (the CPU backend): the
    /// weights then need no separate master copy.
    fn compute_is_full(&self) -> bool;
    /// A second queue of ops on the same device: ops called on the result may run at the
    /// same time as ops called on `self`. Buffers of either are valid on both, but the two
    /// queues are ordered only by [`Backend::wait_for`]. The one-step-off pipeline samples
    /// on one while it trains on the other (`docs/async-pipeline.md`).
    fn fork(&self) -> Result<Self>
    where
        Self: Sized;
    /// Ops called on `self` after this start only after every op called on `other` before
    /// it has finished (`other` is a [`Backend::fork`] of `self`, or `self` of it).
    fn wait_for(&self, other: &Self) -> Result<()>
    where
        Self: Sized;

    /// Whether [`Backend::graphed`] regions become graphs (callers pad their inputs to
    /// few shapes only then). The default: no.
    fn captures_graphs(&self) -> bool {
        false
    }

    /// Runs `ops`, a stretch of ops on this backend that repeats (a decode step's
    /// layers), as one unit where the backend can: CUDA replays a graph captured from
    /// an earlier call whose launches were the same, kernel for kernel and address for
    /// address. `ops` may run more than once per call (the CUDA backend checks its
    /// launches, then captures or replays) and must enqueue the same ops each time; it
    /// may not read results back, copy or fill buffers: such a region runs eagerly. The
    /// default runs `ops` as it is.
    fn graphed<E: From<Error> + std::fmt::Display>(
        &self,
        ops: &mut dyn FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E>
    where
        Self: Sized,
    {
        ops()
    }

    // ---- batch invariance ------------------------------------------------------------

    /// Whether the ops on the log-prob path are in their batch-invariant form (see
    /// [`Backend::set_batch_invariant`]).
    fn batch_invariant(&self) -> bool {
        false
    }
    /// Puts the ops on the log-prob path in their batch-invariant form (`on`) or back in
    /// their fastest form. Batch invariant, each output row of these ops is a fixed
    /// function of that row's inputs, computed by one fixed sequence of float operations
    /// whatever the other rows, their number, the chunking, or whether attention runs
    /// packed or paged:
    /// - [`Backend::matmul`] with `trans_a == false` and `trans_b == true` (`x·Wᵀ`, every
    ///   product of the forward): row `r` of `C` from row `r` of `A` and `B`;
    /// - [`Backend::rmsnorm_forward`], [`Backend::rope`], [`Backend::swiglu_forward`],
    ///   embedding and the elementwise ops (row by row in every mode);
    /// - [`Backend::attention_forward`] and [`Backend::paged_attention`]: a query at
    ///   position `p` reduces over its keys `0..=p` in position order, the same in both;
    /// - [`Backend::lm_head_forward`]: logits by the product above (unscaled), times
    ///   `logit_scale`, then the row's log-softmax;
    /// - [`Backend::sample`]: a row's [`Sampled::logprob`] is that same log-softmax of
    ///   its logits times `1 / temperature` (1 for greedy rows).
    ///
    /// Hence a token's sampled log-prob equals, bit for bit, the one the training
    /// forward computes for it (`docs/exact-logprobs.md`). The default refuses `on`
    /// with [`Error::Unsupported`]: a backend must implement the form to offer it.
    fn set_batch_invariant(&self, on: bool) -> Result<()> {
        if on {
            return Err(Error::Unsupported {
                backend: self.name(),
                mode: "batch-invariant kernels (set engine.exact_logprobs = false)",
            });
        }
        Ok(())
    }

    // ---- buffers ---------------------------------------------------------------------

    /// Bytes one element of a buffer of `kind` takes in device memory (for memory
    /// budgeting, e.g. KV-cache blocks). The default, 4, fits f32 and `u32` storage;
    /// backends that store a kind narrower or wider override it.
    fn element_bytes(&self, kind: BufKind) -> usize {
        let _ = kind;
        4
    }
    /// Number of elements in `buf`.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// The role `buf` was allocated with.
    fn kind(&self, buf: &Self::Buf) -> BufKind;
    /// A zero-filled buffer of `len` elements.
    fn zeros(&self, len: usize, kind: BufKind) -> Result<Self::Buf>;
    /// A buffer holding `data`, rounded to the storage type of `kind`.
    fn upload(&self, data: &[f32], kind: BufKind) -> Result<Self::Buf>;
    /// Like [`Backend::upload`] from `f64` (exact on a `f64` CPU backend).
    fn upload_f64(&self, data: &[f64], kind: BufKind) -> Result<Self::Buf> {
        let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
        self.upload(&data, kind)
    }
    /// An Index buffer holding `data`.
    fn upload_index(&self, data: &[u32]) -> Result<Self::Buf>;
    /// Overwrites the Index buffer `dst` with `data` (the same length): inputs that keep
    /// their address from call to call, as a [`Backend::graphed`] region needs.
    fn write_index(&self, dst: &mut Self::Buf, data: &[u32]) -> Result<()>;
    /// The contents of a Compute or Full buffer as `f32`.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// The contents of a Compute or Full buffer as `f64` (exact on a `f64` CPU backend).
    fn download_f64(&self, buf: &Self::Buf) -> Result<Vec<f64>> {
        Ok(self.download(buf)?.into_iter().map(f64::from).collect())
    }
    /// The contents of an Index buffer.
    fn download_index(&self, buf: &Self::Buf) -> Result<Vec<u32>>;
    /// `dst = src`, converting between Compute and Full storage; lengths must match.
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
    /// `dst[dst_offset .. dst_offset + len] = src[src_offset .. src_offset + len]`
    /// (same kind): pieces of tensors packed into and out of the flat buffers that
    /// collectives move.
    fn copy_range(
        &self,
        dst: &mut Self::Buf,
        dst_offset: usize,
        src: &Self::Buf,
        src_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// Writes `src` into `dst[offset .. offset + len(src)]` (same kind).
    fn copy_into(&self, dst: &mut Self::Buf, offset: usize, src: &Self::Buf) -> Result<()> {
        self.copy_range(dst, offset, src, 0, self.len(src))
    }
    /// Reads `src[offset .. offset + len(dst)]` into `dst` (same kind).
    fn copy_from(&self, dst: &mut Self::Buf, src: &Self::Buf, offset: usize) -> Result<()> {
        let len = self.len(dst);
        self.copy_range(dst, 0, src, offset, len)
    }
    /// Sets every element to zero.
    fn fill_zero(&self, buf: &mut Self::Buf) -> Result<()>;
    /// Element `i` of `buf` becomes `std · sampling::normal(seed, first + i)`, rounded to
    /// f32 and then to the buffer's storage: a tensor of random weights made where it
    /// lives, in parallel. CUDA's f64 `log` and `cos` may round differently from the
    /// host's, so its f32 values can differ from the CPU's by one unit in the last place.
    fn fill_normal(&self, buf: &mut Self::Buf, seed: u64, first: u64, std: f64) -> Result<()>;

    // ---- elementwise and reductions --------------------------------------------------

    /// `y += x`.
    fn add_assign(&self, y: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// `y *= alpha`.
    fn scale(&self, y: &mut Self::Buf, alpha: f32) -> Result<()>;
    /// `Σ x²`, accumulated in at least f32 (f64 on the CPU); waits for the result.
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64>;
    /// `out[i, :] = x[rows[i], :]` for `i < rows.len()`, rows of `dim` elements.
    fn gather_rows(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        rows: &Self::Buf,
        dim: usize,
    ) -> Result<()>;

    // ---- dense -----------------------------------------------------------------------

    /// `C = op(A)·op(B)`, or `C += op(A)·op(B)` when `accumulate`. `C` may be Full while
    /// `A` and `B` are Compute (parameter gradients accumulate in f32).
    fn matmul(
        &self,
        c: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        dims: Matmul,
        accumulate: bool,
    ) -> Result<()>;
    /// `y[r, :] += bias` for each of `rows` rows of `cols`.
    fn add_bias(&self, y: &mut Self::Buf, bias: &Self::Buf, rows: usize, cols: usize)
        -> Result<()>;
    /// `dbias += Σ_r dy[r, :]` (parameter gradient: accumulates).
    fn add_bias_backward(
        &self,
        dbias: &mut Self::Buf,
        dy: &Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()>;

    // ---- embedding -------------------------------------------------------------------

    /// `out[t, :] = table[ids[t], :]`, rows of `dim`.
    fn embedding_forward(
        &self,
        out: &mut Self::Buf,
        table: &Self::Buf,
        ids: &Self::Buf,
        dim: usize,
    ) -> Result<()>;
    /// `dtable[ids[t], :] += dout[t, :]` (parameter gradient: accumulates).
    fn embedding_backward(
        &self,
        dtable: &mut Self::Buf,
        dout: &Self::Buf,
        ids: &Self::Buf,
        dim: usize,
    ) -> Result<()>;

    // ---- RMSNorm ---------------------------------------------------------------------

    /// `out = x · rstd · w` per row, with `rstd[r] = 1 / sqrt(mean(x[r]²) + eps)` saved
    /// (Full) for the backward. Serves the per-head q/k norms with `rows = T × heads`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// `dx = ∂L/∂x` (overwrites) and `dw += ∂L/∂w`, from the forward's `x`, `w`, `rstd`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        dout: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        rows: usize,
        dim: usize,
    ) -> Result<()>;

    // ---- RoPE ------------------------------------------------------------------------

    /// Rotates `x: [tokens, heads, head_dim]` in place by the angles
    /// `positions[t] · inv_freq[i]` (`inv_freq`: Full, `head_dim / 2`), in the
    /// "rotate half" layout of Hugging Face Llama/Qwen: pairs `(i, i + head_dim/2)`.
    /// `inverse` rotates by the negative angles, which is the backward of the forward.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut Self::Buf,
        positions: &Self::Buf,
        inv_freq: &Self::Buf,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()>;

    /// Qwen3's per-head RMSNorm then RoPE, of q and of k: `out = rope(rmsnorm(raw, norm))`
    /// with [`Backend::rmsnorm_forward`]'s `rstd` saved. The default runs those two ops on
    /// each side; a backend may fuse all four into one pass (CUDA does: decode steps are
    /// short enough that launches count).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        q: NormedHeads<'_, Self>,
        k: NormedHeads<'_, Self>,
        positions: &Self::Buf,
        inv_freq: &Self::Buf,
        tokens: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        for side in [q, k] {
            let rows = tokens * side.heads;
            self.rmsnorm_forward(
                side.out, side.rstd, side.raw, side.norm, rows, head_dim, eps,
            )?;
            self.rope(
                side.out, positions, inv_freq, tokens, side.heads, head_dim, false,
            )?;
        }
        Ok(())
    }

    // ---- attention over packed segments ----------------------------------------------

    /// Causal grouped-query attention over packed `segments` (see [`Segment`]).
    /// `q: [T, q_heads, D]`, `k, v: [T, kv_heads, D]`, `out: [T, q_heads, D]`;
    /// `lse: [T, q_heads]` (Full) saves each row's log-sum-exp of scaled logits for the
    /// backward. Tokens outside every segment are left untouched.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        segments: &[Segment],
        shape: AttnShape,
    ) -> Result<()>;
    /// Gradients of [`Backend::attention_forward`]: overwrites `dq`, `dk`, `dv`; keys and
    /// values shared as a prefix receive the sum over every segment that reads them.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        dout: &Self::Buf,
        out: &Self::Buf,
        lse: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        segments: &[Segment],
        shape: AttnShape,
    ) -> Result<()>;

    // ---- paged KV cache (sampling) ---------------------------------------------------

    /// Writes `k, v: [T, kv_heads, head_dim]` into the caches at `slots[t]`
    /// (see [`PagedLayout`] for the slot formula).
    #[allow(clippy::too_many_arguments)]
    fn kv_cache_write(
        &self,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        slots: &Self::Buf,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Attention of `q: [T, q_heads, D]` over cached keys and values; `out` like `q`.
    fn paged_attention(
        &self,
        out: &mut Self::Buf,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        layout: &PagedLayout<'_, Self>,
        shape: AttnShape,
    ) -> Result<()>;

    // ---- SwiGLU ----------------------------------------------------------------------

    /// `out = silu(gate) · up`, elementwise.
    fn swiglu_forward(&self, out: &mut Self::Buf, gate: &Self::Buf, up: &Self::Buf) -> Result<()>;
    /// Overwrites `dgate` and `dup` with the gradients of [`Backend::swiglu_forward`].
    fn swiglu_backward(
        &self,
        dgate: &mut Self::Buf,
        dup: &mut Self::Buf,
        dout: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    ) -> Result<()>;

    // ---- fused lm-head ---------------------------------------------------------------

    /// For each row `t` of `hidden: [tokens, dim]`, with logits
    /// `z = logit_scale · hidden[t] · wᵀ` (`w: [vocab, dim]`): writes
    /// `logprobs[t] = z[targets[t]] − lse(z)`, `entropy[t] = −Σ p log p` and `lse[t]`
    /// (all Full, `[tokens]`). Works in chunks of `chunk_rows`, so the full
    /// `[tokens, vocab]` logits never exist.
    #[allow(clippy::too_many_arguments)]
    fn lm_head_forward(
        &self,
        logprobs: &mut Self::Buf,
        entropy: &mut Self::Buf,
        lse: &mut Self::Buf,
        hidden: &Self::Buf,
        w: &Self::Buf,
        targets: &Self::Buf,
        spec: LmHead,
    ) -> Result<()>;
    /// Given `dlogprobs, dentropy: [tokens]` (Full), overwrites `dhidden` and accumulates
    /// `dw`, recomputing each chunk's logits from `hidden`, `w` and the saved `lse`.
    #[allow(clippy::too_many_arguments)]
    fn lm_head_backward(
        &self,
        dhidden: &mut Self::Buf,
        dw: &mut Self::Buf,
        dlogprobs: &Self::Buf,
        dentropy: &Self::Buf,
        hidden: &Self::Buf,
        w: &Self::Buf,
        targets: &Self::Buf,
        lse: &Self::Buf,
        spec: LmHead,
    ) -> Result<()>;

    // ---- sampling --------------------------------------------------------------------

    /// Draws one token per row of `logits: [rows.len(), vocab]` with that row's
    /// parameters; see [`SamplingRow`] and [`Sampled`].
    fn sample(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        rows: &[SamplingRow],
    ) -> Result<Vec<Sampled>>;

    // ---- optimizer -------------------------------------------------------------------

    /// One AdamW step on Full `param`, `grad`, `m`, `v`; when `compute` is given (a
    /// separate Compute copy of the weights, as on CUDA), it receives the new values.
    fn adamw(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        compute: Option<&mut Self::Buf>,
        hp: AdamW,
    ) -> Result<()>;

    /// One AdamW step whose state lives in host memory, as ZeRO-Offload keeps it: the f32
    /// `master` weights and moments `m`, `v` (each of `grad`'s length) are updated on the
    /// host by the rule of [`Backend::adamw`], and the new weights are written into
    /// `param` (Compute or Full). A device streams the Full `grad` down and the weights up
    /// in chunks, overlapped with the update.
    fn adamw_host(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        master: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        hp: AdamW,
    ) -> Result<()>;
}
