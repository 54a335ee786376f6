"""The sweep's per-site loop in C++ (`_C.Engine.sweep_sites`, issue 10) against the per-site Python
loop it replaced (`_one_site`, still taken when a progress bar is shown): bit-identical metrics,
identical counts, the same errors, and the engine left as it was found. The Python loop is forced by
making `_progress` return a wrapper instead of the site list itself.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_ext
from torch_ext import reactive

from helpers import ResidTanh, position_patch


def _graph():
    torch.manual_seed(0)
    model = ResidTanh(3).eval()  # seeds 0 itself: the same weights
    x = torch.randn(2, 5, 8)
    return model, x, torch_ext.ReactiveGraph(model, (x,))


def _python_loop(monkeypatch):
    monkeypatch.setattr(reactive, "_progress", lambda it, total, enabled, desc: iter(list(it)))


def _bits(v):
    if isinstance(v, torch.Tensor):
        return v.view(torch.int32).tolist()
    if isinstance(v, dict):
        return {k: _bits(x) for k, x in v.items()}
    return v


def _run(rg, sites, patch, metric, **kw):
    before = dict(rg.stats)
    r = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    after = rg.stats
    counts = {k: after[k] - before[k] for k in ("evaluations", "cost", "row_evaluations", "cutoffs")}
    return {s: _bits(v) for s, v in r.metrics.items()}, counts, (r.measured_evaluations, r.predicted_evaluations)


def _metrics():
    return {
        "scalar": lambda o: o[:, -1].sum(),
        "float": lambda o: float(o.mean()),
        "per_example": lambda o: o.sum(dim=(1, 2)),
        "dict": lambda o: {"a": o[:, 0].sum(), "b": o.sum(dim=(1, 2))},
    }


@pytest.mark.parametrize("positions", [True, False])
@pytest.mark.parametrize("metric", sorted(_metrics()))
def test_cpp_loop_equals_python_loop(monkeypatch, positions, metric):
    fn = _metrics()[metric]
    _, _, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    # Sites on several nodes, in an interleaved order, on the graph input too (copied before patching), with runs of
    # sites on one node (sweep_sites looks a node up once per run) between sites on other nodes.
    x_node = [n.name for n in rg.graph.nodes() if n.kind == "placeholder" and n.role == "input"][0]
    sites = [(tanh[1], 3), (tanh[0], 0), (tanh[1], 1), (x_node, 2), (tanh[2], 4), (tanh[0], 4),
             (tanh[0], 1), (tanh[0], 2), (tanh[2], 0), (x_node, 0), (x_node, 3), (tanh[1], 0)]
    patch = position_patch(0.5)
    fast = _run(rg, sites, patch, fn, positions=positions)
    rg.check_invariants()
    _python_loop(monkeypatch)
    slow = _run(rg, sites, patch, fn, positions=positions)
    assert fast == slow
    assert fast[2][0] == fast[2][1]  # measured = predicted evaluations


def test_standing_patch_mixes_transaction_and_cpp_runs(monkeypatch):
    _, _, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    rg.patch(tanh[1], rg.value(tanh[1]) * 2)
    rg.demand()  # the standing patch's own cone, evaluated before either sweep is counted
    pinned_value = rg.value(tanh[1]).clone()
    # tanh[1] is pinned: its sites take the transaction path, between C++ runs of the others.
    sites = [(tanh[0], 1), (tanh[0], 2), (tanh[1], 0), (tanh[2], 3), (tanh[1], 4), (tanh[2], 0)]
    patch = position_patch(-1.0)
    fast = _run(rg, sites, patch, lambda o: o.sum())
    assert rg.patched() == [tanh[1]]
    assert torch.equal(rg.value(tanh[1]), pinned_value)
    rg.check_invariants()
    _python_loop(monkeypatch)
    slow = _run(rg, sites, patch, lambda o: o.sum())
    assert fast == slow
    assert rg.patched() == [tanh[1]]
    rg.check_invariants()


def test_outputs_kept_by_the_metric_stay_correct():
    """The engine reuses an output buffer only while it holds the sole reference: outputs a metric
    keeps must not be overwritten by later sites."""
    model, x, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    kept = []

    def metric(o):
        kept.append(o)
        return o.sum()

    sites = [(tanh[1], p) for p in range(5)]
    patch = position_patch(0.0)
    torch_ext.sweep(rg, sites, patch, metric, progress=False)
    kept = kept[1:]  # the first call measures the unpatched graph
    # The reference: each site swept alone on a fresh graph, so that the same kernels run on the same
    # rows (a token-granular cone runs the linears on rows [p, T); a whole-node recompute on all rows
    # may differ in the last bit on CPUs whose GEMM blocks by row count). Zero tolerance.
    for s, out in zip(sites, kept):
        fresh = torch_ext.ReactiveGraph(model, (x,), cache=False)
        alone = torch_ext.sweep(fresh, [s], patch, lambda o: o.clone(), progress=False)
        assert torch.equal(out, alone.metrics[s])
        fresh.patch(s[0], patch(fresh.value(s[0]), s))  # a whole-node recompute: within 1e-6
        torch.testing.assert_close(out, fresh.demand(), rtol=1e-6, atol=1e-6)
        fresh.restore()


def test_patch_returning_a_non_tensor_names_the_site():
    _, _, rg = _graph()
    t = [n for n in rg.nodes() if n.startswith("tanh")][0]
    clean = rg.demand().clone()
    with pytest.raises(TypeError, match=r"patch function at site .*returned list"):
        torch_ext.sweep(rg, [(t, 0), (t, 1)], lambda v, s: [1.0], lambda o: o.sum(), progress=False)
    assert torch.equal(rg.demand(), clean)
    rg.check_invariants()


def test_patch_writing_into_the_clean_value_is_refused_mid_sweep():
    _, _, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    clean = rg.demand().clone()

    def patch(v, site):
        if site[1] == 2:
            v.add_(1.0)  # writes into the cached activation
            return v
        return v * 0.5

    with pytest.raises(ValueError, match="wrote in place"):
        torch_ext.sweep(rg, [(tanh[0], p) for p in range(4)], patch, lambda o: o.sum(), progress=False)
    assert torch.equal(rg.demand(), clean)  # repaired: the written node was recomputed
    rg.check_invariants()


def _first_changed_reference(cached, now, axis):
    # By bits: -0.0 differs from 0.0 (test_reactive_positions.py, sign of a zero), equal NaN bits do not.
    changed = (now.view(torch.int32) != cached.view(torch.int32)).movedim(axis, 0).reshape(cached.shape[axis], -1)
    changed = changed.any(1).nonzero()
    return int(changed[0, 0]) if len(changed) else cached.shape[axis]


def test_first_changed_row_dense_scan_matches_the_general_path():
    """The in-place row scan of dense CPU tensors gives the general path's answers."""
    _, _, rg = _graph()
    eng = rg._engine
    t = [n for n in rg.nodes() if n.startswith("tanh")][1]
    axis = eng.seq_axis(t)
    assert axis == 1
    cached = rg.value(t)
    T = cached.shape[axis]
    cases = []
    for p in range(T):
        v = cached.clone()
        v[1, p, 3] += 1.0  # one element of one example
        cases.append(v)
    nan = cached.clone()
    nan[0, 3, 0] = float("nan")
    zero = cached.clone()
    zero[1, 2, 5] = 0.0
    cases += [cached.clone(), nan, zero]
    signed = zero.clone()
    signed[1, 2, 5] = -0.0
    cases.append(signed)
    for v in cases:
        assert eng.first_changed_row(t, v) == _first_changed_reference(cached, v, axis)
    # Non-contiguous values take the general path, with the same answers.
    for v in cases[:3]:
        nc = v.transpose(0, 1).contiguous().transpose(0, 1)
        assert not nc.is_contiguous()
        assert eng.first_changed_row(t, nc) == _first_changed_reference(cached, v, axis)


