// RMSNorm forward/backward and rotary position embedding.

// One warp per row: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) saved for the
// backward. A warp per row suits both the hidden-size norms (dim 1024-4096) and the
// per-head q/k norms (dim 128, rows = tokens x heads) without a second variant.
extern "C" __global__ void rmsnorm_forward(void* out, int odt, void* rstd, int rdt, const void* x, int xdt,
                                           const void* w, int wdt, int rows, int dim, float eps) {
    int lane = threadIdx.x & 31;
    int warps = blockDim.x >> 5;
    if (odt == DT_BF16 && xdt == DT_BF16 && wdt == DT_BF16 && dim % 8 == 0 && aligned16(out) && aligned16(x) &&
        aligned16(w)) {
        const bf16_t *xb = (const bf16_t*)x, *wb = (const bf16_t*)w;
        for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
            i64 base = (i64)r * dim;
            float ss = 0.0f;
            for (int c = lane * 8; c < dim; c += 256) {
                float v[8];
                ld_bf16x8(v, xb + base + c);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss = fmaf(v[e], v[e], ss);
            }
            ss = warp_sum(ss);
            float rs = rsqrtf(ss / (float)dim + eps);
            if (lane == 0) stf(rstd, rdt, r, rs);
            for (int c = lane * 8; c < dim; c += 256) {
                float v[8], wv[8];
                ld_bf16x8(v, xb + base + c);
                ld_bf16x8(wv, wb + c);
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = v[e] * rs * wv[e];
                st_bf16x8((bf16_t*)out + base + c, v);
            }
        }
        return;
    }
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
        i64 base = (i64)r * dim;
        float ss = 0.0f;
        for (int c = lane; c < dim; c += 32) {
            float v = ldf(x, xdt, base + c);
            ss = fmaf(v, v, ss);
        }
        ss = warp_sum(ss);
        float rs = rsqrtf(ss / (float)dim + eps);
        if (lane == 0) stf(rstd, rdt, r, rs);
        for (int c = lane; c < dim; c += 32)
            stf(out, odt, base + c, ldf(x, xdt, base + c) * rs * ldf(w, wdt, c));
    }
}

// dx = rstd * (w * dout) - x * rstd^3 * mean(w * dout * x), one warp per row. The weight
// gradient is a column reduction done by `column_sum` (elementwise module).
extern "C" __global__ void rmsnorm_backward_dx(void* dx, int dxdt, const void* dout, int ddt, const void* x,
                                               int xdt, const void* w, int wdt, const void* rstd, int rdt,
                                               int rows, int dim) {
    int lane = threadIdx.x & 31;
    int warps = blockDim.x >> 5;
    if (dxdt == DT_BF16 && ddt == DT_BF16 && xdt == DT_BF16 && wdt == DT_BF16 && dim % 8 == 0 && aligned16(dx) &&
        aligned16(dout) && aligned16(x) && aligned16(w)) {
        const bf16_t *db = (const bf16_t*)dout, *xb = (const bf16_t*)x, *wb = (const bf16_t*)w;
        for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
            i64 base = (i64)r * dim;
            float dot = 0.0f;
            for (int c = lane * 8; c < dim; c += 256) {
                float d[8], xv[8], wv[8];
                ld_bf16x8(d, db + base + c);
                ld_bf16x8(xv, xb + base + c);
                ld_bf16x8(wv, wb + c);
#pragma unroll
                for (int e = 0; e < 8; ++e) dot += d[e] * wv[e] * xv[e];
            }
            dot = warp_sum(dot);
            float rs = ldf(rstd, rdt, r);
            float k = rs * rs * rs * dot / (float)dim;
            for (int c = lane * 8; c < dim; c += 256) {
                float d[8], xv[8], wv[8], o[8];
                ld_bf16x8(d, db + base + c);
                ld_bf16x8(xv, xb + base + c);
                ld_bf16x8(wv, wb + c);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = rs * d[e] * wv[e] - k * xv[e];
                st_bf16x8((bf16_t*)dx + base + c, o);
            }
        }
        return;
    }
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
        i64 base = (i64)r * dim;
        float dot = 0.0f;
        for (int c = lane; c < dim; c += 32)
            dot += ldf(dout, ddt, base + c) * ldf(w, wdt, c) * ldf(x, xdt, base + c);
        dot = warp_sum(dot);
        float rs = ldf(rstd, rdt, r);
        float k = rs * rs * rs * dot / (float)dim;
        for (int c = lane; c < dim; c += 32)
            stf(dx, dxdt, base + c,
                rs * ldf(dout, ddt, base + c) * ldf(w, wdt, c) - k * ldf(x, xdt, base + c));
    }
}

