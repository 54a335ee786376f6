"""One arm of bench_sweep.py's grid cell under callgrind: deterministic instruction counts and simulated cache
misses, where wall clock on a shared 2-core machine cannot settle a few percent.

    valgrind --tool=callgrind [--cache-sim=yes] --collect-atstart=no --toggle-collect=starmap_next \\
        python scripts/grid_callgrind.py relu 64 {full,sweep,evalsum} 3 [N EVERY]

Collection is on only inside itertools.starmap's calls, i.e. around the measured repeats (the import, the build and
two warm-up calls are not counted). Arms: `full` runs torch_ext.Executor over the whole chain once per site with the
site's value replaced (bench_sweep's full arm), `sweep` is torch_ext.sweep, `evalsum` the bare cone loop
(Engine.evaluate_patched per site, then float(out.sum())). Compare arms by their `Collected` totals: full / sweep
over the sweep's rho (2.051 for the 160-node chain, a site every 4th node) is the instruction-count share of rho.

Per node and per site: N=160 EVERY=4 and N=80 EVERY=2 both have 40 sites, with 6,400 / 3,200 nodes run by the full
arm and 3,120 / 1,560 by the cone loop, so the two runs' difference over the node difference is each arm's cost per
node, and what is left over is its cost per site.
"""
import itertools
import os
import sys

import torch

import torch_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sweep import grid_cell  # noqa: E402


def main(op: str, d: int, arm: str, repeats: int, n: int = 160, every: int = 4) -> None:
    torch.set_num_threads(1)
    _, x, rg, sites, pre, extra, executors = grid_cell(op, d, n, every)
    eng = rg._engine
    arms = {
        "full": lambda: [float(executors[s](x, pre[s], *extra)[0].sum()) for s in sites],
        "sweep": lambda: torch_ext.sweep(rg, sites, lambda v, s: pre[s], lambda o: o.sum(), progress=False),
        "evalsum": lambda: [float(eng.evaluate_patched(s, pre[s])[0].sum()) for s in sites],
    }
    run = arms[arm]
    with torch.no_grad():
        for _ in range(2):
            run()
        list(itertools.starmap(run, [()] * repeats))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 3,
         *(int(a) for a in sys.argv[5:7]))