def test_first_changed_row_compares_bits_so_a_signed_zero_is_a_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.ReLU()).eval()
    x = torch.zeros(2, 4, 3)
    rg = torch_ext.ReactiveGraph(model, (x,))
    eng = rg._engine
    n = rg.nodes()[0]
    assert eng.seq_axis(n) == 1
    v = rg.value(n).clone()
    v[:, 2] = -0.0
    assert eng.first_changed_row(n, v) == 2  # -0.0 against 0.0: 1 / x tells them apart downstream
    v[:, 2] = 0.0
    v[1, 3, 2] = float("nan")
    assert eng.first_changed_row(n, v) == 3
    cached_nan = v.clone()
    rg.patch(n, cached_nan)
    rg.demand()
    assert eng.first_changed_row(n, cached_nan.clone()) == 4  # the same NaN bits: unchanged
    rg.restore()


def test_sweep_sites_stops_even_when_fail_returns():
    """`fail` is expected to raise; one that returns still stops the loop before it uses a bad value."""
    _, _, rg = _graph()
    eng = rg._engine
    t = [n for n in rg.nodes() if n.startswith("tanh")][0]
    calls = []
    with pytest.raises(RuntimeError, match="returned no tensor"):
        eng.sweep_sites([t], [t], [lambda v, s: 1.0], False, [], [], lambda o: o.sum(), 0,
                        reactive._metric_value, lambda *a: calls.append(a[:2]))
    assert calls == [("not_tensor", 0)]
    before = eng.value(t).clone()
    with pytest.raises(RuntimeError, match="wrote into the copy"):
        eng.sweep_sites([t], [t], [lambda v, s: v.mul_(2.0)], False, [], [], lambda o: o.sum(), 0,
                        reactive._metric_value, lambda *a: calls.append(a[:2]))
    assert calls[-1] == ("patch_wrote", 0)
    eng.check_intact(t)  # the patch function wrote into a copy: the cached value is untouched
    assert torch.equal(eng.value(t), before)
    rg.demand()
    rg.check_invariants()


