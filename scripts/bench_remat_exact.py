"""Greedy rematerialization (rematerialize_for_budget) against exact optima on small steps.

Two exact references, both on the same FLOP model (csrc/passes/rematerialize.cpp, estimated_flops):

* enumeration: every subset of the recomputable forward nodes (rematerialize() on a copy, the
  planner's exact peak). Exact over the greedy's own moves and memory model; for the tiniest steps.
* ILP: Checkmate's MILP (Jain et al., MLSys 2020, section 4: R/S/FREE/U variables) in the scheduled
  order, solved by HiGHS (scipy.optimize.milp). Its moves are a superset of the pass's (any
  candidate may be recomputed at any later stage, kept or dropped again), its memory model is the
  liveness sum without arena fragmentation or state (every storage-owning call's bytes, views and
  getitems sharing their base's, updates in place). So it is compared at the greedy's own liveness
  peak: the fewest added FLOPs any such schedule needs to fit where the greedy fit. A self-check
  solves it at each enumerated subset's liveness peak: the optimum may never cost more than that
  subset (a schedule the ILP can express), else the model is wrong and the script says so.

For each budget between the smallest reachable planned peak and the plan without recomputation it
prints the added FLOPs of each (inf: nothing fits).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

import torch_ext

_ITEMSIZE = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1}


def _bytes(t) -> int:
    if t[0] == "tensor":
        return math.prod(t[2]) * _ITEMSIZE[t[1]]
    return sum(_bytes(e) for e in t[1]) if t[0] == "tuple" else 0


def _is_alias(n) -> bool:
    """getitem, and ops whose schema says the result aliases an input (views, detach, t)."""
    if n.target == "getitem":
        return True
    ns, rest = n.target.split("::", 1)
    name, overload = rest.split(".", 1)
    schema = getattr(getattr(getattr(torch.ops, ns), name), overload)._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write


def value_dag(g):
    """The graph's storage-owning calls in order: names, bytes, the owners each reads, the owners the
    output keeps. A view or getitem is its base's storage; a placeholder's storage (state, batch) is
    outside the model; an optimizer update writes in place (0 bytes)."""
    owner, names, size, deps = {}, [], [], []
    for n in g.nodes():
        if n.kind == "placeholder":
            owner[n.name] = None
        elif n.kind == "call":
            reads = {owner[a.name] for a in _refs(n.args) if owner.get(a.name) is not None}
            if _is_alias(n):
                base = _refs(n.args[:1])
                owner[n.name] = owner[base[0].name] if base else None
                continue
            owner[n.name] = len(names)
            names.append(n.name)
            size.append(0 if n.target.endswith("_update.default") else _bytes(n.type))
            deps.append(sorted(reads))
        else:
            kept = {owner[a.name] for a in _refs(n.args) if owner.get(a.name) is not None}
    return names, size, deps, kept


def _refs(args):
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _refs(a)
        elif hasattr(a, "name") and not isinstance(a, str):
            out.append(a)
    return out


def liveness_peak(g) -> int:
    """The most bytes live at once running g in its order (a call's inputs and its result together)."""
    _, size, deps, kept = value_dag(g)
    last = {}
    for k, ds in enumerate(deps):
        for i in ds:
            last[i] = k
    live = peak = 0
    for k in range(len(size)):
        live += size[k]
        peak = max(peak, live)
        for i in set(deps[k]) | {k}:
            if i not in kept and last.get(i, i) == k:
                live -= size[i]
    return peak


def checkmate_ilp(g, recomputable: dict[str, int], budget: int | None, schedule: list | None = None):
    """The fewest added FLOPs over Checkmate's schedules of g's order whose liveness peak fits
    `budget`, recomputing only the nodes in `recomputable` (name -> FLOPs); inf if none fits. With
    budget None: the smallest liveness peak of any such schedule instead."""
    names, m, deps, kept = value_dag(g)
    n = len(names)
    cost = [recomputable.get(x) for x in names]
    users = [[] for _ in range(n)]
    for j, ds in enumerate(deps):
        for i in ds:
            users[i].append(j)
    var, lo, hi, integ, obj = {}, [], [], [], []

    def new(key, lb=0.0, ub=1.0, integer=True, c=0.0):
        var[key] = len(lo)
        lo.append(lb), hi.append(ub), integ.append(integer), obj.append(c)
        return var[key]

    if budget is None:  # the peak, minimized instead of the FLOPs
        new(("B",), 0.0, np.inf, integer=False, c=1.0)
    for t in range(n):
        for k in range(t + 1):
            if k == t:
                new(("R", t, k), 1.0, 1.0)  # stage t computes node t
            elif cost[k] is not None:
                new(("R", t, k), c=float(cost[k]) if budget is not None else 0.0)
            if k < t:  # kept from stage t-1; what the output returns is kept from its stage on
                fixed = 1.0 if k in kept else 0.0
                new(("S", t, k), fixed, 1.0)
    rows, cols, vals, rlo, rhi = [], [], [], [], []

    def add(terms, a, b):
        r = len(rlo)
        for key, v in terms:
            if key in var:
                rows.append(r), cols.append(var[key]), vals.append(v)
            elif key[0] == "R" and key[1] == key[2]:  # never reached: R[t,t] always exists
                raise AssertionError(key)
        rlo.append(a), rhi.append(b)

    for t in range(n):
        for j in range(t + 1):
            if ("R", t, j) not in var:
                continue
            for i in deps[j]:  # inputs present: computed in this stage or kept
                add([(("R", t, j), 1.0), (("R", t, i), -1.0), (("S", t, i), -1.0)], -np.inf, 0.0)
        for i in range(t):
            if t > 0 and ("S", t, i) in var:
                add([(("S", t, i), 1.0), (("R", t - 1, i), -1.0), (("S", t - 1, i), -1.0)], -np.inf, 0.0)
        # U[t,k] = kept bytes + what stage t computed up to k, less what it freed before k.
        prev = [(("S", t, i), float(m[i])) for i in range(t)]
        for k in range(t + 1):
            u = new(("U", t, k), 0.0, float(budget) if budget is not None else np.inf, integer=False)
            if budget is None:
                add([(("U", t, k), 1.0), (("B",), -1.0)], -np.inf, 0.0)
            terms = prev + [(("R", t, k), float(m[k]))]
            add([(("U", t, k), 1.0)] + [(key, -v) for key, v in terms], 0.0, 0.0)
            prev = [(("U", t, k), 1.0)]
            if ("R", t, k) not in var:
                continue
            for i in sorted(set(deps[k]) | {k}):
                if i in kept:
                    continue
                later = [j for j in users[i] if k < j <= t]
                f = new(("F", t, i, k))
                # hazards: k not computed, i kept into stage t+1, a later reader in this stage
                hz = [(("R", t, k), -1.0)] + ([(("S", t + 1, i), 1.0)] if t + 1 < n else []) + \
                     [(("R", t, j), 1.0) for j in later]
                maxh = 1 + (1 if t + 1 < n else 0) + len(later)
                # 1 - F <= hazards <= maxh (1 - F), with hazards = 1 - R[t,k] + ...
                add(hz + [(("F", t, i, k), 1.0)], 0.0, np.inf)
                add(hz + [(("F", t, i, k), float(maxh))], -np.inf, float(maxh) - 1.0)
                prev.append((("F", t, i, k), -float(m[i])))
    a = coo_matrix((vals, (rows, cols)), shape=(len(rlo), len(lo))).tocsr()
    res = milp(np.array(obj), constraints=LinearConstraint(a, rlo, rhi), integrality=np.array(integ, dtype=int),
               bounds=Bounds(np.array(lo), np.array(hi)), options={"time_limit": 120})
    if res.status == 2 or res.x is None:  # infeasible
        return math.inf
    assert res.status == 0, res.message
    if schedule is not None:  # (stage, node) of each recomputation
        schedule += [(names[key[1]], names[key[2]]) for key, i in var.items()
                     if key[0] == "R" and key[1] != key[2] and res.x[i] > 0.5]
    return round(res.fun)


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


# 2^14 subsets, each planned: a few minutes. The ILP grows as (call nodes)^2 x inputs: on a 6-block
# MLP step (~100 calls) the run had not finished after 10 minutes here, so both stay on small steps.
ENUMERATE_MAX = 14


def steps():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    yield "mlp relu/gelu", mlp, lambda m, x, y: F.mse_loss(m(x), y), (torch.randn(512, 64), torch.randn(512, 8))
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    yield "cnn 2 blocks", cnn, lambda m, x, y: F.cross_entropy(m(x), y), (torch.randn(16, 3, 16, 16),
                                                                         torch.randint(0, 10, (16,)))


def main():
    bad = 0
    for name, model, loss_fn, batch in steps():
        step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), loss_fn,
                                         batch)
        base = step.graph.clone()
        base.schedule()
        cands = candidates(base)
        if len(cands) > ENUMERATE_MAX:
            cands = cands[:ENUMERATE_MAX]
        f0, p0 = flops_of(base), peak_of(base)
        table = []  # (planned peak, added flops, liveness peak) of every subset
        for k in range(len(cands) + 1):
            for sub in itertools.combinations(cands, k):
                g = base.clone()
                if sub:
                    g.rematerialize(sub)
                table.append((peak_of(g), flops_of(g) - f0, liveness_peak(g)))
        # Each candidate's recomputation cost: what its clone adds when the candidates that read it
        # (transitively) are recomputed too, so that the clone has a reader, against without it.
        def remat_flops(names):
            g = base.clone()
            if names:
                g.rematerialize(sorted(names))
            return flops_of(g)

        names, _, deps, _ = value_dag(base)
        readers = {c: {names[j] for j, ds in enumerate(deps) if names.index(c) in ds} & set(cands) for c in cands}
        cost = {}
        for c in cands:
            above, todo = set(), [c]
            while todo:
                for r in readers[todo.pop()] - above:
                    above.add(r)
                    todo.append(r)
            cost[c] = remat_flops(above | {c}) - remat_flops(above)
        # Self-check: at each subset's liveness peak the ILP costs at most that subset.
        by_peak = {}
        for _, f, lp in table:
            by_peak[lp] = min(f, by_peak.get(lp, math.inf))
        for lp, f in sorted(by_peak.items()):
            opt = checkmate_ilp(base, cost, lp)
            if opt > f:
                bad += 1
                print(f"MODEL ERROR: a subset fits liveness {lp} B at +{f} FLOPs, the ILP says {opt}")
        lo = min(p for p, _, _ in table)
        l0, llo = liveness_peak(base), min(lp for _, _, lp in table)
        print(f"\n== {name}: {len(cands)} recomputable forward nodes, {len(table)} subsets; planned peak without "
              f"recomputation {p0} B (liveness {l0} B), smallest reachable {lo} B (liveness {llo} B); "
              f"ILP self-check on {len(by_peak)} liveness peaks")
        print(f"{'budget B':>10} {'exact +FLOPs':>13} {'greedy +FLOPs':>14} {'greedy peak':>12} {'ratio':>6} "
              f"{'greedy live':>12} {'ILP +FLOPs':>11} {'greedy/ILP':>10}")
        for frac in (1.0, 0.75, 0.5, 0.25, 0.0):
            budget = int(lo + frac * (p0 - 1 - lo))
            exact = min((f for p, f, _ in table if p <= budget), default=math.inf)
            g = base.clone()
            r = g.rematerialize_for_budget(budget)
            greedy = r["added_flops"] if r["feasible"] else math.inf
            ratio = greedy / exact if exact not in (0, math.inf) and greedy != math.inf else float("nan")
            live = liveness_peak(g)  # the greedy's graph (with min_peak's set when infeasible)
            ilp = checkmate_ilp(base, cost, live)
            added = r["added_flops"]
            vs = added / ilp if ilp not in (0, math.inf) else float("nan")
            print(f"{budget:10d} {exact:13} {greedy:14} {r['peak'] if r['feasible'] else r['min_peak']:12} "
                  f"{ratio:6.2f} {live:12} {ilp:11} {vs:10.2f}")
        a = checkmate_ilp(base, cost, None)  # the smallest liveness peak the ILP reaches at all
        print(f"smallest liveness peak: ILP {a} B, subsets of the pass {llo} B")
    print(f"\nILP model errors: {bad}")


if __name__ == "__main__":
    main()
