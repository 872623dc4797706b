// Causal grouped-query attention over packed segments (forward, backward) and paged
// attention over the KV cache.
//
// Version 1 (this file): flash-style tiling with online softmax on the CUDA cores, fp32
// math, bf16 storage. A block owns 32 query rows of one head (or, in dK/dV, 32 key rows of
// one kv head); each row is split over 4 consecutive threads that own the interleaved
// dims `sub + 4*j`, so the 4 threads of a row read 4 consecutive floats of a shared-memory
// tile (no bank conflicts) and 8 rows of a warp share each address (broadcast).
// Logits are kept in base 2 (scaled by log2(e)) so exp2f does the softmax.
//
// Work lists come from the host (cuda/attention.rs):
//   segs  [n_seg * 4]: start, len, prefix_start, prefix_len (the `Segment` struct)
//   items [n_item * 3]: seg, q_lo, q_hi, a tile of at most 32 queries inside one segment
//   key tiles [n_tile * 2]: k_lo, k_hi (at most 32 keys), with a CSR list of the query
//   ranges that read them: tile_ranges[n_tile + 1] offsets into ranges [n_range * 3]:
//   seg, q_lo, q_hi.
// Query q of segment s may read key k iff k is in s's prefix, or s.start <= k <= q.

#define ROWS 32
#define TPR 4
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ bool attn_allowed(u32 q, u32 k, const u32* seg) {
    return (k >= seg[2] && k < seg[2] + seg[3]) || (k >= seg[0] && k <= q);
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// Loads rows [lo, hi) (at most ROWS) of head `head` of a [T, heads, D] bf16 tensor into
// a [ROWS][D] f32 tile; rows past `hi` are zero so masked products stay finite.
template <int D>
__device__ __forceinline__ void load_tile(float (*tile)[D], const bf16_t* src, u32 lo, u32 hi, int heads,
                                          int head) {
    for (int e = threadIdx.x; e < ROWS * D; e += blockDim.x) {
        int r = e / D, c = e % D;
        u32 row = lo + r;
        tile[r][c] = row < hi ? bf2f(src[((i64)row * heads + head) * D + c]) : 0.0f;
    }
}

template <int D>
__device__ void attention_forward_impl(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k,
                                       const bf16_t* v, const u32* segs, const u32* items, int q_heads,
                                       int kv_heads, float scale) {
    constexpr int DS = D / TPR;
    __shared__ float ks[ROWS][D];
    __shared__ float vs[ROWS][D];
    const u32* item = items + 3 * blockIdx.x;
    const u32* seg = segs + 4 * item[0];
    u32 q_lo = item[1], q_hi = item[2];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    int sub = threadIdx.x % TPR;
    u32 qi = q_lo + threadIdx.x / TPR;
    bool active = qi < q_hi;

    float qr[DS], acc[DS];
    float qscale = scale * LOG2E;
#pragma unroll
    for (int j = 0; j < DS; ++j) {
        qr[j] = active ? bf2f(q[((i64)qi * q_heads + h) * D + sub + TPR * j]) * qscale : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    // Range 0: the prefix (no causal mask); range 1: the segment itself up to the last query.
    for (int range = 0; range < 2; ++range) {
        u32 r_lo = range == 0 ? seg[2] : seg[0];
        u32 r_hi = range == 0 ? seg[2] + seg[3] : q_hi;
        for (u32 t_lo = r_lo; t_lo < r_hi; t_lo += ROWS) {
            u32 t_hi = min(t_lo + ROWS, r_hi);
            __syncthreads();
            load_tile<D>(ks, k, t_lo, t_hi, kv_heads, kvh);
            load_tile<D>(vs, v, t_lo, t_hi, kv_heads, kvh);
            __syncthreads();
            float s[ROWS];
            float m_tile = NEG_INF;
#pragma unroll
            for (int kk = 0; kk < ROWS; ++kk) {
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < DS; ++j) dot = fmaf(qr[j], ks[kk][sub + TPR * j], dot);
                dot = quad_sum(dot);
                u32 key = t_lo + kk;
                bool ok = active && key < t_hi && (range == 0 || key <= qi);
                s[kk] = ok ? dot : NEG_INF;
                m_tile = fmaxf(m_tile, s[kk]);
            }
            float m_new = fmaxf(m, m_tile);
            if (m_new == NEG_INF) continue;
            float corr = exp2f(m - m_new);
            l *= corr;
#pragma unroll
            for (int j = 0; j < DS; ++j) acc[j] *= corr;
#pragma unroll
            for (int kk = 0; kk < ROWS; ++kk) {
                float p = exp2f(s[kk] - m_new);
                l += p;
#pragma unroll
                for (int j = 0; j < DS; ++j) acc[j] = fmaf(p, vs[kk][sub + TPR * j], acc[j]);
            }
            m = m_new;
        }
    }
    if (!active) return;
    float inv_l = 1.0f / l;
#pragma unroll
    for (int j = 0; j < DS; ++j) out[((i64)qi * q_heads + h) * D + sub + TPR * j] = f2bf(acc[j] * inv_l);
    if (sub == 0) lse[(i64)qi * q_heads + h] = (m + log2f(l)) * LN2;
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

// dq for one tile of 32 queries of one head: dq = scale * sum_k p (dp - delta) k.
template <int D>
__device__ void attention_backward_dq_impl(bf16_t* dq, const bf16_t* dout, const float* lse,
                                           const float* delta, const bf16_t* q, const bf16_t* k,
                                           const bf16_t* v, const u32* segs, const u32* items, int q_heads,
                                           int kv_heads, float scale) {
    constexpr int DS = D / TPR;
    __shared__ float ks[ROWS][D];
    __shared__ float vs[ROWS][D];
    const u32* item = items + 3 * blockIdx.x;
    const u32* seg = segs + 4 * item[0];
    u32 q_lo = item[1], q_hi = item[2];
    int h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    int sub = threadIdx.x % TPR;
    u32 qi = q_lo + threadIdx.x / TPR;
    bool active = qi < q_hi;
    i64 row = (i64)qi * q_heads + h;

    float qr[DS], dor[DS], acc[DS];
    float qscale = scale * LOG2E;
#pragma unroll
    for (int j = 0; j < DS; ++j) {
        qr[j] = active ? bf2f(q[row * D + sub + TPR * j]) * qscale : 0.0f;
        dor[j] = active ? bf2f(dout[row * D + sub + TPR * j]) : 0.0f;
        acc[j] = 0.0f;
    }
    float lse2 = active ? lse[row] * LOG2E : 0.0f;
    float dl = active ? delta[row] : 0.0f;

    for (int range = 0; range < 2; ++range) {
        u32 r_lo = range == 0 ? seg[2] : seg[0];
        u32 r_hi = range == 0 ? seg[2] + seg[3] : q_hi;
        for (u32 t_lo = r_lo; t_lo < r_hi; t_lo += ROWS) {
            u32 t_hi = min(t_lo + ROWS, r_hi);
            __syncthreads();
            load_tile<D>(ks, k, t_lo, t_hi, kv_heads, kvh);
            load_tile<D>(vs, v, t_lo, t_hi, kv_heads, kvh);
            __syncthreads();
#pragma unroll 4
            for (int kk = 0; kk < ROWS; ++kk) {
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int j = 0; j < DS; ++j) {
                    s = fmaf(qr[j], ks[kk][sub + TPR * j], s);
                    dp = fmaf(dor[j], vs[kk][sub + TPR * j], dp);
                }
                s = quad_sum(s);
                dp = quad_sum(dp);
                u32 key = t_lo + kk;
                bool ok = active && key < t_hi && (range == 0 || key <= qi);
                float p = ok ? exp2f(s - lse2) : 0.0f;
                float ds = p * (dp - dl);
#pragma unroll
                for (int j = 0; j < DS; ++j) acc[j] = fmaf(ds, ks[kk][sub + TPR * j], acc[j]);
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int j = 0; j < DS; ++j) dq[row * D + sub + TPR * j] = f2bf(acc[j] * scale);
}

// dk, dv for one tile of at most 32 keys of one kv head, summed over the heads of its
// group and over every query range that reads the tile (causal rows of its own segment,
// every row of segments that use it as a prefix). Each (key, kv head) belongs to one
// block, so the results are written, not accumulated.
template <int D>
__device__ void attention_backward_dkdv_impl(bf16_t* dk, bf16_t* dv, const bf16_t* dout, const float* lse,
                                             const float* delta, const bf16_t* q, const bf16_t* k,
                                             const bf16_t* v, const u32* segs, const u32* key_tiles,
                                             const u32* tile_ranges, const u32* ranges, int q_heads,
                                             int kv_heads, float scale) {
    constexpr int DS = D / TPR;
    __shared__ float qs[ROWS][D];
    __shared__ float dos[ROWS][D];
    __shared__ float lse2s[ROWS];
    __shared__ float deltas[ROWS];
    u32 k_lo = key_tiles[2 * blockIdx.x], k_hi = key_tiles[2 * blockIdx.x + 1];
    int kvh = blockIdx.y, group = q_heads / kv_heads;
    int sub = threadIdx.x % TPR;
    u32 ki = k_lo + threadIdx.x / TPR;
    bool active = ki < k_hi;
    i64 krow = (i64)ki * kv_heads + kvh;

    float kr[DS], vr[DS], dka[DS], dva[DS];
    float kscale = scale * LOG2E;
#pragma unroll
    for (int j = 0; j < DS; ++j) {
        kr[j] = active ? bf2f(k[krow * D + sub + TPR * j]) * kscale : 0.0f;
        vr[j] = active ? bf2f(v[krow * D + sub + TPR * j]) : 0.0f;
        dka[j] = 0.0f;
        dva[j] = 0.0f;
    }
    for (int g = 0; g < group; ++g) {
        int h = kvh * group + g;
        for (u32 ri = tile_ranges[blockIdx.x]; ri < tile_ranges[blockIdx.x + 1]; ++ri) {
            const u32* seg = segs + 4 * ranges[3 * ri];
            u32 r_lo = ranges[3 * ri + 1], r_hi = ranges[3 * ri + 2];
            for (u32 t_lo = r_lo; t_lo < r_hi; t_lo += ROWS) {
                u32 t_hi = min(t_lo + ROWS, r_hi);
                __syncthreads();
                load_tile<D>(qs, q, t_lo, t_hi, q_heads, h);
                load_tile<D>(dos, dout, t_lo, t_hi, q_heads, h);
                if (threadIdx.x < ROWS) {
                    u32 qrow = t_lo + threadIdx.x;
                    bool ok = qrow < t_hi;
                    lse2s[threadIdx.x] = ok ? lse[(i64)qrow * q_heads + h] * LOG2E : 0.0f;
                    deltas[threadIdx.x] = ok ? delta[(i64)qrow * q_heads + h] : 0.0f;
                }
                __syncthreads();
#pragma unroll 4
                for (int qq = 0; qq < ROWS; ++qq) {
                    float s = 0.0f, dp = 0.0f;
#pragma unroll
                    for (int j = 0; j < DS; ++j) {
                        s = fmaf(kr[j], qs[qq][sub + TPR * j], s);
                        dp = fmaf(vr[j], dos[qq][sub + TPR * j], dp);
                    }
                    s = quad_sum(s);
                    dp = quad_sum(dp);
                    u32 qrow = t_lo + qq;
                    bool ok = active && qrow < t_hi && attn_allowed(qrow, ki, seg);
                    float p = ok ? exp2f(s - lse2s[qq]) : 0.0f;
                    float ds = p * (dp - deltas[qq]);
#pragma unroll
                    for (int j = 0; j < DS; ++j) {
                        dva[j] = fmaf(p, dos[qq][sub + TPR * j], dva[j]);
                        dka[j] = fmaf(ds, qs[qq][sub + TPR * j], dka[j]);
                    }
                }
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int j = 0; j < DS; ++j) {
        dk[krow * D + sub + TPR * j] = f2bf(dka[j] * scale);
        dv[krow * D + sub + TPR * j] = f2bf(dva[j]);
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
