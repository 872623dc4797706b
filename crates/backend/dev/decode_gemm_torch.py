#!/usr/bin/env python3
"""Kernel lab: torch's bf16 GEMMs (cuBLASLt with its heuristics) at the Qwen3-1.7B layer's
decode shapes, the reference for `cuda_ops --ignored timing_table`'s "decode gemm" rows.
Prints ms, weight GB/s and TFLOP/s per shape. Needs torch and a GPU."""
import torch

SHAPES = [("q", 2048, 2048), ("k or v", 1024, 2048), ("o", 2048, 2048),
          ("gate or up", 6144, 2048), ("down", 2048, 6144)]


def time_ms(fn, iters=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


for m in (64, 128, 256):
    for name, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: a @ w.t())
        s = ms / 1e3
        print(f"torch decode gemm {name} [{m}x{k}]·[{n}x{k}]ᵀ {ms:10.4f} ms "
              f"{2 * n * k / s / 1e9:8.1f} GB/s {2 * m * n * k / s / 1e12:6.1f} TFLOP/s")
