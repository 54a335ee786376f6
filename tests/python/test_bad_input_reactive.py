"""Bad input to ReactiveGraph mutations and to sweep (issue 16): every case raises a clear error that
names the culprit, and leaves the graph exactly as a fresh one (same text, same outputs bit for bit,
no patch pinned, invariants holding, the next sweep answering as on a fresh graph)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_ext

from helpers import ResidTanh, position_patch, sum_metric


X = torch.randn(2, 5, 8)


@pytest.fixture
def rg():
    return torch_ext.ReactiveGraph(ResidTanh(3).eval(), (X,))


def _tanh(rg, i=0):
    return [n for n in rg.nodes() if n.startswith("tanh")][i]


_good_patch = position_patch(0)
_good_metric = sum_metric


def _assert_fresh(rg):
    fresh = torch_ext.ReactiveGraph(ResidTanh(3).eval(), (X,))
    assert str(rg) == str(fresh)
    assert rg.patched() == []
    assert torch.equal(rg.demand(), fresh.demand())
    rg.check_invariants()
    sites = [(_tanh(rg, 1), p) for p in range(2)]
    a = torch_ext.sweep(rg, sites, _good_patch, _good_metric, progress=False)
    b = torch_ext.sweep(fresh, sites, _good_patch, _good_metric, progress=False)
    assert a.metrics == b.metrics and a.measured_evaluations == b.measured_evaluations


def _assert_refused_and_fresh(rg, case):
    fn, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fn(rg)
    _assert_fresh(rg)


# (callable taking rg, expected exception type, regex the message must match)
MUTATIONS = {
    "patch_unknown_node": (lambda rg: rg.patch("no_such_node", torch.zeros(1)), RuntimeError, "no_such_node"),
    "patch_wrong_shape": (lambda rg: rg.patch(_tanh(rg), torch.zeros(3)), RuntimeError, r"expected shape"),
    "patch_wrong_dtype": (lambda rg: rg.patch(_tanh(rg), torch.zeros(2, 5, 8, dtype=torch.float64)), RuntimeError,
                          "dtype"),
    "patch_int_tensor": (lambda rg: rg.patch(_tanh(rg), torch.zeros(2, 5, 8, dtype=torch.int64)), RuntimeError,
                         "dtype"),
    "patch_not_a_tensor": (lambda rg: rg.patch(_tanh(rg), 3.0), TypeError, "expected a tensor"),
    "patch_none": (lambda rg: rg.patch(_tanh(rg), None), TypeError, "expected a tensor"),
    "patch_string": (lambda rg: rg.patch(_tanh(rg), "zeros"), TypeError, "expected a tensor"),
    "patch_list": (lambda rg: rg.patch(_tanh(rg), [0.0] * 80), TypeError, "expected a tensor"),
    "patch_fn_returns_none": (lambda rg: rg.patch(_tanh(rg), lambda v: None), TypeError, "expected a tensor"),
    "patch_fn_returns_float": (lambda rg: rg.patch(_tanh(rg), lambda v: 1.0), TypeError, "expected a tensor"),
    "patch_fn_wrong_shape": (lambda rg: rg.patch(_tanh(rg), lambda v: v[0]), RuntimeError, "expected shape"),
    "patch_fn_in_place": (lambda rg: rg.patch(_tanh(rg), lambda v: v.zero_()), ValueError, "in place"),
    "patch_fn_raises": (lambda rg: rg.patch(_tanh(rg), lambda v: 1 / 0), ZeroDivisionError, "division"),
    "patch_scalar_tensor": (lambda rg: rg.patch(_tanh(rg), torch.tensor(0.0)), RuntimeError, "expected shape"),
    "restore_unpatched_node": (lambda rg: rg.restore(_tanh(rg)), ValueError, "not patched"),
    "restore_unknown_node": (lambda rg: rg.restore("ghost"), RuntimeError, "ghost"),
    "graft_unknown_src": (lambda rg: rg.graft("ghost", lambda t: t), RuntimeError, "ghost"),
    "graft_unknown_dst": (lambda rg: rg.graft(_tanh(rg), "ghost", lambda t: t), RuntimeError, "ghost"),
    "graft_dst_not_a_name": (lambda rg: rg.graft(_tanh(rg), 3, lambda t: t), TypeError, "dst must be a node name"),
    "graft_block_not_callable": (lambda rg: rg.graft(_tanh(rg), 42), TypeError, "nn.Module or a callable"),
    "graft_no_edge": (lambda rg: rg.graft(_tanh(rg, 0), _tanh(rg, 2), lambda t: t), RuntimeError, "no edge"),
    "graft_cycle": (lambda rg: rg.graft(_tanh(rg, 2), _tanh(rg, 0), lambda t: t), RuntimeError, "cycle"),
    "graft_changes_shape": (lambda rg: rg.graft(_tanh(rg), lambda t: t.sum(-1)), RuntimeError, "type"),
    "graft_changes_dtype": (lambda rg: rg.graft(_tanh(rg), lambda t: t.double()), RuntimeError, "type"),
    "graft_returns_tuple": (lambda rg: rg.graft(_tanh(rg), lambda t: (t, t)), RuntimeError, "one computed value"),
    "graft_identity_block": (lambda rg: rg.graft(_tanh(rg), lambda t: t), RuntimeError, "computed value"),
    "graft_block_raises": (lambda rg: rg.graft(_tanh(rg), lambda t: t.view(7, 7)), RuntimeError, "view|shape"),
    "graft_dropout_block": (lambda rg: rg.graft(_tanh(rg), nn.Dropout(0.5).train()), ValueError, "random numbers"),
    "run_wrong_dtype": (lambda rg: rg.run(X.double()), RuntimeError, "dtype"),
    "run_wrong_arity": (lambda rg: rg.run(X, X), TypeError, "signature|positional"),
    "run_not_a_tensor": (lambda rg: rg.run("x"), (TypeError, RuntimeError, ValueError), "tensor|str|signature"),
    "value_unknown_node": (lambda rg: rg.value("ghost"), RuntimeError, "ghost"),
    "baseline_unknown_node": (lambda rg: rg.baseline("ghost"), RuntimeError, "ghost"),
    "cone_unknown_node": (lambda rg: rg.cone("ghost"), RuntimeError, "ghost"),
}


@pytest.mark.parametrize("case", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_bad_mutation(rg, case):
    _assert_refused_and_fresh(rg, case)


def _sweep(rg, sites=None, patch=_good_patch, metric=_good_metric, **kw):
    sites = [(_tanh(rg, 1), p) for p in range(3)] if sites is None else sites
    return torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)


def _unbatchable_patch(v, site):
    return v[:1].clone()


def _rows_traded_patch(v, site):
    """Site 1 returns twice the batch, site 2 none of it: stacked, the three have the right total shape."""
    out = _good_patch(v, site)
    return {1: torch.cat([out, out]), 2: out[:0]}.get(site[1], out)


SWEEPS = {
    "no_sites": (lambda rg: _sweep(rg, sites=[]), ValueError, "at least one site"),
    "glob_matches_nothing": (lambda rg: _sweep(rg, sites="zzz*"), ValueError, "no node matches 'zzz\\*'"),
    "unknown_site_node": (lambda rg: _sweep(rg, sites=[("ghost", 0)]), ValueError, "unknown node 'ghost'"),
    "unknown_plain_site": (lambda rg: _sweep(rg, sites=["ghost"]), ValueError, "unknown node 'ghost'"),
    "slice_in_a_site": (lambda rg: _sweep(rg, sites=[(_tanh(rg), slice(1, 3))]), TypeError,
                        r"a site must be hashable.*\(node, \(2, 5\)\)"),
    "list_in_a_site": (lambda rg: _sweep(rg, sites=[(_tanh(rg), [1, 2])]), TypeError, "a site must be hashable"),
    "patch_returns_none": (lambda rg: _sweep(rg, patch=lambda v, s: None), TypeError, "returned NoneType"),
    "patch_returns_int": (lambda rg: _sweep(rg, patch=lambda v, s: 0), TypeError, "returned int"),
    "patch_wrong_shape": (lambda rg: _sweep(rg, patch=lambda v, s: v[0]), RuntimeError, "expected shape"),
    "patch_wrong_dtype": (lambda rg: _sweep(rg, patch=lambda v, s: v.double()), RuntimeError, "dtype"),
    "patch_in_place": (lambda rg: _sweep(rg, patch=lambda v, s: v.mul_(0)), ValueError, "in place"),
    "patch_index_in_place": (lambda rg: _sweep(rg, patch=lambda v, s: v.__setitem__(0, 1.0) or v), ValueError,
                             "in place"),
    "patch_raises": (lambda rg: _sweep(rg, patch=lambda v, s: {}["k"]), KeyError, "k"),
    "metric_raises": (lambda rg: _sweep(rg, metric=lambda o: [][1]), IndexError, "index"),
    "metric_returns_string": (lambda rg: _sweep(rg, metric=lambda o: "high"), TypeError, "returned str"),
    "metric_returns_none": (lambda rg: _sweep(rg, metric=lambda o: None), TypeError, "returned NoneType"),
    "metric_returns_list": (lambda rg: _sweep(rg, metric=lambda o: [1.0]), TypeError, "returned list"),
    "metric_returns_bool": (lambda rg: _sweep(rg, metric=lambda o: True), TypeError, "returned bool"),
    "metric_in_place": (lambda rg: _sweep(rg, metric=lambda o: o.add_(1).sum()), ValueError, "metric wrote"),
    "metric_in_place_slice": (lambda rg: _sweep(rg, metric=lambda o: o[0].zero_().sum()), ValueError, "metric wrote"),
    "metric_dict_of_strings": (lambda rg: _sweep(rg, metric=lambda o: {"a": "b"}), TypeError, "returned str"),
    "batched_patch_raises": (lambda rg: _sweep(rg, patch=lambda v, s: 1 / 0, batch_sites=True), ZeroDivisionError,
                             "division"),
    "batched_metric_raises": (lambda rg: _sweep(rg, metric=lambda o: 1 / 0, batch_sites=True), ZeroDivisionError,
                              "division"),
    "batched_patch_in_place": (lambda rg: _sweep(rg, patch=lambda v, s: v.mul_(0), batch_sites=True), ValueError,
                               "in place"),
    "batched_patch_wrong_shape": (lambda rg: _sweep(rg, patch=_unbatchable_patch, batch_sites=True), RuntimeError,
                                  "shape"),
    "batched_patch_shapes_trade_rows": (lambda rg: _sweep(rg, patch=_rows_traded_patch, batch_sites=True),
                                        RuntimeError, r"at site \('tanh_1', 1\): expected shape \[2, 5, 8\].*got shape \[4, 5, 8\]"),
    "batched_patch_shapes_trade_rows_whole_cones": (
        lambda rg: _sweep(rg, patch=_rows_traded_patch, batch_sites=True, positions=False), RuntimeError,
        r"at site \('tanh_1', 1\): expected shape \[2, 5, 8\]"),
    "batched_patch_one_site_float64": (
        lambda rg: _sweep(rg, patch=lambda v, s: _good_patch(v, s).double() if s[1] == 2 else _good_patch(v, s),
                          batch_sites=True), RuntimeError, r"at site \('tanh_1', 2\).*dtype torch.float64"),
    "batched_metric_in_place": (lambda rg: _sweep(rg, metric=lambda o: o.mul_(2).sum(), batch_sites=True),
                                ValueError, "metric wrote"),
    "batched_patch_returns_none": (lambda rg: _sweep(rg, patch=lambda v, s: None, batch_sites=True), TypeError,
                                   "returned NoneType"),
    "batched_metric_returns_string": (lambda rg: _sweep(rg, metric=lambda o: "x", batch_sites=True), TypeError,
                                      "returned str"),
    "distributed_without_group": (lambda rg: _sweep(rg, distributed=True), RuntimeError, "init_process_group"),
    "nested_sweep": (lambda rg: _sweep(rg, metric=lambda o: _sweep(rg).rho), RuntimeError,
                     r"sweep\(\) is not allowed while a sweep runs"),
    "restore_inside_metric": (lambda rg: _sweep(rg, metric=lambda o: (rg.restore(), 1.0)[1]), RuntimeError,
                              r"restore\(\) is not allowed while a sweep runs"),
    "graft_inside_patch": (lambda rg: _sweep(rg, patch=lambda v, s: (rg.graft(_tanh(rg, 2), lambda t: 2 * t), v)[1]),
                           RuntimeError, r"graft\(\) is not allowed while a sweep runs"),
    "run_inside_metric": (lambda rg: _sweep(rg, metric=lambda o: (rg.run(X), 1.0)[1]), RuntimeError,
                          r"run\(\) is not allowed while a sweep runs"),
    "patch_inside_metric": (lambda rg: _sweep(rg, metric=lambda o: (rg.patch(_tanh(rg), torch.zeros(2, 5, 8)), 1.0)[1]),
                            RuntimeError, r"patch\(\) is not allowed while a sweep runs"),
}


@pytest.mark.parametrize("case", SWEEPS.values(), ids=SWEEPS.keys())
def test_bad_sweep(rg, case):
    _assert_refused_and_fresh(rg, case)


def test_corpus_sizes():
    assert len(MUTATIONS) >= 30 and len(SWEEPS) >= 30


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"example_kwargs": [("attention_mask", X)]}, TypeError, "example_kwargs must be a dict of keyword inputs, got list"),
    ({"example_kwargs": {"bogus": X}}, (TypeError, RuntimeError, ValueError), "bogus"),
])
def test_bad_example_kwargs(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        torch_ext.ReactiveGraph(ResidTanh(3).eval(), (X,), **kwargs)


def test_example_kwargs_without_example_inputs_or_for_a_program():
    with pytest.raises(ValueError, match="example_kwargs need example_inputs"):
        torch_ext.ReactiveGraph(ResidTanh(3).eval(), None, example_kwargs={"x": X})
    ep = torch.export.export(ResidTanh(3).eval(), (X,))
    with pytest.raises(ValueError, match="example_kwargs are for a module"):
        torch_ext.ReactiveGraph(ep, (X,), example_kwargs={"x": X})


class _BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * 2 if h.sum().item() > 0 else h


class _ValueAsNumber(_BranchOnValue):
    def forward(self, x):
        return self.lin(x) * float(x.abs().max().item() > 0)


class _ValueAsList(_BranchOnValue):
    def forward(self, x):
        h = self.lin(x)
        return h + sum(h[0, 0].tolist())


class _SeededNoise(_BranchOnValue):
    def forward(self, x):
        gen = torch.Generator().manual_seed(0)
        return self.lin(x) + torch.randn(x.shape, generator=gen)


class _CumulativeBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(5, momentum=None)

    def forward(self, x):
        return self.bn(self.lin(x))


@pytest.mark.parametrize("make, exc, pattern", [
    (lambda: _BranchOnValue().eval(), NotImplementedError,
     r"the model reads a tensor's value to decide Python control flow .*torch.cond; at File .*"
     r"test_bad_input_reactive.py\", line \d+, in forward"),
    (lambda: _ValueAsNumber().eval(), NotImplementedError,
     r"reads a tensor's value .*; at File .*test_bad_input_reactive.py\", line \d+, in forward: float\(\) argument"),
    (lambda: _ValueAsList().eval(), NotImplementedError,
     r"the model reads a tensor's value as a Python number \(node 'item', aten::item\) in _ValueAsList.forward \(the "
     r"model itself\): .*keep it a tensor \(`t.sum\(\)` for `sum\(t.tolist\(\)\)`"),
    (lambda: _SeededNoise().eval(), ValueError,
     r"ReactiveGraph: the model draws random numbers with a torch.Generator .*deterministic model.*; at File "
     r".*test_bad_input_reactive.py\", line \d+, in forward"),
    (lambda: _CumulativeBatchNorm().train(), ValueError,
     r"bn: BatchNorm1d\(momentum=None\) .* cannot be traced into a graph; give it a momentum .* or call model.eval\(\)"),
], ids=["branch on .item()", "float of a traced value", "sum of .tolist()", "a seeded torch.Generator",
        "BatchNorm momentum=None in training"])
def test_untraceable_forward_is_refused_by_name(make, exc, pattern):
    # Were torch's GuardOnDataDependentSymNode ("Could not guard on data-dependent expression zuf0 > 0.0",
    # "Could not extract specialized integer ... u0") and a TypeError "... not 'SymBool'", naming nothing of ours;
    # sum(t.tolist()) was "UnsupportedNodeError: node 'item' (aten::item.default): value of type SymFloat is not
    # supported", a seeded generator torch.fx's "NotImplementedError: argument of type: <class 'torch._C.Generator'>".
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=pattern):
        torch_ext.ReactiveGraph(model, (X,), cache=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        values, indices = self.lin(x).topk(3, dim=-1)
        return values.sum(-1) + indices.sum(-1)


@pytest.mark.parametrize("how", ["patch", "sweep", "sweep_batched"])
def test_a_site_on_a_node_holding_a_tuple_is_refused_by_name(how):
    # topk's node holds (values, indices): patching it failed deep in the engine ("Expected Tensor but got
    # Tuple", or a TypeError from the copy of the clean value) without naming the node or the nodes to patch.
    torch.manual_seed(0)
    model = _TopK().eval()
    rg = torch_ext.ReactiveGraph(model, (X,))
    text, before = str(rg.graph), rg.demand().clone()
    match = r"node 'topk' holds a tuple of 2 values, not a tensor; .*'getitem', 'getitem_1'"
    with pytest.raises(ValueError, match=match):
        if how == "patch":
            rg.patch("topk", lambda v: v)
        else:
            torch_ext.sweep(rg, ["topk", "getitem"], lambda v, s: v * 2, lambda o: float(o.sum()), progress=False,
                            batch_sites=how == "sweep_batched")
    assert rg.patched() == [] and str(rg.graph) == text
    with torch.no_grad():
        assert torch.equal(rg.demand(), before) and torch.equal(before, model(X))
    rg.check_invariants()
    r = torch_ext.sweep(rg, ["getitem"], lambda v, s: v * 2, lambda o: float(o.sum()), progress=False)
    h = model.lin.register_forward_hook(lambda m, i, o: o)
    values, indices = model.lin(X).topk(3, dim=-1)
    h.remove()
    with torch.no_grad():
        assert r.metrics["getitem"] == float((values * 2).sum(-1).add(indices.sum(-1)).sum())


def test_a_glob_over_sites_takes_the_tensor_nodes():
    torch.manual_seed(0)
    rg = torch_ext.ReactiveGraph(_TopK().eval(), (X,))
    assert "topk" in rg.nodes("*")
    r = torch_ext.sweep(rg, "*", lambda v, s: v * 2, lambda o: float(o.sum()), progress=False)
    assert "topk" not in r.metrics and {"getitem", "getitem_1"} <= set(r.metrics)
    with pytest.raises(ValueError, match="node 'topk' holds a tuple"):
        torch_ext.sweep(rg, "topk", lambda v, s: v * 2, lambda o: float(o.sum()), progress=False)


def _chain_grafted_after_its_first_node():
    """Three Linear+ReLU blocks, then ``2 * t`` grafted after the first node, so every node below it is stale:
    (model, x, rg, first node, the last linear, |V0+(first)| before the graft, the block's node count h)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)]).eval()
    x = torch.randn(2, 4)
    rg = torch_ext.ReactiveGraph(model, (x,))
    first, last = rg.nodes()[0], rg.nodes()[-2]
    cone0 = len(rg.cone(first))
    h = len(rg.graft(first, lambda t: 2 * t))
    return model, x, rg, first, last, cone0, h


@pytest.mark.parametrize("bad", ["wrong shape", "wrong dtype", "not a tensor", "raises"])
def test_a_refused_patch_function_on_a_stale_node_changes_no_count_and_no_cached_value(bad):
    """patch(node, f) on a stale node computes f's argument (its stale ancestors) first. When f's result is
    refused, or f raises, those evaluations are undone (cost-model.md: a refused mutation changes no counter
    and no value): the stats stay as they were, and the next demand costs the graft's closed form, h + |V0+(u)|,
    with the outputs of the grafted model run eagerly."""
    model, x, rg, first, last, cone0, h = _chain_grafted_after_its_first_node()  # every node below it stale
    fns = {"wrong shape": lambda t: torch.zeros(3), "wrong dtype": lambda t: t.double(),
           "not a tensor": lambda t: 1.0, "raises": lambda t: 1 / 0}
    stats, text = rg.stats, str(rg)
    with pytest.raises((RuntimeError, TypeError, ZeroDivisionError), match=r"linear_2|division"):
        rg.patch(last, fns[bad])
    assert rg.stats == stats and str(rg) == str(text) and rg.patched() == []
    out = rg.demand()
    assert rg.stats["evaluations"] - stats["evaluations"] == h + cone0
    with torch.no_grad():
        y = model[0][0](x)
        eager = model[2](model[1](model[0][1](2 * y)))
    assert torch.equal(out, eager)
    rg.check_invariants()


def test_an_accepted_patch_function_on_a_stale_node_keeps_its_evaluations():
    """The same patch accepted: the stale ancestors f needed are evaluated once and stay valid, so the patch
    and the demand after it cost h + |V0+(u)| together, and the value is f of the eager baseline."""
    model, x, rg, first, last, cone0, h = _chain_grafted_after_its_first_node()
    before = rg.stats["evaluations"]
    rg.patch(last, lambda t: t + 1)
    out = rg.demand()
    assert rg.stats["evaluations"] - before == h + cone0
    with torch.no_grad():
        clean = model[2][0](model[1](model[0][1](2 * model[0][0](x))))
        eager = model[2][1](clean + 1)
    assert torch.equal(out, eager)


def test_restore_of_an_unpatched_hook_names_the_hook_and_what_is_patched():
    """restore(hook) with no patch there raised the engine's "restore %linear: node is not patched", naming a node
    the user never wrote; now the hook, its node and the patches standing."""
    HookPoint = pytest.importorskip("transformer_lens.hook_points").HookPoint

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
            self.hook_a, self.hook_b = HookPoint(), HookPoint()
            self.hook_a.name, self.hook_b.name = "hook_a", "hook_b"

        def forward(self, x):
            return self.out(self.hook_b(self.hook_a(self.lin(x)).relu()))

    g = torch_ext.ReactiveGraph(M(), (torch.randn(2, 4),))
    node = g.hook_names["hook_a"]
    with pytest.raises(ValueError, match=rf"restore\('hook_a'\): hook 'hook_a' \(node '{node}'\) is not patched "
                       r"\(patched now: none\)"):
        g.restore("hook_a")
    g.patch("hook_b", torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"is not patched \(patched now: 'hook_b'\)"):
        g.restore("hook_a")
    assert g.patched() == [g.hook_names["hook_b"]]
    g.restore("hook_b")
    assert g.patched() == []


def _hooked_model():
    HookPoint = pytest.importorskip("transformer_lens.hook_points").HookPoint

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 3)
            self.hook_a, self.hook_b = HookPoint(), HookPoint()
            self.hook_a.name, self.hook_b.name = "hook_a", "hook_b"

        def forward(self, x):
            h = self.hook_a(self.lin(x))
            return self.out(self.hook_b(h.relu() + h))

    torch.manual_seed(0)
    return M().eval(), torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))


