// Causal grouped-query attention over packed segments (forward, backward) and paged
// attention over the KV cache.
//
// Version 2 (this file): flash-attention-2 style on the tensor cores (mma.sync m16n8k16
// bf16 -> f32, ldmatrix from padded shared memory), online softmax in base 2.
// A block is 4 warps. Forward and dQ: a block owns 64 query rows of one head (16 per
// warp) and walks 64-key tiles of K and V through shared memory. dK/dV: a block owns 64
// key rows of one kv head (16 per warp) and walks 32-query tiles of Q and dO, summed over
// the heads of its group and over every query range that reads those keys.
// Version 1 (CUDA-core fp32, 4 threads per row) measured 9.3 / 6.5 TFLOP/s fwd / bwd at
// 8 x 2048 tokens; see docs/cuda-notes.md.
//
// Work lists come from the host (cuda/attention.rs):
//   segs  [n_seg * 4]: start, len, prefix_start, prefix_len (the `Segment` struct)
//   items [n_item * 3]: seg, q_lo, q_hi, a tile of at most 64 queries inside one segment
//   key tiles [n_tile * 2]: k_lo, k_hi (at most 64 keys), with a CSR list of the query
//   ranges that read them: tile_ranges[n_tile + 1] offsets into ranges [n_range * 3]:
//   seg, q_lo, q_hi.
// Query q of segment s may read key k iff k is in s's prefix, or s.start <= k <= q.

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define Q_TILE 64   // query rows per forward / dQ block
#define K_TILE 64   // key rows per shared-memory tile (forward / dQ) and per dK/dV block
#define QB_TILE 32  // query rows per shared-memory tile in dK/dV
// Shared-memory rows are padded by 8 bf16 (16 bytes): a row stride of D + 8 elements puts
// the 8 rows an ldmatrix phase reads in distinct banks.
#define PAD 8

__device__ __forceinline__ bool attn_allowed(u32 q, u32 k, const u32* seg) {
    return (k >= seg[2] && k < seg[2] + seg[3]) || (k >= seg[0] && k <= q);
}

// d (16x8 f32) += a (16x16 bf16, row-major fragments) * b (16x8 bf16, col-major fragments).
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory; lane i gives the address of row i % 8 of
// matrix i / 8. `trans` transposes each matrix on the way (for B operands stored k-major).
__device__ __forceinline__ void ldsm4(u32* r, const bf16_t* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm4_trans(u32* r, const bf16_t* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// Two floats to a bf16x2 register (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Rows [lo, hi) (at most `rows`) of head `head` of a [T, heads, D] bf16 tensor into a
// [rows][D + PAD] shared tile with 16-byte copies; rows past `hi` are zero.
template <int D>
__device__ __forceinline__ void load_tile(bf16_t* tile, const bf16_t* src, u32 lo, u32 hi, int heads, int head,
                                          int rows) {
    constexpr int CHUNKS = D / 8;
    for (int e = threadIdx.x; e < rows * CHUNKS; e += blockDim.x) {
        int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        u32 row = lo + r;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (row < hi) val = *(const uint4*)(src + ((i64)row * heads + head) * D + c);
        *(uint4*)(tile + r * (D + PAD) + c) = val;
    }
}

// Asynchronous 16-byte (4-byte) global -> shared copies (sm_80+): the copy engine fills
// the next tile while the warps compute on the current one. `valid == false` zero-fills.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `pending` committed groups are still in flight.
__device__ __forceinline__ void cp_async_wait(int pending) {
    if (pending == 0) asm volatile("cp.async.wait_group 0;\n" ::);
    else asm volatile("cp.async.wait_group 1;\n" ::);
}

// load_tile with asynchronous copies (commit and wait are the caller's).
template <int D>
__device__ __forceinline__ void load_tile_async(bf16_t* tile, const bf16_t* src, u32 lo, u32 hi, int heads,
                                                int head, int rows) {
    constexpr int CHUNKS = D / 8;
    for (int e = threadIdx.x; e < rows * CHUNKS; e += blockDim.x) {
        int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        u32 row = lo + r;
        bool ok = row < hi;
        cp_async16(tile + r * (D + PAD) + c, src + ((i64)(ok ? row : lo) * heads + head) * D + c, ok);
    }
}

// The key tiles a query tile walks: first its segment's prefix (no causal mask), then its
// own segment up to the last query. Tile i starts at `lo`, ends at `hi` (exclusive).
struct KeyTiles {
    u32 prefix_start, prefix_tiles, prefix_end, own_start, own_end;
    __device__ KeyTiles(const u32* seg, u32 q_hi)
        : prefix_start(seg[2]), prefix_tiles((seg[3] + K_TILE - 1) / K_TILE), prefix_end(seg[2] + seg[3]),
          own_start(seg[0]), own_end(q_hi) {}
    __device__ int count() const { return (int)(prefix_tiles + (own_end - own_start + K_TILE - 1) / K_TILE); }
    __device__ bool causal(int i) const { return (u32)i >= prefix_tiles; }
    __device__ u32 lo(int i) const {
        return causal(i) ? own_start + ((u32)i - prefix_tiles) * K_TILE : prefix_start + (u32)i * K_TILE;
    }
    __device__ u32 hi(int i) const { return min(lo(i) + K_TILE, causal(i) ? own_end : prefix_end); }
};

// Whether the 16 query rows from `warp_row` see every key of the tile [t_lo, t_hi): a full
// tile, rows inside the query tile, and (own keys) the last key at or before the first row.
// Such interior tiles, most of a long sequence's, skip the per-element mask.
__device__ __forceinline__ bool sees_whole_tile(u32 t_lo, u32 t_hi, bool causal, u32 warp_row, u32 q_hi) {
    return t_hi - t_lo == K_TILE && warp_row + 16 <= q_hi && (!causal || t_hi <= warp_row + 1);
}

// A fragments (16 rows x D) straight from global memory: the D-long rows at `p0` (the
// lanes' g) and `p1` (g + 8); a null row reads as zeros.
template <int D>
__device__ __forceinline__ void load_a_ptrs(u32 (*a)[4], const bf16_t* p0, const bf16_t* p1, int t) {
    const u32 *r0 = (const u32*)p0, *r1 = (const u32*)p1;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        int c = (ks * 16 + t * 2) / 2;
        a[ks][0] = r0 ? r0[c] : 0u;
        a[ks][1] = r1 ? r1[c] : 0u;
        a[ks][2] = r0 ? r0[c + 4] : 0u;
        a[ks][3] = r1 ? r1[c + 4] : 0u;
    }
}

// load_a_ptrs of rows row0 and row0 + 8 of head `head` of a [T, heads, D] tensor; rows at
// or past `hi` read as zeros.
template <int D>
__device__ __forceinline__ void load_a_rows(u32 (*a)[4], const bf16_t* src, u32 row0, u32 hi, int heads,
                                            int head, int t) {
    const bf16_t* p0 = row0 < hi ? src + ((i64)row0 * heads + head) * D : nullptr;
    const bf16_t* p1 = row0 + 8 < hi ? src + ((i64)(row0 + 8) * heads + head) * D : nullptr;
    load_a_ptrs<D>(a, p0, p1, t);
}

// acc[16 x 8*NT] += A (16 x D, fragments in registers) * tile^T, where tile holds NT*8
// rows of length D in shared memory (B[k = dim][n = row] = tile[row][dim]).
template <int D, int NT>
__device__ __forceinline__ void mma_a_tileT(float (*acc)[4], const u32 (*a)[4], const bf16_t* tile, int lane) {
    int mrow = lane & 7, mat = lane >> 3;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            u32 b[4];
            ldsm4(b, tile + ((nt + (mat >> 1)) * 8 + mrow) * (D + PAD) + ks * 16 + (mat & 1) * 8);
            mma16816(acc[nt], a[ks], b[0], b[1]);
            mma16816(acc[nt + 1], a[ks], b[2], b[3]);
        }
    }
}

