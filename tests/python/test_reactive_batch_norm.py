"""Train-mode BatchNorm in reactive graphs: sweeps equal eager hooks bit for bit (token-granular rows
included), ``reads=`` works on a graph that also outputs running statistics, and the module's running
statistics are never written by the graph (a sweep is a measurement: TransformerLens-style eager sweeps
update them at every patched forward)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_ext


class _BNSeq(nn.Module):
    """[B, T, C] -> linear -> BatchNorm1d over channels (on the transposed [B, C, T]) -> relu -> linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        h = self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)
        return self.out(torch.relu(h))


def _patch(value, site):
    out = value.clone()
    out[:, site[1]:] = 0.5
    return out


def _metric(out):
    return out[:, -1, 0].sum()


def _eager(model, x, site):
    """The eager forward with the hook's patch, its running statistics put back after (they do not enter a
    train-mode output)."""
    saved = {k: v.clone() for k, v in model.bn.state_dict().items()}
    handle = model.lin.register_forward_hook(lambda m, i, o: _patch(o, site))
    try:
        with torch.no_grad():
            return float(_metric(model(x)))
    finally:
        handle.remove()
        model.bn.load_state_dict(saved)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kwargs", [{}, {"positions": False}, {"reads": {0: (slice(None), -1, 0)}},
                                    {"reads": lambda out: out[:, -1, 0]}])
def test_batch_norm_sweeps_equal_eager_hooks_bit_for_bit(mode, kwargs):
    """Token-granular rows joined the patched rows into a contiguous tensor where the full run hands the batch
    norm a transposed view: a train-mode batch norm (a reduction over the rows) summed in another order and
    the sweep differed from eager in the last bits. And reads= on a train-mode graph: {0: ...} indexed the
    running_mean output (IndexError), a callable was refused with an unclear TypeError."""
    torch.manual_seed(1)
    model, x = getattr(_BNSeq(), mode)(), torch.randn(2, 5, 4)
    rg = torch_ext.ReactiveGraph(model, (x,))
    sites = [("linear", p) for p in range(5)]
    result = torch_ext.sweep(rg, sites, _patch, _metric, progress=False, **kwargs)
    for site in sites:
        assert result.metrics[site] == _eager(model, x, site), site


def test_reads_index_names_a_returned_output_not_a_buffer_update():
    model, x = _BNSeq().train(), torch.randn(2, 5, 4)
    rg = torch_ext.ReactiveGraph(model, (x,))
    with pytest.raises(ValueError, match=r"output index 1 out of range \(the model returns 1 output\)"):
        torch_ext.sweep(rg, [("linear", 0)], _patch, _metric, progress=False, reads={1: (slice(None), -1, 0)})


def test_graph_never_writes_the_running_statistics():
    """Decided: the graph computes the train-mode forward (batch statistics) but never updates the module's
    running statistics, at build, run(), demand() or a sweep: eager forwards (and TransformerLens-style eager
    sweeps, one forward per site) update them each time, so the model would leave a sweep changed by it."""
    model, x = _BNSeq().train(), torch.randn(2, 5, 4)
    before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    rg = torch_ext.ReactiveGraph(model, (x,))
    rg.run(x)
    torch_ext.sweep(rg, [("linear", p) for p in range(5)], _patch, _metric, progress=False)
    rg.patch("linear", lambda v: v * 2)
    rg.demand()
    rg.restore()
    for k, v in model.bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert torch.equal(rg.demand(), model(x))  # the same outputs as the eager forward, which updates them
    assert int(model.bn.num_batches_tracked) == int(before["num_batches_tracked"]) + 1