def test_copies_given_to_patch_functions_are_reused_only_while_nobody_holds_them():
    """sweep_sites hands each site a copy on write of the activation (no bytes copied unless written);
    where that cannot stand for a clone (a value at an offset into its storage), it writes the copy into
    an earlier site's copy of the same shape when nothing else holds it: a copy (or a view of it) the
    patch function kept, or returned as the patched value into an output the metric kept, is never
    written again."""
    _, _, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    sites = [(tanh[k % 3], p) for k in range(3) for p in range(5)]
    lazy = []

    def reads_only(v, site):
        lazy.append(torch._C._is_cow_tensor(v))  # (v.data_ptr() would ask for writable memory: a copy)
        return v * 0.5

    torch_ext.sweep(rg, sites, reads_only, lambda o: o.sum(), progress=False)
    assert lazy == [True] * len(sites)

    class RowsFromOne(torch.nn.Module):  # x[1:] is dense but starts at an offset: no copy on write for it
        def forward(self, x):
            return torch.tanh(torch.tanh(x)[1:])

    x = torch.randn(3, 4)
    sliced = torch_ext.ReactiveGraph(RowsFromOne(), (x,))
    node = next(n for n in sliced.nodes() if n.startswith("slice"))
    assert sliced.engine.value(node).storage_offset() > 0
    seen = []

    def keeps_nothing(v, site):
        seen.append(v.data_ptr())
        return v * (0.5 + site[1])

    r = torch_ext.sweep(sliced, [(node, p) for p in range(5)], keeps_nothing, lambda o: o.sum(), progress=False)
    assert len(set(seen)) == 1  # one buffer, written again at every site
    for p in range(5):
        assert r.metrics[(node, p)] == float(torch.tanh(torch.tanh(x)[1:] * (0.5 + p)).sum())

    kept = []  # (what the function kept, the clean value it was given)

    def keeps(v, site):
        node, p = site
        clean = rg.engine.value(node).clone()
        if p % 3 == 0:
            kept.append((v, clean))                      # the copy itself
        elif p % 3 == 1:
            kept.append((v[:, 1:], clean[:, 1:]))        # a view of it
        else:
            kept.append((torch.from_numpy(v.numpy()), clean))  # memory shared through numpy
        return v if p == 4 else v * 0.5                  # the copy itself as the patched value, once

    outs = []

    def metric(o):
        outs.append(o)
        return o.sum()

    r = torch_ext.sweep(rg, sites, keeps, metric, progress=False)
    for held, clean in kept:
        assert torch.equal(held, clean)
    for site, out in zip(sites, outs[1:]):
        assert float(out.sum()) == r.metrics[site]
    rg.check_invariants()


