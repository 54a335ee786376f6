"""The public IR-level API: passes on a torch_ext.ir.Graph, and the reactive Engine over one.

Scripts that measure exact costs or run a pass on hand-written IR use these, not _C or ._g.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.ir import Graph
from torch_ext.reactive import Engine
from torch_ext.synthetic import block_text, chain_text


def test_engine_counts_a_patched_cone_and_a_graft_by_node_name():
    eng = Engine(Graph.parse(chain_text(10)))
    x = torch.rand(4) + 0.5
    eng.run([x])
    eng.reset_stats()
    eng.patch("n4", torch.ones(4))
    eng.demand()
    assert eng.stats()["evaluations"] == 6  # n5 .. n10
    eng.restore()
    eng.reset_stats()
    names = eng.graft("n2", "n3", Graph.parse(block_text(3)), [])
    eng.demand()
    assert len(names) == 3 and eng.stats()["evaluations"] == 3 + 8  # the block, then n3 .. n10
    assert all(n in {v.name for v in eng.graph.nodes()} for n in names)
    expected = x.relu().relu().cos().cos().cos()
    for _ in range(8):
        expected = expected.relu()
    torch.testing.assert_close(eng.value("n10"), expected, rtol=0, atol=0)
    eng.check_invariants()


def test_engine_refuses_anything_but_an_ir_graph():
    with pytest.raises(TypeError, match="torch_ext.ir.Graph, got str"):
        Engine(chain_text(3))


def test_reactive_graph_engine_is_the_same_engine():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    rg = torch_ext.ReactiveGraph(model, (torch.randn(3, 4),))
    rg.run(torch.randn(3, 4))
    relu = next(n.name for n in rg.graph.nodes() if n.target == "aten::relu.default")
    rg.engine.patch(relu, torch.zeros(3, 4))
    assert relu in rg.patched()
    out = rg.graph.nodes()[-1].args[0][0].name
    bias = dict(model.named_parameters())["2.bias"]
    torch.testing.assert_close(rg.value(out), bias.detach().expand(3, 2), rtol=0, atol=0)


def test_passes_on_a_graph_change_it_in_place_and_fit_a_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    batch = (torch.randn(32, 16), torch.randn(32, 4))
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     lambda m, x, y: F.mse_loss(m(x), y), batch)
    g = step.graph.clone()
    chosen, candidates = g.schedule()
    assert chosen in {name for name, _ in candidates}
    peak = g.plan_memory()["peak_bytes"]
    assert peak > 0 and g.plan_memory(donate=False)["peak_bytes"] >= peak
    before = str(g)
    r = g.rematerialize_for_budget(peak - 1)
    if r["feasible"]:
        assert r["peak"] <= peak - 1 and r["recomputed"] > 0 and str(g) != before
        assert g.plan_memory()["peak_bytes"] == r["peak"]
    else:
        assert r["min_peak"] >= peak - 1 and str(g) == before
    g.verify()
    with pytest.raises(RuntimeError, match="no_such_node"):
        g.clone().rematerialize(["no_such_node"])
