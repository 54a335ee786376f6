#!/usr/bin/env python
"""Where a batched TransformerLens-style sweep's time goes (issue 10, bench_sweep.py part 2), against the
eager-hook sweep it is measured against.

    python scripts/profile_tl_batched.py [--d 64 128] [--batch 8] [--repeats 7]

For each d_model (part 2's model and sites: tl_setup, resid_pos_sites, 64 sites, opaque metric):

1. Thread CPU time (time.thread_time: other processes on a shared machine count less) of the eager
   sweep and of sweep(batch_sites=True), medians of interleaved repeats, and the part of the batched
   sweep spent inside the batched engines' evaluate_patched_rows / evaluate_patched (the C++ cone
   evaluations) per unit, and inside the user's patch function and metric (timed wrappers: the eager
   sweep calls both as often, in its hook and after each forward); the rest is the driver (planning,
   copies handed to the callbacks, stacking, splitting, checks).
2. One profiled sweep of each arm (torch.profiler, record_shapes): ATen calls per op, the batched arm
   against eager's per-forward count times the number of batched units, and the bytes aten::copy_
   writes, by the op that called it ("-": called by the engine itself: row joins, dense copies), and the
   engines' own top-level ATen calls by op (count, profiled time with their callees: inflated by the
   profiler, small view ops most).
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import torch_ext  # noqa: E402
import torch_ext.reactive as reactive  # noqa: E402

from _bench_util import eager_hook_sweep, resid_pre_cache  # noqa: E402
from bench_sweep import full_forward_cost, metric, resid_pos_sites, tl_setup  # noqa: E402


_ENGINE = "torch_ext.reactive.cone"


class _TimedEngine:
    """A batched cone's engine whose cone evaluations are timed (thread time) into ``log``."""

    def __init__(self, engine, log: list):
        self._e, self._log = engine, log

    def __getattr__(self, name):
        return getattr(self._e, name)

    def _timed(self, fn, node, value, *rest):
        from torch.profiler import record_function

        t0 = time.thread_time()
        with record_function(_ENGINE):  # a no-op unless profiled: marks the ATen calls the engine makes
            out = fn(node, value, *rest)
        self._log.append((node, value.shape[0], time.thread_time() - t0))
        return out

    def evaluate_patched_rows(self, node, value, *rest):
        return self._timed(self._e.evaluate_patched_rows, node, value, *rest)

    def evaluate_patched(self, node, value):
        return self._timed(self._e.evaluate_patched, node, value)


