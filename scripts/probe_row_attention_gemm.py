#!/usr/bin/env python
"""Can causal attention run on the changed query rows only and still give the whole kernel's bits?

    python scripts/probe_row_attention_gemm.py [--trials 3000] [--seed 0]

The row path runs causal SDPA on whole rows (csrc/reactive/rows.cpp, ``whole_sdpa``) so that its rows are
bit-identical to a full recompute. A row kernel would copy ATen's CPU flash attention
(aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) but hand its two BLAS calls only the query rows
[p, qBlockSize) of a query block: ``q @ k.T`` (rows = queries, so N of the column-major gemm) and
``softmax @ v``. The softmax steps are per row and would match; whether the GEMMs do is the question.

This probe asks that of the same BLAS (torch.mm on CPU calls at::native::cpublas::gemm, as the kernel
does): for random query-block sizes (the kernel's qSplitSize: 32 below 192 rows, 64 below 768), key
counts, head sizes and first rows p, it compares rows [p, n) of the whole-block product with the product of
rows [p, n) alone (a view: the same memory, as the kernel's pointer offset would be), bit for bit. It
reports how many differ, with and without keeping at least two rows (BLAS libraries take a GEMV path for
one row). Any mismatch means a row kernel on the changed rows cannot promise the full recompute's bits.

It also times the whole causal kernel against query rows [T - r, T) alone at T 16 (the benchmark's
shape), the most such a kernel could save.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 8: torch.int64}[t.element_size()])


def probe(trials: int, seed: int, dtype: torch.dtype, min_rows: int) -> tuple[int, int, list]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bad_qk = bad_pv = 0
    examples = []
    for _ in range(trials):
        T = rng.choice([1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 64, 100, 191, 192, 255, 300, 511, 600])
        D = rng.choice([8, 16, 24, 32, 40, 64, 80, 128])
        n = min(T, 32 if T < 192 else 64)  # one query block
        keys = min(T, 512)  # one key block
        p = rng.randrange(n)
        if n - p < min_rows:
            p = max(0, n - min_rows)
        q = torch.randn(n, D, dtype=dtype) * rng.choice([1.0, 10.0, 1e-3])
        k = torch.randn(keys, D, dtype=dtype)
        v = torch.randn(keys, D, dtype=dtype)
        w = torch.rand(n, keys, dtype=dtype)
        whole, rows = q @ k.t(), q[p:] @ k.t()
        if not torch.equal(_bits(whole[p:]), _bits(rows)):
            bad_qk += 1
            examples.append(("q@k.T", T, D, p, float((whole[p:] - rows).abs().max())))
        whole, rows = w @ v, w[p:] @ v
        if not torch.equal(_bits(whole[p:]), _bits(rows)):
            bad_pv += 1
            examples.append(("p@v", T, D, p, float((whole[p:] - rows).abs().max())))
    return bad_qk, bad_pv, examples


def timing() -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for D in (16, 32):
        for r in (16, 8, 4, 1):
            q = torch.randn(448, 4, r, D)
            k, v = torch.randn(448, 4, 16, D), torch.randn(448, 4, 16, D)
            mask = torch.zeros(r, 16).masked_fill_(
                torch.arange(16).unsqueeze(0) > torch.arange(16 - r, 16).unsqueeze(1), float("-inf"))
            fn = (lambda: sdpa(q, k, v, is_causal=True)) if r == 16 else (lambda: sdpa(q, k, v, mask))
            for _ in range(3):
                fn()
            t0 = time.thread_time()
            for _ in range(20):
                fn()
            per = (time.thread_time() - t0) / 20 / (448 * 4)
            print(f"  head dim {D}, query rows {r:2d} of 16: {per * 1e6:.2f} us per (batch, head)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.float64):
        for min_rows in (1, 2):
            qk, pv, ex = probe(args.trials, args.seed, dtype, min_rows)
            print(f"{dtype}, at least {min_rows} row(s): {qk} of {args.trials} q@k.T blocks and {pv} p@v blocks "
                  f"differ in rows [p, n) from the whole block's; e.g. {ex[:4]}")
    print("causal SDPA at T 16, 448 x 4 (batch, head) pairs (the whole kernel at 16 rows; fewer: masked call):")
    timing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
