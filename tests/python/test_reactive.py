"""Reactive engine (csrc/reactive) and ReactiveGraph / sweep (torch_ext/reactive.py).

Every count is checked at zero tolerance against shared/docs/cost-model.md:
  * countable nodes are call nodes (getitem and grafted nodes included); placeholders and the
    output are never counted;
  * patch(s) costs |V+(s)| at the next demand (V+ = strict descendants); restore() costs 0;
  * an edge graft (u, w) with block of h nodes costs h + |D(w)| in the current graph, which is
    Theorem 3's h + |D0(w)| + sum of earlier blocks inside D0(w); the node form costs h + |V+(u)|;
  * a batch of grafts costs |U D0(w_k)| + sum h_k in any order.
Cones are computed independently here, by BFS over the parsed graph (``Structure``), never with
``Engine.cone``; and every output is compared bit for bit (same bits, NaN payloads included) with
a full recomputation: an FX interpreter over the engine's current graph with the patched values
substituted (``reference``) and, where no patch is active, a fresh ``_C.Engine`` on that graph.

Section 6 keeps the minimal repros of engine bugs fixed since (regression tests; the random-mutation
property tests cover the same patterns).

A test of internals (marked ``internals``): most tests drive ``_C.Engine`` on parsed IR directly, and
the ReactiveGraph ones compare against the engine behind it (``rg._engine``).
"""
from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import torch_ext
from torch_ext import _C
from torch_ext import synthetic
from torch_ext._compat import export_joint
from torch_ext.ir import Graph

pytestmark = pytest.mark.internals

# ---------------------------------------------------------------------------------------------
# text IR builders
# ---------------------------------------------------------------------------------------------
SHAPE = "f32[4]"





def chain_text(n: int, op: str = "aten::sin.default", shape: str = SHAPE) -> str:
    return synthetic.chain_text(n, op, shape)


block_text = synthetic.block_text
e4_weights = synthetic.e4_weights

BLOCKS = {
    # name -> (text, h). Each takes one f32[4] and returns one f32[4]; "fan" reads its input twice.
    "cos1": ("graph:\n  %a : f32[4] = input()\n  %b1 : f32[4] = aten::cos.default(%a)\n  return (%b1)\n", 1),
    "cos2": ("graph:\n  %a : f32[4] = input()\n  %b1 : f32[4] = aten::cos.default(%a)\n"
             "  %b2 : f32[4] = aten::sin.default(%b1)\n  return (%b2)\n", 2),
    "fan": ("graph:\n  %a : f32[4] = input()\n  %b1 : f32[4] = aten::cos.default(%a)\n"
            "  %b2 : f32[4] = aten::tanh.default(%a)\n  %b3 : f32[4] = aten::mul.Tensor(%b1, %b2)\n"
            "  return (%b3)\n", 3),
}




def block_graph(h: int) -> Graph:
    return Graph.parse(block_text(h))




def layered_chain_text(weights: list[int], op: str = "aten::relu.default") -> tuple[str, list[str]]:
    """A single path whose layer j is a run of w_j nodes; returns (text, sites = each layer's last node)."""
    n = sum(weights)
    sites, k = [], 0
    for w in weights:
        k += w
        sites.append(f"n{k}")
    return chain_text(n, op), sites


# ---------------------------------------------------------------------------------------------
# independent structure, cones and references
# ---------------------------------------------------------------------------------------------
class Structure(synthetic.Structure):
    """torch_ext.synthetic.Structure, plus our own copy of a graft for the model to follow."""

    def splice(self, src: str, consumers: list[str], block: Graph, names: list[str]) -> None:
        """Our own copy of a graft: block input -> src, block output -> each consumer (or output)."""
        bs = Structure(block.nodes())
        calls = bs.countable
        assert len(calls) == len(names), (calls, names)
        ren = dict(zip(calls, names))
        block_in = [v for v in bs.order if bs.kind[v] == "placeholder"]
        assert len(block_in) == 1
        ren[block_in[0]] = src
        out = ren[bs.outputs[0]]
        for c in calls:
            self.parents[ren[c]] = [ren[p] for p in bs.parents[c]]
            self.kind[ren[c]] = "call"
            self.order.append(ren[c])
        for c in consumers:
            if c == "output":
                self.outputs = [out if o == src else o for o in self.outputs]
            else:
                self.parents[c] = [out if p == src else p for p in self.parents[c]]
        self._rebuild_children()


def bits_equal(a, b) -> bool:
    """Same dtype, shape and bits (stricter than torch.equal: NaN == NaN, -0 != +0)."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.detach().contiguous().view(ints), b.detach().contiguous().view(ints))
    return torch.equal(a, b)


class _PinnedInterpreter(torch.fx.Interpreter):
    def __init__(self, gm, pins):
        super().__init__(gm)
        self.pins = pins

    def run_node(self, n):
        if n.op == "placeholder":
            v = super().run_node(n)
            return self.pins.get(n.name, v)
        if n.op != "output" and n.name in self.pins:
            return self.pins[n.name]
        return super().run_node(n)


def placeholder_values(eng) -> list:
    g = Graph(eng.graph())
    return [eng.value(n.name) for n in g.nodes() if n.kind == "placeholder"]


def reference(graph: Graph, inputs: list, pins: dict | None = None, nodes: list[str] | None = None):
    """Full recomputation of ``graph`` from its placeholder values, in eager PyTorch (FX interpreter).

    ``pins`` maps node names to substituted values (the patches); ``nodes`` asks for those node
    values instead of the outputs.
    """
    gm = graph.to_graph_module()
    if nodes is not None:
        # Return the requested nodes instead of the graph outputs.
        out = next(n for n in gm.graph.nodes if n.op == "output")
        by_name = {n.name: n for n in gm.graph.nodes}
        out.args = (tuple(by_name[v] for v in nodes),)
        gm.recompile()
    with torch.no_grad():
        return list(_PinnedInterpreter(gm, dict(pins or {})).run(*inputs))


def fresh_engine_outputs(eng, inputs: list | None = None) -> list:
    """A new engine on the engine's current graph, run from scratch: a full recomputation."""
    fresh = _C.Engine(eng.graph())
    fresh.run(inputs if inputs is not None else placeholder_values(eng))
    return fresh.demand()


def demand_cost(eng) -> int:
    before = eng.stats()["evaluations"]
    eng.demand()
    eng.check_invariants()
    return eng.stats()["evaluations"] - before


def new_engine(text: str, inputs: list | None = None, cutoff: bool = False):
    g = Graph.parse(text)
    eng = _C.Engine(g._g)
    eng.set_cutoff(cutoff)
    if inputs is None:
        inputs = [torch.randn(4) for n in g.nodes() if n.kind == "placeholder"]
    eng.run(inputs)
    eng.check_invariants()
    eng.reset_stats()
    return eng, Structure(g.nodes()), inputs


# ---------------------------------------------------------------------------------------------
# 1. patch sweeps: exact counts and closed forms
# ---------------------------------------------------------------------------------------------
def test_chain_patch_sweep_equals_strict_cones():
    n = 240
    eng, s, x = new_engine(chain_text(n))
    assert eng.num_countable() == n
    clean = eng.demand()
    per_site = []
    for k in range(1, n + 1):
        site = f"n{k}"
        eng.patch(site, torch.full((4,), 0.25))
        eng.check_invariants()
        assert eng.num_dirty() == len(s.cone(site)) == n - k
        per_site.append(demand_cost(eng))
        if k % 16 == 1 or k == n:
            assert bits_equal(eng.demand(), reference(Graph(eng.graph()), x, {site: torch.full((4,), 0.25)}))
        before = eng.stats()["evaluations"]
        eng.restore()
        eng.check_invariants()
        assert eng.stats()["evaluations"] == before, "restore must cost zero evaluations"
        assert bits_equal(eng.demand(), clean)
        assert eng.stats()["evaluations"] == before
    assert per_site == [n - k for k in range(1, n + 1)]
    total = eng.stats()["evaluations"]
    assert total == sum(len(s.cone(f"n{k}")) for k in range(1, n + 1)) == n * (n - 1) // 2
    assert Fraction(n * n, total) == Fraction(2 * n, n - 1)  # rho = 2L/(L-1), uniform profile, S = 1