def profile_case(d: int, B: int, repeats: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    model, clean, corrupt = tl_setup(d=d, B=B)
    T, L = clean.shape[1], len(model.blocks)
    cache = resid_pre_cache(model, corrupt)
    rg = torch_ext.ReactiveGraph(model, (clean,))
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
    sites, patch = resid_pos_sites(cache, resid, T)
    log: list = []
    init = reactive._BatchedCone.__init__

    def timed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.engine is not None:
            self.engine = _TimedEngine(self.engine, log)

    user = {"patch": 0.0, "metric": 0.0}  # thread time inside the user's callbacks (batched arm)

    def timed_patch(value, site):
        t0 = time.thread_time()
        try:
            return patch(value, site)
        finally:
            user["patch"] += time.thread_time() - t0

    def timed_metric(outs):
        t0 = time.thread_time()
        try:
            return metric(outs)
        finally:
            user["metric"] += time.thread_time() - t0

    arms = {"eager": lambda: eager_hook_sweep(model, clean, cache, T, metric),
            "batched": lambda: torch_ext.sweep(rg, sites, timed_patch, timed_metric, progress=False, batch_sites=True)}
    reactive._BatchedCone.__init__ = timed_init
    try:
        with torch.no_grad():
            result = arms["batched"]()  # builds the batched cones (timed engines from here on)
            arms["eager"]()
            times = {k: [] for k in arms}
            cpp, units, calls = [], [], []
            for _ in range(repeats):
                for k, fn in arms.items():
                    log.clear()
                    user.update(patch=0.0, metric=0.0)
                    t0 = time.thread_time()
                    fn()
                    times[k].append(time.thread_time() - t0)
                    if k == "batched":
                        cpp.append(sum(t for _, _, t in log))
                        calls.append(user["patch"] + user["metric"])
                        units.append(list(log))
            counts, copies = {}, {}
            engine_ops: collections.Counter = collections.Counter()
            engine_us: collections.Counter = collections.Counter()
            for k, fn in arms.items():
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    fn()
                counts[k] = collections.Counter(e.name for e in prof.events() if e.name != _ENGINE)
                for e in prof.events():  # the ATen calls the engine makes itself (its top-level ones)
                    if e.cpu_parent is not None and e.cpu_parent.name == _ENGINE:
                        engine_ops[e.name] += 1
                        engine_us[e.name] += e.cpu_time_total
                by = collections.Counter()
                for e in prof.events():
                    if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0]:
                        caller = e.cpu_parent.name.removeprefix("aten::") if e.cpu_parent is not None else "-"
                        caller = "-" if caller == _ENGINE else caller
                        by[caller] += math.prod(e.input_shapes[0]) * 4  # f32 (the model's dtype)
                copies[k] = by
            # Last: a full run gives the graph new inputs, after which the batched cones are built again.
            fr = full_forward_cost(rg) * len(sites) / result.cost
    finally:
        reactive._BatchedCone.__init__ = init
    med = {k: statistics.median(v) for k, v in times.items()}
    c = statistics.median(cpp)
    print(f"\n[TinyTransformer L={L} d_model={d} batch={B}] {len(sites)} sites, {result.groups} groups "
          f"({len(units[0])} batched units + {result.groups - len(units[0])} single sites), "
          f"{result.measured_evaluations} evaluations")
    print(f"  thread time, medians of {repeats}: eager {med['eager'] * 1e3:.1f} ms, batched {med['batched'] * 1e3:.1f} ms "
          f"({med['eager'] / med['batched']:.2f}x); in the batched engines {c * 1e3:.1f} ms "
          f"({c / med['batched']:.0%}), Python loop and single sites {(med['batched'] - c) * 1e3:.1f} ms")
    u = statistics.median(calls)
    rest = statistics.median(t - e - w for t, e, w in zip(times["batched"], cpp, calls))
    print(f"  of the Python loop: the user's patch function and metric {u * 1e3:.1f} ms (eager calls them as often), "
          f"the driver {rest * 1e3:.1f} ms ({rest / med['batched']:.0%}); the engines at eager's per-FLOP rate would "
          f"leave the batched sweep at {(med['eager'] / fr + u + rest) * 1e3:.1f} ms "
          f"({med['eager'] / (med['eager'] / fr + u + rest):.2f}x) with its FLOP-weighted rho {fr:.2f}")
    per_unit = [statistics.median(u[i][2] for u in units) for i in range(len(units[0]))]
    print("  per unit (entry node, stacked rows, thread ms): "
          + ", ".join(f"({n}, {r}, {t * 1e3:.2f})" for (n, r, _), t in zip(units[0], per_unit)))
    n_units = max(len(units[0]), 1)
    per_fwd = {k: v / len(sites) for k, v in counts["eager"].items()}
    excess = sorted(counts["batched"], key=lambda k: -(counts["batched"][k] - per_fwd.get(k, 0) * n_units))
    print(f"  ATen calls: batched {sum(counts['batched'].values())}, eager {sum(counts['eager'].values())} "
          f"({sum(counts['eager'].values()) / len(sites):.0f} per forward); largest excess over eager's per-forward "
          f"count x {n_units} units (the metric's and patch function's per-site calls are in both):")
    for k in excess[:8]:
        print(f"    {k:34s} batched {counts['batched'][k]:5d}   eager per forward x {n_units}: "
              f"{per_fwd.get(k, 0) * n_units:7.1f}")
    total_us = sum(engine_us.values())
    print(f"  top-level ATen calls inside the batched engines (one profiled sweep; profiled wall time, callees included): "
          f"{sum(engine_ops.values())} calls, {total_us / 1e3:.1f} ms:")
    print("    " + ", ".join(f"{k.removeprefix('aten::')} {engine_ops[k]} / {engine_us[k] / 1e3:.2f} ms"
                          for k, _ in engine_us.most_common(14)))
    for k in arms:
        tot = sum(copies[k].values())
        print(f"  aten::copy_ bytes, {k}: {tot / 1e6:.1f} MB, by caller: "
              + ", ".join(f"{c} {b / 1e6:.2f}" for c, b in copies[k].most_common(6)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for d in args.d:
        profile_case(d, args.batch, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