// In-place rotate-half RoPE on x: [tokens, heads, head_dim]; pairs (i, i + head_dim/2)
// rotate by positions[t] * inv_freq[i] (negated when `inverse`, the backward).
extern "C" __global__ void rope(void* x, int xdt, const u32* positions, const float* inv_freq, int tokens,
                                int heads, int head_dim, int inverse) {
    int half = head_dim / 2;
    i64 total = (i64)tokens * heads * half;
    if (xdt == DT_BF16 && half % 8 == 0 && aligned16(x)) {
        // Eight consecutive pairs per thread: 16-byte loads of both halves.
        bf16_t* xb = (bf16_t*)x;
        for (i64 idx = (blockIdx.x * (i64)blockDim.x + threadIdx.x) * 8; idx < total;
             idx += (i64)gridDim.x * blockDim.x * 8) {
            int i0 = (int)(idx % half);
            i64 th = idx / half;
            float pos = (float)positions[th / heads];
            i64 base = th * head_dim + i0;
            float x1[8], x2[8], y1[8], y2[8];
            ld_bf16x8(x1, xb + base);
            ld_bf16x8(x2, xb + base + half);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float s, c;
                sincosf(pos * inv_freq[i0 + e], &s, &c);
                if (inverse) s = -s;
                y1[e] = x1[e] * c - x2[e] * s;
                y2[e] = x2[e] * c + x1[e] * s;
            }
            st_bf16x8(xb + base, y1);
            st_bf16x8(xb + base + half, y2);
        }
        return;
    }
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        int i = (int)(idx % half);
        i64 th = idx / half;  // token * heads + head
        int t = (int)(th / heads);
        float angle = (float)positions[t] * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);
        if (inverse) s = -s;
        i64 base = th * head_dim;
        float x1 = ldf(x, xdt, base + i), x2 = ldf(x, xdt, base + i + half);
        stf(x, xdt, base + i, x1 * c - x2 * s);
        stf(x, xdt, base + i + half, x2 * c + x1 * s);
    }
}

// Qwen3's per-head RMSNorm then RoPE, for q and k in one launch: one warp per (token,
// head) row, q's rows first. The normalized value stays in f32 until the rotation, so
// the output is rounded once instead of twice (the unfused ops store it in between).
extern "C" __global__ void qk_norm_rope(void* q, int qdt, float* q_rstd, const void* q_raw, int qrdt,
                                        const void* q_w, int qwdt, int q_heads, void* k, int kdt, float* k_rstd,
                                        const void* k_raw, int krdt, const void* k_w, int kwdt, int k_heads,
                                        const u32* positions, const float* inv_freq, int tokens, int head_dim,
                                        float eps) {
    int lane = threadIdx.x & 31;
    int warps = blockDim.x >> 5;
    int half = head_dim / 2;
    i64 q_rows = (i64)tokens * q_heads, rows = q_rows + (i64)tokens * k_heads;
    for (i64 r = blockIdx.x * (i64)warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        bool is_q = r < q_rows;
        i64 row = is_q ? r : r - q_rows;
        void* out = is_q ? q : k;
        const void *raw = is_q ? q_raw : k_raw, *w = is_q ? q_w : k_w;
        int odt = is_q ? qdt : kdt, rdt = is_q ? qrdt : krdt, wdt = is_q ? qwdt : kwdt;
        float pos = (float)positions[row / (is_q ? q_heads : k_heads)];
        i64 base = row * head_dim;
        float ss = 0.0f;
        for (int i = lane; i < head_dim; i += 32) {
            float v = ldf(raw, rdt, base + i);
            ss = fmaf(v, v, ss);
        }
        ss = warp_sum(ss);
        float rs = rsqrtf(ss / (float)head_dim + eps);
        if (lane == 0) (is_q ? q_rstd : k_rstd)[row] = rs;
        for (int i = lane; i < half; i += 32) {
            float x1 = ldf(raw, rdt, base + i) * rs * ldf(w, wdt, i);
            float x2 = ldf(raw, rdt, base + i + half) * rs * ldf(w, wdt, i + half);
            float s, c;
            sincosf(pos * inv_freq[i], &s, &c);
            stf(out, odt, base + i, x1 * c - x2 * s);
            stf(out, odt, base + i + half, x2 * c + x1 * s);
        }
    }
}