// acc[16 x D] += P (16 x 16*KS2, C-layout f32 in registers) * tile, where tile holds the
// 16*KS2 rows (k) of length D (n) in shared memory.
template <int D, int KS2>
__device__ __forceinline__ void mma_p_tile(float (*acc)[4], const float (*p)[4], const bf16_t* tile, int lane) {
    int mrow = lane & 7, mat = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < KS2; ++kk) {
        u32 a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                    pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
            u32 b[4];
            ldsm4_trans(b, tile + (kk * 16 + (mat & 1) * 8 + mrow) * (D + PAD) + (dt + (mat >> 1)) * 8);
            mma16816(acc[dt], a, b[0], b[1]);
            mma16816(acc[dt + 1], a, b[2], b[3]);
        }
    }
}

// A fragments of 16 rows (starting at `rows`) x D from a padded shared tile.
template <int D>
__device__ __forceinline__ void load_a_smem(u32 (*a)[4], const bf16_t* tile, int lane) {
    int mrow = lane & 7, mat = lane >> 3;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
        ldsm4(a[ks], tile + ((mat & 1) * 8 + mrow) * (D + PAD) + ks * 16 + (mat >> 1) * 8);
}

// The keys a forward query tile walks, packed: its segment's prefix, then its own keys
// (see `KeyTiles`), rows of [T, kv_heads, D] tensors. A query's position is its row.
template <int D>
struct PackedKeys {
    KeyTiles kt;
    const bf16_t *k, *v;
    int kv_heads, kvh;
    __device__ int count() const { return kt.count(); }
    __device__ bool causal(int i) const { return kt.causal(i); }
    __device__ u32 lo(int i) const { return kt.lo(i); }
    __device__ u32 hi(int i) const { return kt.hi(i); }
    // Tile i's keys into `stage`, its values K_TILE rows after.
    __device__ void load(bf16_t* stage, int i) const {
        load_tile_async<D>(stage, k, lo(i), hi(i), kv_heads, kvh, K_TILE);
        load_tile_async<D>(stage + K_TILE * (D + PAD), v, lo(i), hi(i), kv_heads, kvh, K_TILE);
    }
};

// The keys a query tile walks in the paged cache: positions [begin, end) of one sequence,
// through its block table; causal for prefill (the query at position p sees 0..=p), not
// for cascade attention (every query sits past the shared keys).
template <int D>
struct PagedKeys {
    const bf16_t *k_cache, *v_cache;
    const u32* table;
    int block_size, kv_heads, kvh;
    u32 begin, end;
    bool is_causal;
    __device__ int count() const { return (int)((end - begin + K_TILE - 1) / K_TILE); }
    __device__ bool causal(int) const { return is_causal; }
    __device__ u32 lo(int i) const { return begin + (u32)i * K_TILE; }
    __device__ u32 hi(int i) const { return min(lo(i) + K_TILE, end); }
    __device__ void load(bf16_t* stage, int i) const {
        constexpr int CHUNKS = D / 8;
        u32 t_lo = lo(i), t_hi = hi(i);
        for (int e = threadIdx.x; e < K_TILE * CHUNKS; e += blockDim.x) {
            int r = e / CHUNKS, c = (e % CHUNKS) * 8;
            u32 pos = t_lo + r;
            bool ok = pos < t_hi;
            i64 slot = ok ? (i64)table[pos / block_size] * block_size + pos % block_size : 0;
            i64 at = (slot * kv_heads + kvh) * D + c;
            cp_async16(stage + r * (D + PAD) + c, k_cache + at, ok);
            cp_async16(stage + (K_TILE + r) * (D + PAD) + c, v_cache + at, ok);
        }
    }
};

// The query rows of a forward tile: rows [lo, hi) of head h of [T, heads, D] tensors, row
// r (from lo) at position lo + r + qoff (u32, wrapping) for the causal mask. Results are
// normalised into `out`, the log-sum-exps into `lse` when it is set.
template <int D>
struct HeadRows {
    bf16_t* out;
    float* lse;
    const bf16_t* q;
    u32 lo, hi, qoff;
    int h, heads;
    __device__ u32 count() const { return hi - lo; }
    __device__ u32 pos(u32 r) const { return lo + r + qoff; }
    // A fragments of rows r0 and r0 + 8.
    __device__ void load_q(u32 (*a)[4], u32 r0, int t) const { load_a_rows<D>(a, q, lo + r0, hi, heads, h, t); }
    // Row r from the accumulator's c-halves `half` (0: c = 0, 1; 1: c = 2, 3), its max m
    // (log2 units) and sum l.
    __device__ void store(u32 r, const float (*o)[4], int half, float m, float l, int t) const {
        u32 row = lo + r;
        float inv = 1.0f / l;
        u32* dst = (u32*)(out + ((i64)row * heads + h) * D);
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            dst[(dt * 8 + t * 2) / 2] = pack_bf16(o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv);
        if (lse && t == 0) lse[(i64)row * heads + h] = (m + log2f(l)) * LN2;
    }
};

