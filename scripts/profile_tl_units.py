#!/usr/bin/env python
"""The batched TransformerLens-style sweep's units replayed one by one, against what their arithmetic and
their attention cost (issue 10: d_model 128, batch 8, target >= 6x the eager-hook sweep).

    python scripts/profile_tl_units.py [--d 128] [--batch 8] [--repeats 20]

bench_sweep.py part 2's model and sites (tl_setup, resid_pos_sites, opaque metric), sweep(batch_sites=True).
Each batched unit's evaluate_patched_rows call is captured with its stacked input and replayed alone:
thread CPU time, best of 5 rounds of ``--repeats`` calls (the same inputs every time: no driver, no
callbacks, so an engine change can be compared unit by unit on a loaded machine). Beside each unit:

- its causal SDPA calls (shapes from one profiled replay) timed as plain calls on the model's q/k/v
  layout: the attention a unit cannot shed (the row path runs whole-row SDPA for the full run's bits, so
  each stacked batch element costs a whole (batch, head) loop however few of its rows changed);
- its other compute calls (addmm, linear, matmul, layer_norm, gelu, add; same shapes) and its copies
  (copy_, contiguous: row joins, dense inputs) timed alone on fresh dense inputs (hot in cache: a floor);
- the rest: views, row joins and copies, the engine's bookkeeping, ATen dispatch;
- for scale, its FLOPs (engine cost) at the rate of one big addmm of the MLP's shape.

Then the sweep's FLOPs against the least any unit split could do (each site from its own first changed
row, no unit overhead), and the attention's share of the sweep against eager's.

``--ab-chains N``: N interleaved rounds (thread time) of the sweep as planned (chains: copies of several
layers' sites in one unit, each entering at its own layer) against one node per unit (_node_chains giving
single nodes: no copy runs a layer it entered at on rows that did not change, more units), same bits.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import torch_ext  # noqa: E402
import torch_ext.reactive as reactive  # noqa: E402

from _bench_util import best_thread_seconds as _best, resid_pre_cache  # noqa: E402
from bench_sweep import metric, resid_pos_sites, tl_setup  # noqa: E402


class _Capture:
    """A batched engine whose evaluate_patched_rows calls are recorded (engine, node, input, reads)."""

    def __init__(self, engine, log: list):
        self._e, self._log = engine, log

    def __getattr__(self, name):
        return getattr(self._e, name)

    def evaluate_patched_rows(self, node, value, *rest):
        self._log.append((self._e, node, value.clone(), rest))
        return self._e.evaluate_patched_rows(node, value, *rest)


def _top_calls(engine, node, value, rest) -> list:
    """(op name, input shapes) of the ATen calls the engine makes itself in one evaluation (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.evaluate_patched_rows(node, value, *rest)
    return [(e.name, e.input_shapes) for e in prof.events() if e.cpu_parent is None]


def _kernel_time(name: str, shapes: list, n: int) -> float | None:
    """Thread time of one compute op of the row path on fresh dense inputs of the profiled shapes (None for
    views, copies and joins: what is left of a unit after these is its bookkeeping)."""
    op = name.removeprefix("aten::")
    if op == "addmm":
        bias, x, w = (torch.randn(*s) for s in shapes[:3])
        return _best(lambda: torch.addmm(bias, x, w), n)
    if op == "layer_norm":
        x, w = torch.randn(*shapes[0]), torch.randn(*shapes[2])
        return _best(lambda: F.layer_norm(x, w.shape, w, w), n)
    if op == "gelu":
        x = torch.randn(*shapes[0])
        return _best(lambda: F.gelu(x), n)
    if op == "add" and shapes[0] == shapes[1]:
        a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
        return _best(lambda: a + b, n)
    if op in ("matmul", "linear"):
        x, w = torch.randn(*shapes[0]), torch.randn(*shapes[1])
        if op == "linear":
            b = torch.randn(*shapes[2]) if len(shapes) > 2 and shapes[2] else None
            return _best(lambda: F.linear(x, w, b), n)
        return _best(lambda: x @ w, n)
    if op == "copy_" and shapes[0] == shapes[1]:  # a row join or a dense copy: the bytes, densely
        dst, src = torch.empty(*shapes[0]), torch.randn(*shapes[1])
        return _best(lambda: dst.copy_(src), n)
    if op == "contiguous":
        x = torch.randn(*shapes[0])
        return _best(lambda: x.clone(), n)
    return None


def _sdpa_time(shape, n: int) -> float:
    b, h, t, d = shape
    qkv = torch.randn(b, t, 3 * h * d)
    q, k, v = (z.reshape(b, t, h, d).transpose(1, 2) for z in qkv.split(h * d, dim=-1))
    return _best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--ab-chains", type=int, default=0, metavar="N")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, clean, corrupt = tl_setup(d=args.d, B=args.batch)
    T, L = clean.shape[1], len(model.blocks)
    cache = resid_pre_cache(model, corrupt)
    rg = torch_ext.ReactiveGraph(model, (clean,))
    resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
    sites, patch = resid_pos_sites(cache, resid, T)
    eng = rg._engine
    log: list = []
    with torch.no_grad():
        torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)  # builds the batched cones
        sweep_s = _best(lambda: torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True), 3)
        for bc in rg._batched.values():
            if bc.engine is not None:
                bc.engine = _Capture(bc.engine, log)
        result = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)
        # The rate of the arithmetic: one addmm of the MLP's first linear on the largest unit's rows.
        d = args.d
        x, w, b = torch.randn(7 * args.batch * (T - 3), d), torch.randn(4 * d, d), torch.randn(4 * d)
        rate = 2 * x.shape[0] * d * 4 * d / _best(lambda: torch.addmm(b, x, w.t()), args.repeats)
        print(f"[TinyTransformer L={L} d_model={d} batch={args.batch}] {len(sites)} sites, {result.groups} units; "
              f"sweep thread time (best of 5 x 3) {sweep_s * 1e3:.1f} ms; addmm rate {rate / 1e9:.1f} GFLOP/s")
        print("  unit (entry node, stacked batch elements): replay ms | its SDPA calls (batch elements) ms | its other compute "
              "calls and copies alone ms (count) | the rest ms (replay - both) | its FLOPs at the addmm rate ms | ATen calls")
        tot = {"replay": 0.0, "sdpa": 0.0, "floor": 0.0, "compute": 0.0, "calls": 0}
        for e, node, value, rest in log:
            st0 = e.stats()["cost"]
            e.evaluate_patched_rows(node, value, *rest)
            flops = e.stats()["cost"] - st0
            replay = _best(lambda: e.evaluate_patched_rows(node, value, *rest), args.repeats)
            calls = _top_calls(e, node, value, rest)
            shapes = [tuple(sh[0]) for name, sh in calls if name == "aten::scaled_dot_product_attention"]
            sdpa = sum(_sdpa_time(s, args.repeats) for s in shapes)
            timed = [t for t in (_kernel_time(name, sh, args.repeats) for name, sh in calls
                                 if name != "aten::scaled_dot_product_attention") if t is not None]
            compute = sum(timed)
            floor = flops / rate
            for k, v in (("replay", replay), ("sdpa", sdpa), ("floor", floor), ("compute", compute), ("calls", len(calls))):
                tot[k] += v
            print(f"  ({node}, {value.shape[0]}): {replay * 1e3:.2f} | {sdpa * 1e3:.2f} ({sum(s[0] for s in shapes)}) "
                  f"| {compute * 1e3:.2f} ({len(timed)}) | {(replay - sdpa - compute) * 1e3:.2f} | {floor * 1e3:.2f} "
                  f"| {len(calls)}")
        rest_ms = (tot["replay"] - tot["sdpa"] - tot["compute"]) * 1e3
        print(f"  sum: replay {tot['replay'] * 1e3:.1f} ms = SDPA {tot['sdpa'] * 1e3:.1f} + other compute calls and copies "
              f"{tot['compute'] * 1e3:.1f} + the rest {rest_ms:.1f} ({tot['calls']} ATen calls: "
              f"{rest_ms * 1e3 / max(tot['calls'], 1):.1f} us a call); FLOPs at the addmm rate {tot['floor'] * 1e3:.1f}; "
              f"the sweep less the replays (driver, callbacks, colder caches in the sweep; noisy under load) "
              f"{(sweep_s - tot['replay']) * 1e3:.1f} ms")
        # The least any split could cost: each non-identical site's cone on its own rows [first, T).
        ideal = 0.0
        for node, pos in sites:
            v = patch(eng.value(node), (node, pos))
            first = eng.first_changed_row(node, v)
            if first < T:
                ideal += eng.cone_cost(node) * (T - first) / T
        print(f"  FLOPs: the sweep's {result.cost / 1e9:.3f} G, each site from its own first row {ideal / 1e9:.3f} G "
              f"({result.cost / ideal - 1:.1%} over)")
        h = model.blocks[0].attn.n_heads
        eager_sdpa = len(sites) * L * _sdpa_time((args.batch, h, T, d // h), args.repeats)
        print(f"  attention: eager's SDPA calls {eager_sdpa * 1e3:.1f} ms a sweep ({len(sites) * L * args.batch} batch "
              f"elements), the batched sweep's {tot['sdpa'] * 1e3:.1f} ms: a ratio of {eager_sdpa / tot['sdpa']:.2f}")
        if args.ab_chains:
            _ab_chains(rg, sites, patch, args.ab_chains)
    return 0


def _ab_chains(rg, sites, patch, rounds: int) -> None:
    chains = reactive._node_chains
    arms = {"chains": chains, "one node per unit": lambda rg_, nodes: [[n] for n in nodes]}
    results, times = {}, {k: [] for k in arms}

    def run():
        return torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)

    for bc in rg._batched.values():  # the captured engines back (no copies of the inputs per unit)
        if isinstance(bc.engine, _Capture):
            bc.engine = bc.engine._e
    try:
        for k, fn in arms.items():
            reactive._node_chains = fn
            run()  # builds its cones; the replays above ran outside the sweep's ledger
            results[k] = run()
        assert results["chains"].metrics == results["one node per unit"].metrics
        for _ in range(rounds):
            for k, fn in arms.items():
                reactive._node_chains = fn
                t0 = time.thread_time()
                run()
                times[k].append(time.thread_time() - t0)
    finally:
        reactive._node_chains = chains
    print(f"  interleaved, {rounds} rounds: " + "; ".join(
        f"{k}: {results[k].groups} units, {results[k].cost / 1e9:.3f} GFLOP, median {statistics.median(t) * 1e3:.1f} ms"
        for k, t in times.items()))


if __name__ == "__main__":
    sys.exit(main())
