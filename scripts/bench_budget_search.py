#!/usr/bin/env python
"""Time of the memory-budget search (``compile(memory_budget=)``, csrc/passes/rematerialize.cpp) on fuzz steps.

For each case (a ``scripts/fuzz_step.py`` seed:index whose runner is "budget"), builds the step as the fuzzer
does, prepares its graph as ``compile()`` does (convolution splits, schedule), and times
``rematerialize_for_budget`` on a copy at the case's budget (or, when that is out of reach, at the smallest peak
the search finds, as the fuzzer retries). Prints per case the node count, the candidate plans evaluated, the
seconds, and what was found (peak, recomputed count and a digest of the recomputed names), so two builds can be
compared side by side: run it once with each build's ``torch_ext`` on PYTHONPATH, e.g.

    PYTHONPATH=/work/main python scripts/bench_budget_search.py            # before
    PYTHONPATH=.          python scripts/bench_budget_search.py            # after

The budget, evaluations, peak, recomputed count and digest must agree between the two (the same search, the same
plan); only the seconds and "pruned" (trials the liveness bound settled without planning, "-" before it) differ.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext.memory import _budget_bytes, _splits_that_lower_the_peak  # noqa: E402

import fuzz_step  # noqa: E402

CASES = ("14:37", "12:114")  # a 347-node GRU step; a ~3,000-node GRU/LSTM step (stop 46: 0.22 s; 70 s)


def prepared(case: str):
    seed, i = map(int, case.split(":"))
    spec = fuzz_step.case_spec(seed, i)
    torch.set_num_threads(1)
    model, loss_fn, batches = fuzz_step.build(spec)
    opts, scheds = fuzz_step.make_opts(spec, model)
    step = torch_ext.make_train_step(model, opts if len(opts) > 1 else opts[0], loss_fn, batches[0][0],
                                     clip_grad_norm=spec["clip"], accumulate=spec["accumulate"],
                                     scheduler=(scheds if len(scheds) > 1 else scheds[0]) if scheds else None,
                                     unroll=spec.get("unroll", 1))
    donate = spec["model_seed"] % 2 == 0
    budget = _budget_bytes(step, spec.get("budget", 0.5), True)
    graph = step.graph.clone()
    graph.split_convolution_backward(_splits_that_lower_the_peak(graph))
    graph.schedule(donate)
    return spec, graph, budget, donate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per case (the least is printed)")
    args = ap.parse_args(argv)
    print(f"torch_ext from {Path(torch_ext.__file__).parent}")
    print(f"{'case':>8} {'nodes':>6} {'runner':>7} {'budget':>10} {'evals':>6} {'seconds':>8} {'peak':>10} "
          f"{'recomputed':>10} {'pruned':>6}  digest")
    for case in args.cases.split(","):
        try:
            spec, graph, budget, donate = prepared(case)
        except Exception as e:  # noqa: BLE001 - a step the fuzzer's generator makes and torch_ext refuses
            print(f"{case:>8} refused: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        nodes = len(graph)
        first = graph.clone().rematerialize_for_budget(budget, donate)
        if not first["feasible"]:  # out of reach: the fuzzer retries at the smallest peak found
            budget = first["min_peak"]
        best, r = float("inf"), None
        for _ in range(max(args.repeat, 1)):
            g = graph.clone()
            t0 = time.perf_counter()
            r = g.rematerialize_for_budget(budget, donate)
            best = min(best, time.perf_counter() - t0)
        digest = hashlib.sha256("\n".join(sorted(r["recomputed"])).encode()).hexdigest()[:12]
        print(f"{case:>8} {nodes:>6} {spec['runner']:>7} {budget:>10} {r['evaluations']:>6} {best:>8.3f} "
              f"{r['peak']:>10} {len(r['recomputed']):>10} {r.get('pruned', '-'):>6}  {digest}", flush=True)


if __name__ == "__main__":
    main()
