"""Batches of reactive mutations (csrc/reactive/engine.h, "Mutations").

Inside a batch, mutations are recorded and their invalidation runs once, at the end of the batch or
at the first read inside it. What a batch leaves must be exactly what applying its mutations one by
one leaves: the same invalid nodes, pins and graph, the same demand cost, the same bits, and after
restore() the same again. The batched engine is never read inside the batch here, except by the
drawn "read" steps, so the deferred path really runs with several mutations pending.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_ext
from torch_ext import _C
from torch_ext.ir import Graph

from test_reactive import BLOCKS, Structure, bits_equal, random_dags

pytestmark = pytest.mark.internals  # drives _C.Engine directly, to hold a batch open across reads


def _state(eng, countable):
    return eng.num_dirty(), sorted(eng.pinned()), {v: eng.is_valid(v) for v in countable}, str(eng)


def _demand(eng):
    before = eng.stats()["evaluations"]
    out = eng.demand()
    eng.check_invariants()
    return eng.stats()["evaluations"] - before, out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=random_dags(), data=st.data(), seed=st.integers(0, 2**31 - 1), cutoff=st.booleans())
def test_a_batch_leaves_the_state_of_its_mutations_applied_one_by_one(text, data, seed, cutoff):
    gen = torch.Generator().manual_seed(seed)
    g = Graph.parse(text)
    inputs = [torch.rand(4, generator=gen) * 2 - 1 for n in g.nodes() if n.kind == "placeholder"]
    batched, single = _C.Engine(g._g), _C.Engine(g._g)
    for eng in (batched, single):
        eng.set_cutoff(cutoff)
        eng.run(inputs)
    # Patches standing before the batch, sometimes: grafts under a patch retire baselines.
    s = Structure(Graph(single.graph()).nodes())
    for node in data.draw(st.lists(st.sampled_from(s.countable), max_size=2), label="standing patches"):
        value = torch.rand(4, generator=gen)
        batched.patch(node, value)
        single.patch(node, value)
    if data.draw(st.booleans(), label="demand first"):
        batched.demand()
        single.demand()
    batched.begin_batch()
    pending = 0
    for _ in range(data.draw(st.integers(1, 6), label="mutations")):
        s = Structure(Graph(single.graph()).nodes())
        ops = ["patch", "patch", "graft", "graft", "read"] + (["restore_node", "restore"] if single.pinned() else [])
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "patch":
            node = data.draw(st.sampled_from(s.countable + ["x"]), label="patch node")
            value = torch.rand(4, generator=gen)
            batched.patch(node, value)
            single.patch(node, value)
            pending += 1
        elif op == "graft":
            src = data.draw(st.sampled_from([v for v in s.order if s.children[v] or v in s.outputs]), label="src")
            calls = list(s.children[src])
            dst = data.draw(st.sampled_from(calls + [""]), label="dst") if calls else ""
            block = Graph.parse(BLOCKS[data.draw(st.sampled_from(sorted(BLOCKS)), label="block")][0])
            assert batched.graft(src, dst, block._g, []) == single.graft(src, dst, block._g, [])
            pending += 1
        elif op == "restore_node":
            pins = sorted(single.pinned())
            node = data.draw(st.sampled_from(pins), label="restore node")
            batched.restore_node(node)
            single.restore_node(node)
            pending = 1 if len(pins) == 1 else pending + 1  # the last pin's is a restore(), which settles first
        elif op == "restore":
            batched.restore()
            single.restore()
            pending = 1
        else:  # a read settles the batch and sees the one-by-one state
            assert _state(batched, s.countable) == _state(single, s.countable)
            pending = 0
        assert batched.num_pending() == pending
        assert single.num_pending() == 0
    batched.end_batch()
    assert batched.num_pending() == 0
    countable = Structure(Graph(single.graph()).nodes()).countable
    assert _state(batched, countable) == _state(single, countable)
    batched.check_invariants()
    cost_b, out_b = _demand(batched)
    cost_s, out_s = _demand(single)
    assert cost_b == cost_s and bits_equal(out_b, out_s)
    batched.restore()
    single.restore()
    assert _state(batched, countable) == _state(single, countable)
    cost_b, out_b = _demand(batched)
    cost_s, out_s = _demand(single)
    assert cost_b == cost_s and bits_equal(out_b, out_s)


def test_graph_is_never_stale():
    """ReactiveGraph.graph is the graph the engine runs: after a graft, in a batch or not, it holds the
    block and the rerouted edges; it is copied again only after a structural change."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)).eval()
    x = torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(model, (x,))
    before = rg.graph
    assert rg.graph is before  # nothing changed: the same copy
    tanh = next(n for n in rg.nodes() if "tanh" in n)
    with rg.batch():
        first = rg.graft(tanh, lambda t: t * 2)
        assert rg._engine.num_pending() == 1
        inside = rg.graph
        assert inside is not before and set(first) <= {n.name for n in inside.nodes()}
        second = rg.graft(first[-1], lambda t: t + 1)
    after = rg.graph
    assert after is not inside and str(after) == str(rg._engine)
    inputs = {n.name: [a.name for a in n.args if isinstance(a, _C.NodeRef)] for n in after.nodes()}
    assert inputs[second[0]] == [first[-1]]
    assert [name for name, ins in inputs.items() if tanh in ins] == [first[0]]  # every consumer rerouted
    with torch.no_grad():
        expected = model[2](model[1](model[0](x)) * 2 + 1)
    assert torch.allclose(rg.demand(), expected)


