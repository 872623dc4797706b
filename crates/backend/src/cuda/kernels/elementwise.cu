// Elementwise ops, small reductions, gathers, SwiGLU and AdamW.
// All loops are grid-stride so the host picks the grid from the device, not the size.

extern "C" __global__ void add_assign(void* y, int ydt, const void* x, int xdt, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        stf(y, ydt, i, ldf(y, ydt, i) + ldf(x, xdt, i));
}

extern "C" __global__ void scale(void* y, int dt, float alpha, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        stf(y, dt, i, ldf(y, dt, i) * alpha);
}

// dst = src with storage conversion (bf16 <-> f32).
extern "C" __global__ void convert(void* dst, int ddt, const void* src, int sdt, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        stf(dst, ddt, i, ldf(src, sdt, i));
}

// partial[block] = sum(x^2) over the block's grid-stride share (f32 per thread and per
// block); the host adds the partials in block order in f64, so the total is the same on
// every run and large tensors (hundreds of millions of elements) keep their precision.
extern "C" __global__ void sum_squares(const void* x, int dt, i64 n, double* partial) {
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = ldf(x, dt, i);
        acc = fmaf(v, v, acc);
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = (double)acc;
}

// out[r, :] = x[rows[r], :]. Also the embedding forward. One block row-chunk per y.
extern "C" __global__ void gather_rows(void* out, int odt, const void* x, int xdt, const u32* rows,
                                       int nrows, int dim) {
    for (int r = blockIdx.y; r < nrows; r += gridDim.y) {
        i64 src = (i64)rows[r] * dim, dst = (i64)r * dim;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < dim; c += gridDim.x * blockDim.x)
            stf(out, odt, dst + c, ldf(x, xdt, src + c));
    }
}

// y[r, c] += bias[c].
extern "C" __global__ void add_bias(void* y, int ydt, const void* bias, int bdt, int rows, int cols) {
    for (int r = blockIdx.y; r < rows; r += gridDim.y)
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
            i64 i = (i64)r * cols + c;
            stf(y, ydt, i, ldf(y, ydt, i) + ldf(bias, bdt, c));
        }
}

// partial[chunk, c] = sum over the chunk's rows r of src[r, c] * (row_scale ? row_scale[r] : 1)
// * (other ? other[r, c] : 1); one block per chunk of rows and strip of columns. Serves
// add_bias_backward (dbias) and RMSNorm's dw (src = dout, other = x, row_scale = rstd).
extern "C" __global__ void column_sum(float* partial, const void* src, int sdt, const void* other,
                                      int odt, const void* row_scale, int rdt, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    int chunk = (rows + gridDim.y - 1) / gridDim.y;
    int r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    float acc = 0.0f;
    for (int r = r0; r < r1; ++r) {
        i64 i = (i64)r * cols + c;
        float v = ldf(src, sdt, i);
        if (other) v *= ldf(other, odt, i);
        if (row_scale) v *= ldf(row_scale, rdt, r);
        acc += v;
    }
    partial[(i64)blockIdx.y * cols + c] = acc;
}

// dst[c] += the chunks' partial sums in chunk order: deterministic, unlike one atomic per
// chunk, whose order (and so rounding) changes from run to run.
extern "C" __global__ void column_sum_finish(float* dst, const float* partial, int chunks, int cols) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < chunks; ++k) acc += partial[(i64)k * cols + c];
        dst[c] += acc;
    }
}

// dtable[ids[u], :] += dout[t, :] for the tokens t = order[starts[u]..starts[u + 1]] (in
// ascending t) of each distinct id u: one block row per id, so repeated ids need no atomics
// and the sums come out the same on every run, in the CPU reference's order.
extern "C" __global__ void embedding_backward(float* dtable, const void* dout, int ddt, const u32* ids,
                                              const u32* starts, const u32* order, int nids, int dim) {
    for (int u = blockIdx.y; u < nids; u += gridDim.y) {
        i64 dst = (i64)ids[u] * dim;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < dim; c += gridDim.x * blockDim.x) {
            float acc = dtable[dst + c];
            for (u32 j = starts[u]; j < starts[u + 1]; ++j) acc += ldf(dout, ddt, (i64)order[j] * dim + c);
            dtable[dst + c] = acc;
        }
    }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// out = silu(gate) * up.