@pytest.mark.parametrize("profile", ["output", "input"])
@pytest.mark.parametrize("q", [0, 0.5, 1, 2])
def test_layered_sweep_closed_form(profile, q):
    """E4 at L = 20 with ~4000 nodes: measured = sum (j-1) w_j exactly, and the paper's +1 table."""
    L = 20
    w = e4_weights(L, q, profile)
    text, sites = layered_chain_text(w)
    eng, s, _ = new_engine(text)
    N = eng.num_countable()
    assert N == sum(w)
    for site in sites:
        eng.patch(site, torch.zeros(4))
        eng.demand()
        eng.restore()
    eng.check_invariants()
    measured = eng.stats()["evaluations"]
    closed = sum((j - 1) * wj for j, wj in enumerate(w, start=1))
    assert measured == closed == sum(len(s.cone(v)) for v in sites)
    assert Fraction(L * N, measured) == Fraction(L * N, closed)
    # Paper conventions (site in its own cone, :input counted in N) -> paper-notes 5.1 table, L = 20.
    paper = {("output", 0): 2.1047, ("output", 0.5): 1.7641, ("output", 1): 1.5781, ("output", 2): 1.3921,
             ("input", 0): 2.1047, ("input", 0.5): 2.6083, ("input", 1): 3.1585, ("input", 2): 4.3118}
    assert round(L * (N + 1) / (measured + L), 4) == paper[(profile, q)]


def test_wide_layered_dag_sweep():
    """On a branching layered DAG the cones are not a chain's suffixes; counts follow the closed form."""
    w = [3, 1, 4, 2, 5, 2, 3]
    text, firsts, aggs = synthetic.layered_text(w, "aten::sin.default")
    eng, s, x = new_engine(text)
    N = eng.num_countable()
    assert N == sum(2 * wj - 1 for wj in w)
    suffix = lambda j: sum(2 * wk - 1 for wk in w[j:])  # noqa: E731  (layers after layer j, 1-based j)
    for j, (b1, agg) in enumerate(zip(firsts, aggs), start=1):
        for site, closed in ((b1, (w[j - 1] - 1) + suffix(j)), (agg, suffix(j))):
            assert len(s.cone(site)) == closed
            eng.patch(site, torch.ones(4))
            assert demand_cost(eng) == closed
            assert bits_equal(eng.demand(), reference(Graph(eng.graph()), x, {site: torch.ones(4)}))
            eng.restore()
    assert eng.stats()["evaluations"] == sum(len(s.cone(v)) for v in firsts + aggs)
    # Two simultaneous patches: the union of the cones, never a node twice, and never a pinned node.
    eng.patch(firsts[1], torch.ones(4))
    eng.patch(firsts[4], torch.ones(4))
    assert firsts[4] in s.cone(firsts[1])
    assert demand_cost(eng) == len(s.cone(firsts[1]) - {firsts[4]})
    pins = {firsts[1]: torch.ones(4), firsts[4]: torch.ones(4)}
    assert bits_equal(eng.demand(), reference(Graph(eng.graph()), x, pins))


# ---------------------------------------------------------------------------------------------
# 2. grafts: interleaved (Theorem 3), node form, batch (Proposition 1)
# ---------------------------------------------------------------------------------------------
E7_SITES = [57, 114, 171, 229, 286, 343]
E7_EXPECTED = {
    (1, 2, 3, 4, 5, 6): [363, 306, 249, 191, 134, 77],
    (6, 5, 4, 3, 2, 1): [77, 154, 231, 309, 386, 463],
    (3, 4, 1, 6, 5, 2): [249, 191, 403, 77, 154, 386],
}


@pytest.mark.parametrize("order", list(E7_EXPECTED))
def test_e7_interleaved_and_batched(order):
    x = [torch.randn(4)]
    eng, s0, _ = new_engine(chain_text(400), x)
    measured = []
    for k in order:
        u, w = f"n{E7_SITES[k - 1]}", f"n{E7_SITES[k - 1] + 1}"
        names = eng.graft(u, w, block_graph(20)._g, [])
        assert len(names) == 20
        eng.check_invariants()
        measured.append(demand_cost(eng))
        assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))
    assert measured == E7_EXPECTED[order]
    c_iso = sum(20 + 400 - E7_SITES[k - 1] for k in order)
    assert c_iso == 1320
    assert sum(measured) - c_iso == {(1, 2, 3, 4, 5, 6): 0, (6, 5, 4, 3, 2, 1): 300, (3, 4, 1, 6, 5, 2): 140}[order]
    # Batched: one demand after all six grafts costs 463 whatever the order.
    eng, _, _ = new_engine(chain_text(400), x)
    eng.begin_batch()
    for k in order:
        eng.graft(f"n{E7_SITES[k - 1]}", f"n{E7_SITES[k - 1] + 1}", block_graph(20)._g, [])
        eng.check_invariants()
    eng.end_batch()
    assert demand_cost(eng) == 463 == len(set().union(*(s0.D(f"n{v + 1}") for v in E7_SITES))) + 6 * 20
    assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))


def branching_text() -> str:
    """Two branches A and B joined by %j, then a tail C; %a2 also feeds %j directly (a skip)."""
    lines = ["graph:", "  %x : f32[4] = input()"]
    for br, op in (("a", "aten::sin.default"), ("b", "aten::cos.default")):
        prev = "x"
        for i in range(1, 9):
            lines.append(f"  %{br}{i} : f32[4] = {op}(%{prev})")
            prev = f"{br}{i}"
    lines.append("  %j0 : f32[4] = aten::add.Tensor(%a8, %b8)")
    lines.append("  %j : f32[4] = aten::mul.Tensor(%j0, %a2)")
    prev = "j"
    for i in range(1, 7):
        lines.append(f"  %c{i} : f32[4] = aten::tanh.default(%{prev})")
        prev = f"c{i}"
    lines.append(f"  return (%{prev})")
    return "\n".join(lines) + "\n"


# (u, w, h): distinct sources; a3/a6 comparable, b4 incomparable with both A sites, c2 below all.
GRAFTS = [("a3", "a4", 2), ("a6", "a7", 3), ("b4", "b5", 1), ("c2", "c3", 4)]


def test_interleaved_grafts_every_order_on_a_dag():
    """All 24 orders of 4 grafts: per-graft cost h + |D0(w)| + sum of earlier h_j with u_j in D0(w)."""
    x = [torch.randn(4)]
    _, s0, _ = new_engine(branching_text(), x)
    D0 = {w: s0.D(w) for _, w, _ in GRAFTS}
    c_iso = sum(h + len(D0[w]) for _, w, h in GRAFTS)
    comparable = [(j, k) for j in range(4) for k in range(4) if j != k and GRAFTS[j][0] in D0[GRAFTS[k][1]]]
    delta_max = sum(GRAFTS[j][2] for j, _ in comparable)
    assert delta_max > 0
    deltas = {}
    for perm in itertools.permutations(range(4)):
        eng, _, _ = new_engine(branching_text(), x)
        total, done = 0, []
        for k in perm:
            u, w, h = GRAFTS[k]
            names = eng.graft(u, w, block_graph(h)._g, [])
            assert len(names) == h
            cost = demand_cost(eng)
            assert cost == h + len(D0[w]) + sum(GRAFTS[j][2] for j in done if GRAFTS[j][0] in D0[w])
            assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))
            total += cost
            done.append(k)
        deltas[perm] = total - c_iso
        predicted = sum(GRAFTS[j][2] for a, j in enumerate(perm) for k in perm[a + 1:] if (j, k) in comparable)
        assert deltas[perm] == predicted >= 0
        upstream_first = all((perm.index(j) > perm.index(k)) for j, k in comparable)
        assert (deltas[perm] == 0) == upstream_first
    assert max(deltas.values()) == delta_max
    # A downstream-first order (a linear extension of the reversed ancestry) reaches the maximum.
    assert deltas[(3, 1, 2, 0)] == delta_max
    # Uniformly random order: E[delta] = delta_max / 2, exactly, averaging over all 4! orders.
    assert Fraction(sum(deltas.values()), len(deltas)) == Fraction(delta_max, 2)


def test_edge_graft_reroutes_only_w():
    """u = a2 feeds a3 and j: grafting the edge (a2, j) leaves a3 reading a2, and costs h + |D0(j)|."""
    x = [torch.randn(4)]
    eng, s, _ = new_engine(branching_text(), x)
    names = eng.graft("a2", "j", Graph.parse(BLOCKS["fan"][0])._g, [])
    assert len(names) == 3
    s.splice("a2", ["j"], Graph.parse(BLOCKS["fan"][0]), names)
    after = Structure(Graph(eng.graph()).nodes())
    assert after.edges() == s.edges()
    assert "a2" in after.parents["a3"] and "a2" not in after.parents["j"]
    assert demand_cost(eng) == 3 + 1 + len(Structure(Graph.parse(branching_text()).nodes()).cone("j"))
    assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))


def test_node_form_graft_reroutes_every_consumer():
    x = [torch.randn(4)]
    eng, s0, _ = new_engine(branching_text(), x)
    assert sorted(s0.children["a2"]) == ["a3", "j"]
    names = eng.graft("a2", "", block_graph(2)._g, [])
    after = Structure(Graph(eng.graph()).nodes())
    assert after.children["a2"] == [names[0]]
    assert after.parents["a3"] == [names[1]] and names[1] in after.parents["j"]
    assert eng.num_dirty() == 2 + len(s0.cone("a2"))
    assert demand_cost(eng) == 2 + len(s0.cone("a2"))  # h + |V0+(u)|
    assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))
    # Node form on the graph's output node: only the block is new, the output now reads it.
    names = eng.graft("c6", "", block_graph(3)._g, [])
    assert demand_cost(eng) == 3
    out = eng.demand()
    assert bits_equal(out, fresh_engine_outputs(eng, x))
    assert bits_equal(out[0], eng.value(names[-1]))


