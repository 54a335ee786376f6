#!/usr/bin/env python
"""Per-call cost of what a pure step checks before it runs, side by side in one run, on a 12-layer GPT-2
(transformers, a small config: the checks' cost depends on the number of modules and parameters, not on
their sizes).

    python scripts/bench_call_checks.py [--layers 12] [--repeats 2000] [--sweep]

Rows: the whole per-call check (step._check_call), the module-attribute check (_module_state.changed),
the hook check on its fast path (no hook registered anywhere since the last call) and on its slow path
(a hook registered on another model since: every hook dict is listed again), and one step call on the
executor for scale. Medians of interleaved rounds, in microseconds.

--sweep adds the cost of sweep(..., reads=)'s read check (the metric run on copies of the outputs whose
undeclared elements are NaN, +inf, -inf and 0.75, torch_ext.reactive._ReadCheck) on bench_sweep.py's part 4
models (64 residual-stream sites, metric = last-row logit difference): the sweep with the check and with
the metric passed through unchecked, interleaved, and whether their metrics are bit-identical.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import torch_ext
from torch_ext import _module_state


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="also time the sweep read check")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=args.layers, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 128, (2, 16))

    def loss_fn(m, x):
        return m(input_ids=x, labels=x).loss

    t0 = time.perf_counter()
    step = torch_ext.make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn, (ids,))
    build_s = time.perf_counter() - t0
    state = step.init_state(seed=0)
    n_mod = sum(1 for _ in model.modules())
    n_par = sum(1 for _ in model.parameters())
    print(f"GPT-2 {args.layers} layers: {n_mod} modules, {n_par} parameters, "
          f"{len(step._module_snapshot[0]) + len(step._module_snapshot[4])} attributes checked; build {build_s:.1f} s")

    hooks = step._hook_snapshot
    other = torch.nn.Linear(2, 2)

    def slow_path():
        other.register_forward_hook(lambda m, a, o: None).remove()  # moves RemovableHandle.next_id
        hooks.changed()

    rows = {
        "step._check_call (all per-call checks)": lambda: step._check_call(state),
        "module attributes (_module_state.changed)": lambda: _module_state.changed(step._module_snapshot),
        "hooks, fast path (Hooks.changed)": hooks.changed,
        "hooks, slow path (a hook registered elsewhere)": slow_path,
    }
    call_n = max(args.repeats // 100, 5)
    rows["one step call (executor), for scale"] = lambda: step(state, ids)
    med = {k: [] for k in rows}
    for _ in range(args.rounds):
        for k, fn in rows.items():
            med[k].append(per_call_us(fn, call_n if k.startswith("one step") else args.repeats))
    for k in rows:
        print(f"  {k:50s} {statistics.median(med[k]):10.2f} us")
    # An independent measurement of the fast path: the one comparison it makes, timed alone.
    seen = torch.utils.hooks.RemovableHandle.next_id
    base = per_call_us(lambda: torch.utils.hooks.RemovableHandle.next_id == seen, args.repeats)
    print(f"  {'(reference: one next_id comparison in a lambda)':50s} {base:10.2f} us")
    if args.sweep:
        bench_read_check(args.rounds)
    return 0


def bench_read_check(rounds: int) -> None:
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_sweep as bs
    from torch_ext import reactive

    checked = reactive._ReadCheck

    def unchecked(rg, metric, reads):
        return metric

    for V, B in ((500, 1), (4096, 8)):
        model, clean, corrupt = bs.positions_setup(V, B)
        T, L = clean.shape[1], len(model.blocks)
        cache = bs.resid_pre_cache(model, corrupt)
        rg = torch_ext.ReactiveGraph(model, (clean,))
        resid = ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(L - 1)]
        sites, patch = bs.resid_pos_sites(cache, resid, T)
        reads = {"logits": (slice(None), -1, [3, 5])}
        res, times = {}, {}
        for key, impl, kw in (("on", checked, {}), ("off", unchecked, {}), ("on_b", checked, {"batch_sites": 8}),
                              ("off_b", unchecked, {"batch_sites": 8})):
            times[key] = []

            def run(key=key, impl=impl, kw=kw):
                reactive._ReadCheck = impl
                try:
                    res[key] = torch_ext.sweep(rg, sites, patch, bs.metric, progress=False, reads=reads, **kw)
                finally:
                    reactive._ReadCheck = checked
            times[key].append(run)
        fns = {k: v[0] for k, v in times.items()}
        for f in fns.values():
            f()  # builds the batched cones
        med = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                med[k].append(time.perf_counter() - t0)
        m = {k: statistics.median(v) * 1e3 for k, v in med.items()}
        same = all(res["on"].metrics[s] == res["off"].metrics[s] and res["on_b"].metrics[s] == res["off_b"].metrics[s]
                   for s in sites)
        print(f"sweep read check, vocab {V} batch {B}, {len(sites)} sites: one at a time {m['on']:.1f} ms checked vs "
              f"{m['off']:.1f} ms unchecked (x{m['on'] / m['off']:.2f}); batch_sites=8 {m['on_b']:.1f} vs "
              f"{m['off_b']:.1f} ms (x{m['on_b'] / m['off_b']:.2f}); metrics bit-identical: {same}")


if __name__ == "__main__":
    sys.exit(main())
