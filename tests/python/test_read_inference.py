"""sweep(reads="auto"): the output elements a metric reads, inferred from one traced call (torch_ext/_read_inference.py),
and the sweep's check that every site's metric stays inside them (a rerun without reads otherwise)."""
from __future__ import annotations

import pytest
import torch

import torch_ext
from torch_ext import _read_inference
from test_reactive_positions import _zoo_sweep_setup


def _infer(metric, *outs):
    return _read_inference.infer_reads(metric, list(outs), [f"o{k}" for k in range(len(outs))],
                                       lambda flat: flat[0] if len(flat) == 1 else tuple(flat))


def _elements(reads, name, shape):
    """The flat positions a reads index picks."""
    ids = torch.arange(torch.Size(shape).numel()).reshape(shape)
    return sorted(ids[reads[name]].reshape(-1).tolist())


X = torch.randn(2, 5, 7)
FLAT = torch.arange(70).reshape(2, 5, 7)


@pytest.mark.parametrize("metric, picked", [
    (lambda o: (o[:, -1, 3] - o[:, -1, 5]).mean(), FLAT[:, -1, [3, 5]]),
    (lambda o: (o[:, -1, 3] - o[:, -1, 5]).mean().item(), FLAT[:, -1, [3, 5]]),   # a Python float
    (lambda o: o[0, 2], FLAT[0, 2]),                                                # an element returned as it is
    (lambda o: o[:, 2:4].reshape(2, -1).transpose(0, 1)[:3].sum(), FLAT[:, 2, :3]),  # views and a reshape
    (lambda o: o.float()[:, -1].log_softmax(-1)[:, 1].sum(), FLAT[:, -1]),        # log_softmax reads the row
    (lambda o: o.gather(2, torch.tensor([[[1]], [[6]]]).expand(2, 5, 1)).sum(),
     torch.stack([FLAT[0, :, 1], FLAT[1, :, 6]])),                                # gather with a constant index
    (lambda o: {"a": o[1, 0, 0] * 2, "b": o[0, -1, -1]}, torch.tensor([FLAT[1, 0, 0], FLAT[0, -1, -1]])),
    (lambda o: (torch.zeros_like(o) + o.new_ones(2, 5, 7))[:, 0, 0].sum() + o[0, 1, 2], FLAT[0, 1, 2]),  # shapes only
])
def test_the_elements_a_metric_reads(metric, picked):
    reads, why = _infer(metric, X)
    assert reads is not None, why
    assert _elements(reads, "o0", X.shape) == sorted(picked.reshape(-1).tolist())


@pytest.mark.parametrize("metric, why", [
    (lambda o: o.sum(), "reads every element"),
    (lambda o: o[o.argmax() // 7 // 5].sum(), "reads every element"),      # an index computed from the values
    (lambda o: torch.tensor(1.0), "reads no output element"),
    (lambda o: o.clone().fill_(0).sum(), "writes into an output element"),
    (lambda o: 1 / 0, "failed when traced: ZeroDivisionError"),
])
def test_nothing_is_inferred_where_nothing_is_gained_or_known(metric, why):
    reads, got = _infer(metric, X)
    assert reads is None and why in got


def test_a_write_the_metric_catches_still_gives_up():
    def metric(o):
        c = o.clone()
        try:
            c[0, 0, 0] = 1.0  # the tracker's refusal raised inside: swallowed by the metric
        except Exception:  # noqa: BLE001
            pass
        return c[0, 1, 1]

    reads, why = _infer(metric, X)
    assert reads is None and "writes into an output element" in why


def test_two_outputs_each_by_its_name():
    a, b = torch.randn(3, 4), torch.randn(2, 2)
    reads, why = _infer(lambda outs: outs[0][1, 2] + outs[1].sum(), a, b)
    assert _elements(reads, "o0", a.shape) == [6]
    assert all(isinstance(i, slice) for i in reads["o1"])


@pytest.mark.parametrize("kw", [{}, {"batch_sites": True}, {"batch_sites": 2}, {"positions": False}])
def test_auto_equals_the_declared_reads_bit_for_bit_at_the_same_cost(kw):
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    metric = lambda out: (out[:, -1, 3] - out[:, -1, 4]).mean()  # noqa: E731
    declared = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads={"logits": (slice(None), -1, [3, 4])},
                               **kw)
    auto = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads="auto", **kw)
    assert auto.metrics == declared.metrics  # floats, compared exactly
    assert (auto.measured_evaluations, auto.cost) == (declared.measured_evaluations, declared.cost)
    inferred = auto.extra["inferred_reads"]
    assert inferred["rerun_without"] is None and "4 of" in inferred["why"]  # batch 2 x 2 columns
    plain = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    if kw.get("positions") is not False:
        assert auto.cost < plain.cost
    for s in sites:
        assert abs(auto.metrics[s] - plain.metrics[s]) <= 1e-5 * max(1.0, abs(plain.metrics[s]))
    assert rg.patched() == []
    rg.check_invariants()


@pytest.mark.parametrize("kw", [{}, {"batch_sites": True}])
def test_a_metric_whose_reads_depend_on_the_values_reruns_without_reads(kw):
    # The clean run takes the else branch (the last row only); sites that raise the last row's sum take the
    # first and read row 0, outside what was inferred: the read check sees it and the sweep starts again.
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    with torch.no_grad():
        threshold = float(rg.value(rg._output_nodes()[0])[:, -1].sum())

    def metric(out):
        return out[:, 0].sum() if float(out[:, -1].sum()) > threshold else out[:, -1].sum()

    auto = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads="auto", **kw)
    plain = torch_ext.sweep(rg, sites, patch, metric, progress=False, **kw)
    inferred = auto.extra["inferred_reads"]
    assert inferred["reads"] is not None and inferred["rerun_without"] is not None
    assert auto.metrics == plain.metrics
    assert auto.measured_evaluations == plain.measured_evaluations
    assert any(m != pytest.approx(auto.clean_metric) for m in auto.metrics.values())
    rg.check_invariants()


def test_reads_auto_where_every_element_is_read_is_the_plain_sweep():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    sites = sites[:6]
    metric = lambda out: out.sum()  # noqa: E731
    auto = torch_ext.sweep(rg, sites, patch, metric, progress=False, reads="auto")
    plain = torch_ext.sweep(rg, sites, patch, metric, progress=False)
    assert auto.metrics == plain.metrics and auto.cost == plain.cost
    assert auto.extra["inferred_reads"]["reads"] is None


def test_a_reads_string_other_than_auto_is_refused():
    rg, resid, patch, sites = _zoo_sweep_setup("sdpa")
    with pytest.raises(ValueError, match=r"takes a dict, a callable, \"auto\" or None, got 'all'"):
        torch_ext.sweep(rg, sites[:2], patch, lambda o: o.sum(), progress=False, reads="all")
    assert rg.patched() == []