def test_cutoff_may_revalidate_a_node_whose_baseline_a_graft_retired():
    """Found by the random-mutation property test: under a same-value patch, a graft retires the
    baselines of D(w); early cutoff then revalidates %s1 without recomputing it (so without an overlay
    entry), and restore() must still recompute it from the grafted graph."""
    text = ("graph:\n  %x : f32[4] = input()\n  %y : f32[4] = input()\n  %v0 : f32[4] = aten::sin.default(%x)\n"
            "  %v1 : f32[4] = aten::sin.default(%x)\n  %v2 : f32[4] = aten::sin.default(%x)\n"
            "  %s0 : f32[4] = aten::add.Tensor(%v0, %v1)\n  %s1 : f32[4] = aten::add.Tensor(%s0, %v2)\n"
            "  return (%s1)\n")
    eng = _C.Engine(Graph.parse(text)._g)
    eng.set_cutoff(True)
    x, y = torch.rand(4), torch.rand(4)
    eng.run([x, y])
    eng.patch("v0", eng.value("v0").clone())
    eng.begin_batch()
    eng.graft("x", "v0", Graph.parse(BLOCKS["cos1"][0])._g, [])
    eng.end_batch()
    eng.demand()
    eng.check_invariants()
    assert eng.stats()["cutoffs"] == 1  # %s1
    eng.restore()
    eng.check_invariants()
    fresh = _C.Engine(eng.graph())
    fresh.run([x, y])
    assert bits_equal(eng.demand(), fresh.demand())