// Forward of a tile of at most Q_TILE query `rows` (HeadRows or CascadeRows) against
// `keys`.
template <int D, class Keys, class Rows>
__device__ void attention_forward_tile(const Keys& keys, const Rows& rows, float scale) {
    constexpr int NT = K_TILE / 8, DT = D / 8, STAGE = K_TILE * (D + PAD);
    // Two stages of K and V tiles: [stage][K | V][K_TILE][D + PAD].
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* tiles = (bf16_t*)smem;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 n_rows = rows.count(), warp_row = warp * 16, row0 = warp_row + g, row1 = row0 + 8;
    u32 pos0 = rows.pos(row0), pos1 = rows.pos(row1);
    int n_tiles = keys.count();
    if (n_tiles > 0) keys.load(tiles, 0);
    cp_async_commit();

    u32 qa[D / 16][4];
    rows.load_q(qa, row0, t);
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float sl = scale * LOG2E;

    for (int i = 0; i < n_tiles; ++i) {
        {
            if (i + 1 < n_tiles) keys.load(tiles + ((i + 1) & 1) * 2 * STAGE, i + 1);
            cp_async_commit();
            cp_async_wait(1);
            __syncthreads();
            const bf16_t* ks = tiles + (i & 1) * 2 * STAGE;
            const bf16_t* vs = ks + STAGE;
            u32 t_lo = keys.lo(i), t_hi = keys.hi(i);
            bool causal = keys.causal(i);
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            mma_a_tileT<D, NT>(s, qa, ks, lane);
            float mx0 = NEG_INF, mx1 = NEG_INF;
            // Interior tiles, most of a long sequence's, skip the per-element mask: a full
            // tile, the warp's rows all real, and (causal) the last key at or before the
            // warp's first row.
            if (t_hi - t_lo == K_TILE && warp_row + 16 <= n_rows &&
                (!causal || t_hi <= rows.pos(warp_row) + 1)) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        float val = s[nt][c] * sl;
                        s[nt][c] = val;
                        if (c < 2) mx0 = fmaxf(mx0, val);
                        else mx1 = fmaxf(mx1, val);
                    }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        u32 key = t_lo + nt * 8 + t * 2 + (c & 1);
                        u32 row = c < 2 ? row0 : row1;
                        bool ok = key < t_hi && row < n_rows && (!causal || key <= (c < 2 ? pos0 : pos1));
                        float val = ok ? s[nt][c] * sl : NEG_INF;
                        s[nt][c] = val;
                        if (c < 2) mx0 = fmaxf(mx0, val);
                        else mx1 = fmaxf(mx1, val);
                    }
            }
            float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
            // A row with no visible key yet keeps m = -inf; exp2 against 0 then gives 0, not NaN.
            float b0 = mn0 == NEG_INF ? 0.0f : mn0, b1 = mn1 == NEG_INF ? 0.0f : mn1;
            float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
            m0 = mn0;
            m1 = mn1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[dt][0] *= c0;
                o[dt][1] *= c0;
                o[dt][2] *= c1;
                o[dt][3] *= c1;
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][0] = exp2f(s[nt][0] - b0);
                s[nt][1] = exp2f(s[nt][1] - b0);
                s[nt][2] = exp2f(s[nt][2] - b1);
                s[nt][3] = exp2f(s[nt][3] - b1);
                l0 += s[nt][0] + s[nt][1];
                l1 += s[nt][2] + s[nt][3];
            }
            mma_p_tile<D, K_TILE / 16>(o, s, vs, lane);
        }
        // The next iteration's copy overwrites this stage.
        __syncthreads();
    }
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    if (row0 < n_rows) rows.store(row0, o, 0, m0, l0, t);
    if (row1 < n_rows) rows.store(row1, o, 1, m1, l1, t);
}


template <int D>
__device__ void attention_forward_impl(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k,
                                       const bf16_t* v, const u32* segs, const u32* items, int q_heads,
                                       int kv_heads, float scale) {
    const u32* item = items + 3 * blockIdx.x;
    const u32* seg = segs + 4 * item[0];
    u32 q_lo = item[1], q_hi = item[2];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    PackedKeys<D> keys{KeyTiles(seg, q_hi), k, v, kv_heads, kvh};
    attention_forward_tile<D>(keys, HeadRows<D>{out, lse, q, q_lo, q_hi, 0u, h, q_heads}, scale);
}

// Prefill over the paged cache on the tensor cores: a block takes up to Q_TILE query
// tokens [q_lo, q_hi) (an item) that are one sequence's consecutive positions, already
// written to the cache with their context, and walks that context in K_TILE tiles like
// the packed forward. Decode tokens stay with `paged_attention`.
template <int D>
__device__ void paged_prefill_attention_impl(bf16_t* out, const bf16_t* q, const bf16_t* k_cache,
                                             const bf16_t* v_cache, const u32* block_tables,
                                             const u32* token_seq, const u32* token_pos, const u32* items,
                                             int max_blocks, int block_size, int q_heads, int kv_heads,
                                             float scale) {
    u32 q_lo = items[2 * blockIdx.x], q_hi = items[2 * blockIdx.x + 1];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    u32 p_lo = token_pos[q_lo];
    PagedKeys<D> keys{k_cache, v_cache, block_tables + (i64)token_seq[q_lo] * max_blocks, block_size, kv_heads,
                      kvh, 0u, p_lo + (q_hi - q_lo), true};
    attention_forward_tile<D>(keys, HeadRows<D>{out, nullptr, q, q_lo, q_hi, p_lo - q_lo, h, q_heads}, scale);
}

// The query rows of cascade attention: the decode tokens of a group whose sequences share
// a prompt's cached keys, times the query heads of one kv head. Flat row f = lo + r is
// listed token first + f / group, head kvh * group + f % group (listed tokens are the decode
// kernel's: `token_list[i]`, or i without a list). No row is causal (every token sits past
// the shared keys). Results go out unnormalised as split `slot`'s partial of each (token,
// head), in `paged_attention`'s format, for `paged_attention_combine`.
template <int D>
struct CascadeRows {
    float *part_acc, *part_ml;
    const bf16_t* q;
    const u32* token_list;
    u32 first, lo, hi;
    int group, kvh, q_heads, nslots, slot;
    __device__ u32 count() const { return hi - lo; }
    __device__ u32 pos(u32) const { return 0u; }
    __device__ u32 listed(u32 r) const { return first + (lo + r) / (u32)group; }
    __device__ i64 head(u32 r) const { return (i64)kvh * group + (lo + r) % (u32)group; }
    __device__ const bf16_t* q_row(u32 r) const {
        if (r >= count()) return nullptr;
        u32 i = listed(r), tok = token_list ? token_list[i] : i;
        return q + ((i64)tok * q_heads + head(r)) * D;
    }
    __device__ void load_q(u32 (*a)[4], u32 r0, int t) const { load_a_ptrs<D>(a, q_row(r0), q_row(r0 + 8), t); }
    __device__ void store(u32 r, const float (*o)[4], int half, float m, float l, int t) const {
        i64 pr = ((i64)listed(r) * q_heads + head(r)) * nslots + slot;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *(float2*)(part_acc + pr * D + dt * 8 + t * 2) = make_float2(o[dt][2 * half], o[dt][2 * half + 1]);
        if (t == 0) {
            part_ml[pr * 2] = m;
            part_ml[pr * 2 + 1] = l;
        }
    }
};

