"""The sweep fast path's in-place cone steps (csrc/reactive/scratch.cpp, plan_inplace).

A cone node with no out= kernel of its own (aten::relu) may overwrite its dying input instead of
allocating. That is only sound when nothing else can read the overwritten tensor: not the caller's
patch value, not a cached value, not the baseline, not a later reader. Ops whose schema declares a
fresh result may still hand back their input (aten::dropout with train=False, aten::type_as with the
dtype it has: torch.export's default IR keeps both), so these tests draw random graphs full of
them and check, after every evaluate_patched, the outputs bit for bit against an eager FX run, the
caller's value, and every cached value.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_ext
from torch_ext import _C
from torch_ext.ir import Graph

from test_reactive import bits_equal, reference

# Unary ops: relu, sigmoid, selu have no out= kernel of their own (they run in place when they may);
# dropout(train=False), type_as, alias, view and reshape hand back their input's tensor or storage.
UNARY = [
    "aten::relu.default(%{a})",
    "aten::relu.default(%{a})",
    "aten::sigmoid.default(%{a})",
    "aten::selu.default(%{a})",
    "aten::sin.default(%{a})",
    "aten::neg.default(%{a})",
    "aten::dropout.default(%{a}, 0.5, False)",
    "aten::dropout.default(%{a}, 0.5, False)",
    "aten::clone.default(%{a})",
    "aten::alias.default(%{a})",
    "aten::view.default(%{a}, [4])",
    "aten::reshape.default(%{a}, [4])",
    "aten::mul.Tensor(%{a}, %{a})",
]
BINARY = [
    "aten::type_as.default(%{a}, %{b})",
    "aten::type_as.default(%{a}, %{b})",
    "aten::add.Tensor(%{a}, %{b})",
    "aten::mul.Tensor(%{a}, %{b})",
    "aten::maximum.default(%{a}, %{b})",
]


@st.composite
def passthrough_dags(draw, max_nodes: int = 18):
    """Random DAG text over f32[4]: 2 inputs, unary and binary nodes, every sink in the output tuple
    (some also read by later nodes, so outputs escape through aliases too)."""
    n = draw(st.integers(3, max_nodes))
    names = ["x", "y"]
    lines = ["graph:", "  %x : f32[4] = input()", "  %y : f32[4] = input()"]
    used = set()
    for i in range(n):
        pick = lambda: draw(st.sampled_from(names[-3:]) if draw(st.booleans()) else st.sampled_from(names))  # noqa: E731
        if draw(st.integers(0, 2)) < 2:
            a = pick()
            op = draw(st.sampled_from(UNARY)).format(a=a)
            used.add(a)
        else:
            a, b = pick(), pick()
            op = draw(st.sampled_from(BINARY)).format(a=a, b=b)
            used.update((a, b))
        name = f"v{i}"
        lines.append(f"  %{name} : f32[4] = {op}")
        names.append(name)
    outs = [v for v in names[2:] if v not in used or draw(st.integers(0, 4)) == 0]
    lines.append(f"  return ({', '.join('%' + v for v in outs)})")
    return "\n".join(lines) + "\n"


def _snapshot(eng, nodes):
    """Every node's cached value, copied (and the tensors themselves, to see that they are kept)."""
    return {n: eng.value(n).clone() for n in nodes}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=passthrough_dags(), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_in_place_cone_steps_never_write_what_others_read(text, data, seed):
    gen = torch.Generator().manual_seed(seed)
    g = Graph.parse(text)
    nodes = [n.name for n in g.nodes() if n.kind != "output"]
    calls = [n.name for n in g.nodes() if n.kind == "call"]
    inputs = [torch.rand(4, generator=gen) * 2 - 1 for n in g.nodes() if n.kind == "placeholder"]
    eng = _C.Engine(g._g)
    eng.run(inputs)
    pins = {}
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        action = data.draw(st.sampled_from(["site", "site", "site", "standing", "restore", "scratch"]), label="action")
        if action == "standing" and not pins:
            node = data.draw(st.sampled_from(calls), label="standing node")
            pins[node] = torch.rand(4, generator=gen) - 0.5
            eng.patch(node, pins[node])
            eng.demand()
            continue
        if action == "restore":
            pins.clear()
            eng.restore()
            eng.demand()
            continue
        if action == "scratch":
            eng.set_scratch(not eng.scratch())
            continue
        site = data.draw(st.sampled_from([n for n in nodes if n not in pins]), label="site")
        # The patch value: a fresh tensor, one the caller keeps, or another node's cached value itself.
        source = data.draw(st.sampled_from(["fresh", "cached", "own"]), label="value")
        if source == "cached":
            value = eng.value(data.draw(st.sampled_from(nodes), label="cached from"))
        elif source == "own":
            value = eng.value(site)
        else:
            value = torch.rand(4, generator=gen) * 2 - 1
        value_before = value.clone()
        cached = _snapshot(eng, nodes)
        expected = reference(Graph(eng.graph()), inputs, {**pins, site: value.clone()})
        out = eng.evaluate_patched(site, value)
        assert bits_equal(list(out), expected), (text, site, source)
        assert bits_equal(value, value_before), ("the caller's patch value was written", text, site, source)
        for n in nodes:
            assert bits_equal(eng.value(n), cached[n]), (f"cached value of %{n} was written", text, site, source)
        eng.check_invariants()
    eng.restore()
    fresh = _C.Engine(eng.graph())
    fresh.run(inputs)
    assert bits_equal(list(eng.demand()), list(fresh.demand()))


