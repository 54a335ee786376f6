"""The batched sweep driver (``sweep(..., batch_sites=...)``, torch_ext/reactive.py ``_sweep``) against an
eager-hook sweep: each site patched by a forward hook on its module, the model run, the hook removed. Batched
results are compared at the batched tests' tolerance (1e-6 relative: a K-times stack rounds otherwise)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_ext


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class _OffsetRowSums(nn.Module):
    """lin1 -> relu -> lin2 (bias 1000) -> sum over the last dim, less 1e6: the sum cancels the offset, so
    the order in which it reads lin2's output shows far above 1e-6 (5e-3 relative)."""

    def __init__(self, width=1000, offset=1000.0):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.lin2 = nn.Linear(width, width)
        with torch.no_grad():
            self.lin2.bias += offset
        self.offset = offset * width

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x))).sum(dim=-1) - self.offset


def _setup(offset=1000.0):
    torch.manual_seed(0)
    model = _OffsetRowSums(offset=offset).eval()
    x = torch.randn(2, 16, 1000)
    rg = torch_ext.ReactiveGraph(model, (x,))
    modules = {"linear": model.lin1, "relu": model.act, "linear_1": model.lin2}
    assert set(modules) <= set(rg.nodes())
    assert rg.seq_axis("linear_1") == 1  # the row path applies
    return model, x, rg, modules


def _eager_sweep(model, x, modules, sites, patch, metric):
    out = {}
    for s in sites:
        handle = modules[s[0]].register_forward_hook(lambda mod, args, o, s=s: patch(o, s))
        try:
            with torch.no_grad():
                out[s] = metric(model(x))
        finally:
            handle.remove()
    return out


def _other_layout(v):
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


_READS = {0: (slice(None), -1)}
_KWS = [{"batch_sites": True}, {"batch_sites": 2}, {"batch_sites": True, "reads": _READS},
        {"batch_sites": 2, "reads": _READS}, {"batch_sites": True, "positions": False}]


@pytest.mark.parametrize("kw", _KWS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_batched_sites_in_another_layout_are_evaluated_as_eager(kw):
    """The cached bits in another layout (``v.t().contiguous().t()``) are another input: eager's sum reads
    them in another order. The batched driver took such a site as identical (``_same_bits`` alone, or the
    row path's byte scan) and answered the clean metric, 5e-3 off eager's; a changed value in another layout
    was stacked (torch.cat lays it out afresh) or run from its first changed row. Same-layout copies of the
    cached value stay identical (answered unevaluated)."""
    model, x, rg, modules = _setup()
    node = "linear_1"

    def patch(v, site):
        kind = site[1]
        if kind == "same":
            return v.clone()
        if kind == "layout":
            return _other_layout(v)
        w = v.clone()  # changed from row 5 on, in another layout
        w[:, 5:] += 1.0
        return _other_layout(w) if kind == "changed_layout" else w

    rows = "reads" in kw
    metric = (lambda out: out[:, -1].clone()) if rows else (lambda out: out.clone())  # noqa: E731
    sites = [(node, kind, i) for i in range(2) for kind in ("same", "layout", "changed_layout", "changed")]
    want = _eager_sweep(model, x, modules, sites, patch, metric)
    clean = metric(rg.demand())
    assert _rel(want[(node, "layout", 0)], clean) > 1e-4  # the case: the layout changes the sums
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    for s in sites:
        assert _rel(got.metrics[s], want[s]) <= 1e-6, (s, _rel(got.metrics[s], want[s]))
        if s[1] == "same":
            assert torch.equal(got.metrics[s], clean), s
    assert got.extra["identical_sites"] == 2
    assert got.measured_evaluations == got.predicted_evaluations  # the two same-layout copies only
    assert rg.patched() == []
    rg.check_invariants()


def _noise(gen):
    return lambda v, site: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype)


