// Row kernels of the chunked lm-head. The host computes one chunk of logits at a time with
// cuBLAS (f32 output, logit_scale folded into alpha); these kernels turn each row into
// log-prob, entropy and log-sum-exp (forward) or into d logits (backward). One block per
// row; the vocabulary (~152k) is read once per pass from L2/HBM.

// Forward: per thread an online (max m, s = sum e^(z-m), sd = sum e^(z-m) (z-m)); merged
// over the block. Entropy = log S - SD / S is a sum of two non-negative terms, so low
// entropies keep their relative precision (lse - sum p z would cancel).
extern "C" __global__ void lm_head_forward_rows(void* logprobs, int lpdt, void* entropy, int edt, void* lse,
                                                int ldt, const float* logits, const u32* targets, int vocab,
                                                int row0) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    const float* z = logits + (i64)r * vocab;
    float m = NEG_INF, s = 0.0f, sd = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float x = z[i];
        if (x == NEG_INF) continue;
        if (x > m) {
            float f = __expf(m - x);  // 0 when m = -inf
            sd = (m == NEG_INF) ? 0.0f : (sd + s * (m - x)) * f;
            s = s * f + 1.0f;
            m = x;
        } else {
            float e = __expf(x - m);
            s += e;
            sd += e * (x - m);
        }
    }
    float big = block_max(m, scratch);
    float f = (m == NEG_INF) ? 0.0f : __expf(m - big);
    float s_all = block_sum(s * f, scratch);
    float sd_all = block_sum((m == NEG_INF) ? 0.0f : (sd + s * (m - big)) * f, scratch);
    if (threadIdx.x == 0) {
        int row = row0 + r;
        float l = big + logf(s_all);
        u32 t = targets[row];
        float lp = t < (u32)vocab ? z[t] - l : __int_as_float(0x7fc00000);
        stf(logprobs, lpdt, row, lp);
        stf(entropy, edt, row, logf(s_all) - sd_all / s_all);
        stf(lse, ldt, row, l);
    }
}

// Backward: with p = e^(z - lse) and H = -sum p (z - lse),
//   d z_k = dlogprob (1[k = target] - p_k) - dentropy p_k ((z_k - lse) + H),
// written as bf16 d(raw logits) = logit_scale * d z for the two cuBLAS products that follow.
extern "C" __global__ void lm_head_backward_rows(bf16_t* dlogits, const float* logits, const void* lse, int ldt,
                                                 const void* dlogprobs, int dlpdt, const void* dentropy,
                                                 int dedt, const u32* targets, int vocab, int row0,
                                                 float logit_scale) {
    __shared__ float scratch[32];
    int r = blockIdx.x, row = row0 + r;
    const float* z = logits + (i64)r * vocab;
    bf16_t* dz = dlogits + (i64)r * vocab;
    float l = ldf(lse, ldt, row);
    float dlp = ldf(dlogprobs, dlpdt, row), dent = ldf(dentropy, dedt, row);
    u32 t = targets[row];
    float neg_h = 0.0f;
    if (dent != 0.0f) {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float c = z[i] - l;
            neg_h += __expf(c) * c;
        }
        neg_h = block_sum(neg_h, scratch);
    }
    float h = -neg_h;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float c = z[i] - l;
        float p = __expf(c);
        float g = dlp * (((u32)i == t ? 1.0f : 0.0f) - p) - dent * p * (c + h);
        dz[i] = f2bf(g * logit_scale);
    }
}