def test_batched_grafts_any_order():
    x = [torch.randn(4)]
    _, s0, _ = new_engine(branching_text(), x)
    c_batch = len(set().union(*(s0.D(w) for _, w, _ in GRAFTS))) + sum(h for _, _, h in GRAFTS)
    c_iso = sum(h + len(s0.D(w)) for _, w, h in GRAFTS)
    assert c_batch < c_iso
    outs = []
    for perm in itertools.permutations(range(4)):
        eng, _, _ = new_engine(branching_text(), x)
        eng.begin_batch()
        for k in perm:
            u, w, h = GRAFTS[k]
            eng.graft(u, w, block_graph(h)._g, [])
            eng.check_invariants()
        eng.end_batch()
        assert demand_cost(eng) == c_batch
        outs.append(eng.demand())
        assert bits_equal(outs[-1], fresh_engine_outputs(eng, x))
    assert all(bits_equal(o, outs[0]) for o in outs)  # splicing order does not change the function


# ---------------------------------------------------------------------------------------------
# 3. property tests: random DAGs, random mutation sequences, an independent model
# ---------------------------------------------------------------------------------------------
UNARY = ["aten::sin.default", "aten::cos.default", "aten::tanh.default", "aten::neg.default"]
BINARY = ["aten::add.Tensor", "aten::mul.Tensor", "aten::atan2.default", "aten::maximum.default",
          "aten::sub.Tensor"]
TERNARY = ["aten::addcmul.default", "aten::lerp.Tensor"]


@st.composite
def random_dags(draw, max_nodes: int = 22):
    """Random DAG text: 2 inputs, nodes of fan-in 1-3, every sink summed into the output."""
    n = draw(st.integers(3, max_nodes))
    names = ["x", "y"]
    lines = ["graph:", "  %x : f32[4] = input()", "  %y : f32[4] = input()"]
    used = set()
    for i in range(n):
        arity = draw(st.sampled_from([1, 1, 2, 2, 3]))
        op = draw(st.sampled_from({1: UNARY, 2: BINARY, 3: TERNARY}[arity]))
        # Bias toward recent nodes so that graphs are deep as well as wide.
        args = [draw(st.sampled_from(names[-4:]) if draw(st.booleans()) else st.sampled_from(names))
                for _ in range(arity)]
        used.update(args)
        name = f"v{i}"
        lines.append(f"  %{name} : f32[4] = {op}({', '.join('%' + a for a in args)})")
        names.append(name)
    sinks = [v for v in names[2:] if v not in used]
    acc = sinks[0]
    for i, v in enumerate(sinks[1:]):
        lines.append(f"  %s{i} : f32[4] = aten::add.Tensor(%{acc}, %{v})")
        acc = f"s{i}"
    lines.append(f"  return (%{acc})")
    return "\n".join(lines) + "\n"


class Model:
    """What the engine must do, computed from Structure alone (engine.h contract + cost-model.md).

    ``invalid``: nodes the next demand evaluates. ``sd``: nodes a graft invalidated that have not
    been recomputed since; ``bs``: nodes whose baseline a graft made while a patch was active. At
    restore() both must be recomputed, with their descendants (the baselines a graft displaced).
    """

    def __init__(self, structure: Structure, inputs: dict):
        self.s = structure
        self.inputs = dict(inputs)
        self.pins: dict[str, torch.Tensor] = {}
        self.invalid: set[str] = set()
        self.sd: set[str] = set()
        self.bs: set[str] = set()

    def closure(self, seeds) -> set[str]:
        """Descendants of ``seeds`` reached without passing through a pinned node (pins excluded)."""
        out, work = set(), list(seeds)
        while work:
            for c in self.s.children[work.pop()]:
                if c not in self.pins and c not in out:
                    out.add(c)
                    work.append(c)
        return out

    def patch(self, node, value):
        self.pins[node] = value
        self.invalid.discard(node)
        self.invalid |= self.closure([node])

    def restore(self):
        if not self.pins:
            return
        self.pins.clear()
        stale = self.sd | self.bs
        self.sd, self.bs = set(stale), set()
        self.invalid = stale | self.closure(stale)

    def restore_node(self, node):
        if len(self.pins) == 1:
            return self.restore()
        del self.pins[node]
        if self.s.kind[node] == "call":
            self.invalid.add(node)
        self.invalid |= self.closure([node])

    def graft(self, src, consumers, block, names):
        self.s.splice(src, consumers, block, names)
        self.invalid |= set(names)
        self.sd |= set(names)
        if self.pins:
            self.bs |= set(names)
        for c in consumers:
            if c == "output":
                continue
            if c not in self.pins:
                self.invalid.add(c)
            self.invalid |= self.closure([c])
            d = self.s.D(c)
            self.sd |= d & self.invalid
            if self.pins:
                self.bs |= d

    def evaluated(self, nodes: set[str]):
        self.invalid -= nodes
        if self.pins:
            self.bs |= nodes & self.sd  # recomputed under a patch: still not a baseline
        self.sd -= nodes

    def demand(self) -> set[str]:
        todo = set(self.invalid)
        self.evaluated(todo)
        return todo

    def value(self, node) -> set[str]:
        todo, work, seen = set(), [node], {node}
        while work:
            v = work.pop()
            if v not in self.invalid:
                continue
            todo.add(v)
            for p in self.s.parents[v]:
                if p not in seen:
                    seen.add(p)
                    work.append(p)
        self.evaluated(todo)
        return todo

    def ref_inputs(self, graph: Graph) -> list:
        return [self.inputs[n.name] for n in graph.nodes() if n.kind == "placeholder"]


class Runner:
    """Applies one mutation to the engine and the model, then checks everything."""

    def __init__(self, text: str, cutoff: bool, seed: int):
        gen = torch.Generator().manual_seed(seed)
        g = Graph.parse(text)
        self.inputs = {n.name: torch.rand(4, generator=gen) * 2 - 1 for n in g.nodes() if n.kind == "placeholder"}
        self.eng = _C.Engine(g._g)
        self.eng.set_cutoff(cutoff)
        self.cutoff = cutoff
        self.eng.run([self.inputs[n.name] for n in g.nodes() if n.kind == "placeholder"])
        self.eng.reset_stats()
        self.model = Model(Structure(g.nodes()), self.inputs)
        self.gen = gen
        self.cutoffs_at_reset = 0
        self.check()

    # -- checks
    def counts(self):
        st_ = self.eng.stats()
        return st_["evaluations"], st_["cutoffs"]

    def check(self, invariants: bool = True):
        eng, m = self.eng, self.model
        if invariants:
            eng.check_invariants()
        assert eng.num_dirty() == len(m.invalid)
        assert sorted(eng.pinned()) == sorted(m.pins)
        for v in m.s.countable:
            assert eng.is_valid(v) == (v not in m.invalid), v
        assert eng.num_countable() == len(m.s.countable)

    def check_structure(self):
        assert Structure(Graph(self.eng.graph()).nodes()).edges() == self.model.s.edges()

    def expect_cost(self, before, todo):
        ev, cut = self.counts()
        if self.cutoff:
            assert (ev - before[0]) + (cut - before[1]) == len(todo)
        else:
            assert ev - before[0] == len(todo)
            assert cut == before[1] == 0

    def reference_outputs(self):
        g = Graph(self.eng.graph())
        return reference(g, self.model.ref_inputs(g), self.model.pins)

    # -- steps
    def demand(self):
        before = self.counts()
        out = self.eng.demand()
        self.expect_cost(before, self.model.demand())
        self.check()
        assert bits_equal(out, self.reference_outputs())
        if not self.model.pins:
            assert bits_equal(out, fresh_engine_outputs(self.eng, self.model.ref_inputs(Graph(self.eng.graph()))))

    def value(self, node):
        before = self.counts()
        got = self.eng.value(node)
        self.expect_cost(before, self.model.value(node))
        self.check()
        g = Graph(self.eng.graph())
        assert bits_equal(got, reference(g, self.model.ref_inputs(g), self.model.pins, [node])[0])

    def patch(self, node):
        value = torch.rand(4, generator=self.gen) * 2 - 1
        self.eng.patch(node, value)
        self.model.patch(node, value)
        self.check()

    def restore(self):
        before = self.counts()
        self.eng.restore()
        self.model.restore()
        assert self.counts() == before, "restore() never evaluates"
        self.cutoffs_at_reset = self.counts()[1]
        self.check()

    def rerun(self):
        """run() with the same inputs, no patch active: re-baselines, N evaluations (or cutoffs)."""
        assert not self.model.pins, "rerun() models run() with no patch active (run() under a patch: test_bug_cutoff_run_keeps_patch)"
        before = self.counts()
        g = Graph(self.eng.graph())
        self.eng.run(self.model.ref_inputs(g))
        self.expect_cost(before, set(self.model.s.countable))
        self.model.invalid, self.model.sd, self.model.bs = set(), set(), set()
        self.cutoffs_at_reset = self.counts()[1]
        self.check()

    def restore_node(self, node):
        before = self.counts()
        self.eng.restore_node(node)
        self.model.restore_node(node)
        assert self.counts() == before
        self.check()

    def graft(self, src, dst, block_name):
        text, h = BLOCKS[block_name]
        block = Graph.parse(text)
        consumers = [dst] if dst else list(self.model.s.children[src]) + (["output"] if src in self.model.s.outputs else [])
        names = self.eng.graft(src, dst, block._g, [])
        assert len(names) == h
        self.model.graft(src, consumers, block, names)
        self.check()
        self.check_structure()

    def bad(self, kind, a, b):
        """A refused mutation: raises, and changes neither graph, values, counters nor validity."""
        eng = self.eng
        text_before, stats_before, dirty = str(eng), eng.stats(), eng.num_dirty()
        valid = {v: eng.is_valid(v) for v in self.model.s.countable}
        pins = sorted(eng.pinned())
        with pytest.raises(RuntimeError):
            if kind == "unknown":
                eng.patch("no_such_node", torch.zeros(4))
            elif kind == "shape":
                eng.patch(a, torch.zeros(5))
            elif kind == "dtype":
                eng.patch(a, torch.zeros(4, dtype=torch.float64))
            elif kind == "cycle":  # b is a (non-strict) ancestor of a: a -> b would close a cycle
                eng.graft(a, b, block_graph(1)._g, [])
            elif kind == "edge":  # b does not read a
                eng.graft(a, b, block_graph(1)._g, [])
            elif kind == "restore_unpinned":
                eng.restore_node(a)
        assert str(eng) == text_before and eng.stats() == stats_before and eng.num_dirty() == dirty
        assert {v: eng.is_valid(v) for v in self.model.s.countable} == valid and sorted(eng.pinned()) == pins
        eng.check_invariants()


