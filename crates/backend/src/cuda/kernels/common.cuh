// Shared by every floe CUDA module (prepended by the host before NVRTC compiles it).
// No system headers: NVRTC needs none for these, so only libnvrtc is required at run time.
//
// Float buffers come in two storage types, chosen by the buffer's role on the host:
// bf16 (BufKind::Compute) and f32 (BufKind::Full). Kernels that accept either take the
// pointer plus a `dt` flag (DT_BF16 / DT_F32) and go through ldf/stf; the flag is uniform
// across the launch, so the branch costs nothing measurable in memory-bound kernels.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

#define DT_BF16 0
#define DT_F32 1

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even, NaN kept quiet: the same rounding as `half::bf16::from_f32`.
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float ldf(const void* p, int dt, i64 i) {
    return dt == DT_F32 ? ((const float*)p)[i] : bf2f(((const bf16_t*)p)[i]);
}

__device__ __forceinline__ void stf(void* p, int dt, i64 i, float v) {
    if (dt == DT_F32) ((float*)p)[i] = v;
    else ((bf16_t*)p)[i] = f2bf(v);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// Eight bf16 (16 bytes) as floats, and back with f2bf's rounding: the wide paths of the
// memory-bound kernels, taken when every operand is bf16 and 16-byte aligned.
__device__ __forceinline__ void ld_bf16x8(float* f, const void* p) {
    uint4 w = *(const uint4*)p;
    u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = __uint_as_float(a[e] << 16);
        f[2 * e + 1] = __uint_as_float(a[e] & 0xffff0000u);
    }
}

__device__ __forceinline__ void st_bf16x8(void* p, const float* f) {
    u32 a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = (u32)f2bf(f[2 * e]) | ((u32)f2bf(f[2 * e + 1]) << 16);
    *(uint4*)p = make_uint4(a[0], a[1], a[2], a[3]);
}

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }
