#!/usr/bin/env python
"""Building the planned executor (`step.compile(plan=True)`'s ArenaExecutor: plan_memory, lower_out_variants, bind) on
deep Adam MLP steps: CPU seconds and microseconds per node, which stay flat with depth when the build is linear.

    python scripts/bench_plan_build.py [--depths 50 100 200] [--repeats 3]

Each depth builds `make_train_step` for Linear(16,16)+ReLU x depth with Adam (the export dominates that), schedules the
graph as compile(plan=True) does, then times `_C.ArenaExecutor(graph, n_state, donate=True)` alone (best of repeats,
thread CPU time, so other load on the machine counts less) and checks every repeat plans the same peak.
"""
from __future__ import annotations

import argparse
import time

import torch

import torch_ext
from torch_ext import _C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'depth':>6s} {'nodes':>7s} {'build s':>8s} {'arena s':>8s} {'us/node':>8s}")
    for depth in a.depths:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(depth)])
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        x, y = torch.randn(4, 16), torch.randn(4, 16)
        t = time.perf_counter()
        step = torch_ext.make_train_step(m, opt, lambda mm, a, b: torch.nn.functional.mse_loss(mm(a), b), (x, y))
        build = time.perf_counter() - t
        g = step.graph.clone()
        g.schedule(True)
        n_state = len(step.state_names)
        nodes = len(list(g.nodes()))
        best, peaks = float("inf"), set()
        for _ in range(a.repeats):
            t = time.thread_time()
            ex = _C.ArenaExecutor(g._g, n_state, True)
            best = min(best, time.thread_time() - t)
            peaks.add(ex.plan()["peak_bytes"])
        assert len(peaks) == 1, peaks
        print(f"{depth:6d} {nodes:7d} {build:8.1f} {best:8.3f} {best / nodes * 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()
