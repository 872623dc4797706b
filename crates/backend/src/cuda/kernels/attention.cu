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

// A fragments (16 rows x D) of rows row0 (lanes' g) and row0 + 8 straight from global memory.
template <int D>
__device__ __forceinline__ void load_a_rows(u32 (*a)[4], const bf16_t* src, u32 row0, u32 hi, int heads,
                                            int head, int t) {
    const u32* r0 = (const u32*)(src + ((i64)row0 * heads + head) * D);
    const u32* r1 = (const u32*)(src + ((i64)(row0 + 8) * heads + head) * D);
    bool ok0 = row0 < hi, ok1 = row0 + 8 < hi;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        int c = (ks * 16 + t * 2) / 2;
        a[ks][0] = ok0 ? r0[c] : 0u;
        a[ks][1] = ok1 ? r1[c] : 0u;
        a[ks][2] = ok0 ? r0[c + 4] : 0u;
        a[ks][3] = ok1 ? r1[c + 4] : 0u;
    }
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

template <int D>
__device__ void attention_forward_impl(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k,
                                       const bf16_t* v, const u32* segs, const u32* items, int q_heads,
                                       int kv_heads, float scale) {
    constexpr int NT = K_TILE / 8, DT = D / 8;
    __shared__ __align__(16) bf16_t ks[K_TILE * (D + PAD)];
    __shared__ __align__(16) bf16_t vs[K_TILE * (D + PAD)];
    const u32* item = items + 3 * blockIdx.x;
    const u32* seg = segs + 4 * item[0];
    u32 q_lo = item[1], q_hi = item[2];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 row0 = q_lo + warp * 16 + g, row1 = row0 + 8;

    u32 qa[D / 16][4];
    load_a_rows<D>(qa, q, row0, q_hi, q_heads, h, t);
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float sl = scale * LOG2E;

    // Range 0: the prefix (no causal mask); range 1: the segment itself up to the last query.
    for (int range = 0; range < 2; ++range) {
        u32 r_lo = range == 0 ? seg[2] : seg[0];
        u32 r_hi = range == 0 ? seg[2] + seg[3] : q_hi;
        for (u32 t_lo = r_lo; t_lo < r_hi; t_lo += K_TILE) {
            u32 t_hi = min(t_lo + K_TILE, r_hi);
            __syncthreads();
            load_tile<D>(ks, k, t_lo, t_hi, kv_heads, kvh, K_TILE);
            load_tile<D>(vs, v, t_lo, t_hi, kv_heads, kvh, K_TILE);
            __syncthreads();
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            mma_a_tileT<D, NT>(s, qa, ks, lane);
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    u32 key = t_lo + nt * 8 + t * 2 + (c & 1);
                    u32 row = c < 2 ? row0 : row1;
                    bool ok = key < t_hi && row < q_hi && (range == 0 || key <= row);
                    float val = ok ? s[nt][c] * sl : NEG_INF;
                    s[nt][c] = val;
                    if (c < 2) mx0 = fmaxf(mx0, val);
                    else mx1 = fmaxf(mx1, val);
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
    }
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    float i0 = 1.0f / l0, i1 = 1.0f / l1;
    if (row0 < q_hi) {
        u32* dst = (u32*)(out + ((i64)row0 * q_heads + h) * D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + t * 2) / 2] = pack_bf16(o[dt][0] * i0, o[dt][1] * i0);
        if (t == 0) lse[(i64)row0 * q_heads + h] = (m0 + log2f(l0)) * LN2;
    }
    if (row1 < q_hi) {
        u32* dst = (u32*)(out + ((i64)row1 * q_heads + h) * D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + t * 2) / 2] = pack_bf16(o[dt][2] * i1, o[dt][3] * i1);
        if (t == 0) lse[(i64)row1 * q_heads + h] = (m1 + log2f(l1)) * LN2;
    }
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