@pytest.mark.parametrize("positions", [None, False])
def test_sweep_patching_a_dropout_input_keeps_the_patch_values(positions):
    """Through the public API: an eval-mode MLP exports aten::dropout(train=False), which hands back
    its input, and the relu after it ran in place on that tensor, the patch value itself: a sweep
    patching in a tensor the user holds (another prompt's activation) changed it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3)).eval()
    x = torch.randn(4, 8)
    rg = torch_ext.ReactiveGraph(model, (x,))
    assert "dropout_1" in rg.nodes() and "linear_1" in rg.nodes()
    donor = torch.randn(4, 8) * 3
    donor_copy = donor.clone()
    h = model[3].register_forward_hook(lambda _m, _i, _o: donor_copy.clone())
    with torch.no_grad():
        ref = model(x)
    h.remove()
    res = torch_ext.sweep(rg, ["linear_1"], lambda v, s: donor, lambda out: out.sum(dim=1), progress=False,
                          positions=positions)
    assert torch.equal(donor, donor_copy), "the patch value was written in place"
    assert torch.equal(res.metrics["linear_1"], ref.sum(dim=1))


# A composite op whose schema declares a fresh result is planned as one (its input's scratch buffer
# dies at its last reader: aten::linear's input is not held as long as linear's value), and checked
# where it runs: dropout(train=False) hands back its input's scratch buffer, which %b is planned into
# once %a is dead, so without the check %d would read %b's bits.
ALIAS_INTO_SCRATCH = """graph:
  %x : f32[64] = input()
  %a : f32[64] = aten::sin.default(%x)
  %d : f32[64] = aten::dropout.default(%a, 0.5, False)
  %b : f32[64] = aten::cos.default(%x)
  %c : f32[64] = aten::sub.Tensor(%d, %b)
  %e : f32[64] = aten::mul.Tensor(%c, %d)
  return (%e, %d)
"""


@pytest.mark.parametrize("site_value", ["fresh", "own"])
def test_composite_op_handing_back_a_scratch_buffer_is_copied_out(site_value):
    g = Graph.parse(ALIAS_INTO_SCRATCH)
    x = torch.linspace(-3, 3, 64)
    eng = _C.Engine(g._g)
    eng.run([x])
    for k in range(3):  # the plan is built at the first site, reused after
        value = torch.linspace(-2, 4, 64) * (k + 1) if site_value == "fresh" else eng.value("x")
        out = eng.evaluate_patched("x", value)
        expected = reference(Graph(eng.graph()), [x], {"x": value.clone()})
        assert bits_equal(list(out), expected), k
        assert eng.scratch_bytes() > 0
    eng.check_invariants()


def test_linear_input_dies_at_linear():
    """In a linear + gelu chain the gelu values live in the scratch (aten::linear has no out= kernel
    of its own) and one buffer holds them all: each dies at the linear that reads it. Planned as an
    alias of its input (aten::linear is composite), a gelu value lived until the next one, two buffers."""
    d = 32
    lines = ["graph:", f"  %x : f32[{d},{d}] = input()", f"  %w : f32[{d},{d}] = input()", f"  %b : f32[{d}] = input()"]
    prev = "x"
    for i in range(1, 9):
        call = f"aten::linear.default(%{prev}, %w, %b)" if i % 2 else f"aten::gelu.default(%{prev})"
        lines.append(f"  %n{i} : f32[{d},{d}] = {call}")
        prev = f"n{i}"
    lines.append(f"  return (%{prev})")
    g = Graph.parse("\n".join(lines) + "\n")
    inputs = [torch.randn(d, d), torch.randn(d, d) * 0.2, torch.randn(d)]
    eng = _C.Engine(g._g)
    eng.run(inputs)
    value = torch.randn(d, d)
    out = eng.evaluate_patched("n1", value)
    assert bits_equal(list(out), reference(Graph(eng.graph()), inputs, {"n1": value.clone()}))
    assert eng.scratch_bytes() == d * d * 4, eng.scratch_bytes()


def test_a_relu_after_a_linear_runs_in_place_as_in_the_executor():
    """aten::linear is a composite op whose out= overload has no CPU kernel, so its value is allocated by
    its own kernel and never in the scratch. A relu reading it where it dies overwrites it, as the
    executor's relu does: the plan used to leave every such relu allocating (the overhead chain of
    bench_sweep part 0b: 64 Linear + ReLU, 9% more instructions than the executor, 0 in-place steps)."""
    d, depth = 16, 6
    lines = ["graph:", f"  %x : f32[4,{d}] = input()", f"  %w : f32[{d},{d}] = input()", f"  %b : f32[{d}] = input()"]
    prev = "x"
    for i in range(1, 2 * depth + 1):
        call = f"aten::linear.default(%{prev}, %w, %b)" if i % 2 else f"aten::relu.default(%{prev})"
        lines.append(f"  %n{i} : f32[4,{d}] = {call}")
        prev = f"n{i}"
    lines.append(f"  return (%{prev})")
    g = Graph.parse("\n".join(lines) + "\n")
    inputs = [torch.randn(4, d), torch.randn(d, d) * 0.3, torch.randn(d)]
    eng = _C.Engine(g._g)
    eng.run(inputs)
    cached = [eng.value(f"n{i}").clone() for i in range(1, 2 * depth + 1)]
    value = torch.randn(4, d)
    kept = value.clone()
    for _ in range(2):
        out = eng.evaluate_patched("x", value)
        assert bits_equal(list(out), reference(Graph(eng.graph()), inputs, {"x": kept}))
    assert eng.inplace_steps("x") == depth  # every relu
    assert torch.equal(value, kept)
    assert all(torch.equal(eng.value(f"n{i}"), c) for i, c in zip(range(1, 2 * depth + 1), cached))
    eng.check_invariants()
