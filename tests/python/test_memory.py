"""Scheduling, memory planning and the arena executor."""
from __future__ import annotations

import json

import pytest
import torch

import torch_ext
from torch_ext import _C

from test_train_step import MODELS, OPTIMIZERS, _as_list


def _overlaps(a, b):
    return a[3] <= b[4] and b[3] <= a[4] and a[5] < b[5] + b[2] and b[5] < a[5] + a[2]


def check_plan(plan):
    """Independent plan verifier: no two buffers overlap in both lifetime and address."""
    bufs = plan["buffers"]
    for i in range(len(bufs)):
        assert bufs[i][5] + bufs[i][2] <= plan["arena_bytes"]
        for j in range(i + 1, len(bufs)):
            assert not _overlaps(bufs[i], bufs[j]), (bufs[i], bufs[j])


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_planned_arena_is_bit_exact_with_unplanned(model_name, opt_name):
    model, loss_fn, make_batch = MODELS[model_name]()
    opts = _as_list(OPTIMIZERS[opt_name](model))
    step = torch_ext.make_train_step(model, opts if len(opts) > 1 else opts[0], loss_fn,
                                     make_batch(torch.Generator().manual_seed(0)))
    planned = step.compile(plan=True, donate=True)
    check_plan(planned.plan)
    assert planned.inplace_updates == len(step._updates), planned.plan["aliases"]
    ref_state = step.init_state()
    state = step.init_state()
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        batch = make_batch(g)
        ref_loss, ref_state = step(ref_state, *batch)
        before = {k: v for k, v in state.params.items()}
        loss, state = planned(state, *batch)
        assert torch.equal(loss, ref_loss)
        for name in step.state_names:
            assert torch.equal(state.lookup(name), ref_state.lookup(name)), name
        # Donation: the same tensor objects were updated in place and handed back.
        assert all(state.params[k] is before[k] for k in before)


def test_no_donation_leaves_the_input_state_alone():
    model, loss_fn, make_batch = MODELS["mlp"]()
    step = torch_ext.make_train_step(model, OPTIMIZERS["adam"](model), loss_fn, make_batch(torch.Generator()))
    planned = step.compile(plan=True, donate=False)
    assert all(not a[1] for a in planned.plan["aliases"])
    state = step.init_state()
    snapshot = {k: v.clone() for k, v in state.params.items()}
    batch = make_batch(torch.Generator().manual_seed(1))
    loss, new = planned(state, *batch)
    ref_loss, ref = step(state, *batch)
    assert torch.equal(loss, ref_loss)
    for k in snapshot:
        assert torch.equal(state.params[k], snapshot[k])
        assert torch.equal(new.params[k], ref.params[k])


@pytest.mark.internals
def test_alias_refused_when_old_weight_is_read_after_the_write():
    g = torch_ext.ir.Graph.parse("""graph:
  %w : f32[1024] = param("w")
  %lr : f64[] = optstate("opt:lr:group0")
  %x : f32[1024] = input()
  %g : f32[1024] = aten::mul.Tensor(%x, %w)
  %u : f32[1024] = torch_ext::sgd_update.default(%w, %g, %lr, 0.0, False)
  %late : f32[1024] = aten::mul.Tensor(%w, 2)
  %loss : f32[] = aten::sum.default(%late)
  return (%loss, %u)
""")
    plan = _C.plan_memory(g._g, True)
    assert plan["aliases"] == [("u", False, "%w is read by %late after the update")]
    # Unscheduled, the arena executor must copy, and still compute the right thing.
    ex = _C.ArenaExecutor(g._g, 0, True)
    w, x, lr = torch.randn(1024), torch.randn(1024), torch.tensor(0.1, dtype=torch.float64)
    loss, u = ex.run([w, lr, x])
    assert torch.equal(loss, (w * 2).sum())
    assert torch.equal(u, torch.add(w, x * w, alpha=-0.1))


def test_donating_aliased_state_is_refused():
    model, loss_fn, make_batch = MODELS["mlp"]()
    step = torch_ext.make_train_step(model, OPTIMIZERS["sgd_nesterov_wd"](model), loss_fn, make_batch(torch.Generator()))
    planned = step.compile()
    state = step.init_state()
    names = list(state.params)
    shared = state.params[names[1]]
    state.params[names[1]] = shared  # same object twice is fine ...
    state.opt[f"opt:{names[1]}:momentum_buffer"] = state.params[names[1]]  # ... but state entries sharing storage are not
    with pytest.raises(RuntimeError, match=r"share storage; donation needs every state tensor to own its memory"):
        planned(state, *make_batch(torch.Generator()))


@pytest.mark.internals
def test_planning_a_mutating_graph_is_refused():
    g = torch_ext.ir.Graph.parse('graph:\n  %c : i64[] = buffer("n")\n  %i : i64[] = aten::add_.Tensor(%c, 1)\n'
                                 '  %o : i64[] = aten::mul.Tensor(%i, 2)\n  return (%o)\n')
    with pytest.raises(RuntimeError, match=r"node %i \(aten::add_.Tensor\) mutates its inputs"):
        _C.plan_memory(g._g, True)


def test_memory_report_table_json_and_plot(tmp_path):
    model, loss_fn, make_batch = MODELS["mlp"]()
    step = torch_ext.make_train_step(model, OPTIMIZERS["adam"](model), loss_fn, make_batch(torch.Generator()))
    report = torch_ext.memory_report(step, make_batch(torch.Generator().manual_seed(1)))
    text = str(report)
    assert "eager step (measured, torch.profiler)" in text and "lower bound LB_graph" in text
    d = json.loads(report.to_json())
    assert d["merged_planned"] >= d["lb_sched"] >= d["persistent_bytes"] > 0
    assert d["eager_peak"] > d["persistent_bytes"]
    assert d["aliases_applied"] == len(step._updates) and d["aliases_refused"] == 0
    assert d["separate_planned"] >= d["merged_planned"]
    png = report.plot(str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 1000 and png.endswith(".png")
