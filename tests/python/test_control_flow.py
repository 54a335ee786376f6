"""Data-dependent control flow: torch.cond and while_loop through the IR, the executor, the reactive engine
and the pure step."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.ir import Graph

from helpers import eager_step


class CondMLP(nn.Module):
    """An MLP block whose second layer is chosen by the sign of the first layer's mean."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.cond(h.mean() > 0, lambda t: F.relu(self.a(t)), lambda t: torch.sigmoid(self.b(t)), (h,))
        return self.out(h)


class NestedCond(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, x):
        def outer_true(t):
            return torch.cond(t.sum() > 1.0, lambda u: u * 2, lambda u: u - 1, (t,))

        return torch.cond(x.mean() > 0, outer_true, lambda t: self.l(t), (x,))


class FixedPoint(nn.Module):
    """x_{k+1} = cos(x_k), iterated while the step is above a tolerance (a data-dependent trip count)."""

    def forward(self, x):
        def cond_fn(i, v, d):
            return (d > 1e-3) & (i < 200)

        def body_fn(i, v, d):
            nv = torch.cos(v)
            return i + 1, nv, (nv - v).abs().max()

        i0 = torch.zeros((), dtype=torch.int64)
        d0 = torch.ones(())
        return torch._higher_order_ops.while_loop(cond_fn, body_fn, (i0, x, d0))


class WhereSelect(nn.Module):
    """The static-select alternative: both branches computed, torch.where picks."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        h = self.l(x)
        return torch.where(h.mean() > 0, F.relu(h), torch.sigmoid(h))


POS, NEG = torch.full((4, 8), 0.5), torch.full((4, 8), -0.5)


def _cases():
    torch.manual_seed(0)
    return {
        "cond_mlp": (CondMLP(), [(POS,), (NEG,)]),
        "nested_cond": (NestedCond(), [(torch.full((3, 6), 1.0),), (torch.full((3, 6), 0.05),), (torch.full((3, 6), -1.0),)]),
        "while_fixed_point": (FixedPoint(), [(torch.zeros(5),), (torch.linspace(-2, 2, 5),)]),
        "where_select": (WhereSelect(), [(POS,), (NEG,)]),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_executor_matches_ep_module_on_both_branches(name):
    model, inputs = CASES[name]
    ep = torch.export.export(model, inputs[0])
    ex = torch_ext.Executor(ep)
    mod = ep.module()
    for inp in inputs:
        got, ref = ex(*inp), mod(*inp)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref)):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("name", list(CASES))
def test_text_round_trip_and_graph_module(name):
    model, inputs = CASES[name]
    ep = torch.export.export(model, inputs[0])
    g = Graph.from_exported(ep)
    text = str(g)
    assert str(Graph.parse(text)) == text
    g.verify()
    if name != "where_select":
        assert "higher_order::" in text and "  } {\n" in text
    gm = g.to_graph_module()
    state = {**ep.state_dict, **ep.constants}
    for inp in inputs:
        it = iter(inp)
        flat = [next(it) if n.role == "input" else state[n.state_name]
                for n in g.nodes() if n.kind == "placeholder"]
        got = gm(*flat)
        ref = ep.module()(*inp)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref)):
            assert torch.equal(a, b)


def test_loop_really_iterates_a_data_dependent_number_of_times():
    model, _ = CASES["while_fixed_point"]
    ep = torch.export.export(model, (torch.zeros(5),))
    ex = torch_ext.Executor(ep)
    i_zero, v_zero, _ = ex(torch.zeros(5))
    i_fixed, _, _ = ex(torch.full((5,), 0.7390851))  # already at the fixed point of cos
    assert 5 < int(i_zero) < 200 and int(i_fixed) <= 2
    assert torch.allclose(v_zero, torch.cos(v_zero), atol=2e-3)


def test_reactive_patch_that_flips_the_predicate():
    model, inputs = CASES["cond_mlp"]
    rg = torch_ext.ReactiveGraph(model, inputs[0])
    cond = [n for n in rg.nodes() if n.startswith("cond")][0]
    pred = Graph.parse(str(rg.graph)).node(cond).args[0].name
    clean = rg.demand()
    flip = ~rg.value(pred)
    rg.reset_stats()
    rg.patch(pred, flip)  # the other branch must run
    flipped = rg.demand()
    assert rg.stats["evaluations"] == len(rg.cone(pred))  # the cond node counts once
    # Full recompute with the flip: run the same graph on a fresh engine with the predicate forced.
    ref = torch_ext.ReactiveGraph(model, inputs[0])
    ref.patch(pred, flip)
    ref_out = ref.demand()
    assert torch.equal(flipped, ref_out) and not torch.equal(flipped, clean)
    rg.restore()
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()


def _signed_batches(shape, out_shape, n=50):
    g = torch.Generator().manual_seed(3)
    batches = []
    for i in range(n):
        sign = 1.0 if i % 2 == 0 else -1.0  # alternate the sign so both branches are taken
        batches.append((sign * (torch.rand(*shape, generator=g) + 0.5), torch.randn(*out_shape, generator=g)))
    return batches


@pytest.mark.parametrize("name,shape,out_shape", [("cond_mlp", (4, 8), (4, 4)), ("nested_cond", (3, 6), (3, 6)),
                                                  ("where_select", (4, 8), (4, 8))])
def test_pure_step_through_control_flow_matches_eager_over_50_steps(name, shape, out_shape):
    torch.manual_seed(0)
    model = {"cond_mlp": CondMLP, "nested_cond": NestedCond, "where_select": WhereSelect}[name]()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    batches = _signed_batches(shape, out_shape)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
    state = step.init_state()
    for b in batches:
        loss, state = step(state, *b)
        ref_loss = eager_step(ref, ref_opt, loss_fn, *b)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state.params["model." + n], p.detach(), rtol=1e-5, atol=1e-6)


BAD_COND = """graph:
  %p : b8[] = input()
  %x : f32[2] = input()
  %c : (f32[2]) = higher_order::cond.default(%p, [%x]) {
    graph:
      %a : f32[2] = input()
      %r : f32[2] = aten::relu.default(%a)
      return (%r)
  } {
    graph:
      %a : f32[2] = input()
      %s : f32[] = aten::sum.default(%a)
      return (%s)
  }
  %g : f32[2] = getitem(%c, 0)
  return (%g)
