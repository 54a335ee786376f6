"""Silent-wrong-answer regressions of the reactive engine and sweep (issues 10, 12, 16).

Every test here failed on the code before the fix: a sweep that dropped standing patches or
ignored grafts, a batch axis guessed wrong, patch functions and metrics writing into the cache,
a metric exception leaving the patch pinned, and a batch of grafts evaluating before the demand.
Each reference is computed independently: plain eager forward passes with the patch applied by
hand (forward hooks), never through the engine.
"""
from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn as nn

import torch_ext
from torch_ext import synthetic
from torch_ext.ir import Graph

from helpers import ResidTanh, Steer, position_patch, sum_metric


@pytest.fixture
def resid():
    torch.manual_seed(0)
    model = ResidTanh(3).eval()  # seeds 0 itself: the same weights
    x = torch.randn(2, 5, 8)
    return model, x


def _tanh_nodes(rg):
    return [n for n in rg.nodes() if n.startswith("tanh")]


def _eager(model, x, replace: dict):
    """Eager forward with the outputs of the given tanh calls (by call index) replaced."""
    calls = {"i": 0}
    orig = torch.tanh

    def patched(t):
        i = calls["i"]
        calls["i"] += 1
        out = orig(t)
        return replace[i](out) if i in replace else out

    torch.tanh = patched
    try:
        return model(x)
    finally:
        torch.tanh = orig


_site_patch = position_patch(0.0)
_metric = sum_metric


def test_unbatched_sweep_keeps_a_standing_patch(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    standing = torch.full_like(rg.value(t0), 0.5)
    rg.patch(t0, standing)
    sites = [(t2, p) for p in range(5)]
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False)
    for (_, p) in sites:
        ref = _eager(model, x, {0: lambda o: torch.full_like(o, 0.5), 2: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t2, p)] == float(ref.sum())
    # The standing patch is still there, and the graph is consistent.
    assert rg.patched() == [t0]
    assert torch.equal(rg.value(t0), standing)
    assert torch.equal(rg.demand(), _eager(model, x, {0: lambda o: torch.full_like(o, 0.5)}))
    rg.check_invariants()