@pytest.mark.parametrize("kw", _KWS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_a_noise_patch_draws_once_per_site_as_in_eager(kw):
    """A noise-ablation sweep from a seeded generator gives the eager-hook sweep's values: the patch function
    runs once per site, in site order. It ran twice for a site alone in its unit (the value for the stack,
    then again in the one-site path), so that site and every later one drew other noise. Sites interleave
    nodes, and one node has a single site. (No offset: batched rounding is not amplified here.)"""
    model, x, rg, modules = _setup(offset=0.0)
    sites = [("linear", 0), ("relu", 0), ("linear", 1), ("linear_1", 0), ("linear", 2), ("linear_1", 1),
             ("linear_1", 2)]
    rows = "reads" in kw
    metric = (lambda out: out[:, -1].clone()) if rows else (lambda out: out.clone())  # noqa: E731
    want = _eager_sweep(model, x, modules, sites, _noise(torch.Generator().manual_seed(7)), metric)
    got = torch_ext.sweep(rg, sites, _noise(torch.Generator().manual_seed(7)), metric, progress=False, **kw)
    for s in sites:
        assert _rel(got.metrics[s], want[s]) <= 1e-6, (s, _rel(got.metrics[s], want[s]))
    rg.check_invariants()


@pytest.mark.parametrize("kw", _KWS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_the_patch_function_runs_once_per_site(kw):
    """Identical sites, a node with one site, stacked sites, sites in another layout: one call each."""
    model, x, rg, modules = _setup()
    calls = []

    def patch(v, site):
        calls.append(site)
        if site[1] == 0:
            return v.clone()  # identical
        if site[1] == 1:
            return _other_layout(v)
        w = v.clone()
        w[:, site[1]:] *= 0.5
        return w

    sites = [("relu", 2)] + [(n, i) for n in ("linear", "linear_1") for i in range(5)]
    metric = (lambda out: out[:, -1].clone()) if "reads" in kw else (lambda out: out.clone())  # noqa: E731
    torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    assert calls == sites


@pytest.mark.parametrize("kw", [{"batch_sites": True}, {"batch_sites": 2}, {}, {"positions": False}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "one_at_a_time")
def test_a_metric_reading_outside_reads_at_one_site_only_is_refused(kw):
    """The read check (the metric run with undeclared elements NaN, +inf, -inf, 0.75) runs per site, not
    once per sweep or per unit: whether a metric reads outside ``reads=`` can depend on the values it reads.
    This one reads an undeclared row only where the declared row's sum passes a threshold, which the clean
    outputs and the first three sites do not: a check of the clean outputs or of a unit's first site alone
    passes it, and the last site got NaN for the undeclared row on the row path (its true value elsewhere)."""
    model, x, rg, modules = _setup(offset=0.0)
    node = "linear_1"

    def patch(v, site):
        w = v.clone()
        w[:, -1] += float(site[1])  # the last row's sums grow by 1000 per step
        return w

    threshold = float(rg.demand()[:, -1].sum()) + 2000.0 * 2.5  # two examples: 2000 per step

    def metric(out):
        last = out[:, -1].sum()
        return float(last) if float(last) < threshold else float(last + out[:, -2].sum())

    sites = [(node, i) for i in range(4)]
    with pytest.raises(ValueError, match=r"the metric reads elements of output 0 .* outside reads="):
        torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=_READS, **kw)
    # Declared, the same metric is answered at every site as eager gives it.
    both = {0: (slice(None), [-2, -1])}
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads=both, **kw)
    want = _eager_sweep(model, x, modules, sites, patch, metric)
    for s in sites:
        assert abs(got.metrics[s] - want[s]) <= 1e-6 * abs(want[s]), s
    assert rg.patched() == []
    rg.check_invariants()


class _OffsetAfterRelu(nn.Module):
    """lin -> relu -> + 1000 -> sum over the last dim, less 1e6: an elementwise op between the site and the
    reduction, which must keep the layout of its input (eager's add does)."""

    def __init__(self, width=1000):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x):
        return (self.act(self.lin(x)) + 1000.0).sum(dim=-1) - 1e6