# ---- sweep(skip_identical=True), the default: a site whose patched value is bit-identical to the node's is
# not evaluated; skip_identical=False evaluates every site's cone
def _identical_or_filled(fill: float, identical_at: set):
    """position_patch(fill), except that positions in ``identical_at`` return an unchanged copy."""
    filled = position_patch(fill)

    def patch(value, site):
        return value.clone() if site[1] in identical_at else filled(value, site)

    return patch


@pytest.mark.parametrize("loop", ["cpp", "python"])
@pytest.mark.parametrize("positions", [True, False])
def test_skip_identical_takes_the_current_outputs_and_leaves_the_ledger(monkeypatch, loop, positions):
    _, _, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    sites = [(n, p) for n in tanh for p in range(5)]
    same = {0, 3}
    patch = _identical_or_filled(0.25, same)
    metric = lambda o: o[:, -1].clone()  # noqa: E731  (per example: compared bit for bit)
    if loop == "python":
        _python_loop(monkeypatch)
    cones = {n: len(rg.cone(n)) for n in tanh}
    # skip_identical=False: every site costs its cone, the identical ones included (the plain sum).
    before = rg.stats["evaluations"]
    full = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=positions, skip_identical=False)
    assert full.measured_evaluations == full.predicted_evaluations == sum(cones[n] for n, _ in sites)
    assert rg.stats["evaluations"] - before == full.measured_evaluations
    assert "identical_sites" not in full.extra
    before = rg.stats["evaluations"]
    r = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=positions)  # the default skips
    # The same bits at every site: an identical value's cone would recompute the cached outputs.
    assert {s: _bits(v) for s, v in r.metrics.items()} == {s: _bits(v) for s, v in full.metrics.items()}
    explicit = torch_ext.sweep(rg, sites, patch, metric, progress=False, positions=positions, skip_identical=True)
    assert {s: _bits(v) for s, v in explicit.metrics.items()} == {s: _bits(v) for s, v in r.metrics.items()}
    assert explicit.measured_evaluations == r.measured_evaluations
    skipped = [s for s in sites if s[1] in same]
    assert r.extra["identical_sites"] == len(skipped)
    assert r.extra["skipped_evaluations"] == sum(cones[n] for n, _ in skipped)
    # The ledger: the other sites cost their cones, the skipped ones nothing, and the two agree.
    assert r.measured_evaluations == r.predicted_evaluations == sum(cones[n] for n, p in sites if p not in same)
    assert rg.stats["evaluations"] - before == r.measured_evaluations + explicit.measured_evaluations
    assert r.predicted_evaluations + r.extra["skipped_evaluations"] == full.predicted_evaluations
    rg.check_invariants()


