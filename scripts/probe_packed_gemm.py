#!/usr/bin/env python
"""Would pre-packed weights (MKL's packed GEMM) speed up the row path's linears, with addmm's bits?

    python scripts/probe_packed_gemm.py [--repeats 200]

The batched TransformerLens sweep (bench_sweep.py part 2, d_model 128, batch 8) spends a tenth of its
time in MKL's packing routines (perf: mkl_blas_def_sgemm_scopy_*; a fifth in its smallest unit), and each
of its ~120 linears a sweep packs afresh. libtorch_cpu exports MKL's packed API (cblas_sgemm_pack,
cblas_sgemm_compute), so a weight could be packed once per engine. This probe asks the two questions that
decide it, for the benchmark's weight shapes (K x N: qkv 128x384, proj 128x128, MLP 128x512 and 512x128)
and row counts M (the row path's rows x stacked copies, 1 to 1000):

1. bits: torch.addmm(bias, x, W.t()) (what linear runs on a 2-D dense input: the bias copied into the
   output, then sgemm with beta = 1) against the packed compute on the same bias copy, bit for bit;
2. thread time of each (best of 5 rounds), side by side, in one process.

Measured (stop 50, tl77, load 9): the bits agree for M >= 4 and differ for M <= 3 (MKL's small-M
path); the packed compute is no faster (0.84-1.37x addmm's time, mostly slower), so the packing the profile shows is not
the weights' (it stays with pre-packed weights). Not taken.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

from _bench_util import best_thread_seconds

_COL_MAJOR, _NO_TRANS, _TRANS, _PACKED, _A_MATRIX = 102, 111, 112, 151, 161


def _mkl():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    return lib


def _pack(lib, w: torch.Tensor) -> torch.Tensor:
    """W [N, K] (row-major, = column-major K x N) packed as op(A) = A^T of the column-major problem
    C^T [N, M] = W [N, K] @ x^T [K, M], the orientation torch's addmm hands sgemm."""
    n, k = w.shape
    size = lib.cblas_sgemm_pack_get_size(_A_MATRIX, n, 1024, k)
    buf = torch.empty(size // 4 + 16, dtype=torch.float32)
    lib.cblas_sgemm_pack(_COL_MAJOR, _A_MATRIX, _TRANS, n, 1024, k, 1.0, w.data_ptr(), k, buf.data_ptr())
    return buf


def _compute(lib, packed: torch.Tensor, n: int, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    out = bias.expand(m, n).contiguous()  # beta = 1 on the bias copy, as addmm does
    lib.cblas_sgemm_compute(_COL_MAJOR, _PACKED, _NO_TRANS, n, m, k, packed.data_ptr(), k, x.data_ptr(), k, 1.0,
                            out.data_ptr(), n)
    return out


def _thread_us(fn, n: int) -> float:
    return best_thread_seconds(fn, n) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lib = _mkl()
    shapes = [(128, 384), (128, 128), (128, 512), (512, 128)]
    rows = [1, 2, 3, 4, 7, 8, 15, 16, 24, 32, 48, 56, 100, 104, 128, 208, 312, 520, 728, 1000]
    differ = []
    for k, n in shapes:
        w, b = torch.randn(n, k), torch.randn(n)
        packed = _pack(lib, w)
        for m in rows:
            x = torch.randn(m, k)
            if not torch.equal(torch.addmm(b, x, w.t()).view(torch.int32), _compute(lib, packed, n, x, b).view(torch.int32)):
                differ.append((k, n, m))
    print(f"bits: {len(differ)} of {len(shapes) * len(rows)} (K, N, M) differ: {differ}")
    print("thread time, best of 5 rounds (us): addmm / packed compute, ratio")
    for k, n in shapes:
        w, b = torch.randn(n, k), torch.randn(n)
        packed = _pack(lib, w)
        line = []
        for m in (16, 104, 312, 728):
            x = torch.randn(m, k)
            a = _thread_us(lambda: torch.addmm(b, x, w.t()), args.repeats)
            c = _thread_us(lambda: _compute(lib, packed, n, x, b), args.repeats)
            line.append(f"M {m}: {a:.0f} / {c:.0f} ({c / a:.2f}x)")
        print(f"  K {k} N {n}: " + ", ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