// Cascade attention, the shared part: a block takes an item (listed token `first`, flat
// rows [lo, hi) of the group's tokens x query heads, at most Q_TILE; `keys` shared keys) of
// a group, kv head y and context split z, and attends those rows to the split's share of
// the shared keys on the tensor cores, reading them once for the whole group where the
// decode kernel would read them once per token. Split z is partial slot z; the decode
// kernel takes each token's own keys from `keys` on, in the slots after.
template <int D>
__device__ void paged_cascade_attention_impl(float* part_acc, float* part_ml, const bf16_t* q,
                                             const bf16_t* k_cache, const bf16_t* v_cache,
                                             const u32* block_tables, const u32* token_seq,
                                             const u32* token_list, const u32* items, int max_blocks,
                                             int block_size, int q_heads, int kv_heads, int split_len,
                                             int nslots, float scale) {
    const u32* item = items + 4 * blockIdx.x;
    u32 first = item[0], shared = item[3], k_lo = blockIdx.z * (u32)split_len;
    if (k_lo >= shared) return;  // the whole block
    int kvh = blockIdx.y, group = q_heads / kv_heads;
    u32 tok = token_list ? token_list[first] : first;
    // Every member holds the shared keys in the same blocks: the first one's table serves.
    PagedKeys<D> keys{k_cache, v_cache, block_tables + (i64)token_seq[tok] * max_blocks, block_size, kv_heads,
                      kvh, k_lo, min(shared, k_lo + (u32)split_len), false};
    CascadeRows<D> rows{part_acc, part_ml, q, token_list, first, item[1], item[2], group, kvh, q_heads, nslots,
                        (int)blockIdx.z};
    attention_forward_tile<D>(keys, rows, scale);
}

// delta[t, h] = sum_d dout[t, h, d] * out[t, h, d], one warp per (t, h).
extern "C" __global__ void attention_backward_delta(float* delta, const bf16_t* dout, const bf16_t* out,
                                                    i64 rows, int head_dim) {
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (i64 r = blockIdx.x * (i64)warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        float acc = 0.0f;
        for (int c = lane; c < head_dim; c += 32)
            acc += bf2f(dout[r * head_dim + c]) * bf2f(out[r * head_dim + c]);
        acc = warp_sum(acc);
        if (lane == 0) delta[r] = acc;
    }
}

// dQ for 64 queries of one head (K/V tiles double-buffered like the forward): with P = exp2(S - lse), dP = dO V^T,
// dS = P (dP - delta), dQ = scale * dS K.
template <int D>
__device__ void attention_backward_dq_impl(bf16_t* dq, const bf16_t* dout, const float* lse,
                                           const float* delta, const bf16_t* q, const bf16_t* k,
                                           const bf16_t* v, const u32* segs, const u32* items, int q_heads,
                                           int kv_heads, float scale) {
    constexpr int NT = K_TILE / 8, DT = D / 8, STAGE = K_TILE * (D + PAD);
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* tiles = (bf16_t*)smem;
    const u32* item = items + 3 * blockIdx.x;
    const u32* seg = segs + 4 * item[0];
    u32 q_lo = item[1], q_hi = item[2];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 row0 = q_lo + warp * 16 + g, row1 = row0 + 8;
    KeyTiles kt(seg, q_hi);
    int n_tiles = kt.count();
    if (n_tiles > 0) {
        load_tile_async<D>(tiles, k, kt.lo(0), kt.hi(0), kv_heads, kvh, K_TILE);
        load_tile_async<D>(tiles + STAGE, v, kt.lo(0), kt.hi(0), kv_heads, kvh, K_TILE);
    }
    cp_async_commit();

    u32 qa[D / 16][4], da[D / 16][4];
    load_a_rows<D>(qa, q, row0, q_hi, q_heads, h, t);
    load_a_rows<D>(da, dout, row0, q_hi, q_heads, h, t);
    float acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    float lse0 = row0 < q_hi ? lse[(i64)row0 * q_heads + h] * LOG2E : 0.0f;
    float lse1 = row1 < q_hi ? lse[(i64)row1 * q_heads + h] * LOG2E : 0.0f;
    float dl0 = row0 < q_hi ? delta[(i64)row0 * q_heads + h] : 0.0f;
    float dl1 = row1 < q_hi ? delta[(i64)row1 * q_heads + h] : 0.0f;
    float sl = scale * LOG2E;

    for (int i = 0; i < n_tiles; ++i) {
        {
            if (i + 1 < n_tiles) {
                bf16_t* next = tiles + ((i + 1) & 1) * 2 * STAGE;
                load_tile_async<D>(next, k, kt.lo(i + 1), kt.hi(i + 1), kv_heads, kvh, K_TILE);
                load_tile_async<D>(next + STAGE, v, kt.lo(i + 1), kt.hi(i + 1), kv_heads, kvh, K_TILE);
            }
            cp_async_commit();
            cp_async_wait(1);
            __syncthreads();
            const bf16_t* ks = tiles + (i & 1) * 2 * STAGE;
            const bf16_t* vs = ks + STAGE;
            u32 t_lo = kt.lo(i), t_hi = kt.hi(i);
            bool causal = kt.causal(i);
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[nt][c] = dp[nt][c] = 0.0f;
            mma_a_tileT<D, NT>(s, qa, ks, lane);
            mma_a_tileT<D, NT>(dp, da, vs, lane);
            if (sees_whole_tile(t_lo, t_hi, causal, q_lo + warp * 16, q_hi)) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        float p = exp2f(s[nt][c] * sl - (c < 2 ? lse0 : lse1));
                        s[nt][c] = p * (dp[nt][c] - (c < 2 ? dl0 : dl1));
                    }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        u32 key = t_lo + nt * 8 + t * 2 + (c & 1);
                        u32 row = c < 2 ? row0 : row1;
                        bool ok = key < t_hi && row < q_hi && (!causal || key <= row);
                        float p = ok ? exp2f(s[nt][c] * sl - (c < 2 ? lse0 : lse1)) : 0.0f;
                        s[nt][c] = p * (dp[nt][c] - (c < 2 ? dl0 : dl1));
                    }
            }
            mma_p_tile<D, K_TILE / 16>(acc, s, ks, lane);
        }
        __syncthreads();
    }
    if (row0 < q_hi) {
        u32* dst = (u32*)(dq + ((i64)row0 * q_heads + h) * D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + t * 2) / 2] = pack_bf16(acc[dt][0] * scale, acc[dt][1] * scale);
    }
    if (row1 < q_hi) {
        u32* dst = (u32*)(dq + ((i64)row1 * q_heads + h) * D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + t * 2) / 2] = pack_bf16(acc[dt][2] * scale, acc[dt][3] * scale);
    }
}