@pytest.mark.parametrize("batched", [False, True])
def test_sweep_sees_grafts(resid, batched):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    rg.graft(t0, lambda t: 2 * t)
    sites = [(t1, p) for p in range(5)]
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=batched)
    for (_, p) in sites:
        ref = _eager(model, x, {0: lambda o: 2 * o, 1: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t1, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5)
    rg.check_invariants()


def test_batched_sweep_keeps_and_uses_a_standing_patch(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    rg.patch(t0, torch.zeros_like(rg.value(t0)))
    sites = [(t2, p) for p in range(5)]
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
    for (_, p) in sites:
        ref = _eager(model, x, {0: torch.zeros_like, 2: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t2, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5)
    assert rg.patched() == [t0]
    rg.check_invariants()


def test_batched_sweep_sees_a_standing_patch_replaced_by_another(resid):
    # The batched cone was cached under id() of the pinned value: restore() freed it and the next
    # patch's tensor took the same address, so the second sweep reused the first standing patch.
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    sites = [(t0, p) for p in range(5)]
    fills = (0.5, -0.25, 0.75)
    values = [torch.full_like(x, f) for f in fills]
    for fill, value in zip(fills, values):
        rg.restore()
        rg.patch(t2, value)
        result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
        for (_, p) in sites:
            ref = _eager(model, x, {0: lambda o, p=p: _site_patch(o, (None, p)),
                                    2: lambda o, fill=fill: torch.full_like(o, fill)})
            assert result.metrics[(t0, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5), (fill, p)
    rg.check_invariants()


def test_batched_sweep_sees_new_inputs_after_several_runs(resid):
    # Same cache key, id() of the last inputs: a run whose inputs object took the address of the
    # one the batched cone was built for reused that cone's values computed from the old inputs.
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    sites = [(t1, p) for p in range(5)]
    torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
    first = id(rg._last_inputs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):  # enough runs for the address to come back (it did after ~160)
        x2 = torch.randn(2, 5, 8, generator=gen)
        rg.run(x2)
        if id(rg._last_inputs) == first:
            break
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
    for (_, p) in sites:
        ref = _eager(model, x2, {1: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t1, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5), p


def test_batched_sweep_sees_inputs_edited_in_place_and_run_again(resid):
    model, x = resid
    x = x.clone()
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    sites = [(t1, p) for p in range(5)]
    torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
    with torch.no_grad():
        x.mul_(-2.0)  # the same tensor object, other values
    rg.run(x)
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
    for (_, p) in sites:
        ref = _eager(model, x, {1: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t1, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5), p


def test_batched_sweep_of_a_sequence_first_model_stacks_along_its_batch_dim():
    # nn.MultiheadAttention's default layout is (seq, batch, d). Before, the batched sweep refused it (the
    # copies, stacked along dim 0, met transposes of dim 0); now batch_cone finds that stacking them along
    # dim 1 keeps them apart through every op of the cone, and answers as eager does, site by site.
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2).eval()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.fc(x))
            return self.mha(h, h, h, need_weights=False)[0]

    model = M().eval()
    x = torch.randn(5, 2, 8)
    rg = torch_ext.ReactiveGraph(model, (x,))
    relu = [n for n in rg.nodes() if n.startswith("relu")][0]
    sites = [(relu, p) for p in range(5)]
    batched = torch_ext.sweep(rg, sites, lambda v, s: _zero_row(v, s[1]), lambda o: o.sum(), progress=False,
                              batch_sites=True)
    assert batched.batched and batched.groups == 1
    r = torch_ext.sweep(rg, sites, lambda v, s: _zero_row(v, s[1]), lambda o: o.sum(), progress=False)
    assert len(set(r.metrics.values())) > 1
    for site in sites:
        h = model.fc.register_forward_hook(lambda m, a, o, p=site[1]: _zero_row(o, p))  # relu(0) == 0
        try:
            with torch.no_grad():
                ref = float(model(x).sum())
        finally:
            h.remove()
        assert r.metrics[site] == pytest.approx(ref, rel=1e-6, abs=1e-6), site
        assert batched.metrics[site] == pytest.approx(ref, rel=1e-6, abs=1e-6), site
    assert rg.patched() == []


def _zero_row(v, p):
    out = v.clone()
    out[p] = 0
    return out


def test_batched_sweep_refuses_mixing_along_the_batch():
    class M(nn.Module):
        def forward(self, x):
            h = torch.sin(x)
            # mixes every element without changing shapes: no dim of the site keeps the copies apart (a
            # softmax over dim 0 alone is batched along dim 1)
            return torch.softmax(h.reshape(-1), dim=0).view(2, 4) * 3

    x = torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(M(), (x,))
    sin = [n for n in rg.nodes() if n.startswith("sin")][0]
    with pytest.raises(ValueError, match="dim 0"):
        torch_ext.sweep(rg, [(sin, 0), (sin, 1)], lambda v, s: v * s[1], lambda o: o.sum(), progress=False,
                        batch_sites=True)


def test_in_place_patch_function_cannot_corrupt_the_cache(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    clean = rg.demand().clone()
    t1 = _tanh_nodes(rg)[1]

    def setter(act, site):  # TransformerLens style: edit in place and return it
        act[:, site[1]] = 1.0
        return act

    with pytest.raises(ValueError, match="in place"):
        torch_ext.sweep(rg, [(t1, 0)], setter, _metric, progress=False)
    assert rg.patched() == []
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()
    with pytest.raises(ValueError, match="in place"):
        rg.patch(t1, lambda act: act.mul_(0))
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()


def test_writing_into_a_returned_value_is_detected_and_repaired(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    out = rg.demand()
    clean = out.clone()
    out.add_(1.0)  # the caller writes into the cached output
    with pytest.raises(RuntimeError, match="modified in place"):
        rg.check_invariants()
    with pytest.raises(RuntimeError, match="modified in place"):
        rg.demand()
    assert torch.equal(rg.demand(), clean)  # recomputed
    rg.check_invariants()
    # A written intermediate is found when it is read again: by the invariant checker, or when a
    # consumer is recomputed without it (a graft on the residual add's other input edge).
    t0 = _tanh_nodes(rg)[0]
    rg.value(t0).zero_()
    with pytest.raises(RuntimeError, match=t0):
        rg.check_invariants()
    add0 = rg.graph.node(t0).users[0]
    other = [a.name for a in rg.graph.node(add0).args if isinstance(a, torch_ext._C.NodeRef) and a.name != t0][0]
    rg.graft(other, add0, lambda t: t * 1.0)
    with pytest.raises(RuntimeError, match=t0):
        rg.demand()
    assert torch.equal(rg.demand(), clean)  # tanh_0 was recomputed
    rg.check_invariants()


def test_metric_writing_into_outputs_is_refused(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    clean = rg.demand().clone()
    t2 = _tanh_nodes(rg)[2]
    with pytest.raises(ValueError, match="metric wrote"):
        torch_ext.sweep(rg, [(t2, 0)], _site_patch, lambda o: o.mul_(2).sum(), progress=False)
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()


@pytest.mark.parametrize("batched", [False, True])
def test_metric_exception_leaves_no_patch_pinned(resid, batched):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    clean = rg.demand().clone()
    t1 = _tanh_nodes(rg)[1]
    calls = {"n": 0}

    def bad_metric(out):
        calls["n"] += 1
        if calls["n"] == 2:  # the first call measures the unpatched graph
            raise KeyError("boom")
        return out.sum()

    with pytest.raises(KeyError):
        torch_ext.sweep(rg, [(t1, 0), (t1, 1)], _site_patch, bad_metric, progress=False, batch_sites=batched)
    assert rg.patched() == []
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()
    # A later batched sweep answers as a fresh graph does.
    sites = [(t1, p) for p in range(3)]
    r1 = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=True)
    fresh = torch_ext.ReactiveGraph(model, (x,))
    r2 = torch_ext.sweep(fresh, sites, _site_patch, _metric, progress=False)
    for s in sites:
        assert r1.metrics[s] == pytest.approx(r2.metrics[s], rel=1e-6, abs=1e-5)


def test_batch_of_mixed_order_grafts_costs_the_batch_formula():
    """300-ReLU chain, 3-node blocks grafted after nodes 220, 95, 260, 40, 150 inside one batch:
    nothing is evaluated before the demand, and the demand costs |U D0(w_k)| + sum h_k = 275."""
    class Chain(nn.Module):
        def forward(self, x):
            for _ in range(300):
                x = torch.relu(x)
            return x

    rg = torch_ext.ReactiveGraph(Chain(), (torch.randn(4),))
    names = rg.nodes()
    assert len(names) == 300
    rg.reset_stats()
    with rg.batch():
        for i in (220, 95, 260, 40, 150):
            rg.graft(names[i - 1], names[i], lambda t: torch.cos(torch.sin(torch.tanh(t))))
    assert rg.stats["evaluations"] == 0
    rg.demand()
    # D0(w) of the most upstream w (node 41) covers nodes 41..300 = 260, plus 5 blocks of 3.
    assert rg.stats["evaluations"] == 260 + 15 == 275
    rg.check_invariants()


def test_an_exception_inside_a_batch_leaves_the_patches_as_they_were_before_it(resid):
    """A user's `with rg.batch():` block that raised (a bad patch value, a KeyError of their own) and was
    caught left the patches made inside it standing: the next demand answered the half-applied batch (1.7
    off the sum of the standing patch alone on ResidTanh(3)), silently, and a patch restored inside it
    stayed off. The patches are now put back as they were when the outermost failing batch began (the
    pins' values, the same bits), nested batches included."""
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    rg.patch(t1, lambda v: v * 0.5)  # standing
    want = _eager(model, x, {1: lambda v: v * 0.5})
    assert torch.equal(rg.demand(), want)
    frozen = rg.value(t1).clone()  # a standing patch keeps its value when its upstream changes (README)
    with pytest.raises(KeyError, match="mine"):
        with rg.batch():
            rg.patch(t0, lambda v: v * 0)
            rg.restore(t1)
            rg.patch(t2, torch.zeros(2, 5, 8))
            raise KeyError("mine")
    assert rg.patched() == [t1]
    assert torch.equal(rg.demand(), want)
    with pytest.raises(RuntimeError, match="expected shape"):
        with rg.batch():
            rg.patch(t0, lambda v: v * 0)
            with rg.batch():
                rg.restore()
                rg.patch(t2, torch.zeros(3))  # refused: the wrong shape
    assert rg.patched() == [t1]
    assert torch.equal(rg.demand(), want)
    with rg.batch():  # an inner batch that failed and was caught inside the outer one: only its own undone
        rg.patch(t0, lambda v: v * 0)
        try:
            with rg.batch():
                rg.restore(t1)
                raise KeyError("inner")
        except KeyError:
            pass
    assert sorted(rg.patched()) == sorted([t0, t1])
    assert torch.equal(rg.demand(), _eager(model, x, {0: lambda v: v * 0, 1: lambda v: frozen}))
    rg.restore(t0)
    with pytest.raises(KeyError, match="graft") as e:  # a graft cannot be taken back: the note says it stands
        with rg.batch():
            rg.patch(t0, lambda v: v * 0)
            rg.graft(t2, lambda v: v * 2)
            raise KeyError("graft")
    assert any(f"its grafts (after {t2!r}) stand" in note for note in e.value.__notes__)
    assert rg.patched() == [t1]
    assert torch.equal(rg.demand(), _eager(model, x, {1: lambda v: frozen, 2: lambda v: v * 2}))
    rg.check_invariants()


@pytest.mark.internals
def test_demand_before_run_says_so():
    g = Graph.parse(synthetic.chain_text(3, "aten::sin.default", "f32[4]"))
    eng = torch_ext._C.Engine(g._g)
    with pytest.raises(RuntimeError, match="call run"):
        eng.demand()
    with pytest.raises(RuntimeError, match="call run"):
        eng.value("n1")


def test_training_mode_dropout_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)).train()
    with pytest.raises(ValueError, match="eval"):
        torch_ext.ReactiveGraph(model, (torch.randn(2, 4),))
    torch_ext.ReactiveGraph(model.eval(), (torch.randn(2, 4),))


def test_per_example_and_dict_metrics(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t1 = _tanh_nodes(rg)[1]
    sites = [(t1, p) for p in range(3)]
    r = torch_ext.sweep(rg, sites, _site_patch, lambda o: o.sum(dim=(1, 2)), progress=False)
    rb = torch_ext.sweep(rg, sites, _site_patch, lambda o: {"sum": o.sum(), "max": o.max()}, progress=False,
                         batch_sites=True)
    for (_, p) in sites:
        ref = _eager(model, x, {1: lambda o, p=p: _site_patch(o, (None, p))})
        assert torch.equal(r.metrics[(t1, p)], ref.sum(dim=(1, 2)))
        assert rb.metrics[(t1, p)]["max"] == pytest.approx(float(ref.max()), rel=1e-6)
    assert "metric.sum" in rb.to_pandas().columns


@pytest.mark.internals
def test_evaluate_patched_equals_patch_demand_rollback():
    """The sweep fast path gives the same outputs and counts as a transaction, and leaves the
    engine exactly as it was, on a DAG with fan-out, under a standing patch too."""
    text = """graph:
  %x : f32[8] = input()
  %a : f32[8] = aten::sin.default(%x)
  %b : f32[8] = aten::cos.default(%a)
  %c : f32[8] = aten::tanh.default(%a)
  %d : f32[8] = aten::mul.Tensor(%b, %c)
  %e : f32[8] = aten::exp.default(%d)
  %f : f32[8] = aten::add.Tensor(%e, %b)
  %g : f32[8] = aten::neg.default(%c)
  return (%f, %g)
"""
    eng = torch_ext._C.Engine(Graph.parse(text)._g)
    x = torch.randn(8)
    eng.run([x])
    clean = [t.clone() for t in eng.demand()]
    for standing in (None, "c"):
        if standing:
            eng.patch(standing, torch.full((8,), 0.3))
            eng.demand()
        for node in ["a", "b", "c", "d", "e"]:
            if node == standing:
                continue
            value = torch.linspace(-1, 1, 8)
            before = eng.stats()["evaluations"]
            fast = [t.clone() for t in eng.evaluate_patched(node, value)]
            fast_count = eng.stats()["evaluations"] - before
            eng.check_invariants()
            before = eng.stats()["evaluations"]
            eng.begin_transaction()
            eng.patch(node, value)
            slow = [t.clone() for t in eng.demand()]
            eng.rollback()
            slow_count = eng.stats()["evaluations"] - before
            assert fast_count == slow_count
            for f, s_ in zip(fast, slow):
                assert torch.equal(f, s_)
            eng.check_invariants()
            assert eng.num_dirty() == 0
        if standing is None:
            assert all(torch.equal(a, b) for a, b in zip(eng.demand(), clean))
    with pytest.raises(RuntimeError, match="pinned"):
        eng.evaluate_patched("c", torch.zeros(8))
    with pytest.raises(RuntimeError, match="shape"):
        eng.evaluate_patched("a", torch.zeros(3))


def test_one_graph_serves_several_prompt_lengths(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0 = _tanh_nodes(rg)[0]
    rg.graft(t0, lambda t: 2 * t)
    longer = torch.randn(2, 9, 8)
    out = rg.run(longer)
    assert out.shape == (2, 9, 8)
    assert torch.allclose(out, _eager(model, longer, {0: lambda o: 2 * o}), rtol=1e-6, atol=1e-6)
    assert rg.stats["graph_builds"] == 2 and rg.stats["graph_reuses"] == 0
    assert torch.equal(rg.run(x), rg.demand())  # back to the first shape: reused, graft still there
    assert torch.allclose(rg.demand(), _eager(model, x, {0: lambda o: 2 * o}), rtol=1e-6, atol=1e-6)
    assert rg.stats["graph_reuses"] == 1
    r = torch_ext.sweep(rg, [(_tanh_nodes(rg)[2], 1)], _site_patch, _metric, progress=False)
    assert len(r.metrics) == 1
    rg.patch(_tanh_nodes(rg)[1], torch.zeros_like(rg.value(_tanh_nodes(rg)[1])))
    with pytest.raises(ValueError, match="restore"):
        rg.run(longer)
    rg.check_invariants()


def test_set_cutoff_and_set_positions_hold_on_every_prompt_lengths_graph(resid):
    # Before: both settings were applied to the current shape's engine only. A graph for another prompt length was
    # built with the constructor's cutoff, and a graph switched back to kept its own old settings: the counts
    # (evaluations, cutoffs) and the sequence axes were those of a setting the user had turned off.
    model, x = resid
    longer = torch.randn(2, 9, 8)
    rg = torch_ext.ReactiveGraph(model, (x,), cutoff=False)
    rg.set_cutoff(True)
    rg.set_positions(False)
    for inputs in (longer, x, longer):
        rg.run(inputs)
        t0 = _tanh_nodes(rg)[0]
        assert rg.seq_axis(t0) == -1
        rg.reset_stats()
        rg.patch(t0, lambda v: v.clone())  # the same bits: its consumer `add` runs, the rest is cut off
        rg.demand()
        assert (rg.stats["evaluations"], rg.stats["cutoffs"]) == (1, len(rg.cone(t0)) - 1)
        rg.restore()
    rg.set_cutoff(False)
    rg.set_positions(True)
    for inputs in (x, longer):
        rg.run(inputs)
        t0 = _tanh_nodes(rg)[0]
        assert rg.seq_axis(t0) == 1
        rg.reset_stats()
        rg.patch(t0, lambda v: v.clone())
        rg.demand()
        assert (rg.stats["evaluations"], rg.stats["cutoffs"]) == (len(rg.cone(t0)), 0)
        rg.restore()
    assert rg.stats["graph_builds"] == 2
    rg.check_invariants()


def test_graft_of_the_wrong_dtype_is_refused_for_its_type(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0 = _tanh_nodes(rg)[0]
    before = str(rg)
    with pytest.raises(RuntimeError, match="type") as err:
        rg.graft(t0, lambda t: t.double())
    assert "dead code" not in str(err.value)
    assert str(rg) == before  # a refused graft changes nothing
    rg.check_invariants()


class _Chain(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = torch.relu(x) + 0.5
        return x


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(2, 59), min_size=1, max_size=4, unique=True), st.randoms(use_true_random=False))
def test_batch_grafts_in_any_order_cost_the_batch_formula(sites, rnd):
    """Edge grafts at random positions, in a random order, inside one rg.batch(): nothing runs before
    the demand, and the demand costs |U D0(w_k)| + sum h_k (cost-model.md), through the Python API."""
    rg = torch_ext.ReactiveGraph(_Chain(30), (torch.randn(4),))
    names = rg.nodes()  # relu_i, add_i alternating: 60 nodes
    order = list(sites)
    rnd.shuffle(order)
    rg.reset_stats()
    with rg.batch():
        for i in order:
            rg.graft(names[i - 1], names[i], lambda t: torch.cos(torch.sin(t)))
    assert rg.stats["evaluations"] == 0
    out = rg.demand()
    assert rg.stats["evaluations"] == (len(names) - min(sites)) + 2 * len(sites)
    x = rg._last_inputs[0][0]
    ref = x
    for k, name in enumerate(names):
        ref = torch.relu(ref) if name.startswith("relu") else ref + 0.5
        if k + 1 in sites:
            ref = torch.cos(torch.sin(ref))
    assert torch.equal(out, ref)
    rg.check_invariants()


def test_early_cutoff_tells_a_negative_zero_from_a_positive_one():
    # Cutoff compared recomputed values with ==, for which -0.0 equals 0.0: the sweep below cut off
    # at `mul` and answered 1/+0 = +inf where the patched graph gives 1/-0 = -inf.
    class M(nn.Module):
        def forward(self, x):
            return torch.reciprocal(torch.relu(x) * 1.0)

    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]])
    rg = torch_ext.ReactiveGraph(M(), (x,), cutoff=True, positions=False)
    flip = lambda clean, site: torch.where(clean == 0, torch.tensor(-0.0), clean)  # noqa: E731
    result = torch_ext.sweep(rg, ["relu"], flip, lambda out: float(out.sum()), progress=False)
    assert result.metrics["relu"] == float("-inf")
    rg.check_invariants()


@pytest.mark.parametrize("how", ["data", "numpy", "storage", "out"])
@pytest.mark.parametrize("entry", ["sweep", "patch"])
def test_patch_function_writing_through_data_or_numpy_cannot_corrupt_the_cache(resid, how, entry):
    # .data and .numpy() share the cached tensor's memory but not its version counter: the write was
    # invisible, stayed in the cache, and every later sweep reading the node answered from it. The sweep
    # loop hands over a copy-on-write copy: a write through its storage or an out= argument must also
    # land in memory of the function's own.
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)

    def sneaky(act, site=None):
        if how == "data":
            act.data.mul_(3.0)
        elif how == "numpy":
            act.numpy()[...] *= 3.0
        elif how == "storage":
            act.detach().untyped_storage().copy_(torch.zeros_like(act).untyped_storage())
        else:
            torch.mul(act.data, 3.0, out=act.data)
        return torch.zeros_like(act)

    resid0 = [n for n in rg.nodes() if n.startswith("add")][0]  # x + tanh(fc0(x)): add_1 reads it
    if entry == "sweep":
        torch_ext.sweep(rg, [(resid0, 0)], sneaky, _metric, progress=False)
    else:
        rg.patch(resid0, sneaky)
        rg.demand()
        rg.restore()
    sites = [(t1, p) for p in range(5)]
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False)
    for (_, p) in sites:
        ref = _eager(model, x, {1: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t1, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5), p
    assert torch.equal(rg.demand(), model(x))
    rg.check_invariants()


_SWEEP_PATHS = {
    # name: (sweep keyword arguments, standing patch on tanh_0)
    "cpp_rows": ({}, False),  # the C++ per-site loop, token-granular rows (row buffers reused across sites)
    "cpp_whole": ({"positions": False}, False),  # the C++ per-site loop, whole cones
    "transaction": ({}, True),  # a standing patch: the Python transaction path
    "batched_rows": ({"batch_sites": True}, False),
    "batched_whole": ({"batch_sites": True, "positions": False}, False),
    "batched_pinned": ({"batch_sites": True}, True),
}


@pytest.mark.parametrize("path", list(_SWEEP_PATHS))
@pytest.mark.parametrize("how", ["data", "numpy"])
def test_metric_writing_through_data_cannot_corrupt_the_cache(resid, path, how):
    # A write through .data or .numpy() shares the memory but not the version counter: handed the cached
    # outputs (or, on the row path, row buffers reused across sites; batched, slices of the batched
    # outputs), such a metric corrupted the cache unseen, and every later site and demand read it.
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    kwargs, pinned = _SWEEP_PATHS[path]
    standing = {}
    if pinned:
        rg.patch(t0, torch.full_like(rg.value(t0), 0.5))
        standing = {0: lambda o: torch.full_like(o, 0.5)}
    sites = [(t1, p) for p in range(5)] + [(t2, p) for p in range(5)]
    if pinned:  # sites on the pinned node take the transaction path (patched over the standing patch)
        sites += [(t0, p) for p in range(5)]

    def sneaky(out):
        value = float(out.sum())
        if how == "data":
            out.data.mul_(0)
        else:
            out.numpy()[...] = 0
        return value

    first = torch_ext.sweep(rg, sites, _site_patch, sneaky, progress=False, **kwargs)
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, **kwargs)
    for (node, p) in sites:
        at = [t0, t1, t2].index(node)
        under = standing.get(at, lambda o: o)
        ref = _eager(model, x, {**standing, at: lambda o, p=p, under=under: _site_patch(under(o), (None, p))})
        assert first.metrics[(node, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5), (node, p)
        assert result.metrics[(node, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5), (node, p)
    assert torch.equal(rg.demand(), _eager(model, x, standing))
    rg.check_invariants()


class _ReluChain(nn.Module):
    """relu(linear(x)) four times: nodes linear, relu, linear_1, relu_1, ..., relu_3 (the output)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for fc in self.fc:
            x = torch.relu(fc(x))
        return x


@pytest.mark.parametrize("batched", [False, True])
def test_sweep_predicts_the_cones_a_standing_patch_cuts_off(batched):
    # predicted_evaluations summed the cones as if nothing were pinned (36 and 12 here, measured 21 and 9):
    # a pinned node keeps its value, so a site's cone stops there.
    x = torch.randn(2, 3, 8)
    rg = torch_ext.ReactiveGraph(_ReluChain().eval(), (x,))
    relus = ["relu", "relu_1", "relu_2", "relu_3"]
    assert [len(rg.cone(n)) for n in relus] == [6, 4, 2, 0]
    rg.patch("relu_1", lambda v: v * 0.5)
    rg.demand()
    sites = [(n, p) for n in relus for p in range(3)]
    r = torch_ext.sweep(rg, sites, position_patch(0.0), lambda o: float(o.sum()), progress=False,
                        batch_sites=batched)
    # Per site, one at a time: relu -> {linear_1} (relu_1 is pinned), relu_1 -> 4 (a pinned site is patched
    # over its standing patch), relu_2 -> 2, relu_3 -> 0. Batched, relu's cone keeps no node that reaches an
    # output (linear_1 feeds only the pinned relu_1): its three sites run one at a time, 1 each.
    expected = 3 * (1 + 4 + 2 + 0) if not batched else 3 * 1 + 4 + 2 + 0
    assert r.measured_evaluations == r.predicted_evaluations == expected
    assert rg.patched() == ["relu_1"]
    rg.check_invariants()


class _Tempered(nn.Module):
    """A softmax temperature and a Dropout: Python values the trace holds fixed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.drop, self.tau = nn.Linear(8, 8), nn.Dropout(0.5), 1.0

    def forward(self, x):
        return torch.softmax(self.drop(self.fc(x)) / self.tau, -1)


_TEMPERED_FORWARD = _Tempered.forward


@pytest.mark.parametrize("change", ["temperature", "train_mode"])
def test_run_refuses_module_attributes_changed_after_build(change):
    # Before: run() computed with the traced temperature (max |difference| 0.53 against the eager
    # forward) or without the dropout eager now applies, silently.
    model = _Tempered().eval()
    x = torch.randn(2, 3, 8)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    if change == "temperature":
        model.tau = 0.25
        message = r"model.tau is 0.25 now, 1.0 when this ReactiveGraph was built"
    else:
        model.train()
        message = r"model.training is True \(train mode\) now, False .*and 2 more"
    with torch.no_grad():
        assert not torch.equal(model(x), rg._engine.demand()[0])  # eager follows the change; the graph does not
    with pytest.raises(ValueError, match=message):
        rg.run(x)
    # demand() (and so a sweep) refuses too: it handed out the stale graph's outputs, unlike eager.
    with pytest.raises(ValueError, match="demand: " + message):
        rg.demand()
    # So do the other reads: value(), values() and baseline() handed out the traced graph's values.
    node = rg.nodes()[-1]
    for where, read in (("value", lambda: rg.value(node)), ("values", lambda: rg.values([node])),
                        ("baseline", lambda: rg.baseline(node))):
        with pytest.raises(ValueError, match=f"{where}: " + message):
            read()
    model.eval()
    model.tau = 1.0  # changed back: the graph is right again
    assert torch.equal(rg.run(x), model(x))



@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "global_forward_hook", "removed"])
def test_run_and_demand_refuse_forward_hooks_changed_after_build(kind):
    # Before: a forward hook registered after the build was silently ignored by run() (and a traced one
    # removed later still acted in the graph), while eager calls followed the change.
    from torch.nn.modules import module as module_mod

    model = _Tempered().eval()
    x = torch.randn(2, 3, 8)
    traced = model.fc.register_forward_hook(lambda m, a, out: out * 3) if kind == "removed" else None
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.run(x).clone()
    if kind == "forward_hook":
        handle = model.fc.register_forward_hook(lambda m, a, out: out * 2)
        message = r"module 'fc' \(Linear\) has a hook registered \(register_forward_hook\) after this ReactiveGraph"
    elif kind == "forward_pre_hook":
        handle = model.fc.register_forward_pre_hook(lambda m, a: (a[0] + 1,))
        message = r"module 'fc' \(Linear\) has a hook registered \(register_forward_pre_hook\)"
    elif kind == "global_forward_hook":
        handle = module_mod.register_module_forward_hook(
            lambda m, a, out: out * 2 if isinstance(m, nn.Linear) else None)
        message = r"every module has a hook registered \(register_module_forward_hook\)"
    else:
        traced.remove()
        handle = None
        message = r"a hook on module 'fc' \(Linear\) \(register_forward_hook\) was removed after this ReactiveGraph"
    try:
        with torch.no_grad():
            assert not torch.equal(model(x), clean)  # eager follows the change
        with pytest.raises(ValueError, match="run: " + message):
            rg.run(x)
        with pytest.raises(ValueError, match="demand: " + message):
            rg.demand()
        node = rg.nodes()[-1]  # before: value(), values() and baseline() answered as if nothing had changed
        for where, read in (("value", lambda: rg.value(node)), ("values", lambda: rg.values([node])),
                            ("baseline", lambda: rg.baseline(node))):
            with pytest.raises(ValueError, match=f"{where}: " + message):
                read()
    finally:
        if handle is not None:
            handle.remove()
    if kind == "removed":
        model.fc.register_forward_hook(lambda m, a, out: out * 3)  # an equal hook again: still refused (a new one)
        with pytest.raises(ValueError, match=r"has a hook registered"):
            rg.run(x)
        return
    assert torch.equal(rg.run(x), clean)  # changed back: the graph is right again
    other = nn.Linear(2, 2)
    other.register_forward_hook(lambda m, a, out: out)  # hooks on another module are not this graph's
    assert torch.equal(rg.run(x), clean)


STEER_SCALE = 2.0  # a module-level knob a hook reads


@pytest.mark.parametrize("kind", ["closure", "object", "global"])
def test_run_and_demand_refuse_a_traced_hooks_values_changed_after_build(kind):
    # "global": a hook reading a module-level name was checked against a copy of the name taken at the build
    # (never against the module's own globals), so `STEER_SCALE = 3.0` went unseen.
    global STEER_SCALE
    # The graph holds the values a forward hook read when traced. Before: after the user turned a steering
    # knob (a closure's scale[0], a hook object's alpha), run() and demand() answered with the traced value,
    # silently, where eager calls follow the change.
    model = _Tempered().eval()
    x = torch.randn(2, 3, 8)
    scale, steer = [2.0], Steer(2.0)
    hook = {"closure": lambda m, a, out: out * scale[0], "object": steer,
            "global": lambda m, a, out: out * STEER_SCALE}[kind]
    model.fc.register_forward_hook(hook)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.run(x).clone()
    if kind == "closure":
        scale[0] = 3.0
        message = r"forward hook <lambda> on module 'fc' \(Linear\): 'scale' is \[3.0\] now, \[2.0\] when this"
    elif kind == "global":
        STEER_SCALE = 3.0
        message = r"forward hook <lambda> on module 'fc' \(Linear\): 'STEER_SCALE' is 3.0 now, 2.0 when this"
    else:
        steer.alpha = 3.0
        message = r"forward hook Steer on module 'fc' \(Linear\): 'alpha' is 3.0 now, 2.0 when this"
    with torch.no_grad():
        assert not torch.equal(model(x), clean)  # eager follows the change
    with pytest.raises(ValueError, match="run: " + message):
        rg.run(x)
    with pytest.raises(ValueError, match="demand: " + message):
        rg.demand()
    scale[0], steer.alpha, STEER_SCALE = 2.0, 2.0, 2.0  # changed back: the graph is right again
    assert torch.equal(rg.run(x), clean)


@pytest.mark.parametrize("front_end", ["make_fx", "export"])
def test_a_forward_hook_that_stores_activations_is_refused_at_build(front_end):
    # Hooks run while the forward is traced, never when the graph runs. Before: a hook that keeps its module's
    # output (acts[name] = out) was left holding a FakeTensor of the trace, and run() never stored anything.
    model = _Tempered().eval()
    acts = {}
    model.fc.register_forward_hook(lambda m, a, out: acts.__setitem__("fc", out))
    with pytest.raises(ValueError, match=r"forward hook <lambda> on module 'fc' \(Linear\) stored a tensor of the "
                                         r"trace in 'acts'.*run_with_cache"):
        torch_ext.ReactiveGraph(model, (torch.randn(2, 3, 8),), cache=False, front_end=front_end)


class _Keeps:
    """A hook object that keeps its module's last output and counts its calls."""

    def __init__(self, keep=True):
        self.keep, self.calls, self.last = keep, 0, None

    def __call__(self, m, a, out):
        self.calls += 1
        if self.keep:
            self.last = out


_KEPT = {"acts": {"old": 1}, "outs": [], "shapes": [], "count": {"n": 0}}


def _hook_writing(kind):
    """(hook, what it writes into) for a forward hook that writes Python state while traced."""
    if kind == "dict":
        return (lambda m, a, out: _KEPT["acts"].__setitem__("fc", out)), _KEPT["acts"]
    if kind == "list":
        return (lambda m, a, out: _KEPT["outs"].append(out.detach())), _KEPT["outs"]
    if kind == "hook-object":
        h = _Keeps()
        return h, h.__dict__
    if kind == "module-attribute":
        return (lambda m, a, out: setattr(m, "kept", out)), None
    if kind == "counter":
        return (lambda m, a, out: _KEPT["count"].__setitem__("n", _KEPT["count"]["n"] + 1)), _KEPT["count"]
    if kind == "shape-log":
        return (lambda m, a, out: _KEPT["shapes"].append(tuple(out.shape))), _KEPT["shapes"]
    h = _Keeps(keep=False)  # counts only
    return h, h.__dict__


def _build(how, model, x):
    if how == "step":
        return torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         lambda m, x: m(x).square().mean(), (x,))
    return torch_ext.ReactiveGraph(model.eval(), (x,), cache=False)