def _step(data, r: Runner, allow_graft: bool, allow_restore_node: bool, in_batch: bool = False):
    m = r.model
    countable = m.s.countable
    ops = ["patch", "patch", "demand", "value", "restore", "bad", "cone"]
    if m.pins and allow_restore_node:
        ops.append("restore_node")
    if allow_graft:
        ops += ["graft", "graft"]
    if allow_graft and not in_batch:
        ops.append("batch")
    op = data.draw(st.sampled_from(ops), label="op")
    event(f"op: {op}")
    if op == "patch":
        # Mostly call nodes; sometimes an input placeholder.
        node = data.draw(st.sampled_from(countable + ["x"]), label="patch node")
        if in_batch and m.sd - m.bs:
            return  # would force a demand inside the batch (see Runner.patch)
        r.patch(node)
    elif op == "demand":
        if not in_batch:
            r.demand()
    elif op == "value":
        r.value(data.draw(st.sampled_from(countable), label="value node"))
    elif op == "restore":
        r.restore()
    elif op == "restore_node":
        r.restore_node(data.draw(st.sampled_from(sorted(m.pins)), label="restore node"))
    elif op == "cone":
        v = data.draw(st.sampled_from(countable + ["x", "y"]), label="cone node")
        assert set(r.eng.cone(v)) == m.s.cone(v)
    elif op == "graft":
        src = data.draw(st.sampled_from([v for v in m.s.order if m.s.children[v] or v in m.s.outputs]),
                        label="graft src")
        calls = [c for c in m.s.children[src]]
        dst = data.draw(st.sampled_from(calls + [""]), label="graft dst") if calls else ""
        r.graft(src, dst, data.draw(st.sampled_from(sorted(BLOCKS)), label="block"))
    elif op == "batch":
        r.eng.begin_batch()
        for _ in range(data.draw(st.integers(1, 4), label="batch size")):
            _step(data, r, allow_graft, allow_restore_node, in_batch=True)
        r.eng.end_batch()
        r.demand()
    elif op == "bad":
        kind = data.draw(st.sampled_from(["unknown", "shape", "dtype", "cycle", "edge", "restore_unpinned"]),
                         label="bad kind")
        a = data.draw(st.sampled_from(countable), label="bad a")
        if kind == "cycle":
            b = data.draw(st.sampled_from(sorted((m.s.ancestors(a) | {a}) & set(countable))), label="bad b")
        elif kind == "edge":
            others = [v for v in countable if v not in m.s.children[a]]
            if not others:
                return
            b = data.draw(st.sampled_from(others), label="bad b")
        else:
            b = None
            if kind == "restore_unpinned" and a in m.pins:
                return
        r.bad(kind, a, b)


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(text=random_dags(), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_random_mutation_sequences(text, data, seed):
    """Random DAGs x random patch / restore / restore_node / graft / batch / demand / value sequences.

    After every step: check_invariants(), the dirty set and every node's validity equal the model's,
    and the evaluations of each demand equal the model's invalid set, node for node in count; every
    demanded output and value is bit-identical to a full recomputation.
    """
    r = Runner(text, cutoff=False, seed=seed)
    for _ in range(data.draw(st.integers(6, 20), label="steps")):
        _step(data, r, allow_graft=True, allow_restore_node=True)
    r.restore()
    r.demand()


@SETTINGS
@given(text=random_dags(), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_random_mutation_sequences_with_cutoff(text, data, seed):
    """Early cutoff on: evaluations + cutoffs equal the model's invalid set, and outputs stay exact.

    Patches often reuse a node's own clean value here, so that cutoff really stops propagation.
    """
    r = Runner(text, cutoff=True, seed=seed)
    for _ in range(data.draw(st.integers(6, 20), label="steps")):
        if data.draw(st.booleans(), label="same-value patch") and not r.model.pins:
            node = data.draw(st.sampled_from(r.model.s.countable), label="same node")
            before = r.counts()
            clean = r.eng.value(node).clone()
            r.expect_cost(before, r.model.value(node))
            pending = r.eng.num_dirty()  # already stale before this patch (e.g. a graft's cone)
            r.eng.patch(node, clean)
            r.model.patch(node, clean)
            r.check()
            before = r.counts()
            r.demand()
            # Every direct consumer is recomputed; nothing past them is, since their values cannot change
            # (values are compared with Tensor.equal, so a NaN counts as a change), except what was
            # already pending.
            ev = r.counts()[0] - before[0]
            if not torch.isnan(clean).any():
                assert ev <= len(set(r.model.s.children[node]) - {"output"}) + pending
        _step(data, r, allow_graft=True, allow_restore_node=True)
    r.restore()
    r.demand()


def test_ten_thousand_mutations_without_drift():
    """10^4 random patches (sometimes two at once), demands, partial and full restores on one engine."""
    rng = random.Random(7)
    eng, s, _ = new_engine(chain_text(30))
    m = Model(s, {})
    predicted = 0
    zero = torch.zeros(4)
    for i in range(10_000):
        for _ in range(1 if rng.random() < 0.8 else 2):
            site = f"n{rng.randint(1, 30)}"
            eng.patch(site, zero)
            m.patch(site, zero)
            if rng.random() < 0.5:
                eng.demand()
                predicted += len(m.demand())
        if len(m.pins) > 1 and rng.random() < 0.5:
            node = sorted(m.pins)[0]
            eng.restore_node(node)
            m.restore_node(node)
            eng.demand()
            predicted += len(m.demand())
        eng.restore()
        m.restore()
        if i % 1000 == 0:
            eng.check_invariants()
            assert eng.stats()["evaluations"] == predicted
    eng.check_invariants()
    assert eng.stats()["evaluations"] == predicted
    assert eng.num_dirty() == 0 and eng.pinned() == []


# ---------------------------------------------------------------------------------------------
# 4. ReactiveGraph on a real nn.Module (TinyTransformer)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """(exported program, eager model, clean tokens, corrupted tokens) for a 2-layer TinyTransformer."""
    from torch_ext.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(n_layers=2).eval()
    clean = torch.randint(0, model.vocab, (2, model.seq))
    corrupt = clean.clone()
    corrupt[:, 5] = (corrupt[:, 5] + 7) % model.vocab
    corrupt[:, 11] = (corrupt[:, 11] + 3) % model.vocab
    ep = torch.export.export(model, (clean,))
    return ep, model, clean, corrupt


def rg_reference(rg, pins: dict | None = None, nodes=None):
    """Full recomputation of the ReactiveGraph's current graph (grafts included) in eager PyTorch."""
    g = Graph(rg._engine.graph())
    return reference(g, placeholder_values(rg._engine), pins, nodes)


def rg_state(rg):
    eng = rg._engine
    return str(eng), eng.stats(), eng.num_dirty(), sorted(eng.pinned()), [o.clone() for o in eng.demand()]


def test_reactive_graph_patch_restore(tiny):
    ep, model, clean, _ = tiny
    rg = torch_ext.ReactiveGraph(ep)
    out0 = rg.run(clean)
    s = Structure(rg.graph.nodes())
    N = rg.num_nodes
    assert N == len(s.countable) == len(rg.nodes()) and rg.stats["evaluations"] == N
    torch.testing.assert_close(out0, model(clean), atol=1e-6, rtol=1e-6)
    assert bits_equal([out0], rg_reference(rg))
    for v in s.countable:
        assert rg.cone(v) == s.cone(v), v
    rg.reset_stats()

    site = rg.nodes("blocks.0.attn.proj")[0]
    value = torch.randn_like(rg.value(site))
    rg.patch(site, value)
    rg.check_invariants()
    out = rg.demand()
    assert rg.stats["evaluations"] == len(s.cone(site))
    assert bits_equal([out], rg_reference(rg, {site: value}))
    before = rg.stats
    rg.restore()
    rg.check_invariants()
    assert bits_equal(rg.demand(), out0)
    assert rg.stats["evaluations"] == before["evaluations"], "restore and the demand after it cost nothing"

    # Patch with a callable f(clean) -> value.
    site2 = rg.nodes("blocks.1.mlp.2")[0]
    clean2 = rg.baseline(site2).clone()
    rg.patch(site2, lambda c: c * 0.5 + 1.0)
    assert bits_equal(rg.value(site2), clean2 * 0.5 + 1.0)
    e0 = rg.stats["evaluations"]
    out = rg.demand()
    assert rg.stats["evaluations"] - e0 == len(s.cone(site2))
    assert bits_equal([out], rg_reference(rg, {site2: clean2 * 0.5 + 1.0}))

    # Two patches, then restore one of them: D(node) recomputed, stopping at the other pin.
    m = Model(s, {})
    m.pins = {site2: clean2 * 0.5 + 1.0}
    rg.patch(site, value)
    m.patch(site, value)
    e0 = rg.stats["evaluations"]
    rg.demand()
    assert rg.stats["evaluations"] - e0 == len(m.demand())
    rg.restore(site)
    m.restore_node(site)
    rg.check_invariants()
    e0 = rg.stats["evaluations"]
    out = rg.demand()
    # The residual stream bypasses the pinned MLP output, so all of D(site) but the pin is recomputed.
    assert rg.stats["evaluations"] - e0 == len(m.demand()) == len(({site} | s.cone(site)) - {site2})
    assert bits_equal([out], rg_reference(rg, {site2: clean2 * 0.5 + 1.0}))
    rg.restore()
    assert bits_equal(rg.demand(), out0)
    rg.check_invariants()


def test_reactive_graph_nodes_glob(tiny):
    ep, _, clean, _ = tiny
    rg = torch_ext.ReactiveGraph(ep)
    rg.run(clean)
    paths = {n.name: n.module_path for n in rg.graph.nodes() if n.kind == "call"}
    assert rg.nodes() == [n.name for n in rg.graph.nodes() if n.kind == "call"]
    assert rg.nodes("linear_*") == [n for n in paths if n.startswith("linear_")]
    assert rg.nodes("layer_norm") == ["layer_norm"]
    assert rg.nodes("blocks.1.mlp*") == [n for n, p in paths.items() if p.startswith("blocks.1.mlp")] != []
    assert rg.nodes("blocks.0.attn.proj") == ["linear_1"]
    assert rg.nodes("no_such_*") == []
    # Each block's residual adds carry the block's own module path.
    assert rg.nodes("blocks.?") == [n for n, p in paths.items() if p in ("blocks.0", "blocks.1")]
    assert all(paths[n].startswith("blocks.1") for n in rg.nodes("blocks.1*"))


def test_reactive_graph_grafts(tiny):
    ep, _, clean, _ = tiny
    rg = torch_ext.ReactiveGraph(ep)
    rg.run(clean)
    s0 = Structure(rg.graph.nodes())
    assert sorted(s0.children["add_1"]) == ["add_2", "layer_norm_1"]
    # Edge form with an nn.Module: only layer_norm_1 reads the block; add_2 still reads add_1.
    torch.manual_seed(1)
    block = nn.Sequential(nn.Linear(32, 32), nn.GELU())
    rg.reset_stats()
    names = rg.graft("add_1", "layer_norm_1", block)
    assert len(names) == 2 and all(n in rg.nodes() for n in names) and rg.nodes("graft*") == names
    rg.check_invariants()
    out = rg.demand()
    assert rg.stats["evaluations"] == len(names) + len(s0.D("layer_norm_1"))
    assert bits_equal([out], rg_reference(rg))
    assert bits_equal([out], fresh_engine_outputs(rg._engine))
    s1 = Structure(Graph(rg._engine.graph()).nodes())
    assert "add_1" in s1.parents["add_2"] and names[-1] in s1.parents["layer_norm_1"]
    with torch.no_grad():
        h = rg.value("add_1")
        torch.testing.assert_close(rg.value(names[-1]), block(h), atol=1e-6, rtol=1e-6)
    # Node form with a lambda, downstream of the first graft: h + |V+(u)| in the current graph,
    # i.e. Theorem 3 with the earlier block counted only if its site lies in D0(w) (it does not).
    e0 = rg.stats["evaluations"]
    names2 = rg.graft("add_3", lambda t: torch.tanh(t) * 2.0)
    assert len(names2) == 2
    out = rg.demand()
    assert rg.stats["evaluations"] - e0 == len(names2) + len(s0.cone("add_3"))
    assert bits_equal([out], rg_reference(rg))
    # Upstream of both: the earlier blocks now lie in the cone (Theorem 3's cross terms).
    e0 = rg.stats["evaluations"]
    names3 = rg.graft("add", "layer_norm", lambda t: t * 0.5)
    out = rg.demand()
    assert rg.stats["evaluations"] - e0 == len(names3) + len(s0.D("layer_norm")) + len(names) + len(names2)
    assert bits_equal([out], rg_reference(rg))
    assert bits_equal([out], fresh_engine_outputs(rg._engine))
    rg.check_invariants()


def test_reactive_graph_bad_inputs_change_nothing(tiny):
    ep, _, clean, _ = tiny
    rg = torch_ext.ReactiveGraph(ep)
    rg.run(clean)
    site = "linear_1"
    shape = rg.value(site).shape
    for pinned in (False, True):
        if pinned:  # the same refusals with a patch active
            rg.patch("add_3", torch.zeros_like(rg.value("add_3")))
            rg.demand()
        state = rg_state(rg)
        bad = [
            (lambda: rg.patch("no_such_node", torch.zeros(shape)), RuntimeError, "unknown node 'no_such_node'"),
            (lambda: rg.patch(site, torch.zeros(3, 3)), RuntimeError, "expected shape"),
            (lambda: rg.patch(site, torch.zeros(shape, dtype=torch.float64)), RuntimeError, "expected dtype"),
            (lambda: rg.patch(site, lambda c: "not a tensor"), TypeError, "expected a tensor"),
            (lambda: rg.graft("add_2", "add_1", lambda t: t + 1), RuntimeError, "would create a cycle"),
            (lambda: rg.graft("add", "add_2", lambda t: t + 1), RuntimeError, "no edge %add -> %add_2"),
            (lambda: rg.graft("no_such_node", "add_2", lambda t: t + 1), RuntimeError, "unknown node"),
            (lambda: rg.graft("add_1", "layer_norm_1", lambda t: t.sum(-1)), RuntimeError, "differs"),
            (lambda: rg.restore("linear_2"), ValueError, "not patched"),
        ]
        for fn, exc, msg in bad:
            with pytest.raises(exc, match=msg):
                fn()
            after = rg_state(rg)
            assert after[:4] == state[:4], msg
            assert bits_equal(after[4], state[4]), msg
            rg.check_invariants()
        assert rg.nodes() == [n.name for n in Graph(rg._engine.graph()).nodes() if n.kind == "call"]


def _resid_sites(rg, n_layers: int) -> list[str]:
    """The residual stream entering each block, and the final one: the embedding add, then each block's last add."""
    return ["add"] + [rg.nodes(f"blocks.{i}")[-1] for i in range(n_layers)]


def test_sweep_one_at_a_time_vs_batched(tiny, tmp_path):
    ep, model, clean, corrupt = tiny
    rg = torch_ext.ReactiveGraph(model, (clean,))
    resid = _resid_sites(rg, 2)
    assert resid == ["add", "add_2", "add_4"]
    rg.run(corrupt)
    cache = {n: rg.value(n).clone() for n in resid}
    clean_out = rg.run(clean)
    metric = lambda out: (out[:, -1, 3] - out[:, -1, 5]).mean()  # noqa: E731

    def patch(value, site):
        node, pos = site
        v = value.clone()
        v[:, pos] = cache[node][:, pos]
        return v

    sites = [(n, p) for n in resid for p in range(model.seq)]
    rg.reset_stats()
    r1 = torch_ext.sweep(rg, sites, patch, metric, progress=False, skip_identical=False)
    assert r1.measured_evaluations == r1.predicted_evaluations == sum(len(rg.cone(n)) for n, _ in sites)
    assert r1.full_evaluations == len(sites) * rg.num_nodes
    assert rg.stats["evaluations"] == r1.measured_evaluations
    assert bits_equal(rg.demand(), clean_out)  # the sweep restores
    # The default skips the sites whose patch leaves the value bit-identical (positions the corrupted
    # prompt does not change, in the embeddings' sum): they cost nothing, the others their cones.
    identical = [(n, p) for n, p in sites if torch.equal(cache[n][:, p], rg.value(n)[:, p])]
    assert identical, "the corrupted prompt changes every position: no identical site to skip"
    rg.reset_stats()
    r0 = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    assert r0.extra["identical_sites"] == len(identical)
    assert r0.measured_evaluations == r0.predicted_evaluations == rg.stats["evaluations"] == sum(
        len(rg.cone(n)) for n, p in sites if (n, p) not in identical)
    assert r0.extra["skipped_evaluations"] == sum(len(rg.cone(n)) for n, _ in identical)
    assert r0.metrics == r1.metrics  # the same bits
    # batch_sites=K: each node's sites, K per batch (here all of them), one node's cone each.
    r3 = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=len(sites))
    assert r3.batched and r3.groups == len(resid)
    assert r3.measured_evaluations == r3.predicted_evaluations == sum(len(rg.cone(n)) for n in resid)
    # batch_sites=True chains the three nodes (each in the cone of the one before): one unit whose copies
    # enter at their own node, the first node's cone plus two entry slices and joins and the first slice.
    r2 = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)
    assert r2.batched and r2.groups == 1
    assert r2.measured_evaluations == r2.predicted_evaluations == len(rg.cone("add")) + 1 + 2 * 2
    assert set(r1.metrics) == set(r2.metrics) == set(r3.metrics) == set(sites)
    for k in sites:
        assert abs(r1.metrics[k] - r3.metrics[k]) <= 1e-6 * max(1.0, abs(r3.metrics[k])), (k, r1.metrics[k], r3.metrics[k])
        # Token-granular cones run the linears on rows [p, T): BLAS rounds a row differently with another
        # row count, so the two sweeps agree within 1e-6 relative, not bit for bit.
        assert abs(r1.metrics[k] - r2.metrics[k]) <= 1e-6 * max(1.0, abs(r2.metrics[k])), (k, r1.metrics[k], r2.metrics[k])
    # Manual check of one site against eager PyTorch with a forward pre-hook.
    node, pos = "add_2", 11
    def hook(mod, args):
        x = args[0].clone()
        x[:, pos] = cache[node][:, pos]
        return (x,)
    handle = model.blocks[1].register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            eager = float(metric(model(clean)))
    finally:
        handle.remove()
    assert abs(eager - r1.metrics[(node, pos)]) <= 1e-5
    # Positions before the first corrupted token (5) see identical prefixes: patching them is a no-op.
    for n in resid:
        for p in range(5):
            assert r1.metrics[(n, p)] == float(metric(clean_out))
    df = r1.to_pandas()
    assert list(df.columns) == ["site", "node", "key", "metric"] and len(df) == len(sites)
    assert sorted(set(df["node"])) == sorted(resid)
    png = tmp_path / "sweep.png"
    assert r1.plot(str(png)) == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_cutoff_stops_at_unchanged_values(tiny):
    ep, _, clean, _ = tiny
    rg = torch_ext.ReactiveGraph(ep, cutoff=True)
    out0 = rg.run(clean)
    s = Structure(rg.graph.nodes())
    rg.reset_stats()
    site = "add_2"
    rg.patch(site, rg.value(site).clone())
    out = rg.demand()
    consumers = set(s.children[site])
    assert rg.stats["evaluations"] == len(consumers)
    assert rg.stats["cutoffs"] == len(s.cone(site)) - len(consumers)
    assert bits_equal(out, out0)
    rg.set_cutoff(False)
    rg.restore()
    rg.patch(site, rg.baseline(site).clone())
    e0 = rg.stats["evaluations"]
    rg.demand()
    assert rg.stats["evaluations"] - e0 == len(s.cone(site))