// The (head of the group, query range, 32-query tile) triples a dK/dV block walks, in order.
struct QueryTiles {
    const u32* ranges;
    u32 r_begin, r_end;
    int group, gi;
    u32 ri, lo;
    __device__ QueryTiles(const u32* ranges_, u32 r_begin_, u32 r_end_, int group_)
        : ranges(ranges_), r_begin(r_begin_), r_end(r_end_), group(group_), gi(r_begin_ == r_end_ ? group_ : 0),
          ri(r_begin_), lo(r_begin_ == r_end_ ? 0 : ranges_[3 * r_begin_ + 1]) {}
    __device__ bool done() const { return gi >= group; }
    __device__ u32 hi() const { return min(lo + QB_TILE, ranges[3 * ri + 2]); }
    __device__ void advance() {
        lo += QB_TILE;
        if (lo >= ranges[3 * ri + 2]) {
            if (++ri == r_end) {
                ri = r_begin;
                ++gi;
            }
            lo = ranges[3 * ri + 1];
        }
    }
};

// dK, dV for 64 keys of one kv head (16 per warp), summed over the heads of its group and
// every query range that reads the tile: P^T = exp2(K Q^T - lse), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += scale * dS^T Q. Each (key, kv head)
// belongs to one block, so the results are written, not accumulated. Dynamic shared
// memory: the K and V tiles, then two stages of Q and dO tiles (QB_TILE rows each), then
// two stages of the tiles' lse and delta.
template <int D>
__device__ void attention_backward_dkdv_impl(bf16_t* dk, bf16_t* dv, const bf16_t* dout, const float* lse,
                                             const float* delta, const bf16_t* q, const bf16_t* k,
                                             const bf16_t* v, const u32* segs, const u32* key_tiles,
                                             const u32* tile_ranges, const u32* ranges, int q_heads,
                                             int kv_heads, float scale) {
    constexpr int NT = QB_TILE / 8, DT = D / 8, ROW = D + PAD, QSTAGE = 2 * QB_TILE * ROW;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* ks = (bf16_t*)smem;
    bf16_t* vs = ks + K_TILE * ROW;
    bf16_t* qstages = vs + K_TILE * ROW;                   // [2][Q | dO][QB_TILE][ROW]
    float* fstages = (float*)(qstages + 2 * QSTAGE);      // [2][lse | delta][QB_TILE]
    u32 k_lo = key_tiles[2 * blockIdx.x], k_hi = key_tiles[2 * blockIdx.x + 1];
    int kvh = blockIdx.y, group = q_heads / kv_heads;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 key0 = k_lo + warp * 16 + g, key1 = key0 + 8;
    const bf16_t* my_k = ks + warp * 16 * ROW;
    const bf16_t* my_v = vs + warp * 16 * ROW;

    // Copies the Q, dO, lse and delta rows of one query tile into `stage`.
    auto issue = [&](const QueryTiles& it, int stage) {
        int h = kvh * group + it.gi;
        u32 lo = it.lo, hi = it.hi();
        bf16_t* qs = qstages + stage * QSTAGE;
        load_tile_async<D>(qs, q, lo, hi, q_heads, h, QB_TILE);
        load_tile_async<D>(qs + QB_TILE * ROW, dout, lo, hi, q_heads, h, QB_TILE);
        if (threadIdx.x < QB_TILE) {
            u32 qrow = lo + threadIdx.x;
            bool ok = qrow < hi;
            i64 at = (i64)(ok ? qrow : lo) * q_heads + h;
            float* fs = fstages + stage * 2 * QB_TILE;
            cp_async4(fs + threadIdx.x, lse + at, ok);
            cp_async4(fs + QB_TILE + threadIdx.x, delta + at, ok);
        }
    };

    QueryTiles cur(ranges, tile_ranges[blockIdx.x], tile_ranges[blockIdx.x + 1], group);
    load_tile_async<D>(ks, k, k_lo, k_hi, kv_heads, kvh, K_TILE);
    load_tile_async<D>(vs, v, k_lo, k_hi, kv_heads, kvh, K_TILE);
    if (!cur.done()) issue(cur, 0);
    cp_async_commit();

    float dka[DT][4], dva[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int c = 0; c < 4; ++c) dka[dt][c] = dva[dt][c] = 0.0f;
    float sl = scale * LOG2E;

    for (int stage = 0; !cur.done(); stage ^= 1) {
        QueryTiles next = cur;
        next.advance();
        if (!next.done()) issue(next, stage ^ 1);
        cp_async_commit();
        cp_async_wait(1);
        __syncthreads();
        const bf16_t* qs = qstages + stage * QSTAGE;
        const bf16_t* dos = qs + QB_TILE * ROW;
        const float* lses = fstages + stage * 2 * QB_TILE;
        const float* deltas = lses + QB_TILE;
        const u32* seg = segs + 4 * ranges[3 * cur.ri];
        u32 t_lo = cur.lo, t_hi = cur.hi();
        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[nt][c] = dp[nt][c] = 0.0f;
        {
            u32 a[D / 16][4];
            load_a_smem<D>(a, my_k, lane);
            mma_a_tileT<D, NT>(s, a, qs, lane);
            load_a_smem<D>(a, my_v, lane);
            mma_a_tileT<D, NT>(dp, a, dos, lane);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                int qc = nt * 8 + t * 2 + (c & 1);
                u32 qrow = t_lo + qc;
                u32 key = c < 2 ? key0 : key1;
                bool ok = key < k_hi && qrow < t_hi && attn_allowed(qrow, key, seg);
                float p = ok ? exp2f(s[nt][c] * sl - lses[qc] * LOG2E) : 0.0f;
                s[nt][c] = p;
                dp[nt][c] = p * (dp[nt][c] - deltas[qc]);
            }
        mma_p_tile<D, QB_TILE / 16>(dva, s, dos, lane);
        mma_p_tile<D, QB_TILE / 16>(dka, dp, qs, lane);
        // The next iteration's copy overwrites this stage.
        __syncthreads();
        cur = next;
    }
    if (key0 < k_hi) {
        u32* dkd = (u32*)(dk + ((i64)key0 * kv_heads + kvh) * D);
        u32* dvd = (u32*)(dv + ((i64)key0 * kv_heads + kvh) * D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            dkd[(dt * 8 + t * 2) / 2] = pack_bf16(dka[dt][0] * scale, dka[dt][1] * scale);
            dvd[(dt * 8 + t * 2) / 2] = pack_bf16(dva[dt][0], dva[dt][1]);
        }
    }
    if (key1 < k_hi) {
        u32* dkd = (u32*)(dk + ((i64)key1 * kv_heads + kvh) * D);
        u32* dvd = (u32*)(dv + ((i64)key1 * kv_heads + kvh) * D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            dkd[(dt * 8 + t * 2) / 2] = pack_bf16(dka[dt][2] * scale, dka[dt][3] * scale);
            dvd[(dt * 8 + t * 2) / 2] = pack_bf16(dva[dt][2], dva[dt][3]);
        }
    }
}