def test_restore_after_a_batch_that_grafts_then_patches_below_the_graft_recomputes_the_shielded_cone():
    """Regression: in one batch, a graft at y -> v1 and then a patch at v3 (below the graft); demand,
    restore, demand. Settling the batch invalidated the graft's cone only down to the pinned v3, so
    v3's users stayed valid and were not marked structural: restore() put back their pre-graft
    baselines and early cutoff kept them. The output was the pre-graft value: a silent wrong answer,
    and a different cost from the same mutations applied one by one."""
    text = ("graph:\n  %x : f32[4] = input()\n  %y : f32[4] = input()\n  %v1 : f32[4] = aten::sin.default(%y)\n"
            "  %v2 : f32[4] = aten::sin.default(%v1)\n  %v3 : f32[4] = aten::sin.default(%v2)\n"
            "  %v0 : f32[4] = aten::sin.default(%x)\n  %s0 : f32[4] = aten::add.Tensor(%v0, %v3)\n"
            "  %s1 : f32[4] = aten::sin.default(%s0)\n  return (%s1)\n")
    block = "graph:\n  %a : f32[4] = input()\n  %b1 : f32[4] = aten::cos.default(%a)\n  return (%b1)\n"
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.rand(4, generator=gen) * 2 - 1 for _ in range(2)]
    patch = torch.rand(4, generator=gen)
    truth = _C.Engine(Graph.parse(text)._g)
    truth.run(inputs)
    truth.graft("y", "v1", Graph.parse(block)._g, [])
    want = truth.demand()
    for cutoff in (False, True):
        batched, single = _C.Engine(Graph.parse(text)._g), _C.Engine(Graph.parse(text)._g)
        for eng in (batched, single):
            eng.set_cutoff(cutoff)
            eng.run(inputs)
        batched.begin_batch()
        for eng in (batched, single):
            eng.graft("y", "v1", Graph.parse(block)._g, [])
            eng.patch("v3", patch)
        batched.end_batch()
        # stats.invalidated (csrc/reactive/engine.h): one by one, the graft marks its block %b1 and
        # D(v1) = {v1, v2, v3, s0, s1}, and the patch finds s0, s1 already invalid: 6. The batch
        # settles with %v3 pinned: b1, v1, v2, then the patch's s0, s1: 5 (v3 never invalid).
        assert (batched.stats()["invalidated"], single.stats()["invalidated"]) == (5, 6)
        for eng in (batched, single):
            eng.demand()
            eng.restore()
        cost_b, out_b = _demand(batched)
        cost_s, out_s = _demand(single)
        assert bits_equal(out_b, want) and bits_equal(out_s, want), cutoff
        assert cost_b == cost_s, (cutoff, cost_b, cost_s)


class _Branchy(torch.nn.Module):
    """Elementwise ops with fan-out and joins, so cones of patches and grafts overlap."""

    def forward(self, x):
        a = torch.tanh(x)
        b = a * 2
        c = torch.sin(a)
        d = b * c
        e = torch.relu(d) + a
        f = torch.cos(c)
        return torch.exp(e) - f


def _cone(graph, seeds) -> set:
    """Strict descendants of `seeds` in `graph`, from its edges (independent of the engine's cones)."""
    users: dict = {}
    for n in graph.nodes():
        for a in n.args:
            if isinstance(a, _C.NodeRef):
                users.setdefault(a.name, []).append(n.name)
    seen, work = set(), list(seeds)
    while work:
        for u in users.get(work.pop(), ()):
            if u not in seen:
                seen.add(u)
                work.append(u)
    return seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_a_batch_of_grafts_and_patches_costs_the_batch_formula(data, seed):
    """cost-model.md, batch mode: from a clean graph with no standing patch, one demand after a batch of
    grafts (blocks B_k) and patches by value (nodes S, standing at the demand) costs |(U_k D(B_k) U U_p V+(s_p)) minus S|,
    cones taken in the graph after the batch; with no patch, |U D0(w_k)| + sum h_k."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=gen)
    rg = torch_ext.ReactiveGraph(_Branchy(), (x,))
    blocks, patched = [], []
    with rg.batch():
        for _ in range(data.draw(st.integers(1, 6), label="mutations")):
            graph = rg.graph  # the graph as the batch left it so far
            calls = [n for n in graph.nodes() if n.kind == "call"]
            op = data.draw(st.sampled_from(["edge graft", "node graft", "patch"]), label="op")
            if op == "patch":
                node = data.draw(st.sampled_from([n.name for n in calls]), label="patched")
                rg.patch(node, torch.rand(3, 4, generator=gen))  # a patch function would read (and settle) here
                patched.append(node)
                continue
            edges = [(a.name, n.name) for n in calls for a in n.args
                     if isinstance(a, _C.NodeRef) and a.name in {c.name for c in calls}]
            if op == "edge graft" and edges:
                u, w = data.draw(st.sampled_from(edges), label="edge")
                blocks.append(rg.graft(u, w, lambda t: t + 1))
            else:
                u = data.draw(st.sampled_from([n.name for n in calls if n.name in {e[0] for e in edges}]), label="u")
                blocks.append(rg.graft(u, lambda t: t * 3 - 1))
        after = rg.graph
    seeds = {n for names in blocks for n in names}
    invalid = (seeds | _cone(after, seeds) | _cone(after, patched)) - set(patched)
    before = rg.stats["evaluations"]
    rg.demand()
    assert rg.stats["evaluations"] - before == len(invalid)