def test_skip_identical_on_a_pinned_node_and_signed_zero(monkeypatch):
    """The transaction path (a standing patch pins the node) skips too; and -0.0 for 0.0 is a change,
    never skipped (a consumer such as 1/x tells the zeros apart)."""

    class Recip(nn.Module):
        def forward(self, x):
            y = torch.relu(x)  # zeros where x < 0
            return 1.0 / (y + 0.0 * x)  # 0.0 * x keeps -0.0 where x < 0: +inf or -inf

    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]])
    rg = torch_ext.ReactiveGraph(Recip().eval(), (x,))
    relu = [n for n in rg.nodes() if n.startswith("relu")][0]

    def flip(value, site):
        return value.clone() if site[1] == "same" else torch.where(value == 0, -0.0, value)

    r = torch_ext.sweep(rg, [(relu, "same"), (relu, "flip")], flip, lambda o: o.clone(), progress=False)
    assert r.extra["identical_sites"] == 1 and r.measured_evaluations == r.predicted_evaluations == len(rg.cone(relu))
    assert torch.equal(r.metrics[(relu, "same")], rg.demand())
    assert not torch.equal(r.metrics[(relu, "flip")], rg.demand())  # evaluated: the signs of 1/±0 differ
    # A standing patch on the node: its sites take the transaction path, which skips the same way.
    tanh_rg = _graph()[2]
    tanh = [n for n in tanh_rg.nodes() if n.startswith("tanh")]
    tanh_rg.patch(tanh[1], tanh_rg.value(tanh[1]) * 2)
    tanh_rg.demand()
    sites = [(tanh[1], p) for p in range(5)] + [(tanh[0], p) for p in range(5)]
    patch = _identical_or_filled(-1.0, {1, 2})
    ref = torch_ext.sweep(tanh_rg, sites, patch, lambda o: o.sum(), progress=False, skip_identical=False)
    got = torch_ext.sweep(tanh_rg, sites, patch, lambda o: o.sum(), progress=False)  # skip_identical: the default
    assert got.metrics == ref.metrics and got.extra["identical_sites"] == 4
    assert got.measured_evaluations == got.predicted_evaluations
    assert tanh_rg.patched() == [tanh[1]]
    tanh_rg.check_invariants()


def test_skip_identical_refuses_a_non_bool():
    _, _, rg = _graph()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    with pytest.raises(TypeError, match="skip_identical"):
        torch_ext.sweep(rg, [(tanh[0], 0)], position_patch(1.0), lambda o: o.sum(), progress=False,
                        skip_identical="yes")


def test_repeated_site_list_after_a_graft_takes_the_new_graph():
    """The site list's resolved plan (nodes, labels, cone sizes) is kept between sweeps: a graft between two
    sweeps of one list must give the grafted graph's cone sizes and metrics, as a graph grafted before
    its first sweep does."""
    model, x, rg = _graph()
    sites = rg.nodes()[:3]
    patch = lambda v, s: v * 0.5  # noqa: E731
    metric = lambda o: o.sum()  # noqa: E731
    first = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    before = {s: rg._cone_size(s) for s in sites}
    block = lambda t: torch.tanh(t) * 2.0  # noqa: E731
    rg.graft(sites[1], block)
    again = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    _, _, fresh = _graph()
    fresh.graft(sites[1], block)
    want = torch_ext.sweep(fresh, sites, patch, metric, progress=False)
    assert rg._cone_size(sites[0]) == before[sites[0]] + 2  # the block's two nodes joined the first site's cone
    assert again.predicted_evaluations == want.predicted_evaluations != first.predicted_evaluations
    assert again.measured_evaluations == again.predicted_evaluations
    assert _bits(again.metrics) == _bits(want.metrics)
    assert again.node_labels == want.node_labels


