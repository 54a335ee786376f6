"""Greedy rematerialization (rematerialize_for_budget) against the exact optimum on small steps.

The exact optimum is found by enumerating every subset of the recomputable forward nodes
(rematerialize() on a copy, the planner's exact peak, the same FLOP model), so it is exact over
the same moves and cost model as the greedy search, not an ILP over a relaxed memory model. For
each budget between the smallest reachable peak and the plan without recomputation it prints the
added FLOPs of both (inf: no set fits).
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext


def flops_of(g) -> int:
    # rematerialize_for_budget with a budget it already meets changes nothing and reports the
    # graph's estimated FLOPs (csrc/passes/rematerialize.cpp, estimated_flops).
    return g.clone().rematerialize_for_budget(2 ** 62)["forward_flops"]


def peak_of(g) -> int:
    return g.plan_memory()["peak_bytes"]


def candidates(g) -> list[str]:
    out = []
    for n in g.nodes():
        if n.kind != "call" or n.target in ("getitem",):
            continue
        try:
            g.clone().rematerialize([n.name])
            out.append(n.name)
        except RuntimeError:
            pass
    return out


def steps():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    yield "mlp relu/gelu", mlp, lambda m, x, y: F.mse_loss(m(x), y), (torch.randn(512, 64), torch.randn(512, 8))
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    yield "cnn 2 blocks", cnn, lambda m, x, y: F.cross_entropy(m(x), y), (torch.randn(16, 3, 16, 16),
                                                                         torch.randint(0, 10, (16,)))


def main():
    for name, model, loss_fn, batch in steps():
        step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), loss_fn,
                                         batch)
        base = step.graph.clone()
        base.schedule()
        cands = candidates(base)
        if len(cands) > 14:
            cands = cands[:14]
        f0, p0 = flops_of(base), peak_of(base)
        table = []  # (peak, added flops) of every subset
        for k in range(len(cands) + 1):
            for sub in itertools.combinations(cands, k):
                g = base.clone()
                if sub:
                    g.rematerialize(sub)
                table.append((peak_of(g), flops_of(g) - f0))
        lo = min(p for p, _ in table)
        print(f"\n== {name}: {len(cands)} recomputable forward nodes, {len(table)} subsets; peak without "
              f"recomputation {p0} B, smallest reachable {lo} B")
        print(f"{'budget B':>10} {'exact +FLOPs':>13} {'greedy +FLOPs':>14} {'greedy peak':>12}  ratio")
        for frac in (1.0, 0.75, 0.5, 0.25, 0.0):
            budget = int(lo + frac * (p0 - 1 - lo))
            exact = min((f for p, f in table if p <= budget), default=math.inf)
            g = base.clone()
            r = g.rematerialize_for_budget(budget)
            greedy = r["added_flops"] if r["feasible"] else math.inf
            ratio = greedy / exact if exact not in (0, math.inf) and greedy != math.inf else float("nan")
            print(f"{budget:10d} {exact:13} {greedy:14} {r['peak'] if r['feasible'] else r['min_peak']:12}  {ratio:.2f}")


if __name__ == "__main__":
    main()
