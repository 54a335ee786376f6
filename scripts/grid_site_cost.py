"""Where a grid cell's wall ratio goes below rho: the fixed cost per site against the cost per node.

    python scripts/grid_site_cost.py [--op relu] [--size 64] [--seconds 1.0] [--clock thread]

A reactive sweep site costs R + cone * c, a full-recompute site (one torch_ext.Executor run of the
160-node chain, as bench_sweep.py's grid arm) F + 160 * c. This prints, for sites at several depths of
the chain (each site repeated 40 times, so its cone is the same every time), the reactive time per site
against the cone size, and the executor's time per run, with the same metric (out.sum(), as a float).
A straight line through the reactive rows gives R (the intercept) and c (the slope); compare c with the
executor's per-node time and R with F. At rho = 2.05 (every 4th node a site), 0.97 rho needs
R <= (F + 160 c) / (0.97 rho) - 78 c. One thread.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sweep  # noqa: E402  (the grid's chain and its full-recompute IR)

import torch_ext  # noqa: E402
from torch_ext.ir import Graph  # noqa: E402


_CLOCK = time.perf_counter  # --clock thread: this thread's CPU time, for a loaded machine


def per_call(fn, seconds: float) -> float:
    for _ in range(3):
        fn()
    start, calls = _CLOCK(), 0
    while _CLOCK() - start < seconds:
        fn()
        calls += 1
    return (_CLOCK() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="relu", choices=["relu", "sin"])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = ap.parse_args()
    global _CLOCK
    if args.clock == "thread":
        _CLOCK = time.thread_time
    torch.set_num_threads(1)
    n, d = 160, args.size
    torch.manual_seed(0)
    model = bench_sweep._GridChain(args.op, d, n).eval()
    x = torch.randn(d, d)
    rg = torch_ext.ReactiveGraph(model, (x,))
    nodes = rg.nodes()
    rows = []
    with torch.no_grad():
        for position in (160, 156, 140, 80, 1):  # 1-based; the cone is everything after it
            site = nodes[position - 1]
            value = rg.value(site) * 0.5
            sites = [site] * 40
            t = per_call(lambda: torch_ext.sweep(rg, sites, lambda v, s: value, lambda o: o.sum(), progress=False),
                         args.seconds) / len(sites)
            rows.append((n - position, t))
            print(f"reactive, site at node {position:3d} (cone {n - position:3d}): {t * 1e6:7.2f} us per site")
        executor = torch_ext.Executor(Graph.parse(bench_sweep._grid_full_graph(args.op, d, n, 80)))
        p = rg.value(nodes[79]) * 0.5
        f_run = per_call(lambda: [float(executor(x, p)[0].sum()) for _ in range(40)], args.seconds) / 40
    print(f"executor, all {n} nodes + the metric: {f_run * 1e6:7.2f} us per run")
    cones = torch.tensor([c for c, _ in rows], dtype=torch.float64)
    times = torch.tensor([t for _, t in rows], dtype=torch.float64)
    slope = float(((cones - cones.mean()) * (times - times.mean())).sum() / ((cones - cones.mean()) ** 2).sum())
    intercept = float(times.mean() - slope * cones.mean())
    print(f"reactive fit: R = {intercept * 1e6:.2f} us per site, c = {slope * 1e6:.3f} us per node; "
          f"executor: {f_run / n * 1e6:.3f} us per node including its fixed cost")
    rho = 160 / 78
    allowed = (f_run / (0.97 * rho) - 78 * slope) * 1e6
    print(f"0.97 rho (rho = {rho:.3f}) allows R <= {allowed:.2f} us with this c and the executor's run time")


if __name__ == "__main__":
    main()
