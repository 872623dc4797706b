// RMSNorm forward/backward and rotary position embedding.

// One warp per row: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) saved for the
// backward. A warp per row suits both the hidden-size norms (dim 1024-4096) and the
// per-head q/k norms (dim 128, rows = tokens x heads) without a second variant.
extern "C" __global__ void rmsnorm_forward(void* out, int odt, void* rstd, int rdt, const void* x, int xdt,
                                           const void* w, int wdt, int rows, int dim, float eps) {
    int lane = threadIdx.x & 31;
    int warps = blockDim.x >> 5;
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