# ---------------------------------------------------------------------------------------------
# 5. training mode: a joint forward/backward program
# ---------------------------------------------------------------------------------------------
class TanhMLP(nn.Module):
    def __init__(self, depth: int, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def joint_reactive_graph(depth: int):
    torch.manual_seed(depth)
    model = TanhMLP(depth)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    joint = export_joint(torch.export.export(model, (x, y)))
    rg = torch_ext.ReactiveGraph(joint)
    state = {**rg.program.state_dict, **rg.program.constants}
    user = iter([x, y])
    flat = [next(user) if n.role == "input" else state[n.state_name]
            for n in rg.graph.nodes() if n.kind == "placeholder"]
    rg.run(x, y)  # a joint program runs like any other; flat is the engine's view of the same inputs
    return rg, model, (x, y), flat


def test_training_mode_patch_invalidates_backward():
    rg, model, (x, y), flat = joint_reactive_graph(3)
    sig = rg.program.graph_signature
    grads = {spec.target: spec.arg.name for spec in sig.output_specs if spec.kind.name == "GRADIENT_TO_PARAMETER"}
    loss = [spec.arg.name for spec in sig.output_specs if spec.kind.name == "LOSS_OUTPUT"]
    assert len(grads) == 6 and len(loss) == 1
    out0 = [o.clone() for o in rg._engine.demand()]
    # The joint graph computes the loss and the gradients of the eager model.
    eager_loss = model(x, y)
    eager_grads = torch.autograd.grad(eager_loss, [p for _, p in model.named_parameters()])
    torch.testing.assert_close(out0[0], eager_loss.detach(), atol=1e-6, rtol=1e-6)
    for g, (name, _) in zip(eager_grads, model.named_parameters()):
        idx = [spec.target for spec in sig.output_specs].index(name)
        torch.testing.assert_close(out0[idx], g, atol=1e-6, rtol=1e-6)
    s = Structure(rg.graph.nodes())
    sites = [n for n in s.countable if rg.graph.node(n).target == "aten::tanh.default"]
    assert len(sites) == 3
    N = rg.num_nodes
    rg.reset_stats()
    total = 0
    for site in sites:
        cone = rg.cone(site)
        assert cone == s.cone(site)
        assert set(grads.values()) <= cone, "every parameter gradient depends on every forward activation"
        assert loss[0] in cone
        value = torch.full_like(rg.value(site), 0.3)
        # A dataflow patch (the counts are the subject here): rg.patch refuses a forward activation of a joint
        # program outside dataflow_edits() (its gradients would not be eager's, see the test below).
        with rg.dataflow_edits():
            rg.patch(site, value)
        out = rg._engine.demand()
        rg.check_invariants()
        total += len(cone)
        assert rg.stats["evaluations"] == total
        assert bits_equal(out, reference(rg.graph, flat, {site: value}))
        assert not bits_equal(out[1:], out0[1:])
        rg.restore()
        assert bits_equal(rg._engine.demand(), out0)
        assert rg.stats["evaluations"] == total
    # rho_train from cones: the ratio the sweep actually achieved, exactly.
    assert Fraction(len(sites) * N, rg.stats["evaluations"]) == Fraction(len(sites) * N, sum(len(s.cone(v)) for v in sites))


class SinTanhMLP(TanhMLP):
    def forward(self, x, y):
        return super().forward(torch.sin(x), y)


def test_training_mode_patch_of_a_forward_activation_with_parameters_before_it_is_refused():
    # Before: rg.patch(tanh, value) on a joint program gave the loss of eager with a forward hook returning value,
    # but the gradients of the layers before the patch ran the chain rule through the patched value with tanh's
    # derivative (tanh_backward of 0.3), where eager's hook cuts or replaces that path: 0.08 to 0.14 off eager's
    # gradients, silently, as a graft was (the backward was derived without the patch).
    torch.manual_seed(0)
    model = SinTanhMLP(3)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rg = torch_ext.ReactiveGraph(export_joint(torch.export.export(model, (x, y))))
    rg.run(x, y)
    loss0, grads0 = rg.demand()
    before = (str(rg), dict(rg.stats), loss0.clone(), {k: g.clone() for k, g in grads0.items()})
    tanh = [n for n in rg.nodes() if n.startswith("tanh") and "backward" not in n]
    assert len(tanh) == 3
    for site in tanh:
        value = torch.full_like(rg.value(site), 0.3)
        with pytest.raises(ValueError, match=rf"patch {site!r}: this graph is a joint forward\+backward program and "
                                             rf"{site!r} is a forward activation computed from parameters "
                                             r"\(layers\.0\.bias, layers\.0\.weight"):
            rg.patch(site, value)
        with pytest.raises(ValueError, match=rf"sweep {site!r}: this graph is a joint forward\+backward program"):
            torch_ext.sweep(rg, [site], lambda v, s: v * 0, lambda o: float(o[0]), progress=False)
        assert rg.patched() == []
    loss, grads = rg.demand()
    assert (str(rg), dict(rg.stats)) == before[:2]
    assert bits_equal([loss, *grads.values()], [before[2], *before[3].values()])
    # A forward activation with no parameter before it (sin of the input) is patched as eager's forward hook: the
    # gradients all flow after it.
    sin = [n for n in rg.nodes() if n.startswith("sin")]
    assert len(sin) == 1
    value = torch.full_like(rg.value(sin[0]), 0.3)
    rg.patch(sin[0], value)
    loss, grads = rg.demand()
    eager_loss = TanhMLP.forward(model, value, y)
    eager_grads = torch.autograd.grad(eager_loss, [p for _, p in model.named_parameters()])
    torch.testing.assert_close(loss, eager_loss.detach(), atol=1e-6, rtol=1e-6)
    for g, (name, _) in zip(eager_grads, model.named_parameters()):
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6)
    rg.restore()