// Paged attention over the KV cache for decode tokens (flash-decoding). Version 4.
// A block of PAGED_WARPS warps takes one (query token, kv head, context split): the (up to
// 8) query heads of the kv head's group share every K/V row the block reads, so the cache
// is read once per kv head. The warps take turns over chunks of the split's keys and merge
// their softmax states in shared memory at the end.
// A K or V row of one kv head is D bf16 = D / 8 16-byte words, so a warp's load covers
// 32 / (D / 8) rows whole, each lane one word: every load is coalesced (version 3 gave each
// lane its own row, so a load touched 32 rows and used half of each 32-byte sector). A
// chunk is NI such loads of K and of V, all issued before any arithmetic. A lane's partial
// dot products over its 8 dims are summed over the row's lanes by a transposed butterfly
// (each round halves the values a lane keeps), which leaves each key's score in a known
// lane; the P·V step fetches it from there.
// The running max is warp-uniform and the denominator stays per lane (counted once per key)
// until the end. Without `part_acc` (one split, no cascade) the block writes `out`;
// otherwise it writes its unnormalised accumulator and (max, sum) to `part_acc` /
// `part_ml` in its slot, and `paged_attention_combine` merges the slots of each query head.
// Split boundaries are `split_len` keys apart from the token's first own key and the warps'
// turns are fixed, so a token's result depends on its context, its group's shared keys and
// `split_len` only.
// With `token_list` set, block x takes token token_list[x]: the call's long prefill runs
// went to `paged_prefill_attention`. With `key_start` set, the token's keys before
// key_start[x] are its group's shared ones, which `paged_cascade_attention` took.
#define PAGED_WARPS 4  // warps of a block, all on one (token, kv head, split)
#define PAGED_GMAX 8   // most query heads per kv head a block takes (Qwen3-32B: 64 / 8)

// Sums each of N values over the L lanes of an aligned lane group (L a power of two) in
// log2(L) shuffle rounds. While a lane holds more than one value, round m (m = L/2, L/4, ...)
// keeps the upper half of them in lanes with bit m set and the lower half in the others, so
// a lane ends with max(1, N / L) sums: the one of value i lives in the lane whose bits m
// are set where i has the bit of that round's half (see `transposed_lane`).
template <int N, int L>
__device__ __forceinline__ void transposed_group_sum(float (&v)[N], int lane) {
    int c = N;
#pragma unroll
    for (int m = L / 2; m >= 1; m >>= 1) {
        if (c > 1) {
            int half = c / 2;
            bool up = lane & m;
#pragma unroll
            for (int j = 0; j < N / 2; ++j) {
                if (j < half) {
                    float send = up ? v[j] : v[j + half];
                    float keep = up ? v[j + half] : v[j];
                    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, m);
                }
            }
            c = half;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], m);
        }
    }
}

// The lane (within its group) that holds the sum of value i after `transposed_group_sum`,
// at index i % max(1, N / L); `transposed_first_index`, the value index of a lane's first
// sum.
template <int N, int L>
__device__ __forceinline__ int transposed_lane(int i) {
    int c = N, off = 0;
#pragma unroll
    for (int m = L / 2; m >= 1; m >>= 1) {
        if (c > 1) {
            c /= 2;
            if (i & c) off += m;
        }
    }
    return off;
}
template <int N, int L>
__device__ __forceinline__ int transposed_first_index(int lane) {
    int c = N, idx = 0;
#pragma unroll
    for (int m = L / 2; m >= 1; m >>= 1) {
        if (c > 1) {
            c /= 2;
            if (lane & m) idx += c;
        }
    }
    return idx;
}