def _eager_hooked(model, x, hook, value):
    h = getattr(model, hook).register_forward_hook(lambda mod, args, out: value)
    try:
        with torch.no_grad():
            return model(x)
    finally:
        h.remove()


_WRONG = {"dtype": (lambda v: v.double(), r"dtype torch\.float64; the hook's value is \[2, 5, 4\] of dtype "
                                          r"torch\.float32,? .*must (have|return) that dtype"),
          "shape": (lambda v: v[:1].clone(), r"shape \[1, 5, 4\]; the hook's value is \[2, 5, 4\] of dtype "
                                             r"torch\.float32,? .*must (have|return) that shape"),
          "device": (lambda v: v.to("meta"), r"device meta; the hook's value is \[2, 5, 4\] of dtype torch\.float32 on "
                                             r"cpu,? .*must (have|return) that device")}


@pytest.mark.parametrize("wrong", sorted(_WRONG))
def test_a_value_of_another_dtype_shape_or_device_by_hook_name_is_refused_naming_the_hook_everywhere(wrong):
    """By hook name, a patch value (a tensor, a patch function's result, a sweep's, batched or not, a grafted
    block's result) of another dtype, shape or device was refused naming the internal node ("patch %linear:
    expected dtype torch.float32, got Double"), which the user never wrote. Now the hook, what it got and what it
    must have; nothing changes, and a right value afterwards gives the eager answer."""
    model, x = _hooked_model()
    rg = torch_ext.ReactiveGraph(model, (x,))
    node, (bad, said) = rg.hook_names["hook_a"], _WRONG[wrong]
    clean, n = rg.demand().clone(), rg.num_nodes
    metric = lambda o: float(o[:, -1].sum())  # noqa: E731
    sites = [("hook_a", p) for p in range(3)]
    entries = {
        "patch": (lambda: rg.patch("hook_a", bad(rg.value("hook_a"))), r"patch 'hook_a': got "),
        "patch function": (lambda: rg.patch("hook_a", bad), r"patch function for hook 'hook_a' returned "),
        "sweep": (lambda: torch_ext.sweep(rg, sites, lambda v, s: bad(v), metric, progress=False),
                  r"patch function for hook 'hook_a' returned "),
        "sweep, every value computed first": (
            lambda: torch_ext.sweep(rg, sites, lambda v, s: bad(v), metric, progress=False, skip_identical=False,
                                    positions=False), r"patch function for hook 'hook_a' returned "),
        "batched sweep": (lambda: torch_ext.sweep(rg, sites, lambda v, s: bad(v), metric, progress=False,
                                                  batch_sites=True), r"patch function for hook 'hook_a' returned "),
        "sweep of the whole node": (lambda: torch_ext.sweep(rg, ["hook_a"], lambda v, s: bad(v), metric,
                                                            progress=False), r"patch function for hook 'hook_a' returned "),
        "graft": (lambda: rg.graft("hook_a", lambda v: bad(v) * 1), r"graft block after hook 'hook_a' returned "),
    }
    for entry, (call, lead) in entries.items():
        with pytest.raises(ValueError, match=lead + said) as e:
            call()
        assert f"%{node}" not in str(e.value), entry
        assert rg.patched() == [] and rg.num_nodes == n, entry
        assert torch.equal(rg.demand(), clean), entry
    rg.check_invariants()
    # A patch function writing into its argument was refused "for node 'linear'" too.
    inplace = lambda v, s=None: v.mul_(2)  # noqa: E731
    for call, lead in ((lambda: rg.patch("hook_a", inplace), r"patch function for 'hook_a' wrote in place"),
                       (lambda: torch_ext.sweep(rg, sites, inplace, metric, progress=False),
                        r"sweep patch function at site \('hook_a', 0\) wrote in place"),
                       (lambda: torch_ext.sweep(rg, sites, inplace, metric, progress=False, batch_sites=True),
                        r"sweep patch function at site \('hook_a', 0\) wrote in place")):
        with pytest.raises(ValueError, match=lead):
            call()
        assert rg.patched() == [] and torch.equal(rg.demand(), clean)
    good = rg.value("hook_a") * 0.5
    rg.patch("hook_a", good)
    assert torch.equal(rg.demand(), _eager_hooked(model, x, "hook_a", good))
    rg.restore()
    rg.patch("hook_a", lambda v: v * 0.5)
    assert torch.equal(rg.demand(), _eager_hooked(model, x, "hook_a", good))
    rg.restore()
    got = torch_ext.sweep(rg, sites, position_patch(0), metric, progress=False)
    for s in sites:
        assert got.metrics[s] == metric(_eager_hooked(model, x, "hook_a", position_patch(0)(rg.value("hook_a"), s))), s