"""

BAD_LOOP = """graph:
  %x : f32[2] = input()
  %w : (f32[2]) = higher_order::while_loop.default([%x], []) {
    graph:
      %a : f32[2] = input()
      %s : f32[] = aten::sum.default(%a)
      %c : b8[] = aten::gt.Scalar(%s, 0)
      return (%c)
  } {
    graph:
      %a : f32[2] = input()
      %b : f32[4] = aten::cat.default([%a, %a])
      return (%b)
  }
  %g : f32[2] = getitem(%w, 0)
  return (%g)
"""


def test_mismatched_branches_and_shape_changing_loops_are_refused():
    with pytest.raises(RuntimeError, match=r"branches return different types: true \(f32\[2\]\), false \(f32\[\]\)"):
        Graph.parse(BAD_COND).verify()
    with pytest.raises(RuntimeError, match=r"loop body changes the carried values from \(f32\[2\]\) to \(f32\[4\]\)"):
        Graph.parse(BAD_LOOP).verify()
    with pytest.raises(RuntimeError, match=r"branches return different types"):
        torch_ext.Executor(Graph.parse(BAD_COND))


def test_training_through_a_loop_names_the_op_and_torch_version():
    class LoopLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(5, 5)
            self.fp = FixedPoint()

        def forward(self, x):
            return self.fp(self.l(x))[1]

    model = LoopLoss()
    try:
        step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         lambda m, x: m(x).sum(), (torch.zeros(5),))
    except NotImplementedError as e:
        assert "while_loop" in str(e) and torch.__version__ in str(e)
    else:  # a torch that can differentiate while_loop: then the step must train
        state = step.init_state()
        loss, _ = step(state, torch.zeros(5))
        assert torch.isfinite(loss)


@pytest.mark.internals
def test_importer_and_exporter_read_the_cpp_higher_order_table():
    """torch_ext/ir.py's cond/while_loop handling comes from csrc/ir/higher_order.h, not from names of its own."""
    from torch_ext import _C, ir

    table = {h["name"]: h for h in _C.higher_order_ops()}
    assert set(table) == {"cond", "while_loop"}
    assert table["cond"]["target"] == "higher_order::cond.default"
    assert table["cond"]["fx_args"] == [("arg", 0), ("region", 0), ("region", 1), ("arg", 1)]
    assert table["while_loop"]["bare_output_regions"] == [0]
    assert set(ir._HIGHER_ORDER) == {torch.ops.higher_order.cond, torch.ops.higher_order.while_loop}
    assert {h["target"] for h in ir._HIGHER_ORDER.values()} == {h["target"] for h in table.values()}
