// Sampling one token per row, reproducing `sampling::sample_row` (see its module docs for
// the procedure) in f64 like the CPU. One block of SAMPLE_THREADS per row.
//
// Order statistics use radix selection instead of a sort: every float logit maps to a
// 32-bit key whose unsigned order is the float order, so
// - top-k's k-th largest value is a count-weighted select over that key (4 passes), and
// - top-p's cut is a mass-weighted select over the 64-bit key (descending value, then id)
//   that orders tokens exactly as the CPU's sort does (8 passes).
// The draw walks the kept tokens in id order: each thread owns a contiguous chunk of ids,
// a block scan of the chunk masses finds the chunk where the running sum crosses u * total.

#define SAMPLE_THREADS 1024
#define BINS 256

__device__ __forceinline__ u32 ordered_key(float x) {
    u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Row {
    const void* logits;
    int dt;
    i64 base;
    double inv_t;
    __device__ float x(int i) const {
        float v = ldf(logits, dt, base + i);
        return v != v ? NEG_INF : v;  // NaN never chosen, no mass
    }
};

// Splits the block's threads' (double) values into a block-wide sum.
__device__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(u32* tokens, float* logprobs, const void* logits, int dt, int vocab, const float* temperature,
            const int* top_k, const float* top_p, const float* min_p, const double* uniforms) {
    __shared__ double dscratch[32];
    __shared__ float fscratch[32];
    __shared__ int iscratch[32];
    __shared__ double mass_hist[BINS];
    __shared__ u32 count_hist[BINS];
    __shared__ unsigned long long sel_prefix;
    __shared__ double sel_before;
    __shared__ u32 sel_rank;
    __shared__ double warp_mass[32];
    __shared__ int warp_last[32];

    int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float temp = temperature[r];
    bool greedy = temp <= 0.0f;
    Row row{logits, dt, (i64)r * vocab, greedy ? 1.0 : 1.0 / (double)temp};

    // 1. max (lowest id among maxima) and log-sum-exp of z = x / T, in f64.
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = tid; i < vocab; i += blockDim.x) {
        float v = row.x(i);
        if (v > best) { best = v; best_i = i; }
    }
    float bmax = block_max(best, fscratch);
    int cand = best == bmax ? best_i : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
    __syncthreads();
    if (lane == 0) iscratch[warp] = cand;
    __syncthreads();
    cand = lane < (int)(blockDim.x >> 5) ? iscratch[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
    int argmax = cand == 0x7fffffff ? 0 : cand;
    if (bmax == NEG_INF) {
        if (tid == 0) { tokens[r] = 0; logprobs[r] = NEG_INF; }
        return;
    }
    // Each warp sums exp(z - zmax) over its own contiguous chunk of ids (lanes stride
    // within it, so loads stay coalesced): the total gives the log-sum-exp, and the chunk
    // masses are where plain temperature sampling's draw lands.
    double zmax = (double)bmax * row.inv_t;
    int warps = blockDim.x >> 5;
    int wchunk = (vocab + warps - 1) / warps;
    int wlo = min(vocab, warp * wchunk), whi = min(vocab, wlo + wchunk);
    double se = 0.0;
    int w_last = -1;  // the warp's last id with mass
    for (int i = wlo + lane; i < whi; i += 32) {
        double e = exp((double)row.x(i) * row.inv_t - zmax);
        se += e;
        if (e > 0.0) w_last = i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        se += __shfl_xor_sync(0xffffffffu, se, o);
        w_last = max(w_last, __shfl_xor_sync(0xffffffffu, w_last, o));
    }
    __syncthreads();
    if (lane == 0) { warp_mass[warp] = se; warp_last[warp] = w_last; }
    __syncthreads();
    double all_mass = 0.0;
    for (int w = 0; w < warps; ++w) all_mass += warp_mass[w];
    double lse = zmax + log(all_mass);
    if (greedy || bmax == __int_as_float(0x7f800000)) {
        if (tid == 0) { tokens[r] = argmax; logprobs[r] = (float)((double)row.x(argmax) * row.inv_t - lse); }
        return;
    }

    int k = top_k[r];
    float p = top_p[r], mp = min_p[r];
    if ((k <= 0 || k >= vocab) && p >= 1.0f && mp <= 0.0f) {
        // Plain temperature sampling, RL's usual case: every finite token is kept, so
        // the draw finds the chunk its target falls in from the masses above, and that
        // chunk's warp walks it in id order, 32 ids a step with a warp scan.
        double target = uniforms[r] * all_mass, before = 0.0;
        int cross = -1, last_warp = -1;
        for (int w = 0; w < warps; ++w) {
            if (warp_mass[w] > 0.0) last_warp = w;
            if (cross < 0 && warp_mass[w] > 0.0) {
                if (before + warp_mass[w] > target) cross = w;
                else before += warp_mass[w];
            }
        }
        // Rounding can leave the target unreached: the last token with mass then.
        if (cross < 0) {
            if (tid == 0) {
                int tok = last_warp >= 0 ? warp_last[last_warp] : argmax;
                tokens[r] = (u32)tok;
                logprobs[r] = (float)((double)row.x(tok) * row.inv_t - lse);
            }
            return;
        }
        if (warp != cross) return;
        double running = before;
        int tok = warp_last[cross];  // where the walk's own rounding falls short
        for (int base = wlo; base < whi; base += 32) {
            int i = base + lane;
            double e = i < whi ? exp((double)row.x(i) * row.inv_t - zmax) : 0.0;
            double incl = e;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                double n = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += n;
            }
            unsigned hit = __ballot_sync(0xffffffffu, e > 0.0 && running + incl > target);
            if (hit) {
                tok = base + __ffs(hit) - 1;
                break;
            }
            running += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) {
            tokens[r] = (u32)tok;
            logprobs[r] = (float)((double)row.x(tok) * row.inv_t - lse);
        }
        return;
    }

    // 2. top-k: the k-th largest value by a count-weighted radix select (4 x 8 bits).
    u32 kth_key = 0;  // keep keys >= kth_key
    if (k > 0 && k < vocab) {
        if (tid == 0) { sel_prefix = 0; sel_rank = (u32)k; }
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < BINS; b += blockDim.x) count_hist[b] = 0;
            __syncthreads();
            u32 prefix = (u32)sel_prefix;
            u32 hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
            for (int i = tid; i < vocab; i += blockDim.x) {
                u32 key = ~ordered_key(row.x(i));  // ascending key = descending value
                if ((key & hi_mask) == prefix) atomicAdd(&count_hist[(key >> shift) & 0xff], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 rank = sel_rank;
                int b = 0;
                while (b < BINS - 1 && count_hist[b] < rank) rank -= count_hist[b++];
                sel_rank = rank;
                sel_prefix = prefix | ((u32)b << shift);
            }
            __syncthreads();
        }
        kth_key = ~(u32)sel_prefix;
    }

    // 3. top-p: the last kept token is the first, in (value desc, id asc) order, whose
    // inclusive running mass reaches top_p of the total kept so far (finite and at least
    // the k-th largest); a mass-weighted radix select over the 64-bit key (8 x 8 bits)
    // finds it.
    unsigned long long cut_key = 0xffffffffffffffffull;
    if (p < 1.0f) {
        double total = 0.0;
        for (int i = tid; i < vocab; i += blockDim.x) {
            float v = row.x(i);
            if (v > NEG_INF && ordered_key(v) >= kth_key) total += exp((double)v * row.inv_t - zmax);
        }
        total = block_sum_f64(total, dscratch);
        double tp = (double)p;
        if (tid == 0) { sel_prefix = 0; sel_before = 0.0; }
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int b = tid; b < BINS; b += blockDim.x) mass_hist[b] = 0.0;
            __syncthreads();
            unsigned long long prefix = sel_prefix;
            unsigned long long hi_mask = shift == 56 ? 0ull : (0xffffffffffffffffull << (shift + 8));
            for (int i = tid; i < vocab; i += blockDim.x) {
                float v = row.x(i);
                if (!(v > NEG_INF && ordered_key(v) >= kth_key)) continue;
                unsigned long long key = ((unsigned long long)(~ordered_key(v)) << 32) | (u32)i;
                if ((key & hi_mask) == prefix)
                    atomicAdd(&mass_hist[(key >> shift) & 0xff], exp((double)v * row.inv_t - zmax));
            }
            __syncthreads();
            if (tid == 0) {
                double before = sel_before;
                int b = 0;
                while (b < BINS - 1 && !(mass_hist[b] > 0.0 && (before + mass_hist[b]) / total >= tp))
                    before += mass_hist[b++];
                sel_before = before;
                sel_prefix = prefix | ((unsigned long long)b << shift);
            }
            __syncthreads();
        }
        cut_key = sel_prefix;
    }

    // 4. min-p and the kept predicate.
    double floor_ = mp > 0.0f ? log((double)mp) : -1.0e300;
    auto weight = [&](int i) -> double {
        float v = row.x(i);
        if (!(v > NEG_INF) || ordered_key(v) < kth_key) return 0.0;
        unsigned long long key = ((unsigned long long)(~ordered_key(v)) << 32) | (u32)i;
        if (key > cut_key) return 0.0;
        double zc = (double)v * row.inv_t - zmax;
        if (zc < floor_) return 0.0;
        return exp(zc);
    };

    // 5. draw in id order over contiguous per-thread chunks.
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int lo = min(vocab, tid * chunk), hi = min(vocab, lo + chunk);
    double mine = 0.0;
    int my_last = -1;
    for (int i = lo; i < hi; ++i) {
        double w = weight(i);
        if (w > 0.0) { mine += w; my_last = i; }
    }
    // Exclusive scan of the chunk masses (warp scan, then over warps).
    double incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        double n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();
    if (lane == 31) dscratch[warp] = incl;
    __syncthreads();
    double warp_before = 0.0, all = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        if (w < warp) warp_before += dscratch[w];
        all += dscratch[w];
    }
    double before = warp_before + incl - mine;
    double target = uniforms[r] * all;
    // The last kept token overall, the fallback when rounding leaves the target unreached.
    int last = my_last;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    __syncthreads();
    if (lane == 0) iscratch[warp] = last;
    __syncthreads();
    last = lane < (int)(blockDim.x >> 5) ? iscratch[lane] : -1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    __syncthreads();
    if (tid == 0) iscratch[0] = 0x7fffffff;
    __syncthreads();
    if (mine > 0.0 && before + mine > target) {
        double running = before;
        for (int i = lo; i < hi; ++i) {
            double w = weight(i);
            if (w > 0.0) {
                running += w;
                if (running > target) { atomicMin(&iscratch[0], i); break; }
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        int tok = iscratch[0] != 0x7fffffff ? iscratch[0] : (last >= 0 ? last : argmax);
        tokens[r] = (u32)tok;
        logprobs[r] = (float)((double)row.x(tok) * row.inv_t - lse);
    }
}
