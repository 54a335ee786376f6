#!/usr/bin/env python3
"""Forward time of torch_ext.Executor vs ep.module(), in one run.

Two cases:
  overhead-bound  deep narrow MLP (64 Linear+ReLU layers of width 16, batch 4): per-op
                  dispatch cost dominates; target executor/ep.module() <= 0.80.
  compute-bound   wide MLP (4 Linear+ReLU layers of width 2048, batch 256): GEMMs dominate;
                  target executor/ep.module() <= 1.02 (no slowdown beyond noise).

Each repeat times one call of each runner back to back, alternating which goes first, so
slow drifts (thermal, other load) hit both alike; the table reports medians. ep.module()
is called as users call it (grad mode on, as is the default); torch's default thread count
is kept. Usage: python scripts/bench_executor.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn

import torch_ext


def mlp(depth: int, width: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


CASES = [
    # name, depth, width, batch, target ratio, repeats, time budget (s)
    ("overhead-bound", 64, 16, 4, 0.80, 2000, 15.0),
    ("compute-bound", 4, 2048, 256, 1.02, 60, 25.0),
]


def bench(runners: dict, x: torch.Tensor, repeats: int, budget_s: float, warmup: int) -> dict:
    names = list(runners)
    for _ in range(warmup):
        for n in names:
            runners[n](x)
    times = {n: [] for n in names}
    deadline = time.perf_counter() + budget_s
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            t0 = time.perf_counter_ns()
            runners[n](x)
            times[n].append(time.perf_counter_ns() - t0)
        if time.perf_counter() > deadline and r >= 10:
            break
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the repeats (smoke test)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, torch_ext {torch_ext.__version__}")
    rows = []
    t_start = time.perf_counter()
    for name, depth, width, batch, target, repeats, budget in CASES:
        if args.quick:
            repeats, budget = max(repeats // 10, 10), budget / 10
        model = mlp(depth, width)
        x = torch.randn(batch, width)
        ep = torch.export.export(model, (x,))
        module = ep.module()
        ex = torch_ext.Executor(ep)
        ref, out = module(x), ex(x)
        if not torch.equal(out, ref):
            print(f"{name}: executor output differs from ep.module() "
                  f"(max abs diff {(out - ref).abs().max().item():.3g})", file=sys.stderr)
            return 1
        warmup = 20 if width <= 64 else 3
        times = bench({"executor": ex, "ep.module()": module}, x, repeats, budget, warmup)
        med = {n: statistics.median(t) / 1e3 for n, t in times.items()}
        ratio = med["executor"] / med["ep.module()"]
        rows.append((f"{name} ({depth}x{width}, b{batch})", med["executor"], med["ep.module()"], ratio, target,
                     len(times["executor"])))

    hdr = f"{'case':<32} {'executor us':>12} {'ep.module() us':>15} {'ratio':>7} {'target':>8} {'n':>6}  status"
    print(hdr)
    print("-" * len(hdr))
    for case, te, tm, ratio, target, n in rows:
        status = "ok" if ratio <= target else "MISS"
        print(f"{case:<32} {te:>12.1f} {tm:>15.1f} {ratio:>7.3f} {'<=' + format(target, '.2f'):>8} {n:>6}  {status}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
