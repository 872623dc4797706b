#!/usr/bin/env python3
"""Kernel lab: compile each CUDA module of the backend with NVRTC for sm_90 and print
ptxas's resource report (registers, spills, shared memory) per kernel. Needs only
libnvrtc (e.g. the `nvidia-cuda-nvrtc` wheel), no GPU:

    LD_LIBRARY_PATH=/path/to/nvrtc/lib python3 crates/backend/dev/ptxas_report.py [module.cu ...]
"""
import ctypes
import pathlib
import sys

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "src" / "cuda" / "kernels"


def compile_report(name: str) -> str:
    nvrtc = ctypes.CDLL("libnvrtc.so.13")
    src = (KERNELS / "common.cuh").read_text() + "\n" + (KERNELS / name).read_text()
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    return f"{name}: rc={rc}\n{log.value.decode()}"


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in KERNELS.glob("*.cu"))
    for n in names:
        print(compile_report(n))