def test_training_mode_graft_is_refused_and_changes_nothing():
    # Before: the block was spliced into the forward of the joint graph and its backward stayed the one derived
    # without it: the loss was the grafted model's, the first layer's gradients were not (2 * t after the first tanh
    # left them off by up to 0.14), silently.
    rg, model, (x, y), _ = joint_reactive_graph(2)
    t0 = [n for n in rg.nodes() if n.startswith("tanh")][0]
    loss, grads = rg.demand()
    before = (str(rg), rg.nodes(), dict(rg.stats), loss.clone(), {k: g.clone() for k, g in grads.items()})
    consumer = next(n.name for n in rg.graph.nodes() if t0 in [a.name for a in n.args if hasattr(a, "name")])
    for args in ((t0, lambda t: 2 * t), (t0, consumer, lambda t: 2 * t)):
        with pytest.raises(ValueError, match=f"graft after '{t0}': this graph is a joint forward\\+backward program"):
            rg.graft(*args)
    loss, grads = rg.demand()
    assert (str(rg), rg.nodes(), dict(rg.stats)) == before[:3]
    assert bits_equal([loss, *grads.values()], [before[3], *before[4].values()])
    rg.check_invariants()


def joint_sin_graph(depth: int = 2):
    """A joint graph of SinTanhMLP: sin(x) has no parameter before it, every tanh has."""
    torch.manual_seed(0)
    model = SinTanhMLP(depth)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rg = torch_ext.ReactiveGraph(export_joint(torch.export.export(model, (x, y))))
    rg.run(x, y)
    return rg, model, x, y


