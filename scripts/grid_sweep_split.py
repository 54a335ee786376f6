#!/usr/bin/env python
"""Where a grid cell's gap to rho sits: the engine, the C++ site loop, or sweep()'s own work (issue 10).

    python scripts/grid_sweep_split.py [--op relu] [--size 64] [--rounds 100] [--clock thread|wall]

bench_sweep.py's grid cell (a 160-node chain, every 4th node a site, 40 sites, metric out.sum()), one thread. Each
round runs every arm once, in turn (so the machine's drifting speed hits them alike), with the cyclic GC off;
medians over the rounds:

  full       the grid's full arm: torch_ext.Executor over all 160 nodes per site + the metric
  sweep      torch_ext.sweep(...), the defaults (what the grid's reactive arm times)
  sweep_bare sweep(positions=False, skip_identical=False): no row-path entry, no identical-site compare
  sites      the C++ site loop alone (_C.Engine.sweep_sites, whole cones): patch and metric callbacks, copies, checks
  sites_rows the same with the row path's entry (what sweep() calls with positions on)
  loop       the bare cone loop: Engine.evaluate_patched + the metric in a Python list comprehension
  sweep1 / sites1  one site (the last node: an empty cone): sweep1 - sites1 is sweep()'s fixed work per call

Prints each arm's time, full / arm / rho for the 40-site arms, and the per-site and per-call differences.

    python scripts/grid_sweep_split.py --per-node [--op relu] [--rounds 60]

splits the full, loop and sweep arms into a cost per node and a cost per site: the 160-node chain with a site every
4th node and an 80-node chain with a site every 2nd node both have 40 sites, with 6,400 / 3,200 nodes run by the full
arm and 3,120 / 1,560 by the cone, so the two cells' difference over the node difference is an arm's cost per node,
and what is left, over 40, its cost per site. With the same per-node and per-site costs in both arms the ratio / rho
is (6400 n + 40 s) / (3120 n + 40 s) / 2.051: the per-site work (the Python call, the metric) that both arms pay
bounds it below 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sweep  # noqa: E402  (the grid's cell)
from _bench_util import interleaved_medians  # noqa: E402

import torch_ext  # noqa: E402


def _alternated_medians(arms: dict, rounds: int, clock) -> dict:
    """Median seconds of each arm over ``rounds`` rounds, the arms alternated within a round (one warm-up call
    each first), under no_grad with the garbage collector off."""
    return interleaved_medians(arms, rounds, clock=clock, no_grad=True)


def per_node(op: str, size: int, rounds: int, clock) -> None:
    cells = {n: bench_sweep.grid_cell(op, size, n, every) for n, every in ((160, 4), (80, 2))}
    arms, nodes = {}, {}

    def patch_of(pre):
        return lambda v, s: pre[s]

    def metric(o):
        return o.sum()

    for n, (_, x, rg, sites, pre, extra, executors) in cells.items():
        eng = rg._engine
        assert len(sites) == 40
        arms[f"full{n}"] = (lambda x=x, sites=sites, pre=pre, extra=extra, executors=executors:
                            [float(executors[s](x, pre[s], *extra)[0].sum()) for s in sites])
        arms[f"loop{n}"] = (lambda eng=eng, sites=sites, pre=pre:
                            [float(eng.evaluate_patched(s, pre[s])[0].sum()) for s in sites])
        arms[f"sweep{n}"] = (lambda rg=rg, sites=sites, pre=pre:
                             torch_ext.sweep(rg, sites, patch_of(pre), metric, progress=False))
        nodes[f"full{n}"] = 40 * n
        nodes[f"loop{n}"] = nodes[f"sweep{n}"] = sum(n - (i + 1) * (n // 40) for i in range(40))
    med = _alternated_medians(arms, rounds, clock)
    print(f"{op} {size}x{size}, 40 sites, chains of 160 (site every 4th) and 80 (every 2nd), medians of {rounds} rounds")
    node_cost = {}
    for arm in ("full", "loop", "sweep"):
        a, b = f"{arm}160", f"{arm}80"
        per = (med[a] - med[b]) / (nodes[a] - nodes[b])
        site = (med[a] - nodes[a] * per) / 40
        node_cost[arm] = per
        print(f"  {arm:6s} {med[a] * 1e3:8.3f} / {med[b] * 1e3:8.3f} ms: {per * 1e6:7.3f} us a node, "
              f"{site * 1e6:7.2f} us a site ({site / per:5.1f} nodes)")
    rho = nodes["full160"] / nodes["loop160"]
    for arm in ("loop", "sweep"):
        print(f"  full / {arm} / rho at 160: {med['full160'] / med[arm + '160'] / rho:.3f}; "
              f"{arm} / full a node: {node_cost[arm] / node_cost['full']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="relu", choices=["relu", "sin", "linear+gelu"])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--clock", choices=["wall", "thread"], default="thread")
    ap.add_argument("--per-node", action="store_true", help="split each arm into a cost per node and per site")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    if args.per_node:
        per_node(args.op, args.size, args.rounds, clock)
        return
    _, x, rg, sites, pre, extra, executors = bench_sweep.grid_cell(args.op, args.size)
    eng = rg._engine
    n = len(sites)

    def patch(v, s):
        return pre[s]

    def metric(o):
        return o.sum()

    def convert(r, s):
        return float(r)

    def fail(*a):
        raise RuntimeError(f"sweep_sites failed: {a}")

    def sites_arm(site_list, rows):
        return lambda: eng.sweep_sites(site_list, site_list, [patch] * len(site_list), rows, [], [], metric, 0,
                                       convert, fail, False, None, None)

    last = [sites[-1]]
    arms = {
        "full": lambda: [float(executors[s](x, pre[s], *extra)[0].sum()) for s in sites],
        "sweep": lambda: torch_ext.sweep(rg, sites, patch, metric, progress=False),
        "sweep_bare": lambda: torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=False,
                                              skip_identical=False),
        "sites": sites_arm(sites, False),
        "sites_rows": sites_arm(sites, True),
        "loop": lambda: [float(eng.evaluate_patched(s, pre[s])[0].sum()) for s in sites],
        "sweep1": lambda: torch_ext.sweep(rg, last, patch, metric, progress=False, positions=False,
                                          skip_identical=False),
        "sites1": sites_arm(last, False),
    }
    med = _alternated_medians(arms, args.rounds, clock)
    rho = torch_ext.sweep(rg, sites, patch, metric, progress=False, skip_identical=False).rho
    print(f"{args.op} {args.size}x{args.size}, {n} sites, rho {rho:.3f}, medians of {args.rounds} rounds "
          f"({args.clock} clock, GC off)")
    for k in ("full", "sweep", "sweep_bare", "sites", "sites_rows", "loop"):
        share = "" if k == "full" else f"   full / {k} / rho {med['full'] / med[k] / rho:.3f}"
        print(f"  {k:11s} {med[k] * 1e3:9.3f} ms{share}")
    per_site = lambda a, b: (med[a] - med[b]) / n * 1e6  # noqa: E731
    print(f"  per site: sites - loop {per_site('sites', 'loop'):+.2f} us, sites_rows - sites "
          f"{per_site('sites_rows', 'sites'):+.2f} us, sweep - sweep_bare {per_site('sweep', 'sweep_bare'):+.2f} us")
    print(f"  per call: sweep1 - sites1 {(med['sweep1'] - med['sites1']) * 1e6:.1f} us (sweep()'s own work), "
          f"sweep_bare - sites {(med['sweep_bare'] - med['sites']) * 1e6:.1f} us at {n} sites")


if __name__ == "__main__":
    main()