// Eight bf16 (a 16-byte word) to floats.
__device__ __forceinline__ void unpack8(const uint4& w, float (&f)[8]) {
    u32 u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

// D: head dim; GM: query heads a block holds registers for (G <= GM are used).
template <int D, int GM>
__device__ void paged_attention_impl(bf16_t* out, float* part_acc, float* part_ml, const bf16_t* q,
                                     const bf16_t* k_cache, const bf16_t* v_cache, const u32* block_tables,
                                     const u32* token_seq, const u32* token_pos, const u32* token_list,
                                     const u32* key_start, int max_blocks, int block_size, int q_heads,
                                     int kv_heads, int split_len, int nslots, float scale) {
    constexpr int LPR = D / 8;               // lanes per row (one 16-byte word each)
    constexpr int RPL = 32 / LPR;            // rows one warp load covers
    constexpr int NI = 8;                    // loads of K (and of V) per chunk
    constexpr int CHUNK = NI * RPL;          // keys per chunk
    constexpr int VL = NI / LPR > 0 ? NI / LPR : 1;   // scores a lane holds after the sum
    constexpr int DUP = LPR / NI > 0 ? LPR / NI : 1;  // lanes holding each score
    __shared__ __align__(16) float s_q[GM][D];
    __shared__ float s_acc[PAGED_WARPS][GM][D];
    __shared__ float s_ml[PAGED_WARPS][GM][2];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row = lane / LPR, col = lane % LPR;  // the lane's row of a load and its word
    // A group of more than PAGED_GMAX query heads is taken by several blocks.
    int group = q_heads / kv_heads, parts = (group + PAGED_GMAX - 1) / PAGED_GMAX;
    int kvh = blockIdx.y / parts, part = blockIdx.y % parts;
    int G = min(PAGED_GMAX, group - part * PAGED_GMAX);  // query heads of this block
    // Token t of the call, or the listed one when the prefill kernel takes the others.
    int t = token_list ? (int)token_list[blockIdx.x] : blockIdx.x, split = blockIdx.z;
    u32 seq = token_seq[t], pos = token_pos[t];
    // With cascade attention the token's own keys start past its group's shared ones,
    // whose splits took the first partial slots.
    u32 own = key_start ? key_start[blockIdx.x] : 0u;
    u32 k_lo = own + (u32)split * split_len;
    if (k_lo > pos) return;  // the whole block
    int slot = (int)((own + split_len - 1) / split_len) + split;
    u32 k_hi = min(pos + 1, k_lo + (u32)split_len);
    i64 head0 = (i64)kvh * group + part * PAGED_GMAX;  // the block's first query head
    i64 q_row = (i64)t * q_heads + head0;
    // The query heads, pre-scaled for exp2, in shared memory: registers go to the K and V
    // words in flight, and a lane reads its 8 dims of a head as two 16-byte words.
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) s_q[i / D][i % D] = bf2f(q[q_row * D + i]) * scale * LOG2E;
    __syncthreads();
    const u32* table = block_tables + (i64)seq * max_blocks;
    // Which keys' scores this lane holds after the sum, and whether it counts them in l.
    int first = transposed_first_index<NI, LPR>(col);
    bool counts = (col & (DUP - 1)) == 0;
    float acc[GM][8], m[GM], l[GM];
#pragma unroll
    for (int h = 0; h < GM; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
    }
    for (u32 c0 = k_lo + warp * CHUNK; c0 < k_hi; c0 += PAGED_WARPS * CHUNK) {
        uint4 kw[NI], vw[NI];
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            u32 key = c0 + i * RPL + row;
            kw[i] = vw[i] = make_uint4(0, 0, 0, 0);
            if (key < k_hi) {
                i64 slot = (i64)table[key / block_size] * block_size + key % block_size;
                i64 off = (slot * kv_heads + kvh) * D + col * 8;
                kw[i] = *(const uint4*)(k_cache + off);
                vw[i] = *(const uint4*)(v_cache + off);
            }
        }
        float p[GM][VL];
#pragma unroll
        for (int h = 0; h < GM; ++h) {
            if (h >= G) continue;
            float qf[8], s[NI];
            *(float4*)&qf[0] = *(const float4*)&s_q[h][col * 8];
            *(float4*)&qf[4] = *(const float4*)&s_q[h][col * 8 + 4];
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                float kf[8];
                unpack8(kw[i], kf);
                s[i] = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) s[i] = fmaf(qf[e], kf[e], s[i]);
            }
            transposed_group_sum<NI, LPR>(s, lane);
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < VL; ++j) {
                bool valid = c0 + (u32)((first + j) * RPL + row) < k_hi;
                s[j] = valid ? s[j] : NEG_INF;
                mx = fmaxf(mx, s[j]);
            }
            float m_new = fmaxf(m[h], warp_max(mx));
            float corr = exp2f(m[h] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < VL; ++j) {
                p[h][j] = exp2f(s[j] - m_new);  // 0 for the masked keys
                sum += p[h][j];
            }
            l[h] = l[h] * corr + (counts ? sum : 0.0f);
            m[h] = m_new;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[h][e] *= corr;
        }
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            float vf[8];
            unpack8(vw[i], vf);
            int src = row * LPR + transposed_lane<NI, LPR>(i);
#pragma unroll
            for (int h = 0; h < GM; ++h) {
                if (h >= G) continue;
                float pi = __shfl_sync(0xffffffffu, p[h][i % VL], src);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(pi, vf[e], acc[h][e]);
            }
        }
    }
    // The rows of a load held different keys: sum them, then hand the warp's state to the
    // block through shared memory (a warp without keys left m = -inf, l = 0, acc = 0).
#pragma unroll
    for (int h = 0; h < GM; ++h) {
        if (h >= G) continue;
#pragma unroll
        for (int mask = LPR; mask < 32; mask <<= 1)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], mask);
        float l_sum = warp_sum(l[h]);
        if (lane < LPR)
#pragma unroll
            for (int e = 0; e < 8; ++e) s_acc[warp][h][col * 8 + e] = acc[h][e];
        if (lane == 0) {
            s_ml[warp][h][0] = m[h];
            s_ml[warp][h][1] = l_sum;
        }
    }
    __syncthreads();
    // Warp w merges query heads w, w + PAGED_WARPS, ...; the weights are relative to the
    // largest max, the same arithmetic `paged_attention_combine` uses across splits.
    for (int h = warp; h < G; h += PAGED_WARPS) {
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; ++w) mx = fmaxf(mx, s_ml[w][h][0]);
        float wt[PAGED_WARPS], l_sum = 0.0f;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; ++w) {
            wt[w] = exp2f(s_ml[w][h][0] - mx);
            l_sum += s_ml[w][h][1] * wt[w];
        }
        i64 r = q_row + h;
        // Partials are numbered by the block's token, listed or not.
        i64 pr = ((i64)blockIdx.x * q_heads + head0 + h) * nslots + slot;
        for (int d = lane; d < D; d += 32) {
            float o = 0.0f;
#pragma unroll
            for (int w = 0; w < PAGED_WARPS; ++w) o += s_acc[w][h][d] * wt[w];
            if (!part_acc)
                out[r * D + d] = f2bf(o / l_sum);
            else
                part_acc[pr * D + d] = o;
        }
        if (part_acc && lane == 0) {
            part_ml[pr * 2] = mx;
            part_ml[pr * 2 + 1] = l_sum;
        }
    }
}