@pytest.mark.parametrize("kw", _KWS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_a_batched_site_in_another_layout_keeps_it_through_an_elementwise_op(kw):
    """The site in another layout runs as a transaction (patch, demand, rollback), whose add keeps the layout
    as eager's does; the prepared cone (evaluate_patched) wrote the add contiguous, and the sum after it gave
    the clean sums, 5e-4 off eager's."""
    torch.manual_seed(0)
    model = _OffsetAfterRelu().eval()
    x = torch.randn(2, 16, 1000)
    rg = torch_ext.ReactiveGraph(model, (x,))
    assert "relu" in rg.nodes() and rg.seq_axis("relu") == 1
    modules = {"relu": model.act}

    def patch(v, site):
        return _other_layout(v) if site[1] == "layout" else v.clone()

    metric = (lambda out: out[:, -1].clone()) if "reads" in kw else (lambda out: out.clone())  # noqa: E731
    sites = [("relu", kind, i) for i in range(2) for kind in ("layout", "same")]
    want = _eager_sweep(model, x, modules, sites, patch, metric)
    clean = metric(rg.demand())
    assert _rel(want[("relu", "layout", 0)], clean) > 1e-4
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    for s in sites:
        assert _rel(got.metrics[s], want[s]) <= 1e-6, (s, _rel(got.metrics[s], want[s]))
    assert got.extra["identical_sites"] == 2
    assert got.measured_evaluations == got.predicted_evaluations
    rg.check_invariants()


_ONE_AT_A_TIME = [{}, {"reads": _READS}, {"positions": False}, {"positions": False, "skip_identical": False},
                  {"skip_identical": False}]


@pytest.mark.parametrize("kw", _ONE_AT_A_TIME, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("model_kind", ["offset_after_relu", "offset_row_sums"])
def test_one_at_a_time_sites_in_another_layout_give_eagers_bits(kw, model_kind):
    """The one-at-a-time loop (C++ sweep_sites): a site value in another layout ran the prepared cone, whose out=
    steps wrote the add's result in the trace's layout (the sum then read the clean order: the clean sums exactly,
    5e-4 off eager's), and the row path kept the rows before the first changed one, computed from the cached
    layout (6e-5 off). Such a value now runs the whole cone on the functional kernels: eager's bits."""
    torch.manual_seed(0)
    if model_kind == "offset_after_relu":
        model, x = _OffsetAfterRelu().eval(), torch.randn(2, 16, 1000)
        rg = torch_ext.ReactiveGraph(model, (x,))
        node, modules = "relu", {"relu": model.act}
    else:
        model, x, rg, modules = _setup()
        node = "linear_1"

    def patch(v, site):
        w = v.clone()
        if site[1] == "changed_layout":
            w[:, 5:] += 1.0
        return w if site[1] == "same" else _other_layout(w)

    metric = (lambda out: out[:, -1].clone()) if "reads" in kw else (lambda out: out.clone())  # noqa: E731
    sites = [(node, kind) for kind in ("layout", "changed_layout", "same")]
    want = _eager_sweep(model, x, modules, sites, patch, metric)
    clean = metric(rg.demand())
    assert _rel(want[(node, "layout")], clean) > 1e-5  # the case: the layout changes the sums
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    for s in sites:
        assert torch.equal(got.metrics[s], want[s]), (s, _rel(got.metrics[s], want[s]))
    assert got.measured_evaluations == got.predicted_evaluations
    rg.check_invariants()


@pytest.mark.parametrize("kw", _KWS + [{}], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "one_at_a_time")
def test_a_patch_function_reusing_one_output_buffer_gives_each_site_its_value(kw):
    """A patch function that writes each site's value into one preallocated buffer and returns it (or a view
    of it) is fine in an eager-hook sweep: each hook's value is consumed before the next is written. The
    batched driver called the function for every site of a unit first and stacked the values afterwards, so
    every site but the last of a unit read the last site's bits: 5 of 6 sites of a resid sweep answered
    another position's metric, silently. Each returned value is now kept as a copy (copy on write)."""
    torch.manual_seed(0)
    model = _OffsetRowSums(width=16, offset=0.0).eval()
    x = torch.randn(2, 6, 16)
    rg = torch_ext.ReactiveGraph(model, (x,))
    modules = {"linear": model.lin1, "relu": model.act, "linear_1": model.lin2}
    buf = torch.empty(2, 6, 16)

    def patch(v, site):
        buf.copy_(v)
        buf[:, site[1]] = 0.0
        return buf if site[0] == "relu" else buf[:, :]

    sites = [(n, p) for n in ("linear", "relu") for p in range(6)]
    metric = (lambda out: out[:, -1].clone()) if "reads" in kw else (lambda out: out.clone())  # noqa: E731
    want = _eager_sweep(model, x, modules, sites, patch, metric)
    assert not torch.equal(want[("relu", 0)], want[("relu", 5)])  # the case: the sites' values differ
    got = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    for s in sites:
        assert _rel(got.metrics[s], want[s]) <= 1e-6, (s, _rel(got.metrics[s], want[s]))
    assert rg.patched() == []
    rg.check_invariants()