def readers_of(rg, node: str) -> list[str]:
    return [n.name for n in rg.graph.nodes() if node in [a.name for a in n.args if hasattr(a, "name")]]


def assert_eager_grads(rg, model, eager_loss):
    """The graph's loss and every gradient equal eager autograd's, bit for bit."""
    loss, grads = rg.demand()
    names = [name for name, _ in model.named_parameters()]
    eager = torch.autograd.grad(eager_loss, [p for _, p in model.named_parameters()])
    assert torch.equal(loss, eager_loss.detach())
    assert sorted(grads) == sorted(names)
    for name, g in zip(names, eager):
        assert torch.equal(grads[name], g), name


def test_training_mode_joint_graph_gradients_are_eagers_bit_for_bit():
    # The baseline the graft tests below compare against: no edit, the joint graph is eager autograd exactly.
    rg, model, x, y = joint_sin_graph()
    assert_eager_grads(rg, model, model(x, y))


@pytest.mark.parametrize("block", [lambda t: 2 * t, lambda t: t * t + 0.5])
def test_training_mode_graft_after_a_value_with_no_parameter_before_it_is_eagers(block):
    # Before: every graft on a joint graph was refused. After sin(x) (no parameter before it), the node form
    # reroutes every reader, the backward's mm reading sin for layers.0.weight's gradient included: a patch by the
    # block's value. Eager: the model with the block after sin. Exact, bit for bit, on the loss and every gradient.
    rg, model, x, y = joint_sin_graph()
    sin = [n for n in rg.nodes() if n.startswith("sin")]
    assert len(sin) == 1 and len(readers_of(rg, sin[0])) == 2  # the forward's addmm and the backward's mm
    names = rg.graft(sin[0], block)
    assert names
    assert_eager_grads(rg, model, TanhMLP.forward(model, block(torch.sin(x)), y))
    rg.check_invariants()
    # A graft after the user input x itself: the same, one step earlier.
    rg2, model2, x2, y2 = joint_sin_graph()
    rg2.graft("x", block)
    assert_eager_grads(rg2, model2, model2(block(x2), y2))


def test_training_mode_graft_on_a_gradient_node_is_eagers_tensor_hook():
    # Before: refused. The gradient of layer 0's output (tanh) is the backward's mm of the next layer's
    # tanh_backward with its weight; a graft after it is eager's tensor hook on that output: h.register_hook(block).
    rg, model, x, y = joint_sin_graph()
    tb = [n for n in rg.nodes() if n.startswith("tanh_backward")]
    grad_h0 = next(n for n in rg.nodes() if n.startswith("mm") and any(r in readers_of(rg, n) for r in tb)
                   and rg.graph.node(n).args[0].name in tb)
    block = lambda t: t * t - 0.25 * t  # noqa: E731
    rg.graft(grad_h0, block)

    h = torch.tanh(model.layers[0](torch.sin(x)))
    h.register_hook(block)
    h1 = torch.tanh(model.layers[1](h))
    assert_eager_grads(rg, model, ((h1 - y) ** 2).mean())
    rg.check_invariants()


def test_training_mode_graft_refusals_name_the_parameter_and_change_nothing():
    rg, model, x, y = joint_sin_graph()
    loss, grads = rg.demand()
    before = (str(rg), rg.nodes(), dict(rg.stats), loss.clone(), {k: g.clone() for k, g in grads.items()})
    sin = [n for n in rg.nodes() if n.startswith("sin")][0]
    fwd, bwd = sorted(readers_of(rg, sin))  # addmm (forward), mm_2 (backward: layers.0.weight's gradient)
    assert fwd.startswith("addmm") and bwd.startswith("mm")
    # The edge form after sin reroutes the forward's addmm only: the backward's mm keeps reading sin, so
    # layers.0.weight's gradient is neither model's.
    with pytest.raises(ValueError, match=rf"graft after {sin!r}: this graph is a joint forward\+backward program "
                                         rf"and {sin!r} is read by the backward \({bwd!r}\).*node form"):
        rg.graft(sin, fwd, lambda t: 2 * t)
    # A graft after a parameter is a parametrization: eager differentiates through the block.
    with pytest.raises(ValueError, match=r"graft after 'p_layers_0_weight': .* is the parameter layers\.0\.weight "
                                         r"whose gradient is an output"):
        rg.graft("p_layers_0_weight", lambda t: 2 * t)
    # A forward activation with parameters before it: named.
    tanh = [n for n in rg.nodes() if n.startswith("tanh") and "backward" not in n][0]
    with pytest.raises(ValueError, match=rf"graft after {tanh!r}: .* computed from parameters \(layers\.0\.bias, "
                                         r"layers\.0\.weight\).*Graft on a gradient node"):
        rg.graft(tanh, lambda t: 2 * t)
    # The public engine view is under the same rule (it took the patch, silently off eager's gradients).
    with pytest.raises(ValueError, match=rf"patch {tanh!r}: this graph is a joint forward\+backward program"):
        rg.engine.patch(tanh, torch.zeros(4, 8))
    with pytest.raises(ValueError, match=rf"patch {tanh!r}: this graph is a joint forward\+backward program"):
        rg.engine.evaluate_patched(tanh, torch.zeros(4, 8))
    assert rg.patched() == []
    loss, grads = rg.demand()
    assert (str(rg), rg.nodes(), dict(rg.stats)) == before[:3]
    assert bits_equal([loss, *grads.values()], [before[3], *before[4].values()])
    rg.check_invariants()
    # What the refused edge graft would have given (dataflow_edits: the cost measurements' way past the rule):
    # the loss of the grafted model, layers.0.weight's gradient off eager's.
    with rg.dataflow_edits():
        rg.graft(sin, fwd, lambda t: 2 * t)
    loss, grads = rg.demand()
    eager_loss = TanhMLP.forward(model, 2 * torch.sin(x), y)
    eager = dict(zip([n for n, _ in model.named_parameters()],
                     torch.autograd.grad(eager_loss, list(model.parameters()))))
    assert torch.equal(loss, eager_loss.detach())
    assert not torch.allclose(grads["layers.0.weight"], eager["layers.0.weight"], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# 6. regressions: minimal repros of engine bugs fixed since
# ---------------------------------------------------------------------------------------------
def test_bug_graft_then_patch_then_restore():
    x = [torch.randn(4)]
    eng, _, _ = new_engine(chain_text(6), x)
    eng.graft("n3", "n4", block_graph(1)._g, [])  # no demand after the graft
    eng.patch("n5", torch.zeros(4))  # a patch anywhere (here downstream of the graft)
    eng.demand()  # recomputes graft0_b1 and n4 under the patch
    eng.restore()
    eng.check_invariants()  # I5: %graft0_b1 valid without value
    assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))