// Merges the context splits of paged attention: one warp per (query token, query head),
// whose partials fill slots 0..n of `nslots`: the cascade kernel's splits of its shared
// keys (none without `key_start`), then the decode kernel's of its own.
// The weights are relative to the splits' largest max, the same arithmetic for one split
// as the direct write above (exp2(0) = 1, 0 + x = x), so results do not depend on the
// number of splits the host chose for other tokens.
extern "C" __global__ void paged_attention_combine(bf16_t* out, const float* part_acc, const float* part_ml,
                                                   const u32* token_pos, const u32* token_list,
                                                   const u32* key_start, int tokens, int q_heads, int nslots,
                                                   int split_len, int head_dim) {
    int lane = threadIdx.x & 31;
    // `row` numbers the partials (the kernel's tokens, listed or not); `out_row` the output.
    i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (i64)tokens * q_heads) return;
    int li = (int)(row / q_heads);
    int t = token_list ? (int)token_list[li] : li;
    i64 out_row = (i64)t * q_heads + row % q_heads;
    u32 own = key_start ? key_start[li] : 0u, sl = (u32)split_len;
    int n = (int)((own + sl - 1) / sl + (token_pos[t] - own) / sl) + 1;  // slots that hold keys
    const float* ml = part_ml + row * nslots * 2;
    float mx = NEG_INF;
    for (int s = 0; s < n; ++s) mx = fmaxf(mx, ml[s * 2]);
    float l_sum = 0.0f;
    for (int s = 0; s < n; ++s) l_sum += ml[s * 2 + 1] * exp2f(ml[s * 2] - mx);
    float inv_l = 1.0f / l_sum;
    // A lane takes 4 dims, one 16-byte load a slot (the whole row of a 128-dim head in one
    // pass), and the unrolled slot loop keeps several loads in flight.
    const float* acc = part_acc + row * nslots * head_dim;
    for (int d = lane * 4; d < head_dim; d += 128) {
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
        for (int s = 0; s < n; ++s) {
            float w = exp2f(ml[s * 2] - mx);
            float4 a = *(const float4*)(acc + (i64)s * head_dim + d);
            o.x += a.x * w;
            o.y += a.y * w;
            o.z += a.z * w;
            o.w += a.w * w;
        }
        *(uint2*)(out + out_row * head_dim + d) =
            make_uint2(pack_bf16(o.x * inv_l, o.y * inv_l), pack_bf16(o.z * inv_l, o.w * inv_l));
    }
}

// k_cache[slots[t], :, :] = k[t, :, :] and the same for v; `row` = kv_heads * head_dim.
extern "C" __global__ void kv_cache_write(bf16_t* k_cache, bf16_t* v_cache, const bf16_t* k, const bf16_t* v,
                                          const u32* slots, int tokens, int row) {
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        i64 dst = (i64)slots[t] * row, src = (i64)t * row;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < row; c += gridDim.x * blockDim.x) {
            k_cache[dst + c] = k[src + c];
            v_cache[dst + c] = v[src + c];
        }
    }
}

#define ATTENTION_INSTANCES(D)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) attention_forward_d##D(                               \
        bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k, const bf16_t* v, const u32* segs,       \
        const u32* items, int q_heads, int kv_heads, float scale) {                                         \
        attention_forward_impl<D>(out, lse, q, k, v, segs, items, q_heads, kv_heads, scale);               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_d##D(                           \
        bf16_t* dq, const bf16_t* dout, const float* lse, const float* delta, const bf16_t* q,              \
        const bf16_t* k, const bf16_t* v, const u32* segs, const u32* items, int q_heads, int kv_heads,     \
        float scale) {                                                                                      \
        attention_backward_dq_impl<D>(dq, dout, lse, delta, q, k, v, segs, items, q_heads, kv_heads,       \
                                      scale);                                                               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dkdv_d##D(                         \
        bf16_t* dk, bf16_t* dv, const bf16_t* dout, const float* lse, const float* delta, const bf16_t* q,  \
        const bf16_t* k, const bf16_t* v, const u32* segs, const u32* key_tiles, const u32* tile_ranges,    \
        const u32* ranges, int q_heads, int kv_heads, float scale) {                                        \
        attention_backward_dkdv_impl<D>(dk, dv, dout, lse, delta, q, k, v, segs, key_tiles, tile_ranges,   \
                                        ranges, q_heads, kv_heads, scale);                                  \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) paged_prefill_attention_d##D(                         \
        bf16_t* out, const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, const u32* block_tables, \
        const u32* token_seq, const u32* token_pos, const u32* items, int max_blocks, int block_size,       \
        int q_heads, int kv_heads, float scale) {                                                           \
        paged_prefill_attention_impl<D>(out, q, k_cache, v_cache, block_tables, token_seq, token_pos, items, \
                                        max_blocks, block_size, q_heads, kv_heads, scale);                  \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) paged_cascade_attention_d##D(                         \
        float* part_acc, float* part_ml, const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,     \
        const u32* block_tables, const u32* token_seq, const u32* token_list, const u32* items,            \
        int max_blocks, int block_size, int q_heads, int kv_heads, int split_len, int nslots, float scale) { \
        paged_cascade_attention_impl<D>(part_acc, part_ml, q, k_cache, v_cache, block_tables, token_seq,   \
                                        token_list, items, max_blocks, block_size, q_heads, kv_heads,       \
                                        split_len, nslots, scale);                                          \
    }

ATTENTION_INSTANCES(32)
ATTENTION_INSTANCES(64)
ATTENTION_INSTANCES(128)

// Decode kernels per head dim and register-held group size (the host rounds the group up
// to 2, 4 or 8), bounded to leave MINB blocks an SM (groups of 8 spill 64 bytes at 3
// blocks, which timed faster than 2 blocks without spills: docs/cuda-notes.md).
#define PAGED_DECODE_INSTANCE(D, GM, MINB)                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * PAGED_WARPS, MINB) paged_attention_d##D##_g##GM(         \
        bf16_t* out, float* part_acc, float* part_ml, const bf16_t* q, const bf16_t* k_cache,              \
        const bf16_t* v_cache, const u32* block_tables, const u32* token_seq, const u32* token_pos,         \
        const u32* token_list, const u32* key_start, int max_blocks, int block_size, int q_heads,          \
        int kv_heads, int split_len, int nslots, float scale) {                                             \
        paged_attention_impl<D, GM>(out, part_acc, part_ml, q, k_cache, v_cache, block_tables, token_seq,  \
                                    token_pos, token_list, key_start, max_blocks, block_size, q_heads,      \
                                    kv_heads, split_len, nslots, scale);                                    \
    }
#define PAGED_DECODE_INSTANCES(D) \
    PAGED_DECODE_INSTANCE(D, 2, 4) PAGED_DECODE_INSTANCE(D, 4, 3) PAGED_DECODE_INSTANCE(D, 8, 3)
PAGED_DECODE_INSTANCES(32)
PAGED_DECODE_INSTANCES(64)
PAGED_DECODE_INSTANCES(128)