// dQ for 64 queries of one head: with P = exp2(S - lse), dP = dO V^T,
// dS = P (dP - delta), dQ = scale * dS K.
template <int D>
__device__ void attention_backward_dq_impl(bf16_t* dq, const bf16_t* dout, const float* lse,
                                           const float* delta, const bf16_t* q, const bf16_t* k,
                                           const bf16_t* v, const u32* segs, const u32* items, int q_heads,
                                           int kv_heads, float scale) {
    constexpr int NT = K_TILE / 8, DT = D / 8;
    __shared__ __align__(16) bf16_t ks[K_TILE * (D + PAD)];
    __shared__ __align__(16) bf16_t vs[K_TILE * (D + PAD)];
    const u32* item = items + 3 * blockIdx.x;
    const u32* seg = segs + 4 * item[0];
    u32 q_lo = item[1], q_hi = item[2];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 row0 = q_lo + warp * 16 + g, row1 = row0 + 8;

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

    for (int range = 0; range < 2; ++range) {
        u32 r_lo = range == 0 ? seg[2] : seg[0];
        u32 r_hi = range == 0 ? seg[2] + seg[3] : q_hi;
        for (u32 t_lo = r_lo; t_lo < r_hi; t_lo += K_TILE) {
            u32 t_hi = min(t_lo + K_TILE, r_hi);
            __syncthreads();
            load_tile<D>(ks, k, t_lo, t_hi, kv_heads, kvh, K_TILE);
            load_tile<D>(vs, v, t_lo, t_hi, kv_heads, kvh, K_TILE);
            __syncthreads();
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[nt][c] = dp[nt][c] = 0.0f;
            mma_a_tileT<D, NT>(s, qa, ks, lane);
            mma_a_tileT<D, NT>(dp, da, vs, lane);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    u32 key = t_lo + nt * 8 + t * 2 + (c & 1);
                    u32 row = c < 2 ? row0 : row1;
                    bool ok = key < t_hi && row < q_hi && (range == 0 || key <= row);
                    float p = ok ? exp2f(s[nt][c] * sl - (c < 2 ? lse0 : lse1)) : 0.0f;
                    s[nt][c] = p * (dp[nt][c] - (c < 2 ? dl0 : dl1));
                }
            mma_p_tile<D, K_TILE / 16>(acc, s, ks, lane);
        }
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

// dK, dV for 64 keys of one kv head (16 per warp), summed over the heads of its group and
// every query range that reads the tile: P^T = exp2(K Q^T - lse), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += scale * dS^T Q. Each (key, kv head)
// belongs to one block, so the results are written, not accumulated. K, V, Q and dO
// tiles live in dynamic shared memory (K_TILE + K_TILE + 2 * QB_TILE rows).
template <int D>
__device__ void attention_backward_dkdv_impl(bf16_t* dk, bf16_t* dv, const bf16_t* dout, const float* lse,
                                             const float* delta, const bf16_t* q, const bf16_t* k,
                                             const bf16_t* v, const u32* segs, const u32* key_tiles,
                                             const u32* tile_ranges, const u32* ranges, int q_heads,
                                             int kv_heads, float scale) {
    constexpr int NT = QB_TILE / 8, DT = D / 8, ROW = D + PAD;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* ks = (bf16_t*)smem;
    bf16_t* vs = ks + K_TILE * ROW;
    bf16_t* qs = vs + K_TILE * ROW;
    bf16_t* dos = qs + QB_TILE * ROW;
    float* lse2s = (float*)(dos + QB_TILE * ROW);
    float* deltas = lse2s + QB_TILE;
    u32 k_lo = key_tiles[2 * blockIdx.x], k_hi = key_tiles[2 * blockIdx.x + 1];
    int kvh = blockIdx.y, group = q_heads / kv_heads;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 key0 = k_lo + warp * 16 + g, key1 = key0 + 8;
    load_tile<D>(ks, k, k_lo, k_hi, kv_heads, kvh, K_TILE);
    load_tile<D>(vs, v, k_lo, k_hi, kv_heads, kvh, K_TILE);
    const bf16_t* my_k = ks + warp * 16 * ROW;
    const bf16_t* my_v = vs + warp * 16 * ROW;

    float dka[DT][4], dva[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int c = 0; c < 4; ++c) dka[dt][c] = dva[dt][c] = 0.0f;
    float sl = scale * LOG2E;

    for (int gi = 0; gi < group; ++gi) {
        int h = kvh * group + gi;
        for (u32 ri = tile_ranges[blockIdx.x]; ri < tile_ranges[blockIdx.x + 1]; ++ri) {
            const u32* seg = segs + 4 * ranges[3 * ri];
            u32 r_lo = ranges[3 * ri + 1], r_hi = ranges[3 * ri + 2];
            for (u32 t_lo = r_lo; t_lo < r_hi; t_lo += QB_TILE) {
                u32 t_hi = min(t_lo + QB_TILE, r_hi);
                __syncthreads();
                load_tile<D>(qs, q, t_lo, t_hi, q_heads, h, QB_TILE);
                load_tile<D>(dos, dout, t_lo, t_hi, q_heads, h, QB_TILE);
                if (threadIdx.x < QB_TILE) {
                    u32 qrow = t_lo + threadIdx.x;
                    bool ok = qrow < t_hi;
                    lse2s[threadIdx.x] = ok ? lse[(i64)qrow * q_heads + h] * LOG2E : 0.0f;
                    deltas[threadIdx.x] = ok ? delta[(i64)qrow * q_heads + h] : 0.0f;
                }
                __syncthreads();
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
                        float p = ok ? exp2f(s[nt][c] * sl - lse2s[qc]) : 0.0f;
                        s[nt][c] = p;
                        dp[nt][c] = p * (dp[nt][c] - deltas[qc]);
                    }
                mma_p_tile<D, QB_TILE / 16>(dva, s, dos, lane);
                mma_p_tile<D, QB_TILE / 16>(dka, dp, qs, lane);
            }
        }
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

// Paged attention: one warp per (query token, q head); lane owns dims lane + 32*j.
// Keys are read through the block table; one pass with online softmax.
template <int D>
__device__ void paged_attention_impl(bf16_t* out, const bf16_t* q, const bf16_t* k_cache,
                                     const bf16_t* v_cache, const u32* block_tables, const u32* token_seq,
                                     const u32* token_pos, int max_blocks, int block_size, int q_heads,
                                     int kv_heads, float scale) {
    constexpr int DL = D / 32;
    int lane = threadIdx.x & 31;
    int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= q_heads) return;
    int t = blockIdx.x, kvh = h / (q_heads / kv_heads);
    u32 seq = token_seq[t], pos = token_pos[t];
    i64 row = (i64)t * q_heads + h;
    float qr[DL], acc[DL];
#pragma unroll
    for (int j = 0; j < DL; ++j) {
        qr[j] = bf2f(q[row * D + lane + 32 * j]) * scale * LOG2E;
        acc[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (u32 p = 0; p <= pos; ++p) {
        i64 slot = (i64)block_tables[(i64)seq * max_blocks + p / block_size] * block_size + p % block_size;
        i64 base = (slot * kv_heads + kvh) * D;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < DL; ++j) s = fmaf(qr[j], bf2f(k_cache[base + lane + 32 * j]), s);
        s = warp_sum(s);
        float m_new = fmaxf(m, s);
        float corr = exp2f(m - m_new), e = exp2f(s - m_new);
        l = l * corr + e;
#pragma unroll
        for (int j = 0; j < DL; ++j) acc[j] = fmaf(e, bf2f(v_cache[base + lane + 32 * j]), acc[j] * corr);
        m = m_new;
    }
    float inv_l = 1.0f / l;
#pragma unroll
    for (int j = 0; j < DL; ++j) out[row * D + lane + 32 * j] = f2bf(acc[j] * inv_l);
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
    extern "C" __global__ void paged_attention_d##D(                                                        \
        bf16_t* out, const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, const u32* block_tables, \
        const u32* token_seq, const u32* token_pos, int max_blocks, int block_size, int q_heads,            \
        int kv_heads, float scale) {                                                                        \
        paged_attention_impl<D>(out, q, k_cache, v_cache, block_tables, token_seq, token_pos, max_blocks,  \
                                block_size, q_heads, kv_heads, scale);                                      \
    }

ATTENTION_INSTANCES(64)
ATTENTION_INSTANCES(128)