def test_bug_graft_then_patch_then_restore_values():
    """Same as above without check_invariants(): the outputs are wrong, not only the invariant."""
    x = [torch.randn(4)]
    eng, _, _ = new_engine(chain_text(6), x)
    eng.graft("n3", "n4", block_graph(1)._g, [])
    eng.patch("n5", torch.zeros(4))
    eng.demand()
    eng.restore()
    assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))


def test_bug_cutoff_ignores_graft():
    x = [torch.randn(4)]
    eng, _, _ = new_engine(chain_text(6), x, cutoff=True)
    eng.graft("n3", "n4", block_graph(2)._g, [])
    assert bits_equal(eng.demand(), fresh_engine_outputs(eng, x))


def test_bug_cutoff_restore_node_keeps_patch():
    x = [torch.randn(4)]
    eng, _, _ = new_engine(chain_text(6), x, cutoff=True)
    eng.patch("n2", torch.zeros(4))
    eng.patch("n4", torch.ones(4))
    eng.demand()
    eng.restore_node("n4")  # n2 stays pinned, so n4 must become sin(n3) = sin(sin(0)) = 0
    assert bits_equal(eng.value("n4"), torch.zeros(4))


def test_bug_cutoff_restore_breaks_i4():
    eng, _, _ = new_engine(chain_text(3), cutoff=True)
    eng.patch("n1", eng.value("n1").clone())  # same value: n2 recomputes unchanged, n3 is cut off
    eng.demand()
    eng.restore()
    eng.check_invariants()  # "I4 invariant violated at %n3: verified at 2 but input %n2 changed at 3"


def test_bug_cutoff_restore_degrades_later_sweeps():
    eng, _, _ = new_engine(chain_text(6), cutoff=True)
    costs = []
    for _ in range(3):
        eng.patch("n1", eng.baseline("n1").clone())
        costs.append(_evals_of_demand(eng))
        eng.restore()
    assert costs == [1, 1, 1]  # only n2 (n1's consumer) re-executes; measured [1, 2, 2]


def _evals_of_demand(eng) -> int:
    before = eng.stats()["evaluations"]
    eng.demand()
    return eng.stats()["evaluations"] - before


def test_bug_cutoff_list_valued_node():
    g = ("graph:\n  %x : f32[4] = input()\n  %a : f32[4] = aten::sin.default(%x)\n"
         "  %s : (f32[2], f32[2]) = aten::split.Tensor(%a, 2)\n  %s0 : f32[2] = getitem(%s, 0)\n  return (%s0)\n")
    x = [torch.randn(4)]
    eng, _, _ = new_engine(g, x, cutoff=True)
    eng.patch("a", torch.zeros(4))
    out = eng.demand()
    eng.check_invariants()
    assert bits_equal(out, [torch.zeros(2)])


def test_bug_cutoff_run_keeps_patch():
    x = [torch.randn(4)]
    eng, _, _ = new_engine(chain_text(3), x, cutoff=True)
    clean = eng.demand()
    eng.patch("n2", torch.zeros(4))
    eng.run(x)
    assert bits_equal(eng.demand(), clean)


def test_bug_reactive_graph_joint_outputs():
    torch.manual_seed(0)
    model = TanhMLP(2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rg = torch_ext.ReactiveGraph(export_joint(torch.export.export(model, (x, y))))
    rg.run(x, y)


def test_bug_batched_sweep_ignores_current_inputs(tiny):
    ep, model, clean, corrupt = tiny
    rg = torch_ext.ReactiveGraph(model, (clean,))
    rg.run(corrupt)  # the graph now holds `corrupt`
    sites = [("linear_5", p) for p in (0, 15)]
    patch = lambda c, site: c.index_fill(1, torch.tensor([site[1]]), 0.0)  # noqa: E731
    metric = lambda out: out[:, -1, 0].mean()  # noqa: E731
    r1 = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    r2 = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=True)
    for k in sites:
        assert abs(r1.metrics[k] - r2.metrics[k]) <= 1e-6


def test_batched_cones_are_bounded_and_evicted_least_recently_used_first(tiny):
    # Each batched cone holds K times its cone's values: a sweep over many site nodes used to keep
    # every one of them for the graph's lifetime.
    ep, model, clean, corrupt = tiny
    rg = torch_ext.ReactiveGraph(model, (clean,))
    rg.max_batched_cones = 3
    nodes = [n for n in rg.nodes() if n.startswith("linear")][:5]
    assert len(nodes) == 5
    patch = lambda c, site: c.index_fill(1, torch.tensor([site[1]]), 0.0)  # noqa: E731
    metric = lambda out: out[:, -1, 0].mean()  # noqa: E731
    sites = [(n, p) for n in nodes for p in (0, 7)]
    # batch_sites=2: one batched cone per node (batch_sites=True may chain nodes into one unit).
    one_by_one = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    batched = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=2)
    assert [key[0] for key in rg._batched] == nodes[2:]  # the last three, oldest first
    for k in sites:
        assert abs(one_by_one.metrics[k] - batched.metrics[k]) <= 1e-6, k
    # Reused, it becomes the most recent; a standing patch changes the state: every entry goes.
    torch_ext.sweep(rg, sites[4:6], patch, metric, progress=False, batch_sites=2)
    assert [key[0] for key in rg._batched] == [nodes[3], nodes[4], nodes[2]]
    rg.patch(nodes[0], lambda v: v * 0.5)
    torch_ext.sweep(rg, sites[8:], patch, metric, progress=False, batch_sites=2)
    assert [key[0] for key in rg._batched] == [nodes[4]]
    rg.restore()


def test_alternating_batch_sizes_reuse_their_batched_cones(tiny):
    """Two batched sweeps of one graph with different batch_sites (10 (node, K) pairs) used to evict each
    other's cones (at most 8 were kept), so every sweep rebuilt every cone: a C++ pass and a clean run
    each, 3-5x the warm time. Both now stay cached within the byte budget; a small budget still evicts."""
    ep, model, clean, corrupt = tiny
    rg = torch_ext.ReactiveGraph(model, (clean,))
    nodes = [n for n in rg.nodes() if n.startswith("linear")][:5]
    patch = lambda c, site: c.index_fill(1, torch.tensor([site[1]]), 0.0)  # noqa: E731
    metric = lambda out: out[:, -1, 0].mean()  # noqa: E731
    sites = [(n, p) for n in nodes for p in (0, 3, 6, 7)]
    ref = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=False)
    first = {k: torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=k, positions=False)
             for k in (2, 3)}
    assert len(rg._batched) == 10
    for k in (2, 3):
        again = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=k, positions=False)
        assert again.extra["setup_evaluations"] == 0, k  # nothing rebuilt
        assert again.metrics == first[k].metrics
        for s in sites:
            assert abs(again.metrics[s] - ref.metrics[s]) <= 1e-6, s
    # A budget below two cones' values: each new cone evicts the older ones first, results unchanged.
    sizes = sorted(bc.nbytes for bc in rg._batched.values())
    assert all(size > 0 for size in sizes)
    rg.max_batched_bytes = sizes[-1] + sizes[0] - 1
    small = torch_ext.sweep(rg, sites, patch, metric, progress=False, batch_sites=4, positions=False)
    assert small.extra["setup_evaluations"] > 0  # K = 4: built now, evicting as it goes
    assert sum(bc.nbytes for bc in rg._batched.values()) <= rg.max_batched_bytes
    assert len(rg._batched) < 5
    for s in sites:
        assert abs(small.metrics[s] - ref.metrics[s]) <= 1e-6, s


def test_example_inputs_passing_one_tensor_twice_stay_two_inputs():
    # The trace reads one tensor passed twice as one input; run(a, b) then computed with b for a.
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, a, b):
            return self.fc(a) - b

    torch.manual_seed(0)
    model = Two().eval()
    x = torch.randn(3, 4)
    for front_end in ("make_fx", "export"):
        rg = torch_ext.ReactiveGraph(model, (x, x), front_end=front_end, cache=False)
        assert torch.equal(rg.demand(), model(x, x))
        a, b = torch.randn(3, 4), torch.randn(3, 4)
        assert torch.equal(rg.run(a, b), model(a, b)), front_end