def _state_of(written, model):
    own = {k: v for k, v in vars(model.fc).items() if not k.startswith("_")}
    if written is None:
        return own
    return (dict(written) if isinstance(written, dict) else list(written)), own


@pytest.mark.parametrize("how", ["step", "ReactiveGraph"])
@pytest.mark.parametrize("kind, refused", [("dict", True), ("list", True), ("hook-object", True),
                                           ("module-attribute", True), ("counter", False), ("shape-log", False),
                                           ("hook-object-counter", False)])
def test_a_build_leaves_what_a_forward_hook_writes_as_it_found_it(kind, refused, how):
    # The trace runs the hooks once, the program never. Before: a refused build left a FakeTensor of the trace in
    # the user's dict (acts["fc"]), list or hook object; an accepted one left a counter counting a call that never
    # ran, a log holding the trace's entry, and a module attribute (module.kept = out) holding a FakeTensor.
    model = _Tempered() if how == "step" else _Tempered().eval()
    x = torch.randn(2, 3, 8)
    hook, written = _hook_writing(kind)
    model.fc.register_forward_hook(hook)
    before = _state_of(written, model)
    if refused:
        with pytest.raises(ValueError, match=r"stored a tensor of the trace in .*(run_with_cache|aux)"):
            _build(how, model, x)
    else:
        _build(how, model, x)
    after = _state_of(written, model)
    assert after == before if written is None else (
        after[1] == before[1] and len(after[0]) == len(before[0])
        and all((a is b) if not isinstance(a, tuple) else a == b for a, b in zip(
            after[0].values() if isinstance(after[0], dict) else after[0],
            before[0].values() if isinstance(before[0], dict) else before[0]))), (before, after)