extern "C" __global__ void swiglu_forward(void* out, int odt, const void* gate, int gdt, const void* up,
                                          int udt, i64 n) {
    if (odt == DT_BF16 && gdt == DT_BF16 && udt == DT_BF16 && n % 8 == 0 && aligned16(out) &&
        aligned16(gate) && aligned16(up)) {
        for (i64 i = (blockIdx.x * (i64)blockDim.x + threadIdx.x) * 8; i < n; i += (i64)gridDim.x * blockDim.x * 8) {
            float g[8], u[8], o[8];
            ld_bf16x8(g, (const bf16_t*)gate + i);
            ld_bf16x8(u, (const bf16_t*)up + i);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = g[e] * sigmoid(g[e]) * u[e];
            st_bf16x8((bf16_t*)out + i, o);
        }
        return;
    }
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = ldf(gate, gdt, i);
        stf(out, odt, i, g * sigmoid(g) * ldf(up, udt, i));
    }
}

// d up = dout * silu(g); d gate = dout * up * sig(g) * (1 + g * (1 - sig(g))).
extern "C" __global__ void swiglu_backward(void* dgate, int dgdt, void* dup, int dudt, const void* dout,
                                           int ddt, const void* gate, int gdt, const void* up, int udt,
                                           i64 n) {
    if (dgdt == DT_BF16 && dudt == DT_BF16 && ddt == DT_BF16 && gdt == DT_BF16 && udt == DT_BF16 && n % 8 == 0 &&
        aligned16(dgate) && aligned16(dup) && aligned16(dout) && aligned16(gate) && aligned16(up)) {
        for (i64 i = (blockIdx.x * (i64)blockDim.x + threadIdx.x) * 8; i < n; i += (i64)gridDim.x * blockDim.x * 8) {
            float g[8], u[8], d[8], dg[8], du[8];
            ld_bf16x8(g, (const bf16_t*)gate + i);
            ld_bf16x8(u, (const bf16_t*)up + i);
            ld_bf16x8(d, (const bf16_t*)dout + i);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float s = sigmoid(g[e]);
                du[e] = d[e] * g[e] * s;
                dg[e] = d[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
            }
            st_bf16x8((bf16_t*)dup + i, du);
            st_bf16x8((bf16_t*)dgate + i, dg);
        }
        return;
    }
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = ldf(gate, gdt, i), u = ldf(up, udt, i), d = ldf(dout, ddt, i);
        float s = sigmoid(g);
        stf(dup, dudt, i, d * g * s);
        stf(dgate, dgdt, i, d * u * s * (1.0f + g * (1.0f - s)));
    }
}

// One AdamW step on f32 master weights and moments; `compute` (may be null) receives the
// new weights in its own storage type, so no separate cast pass is needed.
// bias1 = 1 - beta1^step, bias2 = 1 - beta2^step (computed in f64 on the host).
// splitmix64's finaliser, as `floe_backend::sampling::mix64`.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// out[i] = std * normal(seed, first + i), the formula of `floe_backend::sampling::normal`
// step for step in f64; std arrives as the bits of a double.
extern "C" __global__ void fill_normal(void* out, int odt, i64 seed, i64 first, i64 std_bits, i64 n) {
    const unsigned long long gamma = 0x9E3779B97F4A7C15ull;
    const double sd = __longlong_as_double(std_bits);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned long long s = (unsigned long long)seed + ((unsigned long long)(first + i) * 2ull) * gamma;
        double u = (double)((mix64(s + gamma) >> 11) + 1ull) / 9007199254740992.0;
        double v = (double)((mix64(s + 2ull * gamma) >> 11) + 1ull) / 9007199254740992.0;
        double z = sqrt(-2.0 * log(u)) * cos(2.0 * 3.141592653589793 * v);
        stf(out, odt, i, (float)(sd * z));
    }
}

extern "C" __global__ void adamw(float* param, const void* grad, int gdt, float* m, float* v, void* compute,
                                 int cdt, float lr, float beta1, float beta2, float eps, float weight_decay,
                                 float grad_scale, float bias1, float bias2, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = ldf(grad, gdt, i) * grad_scale;
        float p = param[i];
        p -= lr * weight_decay * p;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        p -= lr * (mi / bias1) / (sqrtf(vi / bias2) + eps);
        param[i] = p;
        if (compute) stf(compute, cdt, i, p);
    }
}
