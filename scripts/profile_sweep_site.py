#!/usr/bin/env python
"""Where a reactive sweep site's microseconds go, against the executor arm of the grid (issue 10).

    python scripts/profile_sweep_site.py [--op relu] [--d 64] [--repeats 40]

Builds bench_sweep.py's grid case (a 160-node chain, every 4th node a site, one thread) and times,
by thread CPU time (time.thread_time, so other processes on a shared machine count less), each
component of one site, per site, interleaved over `repeats` rounds (median, and the minimum):

  full           the grid's full arm: Executor over all 160 nodes + out.sum() + float(), per site
  sweep          torch_ext.sweep(...) one-at-a-time (what the grid's reactive arm times), per site
  cone_whole     _C.Engine.evaluate_patched(node, value): the bare cone call, per site
  cone_rows      _C.Engine.evaluate_patched_rows(node, value, [], []): the row path's entry, per site
  clone          the copy of the activation handed to the patch function
  metric         out.sum().item()
  sweep_one      torch_ext.sweep over one site (the last node: an empty cone), per sweep
  cone_one       evaluate_patched on that site, per call (sweep_one - cone_one: the sweep's fixed cost)

and prints sweep - (cone_whole + clone + metric), the per-site overhead the loop adds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import torch_ext  # noqa: E402
from torch_ext.ir import Graph  # noqa: E402

from bench_sweep import _GridChain, _grid_full_graph  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="relu", choices=["relu", "sin", "linear+gelu"])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--n", type=int, default=160)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    op, d, n = args.op, args.d, args.n
    model = _GridChain(op, d, n).eval()
    x = torch.randn(d, d)
    rg = torch_ext.ReactiveGraph(model, (x,))
    nodes = rg.nodes()
    site_idx = list(range(args.every, n + 1, args.every))
    sites = [nodes[i - 1] for i in site_idx]
    pre = {s: rg.value(s) * 0.5 for s in sites}
    extra = [model.lin.weight.detach(), model.lin.bias.detach()] if op == "linear+gelu" else []
    executors = {s: torch_ext.Executor(Graph.parse(_grid_full_graph(op, d, n, i))) for s, i in zip(sites, site_idx)}
    eng = rg._engine._e if hasattr(rg._engine, "_e") else rg._engine
    patch = lambda v, s: pre[s]  # noqa: E731
    metric = lambda o: o.sum()  # noqa: E731
    S = len(sites)

    def full():
        return {s: float(executors[s](x, pre[s], *extra)[0].sum()) for s in sites}

    def sweep():
        return torch_ext.sweep(rg, sites, patch, metric, progress=False)

    def cone_whole():
        for s in sites:
            eng.evaluate_patched(s, pre[s])

    def cone_rows():
        for s in sites:
            eng.evaluate_patched_rows(s, pre[s], [], [])

    vals = [rg.value(s) for s in sites]

    def clone():
        for v in vals:
            v.clone()

    out = rg.value(nodes[-1])

    def metric_only():
        for _ in sites:
            float(out.sum().item())

    one = sites[-1]

    def sweep_one():
        for _ in sites:
            torch_ext.sweep(rg, [one], patch, metric, progress=False)

    def cone_one():
        for _ in sites:
            eng.evaluate_patched(one, pre[one])

    arms = {"full": (full, S), "sweep": (sweep, S), "cone_whole": (cone_whole, S), "cone_rows": (cone_rows, S),
            "clone": (clone, S), "metric": (metric_only, S), "sweep_one": (sweep_one, S), "cone_one": (cone_one, S)}
    r = sweep()
    assert r.measured_evaluations == r.predicted_evaluations
    assert all(r.metrics[s] == v for s, v in full().items()), "arms disagree"
    times = {k: [] for k in arms}
    with torch.no_grad():
        for fn, _ in arms.values():
            fn()
        for _ in range(args.repeats):
            for k, (fn, per) in arms.items():
                t0 = time.thread_time()
                fn()
                times[k].append((time.thread_time() - t0) / per * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    print(f"{op} {d}x{d}, chain {n}, {S} sites, rho {r.rho:.3f}; load {os.getloadavg()[0]:.2f}; "
          f"us per site by thread CPU time, median / min of {args.repeats}")
    for k in arms:
        print(f"  {k:12s} {med[k]:9.2f} {low[k]:9.2f}")
    fixed = med["sweep_one"] - med["cone_one"]
    over = med["sweep"] - med["cone_whole"] - med["clone"] - med["metric"]
    print(f"  sweep fixed cost (one-site sweep - its cone): {fixed:.2f} us, over {S} sites {fixed / S:.2f} us/site")
    print(f"  rows entry - whole cone: {med['cone_rows'] - med['cone_whole']:.2f} us/site")
    print(f"  sweep - (cone_whole + clone + metric): {over:.2f} us/site")
    print(f"  wall ratio full/sweep {med['full'] / med['sweep']:.3f} = {med['full'] / med['sweep'] / r.rho:.3f} rho; "
          f"full/cone_whole {med['full'] / med['cone_whole'] / r.rho:.3f} rho")
    return 0


if __name__ == "__main__":
    sys.exit(main())