@pytest.mark.parametrize("how", ["step", "ReactiveGraph"])
@pytest.mark.parametrize("where", ["attribute", "list", "dict"])
def test_a_forward_that_stores_activations_on_its_module_is_refused(where, how):
    # Before: a step accepted it, with the module holding a FakeTensor of the trace (self.attn = weights, a list
    # appended to, a dict), and no step ever storing a value there where eager stores each call's; a ReactiveGraph
    # accepted the attribute (put back, never stored by a run).
    class Stores(_Tempered):
        def __init__(self):
            super().__init__()
            self.maps, self.d = [], {}

        def forward(self, x):
            h = self.fc(x)
            if where == "attribute":
                self.attn = torch.softmax(h, -1)
            elif where == "list":
                self.maps.append(h)
            else:
                self.d["h"] = h
            return h

    model = Stores()
    with pytest.raises(ValueError, match=r"forward stored a tensor of the trace in model\.(attn|maps|d) "):
        _build(how, model, torch.randn(2, 3, 8))
    assert "attn" not in vars(model) and model.maps == [] and model.d == {}


class _HoldsTensors(nn.Module):
    """Tensors held in a list and in a dict attribute: constants of the trace."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.shifts, self.table = nn.Linear(8, 8), [torch.ones(8)], {"bias": torch.zeros(8)}

    def forward(self, x):
        return self.fc(x) + self.shifts[0] * self.table["bias"].exp()


@pytest.mark.parametrize("how", ["step", "ReactiveGraph"])
@pytest.mark.parametrize("where", ["list", "dict", "shrunk"])
def test_a_tensor_replaced_in_a_list_or_dict_attribute_after_the_build_is_refused(where, how):
    # Before: the trace baked model.shifts[0] and model.table["bias"] in; replaced after the build, eager computed
    # with the new tensor and the step / graph with the old one, silently.
    model = _HoldsTensors()
    x = torch.randn(2, 3, 8)
    built = _build(how, model, x)
    run = (lambda: built(built.init_state(), x)[0]) if how == "step" else (lambda: built.run(x))
    run()
    if where == "list":
        model.shifts[0] = torch.full((8,), 2.0)
        name = r"model\.shifts\[0\] was replaced"
    elif where == "dict":
        model.table["bias"] = torch.full((8,), 2.0)
        name = r"model\.table\['bias'\] was replaced"
    else:
        model.shifts.clear()
        name = r"model\.shifts\[0\] was replaced by \(none\)"
    with pytest.raises(ValueError, match=name):
        run()


@pytest.mark.parametrize("demanded", [False, True])
def test_patch_function_below_a_standing_patch_gets_the_baseline_in_either_order(demanded):
    # "f receives the node's baseline value (no patch active)". Before: with a patch upstream not yet
    # demanded, patch(node, f) raised "baseline of %relu_2 is not cached while patches are active",
    # though the node still held its baseline; the other order (or a demand in between) worked.
    x = torch.randn(2, 3, 8)
    model = _ReluChain().eval()
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.value("relu_2").clone()
    seen = []

    def half(v):
        seen.append(v.clone())
        return v * 0.5

    rg.patch("relu", lambda v: v * 0)
    if demanded:
        rg.demand()
    rg.patch("relu_2", half)
    assert torch.equal(seen[-1], clean)
    assert torch.equal(rg.baseline("relu_2"), clean)
    upstream_first = rg.demand().clone()
    rg.restore()
    rg.patch("relu_2", half)
    rg.patch("relu", lambda v: v * 0)
    assert torch.equal(seen[-1], clean)
    assert torch.equal(rg.demand(), upstream_first)
    rg.check_invariants()
    # Eager reference: relu_2 (the third block's output) pinned to half its clean value.
    with torch.no_grad():
        ref = torch.relu(model.fc[3](clean * 0.5))
    assert torch.equal(upstream_first, ref)
    rg.restore()
    assert torch.equal(rg.value("relu_2"), clean)


@pytest.mark.parametrize("change", ["submodule", "forward", "class_forward", "parameter"])
def test_run_refuses_a_submodule_or_forward_replaced_after_build(change):
    # Before: run() kept computing with the traced submodule / forward / the parameter object it was
    # built with, while eager used the new one.
    model = _Tempered().eval()
    x = torch.randn(2, 3, 8)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.run(x).clone()
    traced = model.fc
    if change == "submodule":
        model.fc = nn.Linear(8, 8)
        message = r"run: model.fc was replaced by a Linear module \(when this ReactiveGraph was built: a Linear module\)"
    elif change == "forward":
        model.forward = lambda x: torch.softmax(model.fc(x) * 2, -1)
        message = r"run: model.forward was replaced by <function"
    elif change == "class_forward":  # reaches every instance of the class
        _Tempered.forward = lambda self, x: torch.softmax(self.fc(x) * 2, -1)
        message = r"run: test_reactive_safety._Tempered.forward \(on the class\) was replaced by <function"
    else:
        traced_weight = model.fc.weight
        model.fc.weight = nn.Parameter(traced_weight.detach() * 2)
        message = r"run: model.fc.weight was replaced by a tensor of shape \(8, 8\)"
    try:
        with torch.no_grad():
            assert not torch.equal(model(x), clean)  # eager follows the change
        with pytest.raises(ValueError, match=message):
            rg.run(x)
    finally:
        _Tempered.forward = _TEMPERED_FORWARD
    model.fc = traced
    model.__dict__.pop("forward", None)
    if change == "parameter":
        model.fc.weight = traced_weight
    assert torch.equal(rg.run(x), clean)


def test_run_on_new_inputs_while_patched_is_refused_not_silently_unpatched():
    # Before, run(x2) with a standing patch made a clean baseline and dropped the patch: the outputs
    # were the unpatched model's, where a forward hook (what a user holding a patch expects) still acts.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    rg = torch_ext.ReactiveGraph(m, (x1,))
    rg.patch("linear", lambda v: v * 2)
    patched = rg.demand().clone()
    with pytest.raises(ValueError, match=r"run: patches are active at \['linear'\].*restore\(\) first"):
        rg.run(x2)
    with pytest.raises(ValueError, match=r"patches are active"):
        rg.run_with_cache(x2)
    assert torch.equal(rg.demand(), patched)  # refused before anything changed
    rg.restore()
    with torch.no_grad():
        assert torch.equal(rg.run(x2), m(x2))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("positions", [False, True])
def test_a_weight_edited_in_place_is_seen_by_demand_value_and_sweeps(resid, batched, positions):
    """A weight edit (ROME-style ``W.add_(...)``, or a fine-tuning step) after the build: demand(),
    value() and sweeps (batched cones built before the edit included) answer for the edited model.
    Before, demand() returned the outputs cached from the old weights, silently."""
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    sites = [(t1, p) for p in range(5)]
    torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=batched, positions=positions)
    before = rg.stats["evaluations"]
    with torch.no_grad():
        model.fc[2].weight.mul_(1.5)
    assert torch.equal(rg.demand(), model(x))
    assert rg.stats["evaluations"] - before == len(rg.cone("p_fc_2_weight"))  # exactly the edited weight's cone
    with torch.no_grad():
        model.fc[1].bias.add_(0.25)
    assert torch.equal(rg.value(t1), torch.tanh(model.fc[1](model.fc[0](x).tanh() + x)))
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=batched, positions=positions)
    for (_, p) in sites:
        ref = _eager(model, x, {1: lambda o, p=p: _site_patch(o, (None, p))})
        assert result.metrics[(t1, p)] == pytest.approx(float(ref.sum()), rel=1e-6, abs=1e-5)
    rg.check_invariants()


def test_a_weight_edited_under_a_standing_patch_restores_to_the_new_baseline(resid):
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    rg.patch(t1, torch.zeros_like(rg.value(t1)))
    rg.demand()
    with torch.no_grad():
        model.fc[0].weight.mul_(-1)  # upstream of the patch: its cone's baselines are stale
        model.fc[2].bias.add_(1)     # downstream of it
    assert torch.equal(rg.demand(), _eager(model, x, {1: torch.zeros_like}))
    rg.restore()
    assert torch.equal(rg.demand(), model(x))
    rg.check_invariants()


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("where", ["patch", "metric"])
def test_a_sweep_callback_writing_into_the_model_is_refused(resid, batched, where):
    """A patch function or metric that edits a weight would change the model under every later site
    (and, taken as an edit, mix two models in one table): refused, naming the input."""
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)

    def edit():
        with torch.no_grad():
            model.fc[2].bias.add_(1.0)

    def patch(v, s):
        if where == "patch":
            edit()
        return _site_patch(v, s)

    def metric(out):
        if where == "metric":
            edit()
        return out.sum()

    with pytest.raises(RuntimeError, match=r"input %p_fc_2_bias of the graph .* was written in place during a sweep"):
        torch_ext.sweep(rg, [(t1, p) for p in range(5)], patch, metric, progress=False, batch_sites=batched)
    assert rg.patched() == []
    assert torch.equal(rg.demand(), model(x))  # the write is then an edit like any other
    rg.check_invariants()


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("how", ["data_mul", "data_row", "numpy", "input_data", "input_numpy"])
def test_sweep_sees_weights_written_where_the_version_does_not_move(resid, how, batched):
    """``fc.weight.data.mul_(2)`` (``.data`` has a version counter of its own), a row written through
    ``.data`` or through ``.numpy()``: the engine, which takes in-place edits by version (I15), kept the
    outputs cached from the old weights and the sweep measured them; the same for the graph's input. A
    sweep compares inputs and weights by content first and takes a changed one as an edit."""
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    w = model.fc[1].weight
    if how == "data_mul":
        w.data.mul_(2.0)
    elif how == "data_row":
        w.data[3] = 0.25
    elif how == "numpy":
        w.detach().numpy()[0, 0] += 1.0
    elif how == "input_data":  # the graph's input, after run(): the same object, other values
        x.data[1, 2] = -1.0
    else:
        x.numpy()[0, 4, :3] = 2.0
    sites = [(t2, p) for p in range(5)]
    result = torch_ext.sweep(rg, sites, _site_patch, _metric, progress=False, batch_sites=batched)
    with torch.no_grad():
        assert result.clean_metric == float(model(x).sum())
        for (_, p) in sites:
            ref = _eager(model, x, {2: lambda o, p=p: _site_patch(o, (None, p))})
            assert result.metrics[(t2, p)] == float(ref.sum())
        assert torch.equal(rg.demand(), model(x))  # the edit was taken: later reads agree too
    rg.check_invariants()


@pytest.mark.parametrize("read", ["demand", "value", "values", "baseline", "patched_demand"])
@pytest.mark.parametrize("how", ["data_mul", "numpy", "input_data"])
def test_demand_and_value_see_writes_where_the_version_does_not_move(resid, how, read):
    """rg.demand() / rg.value() / rg.baseline() after ``w.data.mul_(2)`` (or a write through ``.numpy()``, or
    into the input's ``.data``) handed out the values cached from the old weights: only run(), sweep and
    patching compared contents. Every read now compares them once per call (a fast content digest)."""
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    w = model.fc[1].weight
    if how == "data_mul":
        w.data.mul_(2.0)
    elif how == "numpy":
        w.detach().numpy()[0, 0] += 1.0
    else:
        x.data[1, 2] = -1.0
    with torch.no_grad():
        want = model(x)
        if read == "demand":
            assert torch.equal(rg.demand(), want)
        elif read in ("value", "baseline", "values"):
            seen = {}
            _eager(model, x, {0: lambda o: seen.setdefault(t0, o), 2: lambda o: seen.setdefault(t2, o)})
            got = rg.values([t0, t2]) if read == "values" else {t: getattr(rg, read)(t) for t in (t0, t2)}
            assert torch.equal(got[t0], seen[t0]) and torch.equal(got[t2], seen[t2])
            assert torch.equal(rg.demand(), want)
        else:
            rg.patch(t0, lambda v: v * 0.5)
            ref = _eager(model, x, {0: lambda o: o * 0.5})
            assert torch.equal(rg.demand(), ref)
            rg.restore()
            assert torch.equal(rg.demand(), want)
    rg.check_invariants()


def test_values_compares_contents_once_for_all_names_and_again_at_the_next_call(resid, monkeypatch):
    """rg.values(names) reads many nodes with one content comparison of the weights (rg.value per name paid a
    pass over every weight byte per name); a write through .data between two calls is still seen."""
    import torch_ext.reactive as reactive

    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t0, t1, t2 = _tanh_nodes(rg)
    calls = []
    digest = reactive._contents_digest
    monkeypatch.setattr(reactive, "_contents_digest", lambda ts: calls.append(len(ts)) or digest(ts))
    rg.values(rg.nodes())
    assert len(calls) == 1
    model.fc[1].weight.data.mul_(2.0)  # between two calls: no version counter moves
    seen = {}
    with torch.no_grad():
        _eager(model, x, {i: (lambda o, i=i: seen.setdefault(i, o)) for i in range(3)})
    got = rg.values([t0, t1, t2])
    assert len(calls) == 2
    assert all(torch.equal(got[t], seen[i]) for i, t in enumerate((t0, t1, t2)))
    with pytest.raises(TypeError, match="values: expected node or hook names"):
        rg.values([t0, 3])
    rg.check_invariants()


class _Options(nn.Module):
    """forward(x, scale, flag): non-tensor inputs the trace computes with as constants."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0, flag=False):
        y = self.lin(x) * scale
        return torch.tanh(y) if flag else y


def test_run_with_other_non_tensor_inputs_moves_to_their_graph():
    """run(x, scale=3.0) on a graph built with scale=2.0 computed with 2.0 (the shape key held None for
    every non-tensor input), as did run(x, 5.0) for a positional one: now each value has its graph."""
    model, x = _Options().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(model, (x,), example_kwargs={"scale": 2.0, "flag": False})
    with torch.no_grad():
        for kwargs in ({"scale": 3.0, "flag": False}, {"scale": 2.0, "flag": True}, {"scale": 2.0, "flag": False}):
            assert torch.equal(rg.run(x, **kwargs), model(x, **kwargs)), kwargs
        assert rg.stats["graph_builds"] == 3 and rg.stats["graph_reuses"] == 1
        positional = torch_ext.ReactiveGraph(model, (x, 3.0))
        assert torch.equal(positional.run(x, 5.0), model(x, 5.0))
        # While a patch is active another value is refused, as any run is.
        rg.patch(rg.nodes("linear*")[0], torch.zeros(2, 4))
        with pytest.raises(ValueError, match="patches are active"):
            rg.run(x, scale=4.0, flag=False)
        rg.restore()
        assert torch.equal(rg.run(x, flag=False, scale=3.0), model(x, scale=3.0, flag=False))  # keyword order: no meaning
        assert rg.stats["graph_builds"] == 3


_GAIN = 1.0
_CALLS = 0
_SHAPES: list = []
_SETTINGS = types.ModuleType("_torch_ext_safety_settings")  # a user module read by attribute
_SETTINGS.SHIFT = 0.0


class _Config:  # a user class read as a namespace
    SCALE = 1.0


def _gained(t):
    return t * _GAIN * _Config.SCALE


class _ReadsGlobals(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        global _CALLS
        _CALLS += 1  # bookkeeping the forward assigns: not a constant of the trace, not checked
        _SHAPES.append(tuple(x.shape))  # nor a log it appends to
        return _gained(self.lin(x)) + _SETTINGS.SHIFT


@pytest.mark.parametrize("change", ["global_of_a_helper", "user_module_attribute", "helper_replaced",
                                    "user_class_attribute"])
def test_run_and_demand_refuse_module_level_values_changed_after_build(change, monkeypatch):
    """A module-level constant the forward reads (directly, through a helper, or as config.SHIFT of a user
    module) changed after the build: eager calls use the new value, the graph held the old one and run(),
    demand() and sweep() answered with it, silently (1.0 off here)."""
    model, x = _ReadsGlobals().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    with torch.no_grad():
        model(x)  # the counter moves: no refusal
    assert torch.equal(rg.run(x), model(x))
    if change == "global_of_a_helper":
        monkeypatch.setitem(globals(), "_GAIN", 2.0)
    elif change == "user_module_attribute":
        monkeypatch.setattr(_SETTINGS, "SHIFT", 1.0)
    elif change == "user_class_attribute":  # before: not looked at, so run(), demand() and value() answered 1.0 off
        monkeypatch.setattr(_Config, "SCALE", 2.0)
    else:
        monkeypatch.setitem(globals(), "_gained", lambda t: -t)
    for call in (rg.demand, lambda: rg.run(x),
                 lambda: torch_ext.sweep(rg, [rg.nodes("linear*")[0]], lambda v, s: v, sum_metric, progress=False)):
        with pytest.raises(ValueError, match="a module-level value the traced code reads"):
            call()
    with pytest.raises(ValueError, match=r"value: .*a module-level value the traced code reads"):
        rg.value(rg.nodes()[-1])
    monkeypatch.undo()
    assert torch.equal(rg.run(x), model(x))  # changed back: computes again


class _Mode(nn.Module):
    """forward(x, mode: str): a string input the trace computes with as a constant."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mode: str = "plain"):
        y = self.lin(x)
        return torch.tanh(y) * 2 if mode == "tanh" else y


def test_string_inputs_are_imported_as_the_constants_they_are(tmp_path, monkeypatch):
    """forward(x, mode="tanh"): the importer refused the program ("value of type str is not supported"). A
    string input is specialised by export (nothing in the graph reads it): each value has its graph (a
    module's graph moves to it, an ExportedProgram refuses another value), the disk cache included."""
    monkeypatch.setenv("TORCH_EXT_CACHE_DIR", str(tmp_path))
    model, x = _Mode().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(model, (x,), example_kwargs={"mode": "tanh"})
    assert rg.build_stats["disk_cache"] == "stored"
    with torch.no_grad():
        for mode in ("tanh", "plain", "tanh"):
            assert torch.equal(rg.run(x, mode=mode), model(x, mode=mode)), mode
        ep = torch.export.export(model, (x,), {"mode": "tanh"})
        rg = torch_ext.ReactiveGraph(ep)
        assert torch.equal(rg.run(x, mode="tanh"), model(x, mode="tanh"))
        with pytest.raises(ValueError, match="exported with the constant 'tanh'"):
            rg.run(x, mode="plain")


def test_a_submodule_added_after_the_build_is_refused(resid):
    """``model.fc.append(nn.Linear(8, 8))`` after the build: eager iterates the new layer, the graph never ran
    it, and demand() handed back the old outputs silently (submodules were checked by identity, per name
    present at the build; a new name was not seen). Patching rebuilds its graph instead."""
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    model.fc.append(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"model\.fc has submodules \(0, 1, 2, 3\) now, submodules \(0, 1, 2\) when"):
        rg.demand()
    with pytest.raises(ValueError, match="submodules"):
        rg.run(x)
    del model.fc[3]
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))  # as built again


class _RebindsBuffer(nn.Module):
    """forward rebinds its buffer ``prev`` (to the same shape, or to another): eager's next call reads it."""

    def __init__(self, shape=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("prev", torch.zeros(4))
        self.shape = shape

    def forward(self, x):
        y = self.lin(x) + self.prev
        self.prev = y.mean(0).detach() if self.shape is None else y.detach().reshape(self.shape)
        return y


class _WritesPlainTensor(nn.Module):
    """forward writes in place into ``ema``, a tensor attribute that is neither a parameter nor a buffer."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.ema = torch.zeros(4)
        self.how = how

    def forward(self, x):
        y = self.lin(x) + self.ema
        if self.how == "no_grad":
            with torch.no_grad():
                self.ema.mul_(0.5).add_(1.0)
        else:
            self.ema.copy_(y.mean(0).detach())
        return y


@pytest.mark.parametrize("front_end", ["auto", "export"])
@pytest.mark.parametrize("how", ["copy", "no_grad"])
def test_graph_refuses_a_forward_writing_a_plain_tensor_attribute(front_end, how):
    """Only the pure step refused this; the inference trace treats ``ema`` as a constant and dropped the write
    (torch's 'Constant ema is mutated', or, under no_grad, an engine error about dead code), where eager's next
    call reads the new value. Refused naming it, as the step does; the model is left as it was."""
    model, x = _WritesPlainTensor(how).eval(), torch.randn(2, 4)
    ema, before = model.ema, model.ema.clone()
    with pytest.raises(ValueError, match=r"forward writes in place into 'ema', a tensor attribute that is neither a "
                                         r"parameter nor a buffer"):
        torch_ext.ReactiveGraph(model, (x,), front_end=front_end, cache=False)
    assert model.ema is ema and torch.equal(model.ema, before)
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("front_end", ["auto", "export"])
def test_graph_refuses_a_buffer_rebound_to_another_shape(front_end):
    """make_fx kept such a rebinding on its traced copy and built a graph, export failed inside torch ('expand:
    attempting to expand a dimension of length 8 -> 4'): refused naming the buffer, as the step does."""
    model, x = _RebindsBuffer(shape=(8,)).eval(), torch.randn(2, 4)
    prev = model.prev
    with pytest.raises(ValueError, match=r"forward rebinds buffer 'prev' \(shape \(4,\) and dtype torch.float32\) to "
                                         r"a tensor of shape \(8,\) .*the graph keeps each buffer's shape"):
        torch_ext.ReactiveGraph(model, (x,), front_end=front_end, cache=False)
    assert model.prev is prev and torch.equal(prev, torch.zeros(4))


@pytest.mark.parametrize("front_end", ["auto", "export"])
def test_graph_refuses_a_same_shape_rebinding_that_later_calls_read(front_end):
    """A rebinding to the same shape and dtype is a buffer write, as ``self.prev.copy_(...)`` is (the step carries
    it so). Here forward also reads ``prev``: eager's next call computes with the rebound value, and the graph,
    which never writes the module's buffers, would keep answering the first call. Refused at build, naming the
    buffer (ReactiveGraph's state read-back check); the module is left as it was."""
    model, x = _RebindsBuffer().eval(), torch.randn(2, 4)
    prev = model.prev
    with pytest.raises(ValueError, match=r"forward writes buffer 'prev' of module '<root>' \(_RebindsBuffer\)"):
        torch_ext.ReactiveGraph(model, (x,), front_end=front_end, cache=False)
    assert model.prev is prev and torch.equal(prev, torch.zeros(4))


def test_run_digests_each_input_once(resid, monkeypatch):
    """run() digested its inputs twice: with the weights (the graph's reads) and again for _ran_on's check of
    the inputs; the second reuses the first. A write through .data into the input is still seen after it."""
    import torch_ext.reactive as reactive

    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    seen = []
    digest = reactive._contents_digest
    monkeypatch.setattr(reactive, "_contents_digest", lambda ts: seen.extend(id(t) for t in ts) or digest(ts))
    rg.run(x)
    assert seen.count(id(x)) == 1, seen.count(id(x))
    assert rg._ran_on(x)
    x.data[0, 0, 0] += 1.0
    assert not rg._ran_on(x)


def test_ran_on_reuses_the_digests_taken_earlier_in_the_same_call(resid, monkeypatch):
    """Patching compares the graph's reads by content, then asks _ran_on whether the tokens are those of the last
    run, which digested them again: within one call the first digest is reused. Between calls, a write through
    .data into the input is still seen."""
    import torch_ext.reactive as reactive

    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    seen = []
    digest = reactive._contents_digest
    monkeypatch.setattr(reactive, "_contents_digest", lambda ts: seen.extend(id(t) for t in ts) or digest(ts))
    with reactive._one_check_per_call():
        rg._take_untracked_writes()
        assert rg._ran_on(x)
    assert seen.count(id(x)) == 1, seen.count(id(x))
    x.data[0, 0, 0] += 1.0
    with reactive._one_check_per_call():
        rg._take_untracked_writes()  # takes the write as an edit (moves x's version): not the last run's inputs
        assert not rg._ran_on(x)


class _RReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.act, self.b = nn.Linear(8, 8), nn.RReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def test_rrelu_is_refused_in_training_mode_and_exact_in_eval_mode():
    # An RReLU in eval mode applies its mean slope and draws nothing (aten::rrelu with training=False). It was
    # refused as random ("the program draws random numbers at %rrelu"), as it is, rightly, in training mode.
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"draws random numbers at %rrelu \(aten::rrelu\)"):
        torch_ext.ReactiveGraph(_RReLUNet().train(), (x,), cache=False)
    model = _RReLUNet().eval()
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    with torch.no_grad():
        assert torch.equal(rg.run(x), model(x)) and torch.equal(rg.run(x + 1), model(x + 1))


class _AutocastInForward(nn.Module):
    """A forward that enters torch.autocast itself: the linear and relu run in bfloat16, the head in float32."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.fc(x))
        return self.fc2(h.float())


def test_a_forward_that_enters_autocast_runs_its_casts_exactly_as_eager():
    # Before: refused at build ("higher-order operator 'wrap_with_autocast' is not supported"). The region is
    # now traced into the casts autocast makes (aten._to_copy), so the graph runs the same kernels on the same
    # dtypes as eager: equal at zero tolerance, patched or not.
    torch.manual_seed(0)
    model = _AutocastInForward().eval()
    x = torch.randn(4, 16)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))
    relu = [n for n in rg.nodes() if n.startswith("relu")][0]
    assert rg.value(relu).dtype == torch.bfloat16
    sites = [(relu, p) for p in range(4)]
    patch = lambda v, s: _zero_row(v, s[1])  # noqa: E731
    metric = lambda o: o[:, 0] - o[:, 1]  # noqa: E731
    one = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=False)
    batched = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=False, batch_sites=True)
    assert batched.batched
    for s in sites:
        h = model.fc.register_forward_hook(lambda m, a, o, p=s[1]: _zero_row(o, p))  # relu(0) == 0
        try:
            with torch.no_grad():
                ref = metric(model(x))
        finally:
            h.remove()
        assert torch.equal(one.metrics[s], ref), s
        torch.testing.assert_close(batched.metrics[s], ref, rtol=1e-5, atol=1e-6)


def test_an_ambient_autocast_is_refused_by_name_and_leaves_the_graph_as_it_was():
    # An autocast context around the build recorded bfloat16 types without casts (the build failed IR
    # verification); around a run, demand or sweep of a plainly built graph it silently cast only the kernels
    # recomputed, answering neither as eager with nor as eager without it. Both are refused by name.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"built under torch\.autocast\('cpu', dtype=torch\.bfloat16\).*inside the forward"):
            torch_ext.ReactiveGraph(model, (x,), cache=False)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    relu = [n for n in rg.nodes() if n.startswith("relu")][0]
    rg.patch(relu, torch.zeros(4, 16))
    before = rg.stats["evaluations"]
    calls = {
        "run": lambda: rg.run(x),
        "demand": rg.demand,
        "value": lambda: rg.value(relu),
        "sweep": lambda: torch_ext.sweep(rg, [(relu, 0)], lambda v, s: v * 0, lambda o: o.sum(), progress=False),
    }
    for name, call in calls.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(ValueError, match=r"called under torch\.autocast\('cpu', dtype=torch\.bfloat16\)"):
                call()
        assert rg.stats["evaluations"] == before, name
        assert rg.patched() == [relu], name
    with torch.no_grad():
        expected = model[2](torch.zeros(4, 16))
    assert torch.equal(rg.demand(), expected)
    rg.restore()
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))


def test_early_cutoff_does_not_stop_at_the_same_bits_in_another_layout():
    """A patch with the cached bits transposed in memory: the elementwise node after it recomputes the same bits in
    that layout, and early cutoff (same bits) stopped there, keeping the row sums computed from the old layout;
    eager sums the new layout in another order (other bits). Cutoff compares layouts too."""
    class RowSums(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(1000, 1000)

        def forward(self, x):
            return (torch.relu(self.lin(x)) * 1.0).sum(dim=-1)

    model = RowSums().eval()
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    rg = torch_ext.ReactiveGraph(model, (x,), cutoff=True)
    relu = [n for n in rg.nodes() if n.startswith("relu")][0]
    with torch.no_grad():
        h = model.lin(x).relu()
        moved = h.t().contiguous().t()
        eager, clean = (moved * 1.0).sum(dim=-1), (h * 1.0).sum(dim=-1)
    assert not torch.equal(eager, clean)  # the case: the layout changes the bits
    rg.patch(relu, moved)
    assert torch.equal(rg.demand(), eager)
    rg.restore()
    assert torch.equal(rg.demand(), clean)
    rg.patch(relu, h.clone())  # the same bits in the same layout: cut off after the site, as before
    cut = rg.stats["cutoffs"]
    assert torch.equal(rg.demand(), clean) and rg.stats["cutoffs"] > cut


def _model_made_by_a_factory(scale: list) -> nn.Module:
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) * scale[0]

    return Scaled().eval()


def test_a_value_the_forward_reads_from_its_factorys_closure_changed_after_build_is_refused():
    # A module class defined inside a factory reads its knobs from the factory's closure. Before: module-level
    # names were checked, closures not, so `scale[0] = 3.0` left run() answering with 2.0, silently.
    scale = [2.0]
    model, x = _model_made_by_a_factory(scale), torch.randn(3, 4)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.run(x).clone()
    scale[0] = 3.0
    with torch.no_grad():
        assert not torch.equal(model(x), clean)  # eager follows the change
    message = r"'scale' \(a closure variable .*Scaled.forward reads\) is \[3.0\] now, \[2.0\] when this ReactiveGraph"
    with pytest.raises(ValueError, match="run: " + message):
        rg.run(x)
    with pytest.raises(ValueError, match="demand: " + message):
        rg.demand()
    scale[0] = 2.0  # changed back: the graph is right again
    assert torch.equal(rg.run(x), clean)
    y = torch.randn(3, 2)
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     lambda m, a, b: nn.functional.mse_loss(m(a), b), (x, y))
    state = step.init_state()
    scale[0] = 3.0
    with pytest.raises(ValueError, match=message.replace("this ReactiveGraph", "the step")):
        step(state, x, y)
    scale[0] = 2.0
    step(state, x, y)


class _UserOptions:  # the user's own options class (neither a dataclass nor a namespace)
    def __init__(self):
        self.scale = 2.0


def _times(t, s):
    return t * s["v"]


class _HoldsKnobs(nn.Module):
    GAIN = 2.0  # a class-level knob

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.kind = nn.Linear(4, 2), kind
        self.opts = _UserOptions()
        self.by_partial = functools.partial(_times, s={"v": 2.0})
        k = [2.0]
        self.by_lambda = lambda t: t * k[0]

    def forward(self, x):
        y = self.fc(x)
        if self.kind == "object":
            return y * self.opts.scale
        if self.kind == "class":
            return y * self.GAIN
        return self.by_partial(y) if self.kind == "partial" else self.by_lambda(y)


@pytest.mark.parametrize("kind", ["object", "partial", "lambda", "class"])
def test_a_knob_held_in_a_user_object_or_a_held_functions_state_changed_after_build_is_refused(kind):
    # Before: options on an instance of the user's own class (self.opts.scale) and what a held function reads
    # (a partial's keyword dict, a lambda's closure list) were taken by identity only, and class-level values
    # (GAIN = 2.0 in the class body) not at all, so an edit left run() and the step answering with the traced
    # value, silently.
    model, x = _HoldsKnobs(kind).eval(), torch.randn(3, 4)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.run(x).clone()
    y = torch.randn(3, 2)
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     lambda m, a, b: nn.functional.mse_loss(m(a), b), (x, y))
    state = step.init_state()

    def turn(value):
        if kind == "object":
            model.opts.scale = value
        elif kind == "class":
            _HoldsKnobs.GAIN = value
        elif kind == "partial":
            model.by_partial.keywords["s"]["v"] = value
        else:
            model.by_lambda.__closure__[0].cell_contents[0] = value

    turn(3.0)
    try:
        _expect_refused(model, rg, step, state, x, y, clean, kind)
    finally:
        turn(2.0)  # changed back: both are right again
    assert torch.equal(rg.run(x), clean)
    step(state, x, y)


def _expect_refused(model, rg, step, state, x, y, clean, kind):
    with torch.no_grad():
        assert not torch.equal(model(x), clean)  # eager follows the change
    message = {"object": r"model.opts.scale is 3.0 now, 2.0", "partial": r"model.by_partial: 's' is \{'v': 3.0\} now",
               "lambda": r"model.by_lambda: 'k' is \[3.0\] now, \[2.0\]",
               "class": r"[\w.]*_HoldsKnobs.GAIN \(on the class\) is 3.0 now, 2.0"}[kind]
    with pytest.raises(ValueError, match="run: " + message):
        rg.run(x)
    with pytest.raises(ValueError, match=message):
        step(state, x, y)


BIAS_TABLE = torch.tensor([1.0, -1.0])  # a module-level tensor a forward reads


class _ReadsAModuleLevelTensor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x) + BIAS_TABLE


def test_a_module_level_tensor_rebound_after_build_is_refused():
    # The trace holds a module-level tensor as a constant. Writes into it were found by content; rebinding the
    # name (BIAS_TABLE = other) was not: run() and the step kept the old tensor, silently.
    global BIAS_TABLE
    model, x, y = _ReadsAModuleLevelTensor().eval(), torch.randn(3, 4), torch.randn(3, 2)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    clean = rg.run(x).clone()
    step = torch_ext.make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     lambda m, a, b: nn.functional.mse_loss(m(a), b), (x, y))
    state = step.init_state()
    old, BIAS_TABLE = BIAS_TABLE, torch.tensor([5.0, 5.0])
    try:
        with torch.no_grad():
            assert not torch.equal(model(x), clean)  # eager follows the change
        message = r"BIAS_TABLE \(a module-level value the traced code reads\) was replaced by a tensor of shape \(2,\)"
        with pytest.raises(ValueError, match="run: .*" + message):
            rg.run(x)
        with pytest.raises(ValueError, match=message):
            step(state, x, y)
    finally:
        BIAS_TABLE = old  # changed back: both are right again
    assert torch.equal(rg.run(x), clean)
    step(state, x, y)


@pytest.mark.parametrize("how", ["data", "numpy", "storage"])
@pytest.mark.parametrize("given", ["tensor", "function"])
def test_a_patch_value_the_caller_keeps_and_writes_without_a_version_bump_does_not_go_stale(resid, how, given):
    # rg.patch(node, v) stored v itself: a later write into v through .data, .numpy() or its storage moves no
    # version counter, so the patched node read the new contents (rg.value) while its cone kept the outputs
    # computed from the old ones, and demand() answered neither eager run. The patch is the value given.
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    t1 = _tanh_nodes(rg)[1]
    v = rg.value(t1).clone() * 0.5
    kept = v.clone()
    rg.patch(t1, v if given == "tensor" else (lambda clean: v))
    first = rg.demand().clone()
    if how == "data":
        v.data.mul_(3.0)
    elif how == "numpy":
        v.numpy()[:] *= 3.0
    else:
        v.untyped_storage().copy_(torch.full_like(v, 2.0).untyped_storage())
    assert not torch.equal(v, kept)
    with torch.no_grad():
        ref = _eager(model, x, {1: lambda out: kept})
    assert torch.equal(rg.value(t1), kept)
    assert torch.equal(rg.demand(), first)
    torch.testing.assert_close(rg.demand(), ref, rtol=0, atol=0)
    rg.check_invariants()
    rg.restore()
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))


def test_contents_digest_reads_tensors_with_autograd_history_as_their_bytes():
    """contents_digest hands tensors to C++ as they are (no per-tensor detach in Python): a parameter with
    autograd history, contiguous or not, digests as its detached bytes, records no autograd history, and a
    write through .data (no version counter moves) changes its digest. An empty or meta tensor: as before."""
    from torch_ext import _module_state

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 6))
    wt = w.t()  # not contiguous, with a grad_fn
    plain = [w.detach().clone(), w.detach().t().contiguous()]
    with torch.enable_grad():
        got = _module_state.contents_digest([w, wt, torch.empty(0), torch.empty(3, device="meta")])
    assert got[:2] == _module_state.contents_digest(plain)
    assert got[2] == 0 and got[3] is None
    assert w.grad is None and wt.grad_fn is not None
    before = got[:2]
    was = float(w.data[3, 2])
    w.data[3, 2] = was + 1.0
    after = _module_state.contents_digest([w, wt])
    assert after[0] != before[0] and after[1] != before[1]
    w.data[3, 2] = was  # the same bits again: the same digests
    assert _module_state.contents_digest([w, wt]) == before


class _Knobs:  # a user class the forward reads as a namespace, never by its global name
    scale = 2.0
    calls = 0


class _Opts:  # a user object given as a default argument
    def __init__(self):
        self.scale = 2.0


_OPTS = _Opts()


class _HeldClass(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.knobs = _Knobs  # held as an attribute, read as self.knobs.scale

    def forward(self, x):
        self.knobs.calls += 1  # bookkeeping the code assigns: not a constant of the trace
        return self.lin(x) * self.knobs.scale


class _ClassAttribute(_HeldClass):
    KNOBS = _Knobs

    def forward(self, x):
        return self.lin(x) * type(self).KNOBS.scale


class _InContainers(_HeldClass):
    def __init__(self):
        super().__init__()
        self.in_list, self.in_dict = [_Knobs], {"k": _Knobs}

    def forward(self, x):
        return self.lin(x) * self.in_list[0].scale + self.in_dict["k"].scale


class _DefaultObject(_HeldClass):
    def forward(self, x, opts=_OPTS):
        return self.lin(x) * opts.scale


class _DefaultClass(_HeldClass):
    def forward(self, x, knobs=_Knobs):
        return self.lin(x) * knobs.scale


def _graft_default(t, opts=_OPTS):
    return t * opts.scale


_NAMESPACE_CASES = {
    "class attribute of the module": (_HeldClass, None, _Knobs),
    "type(self).X": (_ClassAttribute, None, _Knobs),
    "class in a list or dict": (_InContainers, None, _Knobs),
    "object as forward's default": (_DefaultObject, None, _OPTS),
    "class as forward's default": (_DefaultClass, None, _Knobs),
    "object as a grafted function's default": (_HeldClass, _graft_default, _OPTS),
    "class as a grafted lambda's default": (_HeldClass, lambda t, k=_Knobs: t + k.scale, _Knobs),
    "class a grafted lambda names as a global": (_HeldClass, lambda t: t - _Knobs.scale, _Knobs),
}


@pytest.mark.parametrize("case", list(_NAMESPACE_CASES))
def test_a_user_class_or_object_the_trace_reads_as_a_namespace_is_checked(case, monkeypatch):
    """Before: run(), demand(), value() and sweep() answered with the traced 2.0 after `scale = 5.0` on a user class
    or object the code reads without naming it as a global (held by the module, a class attribute, in a list or dict,
    a default argument of forward or of a grafted function), silently unlike eager; changed back, it computes again."""
    make, graft, holder = _NAMESPACE_CASES[case]
    model, x = make().eval(), torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(model, (x,), cache=False)
    if graft is not None:
        rg.graft(rg.nodes("linear*")[0], graft)

    def eager():
        with torch.no_grad():
            return model(x) if graft is None else graft(model.lin(x)) * model.knobs.scale  # grafted after lin

    assert torch.equal(rg.run(x), eager())  # the bookkeeping (calls += 1) moved: no refusal
    monkeypatch.setattr(holder, "scale", 5.0)
    for call in (rg.demand, lambda: rg.run(x), lambda: rg.value(rg.nodes()[-1]),
                 lambda: torch_ext.sweep(rg, [rg.nodes("linear*")[0]], lambda v, s: v, sum_metric, progress=False)):
        with pytest.raises(ValueError, match=r"\.scale( \(a module-level value the traced code reads\))? is 5\.0 now, "
                                             r"2\.0 when"):
            call()
    monkeypatch.undo()
    assert torch.equal(rg.run(x), eager())


@pytest.mark.parametrize("path", [{}, {"positions": False}, {"batch_sites": True},
                                  {"reads": {0: (slice(None), -1)}}])
@pytest.mark.parametrize("read", ["value", "values", "demand"])
def test_a_metric_reading_the_graph_is_refused_not_answered_unpatched(resid, path, read):
    # A sweep's metric is handed the site's patched outputs; the graph's cache keeps the clean values (the
    # per-site transaction runs beside it). rg.value(node) / values / demand() from the metric answered the
    # clean graph: every site read the same unpatched tanh, where eager with the patch hook differs per site.
    model, x = resid
    rg = torch_ext.ReactiveGraph(model, (x,))
    clean = rg.demand().clone()
    t0, _, t2 = _tanh_nodes(rg)
    reads = {"value": lambda: rg.value(t2), "values": lambda: rg.values([t2])[t2], "demand": lambda: rg.demand()}
    sites = [(t0, p) for p in range(x.shape[1])]
    with pytest.raises(RuntimeError, match="from a sweep's metric would read the graph without the site's patch"):
        torch_ext.sweep(rg, sites, _site_patch, lambda out: reads[read]().sum(), progress=False, **path)
    # Refused, the graph is as it was; the same sweep reading its outputs answers as eager does.
    assert rg.patched() == []
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()
    r = torch_ext.sweep(rg, sites, _site_patch, lambda out: out[:, -1].sum(), progress=False, **path)
    for site in sites:
        with torch.no_grad():
            ref = _eager(model, x, {0: lambda t, p=site[1]: _site_patch(t, (t0, p))})
        assert r.metrics[site] == pytest.approx(float(ref[:, -1].sum()), rel=1e-6, abs=1e-6), site
    # Outside a sweep a read follows a standing patch, as eager does.
    rg.patch(t0, lambda v: _site_patch(v, (t0, 1)))
    with torch.no_grad():
        assert torch.equal(rg.demand(), _eager(model, x, {0: lambda t: _site_patch(t, (t0, 1))}))
    rg.restore()
