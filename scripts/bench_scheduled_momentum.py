#!/usr/bin/env python
"""Per-call cost of a scheduled momentum, side by side in one run: the same model and optimizer under
OneCycleLR with cycle_momentum=False (the momentum / beta1 a constant of each update op) and with
cycle_momentum=True (an input of the program, fed per call from the scheduler's replay, read by the
"scheduled" overload of the update ops).

    python scripts/bench_scheduled_momentum.py [--layers 12] [--width 256] [--calls 200] [--rounds 7]

Rows per optimizer: one step call on the executor (the checks, the replay's lookups and the program),
the program alone (executor.run on fixed inputs), and the per-call checks alone (step._check_call).
Medians of interleaved rounds (which of the two goes first alternates), in microseconds, and the ratio
cycled / constant.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def build(make_opt, cycle: bool, layers: int, width: int, batch):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())], nn.Linear(width, 4))
    opt = make_opt(model.parameters())
    # total_steps far beyond the calls timed: the schedule never runs out.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10**6, cycle_momentum=cycle)
    step = torch_ext.make_train_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), batch, scheduler=sched)
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, args.width, generator=g), torch.randint(0, 4, (32,), generator=g))
    optimizers = {"SGD nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
                  "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}
    print(f"MLP {args.layers} x {args.width}, batch 32, 1 thread; medians of {args.rounds} interleaved rounds "
          f"of {args.calls} calls (us per call)")
    print(f"{'optimizer':<14}{'row':<14}{'constant':>10}{'cycled':>10}{'ratio':>8}")
    for name, make_opt in optimizers.items():
        steps = {cycle: build(make_opt, cycle, args.layers, args.width, batch) for cycle in (False, True)}
        assert any(n.startswith("opt:") and ":lr:" not in n and n.endswith("group0") for n, _ in steps[True]._inputs)
        states = {c: s.init_state() for c, s in steps.items()}
        times: dict[tuple, list] = {}

        def call(c):
            _, states[c] = steps[c](states[c], *batch)

        for r in range(args.rounds):
            for c in ((False, True) if r % 2 == 0 else (True, False)):
                times.setdefault(("step call", c), []).append(per_call_us(lambda: call(c), args.calls))
                st = states[c]
                inputs = steps[c].flat_inputs(st, *batch)
                times.setdefault(("program", c), []).append(
                    per_call_us(lambda: steps[c]._executor.run(inputs), args.calls))
                times.setdefault(("checks", c), []).append(per_call_us(lambda: steps[c]._check_call(st), args.calls))
        for row in ("step call", "program", "checks"):
            a, b = statistics.median(times[(row, False)]), statistics.median(times[(row, True)])
            print(f"{name:<14}{row:<14}{a:>10.1f}{b:>10.1f}{b / a:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