class _RowSums(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(1000, 1000)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum(dim=-1)


@pytest.mark.parametrize("loop", ["cpp", "python"])
def test_skip_identical_needs_the_cached_layout_too(monkeypatch, loop):
    """A patch returning the cached bits in another layout (``v.t().contiguous().t()``) is another input: eager's
    sum over the last dim reads it in another order and rounds otherwise (3e-5 here). skip_identical took it as
    identical and answered the clean sums, silently not eager's."""
    torch.manual_seed(0)
    model = _RowSums().eval()
    x = torch.randn(64, 1000)
    rg = torch_ext.ReactiveGraph(model, (x,))
    relu = [n for n in rg.nodes() if n.startswith("relu")][0]
    if loop == "python":
        _python_loop(monkeypatch)
    with torch.no_grad():
        h = model.lin(x).relu()
        eager = h.t().contiguous().t().sum(dim=-1)
        clean = h.sum(dim=-1)
    assert not torch.equal(eager, clean)  # the case: the layout changes the bits
    for skip in (True, False):
        r = torch_ext.sweep(rg, [relu], lambda v, s: v.t().contiguous().t(), lambda o: o.clone(),
                            progress=False, skip_identical=skip)
        assert torch.equal(r.metrics[relu], eager), skip
        assert "identical_sites" not in r.extra or r.extra["identical_sites"] == 0
    # The same bits in the same layout are still identical: taken unevaluated.
    r = torch_ext.sweep(rg, [relu], lambda v, s: v.clone(), lambda o: o.clone(), progress=False)
    assert r.extra["identical_sites"] == 1 and torch.equal(r.metrics[relu], clean)


@pytest.mark.parametrize("loop", ["cpp", "python"])
@pytest.mark.parametrize("positions", [True, False])
def test_unpatched_metric_measured_in_the_cpp_loop_is_guarded(monkeypatch, positions, loop):
    """The C++ loop measures the unpatched outputs first (sweep_sites(clean=...)): the metric gets copies
    there too. A write into them (in place, or through .data, which no version counter sees) is refused
    naming the unpatched run, or cannot reach the cache; the clean metric is the eager one. The Python
    loop (a progress bar) measures it itself, first."""
    model, x, rg = _graph()
    if loop == "python":
        _python_loop(monkeypatch)
    clean = rg.demand().clone()
    tanh = [n for n in rg.nodes() if n.startswith("tanh")]
    sites = [(tanh[1], p) for p in range(3)]
    patch = position_patch(0.5)
    calls = []

    def writes_first(o):
        calls.append(1)
        if len(calls) == 1:
            o.mul_(2.0)
        return o.sum()

    with pytest.raises(ValueError, match="metric wrote .* at site 'unpatched'"):
        torch_ext.sweep(rg, sites, patch, writes_first, progress=False, positions=positions)
    assert len(calls) == 1  # refused before any site ran
    assert torch.equal(rg.demand(), clean)

    def through_data(o):
        value = float(o.sum())
        o.data.mul_(0.0)
        return value

    r = torch_ext.sweep(rg, sites, patch, through_data, progress=False, positions=positions)
    assert r.clean_metric == float(clean.sum())
    assert torch.equal(rg.demand(), clean)
    again = torch_ext.sweep(rg, sites, patch, lambda o: o.sum(), progress=False, positions=positions)
    assert again.metrics == r.metrics and again.clean_metric == r.clean_metric
    rg.check_invariants()


@pytest.mark.parametrize("kw", [{}, {"batch_sites": True}, {"reads": {0: (slice(None), -1)}}, "python_loop"],
                         ids=["cpp_loop", "batched", "reads", "python_loop"])
@pytest.mark.parametrize("how", ["backward", "autograd_grad"])
def test_a_metric_asking_for_a_gradient_says_the_sweep_has_none(monkeypatch, kw, how):
    """Attribution patching: a metric calling ``.backward()`` (or ``torch.autograd.grad``) on the outputs got
    torch's "element 0 of tensors does not require grad and does not have a grad_fn", which names neither the
    sweep nor the way out. The refusal says the graph runs without autograd and where gradients with respect to
    activations come from (eager with hooks); nothing is left patched."""
    model, x, rg = _graph()
    if kw == "python_loop":
        _python_loop(monkeypatch)
        kw = {}
    clean = rg.demand().clone()

    def metric(out):
        m = out[:, -1].sum()
        if how == "backward":
            m.backward()
        else:
            torch.autograd.grad(m, out)
        return m

    sites = [(n, p) for n in rg.nodes("tanh*") for p in range(2)]
    with pytest.raises(RuntimeError, match=r"sweep: the metric asked for a gradient .* runs without autograd.*"
                                           r"attribution patching.*rg.gradient\(metric, nodes\)") as e:
        torch_ext.sweep(rg, sites, position_patch(0.0), metric, progress=False, **kw)
    assert "does not require grad" in str(e.value)  # torch's own words kept, after ours
    assert rg.patched() == []
    assert torch.equal(rg.demand(), clean)
